"""The kernel ops as `torch.library` custom ops in the `slabserve` namespace, and the functions to call them.

Each op mutates its output arguments (`out`, q/k for rope, the caches for kv_write) and returns nothing, so
`torch.export` keeps it as one opaque node and the memory planner sees exactly which buffers it writes.
Dispatch is by device: CPU tensors run the native CPU kernels (`kernels.cpu_native`: fp32, where this machine
can build them) and otherwise the PyTorch references (`kernels.reference`), CUDA tensors the Triton wrappers;
the fake implementations validate the contract (`kernels.contracts`) on metadata alone.

Importing this module registers the ops and loads neither Triton nor CUDA: the Triton modules are imported on
the first CUDA call (during warm-up, before any graph capture).

  slabserve::rms_norm(x, weight, eps, out, workspace, rows)
  slabserve::rope(q, k, positions, cos_sin)
  slabserve::silu_mul(gate_up, out, rows)
  slabserve::kv_write(k, v, k_cache, v_cache, slot_mapping)
  slabserve::slab_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, scale, out)
  slabserve::slab_decode_attention(q, k_cache, v_cache, slab_offset, context_len, scale, out, workspace)
  slabserve::linear(x, w, out, residual, rows, per_sequence)   CPU only: w packed as column panels
  slabserve::linear_q(x, w, out, residual, qtype, rows, per_sequence)   CPU only: w rows of GGUF blocks
  slabserve::embed_q(ids, w, out, qtype)            CPU only: rows of GGUF blocks gathered and dequantized
  slabserve::all_reduce_residual(out, residual, rows)   tensor parallelism: sum over the ranks, + residual
                                                    (kernels/collectives.py)

ROWS. The row-wise ops that carry most of a step's work (linear, linear_q, rms_norm, silu_mul) take an optional
`rows`: the step's query_start (S+1,) int32. Its last value counts the real token rows of the padded bucket; with
`per_sequence` (linear and linear_q, for the lm_head over the gathered logits rows) the real rows are the
sequences with tokens, the first 1 + the last s with query_start[s+1] > query_start[s]. The native CPU kernels
read it at each call and compute only those rows, leaving the padding rows of `out` as they were, so a CPU step
costs its tokens rather than its bucket; the references and the CUDA kernels (whose graphs replay a bucket whole)
compute every row. Nothing reads a padding row: attention takes each sequence's rows from query_start, and the
logits of padding sequences are never sampled.

`CPU_PREPARE` maps each op's name to the function the planned executor uses to bind it once on CPU (checks and
views at bind time, only arithmetic per step); the op's own CPU kernel runs the same function, so the eager and the
planned paths agree bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from slabserve.kernels import collectives, contracts, cpu_native, reference

_LIB = "slabserve"


# --- rms_norm -------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::rms_norm", mutates_args=("out", "workspace"), device_types="cpu")
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, out: Tensor, workspace: Optional[Tensor] = None,
                 rows: Optional[Tensor] = None) -> None:
    cpu_native.prepare_rms_norm(x, weight, eps, out, workspace, rows)()


@_rms_norm_op.register_kernel("cuda")
def _rms_norm_cuda(x: Tensor, weight: Tensor, eps: float, out: Tensor, workspace: Optional[Tensor] = None,
                   rows: Optional[Tensor] = None) -> None:  # every row: a graph replays its bucket whole
    from slabserve.kernels.triton_rmsnorm import rms_norm_triton
    rms_norm_triton(x, weight, eps, out)


@_rms_norm_op.register_fake
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float, out: Tensor, workspace: Optional[Tensor] = None,
                   rows: Optional[Tensor] = None) -> None:
    contracts.check_rms_norm(x, weight, out)
    contracts.check_live_rows("rms_norm", rows)


# --- rope -----------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::rope", mutates_args=("q", "k", "workspace"), device_types="cpu")
def _rope_op(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, workspace: Optional[Tensor] = None) -> None:
    cpu_native.prepare_rope(q, k, positions, cos_sin, workspace)()


@_rope_op.register_kernel("cuda")
def _rope_cuda(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, workspace: Optional[Tensor] = None) -> None:
    from slabserve.kernels.triton_rope import rope_triton
    rope_triton(q, k, positions, cos_sin)


@_rope_op.register_fake
def _rope_fake(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, workspace: Optional[Tensor] = None) -> None:
    contracts.check_rope(q, k, positions, cos_sin)


# --- silu_mul -------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::silu_mul", mutates_args=("out",), device_types="cpu")
def _silu_mul_op(gate_up: Tensor, out: Tensor, rows: Optional[Tensor] = None) -> None:
    cpu_native.prepare_silu_mul(gate_up, out, rows)()


@_silu_mul_op.register_kernel("cuda")
def _silu_mul_cuda(gate_up: Tensor, out: Tensor, rows: Optional[Tensor] = None) -> None:  # every row
    from slabserve.kernels.triton_silu_mul import silu_mul_triton
    silu_mul_triton(gate_up, out)


@_silu_mul_op.register_fake
def _silu_mul_fake(gate_up: Tensor, out: Tensor, rows: Optional[Tensor] = None) -> None:
    contracts.check_silu_mul(gate_up, out)
    contracts.check_live_rows("silu_mul", rows)


# --- kv_write -------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::kv_write", mutates_args=("k_cache", "v_cache"), device_types="cpu")
def _kv_write_op(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    cpu_native.prepare_kv_write(k, v, k_cache, v_cache, slot_mapping)()


@_kv_write_op.register_kernel("cuda")
def _kv_write_cuda(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    from slabserve.kernels.triton_kv_write import kv_write_triton
    kv_write_triton(k, v, k_cache, v_cache, slot_mapping)


@_kv_write_op.register_fake
def _kv_write_fake(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    contracts.check_kv_write(k, v, k_cache, v_cache, slot_mapping)


# --- slab_attention (prefill form; decode rows are sequences with q_len 1) --------------------------------

@torch.library.custom_op(f"{_LIB}::slab_attention", mutates_args=("out", "workspace"), device_types="cpu")
def _slab_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start: Tensor, slab_offset: Tensor,
                       context_len: Tensor, scale: float, out: Tensor, workspace: Optional[Tensor] = None) -> None:
    cpu_native.prepare_slab_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, scale, out,
                                      workspace)()


@_slab_attention_op.register_kernel("cuda")
def _slab_attention_cuda(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start: Tensor, slab_offset: Tensor,
                         context_len: Tensor, scale: float, out: Tensor, workspace: Optional[Tensor] = None) -> None:
    # the Triton kernel keeps its scores in registers; the CPU path's workspace is not needed here
    from slabserve.kernels.triton_slab_attention import slab_prefill_attention_triton
    slab_prefill_attention_triton(q, k_cache, v_cache, query_start, slab_offset, context_len, scale, out)


@_slab_attention_op.register_fake
def _slab_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start: Tensor, slab_offset: Tensor,
                         context_len: Tensor, scale: float, out: Tensor, workspace: Optional[Tensor] = None) -> None:
    contracts.check_slab_prefill_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, out,
                                           workspace)


# --- slab_decode_attention ------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::slab_decode_attention", mutates_args=("out", "workspace"), device_types="cpu")
def _slab_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, slab_offset: Tensor, context_len: Tensor,
                    scale: float, out: Tensor, workspace: Optional[Tensor]) -> None:
    reference.slab_decode_attention_ref(q, k_cache, v_cache, slab_offset, context_len, scale, out, workspace)


@_slab_decode_op.register_kernel("cuda")
def _slab_decode_cuda(q: Tensor, k_cache: Tensor, v_cache: Tensor, slab_offset: Tensor, context_len: Tensor,
                      scale: float, out: Tensor, workspace: Optional[Tensor]) -> None:
    from slabserve.kernels.triton_slab_attention import slab_decode_attention_triton
    slab_decode_attention_triton(q, k_cache, v_cache, slab_offset, context_len, scale, out, workspace)


@_slab_decode_op.register_fake
def _slab_decode_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, slab_offset: Tensor, context_len: Tensor,
                      scale: float, out: Tensor, workspace: Optional[Tensor]) -> None:
    contracts.check_slab_decode_attention(q, k_cache, v_cache, slab_offset, context_len, out, workspace)


# --- linear (CPU; weights in the panel layout the native kernel reads) --------------------------------------

@torch.library.custom_op(f"{_LIB}::linear", mutates_args=("out",), device_types="cpu")
def _linear_op(x: Tensor, w: Tensor, out: Tensor, residual: Optional[Tensor] = None,
               rows: Optional[Tensor] = None, per_sequence: bool = False) -> None:
    if cpu_native.available():
        cpu_native.linear_native(x, w, out, residual, rows, per_sequence)
    else:
        reference.linear_ref(x, w, out, residual, rows)


@_linear_op.register_fake
def _linear_fake(x: Tensor, w: Tensor, out: Tensor, residual: Optional[Tensor] = None,
                 rows: Optional[Tensor] = None, per_sequence: bool = False) -> None:
    contracts.check_linear(x, w, out, residual)
    contracts.check_live_rows("linear", rows)


# --- linear_q and embed_q (CPU; weights in GGUF blocks, kernels.quant) --------------------------------------

@torch.library.custom_op(f"{_LIB}::linear_q", mutates_args=("out",), device_types="cpu")
def _linear_q_op(x: Tensor, w: Tensor, out: Tensor, residual: Optional[Tensor], qtype: int,
                 rows: Optional[Tensor] = None, per_sequence: bool = False) -> None:
    if cpu_native.available():
        cpu_native.prepare_linear_q(x, w, out, residual, qtype, rows, per_sequence)()
    else:
        reference.linear_q_ref(x, w, out, residual, qtype, rows)


@_linear_q_op.register_fake
def _linear_q_fake(x: Tensor, w: Tensor, out: Tensor, residual: Optional[Tensor], qtype: int,
                   rows: Optional[Tensor] = None, per_sequence: bool = False) -> None:
    contracts.check_linear_q(x, w, out, residual, qtype)
    contracts.check_live_rows("linear_q", rows)


@torch.library.custom_op(f"{_LIB}::embed_q", mutates_args=("out",), device_types="cpu")
def _embed_q_op(ids: Tensor, w: Tensor, out: Tensor, qtype: int) -> None:
    if cpu_native.available():
        cpu_native.prepare_embed_q(ids, w, out, qtype)()
    else:
        reference.embed_q_ref(ids, w, out, qtype)


@_embed_q_op.register_fake
def _embed_q_fake(ids: Tensor, w: Tensor, out: Tensor, qtype: int) -> None:
    contracts.check_embed_q(ids, w, out, qtype)


CPU_PREPARE = {"rms_norm": cpu_native.prepare_rms_norm, "rope": cpu_native.prepare_rope,
               "silu_mul": cpu_native.prepare_silu_mul, "kv_write": cpu_native.prepare_kv_write,
               "slab_attention": cpu_native.prepare_slab_attention, "linear": cpu_native.prepare_linear,
               "linear_q": cpu_native.prepare_linear_q, "embed_q": cpu_native.prepare_embed_q,
               "all_reduce_residual": collectives.prepare_all_reduce_residual}


# --- the functions models call ----------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor, workspace: Optional[Tensor] = None,
             rows: Optional[Tensor] = None) -> Tensor:
    """x (T, N), weight (N,), out (T, N): RMSNorm into out. `rows`: the real rows, as ROWS above."""
    torch.ops.slabserve.rms_norm(x, weight, eps, out, workspace, rows)
    return out


def rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, workspace: Optional[Tensor] = None) -> None:
    """q (T, H, D), k (T, Hkv, D) rotated in place (neox rotate_half) at positions (T,) int64.

    cos_sin (P, D) float32: cos_sin[p, :D/2] = cos(p * inv_freq), cos_sin[p, D/2:] = sin(p * inv_freq).
    """
    torch.ops.slabserve.rope(q, k, positions, cos_sin, workspace)


def silu_mul(gate_up: Tensor, out: Tensor, rows: Optional[Tensor] = None) -> Tensor:
    """gate_up (T, 2I), out (T, I) = silu(gate) * up. `rows`: the real rows, as ROWS above."""
    torch.ops.slabserve.silu_mul(gate_up, out, rows)
    return out


def kv_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k, v (T, Hkv, D) into cache rows slot_mapping (T,); slot -1 skips the row."""
    torch.ops.slabserve.kv_write(k, v, k_cache, v_cache, slot_mapping)


