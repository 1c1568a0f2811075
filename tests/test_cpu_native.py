"""The native CPU kernels (kernels/cpu_native.c) against their PyTorch references.

slabserve::linear on panel-packed weights (every row count a tile can take, padded last panels, the residual,
strided rows of x) and slab attention of short query runs (decode rows and small prefill chunks mixed with long
chunks, padding sequences, GQA and MHA), plus the layout helpers, the contract, the fallback when the library is
unavailable, a build from an empty cache, and the promise that neither kernel allocates.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slabserve.kernels.ops  # noqa: F401  (registers torch.ops.slabserve.*)
from slabserve.kernels import cpu_native, reference
from slabserve.kernels.contracts import KV_TILE, PANEL, k_rows, k_tiles, panel_shape
from slabserve.runtime.executor import allocations

REPO = Path(__file__).resolve().parents[1]
needs_native = pytest.mark.skipif(not cpu_native.available(),
                                  reason=f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tiled(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row caches as the native kernels take them: K tiled (contracts.KV_TILE), both padded with zero rows to a whole
    number of tiles."""
    pad = -k_cache.shape[0] % KV_TILE
    k_cache, v_cache = (torch.cat([c, c.new_zeros(pad, *c.shape[1:])]) for c in (k_cache, v_cache))
    return k_tiles(k_cache), v_cache


# ---------------------------------------------------------------------------------------------------- linear


@pytest.mark.parametrize("k, n", [(576, 960), (64, 40), (33, 17), (8, 5), (1536, 576)])
def test_pack_panels_round_trips_and_pads_with_zeros(k, n):
    w = _randn(k, n, seed=k + n)
    panels = cpu_native.pack_panels(w)
    assert tuple(panels.shape) == panel_shape(k, n) and panels.is_contiguous()
    assert torch.equal(cpu_native.unpack_panels(panels, n), w)
    assert torch.equal(panels[0, :, : min(n, PANEL)], w[:, : min(n, PANEL)])
    if n % PANEL:
        assert not panels[-1, :, n % PANEL :].any()


@needs_native
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 61])
@pytest.mark.parametrize("k, n", [(64, 48), (33, 17), (96, 5)])
def test_native_linear_matches_reference(m, k, n):
    x, w, r = _randn(m, k, seed=1), _randn(k, n, seed=2), _randn(m, n, seed=3)
    panels = cpu_native.pack_panels(w)
    for residual in (None, r):
        got = cpu_native.linear_native(x, panels, torch.full((m, n), float("nan")), residual)
        want = reference.linear_ref(x, panels, torch.empty(m, n), residual)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(want, x @ w + (0 if residual is None else residual), rtol=1e-5, atol=1e-5)


@needs_native
def test_native_linear_rows_do_not_depend_on_the_other_rows():
    """Each output row is bit for bit the same whatever rows share the call and wherever it sits among them (one
    alone, as a decode step of one runs it, or inside tiles of any height): a KV row written by a decode step
    equals the one a prefill chunk writes for the same token, which prefix reuse relies on."""
    k, n = 200, 70
    x, w, r = _randn(61, k, seed=11), cpu_native.pack_panels(_randn(k, n, seed=12)), _randn(61, n, seed=13)
    whole = cpu_native.linear_native(x, w, torch.empty(61, n), r)
    for m in (1, 2, 3, 5, 7, 8, 13, 32):
        for first in (0, 17, 61 - m):
            part = cpu_native.linear_native(x[first : first + m], w, torch.empty(m, n), r[first : first + m])
            assert torch.equal(part, whole[first : first + m]), f"rows {first}..{first + m - 1} of {m}"


@needs_native
def test_native_linear_takes_strided_rows_and_writes_only_its_columns():
    """x and out may be column slices of wider rows (the fused qkv and the residual stream are)."""
    wide_x, wide_out = _randn(7, 100, seed=4), torch.zeros(7, 50)
    x, out = wide_x[:, 10:74], wide_out[:, 3:40]  # (7, 64), (7, 37), row strides 100 and 50
    w = _randn(64, 37, seed=5)
    cpu_native.linear_native(x, cpu_native.pack_panels(w), out)
    torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-5)
    assert not wide_out[:, :3].any() and not wide_out[:, 40:].any()


