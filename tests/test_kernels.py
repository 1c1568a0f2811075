"""Tests of `kernels/`: references against naive formulas, Triton kernels against references, sm_90 compiles,
and the `slabserve::` custom ops.

How the Triton parts run without a GPU (and without depending on test order):
- `triton.jit` picks interpret mode when the decorator runs, so the interpreted checks run in ONE subprocess
  started with TRITON_INTERPRET=1 (this file run as a script: `python tests/test_kernels.py interpreted`);
  each check reports pass or its traceback as JSON, and `test_triton_interpreted[...]` asserts one check each.
  On a GPU the same checks run in-process on CUDA tensors (`test_triton_on_cuda`, marked `cuda`).
- The sm_90 compiles run in another subprocess WITHOUT TRITON_INTERPRET (`... compile`), so the kernels are
  real JITFunctions; `triton.compile` with GPUTarget("cuda", 90, 32) must produce PTX and a cubin.
The main pytest process never imports Triton kernels, so it is unaffected by either mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from slabserve import kernels
from slabserve.kernels import contracts

REPO = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (atol, rtol) per dtype, against float64 naive formulas and between kernel and reference
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
# (num_heads, num_kv_heads): GQA with a non-power-of-two group (as SmolLM2's 9/3), MHA, MQA-like group of 4
HEAD_CONFIGS = {"gqa3": (6, 2), "mha": (2, 2), "group4": (4, 1)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------------------
# Inputs shared by the reference tests, the interpreted kernel checks and the custom-op tests
# ---------------------------------------------------------------------------------------------------------

def randn(*shape: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """The same values on every device (drawn on the CPU)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@dataclass
class Qkv:
    """One fused qkv activation and the strided (T, heads, D) views the model takes of it."""

    qkv: torch.Tensor  # (T, (H + 2 Hkv) D + 8): 8 spare columns so rows are not tightly packed
    q: torch.Tensor  # (T, H, D) view
    k: torch.Tensor  # (T, Hkv, D) view
    v: torch.Tensor  # (T, Hkv, D) view


def make_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             seed: int = 0, device: str = "cpu") -> Qkv:
    q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_cols + 2 * kv_cols + 8, dtype=dtype, seed=seed, device=device)
    q = qkv[:, :q_cols].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_cols:q_cols + kv_cols].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_cols + kv_cols:q_cols + 2 * kv_cols].view(num_tokens, num_kv_heads, head_dim)
    return Qkv(qkv, q, k, v)


def rope_table(head_dim: int, max_position: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_sin (P, D) float32, inv_freq (D/2,) float64) as the model builds them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq).float()  # (P, D/2)
    return torch.cat([angles.cos(), angles.sin()], dim=1), inv_freq


@dataclass
class SlabBatch:
    """A mixed step: several slabs of different lengths, padding sequences and padding rows."""

    q: torch.Tensor  # (T, H, D) strided view into a fused qkv
    k_cache: torch.Tensor  # (N, Hkv, D)
    v_cache: torch.Tensor  # (N, Hkv, D)
    query_start: torch.Tensor  # (S + 1,) int32
    slab_offset: torch.Tensor  # (S,) int64
    context_len: torch.Tensor  # (S,) int32
    scale: float


# seq 0: fresh prefill of 40 (several query blocks); 1: padding; 2: a 7-token chunk after 123 cached tokens;
# 3: a decode row; 4: a 2-token prefill; 5: padding. Five padding rows follow query_start[S].
PREFILL_Q_LENS = (40, 0, 7, 1, 2, 0)
PREFILL_CONTEXTS = (40, 0, 130, 75, 2, 0)
PREFILL_OFFSETS = (0, 0, 200, 64, 400, 0)
PREFILL_PADDING_ROWS = 5
# decode: a long slab (several splits, several key tiles per split), padding, short slabs
DECODE_CONTEXTS = (700, 0, 33, 1, 256)
DECODE_OFFSETS = (0, 0, 800, 1000, 1100)


