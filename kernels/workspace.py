"""How the decode attention splits a slab, and the fp32 workspace its partial results need.

Flash-decoding splits each sequence's context into `num_splits` chunks; one program per (sequence, kv head,
chunk) writes a partial (running max, running sum, unnormalized accumulator) into the workspace, and a reduce
step combines them. The split count is fixed when the workspace is sized (from the longest context the planner
allows), so the launch grid is static and CUDA-graph capturable.

Layout: workspace (num_seqs, num_heads, num_splits, head_dim + 2) float32, contiguous; per split the last dim
holds [acc (head_dim) | max | sum], with max in log2 units. One workspace serves every layer (layers run one
after another on one stream), and nothing in it outlives a call. The PyTorch reference does not use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A split below this many tokens costs more in the reduce than it saves in parallelism.
MIN_TOKENS_PER_SPLIT = 256
# Past this the reduce step and the workspace grow for little gain on current GPUs.
MAX_SPLITS = 16


@dataclass(frozen=True, slots=True)
class DecodeWorkspaceSpec:
    """Everything a planner needs to preallocate the decode workspace."""

    shape: tuple[int, int, int, int]  # (num_seqs, num_heads, num_splits, head_dim + 2)
    dtype: torch.dtype = torch.float32

    @property
    def num_splits(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        num_elements = 1
        for size in self.shape:
            num_elements *= size
        return num_elements * torch.empty((), dtype=self.dtype).element_size()


def decode_num_splits(max_context: int) -> int:
    """Number of context chunks for slabs of up to `max_context` tokens: in [1, MAX_SPLITS]."""
    if max_context < 0:
        raise ValueError(f"max_context must be >= 0, got {max_context}")
    return max(1, min(MAX_SPLITS, -(-max_context // MIN_TOKENS_PER_SPLIT)))


def decode_workspace_shape(num_seqs: int, num_heads: int, head_dim: int, max_context: int) -> DecodeWorkspaceSpec:
    """The workspace for a decode step of `num_seqs` rows whose slabs hold at most `max_context` tokens."""
    if min(num_seqs, num_heads, head_dim) < 1:
        raise ValueError(f"num_seqs, num_heads, head_dim must be >= 1, got {num_seqs}, {num_heads}, {head_dim}")
    return DecodeWorkspaceSpec(shape=(num_seqs, num_heads, decode_num_splits(max_context), head_dim + 2))


def new_decode_workspace(spec: DecodeWorkspaceSpec, device: torch.device | str) -> torch.Tensor:
    """Allocate the workspace `spec` describes (at start-up, never while serving)."""
    return torch.empty(spec.shape, dtype=spec.dtype, device=device)  # (S, H, splits, D + 2)