def test_linear_op_checks_its_contract():
    x, panels = torch.randn(4, 32), cpu_native.pack_panels(torch.randn(32, 20))
    with pytest.raises(ValueError, match="linear: w has shape"):
        torch.ops.slabserve.linear(x, panels, torch.empty(4, 40))
    with pytest.raises(ValueError, match="linear: residual has shape"):
        torch.ops.slabserve.linear(x, panels, torch.empty(4, 20), torch.empty(3, 20))
    with pytest.raises(ValueError, match="linear: x has dtype"):
        torch.ops.slabserve.linear(x.half(), panels, torch.empty(4, 20))


def test_linear_opcheck():
    x, panels = torch.randn(5, 24), cpu_native.pack_panels(torch.randn(24, 20))
    torch.library.opcheck(torch.ops.slabserve.linear.default, (x, panels, torch.empty(5, 20), torch.randn(5, 20)),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------- attention


def _attention_case(seed: int):
    """A random flat step: sequences of 0 to 40 rows (padding ones with no keys among them) over their slabs, every
    100 rows (most of them off a K tile's start), K tiled."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = rng.choice([(9, 3, 64), (4, 4, 16), (8, 2, 32), (6, 1, 8)])
    q_lens = [rng.choice([0, 1, 1, 1, 2, 5, 16, 17, 40]) for _ in range(rng.randint(1, 6))]
    contexts = [q + rng.randint(0, 60) if rng.random() > 0.1 else 0 for q in q_lens]
    rows = sum(q_lens) + rng.randint(0, 3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)  # q is a slice of a fused row
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k_cache, v_cache = _tiled(torch.randn(100 * len(q_lens), kv_heads, head_dim, generator=gen),
                              torch.randn(100 * len(q_lens), kv_heads, head_dim, generator=gen))
    query_start = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    slab_offset = torch.arange(len(q_lens), dtype=torch.int64) * 100
    context_len = torch.tensor(contexts, dtype=torch.int32)
    workspace = torch.empty(reference.cpu_workspace_numel(rows, heads, head_dim, 100, kv_heads))
    return (q, k_cache, v_cache, query_start, slab_offset, context_len, head_dim ** -0.5), workspace


@needs_native
@pytest.mark.parametrize("seed", range(24))
def test_native_attention_matches_reference(seed):
    args, workspace = _attention_case(seed)
    want = torch.full_like(args[0], 7.0)
    reference.prepare_slab_prefill_attention(*args, want, workspace)()
    got = torch.full_like(args[0], 7.0)
    cpu_native.prepare_slab_attention(*args, got, workspace)()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _attend_pieces(q, k_cache, v_cache, pieces, offset, others, gen):
    """Attend the prompt rows q (n, H, D) cut into `pieces` (row counts), one step per piece, each step also holding
    `others` one-row sequences of random queries over their own slabs before it and two padding rows after; the
    prompt's output rows, gathered."""
    outs, done = [], 0
    heads, head_dim = q.shape[1], q.shape[2]
    for size in pieces:
        rows = others + size
        step_q = torch.cat([torch.randn(others, heads, head_dim, generator=gen), q[done : done + size],
                            torch.randn(2, heads, head_dim, generator=gen)])
        query_start = torch.tensor(list(range(others + 1)) + [rows], dtype=torch.int32)
        slab_offset = torch.tensor([10 * i for i in range(others)] + [offset])
        context_len = torch.tensor([1 + 3 * i for i in range(others)] + [done + size], dtype=torch.int32)
        out = torch.full_like(step_q, 7.0)
        cpu_native.prepare_slab_attention(step_q, k_cache, v_cache, query_start, slab_offset, context_len,
                                          head_dim ** -0.5, out)()
        assert (out[rows:] == 0).all(), "padding rows are zeroed"
        outs.append(out[others:rows])
        done += size
    return torch.cat(outs)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (9, 3, 64), (32, 8, 128)])