def slab_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start: Tensor,
                           slab_offset: Tensor, context_len: Tensor, scale: float, out: Tensor,
                           workspace: Optional[Tensor] = None) -> Tensor:
    """q (T, H, D) flat rows of S sequences over their slabs, into out (T, H, D); workspace: CPU scratch."""
    torch.ops.slabserve.slab_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, scale, out,
                                       workspace)
    return out


def slab_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slab_offset: Tensor, context_len: Tensor,
                          scale: float, out: Tensor, workspace: Optional[Tensor] = None) -> Tensor:
    """q (S, H, D), one query per sequence, over its whole slab, into out (S, H, D)."""
    torch.ops.slabserve.slab_decode_attention(q, k_cache, v_cache, slab_offset, context_len, scale, out, workspace)
    return out


def linear(x: Tensor, w: Tensor, out: Tensor, residual: Optional[Tensor] = None,
           rows: Optional[Tensor] = None, per_sequence: bool = False) -> Tensor:
    """x (M, K) @ W into out (M, N), plus residual (M, N) when given; w is W packed as (ceil(N / 16), K, 16).
    `rows`, `per_sequence`: the real rows, as ROWS above."""
    torch.ops.slabserve.linear(x, w, out, residual, rows, per_sequence)
    return out


def linear_q(x: Tensor, w: Tensor, out: Tensor, residual: Optional[Tensor], qtype: int,
             rows: Optional[Tensor] = None, per_sequence: bool = False) -> Tensor:
    """x (M, K) @ W^T into out (M, N) (+ residual): W (N, row_bytes) uint8 rows of GGML type `qtype` blocks.
    `rows`, `per_sequence`: the real rows, as ROWS above."""
    torch.ops.slabserve.linear_q(x, w, out, residual, qtype, rows, per_sequence)
    return out


def embed_q(ids: Tensor, w: Tensor, out: Tensor, qtype: int) -> Tensor:
    """out (T, K) = the rows ids (T,) of W (V, row_bytes) uint8 rows of GGML type `qtype` blocks, dequantized."""
    torch.ops.slabserve.embed_q(ids, w, out, qtype)
    return out
