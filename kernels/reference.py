"""PyTorch references of every kernel op: the CPU serving path, and the ground truth the Triton kernels are
tested against.

Each reference has the same signature as its Triton wrapper, validates the same contract
(`kernels.contracts`), writes its result into the given `out` (or in place), and allocates only small
temporaries. Numerics follow HF Llama: statistics and attention in fp32; RMSNorm rounds the normalized value
to the activation dtype before the weight multiply, SiLU-mul rounds silu(gate) before the product; RoPE
rotates in fp32 and rounds once.

Attention semantics (shared with the kernels): sequence s owns flat rows query_start[s] .. query_start[s+1]-1;
query j of s sits at position p = context_len[s] - q_len_s + j and sees cache rows slab_offset[s] + [0, p].
A row that sees no key (padding rows past query_start[S], rows of a sequence with context_len 0) gets zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.contracts import (
    check_kv_write,
    check_rms_norm,
    check_rope,
    check_silu_mul,
    check_slab_decode_attention,
    check_slab_prefill_attention,
)


def cpu_workspace_numel(num_tokens: int, num_heads: int, head_dim: int, max_context: int) -> int:
    """fp32 elements of the one scratch buffer the CPU references share within a step (ops run one at a time):
    enough for attention over the longest slab, for RoPE's rotation and for RMSNorm's row statistics."""
    return max(prefill_workspace_numel(num_tokens, num_heads, head_dim, max_context),
               num_tokens * head_dim + 3 * num_tokens * num_heads * (head_dim // 2), 2 * num_tokens)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                 workspace: torch.Tensor | None = None) -> torch.Tensor:
    """out = x / sqrt(mean(x^2) + eps) * weight, with the statistic in fp32 (in `workspace` when given).

    No op here takes a Python number as an operand: ATen wraps such a number in a new scalar tensor, which is
    an allocation. eps enters as a filled workspace row instead.
    """
    check_rms_norm(x, weight, out)
    num_tokens, hidden = x.shape
    variance = _scratch(workspace, 0, num_tokens, x.device).view(num_tokens, 1)  # (T, 1) fp32
    eps_col = _scratch(workspace, num_tokens, num_tokens, x.device).view(num_tokens, 1).fill_(eps)  # (T, 1)
    if x.dtype == torch.float32:  # sum of squares; `out` holds x^2 meanwhile (mean() would divide by a Python int)
        torch.sum(torch.mul(x, x, out=out), dim=-1, keepdim=True, out=variance)
    else:  # half precision: square and sum in fp32 without an fp32 copy of x
        torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32, out=variance)
        variance.square_()
    torch.add(eps_col, variance, alpha=1.0 / hidden, out=variance)  # mean + eps
    variance.rsqrt_()
    torch.mul(x, variance, out=out)  # fp32 product rounded to x.dtype, as HF does before the weight
    return out.mul_(weight)


def _scratch(workspace: torch.Tensor | None, start: int, numel: int, device: torch.device) -> torch.Tensor:
    """fp32 elements [start, start + numel) of the caller's workspace, or a new buffer when there is none."""
    if workspace is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if workspace.numel() < start + numel:
        raise ValueError(f"workspace holds {workspace.numel()} fp32 values, {start + numel} needed "
                         f"(size it with kernels.cpu_workspace_numel)")
    return workspace[start : start + numel]


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
             workspace: torch.Tensor | None = None) -> None:
    """Rotate q and k in place, neox "rotate_half" style, at the given positions.

    For d < D/2 with x1 = x[..., d], x2 = x[..., d + D/2]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, where
    cos_sin (P, D) float32 holds cos(p * inv_freq) in its first D/2 columns and sin(p * inv_freq) in the rest.
    Rotation in fp32, rounded once; temporaries live in `workspace` when given.
    """
    check_rope(q, k, positions, cos_sin)
    num_tokens, _, head_dim = q.shape
    half = head_dim // 2
    table = _scratch(workspace, 0, num_tokens * head_dim, q.device).view(num_tokens, head_dim)  # (T, D) fp32
    torch.index_select(cos_sin, 0, positions, out=table)
    cos, sin = table[:, None, :half], table[:, None, half:]  # (T, 1, D/2)
    for x in (q, k):
        n = x.shape[0] * x.shape[1] * half
        a, b, r = (_scratch(workspace, num_tokens * head_dim + i * n, n, q.device).view(x.shape[0], x.shape[1], half)
                   for i in range(3))  # (T, h, D/2) each
        x1, x2 = x[..., :half], x[..., half:]  # (T, h, D/2) views
        a.copy_(x1)  # originals: x1 is overwritten before x2 is computed
        b.copy_(x2)
        torch.mul(a, cos, out=r)
        x1.copy_(r.addcmul_(b, sin, value=-1.0))
        torch.mul(b, cos, out=r)
        x2.copy_(r.addcmul_(a, sin))


