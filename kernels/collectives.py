"""The step's one collective: the tensor-parallel all-reduce, as the `slabserve::all_reduce_residual` op.

In a tensor-parallel step (runtime/tensor_parallel.py) each rank holds a slice of the attention heads and of the
MLP's columns, so the outputs of o_proj and down_proj are partial sums over the ranks. The op sums them in place
across the process group and then adds the residual stream:

    out[:n] = sum over ranks of out[:n], then out[:n] += residual[:n]

`n` is every row of `out`, or with `rows` (the step's query_start, kernels.ops: ROWS) its real rows only, read at
each call: a CPU step sends its tokens over the wire, not its bucket. The sum writes into `out` itself, a planned
buffer of the activation arena, so a collective adds no storage to the plan; on CUDA the NCCL all-reduce runs inside
the bucket's graph. Every rank adds the same residual after the sum, so the ranks stay bit-identical, and the
result differs from one device only by the order of the sum.

The process group is set once per process (`set_group`) before the first step; the op refuses to run without one,
rather than return a partial sum. The fake implementation checks the contract on metadata alone, so the step traces
on meta weights (the compiler) and under fake tensors (the engine's own trace) without a group.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

_GROUP = None  # the torch.distributed ProcessGroup of this process's tensor-parallel ranks


def set_group(group) -> None:
    """The process group every all_reduce_residual of this process sums over (None: none)."""
    global _GROUP
    _GROUP = group


def group():
    return _GROUP


def _check(out: Tensor, residual: Tensor, rows: Optional[Tensor]) -> None:
    if out.dim() != 2 or residual.shape != out.shape or residual.dtype != out.dtype:
        raise ValueError(f"slabserve::all_reduce_residual: out {tuple(out.shape)} {out.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} must be the same (T, hidden) shape and dtype")
    if not out.is_contiguous():
        raise ValueError("slabserve::all_reduce_residual: out must be contiguous (the collective sends its bytes)")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int32 or rows.shape[0] < 1):
        raise ValueError(f"slabserve::all_reduce_residual: rows must be the step's query_start, a 1-D int32 "
                         f"tensor; got {tuple(rows.shape)} {rows.dtype}")


def prepare_all_reduce_residual(out: Tensor, residual: Tensor, rows: Optional[Tensor] = None) -> Callable[[], None]:
    """Check once and bind: `run()` sums `out` over the group and adds `residual`, over the real rows when `rows`
    is given (its last value, read at each call)."""
    _check(out, residual, rows)
    import torch.distributed as dist

    if _GROUP is None:
        raise RuntimeError("slabserve::all_reduce_residual: this step is one rank of a tensor-parallel plan and no "
                           "process group is set (kernels.collectives.set_group); serve it with `slabserve serve`")
    group = _GROUP
    total = out.shape[0]

    def run() -> None:
        n = total if rows is None else int(rows[-1])
        if n <= 0:
            return
        part = out[:n] if n < total else out
        dist.all_reduce(part, group=group)
        part.add_(residual[:n] if n < total else residual)

    return run


@torch.library.custom_op("slabserve::all_reduce_residual", mutates_args=("out",), device_types=("cpu", "cuda"))
def _all_reduce_residual_op(out: Tensor, residual: Tensor, rows: Optional[Tensor] = None) -> None:
    prepare_all_reduce_residual(out, residual, rows if out.device.type == "cpu" else None)()


@_all_reduce_residual_op.register_fake
def _all_reduce_residual_fake(out: Tensor, residual: Tensor, rows: Optional[Tensor] = None) -> None:
    _check(out, residual, rows)


def all_reduce_residual(out: Tensor, residual: Tensor, rows: Optional[Tensor] = None) -> Tensor:
    """out (T, hidden) summed over the tensor-parallel group, plus residual (T, hidden); returns out."""
    torch.ops.slabserve.all_reduce_residual(out, residual, rows)
    return out
