"""KV write as a Triton kernel: copy each token's K and V rows into its cache slot, one program per token.

Rows whose slot is -1 (padding) are skipped. Contract: `kernels.contracts.check_kv_write`; semantics:
`kernels.reference.kv_write_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slabserve.kernels._triton_util import Launch, block_size
from slabserve.kernels.contracts import check_kv_write


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, num_kv_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64, so the cache offset below cannot overflow
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offsets = slot * (num_kv_heads * head_dim) + heads * head_dim + dims  # (BLOCK_H, BLOCK_D)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)  # rounded to kv_dtype
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write_launch(num_kv_heads: int, head_dim: int) -> Launch:
    return Launch({"BLOCK_H": block_size(num_kv_heads), "BLOCK_D": block_size(head_dim)}, 4)


def kv_write_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens:
        launch = kv_write_launch(num_kv_heads, head_dim)
        _kv_write_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            num_kv_heads, head_dim, **launch.constexprs, num_warps=launch.num_warps,
        )
