"""Small helpers shared by the Triton wrappers (imported only with Triton)."""

from __future__ import annotations

import torch
import triton


def block_size(n: int, minimum: int = 1) -> int:
    """The power-of-two tile covering n elements, at least `minimum` (tl.dot needs 16)."""
    return max(minimum, triton.next_power_of_2(max(n, 1)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 activations get exact fp32 dots (the default would be TF32); half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
