"""The CPU attention's batched decode groups: the same result as attending each sequence alone, whatever the
mix of decode rows, prefill chunks and padding, however the workspace splits the groups; and no allocation."""
from __future__ import annotations

import pytest
import torch

from slabserve.kernels import reference
from slabserve.kernels.reference import cpu_workspace_numel, prefill_workspace_numel, slab_prefill_attention_ref
from slabserve.runtime.executor import allocations

H, HKV, D, ROWS = 4, 2, 16, 2048


def naive(q, k_cache, v_cache, chunks, scale):
    """Float64 attention, one query row at a time: chunks are (q_len, slab_offset, context_len)."""
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for q_len, offset, context in chunks:
        for j in range(q_len):
            position = context - q_len + j
            if context == 0:
                continue
            keys = k_cache[offset : offset + position + 1].double()  # (P, Hkv, D)
            values = v_cache[offset : offset + position + 1].double()
            for h in range(H):
                scores = keys[:, h // (H // HKV)] @ q[row + j, h].double() * scale
                out[row + j, h] = torch.softmax(scores, 0) @ values[:, h // (H // HKV)]
        row += q_len
    return out


def case(chunks, bucket):
    generator = torch.Generator().manual_seed(len(chunks))
    q = torch.randn(bucket, H, D, generator=generator)
    k_cache = torch.randn(ROWS, HKV, D, generator=generator)
    v_cache = torch.randn(ROWS, HKV, D, generator=generator)
    starts = [0]
    for q_len, _, _ in chunks:
        starts.append(starts[-1] + q_len)
    meta = (torch.tensor(starts, dtype=torch.int32), torch.tensor([c[1] for c in chunks]),
            torch.tensor([c[2] for c in chunks], dtype=torch.int32))
    return q, k_cache, v_cache, meta


# decode rows of different lengths (one at the very start of the cache), a prefill chunk between them, a padding
# sequence (context 0) and padding rows at the end
MIXED = [(1, 0, 1), (1, 64, 37), (1, 128, 5), (3, 192, 20), (1, 256, 60), (1, 320, 59), (1, 384, 2), (0, 0, 0)]


@pytest.mark.parametrize("capacity", ["ample", "tight"])
def test_decode_groups_equal_attending_each_sequence(monkeypatch, capacity):
    groups = []
    real = reference._attend_decode_group
    monkeypatch.setattr(reference, "_attend_decode_group",
                        lambda q, *rest: (groups.append(q.shape[0]), real(q, *rest))[1])
    q, k_cache, v_cache, meta = case(MIXED, 12)
    numel = (cpu_workspace_numel(12, H, D, 64, HKV) if capacity == "ample"
             else reference._decode_group_numel(2, 37, H, HKV, D))  # room for the first two windows only
    workspace = torch.full((max(numel, prefill_workspace_numel(3, H, D, 20)),), float("nan"))
    out = torch.full_like(q, float("nan"))
    slab_prefill_attention_ref(q, k_cache, v_cache, *meta, 0.25, out, workspace)
    torch.testing.assert_close(out.double(), naive(q, k_cache, v_cache, MIXED, 0.25), rtol=0, atol=2e-6)
    # the batched path ran on several sequences at once; the tight workspace splits what the ample one groups
    assert groups == ([3, 3] if capacity == "ample" else [2])


def test_decode_group_padding_and_window_are_bounded():
    """Short sequences are not padded to a much longer one's window, and a context over GROUP_MAX_WINDOW is
    attended in place, alone."""
    chunks = [(1, 0, 3), (1, 64, 2), (1, 128, 500), (1, 640, 1000), (1, 1700, 7)]
    q, k_cache, v_cache, meta = case(chunks, 5)
    workspace = torch.empty(cpu_workspace_numel(5, H, D, 1024, HKV))
    out = torch.empty_like(q)
    groups = []
    real = reference._attend_decode_group
    reference._attend_decode_group = lambda q, *rest: (groups.append(q.shape[0]), real(q, *rest))[1]
    try:
        slab_prefill_attention_ref(q, k_cache, v_cache, *meta, 0.25, out, workspace)
    finally:
        reference._attend_decode_group = real
    assert groups == [2]
    torch.testing.assert_close(out.double(), naive(q, k_cache, v_cache, chunks, 0.25), rtol=0, atol=2e-6)


def test_decode_groups_allocate_nothing():
    q, k_cache, v_cache, meta = case(MIXED, 12)
    workspace = torch.empty(cpu_workspace_numel(12, H, D, 64, HKV))
    out = torch.empty_like(q)
    run = reference.prepare_slab_prefill_attention(q, k_cache, v_cache, *meta, 0.25, out, workspace)
    run()
    assert allocations(run, 3) == []


@pytest.mark.parametrize("slots", [[5, 9, 20, 33, -1, -1], [5, 6, 7, 40, -1], [-1, 3, 8, 12, 30], [7, -1, 2, 9, 11]])
def test_kv_write_runs_and_indexed_copy_agree_and_allocate_nothing(slots):
    """Decode steps (many one-row runs, valid rows first) take the indexed copy; the rest copy runs."""
    k, v = torch.randn(len(slots), HKV, D), torch.randn(len(slots), HKV, D)
    k_cache, v_cache = torch.zeros(64, HKV, D), torch.zeros(64, HKV, D)
    run = reference.prepare_kv_write(k, v, k_cache, v_cache, torch.tensor(slots))
    run()
    for t, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(k_cache[slot], k[t]) and torch.equal(v_cache[slot], v[t])
    assert int((k_cache.abs().sum((1, 2)) > 0).sum()) == sum(s >= 0 for s in slots)
    assert allocations(run, 2) == []
