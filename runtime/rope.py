"""Rotary position tables: the (P, D) cos/sin table the `rope` kernel reads, with Llama 3 and linear scaling.

The table layout is the one `kernels.rope` documents: row p holds cos(p * inv_freq) in its first D/2 columns and
sin(p * inv_freq) in the last D/2 (the "rotate_half" pairing HF Llama uses).
"""
from __future__ import annotations

import math

import torch

from slabserve.runtime.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling, freq_factors: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies after scaling. `freq_factors` are GGUF's `rope_freqs` divisors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(config: ModelConfig, num_positions: int, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """(P, D) float32: [cos | sin] of position * inverse frequency, for positions 0 .. P-1."""
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, freq_factors)
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    angles = torch.outer(positions, inv_freq)  # (P, D/2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous()  # (P, D)