def test_native_attention_rows_do_not_depend_on_chunking_or_batch(kv_dtype, heads, kv_heads, head_dim):
    """A row's attention is bit for bit the same whether its prompt runs as one chunk, is cut into chunks of any
    sizes, or goes a row at a time as decode does, beside other sequences or alone (prefix reuse serves a prompt's
    tail after KV rows written by other steps, and promises the same tokens as without reuse)."""
    gen = torch.Generator().manual_seed(heads)
    n, offset = 150, 200
    q = torch.randn(n, heads, head_dim, generator=gen)
    k_rows_, v_rows = (torch.randn(offset + 8 + n, kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in "kv")
    k_cache, v_cache = _tiled(k_rows_, v_rows)
    whole = _attend_pieces(q, k_cache, v_cache, [n], offset, 0, gen)
    for pieces, others in (([64, 86], 3), ([7, 1, 100, 42], 1), ([1] * 20 + [130], 5), ([149, 1], 0)):
        got = _attend_pieces(q, k_cache, v_cache, pieces, offset, others, gen)
        assert torch.equal(got, whole), f"rows differ when the prompt runs as {pieces} beside {others} others"
    # the same keys 8 rows on, from a K tile's start (200 is 8 rows past one): read in place, not gathered
    k_moved, v_moved = _tiled(torch.cat([k_rows_[:8], k_rows_[:-8]]), torch.cat([v_rows[:8], v_rows[:-8]]))
    assert torch.equal(_attend_pieces(q, k_moved, v_moved, [64, 86], offset + 8, 3, gen), whole)
    query_start = torch.tensor([0, n], dtype=torch.int32)
    want = reference.slab_prefill_attention_ref(q, k_rows_.float(), v_rows.float(), query_start,
                                                torch.tensor([offset]), torch.tensor([n], dtype=torch.int32),
                                                head_dim ** -0.5, torch.empty_like(q))
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 32), (4, 1, 128)])
def test_rows_past_a_key_partition_are_the_same_split_across_threads_or_not(kv_dtype, heads, kv_heads, head_dim):
    """A row over more than one partition of keys (cpu_native.c: KEY_PART, 512) attends each partition from an empty
    softmax state and merges them in order; a decode step with fewer than two tasks a thread (one row over 3 kv
    heads, or two over 1, for 2 threads) gives a row's partitions to different threads and merges afterwards. The
    bits must not depend on which happened: decode alone, decode beside others (enough tasks not to split), and the
    prompt's rows in prefill chunks all give the same rows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs two threads; the kernel follows torch's setting
    try:
        gen = torch.Generator().manual_seed(head_dim)
        n, offset, tail = 1150, 40, 24
        q = torch.randn(n, heads, head_dim, generator=gen)
        k_rows_, v_rows = (torch.randn(offset + n, kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in "kv")
        k_cache, v_cache = _tiled(k_rows_, v_rows)
        whole = _attend_pieces(q, k_cache, v_cache, [n], offset, 0, gen)
        for pieces, others in (([n - tail] + [1] * tail, 0), ([n - tail] + [1] * tail, 1),
                               ([n - tail] + [1] * tail, 6), ([300, 212, 1, 600, 37], 2)):
            got = _attend_pieces(q, k_cache, v_cache, pieces, offset, others, gen)
            assert torch.equal(got, whole), f"rows differ when the prompt runs as {pieces} beside {others} others"
        want = reference.slab_prefill_attention_ref(q, k_rows_.float(), v_rows.float(),
                                                    torch.tensor([0, n], dtype=torch.int32), torch.tensor([offset]),
                                                    torch.tensor([n], dtype=torch.int32), head_dim ** -0.5,
                                                    torch.empty_like(q))
        torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_half_precision_caches_attend_as_their_fp32_widening(kv_dtype, seed):
    """A plan's kv_dtype on CPU: the native kernel (K tiled) and the reference (row caches, widening the slab into
    scratch) over bf16/fp16 caches equal attention over the same caches widened to fp32, allocating nothing."""
    (q, k_cache, v_cache, *meta), _ = _attention_case(seed)
    half_k, half_v = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    rows, heads, head_dim = q.shape
    workspace = torch.empty(reference.cpu_workspace_numel(rows, heads, head_dim, 100, k_cache.shape[1], kv_dtype))
    want = torch.full_like(q, 7.0)
    reference.slab_prefill_attention_ref(q, half_k.float(), half_v.float(), *meta, want)
    got = torch.full_like(q, 7.0)
    run = cpu_native.prepare_slab_attention(q, half_k, half_v, *meta, got, workspace)
    assert allocations(run, steps=2) == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref_only = torch.full_like(q, 7.0)
    run = reference.prepare_slab_prefill_attention(q, k_rows(half_k), half_v, *meta, ref_only, workspace)
    assert allocations(run, steps=2) == []
    torch.testing.assert_close(ref_only, want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_kv_write_rounds_into_half_caches_as_torch_does(kv_dtype):
    _, _, k, v = _qkv(9, 4, 2, 20, seed=8)
    k[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), 1e-40, 65519.0])  # specials, subnormal, fp16 edge
    slots = torch.tensor([3, -1, 0, 7, 8, 9, 10, 11, 1])
    theirs = [torch.full((16, 2, 20), 7.0, dtype=kv_dtype) for _ in range(2)]
    ours = list(_tiled(*theirs))
    cpu_native.prepare_kv_write(k, v, *ours, slots)()
    reference.kv_write_ref(k, v, *theirs, slots)
    assert torch.equal(k_rows(ours[0]).view(torch.int16), theirs[0].view(torch.int16))  # bit for bit
    assert torch.equal(ours[1].view(torch.int16), theirs[1].view(torch.int16))
    assert torch.equal(theirs[0][3], k[0].to(kv_dtype)) and torch.equal(theirs[0][0], k[2].to(kv_dtype))
    assert (theirs[0][2] == 7.0).all()  # a row no slot names is untouched


# ---------------------------------------------------------------------------------------------------- small ops


def _qkv(rows: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as the model makes them: views of one fused (T, (H + 2 Hkv) D) row each."""
    qkv = _randn(rows, (heads + 2 * kv_heads) * head_dim, seed=seed)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    return qkv, q, k, v


