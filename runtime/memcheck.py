"""The start-up memory check: a plan that does not fit the memory free here is refused before anything is allocated.

Contract: `free_memory(device, limit_bytes)` says how many bytes the server may still take, and where that figure
comes from: on CPU `MemAvailable` in /proc/meminfo, on CUDA the device's free memory (`torch.cuda.mem_get_info`).
An operator's limit (`slabserve serve --memory-limit`, a container's share, say) caps it: on CPU the process may
hold at most `limit_bytes` in all, so what it holds already (VmRSS: the interpreter, torch, the tokenizer) comes off
the limit; on CUDA the arenas may take at most `limit_bytes` of the device. `check_plan_fits(plan, free)` raises
`InsufficientMemoryError` when the plan's planned bytes (weights + KV + activations + staging: what
`Engine.from_plan` allocates) exceed that figure; its message gives what is needed, what is free, the shortfall and
which numbers of the spec to change, and by how much.

Why at start: CPU arenas are allocated lazily by the OS, so a plan that does not fit would otherwise start, pass
warm-up and be killed for memory later, under traffic. This module reads the plan (runtime.plan) and /proc; it
imports torch only for a CUDA plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from slabserve.runtime.plan import Plan
from slabserve.runtime.units import format_bytes, parse_bytes


class InsufficientMemoryError(RuntimeError):
    """The plan needs more memory than is free; the message has the figures and the fixes."""


@dataclass(frozen=True, slots=True)
class FreeMemory:
    free_bytes: int  # may be below zero: an operator's limit below what the process already holds
    source: str      # where the figure comes from, for the error message
    limit_bytes: int | None = None  # the operator's limit, when it is what bounds the figure


def parse_size(text: str) -> int:
    """`8GiB`, `512 MiB`, `4000000000` (bytes) -> bytes, in the serving spec's spellings (runtime.units);
    ValueError names the allowed units."""
    text = text.strip()
    return parse_bytes(int(text) if text.isdigit() else text)


def _exact(num_bytes: int) -> str:
    return f"{format_bytes(num_bytes)} ({num_bytes} bytes)"


def _meminfo_kib(field: str, path: Path = Path("/proc/meminfo")) -> int:
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            return int(rest.split()[0])
    raise OSError(f"{path} has no {field} line")


def resident_bytes(pid: int | str = "self") -> int:
    """The process's resident memory (VmRSS of /proc/<pid>/status), in bytes."""
    return _meminfo_kib("VmRSS", Path(f"/proc/{pid}/status")) * 1024


def free_memory(device: str, limit_bytes: int | None = None) -> FreeMemory:
    """What the plan's arenas may take on `device` ("cpu" or "cuda"); see the module docstring."""
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        figure = FreeMemory(free, "free on the CUDA device (torch.cuda.mem_get_info)")
        if limit_bytes is not None and limit_bytes < free:
            figure = FreeMemory(limit_bytes, f"--memory-limit {format_bytes(limit_bytes)}", limit_bytes)
        return figure
    try:
        figure = FreeMemory(_meminfo_kib("MemAvailable") * 1024, "MemAvailable in /proc/meminfo")
    except OSError:  # not Linux: nothing to measure, so only an operator's limit can refuse
        figure = FreeMemory(1 << 62, "no /proc/meminfo on this system")
    if limit_bytes is not None:
        held = resident_bytes()
        if limit_bytes - held < figure.free_bytes:
            figure = FreeMemory(limit_bytes - held, f"--memory-limit {format_bytes(limit_bytes)} less the "
                                                    f"{format_bytes(held)} this process already holds", limit_bytes)
    return figure


def check_plan_fits(plan: Plan, free: FreeMemory) -> None:
    """Raise InsufficientMemoryError when the plan's planned bytes exceed `free`."""
    t = plan.totals
    short = t.planned_bytes - free.free_bytes
    if short <= 0:
        return
    fixes = []
    if short < t.planned_bytes:  # otherwise not even an empty plan would fit
        fixes.append(f"shrink the plan by at least {_exact(short)} and rebuild it with build-plan "
                     f"({_kv_fix(plan, short)})")
    if free.limit_bytes is not None:
        fixes.append(f"raise --memory-limit to at least {format_bytes(free.limit_bytes + short)} "
                     f"({free.limit_bytes + short} bytes)")
    else:
        fixes.append("serve it where more memory is free")
    raise InsufficientMemoryError(
        f"plan {plan.name!r} needs {format_bytes(t.planned_bytes)} ({t.planned_bytes} bytes: weights "
        f"{format_bytes(t.weights_bytes)}, KV {format_bytes(t.kv_bytes)}, activations "
        f"{format_bytes(t.activations_bytes)}, staging {format_bytes(t.staging_bytes)}) but "
        f"{_exact(max(free.free_bytes, 0))} is free ({free.source}): {'; or '.join(fixes)}")


def _kv_fix(plan: Plan, short: int) -> str:
    """The spec change that frees `short` bytes of KV, if the KV arena alone can."""
    kv = plan.kv
    if "workload" in plan.spec.get("kv", {}):
        if kv.arena_bytes > short:
            return f"kv.budget: {kv.arena_bytes - short} or less, and the compiler plans fewer slabs"
        return f"the KV arena ({format_bytes(kv.arena_bytes)}) alone cannot free that much"
    for entry in sorted(kv.classes, key=lambda c: -c.tokens):  # the largest slabs free the most per slab
        slab_bytes = entry.tokens * kv.bytes_per_token
        fewer = math.ceil(short / slab_bytes)
        if fewer < entry.count:
            return (f"kv.classes: {fewer} fewer {entry.tokens}-token slabs, count {entry.count} -> "
                    f"{entry.count - fewer}, free {format_bytes(fewer * slab_bytes)}")
    return (f"no one slab class frees that much: fewer or smaller kv.classes (the KV arena is "
            f"{format_bytes(kv.arena_bytes)}), a smaller kv_dtype, fewer step_tokens or a smaller model")
