"""The GPUs a plan can target, by what the server can check on the machine it starts on.

Contract: `GPU_KINDS` maps each name a spec's `target.gpu` may use to its compute capability and its memory as
`nvidia-smi --query-gpu=memory.total` reports it; a plan records what its target needs from that
(runtime.plan.Requirements). `device_mismatch(...)` says why the device at hand cannot serve it (None when it can),
from what `torch.cuda.get_device_properties` reports, never from the marketing name (`get_device_name()` says
"NVIDIA H100 80GB HBM3" or "NVIDIA H200", which no spec name is a substring of). `version_mismatch` compares
the major.minor of two versions, ignoring local build tags ("+cpu").
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


def device_mismatch(capability_needed: tuple[int, ...] | None, memory_needed: int, capability: tuple[int, int],
                    total_memory: int) -> str | None:
    """Why a device of `capability` and `total_memory` bytes (torch.cuda.get_device_properties) cannot serve a plan
    that needs `capability_needed` (None: any) and `memory_needed` bytes (its arenas and reserve), or None. The
    memory is compared with MEMORY_TOLERANCE, since plans for a GPU of the table are sized by nvidia-smi's
    figure, a little above torch's."""
    if capability_needed is not None and tuple(capability) != tuple(capability_needed):
        return (f"compute capability {capability[0]}.{capability[1]}, the plan needs "
                f"{'.'.join(map(str, capability_needed))}")
    if total_memory < memory_needed * (1 - MEMORY_TOLERANCE):
        return (f"{total_memory / MIB:,.0f} MiB of memory, the plan needs {memory_needed / MIB:,.0f} MiB (its arenas "
                f"and reserve)")
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
