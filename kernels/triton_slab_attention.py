"""Slab attention as Triton kernels: chunked prefill over flat rows, and split-context (flash) decoding.

Both read each sequence's slab as one contiguous range of cache rows, with no block table. Semantics and the
padding rules are those of `kernels.reference` (rows that see no key get zeros); contracts are in
`kernels.contracts`. Grids depend on tensor shapes only (never on metadata values), so both launches are
CUDA-graph capturable.

GQA: a program owns one kv head and stacks the GROUP = H / Hkv query heads that share it along the M dim of
its tile, so each K/V tile is loaded once for the whole group. Softmax runs online in log2 units (exp2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slabserve.kernels._triton_util import Launch, block_size, dot_precision
from slabserve.kernels.contracts import check_slab_decode_attention, check_slab_prefill_attention
from slabserve.kernels.workspace import decode_workspace_shape, new_decode_workspace

LOG2_E = 1.4426950408889634
_PREFILL_BLOCK_M = 64  # query rows per tile: BLOCK_M // GROUP tokens times GROUP heads
_BLOCK_N = 64  # keys per tile
_DECODE_BLOCK_N = 32  # keys per tile of the split decode kernel (decode_split_launch)


@triton.jit
def _online_softmax_step(q, k_cache_ptr, v_cache_ptr, key_offsets, key_mask, dims, dim_mask, allowed,
                         m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running (max, sum, acc).

    key_offsets (BLOCK_N,): element offsets of the tile's cache rows (kv head included); `allowed`
    (BLOCK_M, BLOCK_N) says which key each query row may see.
    """
    tile_offsets = key_offsets[:, None] + dims[None, :]  # (BLOCK_N, BLOCK_D), contiguous along D
    tile_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + tile_offsets, mask=tile_mask, other=0.0).to(q.dtype)  # the cache's kv_dtype, widened
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet must not produce NaN
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_cache_ptr + tile_offsets, mask=tile_mask, other=0.0).to(q.dtype)  # (BLOCK_N, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _find_sequence(query_start_ptr, num_seqs, block_idx, BLOCK_Q: tl.constexpr):
    """Largest s in [0, num_seqs] with query_start[s] // BLOCK_Q + s <= block_idx (binary search).

    Sequence s owns grid blocks query_start[s] // BLOCK_Q + s + [0, cdiv(q_len_s, BLOCK_Q)); these ranges do
    not overlap, and s = num_seqs stands for the padding rows past query_start[num_seqs].
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= block_idx
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    return lo


@triton.jit
def _slab_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, slab_offset_ptr,
                         context_len_ptr, num_seqs, num_tokens, scale_log2, stride_qt, stride_qh, stride_ot,
                         stride_oh, stride_cache_row, head_dim, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, SKIP_DECODE: tl.constexpr):
    """SKIP_DECODE: sequences of exactly one row are left to the split decode kernels (trailing padding rows,
    s == num_seqs, are always done here)."""
    block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    # 1) which sequence and which of its query blocks this program owns (s == num_seqs: trailing padding)
    s = _find_sequence(query_start_ptr, num_seqs, block_idx, BLOCK_Q)
    is_padding = s == num_seqs
    meta = tl.minimum(s, num_seqs - 1)
    q_begin = tl.load(query_start_ptr + s)
    q_end = tl.where(is_padding, num_tokens, tl.load(query_start_ptr + meta + 1))
    q_len = q_end - q_begin
    context = tl.where(is_padding, 0, tl.load(context_len_ptr + meta))
    context = tl.where(context < q_len, 0, context)  # padding sequence: no key is visible
    first_query = (block_idx - (q_begin // BLOCK_Q + s)) * BLOCK_Q
    if first_query >= q_len:
        return
    if SKIP_DECODE:
        if (q_len == 1) & (s < num_seqs):
            return
    # 2) tile rows: BLOCK_Q tokens x GROUP heads of one kv head
    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // GROUP  # (BLOCK_M,) index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows // GROUP < BLOCK_Q) & (query < q_len)
    position = context - q_len + query  # absolute position; negative when no key is visible
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    token = q_begin + query
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    # 3) online softmax over the keys the last query of the block can see
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slab_base = tl.load(slab_offset_ptr + meta) * stride_cache_row + kv_head * head_dim  # int64
    kv_end = context - q_len + tl.minimum(q_len, first_query + BLOCK_Q)
    for start in range(0, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < kv_end
        allowed = (keys[None, :] <= position[:, None]) & key_mask[None, :]  # causal within the chunk
        m_i, l_i, acc = _online_softmax_step(
            q, k_cache_ptr, v_cache_ptr, slab_base + keys * stride_cache_row, key_mask, dims, dim_mask, allowed,
            m_i, l_i, acc, scale_log2, DOT_PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _slab_decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, slab_offset_ptr, context_len_ptr, workspace_ptr,
                              query_start_ptr, scale_log2, stride_qs, stride_qh, stride_cache_row, head_dim,
                              NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              FROM_QUERY_START: tl.constexpr):
    """Partial attention of one (sequence, kv head, context chunk) into workspace[s, heads, split].

    FROM_QUERY_START: q holds a step's flat rows; sequence s is attended here only when it has exactly one row
    (query_start[s + 1] - query_start[s] == 1, its row query_start[s]), else the program does nothing (the
    prefill kernel takes it). Otherwise q holds one row per sequence."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = seq
    context = tl.load(context_len_ptr + seq)
    if FROM_QUERY_START:
        row = tl.load(query_start_ptr + seq)
        # not a one-row sequence: attend no key (the reduce skips it). An early return here made the compiler
        # keep 8 bytes of stack a thread.
        context = tl.where(tl.load(query_start_ptr + seq + 1) - row == 1, context, 0)
    chunk = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole key tiles per split
    lo = split * chunk
    hi = tl.minimum(context, lo + chunk)
    rows = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qs + head[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slab_base = tl.load(slab_offset_ptr + seq) * stride_cache_row + kv_head * head_dim  # int64
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < hi
        m_i, l_i, acc = _online_softmax_step(
            q, k_cache_ptr, v_cache_ptr, slab_base + keys * stride_cache_row, key_mask, dims, dim_mask,
            tl.broadcast_to(key_mask[None, :], [BLOCK_G, BLOCK_N]), m_i, l_i, acc, scale_log2, DOT_PRECISION)
    # Every program writes its slot, empty chunks included (max -inf, sum 0): the workspace is reused.
    width = head_dim + 2
    slot = workspace_ptr + ((seq * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split) * width  # (BLOCK_G,)
    tl.store(slot[:, None] + dims[None, :], acc, mask=row_mask[:, None] & dim_mask[None, :])
    tl.store(slot + head_dim, m_i, mask=row_mask)
    tl.store(slot + head_dim + 1, l_i, mask=row_mask)


@triton.jit
def _slab_decode_reduce_kernel(workspace_ptr, out_ptr, query_start_ptr, stride_os, stride_oh, head_dim,
                               NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                               FROM_QUERY_START: tl.constexpr):
    """Combine the split partials of one (sequence, head); a row with no key (context 0) gets zeros.
    FROM_QUERY_START: as for the split kernel (the output row is query_start[s])."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq
    if FROM_QUERY_START:
        row = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) - row != 1:
            return
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    width = head_dim + 2
    base = workspace_ptr + ((seq * tl.num_programs(1) + head) * NUM_SPLITS + splits) * width  # (BLOCK_SPLITS,)
    m = tl.load(base + head_dim, mask=split_mask, other=float("-inf"))
    l = tl.load(base + head_dim + 1, mask=split_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for empty splits
    total = tl.sum(weight * l, axis=0)
    acc = tl.load(base[:, None] + dims[None, :], mask=split_mask[:, None] & (dims < head_dim)[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # (BLOCK_D,)
    tl.store(out_ptr + row.to(tl.int64) * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


def prefill_launch(group: int, head_dim: int, dtype: torch.dtype, skip_decode: bool = False) -> Launch:
    """BLOCK_M rows per tile (BLOCK_Q tokens x GROUP query heads of one kv head). 4 warps hold a 64 x 64 tile in
    half precision; wider tiles, and fp32 (exact fp32 dots), need more registers than 4 warps have (sm_90: 255 a
    thread; compiled with 4 they spilled 144 bytes a thread at head_dim 128 in bf16, 1,448 at head_dim 64 in fp32),
    so they get 8, and fp32 also takes 32 keys a tile (8 warps still spilled 376 bytes with 64). CI compiles every
    model's launch for sm_90 and fails on any spill (tests/test_kernels.py)."""
    block_m = max(_PREFILL_BLOCK_M, block_size(group))
    block_d = block_size(head_dim, 16)
    exact = dtype == torch.float32
    return Launch({"GROUP": group, "BLOCK_M": block_m, "BLOCK_Q": block_m // group,
                   "BLOCK_N": _BLOCK_N // 2 if exact else _BLOCK_N, "BLOCK_D": block_d,
                   "DOT_PRECISION": dot_precision(dtype), "SKIP_DECODE": skip_decode},
                  4 if block_d <= 64 and not exact else 8)


def decode_split_launch(group: int, head_dim: int, num_splits: int, dtype: torch.dtype,
                        from_query_start: bool = False) -> Launch:
    """One kv head's GROUP query rows against a split of its keys, 32 keys a tile; 8 warps past 64 dims. Measured
    on the sm_90 compile (registers, stack a thread, bf16): with 64-key tiles, 4 warps kept 8 bytes of stack at
    head_dim 64 once the rows came from query_start, and 120 at head_dim 128; 32-key tiles take 120 registers
    and no stack at 64 dims (4 warps), 148 at 128 (8 warps). Decode reads memory; the smaller tile costs no
    bandwidth."""
    block_d = block_size(head_dim, 16)
    return Launch({"NUM_SPLITS": num_splits, "GROUP": group, "BLOCK_G": block_size(group, 16),
                   "BLOCK_N": _DECODE_BLOCK_N, "BLOCK_D": block_d, "DOT_PRECISION": dot_precision(dtype),
                   "FROM_QUERY_START": from_query_start}, 4 if block_d <= 64 else 8)


def decode_reduce_launch(head_dim: int, num_splits: int, from_query_start: bool = False) -> Launch:
    return Launch({"NUM_SPLITS": num_splits, "BLOCK_SPLITS": block_size(num_splits), "BLOCK_D": block_size(head_dim),
                   "FROM_QUERY_START": from_query_start}, 4)


def slab_prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  query_start: torch.Tensor, slab_offset: torch.Tensor,
                                  context_len: torch.Tensor, scale: float, out: torch.Tensor,
                                  workspace: torch.Tensor | None = None) -> torch.Tensor:
    """slabserve::slab_attention on CUDA. With a decode workspace (S, H, splits, D + 2) (the step passes one,
    sized by kernels.workspace for its longest slab), sequences of one row go to the split decode kernels and the
    others to the chunked-prefill kernel: three launches whose grids depend on shapes only, each program reading
    query_start on the device to see whether the sequence is its own, so the choice costs no host sync and is
    captured in the CUDA graph as it is. Without one, the prefill kernel does every row."""
    check_slab_prefill_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, out, workspace)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = slab_offset.shape[0], k_cache.shape[1]
    split_decode = workspace is not None and workspace.dim() == 4
    launch = prefill_launch(num_heads // num_kv_heads, head_dim, q.dtype, skip_decode=split_decode)
    if num_tokens == 0:
        return out
    if split_decode:
        _decode_launches(q, k_cache, v_cache, slab_offset, context_len, scale, out, workspace, query_start)
    grid = (triton.cdiv(num_tokens, launch.constexprs["BLOCK_Q"]) + num_seqs, num_kv_heads)  # see _find_sequence
    _slab_prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start, slab_offset, context_len, num_seqs, num_tokens, scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), head_dim,
        **launch.constexprs, num_warps=launch.num_warps,
    )
    return out


