"""runtime.arena: the KV arena's memory is zero, resident on return, and outlives every view of it."""
from __future__ import annotations

import gc

import torch

from slabserve.runtime.arena import committed_zeros
from slabserve.runtime.memcheck import resident_bytes


def test_committed_zeros_is_zero_resident_and_outlives_its_views():
    before = resident_bytes()
    arena = committed_zeros((4, 1000, 3, 64), torch.float32)  # 3 MiB
    assert arena.shape == (4, 1000, 3, 64) and arena.dtype == torch.float32 and arena.is_contiguous()
    assert resident_bytes() - before >= 3 * 1000 * 1000  # committed before anything writes it
    assert not arena.any()
    view = arena[2]
    del arena
    gc.collect()
    view.fill_(1.5)  # the mapping is still there
    assert float(view.sum()) == 1.5 * view.numel()


def test_committed_zeros_of_half_precision_and_of_nothing():
    assert committed_zeros((3, 5), torch.bfloat16).dtype == torch.bfloat16
    assert committed_zeros((0, 5), torch.float32).shape == (0, 5)