@needs_native
@pytest.mark.parametrize("rows, width", [(1, 576), (9, 64), (3, 13)])
def test_native_rms_norm_and_silu_mul_match_references(rows, width):
    x, weight = _randn(rows, width + 5, seed=1)[:, 2 : width + 2], torch.rand(width) + 0.5  # strided rows
    got, want = torch.empty(rows, width), torch.empty(rows, width)
    cpu_native.prepare_rms_norm(x, weight, 1e-5, got)()
    torch.testing.assert_close(got, reference.rms_norm_ref(x, weight, 1e-5, want), rtol=1e-6, atol=1e-6)
    gate_up = _randn(rows, 2 * width, seed=2) * 4
    cpu_native.prepare_silu_mul(gate_up, got)()
    torch.testing.assert_close(got, reference.silu_mul_ref(gate_up, want), rtol=1e-6, atol=1e-6)


@needs_native
def test_row_wise_kernels_compute_only_the_live_rows_read_at_each_call():
    """With `rows` (the step's query_start), linear, linear_q, rms_norm and silu_mul compute rows 0 .. rows[-1]-1
    (with per_sequence, one row per sequence with tokens), read when they run (one prepared call serves every step of a bucket), bit for bit as without it, and leave the
    padding rows as they were; a count past the tensor's rows or below zero is clamped."""
    from slabserve.kernels import quant
    from test_quant_kernels import random_rows

    m, k, n = 9, 64, 40
    x, res = _randn(m, k, seed=1), _randn(m, n, seed=2)
    panels, blocks = cpu_native.pack_panels(_randn(k, n, seed=3)), random_rows("Q4_1", n, k, seed=4)
    weight, q41 = torch.rand(k) + 0.5, quant.BLOCK_TYPES["Q4_1"].ggml_id
    query_start = torch.zeros(4, dtype=torch.int32)
    outs = {"linear": torch.empty(m, n), "linear_q": torch.empty(m, n), "rms_norm": torch.empty(m, k),
            "silu_mul": torch.empty(m, k // 2)}
    runs = {"linear": lambda live: cpu_native.prepare_linear(x, panels, outs["linear"], res, live),
            "linear_q": lambda live: cpu_native.prepare_linear_q(x, blocks, outs["linear_q"], res, q41, live),
            "rms_norm": lambda live: cpu_native.prepare_rms_norm(x, weight, 1e-5, outs["rms_norm"], None, live),
            "silu_mul": lambda live: cpu_native.prepare_silu_mul(x, outs["silu_mul"], live)}
    whole = {}
    for name, prepare in runs.items():
        prepare(None)()
        whole[name] = outs[name].clone()
    prepared = {name: prepare(query_start) for name, prepare in runs.items()}
    for live, computed in [(5, 5), (1, 1), (0, 0), (m, m), (m + 30, m), (-4, 0)]:
        query_start[-1] = live
        for name, run in prepared.items():
            outs[name].fill_(7.0)
            run()
            assert torch.equal(outs[name][:computed], whole[name][:computed]), (name, live)
            assert (outs[name][computed:] == 7.0).all(), (name, live)
    assert allocations(lambda: [run() for run in prepared.values()], steps=3) == []
    # per_sequence (the lm_head over a logits gather): the rows are the sequences with tokens, up to the last one
    per_seq = [cpu_native.prepare_linear(x, panels, outs["linear"], res, query_start, per_sequence=True),
               cpu_native.prepare_linear_q(x, blocks, outs["linear_q"], res, q41, query_start, per_sequence=True)]
    for starts, computed in [([0, 3, 5, 5], 2), ([0, 1, 1, 1], 1), ([0, 0, 0, 0], 0), ([0, 2, 2, 4], 3),
                             ([0, 1, 2, 3], 3)]:
        query_start.copy_(torch.tensor(starts, dtype=torch.int32))
        for name, run in zip(("linear", "linear_q"), per_seq):
            outs[name].fill_(7.0)
            run()
            assert torch.equal(outs[name][:computed], whole[name][:computed]), (name, starts)
            assert (outs[name][computed:] == 7.0).all(), (name, starts)


def test_rows_must_be_a_1d_int32_tensor():
    x, panels = torch.randn(4, 32), cpu_native.pack_panels(torch.randn(32, 20))
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                torch.zeros(2, 2, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="linear: rows must be a non-empty contiguous 1-D int32 tensor"):
            torch.ops.slabserve.linear(x, panels, torch.empty(4, 20), None, bad)
    with pytest.raises(ValueError, match="silu_mul: rows must be"):
        torch.ops.slabserve.silu_mul(x, torch.empty(4, 16), torch.zeros(3))
    torch.library.opcheck(torch.ops.slabserve.linear.default,
                          (x, panels, torch.empty(4, 20), None, torch.tensor([0, 2, 3], dtype=torch.int32)),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.slabserve.rms_norm.default,
                          (x, torch.rand(32), 1e-6, torch.empty(4, 32), None, torch.tensor([3], dtype=torch.int32)),
                          test_utils=("test_schema", "test_faketensor"))


@needs_native
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 9, 3, 64), (10, 4, 2, 16), (3, 2, 1, 6)])
def test_native_rope_and_kv_write_match_references(rows, heads, kv_heads, head_dim):
    cos_sin, positions = _randn(50, head_dim, seed=3), torch.randint(0, 50, (rows,))
    ours, q, k, v = _qkv(rows, heads, kv_heads, head_dim, seed=4)
    theirs, q2, k2, v2 = _qkv(rows, heads, kv_heads, head_dim, seed=4)
    cpu_native.prepare_rope(q, k, positions, cos_sin)()
    reference.rope_ref(q2, k2, positions, cos_sin)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    slots = torch.tensor([(7 * t) % 48 if t % 3 else -1 for t in range(rows)])
    caches = [torch.full((48, kv_heads, head_dim), 7.0) for _ in range(4)]
    caches[0], caches[1] = _tiled(caches[0], caches[1])
    cpu_native.prepare_kv_write(k, v, caches[0], caches[1], slots)()
    reference.kv_write_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(k_rows(caches[0]), caches[2]) and torch.equal(caches[1], caches[3])
    tiled_ref = list(_tiled(torch.full((48, kv_heads, head_dim), 7.0), torch.full((48, kv_heads, head_dim), 7.0)))
    reference.kv_write_ref(k, v, *tiled_ref, slots)  # the reference into a tiled K: the same rows
    assert torch.equal(tiled_ref[0], caches[0]) and torch.equal(tiled_ref[1], caches[1])


