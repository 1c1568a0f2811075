"""The GPUs a plan can target, by what the server can check on the machine it starts on.

Contract: `GPU_KINDS` maps each name a spec's `target.gpu` may use to its compute capability and its memory as
`nvidia-smi --query-gpu=memory.total` reports it. `gpu_mismatch(name, capability, total_memory)` says why the
device at hand is not that kind (None when it is), from what `torch.cuda.get_device_properties` reports, never from
the marketing name (`get_device_name()` says "NVIDIA H100 80GB HBM3" or "NVIDIA H200", which no spec name is a
substring of). `version_mismatch` compares the major.minor of two versions, ignoring local build tags ("+cpu").
"""
from __future__ import annotations

from dataclasses import dataclass

MIB = 1024**2
MEMORY_TOLERANCE = 0.05  # torch's total_memory reads a little below nvidia-smi's (driver and ECC reservations);
                         # 5% still tells every pair of kinds in the table apart


@dataclass(frozen=True, slots=True)
class GpuKind:
    capability: tuple[int, int]  # (major, minor): the kernels are compiled for sm_<major><minor>
    memory_bytes: int


GPU_KINDS: dict[str, GpuKind] = {
    "L4-24GB": GpuKind((8, 9), 23034 * MIB),
    "A100-40GB": GpuKind((8, 0), 40960 * MIB),
    "A100-80GB": GpuKind((8, 0), 81920 * MIB),
    "H100-80GB": GpuKind((9, 0), 81559 * MIB),
    "H200-141GB": GpuKind((9, 0), 143771 * MIB),
}


def gpu_mismatch(name: str, capability: tuple[int, int], total_memory: int) -> str | None:
    """Why a device of `capability` and `total_memory` bytes is not a `name` (a key of GPU_KINDS), or None."""
    kind = GPU_KINDS.get(name)
    if kind is None:
        return f"{name!r} is not a known GPU ({', '.join(GPU_KINDS)})"
    if tuple(capability) != kind.capability:
        return (f"compute capability {capability[0]}.{capability[1]}, the plan's {name} has "
                f"{kind.capability[0]}.{kind.capability[1]}")
    if total_memory < kind.memory_bytes * (1 - MEMORY_TOLERANCE):
        return (f"{total_memory / MIB:,.0f} MiB of memory, the plan's {name} has {kind.memory_bytes / MIB:,.0f} "
                f"MiB")
    return None


def major_minor(version: str) -> tuple[int, ...]:
    """"2.11.0+cu130" -> (2, 11); "3.6.0" -> (3, 6)."""
    numbers = []
    for part in version.split("+", 1)[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers)


def version_mismatch(installed: str | None, planned: str | None) -> bool:
    """Whether an installed version differs from the plan's in major.minor (None: not installed / not recorded)."""
    if planned is None:
        return False
    return installed is None or major_minor(installed) != major_minor(planned)
