"""PyTorch references of every kernel op: the CPU serving path, and the ground truth the Triton kernels are
tested against.

Each reference has the same signature as its Triton wrapper, validates the same contract
(`kernels.contracts`), writes its result into the given `out` (or in place), and allocates nothing when given a
workspace. Numerics follow HF Llama: statistics and attention in fp32; RMSNorm rounds the normalized value
to the activation dtype before the weight multiply, SiLU-mul rounds silu(gate) before the product; RoPE
rotates in fp32 and rounds once.

Each reference is split in two: `prepare_<op>(args)` checks the contract and builds every view the op needs
(metadata only, no data read), and returns `run()`, which does the arithmetic. `<op>_ref(args)` is
`prepare_<op>(args)()`. The planned executor prepares each op of a step once, when it binds the step to its
fixed tensors, and then calls only the `run`s: the contract checks and the view building leave the serving loop,
and both paths run the same arithmetic, so they agree bit for bit.

Attention semantics (shared with the kernels): sequence s owns flat rows query_start[s] .. query_start[s+1]-1;
query j of s sits at position p = context_len[s] - q_len_s + j and sees cache rows slab_offset[s] + [0, p].
A row that sees no key (padding rows past query_start[S], rows of a sequence with context_len 0) gets zeros.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slabserve.kernels.contracts import (
                                         KV_TILE,
                                         PANEL,
                                         check_embed_q,
                                         check_kv_write,
                                         check_linear,
                                         check_linear_q,
                                         check_live_rows,
                                         check_rms_norm,
                                         check_rope,
                                         check_silu_mul,
                                         check_slab_decode_attention,
                                         check_slab_prefill_attention,
                                         k_rows,
                                         k_tiled,
                                         )

Run = Callable[[], None]


def cpu_workspace_numel(num_tokens: int, num_heads: int, head_dim: int, max_context: int,
                        num_kv_heads: int | None = None, kv_dtype: torch.dtype = torch.float32) -> int:
    """fp32 elements of the one scratch buffer the CPU references share within a step (ops run one at a time):
    enough for attention over the longest slab (with its K/V rows widened to fp32 when the caches hold `kv_dtype`
    half floats), for batched decode attention over DECODE_GROUP_KEYS window rows, for RoPE's rotation and for
    RMSNorm's row statistics."""
    num_kv_heads = num_kv_heads or num_heads
    group_seqs = min(num_tokens, DECODE_GROUP_KEYS // 16)
    group = _decode_group_numel(group_seqs, min(DECODE_GROUP_KEYS // group_seqs, GROUP_MAX_WINDOW, max_context),
                                num_heads, num_kv_heads, head_dim) if num_tokens > 1 else 0
    widen = _widened_kv_width(kv_dtype, num_kv_heads, head_dim)
    return max(prefill_workspace_numel(num_tokens, num_heads, head_dim, max_context, widen), group,
               num_tokens * head_dim + 3 * num_tokens * num_heads * (head_dim // 2), 2 * num_tokens)


def _scratch(workspace: torch.Tensor | None, start: int, numel: int, device: torch.device) -> torch.Tensor:
    """fp32 elements [start, start + numel) of the caller's workspace, or a new buffer when there is none."""
    if workspace is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if workspace.numel() < start + numel:
        raise ValueError(f"workspace holds {workspace.numel()} fp32 values, {start + numel} needed "
                         f"(size it with kernels.cpu_workspace_numel)")
    return workspace[start : start + numel]


# ---------------------------------------------------------------------------------------------------- rms_norm


def prepare_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                     workspace: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> Run:
    """out = x / sqrt(mean(x^2) + eps) * weight, with the statistic in fp32 (in `workspace` when given). `rows`
    (contracts.check_live_rows) is checked and otherwise unused: the reference computes every row.

    No op here takes a Python number as an operand: ATen wraps such a number in a new scalar tensor, which is
    an allocation. eps enters as a filled workspace row instead.
    """
    check_rms_norm(x, weight, out)
    check_live_rows("rms_norm", rows)
    num_tokens, hidden = x.shape
    variance = _scratch(workspace, 0, num_tokens, x.device).view(num_tokens, 1)  # (T, 1) fp32
    eps_col = _scratch(workspace, num_tokens, num_tokens, x.device).view(num_tokens, 1)  # (T, 1) fp32
    inv_hidden = 1.0 / hidden

    def run() -> None:
        eps_col.fill_(eps)
        if x.dtype == torch.float32:  # sum of squares; `out` holds x^2 meanwhile (mean() divides by a Python int)
            torch.sum(torch.mul(x, x, out=out), dim=-1, keepdim=True, out=variance)
        else:  # half precision: square and sum in fp32 without an fp32 copy of x
            torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32, out=variance)
            variance.square_()
        torch.add(eps_col, variance, alpha=inv_hidden, out=variance)  # mean + eps
        variance.rsqrt_()
        torch.mul(x, variance, out=out)  # fp32 product rounded to x.dtype, as HF does before the weight
        out.mul_(weight)

    return run


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                 workspace: torch.Tensor | None = None) -> torch.Tensor:
    prepare_rms_norm(x, weight, eps, out, workspace)()
    return out


# ---------------------------------------------------------------------------------------------------- rope


def _joint_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q (T, H, D) and k (T, Hkv, D) as one (T, H + Hkv, D) view when k's heads follow q's in every row (both
    slices of one fused qkv projection, as the model's are), so one rotation covers both; else None."""
    t, h, d = q.shape
    if (k.device != q.device or k.dtype != q.dtype or q.stride()[1:] != (d, 1) or k.stride() != q.stride()
            or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
            or k.storage_offset() != q.storage_offset() + h * d):
        return None
    return q.as_strided((t, h + k.shape[1], d), q.stride())


def prepare_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 workspace: torch.Tensor | None = None) -> Run:
    """Rotate q and k in place, neox "rotate_half" style, at the given positions.

    For d < D/2 with x1 = x[..., d], x2 = x[..., d + D/2]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, where
    cos_sin (P, D) float32 holds cos(p * inv_freq) in its first D/2 columns and sin(p * inv_freq) in the rest.
    Rotation in fp32, rounded once; temporaries live in `workspace` when given.
    """
    check_rope(q, k, positions, cos_sin)
    num_tokens, _, head_dim = q.shape
    half = head_dim // 2
    table = _scratch(workspace, 0, num_tokens * head_dim, q.device).view(num_tokens, head_dim)  # (T, D) fp32
    cos, sin = table[:, None, :half], table[:, None, half:]  # (T, 1, D/2)
    joint = _joint_heads(q, k)
    parts = (joint,) if joint is not None else (q, k)
    steps = []
    for x in parts:
        n = x.shape[0] * x.shape[1] * half
        a, b, r = (_scratch(workspace, num_tokens * head_dim + i * n, n, q.device).view(x.shape[0], x.shape[1], half)
                   for i in range(3))  # (T, h, D/2) each
        steps.append((x[..., :half], x[..., half:], a, b, r))  # x1, x2: (T, h, D/2) views

    def run() -> None:
        torch.index_select(cos_sin, 0, positions, out=table)
        for x1, x2, a, b, r in steps:
            if x1.dtype == torch.float32:  # in place: the products round to fp32 exactly as they would in scratch
                a.copy_(x1)  # x1 is overwritten before x2 is computed
                x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
                x2.mul_(cos).addcmul_(a, sin)
            else:  # half precision: rotate in fp32 scratch, round once
                a.copy_(x1)
                b.copy_(x2)
                torch.mul(a, cos, out=r)
                x1.copy_(r.addcmul_(b, sin, value=-1.0))
                torch.mul(b, cos, out=r)
                x2.copy_(r.addcmul_(a, sin))

    return run


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
             workspace: torch.Tensor | None = None) -> None:
    prepare_rope(q, k, positions, cos_sin, workspace)()


# ---------------------------------------------------------------------------------------------------- silu_mul


def prepare_silu_mul(gate_up: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None) -> Run:
    """out = silu(gate_up[:, :I]) * gate_up[:, I:]; every row (`rows` is checked, not used)."""
    check_silu_mul(gate_up, out)
    check_live_rows("silu_mul", rows)
    inter = out.shape[1]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]

    def run() -> None:
        torch.ops.aten.silu.out(gate, out=out)
        out.mul_(up)

    return run