def silu_mul_ref(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    check_silu_mul(gate_up, out)
    inter = out.shape[1]
    torch.ops.aten.silu.out(gate_up[:, :inter], out=out)
    return out.mul_(gate_up[:, inter:])


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t] (same for v), skipping rows whose slot is -1.

    A sequence's new rows go to consecutive slots, so the rows are copied as runs of consecutive slots: a few
    slice copies per step and no index tensors.
    """
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.tolist()
    t = 0
    while t < len(slots):
        if slots[t] < 0:
            t += 1
            continue
        end = t + 1
        while end < len(slots) and slots[end] == slots[end - 1] + 1:
            end += 1
        first = slots[t]
        k_cache[first : first + end - t].copy_(k[t:end])
        v_cache[first : first + end - t].copy_(v[t:end])
        t = end


def prefill_workspace_numel(num_tokens: int, num_heads: int, head_dim: int, max_context: int) -> int:
    """fp32 elements the CPU attention needs for one sequence of up to `num_tokens` rows over `max_context` keys:
    the gathered queries and the result (each H*L*D), the scores (H*L*C) and the causal mask of the chunk (L*L).
    Sequences reuse it one by one."""
    return num_heads * num_tokens * (2 * head_dim + max_context) + num_tokens * num_tokens


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
    if k_slab.dtype != torch.float32:  # half-precision caches on CPU: compute in fp32 (copies; CPU serves fp32)
        k_slab, v_slab = k_slab.float(), v_slab.float()
    n_q, n_s = num_heads * q_len * head_dim, num_heads * q_len * context
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


def slab_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               query_start: torch.Tensor, slab_offset: torch.Tensor,
                               context_len: torch.Tensor, scale: float, out: torch.Tensor,
                               workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked-prefill (and mixed decode) attention of flat rows q (T, H, D) over each sequence's slab.

    `workspace`: fp32 scratch of at least prefill_workspace_numel(T, H, D, longest context); allocated when None.
    """
    check_slab_prefill_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, out, workspace)
    starts, offsets, contexts = query_start.tolist(), slab_offset.tolist(), context_len.tolist()
    num_heads, head_dim = q.shape[1], q.shape[2]
    if workspace is None:
        longest = max([c for c in contexts] + [1])
        workspace = torch.empty(prefill_workspace_numel(q.shape[0], num_heads, head_dim, longest), device=q.device)
    out[starts[-1]:].zero_()
    for s, (offset, context) in enumerate(zip(offsets, contexts)):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        if context < end - begin:  # padding sequence (context 0) or malformed metadata: nothing to see
            out[begin:end].zero_()
            continue
        need = prefill_workspace_numel(end - begin, num_heads, head_dim, context)
        if workspace.numel() < need:
            raise ValueError(f"slab_prefill_attention: workspace holds {workspace.numel()} fp32 values, sequence {s} "
                             f"({end - begin} rows over {context} keys) needs {need}")
        slab = slice(offset, offset + context)
        _attend_slab(q[begin:end], k_cache[slab], v_cache[slab], scale, out[begin:end], workspace)
    return out


def slab_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slab_offset: torch.Tensor, context_len: torch.Tensor, scale: float,
                              out: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, q (S, H, D), over its whole slab; `workspace` is accepted and unused."""
    check_slab_decode_attention(q, k_cache, v_cache, slab_offset, context_len, out, workspace)
    offsets, contexts = slab_offset.tolist(), context_len.tolist()
    # one scratch for every sequence, sized for the longest (the Triton kernel's split workspace has another layout)
    scratch = torch.empty(prefill_workspace_numel(1, q.shape[1], q.shape[2], max(contexts + [1])), device=q.device)
    for s, (offset, context) in enumerate(zip(offsets, contexts)):
        if context == 0:
            out[s].zero_()
            continue
        slab = slice(offset, offset + context)
        _attend_slab(q[s:s + 1], k_cache[slab], v_cache[slab], scale, out[s:s + 1], scratch)
    return out
