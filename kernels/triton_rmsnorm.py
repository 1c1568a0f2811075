"""RMSNorm as a Triton kernel: one program per token row, fp32 statistics.

Contract: `kernels.contracts.check_rms_norm`; semantics and rounding: `kernels.reference.rms_norm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slabserve.kernels._triton_util import Launch, block_size
from slabserve.kernels.contracts import check_rms_norm


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, stride_out, hidden, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    # Round to the activation dtype before the weight multiply, as HF Llama (and the reference) do.
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(hidden: int) -> Launch:
    return Launch({"BLOCK_N": block_size(hidden)}, 4 if hidden <= 4096 else 8)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                    workspace: torch.Tensor | None = None) -> torch.Tensor:
    """`workspace` matches the reference's signature; the kernel keeps its statistics in registers."""
    check_rms_norm(x, weight, out)
    num_tokens, hidden = x.shape
    if num_tokens:
        launch = rms_norm_launch(hidden)
        _rms_norm_kernel[(num_tokens,)](x, weight, out, x.stride(0), out.stride(0), hidden, eps,
                                        **launch.constexprs, num_warps=launch.num_warps)
    return out