def silu_mul_ref(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    prepare_silu_mul(gate_up, out)()
    return out


# ---------------------------------------------------------------------------------------------------- linear


def linear_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
               residual: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """out = x @ W (+ residual), W packed as column panels (P, K, PANEL): W[k, PANEL p + j] = w[p, k, j].

    The ground truth of the native kernel (kernels/cpu_native.c); allocates its product (the serving path is the
    native kernel, which writes into `out` directly)."""
    check_linear(x, w, out, residual)
    check_live_rows("linear", rows)  # every row is computed
    num_panels, k, _ = w.shape
    product = x @ w.permute(1, 0, 2).reshape(k, num_panels * PANEL)[:, : out.shape[1]]  # (M, N)
    if residual is not None:
        product += residual
    return out.copy_(product)



def linear_q_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
                 qtype: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """out = x @ dequantize(W)^T (+ residual), W rows of GGUF blocks (kernels.quant): the `gguf` package's
    dequantization, then an fp32 matmul. The ground truth of the native kernel; allocates (the serving path is the
    native kernel, and build-plan refuses quantized weights where it cannot run)."""
    from slabserve.kernels import quant

    check_linear_q(x, w, out, residual, qtype)
    check_live_rows("linear_q", rows)  # every row is computed
    weights = quant.dequantize(w, quant.by_id(qtype).name, x.shape[1]).to(x.device)  # (N, K)
    product = x @ weights.t()
    if residual is not None:
        product += residual
    return out.copy_(product)


def embed_q_ref(ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, qtype: int) -> torch.Tensor:
    """out[t] = dequantize(W)[ids[t]]: the rows asked for, through the `gguf` package."""
    from slabserve.kernels import quant

    check_embed_q(ids, w, out, qtype)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
        raise ValueError(f"embed_q: a token id lies outside the embedding's {w.shape[0]} rows")
    rows = quant.dequantize(w[ids.cpu()], quant.by_id(qtype).name, out.shape[1])
    return out.copy_(rows)

# ---------------------------------------------------------------------------------------------------- kv_write


def prepare_kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> Run:
    """k_cache[slot_mapping[t]] = k[t] (same for v), skipping rows whose slot is -1.

    A sequence's new rows go to consecutive slots, so a step with few sequences copies them as runs of consecutive
    slots (a few slice copies, no index); a step with many (decode: one row per sequence) writes the valid rows,
    which come first, with one index_copy_ per cache.
    """
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    same_dtype = k.dtype == k_cache.dtype  # index_copy_ takes no other (copy_ rounds into the cache's dtype)
    if k_tiled(k_cache):  # K into its lanes of the tiles (contracts.KV_TILE), V as rows
        def run_tiled() -> None:
            keep = slot_mapping >= 0
            slots = slot_mapping[keep]
            k_cache[slots // KV_TILE, :, :, slots % KV_TILE] = k[keep].to(k_cache.dtype)
            v_cache[slots] = v[keep].to(v_cache.dtype)

        return run_tiled

    def run() -> None:
        slots = slot_mapping.tolist()
        runs, valid, t = [], 0, 0
        while t < len(slots):
            if slots[t] < 0:
                t += 1
                continue
            end = t + 1
            while end < len(slots) and slots[end] == slots[end - 1] + 1:
                end += 1
            runs.append((t, end))
            valid += end - t
            t = end
        if len(runs) > 2 and runs[-1][1] == valid and same_dtype:  # valid rows are [0, valid): one indexed copy
            index = slot_mapping[:valid]
            k_cache.index_copy_(0, index, k[:valid])
            v_cache.index_copy_(0, index, v[:valid])
            return
        for t, end in runs:
            first = slots[t]
            k_cache[first : first + end - t].copy_(k[t:end])
            v_cache[first : first + end - t].copy_(v[t:end])

    return run


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    prepare_kv_write(k, v, k_cache, v_cache, slot_mapping)()


# ---------------------------------------------------------------------------------------------------- attention


def prefill_workspace_numel(num_tokens: int, num_heads: int, head_dim: int, max_context: int,
                            widened_kv_width: int = 0) -> int:
    """fp32 elements the CPU attention needs for one sequence of up to `num_tokens` rows over `max_context` keys:
    the gathered queries and the result (each H*L*D), the scores (H*L*C), the causal mask of the chunk (L*L) and,
    for half-precision caches, the slab's K and V rows widened to fp32 (2*C*`widened_kv_width`, the width being
    Hkv*D: `_widened_kv_width`). Sequences reuse it one by one; decode sequences over fp32 caches are batched in
    groups that fit it (`_decode_group_numel`)."""
    return (num_heads * num_tokens * (2 * head_dim + max_context) + num_tokens * num_tokens
            + 2 * max_context * widened_kv_width)


def _widened_kv_width(kv_dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> int:
    """fp32 values per cache row that attention widens into scratch: none for fp32 caches."""
    return 0 if kv_dtype == torch.float32 else num_kv_heads * head_dim


def _k_slab(k_cache: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start .. stop-1 of one layer's K cache (C, Hkv, D): a view of a row cache, a copy out of a tiled one."""
    if not k_tiled(k_cache):
        return k_cache[start:stop]
    first = start // KV_TILE
    return k_rows(k_cache[first : -(-stop // KV_TILE)])[start - first * KV_TILE : stop - first * KV_TILE]


def _attend_slab(q: torch.Tensor, k_slab: torch.Tensor, v_slab: torch.Tensor, scale: float,
                 out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Bottom-right aligned causal attention of q (L, H, D) over k/v_slab (C, Hkv, D), C >= L, into out.

    Allocation-free given `scratch` (fp32, >= prefill_workspace_numel(L, H, D, C)): one GEMM per kv head over its
    G*L query rows, reading the slab in place (a kv head's rows are a strided matrix BLAS takes as it is; a
    batched matmul over heads would copy the slab first), softmax in place, a second GEMM per kv head.
    """
    q_len, num_heads, head_dim = q.shape
    context, num_kv_heads = k_slab.shape[0], k_slab.shape[1]
    group = num_heads // num_kv_heads
    rows = group * q_len
    n_q, n_s = num_heads * q_len * head_dim, num_heads * q_len * context
    if k_slab.dtype != torch.float32:  # half-precision caches: widen the slab's rows into fp32 scratch
        base, n_kv = 2 * n_q + n_s + q_len * q_len, context * num_kv_heads * head_dim
        k_slab = scratch[base : base + n_kv].view(k_slab.shape).copy_(k_slab)
        v_slab = scratch[base + n_kv : base + 2 * n_kv].view(v_slab.shape).copy_(v_slab)
    queries = scratch[:n_q].view(num_kv_heads, group, q_len, head_dim)  # (Hkv, G, L, D)
    scores = scratch[n_q : n_q + n_s].view(num_kv_heads, group, q_len, context)  # (Hkv, G, L, C)
    result = scratch[n_q + n_s : 2 * n_q + n_s].view(num_kv_heads, group, q_len, head_dim)  # (Hkv, G, L, D)
    queries.copy_(q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3))
    for h in range(num_kv_heads):  # scores = scale * q k^T; alpha is passed through (a Python operand would allocate)
        s_h = scores[h].view(rows, context)
        torch.addmm(s_h, queries[h].view(rows, head_dim), k_slab[:, h].t(), beta=0.0, alpha=scale, out=s_h)
    if q_len > 1:  # the last L keys are this chunk's own rows: mask the strict upper triangle with -inf
        mask = scratch[2 * n_q + n_s : 2 * n_q + n_s + q_len * q_len].view(q_len, q_len)
        mask.fill_(float("-inf")).triu_(1)
        scores[..., context - q_len :].add_(mask)
    torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    for h in range(num_kv_heads):
        torch.mm(scores[h].view(rows, context), v_slab[:, h], out=result[h].view(rows, head_dim))
    out.view(q_len, num_kv_heads, group, head_dim).copy_(result.permute(2, 0, 1, 3))


def _decode_group_numel(num_seqs: int, keys: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """fp32 elements `_attend_decode_group` needs for `num_seqs` sequences over windows of `keys` rows: gathered
    K and V, the scores, the result, and the int64 row index and the bool mask of the windows."""
    window = num_seqs * keys
    return window * (2 * num_kv_heads * head_dim + num_heads + 3) + 2 * keys + num_seqs * (num_heads * head_dim + 4) + 16


def _attend_decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slab_offset: torch.Tensor,
                         context_len: torch.Tensor, keys: int, scale: float, out: torch.Tensor,
                         scratch: torch.Tensor) -> None:
    """Decode attention of S sequences at once, one query row each: q (S, H, D), their slab_offset (S,) int64
    and context_len (S,) int32 (each >= 1, at most `keys`), into out (S, H, D).

    Each sequence's last `keys` cache rows (its window, ending at its newest key) are gathered into scratch with
    one index_select per cache, rows before its slab masked out, and then a batched GEMM per kv head gives every
    sequence's scores; softmax in place, a second batched GEMM. The op count does not grow with S, where looping
    over sequences costs about ten small ops each. Allocation-free given `scratch`
    (>= _decode_group_numel(S, keys, H, Hkv, D)).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    window = num_seqs * keys
    cursor = 0

    def take(numel: int) -> torch.Tensor:
        nonlocal cursor
        cursor += numel + (numel % 2)  # keep the next piece 8-byte aligned for the int64 index
        return scratch[cursor - numel - (numel % 2) : cursor - (numel % 2)]

    index = take(2 * window).view(torch.int64).view(num_seqs, keys)  # (S, W) cache row of each window slot
    steps = take(2 * keys).view(torch.int64)  # (W,) -keys .. -1
    ends = take(2 * num_seqs).view(torch.int64)  # (S,) one past each sequence's newest row
    contexts = take(2 * num_seqs).view(torch.int64)  # (S,) context_len as int64 (mixed dtypes would copy)
    mask = take(-(-window // 4)).view(torch.bool)[:window].view(num_seqs, keys)  # (S, W) slot before the slab
    k_win = take(window * num_kv_heads * head_dim).view(num_seqs, keys, num_kv_heads, head_dim)  # (S, W, Hkv, D)
    v_win = take(window * num_kv_heads * head_dim).view(num_seqs, keys, num_kv_heads, head_dim)
    scores = take(window * num_heads).view(num_kv_heads, num_seqs, group, keys)  # (Hkv, S, G, W)
    result = take(num_seqs * num_heads * head_dim).view(num_kv_heads, num_seqs, group, head_dim)  # (Hkv, S, G, D)
    # window slot j of sequence s is row ends[s] - keys + j; it lies in s's slab when j - keys + context[s] >= 0
    torch.arange(-keys, 0, out=steps)
    contexts.copy_(context_len)
    torch.add(steps, contexts.view(num_seqs, 1), out=index)  # (S, W) j - keys + context
    torch.signbit(index, out=mask)  # index < 0 (a Python 0 operand would allocate)
    torch.add(slab_offset, contexts, out=ends)
    torch.add(steps, ends.view(num_seqs, 1), out=index)  # (S, W) cache rows
    index.clamp_(min=0)  # slots before row 0 (masked anyway) read row 0
    rows = index.view(window)
    torch.index_select(k_cache, 0, rows, out=k_win.view(window, num_kv_heads, head_dim))
    torch.index_select(v_cache, 0, rows, out=v_win.view(window, num_kv_heads, head_dim))
    queries = q.view(num_seqs, num_kv_heads, group, head_dim)
    for h in range(num_kv_heads):
        torch.baddbmm(scores[h], queries[:, h], k_win[:, :, h].transpose(1, 2), beta=0.0, alpha=scale,
                      out=scores[h])
    scores.masked_fill_(mask.view(1, num_seqs, 1, keys), float("-inf"))
    torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    for h in range(num_kv_heads):
        torch.bmm(scores[h], v_win[:, :, h], out=result[h])
    out.view(num_seqs, num_kv_heads, group, head_dim).copy_(result.permute(1, 0, 2, 3))


# Batched decode attention (`_attend_decode_group`) gathers each sequence's window of keys; it beats attending
# each sequence in place for short windows only (measured on 2 AVX2 cores, SmolLM2 heads, one thread: 5x faster
# at 32 sequences of 64 keys, 1.4x at 256, 1.5x slower at 1,024). Sequences with longer contexts run alone.
GROUP_MAX_WINDOW = 512
# Window rows the CPU workspace holds for one group (all its sequences together), e.g. 32 sequences of 256.
DECODE_GROUP_KEYS = 8192
# Padding a group's sequences to the longest window pays off while each sequence adds fewer than this many
# padded rows (a separate call per sequence costs about that much).
_SEQ_COST_IN_KEYS = 256


def prepare_slab_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   query_start: torch.Tensor, slab_offset: torch.Tensor, context_len: torch.Tensor,
                                   scale: float, out: torch.Tensor, workspace: torch.Tensor | None = None,
                                   done_below: int = 0) -> Run:
    """Chunked-prefill (and mixed decode) attention of flat rows q (T, H, D) over each sequence's slab.

    `workspace`: fp32 scratch of at least prefill_workspace_numel(T, H, D, longest context); allocated when None.
    Runs of consecutive decode sequences (one row each) are attended together (`_attend_decode_group`) while
    their windows fit the workspace and padding them to the longest costs less than a call per sequence.
    `done_below`: sequences of 1 to `done_below` rows (with at least as many keys) are left as they are: another
    kernel attends them (kernels.cpu_native.prepare_slab_attention).
    """
    check_slab_prefill_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, out, workspace)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    # the decode groups gather rows into fp32 scratch as they are (rows: a tiled K is read slab by slab)
    fp32_caches = k_cache.dtype == torch.float32 and not k_tiled(k_cache)
    widen = _widened_kv_width(k_cache.dtype, num_kv_heads, head_dim)

    def run() -> None:
        starts, offsets, contexts = query_start.tolist(), slab_offset.tolist(), context_len.tolist()
        scratch = workspace
        if scratch is None:
            longest = max([c for c in contexts] + [1])
            scratch = torch.empty(prefill_workspace_numel(q.shape[0], num_heads, head_dim, longest, widen),
                                  device=q.device)
        capacity = scratch.numel()
        out[starts[-1]:].zero_()
        num_seqs, s = len(offsets), 0
        while s < num_seqs:
            begin, end, context = starts[s], starts[s + 1], contexts[s]
            if end == begin:
                s += 1
                continue
            if context < end - begin:  # padding sequence (context 0) or malformed metadata: nothing to see
                out[begin:end].zero_()
                s += 1
                continue
            if end - begin <= done_below:
                s += 1
                continue
            if end - begin == 1 and context <= GROUP_MAX_WINDOW and fp32_caches:  # group the decode rows that follow
                last, keys, total = s + 1, context, context
                while (last < num_seqs and starts[last + 1] - starts[last] == 1 and contexts[last] >= 1
                       and max(keys, contexts[last]) <= GROUP_MAX_WINDOW):
                    wider = max(keys, contexts[last])
                    size = last + 1 - s
                    if (_decode_group_numel(size, wider, num_heads, num_kv_heads, head_dim) > capacity
                            or size * wider - total - contexts[last] > _SEQ_COST_IN_KEYS * size):
                        break
                    keys, total, last = wider, total + contexts[last], last + 1
                if last - s > 1:
                    _attend_decode_group(q[begin : begin + last - s], k_cache, v_cache, slab_offset[s:last],
                                         context_len[s:last], keys, scale, out[begin : begin + last - s], scratch)
                    s = last
                    continue
            need = prefill_workspace_numel(end - begin, num_heads, head_dim, context, widen)
            if capacity < need:
                raise ValueError(f"slab_prefill_attention: workspace holds {capacity} fp32 values, sequence {s} "
                                 f"({end - begin} rows over {context} keys) needs {need}")
            slab = slice(offsets[s], offsets[s] + context)
            _attend_slab(q[begin:end], _k_slab(k_cache, slab.start, slab.stop), v_cache[slab], scale,
                         out[begin:end], scratch)
            s += 1

    return run


def slab_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               query_start: torch.Tensor, slab_offset: torch.Tensor,
                               context_len: torch.Tensor, scale: float, out: torch.Tensor,
                               workspace: torch.Tensor | None = None) -> torch.Tensor:
    prepare_slab_prefill_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, scale, out,
                                   workspace)()
    return out


def slab_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slab_offset: torch.Tensor, context_len: torch.Tensor, scale: float,
                              out: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, q (S, H, D), over its whole slab; `workspace` is accepted and unused."""
    check_slab_decode_attention(q, k_cache, v_cache, slab_offset, context_len, out, workspace)
    offsets, contexts = slab_offset.tolist(), context_len.tolist()
    # one scratch for every sequence, sized for the longest (the Triton kernel's split workspace has another layout)
    widen = _widened_kv_width(k_cache.dtype, k_cache.shape[1], q.shape[2])
    scratch = torch.empty(prefill_workspace_numel(1, q.shape[1], q.shape[2], max(contexts + [1]), widen),
                          device=q.device)
    for s, (offset, context) in enumerate(zip(offsets, contexts)):
        if context == 0:
            out[s].zero_()
            continue
        slab = slice(offset, offset + context)
        _attend_slab(q[s:s + 1], _k_slab(k_cache, slab.start, slab.stop), v_cache[slab], scale, out[s:s + 1],
                     scratch)
    return out

