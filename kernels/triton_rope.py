"""RoPE (neox "rotate_half" style) as a Triton kernel, in place on q and k: one program per token.

q and k may be strided views into one fused qkv row; the kernel reads the cos/sin row of the token's position
once and rotates every q and k head with it. Contract: `kernels.contracts.check_rope`; semantics:
`kernels.reference.rope_ref`. Positions must lie in [0, cos_sin.shape[0]) (padding rows use any valid one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slabserve.kernels._triton_util import Launch, block_size
from slabserve.kernels.contracts import check_rope


@triton.jit
def _rotate_heads(base_ptr, stride_head, num_heads, half, cos, sin, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    offsets = heads[:, None] * stride_head + dims[None, :]  # (BLOCK_H, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)
    x1 = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base_ptr + offsets + half, mask=mask, other=0.0).to(tl.float32)
    out_ty = base_ptr.dtype.element_ty
    tl.store(base_ptr + offsets, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=mask)
    tl.store(base_ptr + offsets + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 num_heads, num_kv_heads, half, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)
    row_ptr = cos_sin_ptr + position * (2 * half)
    cos = tl.load(row_ptr + dims, mask=dims < half, other=0.0)
    sin = tl.load(row_ptr + half + dims, mask=dims < half, other=0.0)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, half, cos, sin, BLOCK_HK, BLOCK_HALF)


def rope_launch(num_heads: int, num_kv_heads: int, head_dim: int) -> Launch:
    return Launch({"BLOCK_HQ": block_size(num_heads), "BLOCK_HK": block_size(num_kv_heads),
                   "BLOCK_HALF": block_size(head_dim // 2)}, 4)


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                workspace: torch.Tensor | None = None) -> None:
    """`workspace` matches the reference's signature; the kernel rotates in registers."""
    check_rope(q, k, positions, cos_sin)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens:
        launch = rope_launch(num_heads, k.shape[1], head_dim)
        _rope_kernel[(num_tokens,)](
            q, k, positions, cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            num_heads, k.shape[1], head_dim // 2, **launch.constexprs, num_warps=launch.num_warps,
        )