def make_prefill_batch(dtype: torch.dtype, heads: str, head_dim: int = 16, seed: int = 0,
                       device: str = "cpu") -> SlabBatch:
    num_heads, num_kv_heads = HEAD_CONFIGS[heads]
    num_tokens = sum(PREFILL_Q_LENS) + PREFILL_PADDING_ROWS
    starts = [0]
    for q_len in PREFILL_Q_LENS:
        starts.append(starts[-1] + q_len)
    return SlabBatch(
        q=make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed, device).q,
        k_cache=randn(420, num_kv_heads, head_dim, dtype=dtype, seed=seed + 1, device=device),
        v_cache=randn(420, num_kv_heads, head_dim, dtype=dtype, seed=seed + 2, device=device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        slab_offset=torch.tensor(PREFILL_OFFSETS, dtype=torch.int64, device=device),
        context_len=torch.tensor(PREFILL_CONTEXTS, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
    )


def make_decode_batch(dtype: torch.dtype, heads: str, head_dim: int = 16, seed: int = 0,
                      device: str = "cpu") -> SlabBatch:
    num_heads, num_kv_heads = HEAD_CONFIGS[heads]
    num_seqs = len(DECODE_CONTEXTS)
    return SlabBatch(
        q=make_qkv(num_seqs, num_heads, num_kv_heads, head_dim, dtype, seed, device).q,
        k_cache=randn(1400, num_kv_heads, head_dim, dtype=dtype, seed=seed + 1, device=device),
        v_cache=randn(1400, num_kv_heads, head_dim, dtype=dtype, seed=seed + 2, device=device),
        query_start=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        slab_offset=torch.tensor(DECODE_OFFSETS, dtype=torch.int64, device=device),
        context_len=torch.tensor(DECODE_CONTEXTS, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
    )


def sentinel_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any row a kernel forgets to write fails the comparison."""
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)


def prefill_args(b: SlabBatch, out: torch.Tensor) -> tuple:
    return (b.q, b.k_cache, b.v_cache, b.query_start, b.slab_offset, b.context_len, b.scale, out)


def decode_args(b: SlabBatch, out: torch.Tensor, workspace: torch.Tensor | None = None) -> tuple:
    return (b.q, b.k_cache, b.v_cache, b.slab_offset, b.context_len, b.scale, out, workspace)


# ---------------------------------------------------------------------------------------------------------
# Naive, obviously-correct formulas (float64, explicit loops)
# ---------------------------------------------------------------------------------------------------------

def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight.double()


def naive_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    angles = positions.double()[:, None, None] * inv_freq  # (T, 1, D/2)
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)


def naive_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def naive_slab_attention(b: SlabBatch) -> torch.Tensor:
    """Loop over sequences; dense scores, an explicit causal mask from absolute positions, softmax."""
    num_tokens, num_heads, head_dim = b.q.shape
    group = num_heads // b.k_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for s in range(b.slab_offset.shape[0]):
        begin, end = int(b.query_start[s]), int(b.query_start[s + 1])
        context, offset = int(b.context_len[s]), int(b.slab_offset[s])
        if end == begin or context == 0:
            continue
        k = b.k_cache[offset:offset + context].double().repeat_interleave(group, dim=1)  # (C, H, D)
        v = b.v_cache[offset:offset + context].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,chd->hlc", b.q[begin:end].double(), k) * b.scale  # (H, L, C)
        positions = torch.arange(context - (end - begin), context)  # (L,)
        visible = torch.arange(context)[None, :] <= positions[:, None]  # (L, C)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[begin:end] = torch.einsum("hlc,chd->lhd", torch.softmax(scores, dim=-1), v)
    return out


# ---------------------------------------------------------------------------------------------------------
# 1) References against the naive formulas (the proof of the CPU serving path)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_ref(dtype):
    x_wide = randn(7, 80, dtype=dtype, seed=1)  # (T, 80)
    x = x_wide[:, :48]  # (T, N) with row stride 80
    weight = randn(48, dtype=dtype, seed=2)
    out = sentinel_like(x)
    assert kernels.rms_norm_ref(x, weight, 1e-5, out) is out
    assert_close(out, naive_rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_ref(dtype):
    t = make_qkv(6, 6, 2, 16, dtype)
    q0, k0, rest = t.q.clone(), t.k.clone(), t.qkv[:, 128:].clone()
    cos_sin, inv_freq = rope_table(16, 40)
    positions = torch.tensor([0, 1, 2, 39, 17, 0])  # the last row is padding at position 0
    assert kernels.rope_ref(t.q, t.k, positions, cos_sin) is None
    assert_close(t.q, naive_rope(q0, positions, inv_freq), dtype)
    assert_close(t.k, naive_rope(k0, positions, inv_freq), dtype)
    assert torch.equal(t.qkv[:, 128:], rest)  # v and the spare columns are untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_ref(dtype):
    gate_up = randn(5, 104, dtype=dtype, seed=3)[:, :96]  # (T, 2I) with row stride 104
    out = sentinel_like(gate_up[:, :48])
    assert kernels.silu_mul_ref(gate_up, out) is out
    assert_close(out, naive_silu_mul(gate_up), dtype)


@pytest.mark.parametrize("slots", [[3, 0, 9, 4], [3, -1, 9, -1]], ids=["all_valid", "padding"])
def test_kv_write_ref(slots):
    t = make_qkv(4, 4, 2, 8, torch.float16)
    k_cache = torch.full((12, 2, 8), -7.0, dtype=torch.float16)
    v_cache = torch.full((12, 2, 8), -7.0, dtype=torch.float16)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot], expected_v[slot] = t.k[token], t.v[token]
    kernels.kv_write_ref(t.k, t.v, k_cache, v_cache, torch.tensor(slots))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slab_prefill_attention_ref(dtype, heads):
    b = make_prefill_batch(dtype, heads)
    out = sentinel_like(b.q)
    assert kernels.slab_prefill_attention_ref(*prefill_args(b, out)) is out
    assert_close(out, naive_slab_attention(b), dtype)


@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slab_decode_attention_ref(dtype, heads):
    b = make_decode_batch(dtype, heads)
    out = sentinel_like(b.q)
    assert kernels.slab_decode_attention_ref(*decode_args(b, out)) is out
    assert_close(out, naive_slab_attention(b), dtype)


def test_decode_equals_prefill_form_with_one_query_per_sequence():
    b = make_decode_batch(torch.float32, "gqa3")
    decode = kernels.slab_decode_attention_ref(*decode_args(b, sentinel_like(b.q)))
    prefill = kernels.slab_prefill_attention_ref(*prefill_args(b, sentinel_like(b.q)))
    torch.testing.assert_close(decode, prefill)


# ---------------------------------------------------------------------------------------------------------
# 2) Contracts and the decode workspace
# ---------------------------------------------------------------------------------------------------------

def _bad_calls():
    x, w = torch.randn(4, 8), torch.randn(8)
    q, cache, cache2 = torch.randn(4, 6, 8), torch.randn(16, 4, 8), torch.randn(16, 2, 8)  # 4 kv heads, 2 kv heads
    meta = (torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0]), torch.tensor([4], dtype=torch.int32))
    return {
        "out dtype": (kernels.rms_norm_ref, (x, w, 1e-6, torch.empty(4, 8, dtype=torch.float16)), "out has dtype"),
        "weight shape": (kernels.rms_norm_ref, (x, torch.randn(9), 1e-6, torch.empty(4, 8)), "weight has shape"),
        "strided last dim": (kernels.rms_norm_ref, (torch.randn(8, 4).t(), w, 1e-6, torch.empty(4, 8)),
                             "contiguous last dim"),
        "heads not a multiple": (kernels.slab_prefill_attention_ref, (q, cache, cache, *meta, 1.0, torch.empty_like(q)),
                                 "multiple of num_kv_heads"),
        "int64 query_start": (kernels.slab_prefill_attention_ref,
                              (q, cache2, cache2, meta[0].long(), *meta[1:], 1.0, torch.empty_like(q)),
                              "query_start has dtype"),
        "odd gate_up": (kernels.silu_mul_ref, (torch.randn(4, 7), torch.empty(4, 3)), "must be even"),
        "workspace shape": (kernels.slab_decode_attention_ref,
                            (q[:1], cache2, cache2, *meta[1:], 1.0, torch.empty_like(q[:1]),
                             torch.empty(1, 6, 2, 8)), "decode_workspace_shape"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_contract_violations_name_the_argument(case):
    fn, args, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        fn(*args)


def test_decode_workspace_shape():
    assert [kernels.decode_num_splits(n) for n in (0, 1, 256, 257, 800, 10**6)] == [1, 1, 1, 2, 4, 16]
    spec = kernels.decode_workspace_shape(8, 9, 64, max_context=2048)
    assert spec.shape == (8, 9, 8, 66) and spec.dtype == torch.float32 and spec.num_splits == 8
    assert spec.nbytes == 8 * 9 * 8 * 66 * 4
    assert kernels.new_decode_workspace(spec, "cpu").shape == spec.shape
    b = make_decode_batch(torch.float32, "gqa3")  # a workspace sized by the helper passes the contract
    workspace = kernels.new_decode_workspace(kernels.decode_workspace_shape(5, 6, 16, 700), "cpu")
    contracts.check_slab_decode_attention(b.q, b.k_cache, b.v_cache, b.slab_offset, b.context_len,
                                          torch.empty_like(b.q), workspace)


def test_import_is_cheap_and_needs_no_triton():
    code = "import sys, kernels, kernels.ops; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env=_subprocess_env(interpret=False))


# ---------------------------------------------------------------------------------------------------------
# 3) Custom ops: CPU dispatch equals the references; torch.export keeps each op as one node
# ---------------------------------------------------------------------------------------------------------

def test_custom_ops_on_cpu_equal_references():
    dtype = torch.bfloat16
    x, weight = randn(5, 32, dtype=dtype, seed=1), randn(32, dtype=dtype, seed=2)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6, torch.empty_like(x)),
                               kernels.rms_norm_ref(x, weight, 1e-6, torch.empty_like(x)), rtol=0, atol=0)
    gate_up = randn(5, 64, dtype=dtype, seed=3)
    torch.testing.assert_close(kernels.silu_mul(gate_up, torch.empty(5, 32, dtype=dtype)),
                               kernels.silu_mul_ref(gate_up, torch.empty(5, 32, dtype=dtype)), rtol=0, atol=0)
    a, r = make_qkv(6, 6, 2, 16, dtype), make_qkv(6, 6, 2, 16, dtype)
    cos_sin, _ = rope_table(16, 8)
    positions = torch.tensor([0, 1, 2, 3, 7, 0])
    kernels.rope(a.q, a.k, positions, cos_sin)
    kernels.rope_ref(r.q, r.k, positions, cos_sin)
    assert torch.equal(a.qkv, r.qkv)
    caches = [torch.zeros(9, 2, 16, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([4, -1, 0, 8, -1, 2])
    kernels.kv_write(a.k, a.v, caches[0], caches[1], slots)
    kernels.kv_write_ref(r.k, r.v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_attention_custom_ops_on_cpu_equal_references():
    p = make_prefill_batch(torch.float16, "gqa3")
    torch.testing.assert_close(kernels.slab_prefill_attention(*prefill_args(p, sentinel_like(p.q))),
                               kernels.slab_prefill_attention_ref(*prefill_args(p, sentinel_like(p.q))),
                               rtol=0, atol=0)
    d = make_decode_batch(torch.float16, "gqa3")
    workspace = kernels.new_decode_workspace(kernels.decode_workspace_shape(5, 6, 16, 700), "cpu")
    for ws in (None, workspace):
        torch.testing.assert_close(kernels.slab_decode_attention(*decode_args(d, sentinel_like(d.q), ws)),
                                   kernels.slab_decode_attention_ref(*decode_args(d, sentinel_like(d.q))),
                                   rtol=0, atol=0)


class TinyLayer(torch.nn.Module):
    """A toy attention + MLP layer built from the six ops, with every output buffer explicit."""

    def __init__(self, hidden: int = 32, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.norm = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.qkv = torch.nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.up = torch.nn.Linear(num_heads * head_dim, 2 * hidden, bias=False)

    def forward(self, x, positions, cos_sin, k_cache, v_cache, slots, query_start, slab_offset, context_len):
        num_tokens = x.shape[0]
        num_heads, num_kv_heads, head_dim = self.shape
        h = kernels.rms_norm(x, self.norm, 1e-6, torch.empty_like(x))  # (T, hidden)
        qkv = self.qkv(h)  # (T, (H + 2 Hkv) D)
        q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
        kernels.rope(q, k, positions, cos_sin)
        kernels.kv_write(k, v, k_cache, v_cache, slots)
        attn = kernels.slab_prefill_attention(q, k_cache, v_cache, query_start, slab_offset, context_len,
                                              head_dim ** -0.5, torch.empty(num_tokens, num_heads, head_dim))
        last = query_start[1:] - 1  # (S,) the last row of each sequence decodes again, as a check
        decode = kernels.slab_decode_attention(q.index_select(0, last), k_cache, v_cache, slab_offset,
                                               context_len, head_dim ** -0.5, torch.empty(last.shape[0], num_heads, head_dim))
        act = kernels.silu_mul(self.up(attn.view(num_tokens, -1)), torch.empty_like(x))  # (T, hidden)
        return act, decode


def tiny_layer_inputs() -> tuple:
    cos_sin, _ = rope_table(8, 16)
    return (
        torch.randn(6, 32), torch.tensor([0, 1, 2, 3, 0, 0]), cos_sin,
        torch.zeros(20, 2, 8), torch.zeros(20, 2, 8), torch.tensor([10, 11, 12, 3, 0, -1]),
        torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([10, 0]), torch.tensor([3, 4], dtype=torch.int32),
    )


def test_export_keeps_each_op_as_one_node():
    torch.manual_seed(0)
    layer, inputs = TinyLayer().eval(), tiny_layer_inputs()
    with torch.no_grad():
        eager = layer(*[t.clone() for t in inputs])
        program = torch.export.export(layer, tuple(t.clone() for t in inputs))
        exported = program.module()(*[t.clone() for t in inputs])
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    for name in ("rms_norm", "rope", "kv_write", "slab_attention", "slab_decode_attention", "silu_mul"):
        assert targets.count(getattr(torch.ops.slabserve, name).default) == 1, name
    for got, want in zip(exported, eager):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["rms_norm", "silu_mul", "rope", "kv_write", "slab_attention",
                                  "slab_decode_attention"])
def test_opcheck(name):
    """torch.library.opcheck: schema (declared mutations), fake impl and dispatch registrations agree."""
    p, t = make_prefill_batch(torch.float32, "gqa3"), make_qkv(4, 4, 2, 8, torch.float32)
    d = make_decode_batch(torch.float32, "gqa3")
    cos_sin, _ = rope_table(8, 8)
    args = {
        "rms_norm": (t.qkv[:, :16], torch.randn(16), 1e-6, torch.empty(4, 16)),
        "silu_mul": (t.qkv[:, :16], torch.empty(4, 8)),
        "rope": (t.q, t.k, torch.tensor([0, 1, 5, 0]), cos_sin),
        "kv_write": (t.k, t.v, torch.zeros(6, 2, 8), torch.zeros(6, 2, 8), torch.tensor([5, -1, 0, 2])),
        "slab_attention": prefill_args(p, torch.empty_like(p.q)),
        "slab_decode_attention": decode_args(d, torch.empty_like(d.q)),
    }[name]
    torch.library.opcheck(getattr(torch.ops.slabserve, name).default, args,
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------------
# 4) Triton kernels under TRITON_INTERPRET=1, against the references (run in a subprocess, see top)
# ---------------------------------------------------------------------------------------------------------

TRITON_CHECKS: dict = {}
# The Triton 3.9 interpreter computes bf16 tl.dot wrongly (~1e10 off on a plain 16x16 product; fp16 and fp32
# are exact), so interpreted attention runs fp32 and fp16 only; bf16 attention is covered by the sm_90
# compile below and by test_triton_on_cuda on a GPU. The elementwise kernels run all three dtypes.
INTERPRETER_DOT_DTYPES = (torch.float32, torch.float16)


def triton_check(fn):
    """Register a check of Triton kernels on `device` against the references on the CPU."""
    TRITON_CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@triton_check
def check_rms_norm(device: str, dot_dtypes: tuple) -> None:
    for dtype in DTYPES:
        x, x_cpu = (randn(7, 80, dtype=dtype, seed=1, device=dev)[:, :48] for dev in (device, "cpu"))  # stride 80
        weight, weight_cpu = (randn(48, dtype=dtype, seed=2, device=dev) for dev in (device, "cpu"))
        got = kernels.rms_norm_triton(x, weight, 1e-5, sentinel_like(x))
        assert_close(got.cpu(), kernels.rms_norm_ref(x_cpu, weight_cpu, 1e-5, sentinel_like(x_cpu)), dtype)


@triton_check
def check_rope(device: str, dot_dtypes: tuple) -> None:
    cos_sin, _ = rope_table(16, 40)
    positions = torch.tensor([0, 1, 2, 39, 17, 0])  # the last row is padding at position 0
    for dtype in DTYPES:
        for num_heads, num_kv_heads in HEAD_CONFIGS.values():
            got = make_qkv(6, num_heads, num_kv_heads, 16, dtype, device=device)
            want = make_qkv(6, num_heads, num_kv_heads, 16, dtype)
            kernels.rope_triton(got.q, got.k, positions.to(device), cos_sin.to(device))
            kernels.rope_ref(want.q, want.k, positions, cos_sin)
            assert_close(got.qkv.cpu(), want.qkv, dtype)  # q, k rotated; v and spare columns untouched


@triton_check
def check_silu_mul(device: str, dot_dtypes: tuple) -> None:
    for dtype in DTYPES:
        for inter in (48, 1500):  # 1500: two column blocks, the second partial
            gate_up, gate_up_cpu = (randn(3, 2 * inter + 8, dtype=dtype, seed=3, device=dev)[:, :2 * inter]
                                    for dev in (device, "cpu"))
            got = kernels.silu_mul_triton(gate_up, sentinel_like(gate_up[:, :inter]))
            want = kernels.silu_mul_ref(gate_up_cpu, sentinel_like(gate_up_cpu[:, :inter]))
            assert_close(got.cpu(), want, dtype)


@triton_check
def check_kv_write(device: str, dot_dtypes: tuple) -> None:
    slots = torch.tensor([3, -1, 9, 0, -1, 11])
    for dtype in DTYPES:
        got, want = make_qkv(6, 6, 2, 16, dtype, device=device), make_qkv(6, 6, 2, 16, dtype)
        caches = [torch.full((12, 2, 16), -7.0, dtype=dtype) for _ in range(4)]  # untouched rows stay -7
        got_k, got_v = caches[0].to(device), caches[1].to(device)
        kernels.kv_write_triton(got.k, got.v, got_k, got_v, slots.to(device))
        kernels.kv_write_ref(want.k, want.v, caches[2], caches[3], slots)
        assert torch.equal(got_k.cpu(), caches[2]) and torch.equal(got_v.cpu(), caches[3])


def attention_cases(dot_dtypes: tuple) -> list:
    """(dtype, heads, head_dim): every dtype on GQA with group 3, plus MHA, group 4 and head_dim 24."""
    cases = [(dtype, "gqa3", 16) for dtype in dot_dtypes]
    return cases + [(torch.float16, "mha", 16), (torch.float32, "group4", 16), (torch.float16, "gqa3", 24)]


@triton_check
def check_slab_prefill_attention(device: str, dot_dtypes: tuple) -> None:
    for dtype, heads, head_dim in attention_cases(dot_dtypes):
        b = make_prefill_batch(dtype, heads, head_dim, device=device)
        c = make_prefill_batch(dtype, heads, head_dim)
        got = kernels.slab_prefill_attention_triton(*prefill_args(b, sentinel_like(b.q)))
        want = kernels.slab_prefill_attention_ref(*prefill_args(c, sentinel_like(c.q)))
        assert_close(got.cpu(), want, dtype)


@triton_check
def check_slab_decode_attention(device: str, dot_dtypes: tuple) -> None:
    for dtype, heads, head_dim in attention_cases(dot_dtypes):
        b = make_decode_batch(dtype, heads, head_dim, device=device)
        c = make_decode_batch(dtype, heads, head_dim)
        want = kernels.slab_decode_attention_ref(*decode_args(c, sentinel_like(c.q)))
        spec = kernels.decode_workspace_shape(b.q.shape[0], b.q.shape[1], head_dim, max_context=800)
        assert spec.num_splits == 4  # the 700-token slab spans all of them, several key tiles each
        workspace = torch.full(spec.shape, float("nan"), device=device)  # stale contents must not leak
        got = kernels.slab_decode_attention_triton(*decode_args(b, sentinel_like(b.q), workspace))
        assert_close(got.cpu(), want, dtype)
        # no workspace: allocated with splits sized for the whole arena (1400 rows -> 6 splits)
        got = kernels.slab_decode_attention_triton(*decode_args(b, sentinel_like(b.q)))
        assert_close(got.cpu(), want, dtype)


@triton_check
def check_slab_attention_split_decode(device: str, dot_dtypes: tuple) -> None:
    """The step's form on CUDA: with a decode workspace, one-row sequences go to the split decode kernels and the
    rest to the prefill kernel, each deciding from query_start on the device; every row must come out as the
    reference's, padding rows (5 trailing, then exactly 1) and empty sequence slots included."""
    for dtype, heads, head_dim in attention_cases(dot_dtypes):
        b = make_prefill_batch(dtype, heads, head_dim, device=device)
        c = make_prefill_batch(dtype, heads, head_dim)
        spec = kernels.decode_workspace_shape(b.slab_offset.shape[0], b.q.shape[1], head_dim, max_context=420)
        workspace = torch.full(spec.shape, float("nan"), device=device)
        got = kernels.slab_prefill_attention_triton(*prefill_args(b, sentinel_like(b.q)), workspace)
        want = kernels.slab_prefill_attention_ref(*prefill_args(c, sentinel_like(c.q)))
        assert_close(got.cpu(), want, dtype)
    dtype = dot_dtypes[0]
    num_heads, num_kv_heads = HEAD_CONFIGS["gqa3"]
    q_lens, contexts, offsets = (1, 1, 3, 1, 0), (300, 1, 3, 64, 0), (0, 300, 310, 320, 0)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    def batch_on(dev: str) -> SlabBatch:
        return SlabBatch(q=make_qkv(starts[-1] + 1, num_heads, num_kv_heads, 16, dtype, 4, dev).q,
                         k_cache=randn(400, num_kv_heads, 16, dtype=dtype, seed=5, device=dev),
                         v_cache=randn(400, num_kv_heads, 16, dtype=dtype, seed=6, device=dev),
                         query_start=torch.tensor(starts, dtype=torch.int32, device=dev),
                         slab_offset=torch.tensor(offsets, dtype=torch.int64, device=dev),
                         context_len=torch.tensor(contexts, dtype=torch.int32, device=dev), scale=0.25)

    b, c = batch_on(device), batch_on("cpu")
    spec = kernels.decode_workspace_shape(len(q_lens), num_heads, 16, max_context=400)
    assert spec.num_splits == 2  # the 300-key row spans both
    got = kernels.slab_prefill_attention_triton(*prefill_args(b, sentinel_like(b.q)),
                                                torch.full(spec.shape, float("nan"), device=device))
    want = kernels.slab_prefill_attention_ref(*prefill_args(c, sentinel_like(c.q)))
    assert_close(got.cpu(), want, dtype)


def run_interpreted_checks() -> dict:
    """Run every check in this (interpreted) process: {name: None if it passed, else its traceback}."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, check in TRITON_CHECKS.items():
        try:
            check("cpu", INTERPRETER_DOT_DTYPES)
            results[name] = None
        except Exception:  # report every failure, not only the first
            results[name] = traceback.format_exc()
    return results


# ---------------------------------------------------------------------------------------------------------
# 5) Each kernel compiled for sm_90 (no GPU needed; ptxas ships with Triton)
# ---------------------------------------------------------------------------------------------------------

# Pointer element types that do not follow the activation dtype; scalars are i32 unless listed as floats.
_POINTER_TYPES = {"cos_sin_ptr": "*fp32", "positions_ptr": "*i64", "slot_mapping_ptr": "*i64",
                  "query_start_ptr": "*i32", "slab_offset_ptr": "*i64", "context_len_ptr": "*i32",
                  "workspace_ptr": "*fp32"}
_FLOAT_SCALARS = {"eps", "scale_log2"}
# The models CI compiles for: sizes from their configs, the dtypes they serve in, the plan's longest slab (which
# sets the decode splits). Buckets set only the grids, never a constexpr, so every bucket runs these binaries.
MODEL_SHAPES = {
    "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536, max_context=8192,
                    dtypes=("fp32", "fp16", "bf16")),
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, max_context=8192,
                      dtypes=("bf16",)),
}
COMPILE_DTYPES = {"fp32": ("*fp32", torch.float32), "fp16": ("*fp16", torch.float16),
                  "bf16": ("*bf16", torch.bfloat16)}
# sm_90 (H100/H200) limits a CTA must fit: dynamic shared memory per block, registers per thread and per SM
SM90_MAX_SHARED_BYTES = 227 * 1024
SM90_MAX_REGS_PER_THREAD = 255
SM90_REGS_PER_SM = 65536


def compile_cases(model: str, dtype: torch.dtype) -> dict:
    """{kernel name: (module, kernel, Launch)}: what the wrappers launch for `model`'s sizes in `dtype`."""
    from slabserve.kernels import triton_kv_write, triton_rmsnorm, triton_rope, triton_silu_mul
    from slabserve.kernels import triton_slab_attention as attention

    m = MODEL_SHAPES[model]
    group, splits = m["heads"] // m["kv_heads"], kernels.decode_num_splits(m["max_context"])
    module = "slabserve.kernels."
    return {
        "rms_norm": (module + "triton_rmsnorm", "_rms_norm_kernel", triton_rmsnorm.rms_norm_launch(m["hidden"])),
        "rope": (module + "triton_rope", "_rope_kernel",
                 triton_rope.rope_launch(m["heads"], m["kv_heads"], m["head_dim"])),
        "silu_mul": (module + "triton_silu_mul", "_silu_mul_kernel", triton_silu_mul.silu_mul_launch(m["inter"])),
        "kv_write": (module + "triton_kv_write", "_kv_write_kernel",
                     triton_kv_write.kv_write_launch(m["kv_heads"], m["head_dim"])),
        # the step's forms: decode rows to the split kernels, the rest to prefill (triton_slab_attention)
        "slab_prefill": (module + "triton_slab_attention", "_slab_prefill_kernel",
                         attention.prefill_launch(group, m["head_dim"], dtype, skip_decode=True)),
        "slab_decode_split": (module + "triton_slab_attention", "_slab_decode_split_kernel",
                              attention.decode_split_launch(group, m["head_dim"], splits, dtype,
                                                            from_query_start=True)),
        "slab_decode_reduce": (module + "triton_slab_attention", "_slab_decode_reduce_kernel",
                               attention.decode_reduce_launch(m["head_dim"], splits, from_query_start=True)),
    }


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack (spills) per thread of the one function in `cubin`, read by the cuobjdump that ships
    with Triton: "REG:232 STACK:0 SHARED:1024 LOCAL:0 ..."."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split())
    return {"regs": int(fields["REG"]), "stack_bytes": int(fields["STACK"])}


def _compile_one(module: str, kernel: str, launch, pointer_type: str) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    signature = {}
    for param in fn.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name] = _POINTER_TYPES.get(param.name, pointer_type)
        else:
            signature[param.name] = "fp32" if param.name in _FLOAT_SCALARS else "i32"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=dict(launch.constexprs)),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": launch.num_warps})
    return {"ptx_sm90": ".target sm_90" in compiled.asm["ptx"],
            "cubin_elf": compiled.asm["cubin"][:4] == b"\x7fELF", "cubin_bytes": len(compiled.asm["cubin"]),
            "shared_bytes": compiled.metadata.shared, "threads": 32 * launch.num_warps,
            **_resource_usage(compiled.asm["cubin"])}