def slab_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slab_offset: torch.Tensor, context_len: torch.Tensor, scale: float,
                                 out: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
    check_slab_decode_attention(q, k_cache, v_cache, slab_offset, context_len, out, workspace)
    num_seqs, num_heads, head_dim = q.shape
    if workspace is None:  # no plan: size the splits for the longest slab the arena could hold
        spec = decode_workspace_shape(num_seqs, num_heads, head_dim, max_context=k_cache.shape[0])
        workspace = new_decode_workspace(spec, q.device)
    _decode_launches(q, k_cache, v_cache, slab_offset, context_len, scale, out, workspace, None)
    return out


def _decode_launches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slab_offset: torch.Tensor,
                     context_len: torch.Tensor, scale: float, out: torch.Tensor, workspace: torch.Tensor,
                     query_start: torch.Tensor | None) -> None:
    """The split and reduce launches over every sequence slot; with `query_start`, q and out are a step's flat
    rows and only one-row sequences are attended (FROM_QUERY_START)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs, num_kv_heads, num_splits = slab_offset.shape[0], k_cache.shape[1], workspace.shape[2]
    rows = query_start is not None
    split = decode_split_launch(num_heads // num_kv_heads, head_dim, num_splits, q.dtype, from_query_start=rows)
    _slab_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, slab_offset, context_len, workspace, query_start if rows else slab_offset,
        scale * LOG2_E, q.stride(0), q.stride(1), k_cache.stride(0), head_dim, **split.constexprs,
        num_warps=split.num_warps,
    )
    reduce = decode_reduce_launch(head_dim, num_splits, from_query_start=rows)
    _slab_decode_reduce_kernel[(num_seqs, num_heads)](
        workspace, out, query_start if rows else slab_offset, out.stride(0), out.stride(1), head_dim,
        **reduce.constexprs, num_warps=reduce.num_warps,
    )