@needs_native
def test_native_ops_refuse_metadata_outside_their_buffers_and_write_nothing():
    _, q, k, v = _qkv(4, 4, 2, 8, seed=5)
    before = k.clone()
    with pytest.raises(ValueError, match="rope: a position lies outside the rope table's 10 rows"):
        cpu_native.prepare_rope(q, k, torch.tensor([0, 1, 10, 2]), torch.randn(10, 8))()
    assert torch.equal(k, before)
    caches = _tiled(torch.zeros(16, 2, 8), torch.zeros(16, 2, 8))
    with pytest.raises(ValueError, match="kv_write: a slot lies past the caches' 16 rows"):
        cpu_native.prepare_kv_write(k, v, *caches, torch.tensor([0, 1, 16, -1]))()
    assert not caches[0].any() and not caches[1].any()
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="slab_attention: query_start, slab_offset or context_len point outside"):
        cpu_native.prepare_slab_attention(q, *caches, torch.tensor([0, 1, 2], dtype=torch.int32),
                                          torch.tensor([0, 13]), torch.tensor([1, 5], dtype=torch.int32), 0.3, out)()
    assert (out == 7.0).all()


# ---------------------------------------------------------------------------------------------------- plumbing


@needs_native
def test_native_kernels_allocate_nothing():
    x, panels, out, res = torch.randn(8, 64), cpu_native.pack_panels(torch.randn(64, 40)), torch.empty(8, 40), \
        torch.randn(8, 40)
    (q, k, v, qs, so, cl, scale), workspace = _attention_case(3)
    _, q2, k2, v2 = _qkv(8, 4, 2, 16, seed=6)
    runs = [cpu_native.prepare_linear(x, panels, out, res),
            cpu_native.prepare_slab_attention(q, k, v, qs, so, cl, scale, torch.empty_like(q), workspace),
            cpu_native.prepare_rms_norm(x, torch.rand(64), 1e-6, torch.empty(8, 64)),
            cpu_native.prepare_silu_mul(x, torch.empty(8, 32)),
            cpu_native.prepare_rope(q2, k2, torch.arange(8), torch.randn(8, 16)),
            cpu_native.prepare_kv_write(k2, v2, *_tiled(torch.zeros(9, 2, 16), torch.zeros(9, 2, 16)),
                                        torch.arange(8))]
    assert allocations(lambda: [run() for run in runs], steps=5) == []


