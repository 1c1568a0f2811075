"""Small helpers shared by the Triton wrappers (imported only with Triton)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton


class Launch(NamedTuple):
    """What a wrapper passes a kernel besides tensors: its constexprs and warps. One function per kernel computes
    it from the model's sizes, so the launch and CI's sm_90 compile check (tests/test_kernels.py) agree."""

    constexprs: dict
    num_warps: int


def block_size(n: int, minimum: int = 1) -> int:
    """The power-of-two tile covering n elements, at least `minimum` (tl.dot needs 16)."""
    return max(minimum, triton.next_power_of_2(max(n, 1)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 activations get exact fp32 dots (the default would be TF32); half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
