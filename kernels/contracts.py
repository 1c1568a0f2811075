"""Shape, dtype, stride and device contracts of the kernel ops.

One check per op, shared by the Triton wrappers, the PyTorch references and the fake implementations that
`torch.export` runs, so every path rejects the same bad call with the same message. The checks read tensor
metadata only (never data), so they are cheap and work on fake and meta tensors.

A failed check raises `ValueError` naming the op, the argument, and what was expected.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _expect_shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _expect_dtype(op: str, name: str, t: torch.Tensor, dtypes: tuple) -> None:
    if t.dtype not in dtypes:
        _fail(op, f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")


def _expect_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} needs a contiguous last dim, got strides {t.stride()}")


def _expect_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def _expect_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        _fail(op, f"tensors on different devices: {devices}")


def _expect_activation(op: str, name: str, t: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> None:
    """A float tensor of `dim` dims, last dim contiguous, optionally of a given dtype."""
    if t.dim() != dim:
        _fail(op, f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    _expect_dtype(op, name, t, FLOAT_DTYPES if dtype is None else (dtype,))
    _expect_last_dim_contiguous(op, name, t)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    op = "rms_norm"
    _expect_activation(op, "x", x, 2)
    num_tokens, hidden = x.shape
    _expect_shape(op, "weight", weight, (hidden,))
    _expect_dtype(op, "weight", weight, FLOAT_DTYPES)
    _expect_contiguous(op, "weight", weight)
    _expect_activation(op, "out", out, 2, x.dtype)
    _expect_shape(op, "out", out, (num_tokens, hidden))
    _expect_same_device(op, x=x, weight=weight, out=out)


def check_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    op = "rope"
    _expect_activation(op, "q", q, 3)
    _expect_activation(op, "k", k, 3, q.dtype)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        _fail(op, f"head_dim must be even, got {head_dim}")
    _expect_shape(op, "k", k, (num_tokens, k.shape[1], head_dim))
    _expect_shape(op, "positions", positions, (num_tokens,))
    _expect_dtype(op, "positions", positions, (torch.int64,))
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        _fail(op, f"cos_sin must be (max_position, {head_dim}), got {tuple(cos_sin.shape)}")
    _expect_dtype(op, "cos_sin", cos_sin, (torch.float32,))
    _expect_contiguous(op, "cos_sin", cos_sin)
    _expect_same_device(op, q=q, k=k, positions=positions, cos_sin=cos_sin)


def check_silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    op = "silu_mul"
    _expect_activation(op, "gate_up", gate_up, 2)
    num_tokens, two_inter = gate_up.shape
    if two_inter % 2:
        _fail(op, f"gate_up's last dim must be even (gate then up), got {two_inter}")
    _expect_activation(op, "out", out, 2, gate_up.dtype)
    _expect_shape(op, "out", out, (num_tokens, two_inter // 2))
    _expect_same_device(op, gate_up=gate_up, out=out)


# Keys per tile of a tiled K cache. A CPU engine's K cache is (num_rows / KV_TILE, num_kv_heads, head_dim, KV_TILE):
# the KV_TILE keys of a tile side by side for each (kv head, dimension), so that the native attention
# (kernels/cpu_native.c) computes each key's score in its own vector lane. V stays (num_rows, num_kv_heads,
# head_dim), and so does K on CUDA, where the Triton kernels read rows.
KV_TILE = 16


def k_tiled(k_cache: torch.Tensor) -> bool:
    """Whether one layer's K cache is tiled: (num_rows / KV_TILE, num_kv_heads, head_dim, KV_TILE)."""
    return k_cache.dim() == 4


def kv_cache_rows(k_cache: torch.Tensor) -> int:
    """The cache rows (token slots) of one layer's K cache, tiled or not."""
    return k_cache.shape[0] * KV_TILE if k_tiled(k_cache) else k_cache.shape[0]