def _every_op(seed: int) -> tuple[list, list[torch.Tensor]]:
    """One prepared call of each native kernel (linear, attention, rms_norm, silu_mul, rope, kv_write, linear_q,
    embed_q) on random inputs from `seed`, and every tensor they write."""
    from test_quant_kernels import random_rows

    gen = torch.Generator().manual_seed(seed)
    x, res = torch.randn(8, 64, generator=gen), torch.randn(8, 40, generator=gen)
    panels = cpu_native.pack_panels(torch.randn(64, 40, generator=gen))
    (q, k, v, qs, so, cl, scale), workspace = _attention_case(seed)
    _, q2, k2, v2 = _qkv(8, 4, 2, 16, seed=seed)
    blocks = random_rows("Q4_1", 24, 64, seed=seed)
    outs = [torch.empty(8, 40), torch.empty_like(q), torch.empty(8, 64), torch.empty(8, 32),
            *_tiled(torch.zeros(9, 2, 16), torch.zeros(9, 2, 16)), torch.empty(8, 24), torch.empty(3, 64)]
    runs = [cpu_native.prepare_linear(x, panels, outs[0], res),
            cpu_native.prepare_slab_attention(q, k, v, qs, so, cl, scale, outs[1], workspace),
            cpu_native.prepare_rms_norm(x, torch.rand(64, generator=gen), 1e-6, outs[2]),
            cpu_native.prepare_silu_mul(x, outs[3]),
            cpu_native.prepare_rope(q2, k2, torch.arange(8), torch.randn(8, 16, generator=gen)),
            cpu_native.prepare_kv_write(k2, v2, outs[4], outs[5], torch.arange(8)),
            cpu_native.prepare_linear_q(x, blocks, outs[6], None, 3),
            cpu_native.prepare_embed_q(torch.tensor([3, 1, 23]), blocks, outs[7], 3)]
    return runs, outs + [q2, k2]


