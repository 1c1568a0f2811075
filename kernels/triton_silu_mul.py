"""SiLU-and-multiply (the gated MLP activation) as a Triton kernel: programs tile (token, column block).

Contract: `kernels.contracts.check_silu_mul`; semantics and rounding: `kernels.reference.silu_mul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slabserve.kernels._triton_util import Launch, block_size
from slabserve.kernels.contracts import check_silu_mul

_BLOCK_COLS = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the activation dtype before the product, as HF's act_fn(gate) * up does.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_launch(inter: int) -> Launch:
    return Launch({"BLOCK": min(_BLOCK_COLS, block_size(inter))}, 4)


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    check_silu_mul(gate_up, out)
    num_tokens, inter = out.shape
    launch = silu_mul_launch(inter)
    if num_tokens and inter:
        _silu_mul_kernel[(num_tokens, triton.cdiv(inter, launch.constexprs["BLOCK"]))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, **launch.constexprs, num_warps=launch.num_warps,
        )
    return out