def k_cache_shape(rows_shape: tuple[int, ...], tiled: bool) -> tuple[int, ...]:
    """The K cache's shape for caches of `rows_shape` (..., num_rows, num_kv_heads, head_dim): as it is, or tiled
    (num_rows a multiple of KV_TILE)."""
    if not tiled:
        return tuple(rows_shape)
    *lead, rows, heads, dim = rows_shape
    if rows % KV_TILE:
        raise ValueError(f"a tiled K cache needs a multiple of {KV_TILE} rows, got {rows}")
    return (*lead, rows // KV_TILE, heads, dim, KV_TILE)


def k_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """One layer's K cache as rows (num_rows, num_kv_heads, head_dim): itself, or a tiled cache's rows copied out
    (for the reference kernels and tests, never a step of the native path)."""
    if not k_tiled(k_cache):
        return k_cache
    tiles, heads, dim, _ = k_cache.shape
    return k_cache.permute(0, 3, 1, 2).reshape(tiles * KV_TILE, heads, dim)


def k_tiles(k_rows_: torch.Tensor) -> torch.Tensor:
    """Rows (num_rows, num_kv_heads, head_dim), num_rows a multiple of KV_TILE, as a new tiled K cache."""
    rows, heads, dim = k_rows_.shape
    return k_rows_.reshape(rows // KV_TILE, KV_TILE, heads, dim).permute(0, 2, 3, 1).contiguous()


def _check_kv_cache_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The caches' dtype is the plan's kv_dtype, which may differ from the activations': kv_write rounds into it
    and attention widens out of it. K may be tiled (KV_TILE)."""
    if k_cache.dim() == 4:
        if k_cache.shape[3] != KV_TILE:
            _fail(op, f"a tiled k_cache must be (num_rows / {KV_TILE}, num_kv_heads, head_dim, {KV_TILE}), got "
                      f"{tuple(k_cache.shape)}")
    elif k_cache.dim() != 3:
        _fail(op, f"k_cache must be (num_rows, num_kv_heads, head_dim) or tiled (num_rows / {KV_TILE}, "
                  f"num_kv_heads, head_dim, {KV_TILE}), got {tuple(k_cache.shape)}")
    _expect_shape(op, "v_cache", v_cache, (kv_cache_rows(k_cache), k_cache.shape[1], k_cache.shape[2]))
    _expect_dtype(op, "k_cache", k_cache, FLOAT_DTYPES)
    _expect_dtype(op, "v_cache", v_cache, (k_cache.dtype,))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _expect_contiguous(op, name, cache)


def check_kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    op = "kv_write"
    _expect_activation(op, "k", k, 3)
    _expect_activation(op, "v", v, 3, k.dtype)
    _expect_shape(op, "v", v, tuple(k.shape))
    _check_kv_cache_pair(op, k_cache, v_cache)
    _expect_shape(op, "k_cache", k_cache, (*k_cache.shape[:1], k.shape[1], k.shape[2], *k_cache.shape[3:]))
    _expect_shape(op, "slot_mapping", slot_mapping, (k.shape[0],))
    _expect_dtype(op, "slot_mapping", slot_mapping, (torch.int64,))
    _expect_same_device(op, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def _check_attention_common(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slab_offset: torch.Tensor, context_len: torch.Tensor, out: torch.Tensor) -> None:
    _expect_activation(op, "q", q, 3)
    _, num_heads, head_dim = q.shape
    _check_kv_cache_pair(op, k_cache, v_cache)
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or num_kv_heads == 0 or num_heads % num_kv_heads:
        _fail(op, f"q heads/head_dim {tuple(q.shape[1:])} do not fit cache heads/head_dim "
                  f"{tuple(k_cache.shape[1:])} (num_heads must be a multiple of num_kv_heads)")
    num_seqs = slab_offset.shape[0] if slab_offset.dim() == 1 else -1
    if num_seqs < 1:
        _fail(op, f"slab_offset must be (num_seqs,) with num_seqs >= 1, got {tuple(slab_offset.shape)}")
    _expect_dtype(op, "slab_offset", slab_offset, (torch.int64,))
    _expect_shape(op, "context_len", context_len, (num_seqs,))
    _expect_dtype(op, "context_len", context_len, (torch.int32,))
    _expect_shape(op, "out", out, tuple(q.shape))
    _expect_dtype(op, "out", out, (q.dtype,))
    _expect_contiguous(op, "out", out)


def check_slab_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 query_start: torch.Tensor, slab_offset: torch.Tensor,
                                 context_len: torch.Tensor, out: torch.Tensor,
                                 workspace: torch.Tensor | None = None) -> None:
    op = "slab_prefill_attention"
    _check_attention_common(op, q, k_cache, v_cache, slab_offset, context_len, out)
    if workspace is not None:
        _expect_dtype(op, "workspace", workspace, (torch.float32,))
        num_seqs, num_heads, head_dim = slab_offset.shape[0], q.shape[1], q.shape[2]
        decode = (workspace.dim() == 4 and tuple(workspace.shape[:2]) == (num_seqs, num_heads)
                  and workspace.shape[2] >= 1 and workspace.shape[3] == head_dim + 2)
        if workspace.dim() != 1 and not decode:
            _fail(op, f"workspace must be 1-D fp32 (CPU scratch: kernels.cpu_workspace_numel) or the decode "
                      f"workspace ({num_seqs}, {num_heads}, splits, {head_dim + 2}) (kernels.decode_workspace_shape), "
                      f"got {tuple(workspace.shape)}")
        if decode:
            _expect_contiguous(op, "workspace", workspace)
    _expect_shape(op, "query_start", query_start, (slab_offset.shape[0] + 1,))
    _expect_dtype(op, "query_start", query_start, (torch.int32,))
    _expect_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, query_start=query_start,
                        slab_offset=slab_offset, context_len=context_len, out=out)


def check_slab_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slab_offset: torch.Tensor, context_len: torch.Tensor, out: torch.Tensor,
                                workspace: torch.Tensor | None) -> None:
    op = "slab_decode_attention"
    _check_attention_common(op, q, k_cache, v_cache, slab_offset, context_len, out)
    num_seqs, num_heads, head_dim = q.shape
    _expect_shape(op, "slab_offset", slab_offset, (num_seqs,))
    if workspace is not None:
        if workspace.dim() != 4 or workspace.shape[3] != head_dim + 2 or workspace.shape[2] < 1:
            _fail(op, f"workspace must be (num_seqs, num_heads, num_splits, head_dim + 2) = "
                      f"({num_seqs}, {num_heads}, splits, {head_dim + 2}), got {tuple(workspace.shape)}; "
                      f"size it with kernels.decode_workspace_shape")
        _expect_shape(op, "workspace", workspace, (num_seqs, num_heads, workspace.shape[2], head_dim + 2))
        _expect_dtype(op, "workspace", workspace, (torch.float32,))
        _expect_contiguous(op, "workspace", workspace)
    _expect_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, slab_offset=slab_offset,
                        context_len=context_len, out=out, workspace=workspace)


# Columns per panel of a panel-packed weight (slabserve::linear): two AVX2 registers of fp32.
PANEL = 16


def panel_shape(k: int, n: int) -> tuple[int, int, int]:
    """Shape of a (K, N) weight packed as column panels: (ceil(N / PANEL), K, PANEL)."""
    return (-(-n // PANEL), k, PANEL)


def check_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None) -> None:
    _check_rows_times_weight("linear", x, w, out, residual, panel_shape, torch.float32)


def _check_rows_times_weight(op: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                             residual: torch.Tensor | None, w_shape, w_dtype: torch.dtype) -> None:
    """x (M, K) and out (M, N) fp32 activations, residual like out, w contiguous of `w_dtype` and shape
    w_shape(K, N), all on one device."""
    _expect_activation(op, "x", x, 2, torch.float32)
    _expect_activation(op, "out", out, 2, torch.float32)
    num_tokens, k = x.shape
    n = out.shape[1]
    _expect_shape(op, "out", out, (num_tokens, n))
    _expect_shape(op, "w", w, w_shape(k, n))
    _expect_dtype(op, "w", w, (w_dtype,))
    _expect_contiguous(op, "w", w)
    if residual is not None:
        _expect_activation(op, "residual", residual, 2, torch.float32)
        _expect_shape(op, "residual", residual, (num_tokens, n))
    _expect_same_device(op, x=x, w=w, out=out, residual=residual)


def _block_rows(op: str, ggml_id: int, k: int) -> int:
    """Bytes of one row of k weights of GGML type `ggml_id`, or a ValueError naming the op."""
    from slabserve.kernels import quant

    try:
        t = quant.by_id(ggml_id)
    except ValueError as exc:
        _fail(op, str(exc))
    if not quant.fits(t.name, k):
        _fail(op, f"rows of {k} weights do not split into whole {t.name} blocks of {t.block_size} (or exceed "
                  f"{quant.MAX_K})")
    return t.row_bytes(k)


def check_linear_q(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
                   qtype: int) -> None:
    """x (M, K) fp32, w (N, row_bytes) uint8 rows of GGUF blocks of type `qtype` (kernels.quant), out (M, N) fp32
    whose rows may be a column slice of a wider tensor (stride(1) 1), residual like out."""
    _check_rows_times_weight("linear_q", x, w, out, residual,
                             lambda k, n: (n, _block_rows("linear_q", qtype, k)), torch.uint8)


def check_embed_q(ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, qtype: int) -> None:
    """ids (T,) int64, w (V, row_bytes) uint8 rows of GGUF blocks of type `qtype`, out (T, K) fp32."""
    op = "embed_q"
    if ids.dim() != 1 or ids.dtype != torch.int64:
        _fail(op, f"ids must be (T,) int64, got {tuple(ids.shape)} {ids.dtype}")
    _expect_activation(op, "out", out, 2, torch.float32)
    _expect_shape(op, "out", out, (ids.shape[0], out.shape[1]))
    _expect_shape(op, "w", w, (w.shape[0], _block_rows(op, qtype, out.shape[1])))
    _expect_dtype(op, "w", w, (torch.uint8,))
    _expect_contiguous(op, "w", w)
    _expect_same_device(op, ids=ids, w=w, out=out)


def check_live_rows(op: str, rows: torch.Tensor | None) -> None:
    """`rows` of a row-wise op: None (every row), or the step's query_start, a contiguous 1-D int32 tensor (S+1,)
    that says which rows of the op's activations are real (kernels.ops: ROWS); the others are padding, which a
    kernel may leave as they were. The values are read at each call, never here (this check sees metadata only)."""
    if rows is None:
        return
    if rows.dim() != 1 or rows.shape[0] < 1 or rows.dtype != torch.int32 or rows.stride(0) != 1:
        _fail(op, f"rows must be a non-empty contiguous 1-D int32 tensor (the step's query_start), got "
                  f"{tuple(rows.shape)} {rows.dtype} strides {rows.stride()}")