def run_compile_checks() -> dict:
    """Compile every kernel for every model and dtype: {"model/kernel/dtype": {...} or the traceback}."""
    assert not os.environ.get("TRITON_INTERPRET"), "compile checks need real JITFunctions"
    results = {}
    for model, shape in MODEL_SHAPES.items():
        for dtype_name in shape["dtypes"]:
            pointer_type, dtype = COMPILE_DTYPES[dtype_name]
            for name, (module, kernel, launch) in compile_cases(model, dtype).items():
                try:
                    results[f"{model}/{name}/{dtype_name}"] = _compile_one(module, kernel, launch, pointer_type)
                except Exception:
                    results[f"{model}/{name}/{dtype_name}"] = traceback.format_exc()
    return results


# ---------------------------------------------------------------------------------------------------------
# The two subprocesses and the tests that read their reports
# ---------------------------------------------------------------------------------------------------------

_REPORT_MARK = "KERNEL-CHECK-REPORT "


def _subprocess_env(interpret: bool, cache_dir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)  # fresh: the compile really happens
    return env


def _run_report(mode: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, mode], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_REPORT_MARK)]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{mode} subprocess failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len(_REPORT_MARK):])


@pytest.fixture(scope="module")
def interpreted_report() -> dict:
    return _run_report("interpreted", _subprocess_env(interpret=True))