@needs_native
def test_fused_calls_compute_each_calls_bits_in_one_foreign_call_and_allocate_nothing():
    runs, alone = _every_op(seed=4)
    for run in runs:
        run()
    fused_runs, fused = _every_op(seed=4)
    calls = cpu_native.fuse_calls(fused_runs)
    assert len(calls) == 1 and calls[0].calls == fused_runs
    calls[0]()
    for got, want in zip(fused, alone, strict=True):
        assert torch.equal(got, want)
    assert allocations(calls[0], steps=3) == []


@needs_native
def test_a_call_refused_inside_a_fused_run_raises_its_own_error_after_the_calls_before_it():
    _, q, k, v = _qkv(4, 4, 2, 8, seed=5)
    x, norm = torch.randn(4, 8), torch.full((4, 8), 7.0)
    caches = _tiled(torch.zeros(6, 2, 8), torch.zeros(6, 2, 8))
    before = k.clone()
    calls = cpu_native.fuse_calls([cpu_native.prepare_rms_norm(x, torch.ones(8), 1e-6, norm),
                                   cpu_native.prepare_rope(q, k, torch.tensor([0, 1, 10, 2]), torch.randn(10, 8)),
                                   cpu_native.prepare_kv_write(k, v, *caches, torch.tensor([0, 1, 2, 3]))])
    with pytest.raises(ValueError, match="rope: a position lies outside the rope table's 10 rows"):
        calls[0]()
    assert not (norm == 7.0).any(), "the call before the refused one ran"
    assert torch.equal(k, before) and not caches[0].any(), "the refused call and those after it did not"


@needs_native
def test_python_calls_split_fused_runs_and_keep_their_order():
    order: list[str] = []
    runs, _ = _every_op(seed=2)
    python_call = lambda: order.append("python")  # noqa: E731
    calls = cpu_native.fuse_calls([runs[2], runs[3], python_call, runs[0], python_call, python_call, runs[6],
                                   runs[7]])
    assert [getattr(c, "calls", c) for c in calls] == [[runs[2], runs[3]], python_call, runs[0], python_call,
                                                       python_call, [runs[6], runs[7]]]


def test_without_the_library_linear_refuses_to_bind_and_attention_runs_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_native, "_state", {"error": "no C compiler found (test)"})
    assert not cpu_native.available() and "test" in cpu_native.unavailable_reason()
    x, w = torch.randn(3, 16), torch.randn(16, 20)
    with pytest.raises(RuntimeError, match="native CPU kernels are not available here: no C compiler"):
        cpu_native.prepare_linear(x, cpu_native.pack_panels(w), torch.empty(3, 20))
    out = torch.ops.slabserve.linear(x, cpu_native.pack_panels(w), torch.empty(3, 20))  # the op: the reference
    args, workspace = _attention_case(5)
    got, want = torch.full_like(args[0], 7.0), torch.full_like(args[0], 7.0)
    cpu_native.prepare_slab_attention(*args, got, workspace)()
    reference.prepare_slab_prefill_attention(*args, want, workspace)()
    assert torch.equal(got, want) and out is None


@needs_native
def test_library_builds_from_an_empty_cache(tmp_path):
    code = ("from kernels import cpu_native; assert cpu_native.available(), cpu_native.unavailable_reason(); "
            "print(cpu_native.library_path())")
    env = {**os.environ, "SLABSERVE_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True)
    built = Path(done.stdout.strip())
    assert built.parent == tmp_path and built.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [built.name], "no temporary file left behind"
