"""The fit check: weights + KV + activations + staging + reserve against a target's memory, and what to change.

Contract: the report functions return text for people: the consumers, largest first, and concrete changes with
the bytes each frees ("2 fewer 8192-token slabs free 1.5 GiB", "dtype: bfloat16 halves the weights: frees ...").
`FitError` carries that text; the CLI prints it and exits non-zero. Pure functions of the numbers given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from slabserve.compiler.slabs import SlabPlan
from slabserve.compiler.spec import GPUS, Spec
from slabserve.runtime.units import format_bytes
from slabserve.runtime import plan as P


class FitError(ValueError):
    """The plan does not fit its target. The message lists consumers and suggested changes."""


@dataclass(frozen=True, slots=True)
class Usage:
    weights: int
    kv: int
    activations: int
    staging: int
    reserve: int
    memory: int
    kv_classes: tuple[tuple[int, int], ...]  # (tokens, count), ascending
    kv_bytes_per_token: int
    dtype: str
    kv_dtype: str
    device: str
    weight_format: str  # the weight arena's format: float (dense, in `dtype`), gguf or q8_0 (blocks)

    @property
    def excess(self) -> int:
        return self.weights + self.kv + self.activations + self.staging + self.reserve - self.memory


def report(spec: Spec, totals: P.Totals, slabs: SlabPlan, weight_format: str) -> str:
    usage = Usage(totals.weights_bytes, totals.kv_bytes, totals.activations_bytes, totals.staging_bytes,
                  totals.reserve_bytes, totals.target_bytes, tuple((c.tokens, c.count) for c in slabs.classes),
                  slabs.kv_bytes_per_token, spec.dtype, spec.kv_dtype, spec.target.device, weight_format)
    head = (f"{spec.source}: the plan does not fit {_target_name(spec)}: it needs {format_bytes(usage.excess)} "
            f"({usage.excess} bytes) more than the target has")
    return "\n".join([head, *consumers(usage), *suggestions(usage, kv_budget_set=spec.kv.budget_bytes is not None)])


def report_without_kv(spec: Spec, weights: int, activations: int, staging: int, kv_bytes_per_token: int,
                      reason: str, weight_format: str) -> str:
    """When not even the KV slabs can be planned in what is left (or listed slabs do not fit their budget)."""
    listed = sum(c.tokens * c.count for c in spec.kv.classes) * kv_bytes_per_token
    usage = Usage(weights, listed, activations, staging, spec.target.reserve_bytes, spec.target.memory_bytes,
                  tuple((c.tokens, c.count) for c in spec.kv.classes), kv_bytes_per_token, spec.dtype,
                  spec.kv_dtype, spec.target.device, weight_format)
    left = spec.target.usable_bytes - weights - activations - staging
    if spec.kv.budget_bytes is not None and spec.kv.budget_bytes < listed:
        head = f"{spec.source}: the listed KV slabs do not fit kv.budget: {reason}"
        need = listed - spec.kv.budget_bytes
    elif listed:
        head = (f"{spec.source}: the plan does not fit {_target_name(spec)}: the listed slabs need "
                f"{format_bytes(listed)}, {format_bytes(max(left, 0))} is left after weights, activations and staging")
        need = usage.excess
    else:
        head = (f"{spec.source}: the plan does not fit {_target_name(spec)}: {format_bytes(max(left, 0))} is left "
                f"for the KV arena after weights, activations and staging\n  slab planner: {reason}")
        largest = max(r.max_need for r in spec.kv.workload.mix) if spec.kv.workload and spec.kv.workload.mix \
            else spec.max_context
        need = max(-left, 0) + min(largest, spec.max_context) * kv_bytes_per_token
    fixes = suggestions(usage, kv_budget_set=spec.kv.budget_bytes is not None, need=need)
    return "\n".join([head, *consumers(usage), *fixes])


def consumers(u: Usage) -> list[str]:
    parts = [("weights", u.weights), ("KV arena", u.kv), ("activations", u.activations),
             ("staging (step inputs, sampler)", u.staging), ("reserve (framework context)", u.reserve)]
    lines = ["  consumers, largest first:"]
    for name, size in sorted(parts, key=lambda p: (-p[1], p[0])):
        lines.append(f"    {name:<32} {format_bytes(size):>12}")
    lines.append(f"    {'target memory':<32} {format_bytes(u.memory):>12}")
    return lines


def suggestions(u: Usage, *, kv_budget_set: bool, need: int | None = None) -> list[str]:
    """Concrete changes, each with the bytes it frees; any one of those that frees `need` bytes makes it fit."""
    need = u.excess if need is None else need
    fixes: list[str] = []
    if u.kv and u.kv_classes:
        hint = fewer_slabs(u.kv_classes, u.kv_bytes_per_token, need)
        if hint:
            fixes.append(f"kv: {hint}" + (" (lower kv.budget to match)" if kv_budget_set else ""))
    if kv_budget_set and u.kv:
        fixes.append(f"kv.budget: lower it by {format_bytes(need)} (the slab planner re-plans under it)")
    if u.dtype == "float32" and u.weight_format == "float":
        fixes.append(f"dtype: bfloat16 halves the weights and activations: frees about "
                     f"{format_bytes((u.weights + u.activations) // 2)}")
    # with the weights in blocks (gguf, q8_0) bfloat16 is no fix: the blocks are multiplied by the float32 CPU
    # kernels only, and `weight_format: auto` would dequantize them to bfloat16, 2 bytes a parameter
    if u.kv_dtype == "float32" and u.kv:
        fixes.append(f"kv_dtype: bfloat16 halves the KV arena: frees {format_bytes(u.kv // 2)}")
    if u.activations > need // 4:
        fixes.append(f"step_tokens: halving it roughly halves the activations ({format_bytes(u.activations)})")
    fixes.append(_bigger_target(u, need))
    return ["  changes that free memory (need " + format_bytes(need) + "):", *("    - " + f for f in fixes)]


def fewer_slabs(classes: Sequence[tuple[int, int]], bytes_per_token: int, excess: int) -> str:
    """The fewest slabs, largest first, whose bytes cover `excess`: `2 fewer 8192-token slabs free 1.5 GiB`."""
    parts, freed = [], 0
    for tokens, count in reversed(classes):
        slab = tokens * bytes_per_token
        drop = min(count, math.ceil((excess - freed) / slab)) if excess > freed else 0
        if drop > 0:
            parts.append(f"{drop} fewer {tokens}-token slabs free {format_bytes(drop * slab)}")
            freed += drop * slab
        if freed >= excess:
            break
    if freed < excess or sum(n for _, n in classes) == sum(int(p.split()[0]) for p in parts):
        return ""  # not even dropping every slab is enough, or it would leave none
    return "; ".join(parts)


def _bigger_target(u: Usage, need: int) -> str:
    if u.device == "cuda":
        for name, size in sorted(GPUS.items(), key=lambda kv: kv[1]):
            if size >= u.memory + need:
                return f"target.gpu: {name} ({format_bytes(size)}) holds it"
        return "target: no single GPU listed holds it; lower the model's size (dtype) or max_context"
    return f"target.memory: raise it by {format_bytes(need)} to {format_bytes(u.memory + need)}"


def _target_name(spec: Spec) -> str:
    t = spec.target
    return f"target {t.gpu}" if t.gpu else f"target {t.device} with {format_bytes(t.memory_bytes)}"


# ---------------------------------------------------------------------------------------------------------------
# A built plan against another target (`slabserve plan verify`)


def check_plan_against(plan: P.Plan, memory_bytes: int, reserve_bytes: int, device: str, label: str
                       ) -> tuple[bool, str]:
    """Whether the plan's arenas fit `memory_bytes` with `reserve_bytes` kept back, and a report either way."""
    t = plan.totals
    u = Usage(t.weights_bytes, t.kv_bytes, t.activations_bytes, t.staging_bytes, reserve_bytes, memory_bytes,
              tuple((c.tokens, c.count) for c in plan.kv.classes), plan.kv.bytes_per_token, plan.engine.dtype,
              plan.engine.kv_dtype, device, plan.engine.weight_format)
    lines = []
    if device != plan.engine.device:
        lines.append(f"note: the plan was built for {plan.engine.device}; its activation layout and graphs are "
                     f"traced for that device")
    if u.excess <= 0:
        lines.append(f"fits {label}: {format_bytes(t.planned_bytes)} planned + {format_bytes(reserve_bytes)} "
                     f"reserve of {format_bytes(memory_bytes)}; headroom {format_bytes(-u.excess)}")
        return True, "\n".join(lines)
    lines.append(f"does not fit {label}: it needs {format_bytes(u.excess)} ({u.excess} bytes) more")
    lines += consumers(u) + suggestions(u, kv_budget_set=False)
    left = memory_bytes - reserve_bytes - t.weights_bytes - t.activations_bytes - t.staging_bytes
    if left > 0:
        key = "target.gpu" if device == "cuda" and label in GPUS else "target"
        lines.append(f"    - or rebuild the plan for it ({key}: {label}): the slab planner then sizes the KV arena "
                     f"to the {format_bytes(left)} left after weights, activations and staging")
    return False, "\n".join(lines)