@pytest.fixture(scope="module")
def compile_report(tmp_path_factory) -> dict:
    return _run_report("compile", _subprocess_env(interpret=False, cache_dir=tmp_path_factory.mktemp("triton")))


@pytest.mark.parametrize("check", list(TRITON_CHECKS))
def test_triton_interpreted(interpreted_report, check):
    assert interpreted_report[check] is None, interpreted_report[check]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("check", list(TRITON_CHECKS))
def test_triton_on_cuda(check):
    TRITON_CHECKS[check]("cuda", DTYPES)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_custom_ops_dispatch_to_triton_on_cuda():
    b = make_prefill_batch(torch.bfloat16, "gqa3", device="cuda")
    c = make_prefill_batch(torch.bfloat16, "gqa3")
    got = kernels.slab_prefill_attention(*prefill_args(b, sentinel_like(b.q)))
    assert_close(got.cpu(), kernels.slab_prefill_attention_ref(*prefill_args(c, sentinel_like(c.q))), torch.bfloat16)


COMPILE_IDS = [f"{model}/{name}/{d}" for model, shape in MODEL_SHAPES.items() for d in shape["dtypes"]
               for name in ("rms_norm", "rope", "silu_mul", "kv_write", "slab_prefill", "slab_decode_split",
                            "slab_decode_reduce")]


@pytest.mark.parametrize("case", COMPILE_IDS)
def test_triton_compiles_for_sm90_and_fits(compile_report, case):
    """Each kernel as its wrapper launches it for the model, compiled for sm_90: it builds, fits the limits of
    one CTA (shared memory, registers per thread and per SM) and spills nothing to local memory."""
    result = compile_report[case]
    assert isinstance(result, dict), result
    assert result["ptx_sm90"] and result["cubin_elf"] and result["cubin_bytes"] > 0, result
    assert result["shared_bytes"] <= SM90_MAX_SHARED_BYTES, result
    assert result["regs"] <= SM90_MAX_REGS_PER_THREAD and result["regs"] * result["threads"] <= SM90_REGS_PER_SM, result
    assert result["stack_bytes"] == 0, f"{case} spills {result['stack_bytes']} bytes a thread: {result}"


if __name__ == "__main__":
    report = {"interpreted": run_interpreted_checks, "compile": run_compile_checks}[sys.argv[1]]()
    print(_REPORT_MARK + json.dumps(report))
