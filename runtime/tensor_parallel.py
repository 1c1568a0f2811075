"""Tensor parallelism: how a model is cut into ranks (this module), and how the ranks serve together
(runtime/ranks.py).

A plan built with `parallel: {tensor: N}` serves one model on N devices, Megatron-style:

- attention by KV-head groups: rank r holds KV heads [r*Hkv/N, (r+1)*Hkv/N) and the query heads that read them,
  [r*H/N, (r+1)*H/N) (q/k/v rows, and the same columns of o_proj), and only those heads of every slab in its KV arena;
- the MLP by columns then rows: rank r holds columns [r*I/N, (r+1)*I/N) of gate/up and the same rows of down_proj's
  input;
- the embedding, the norms and the lm_head are replicated: every rank computes the same logits, so rank 0 samples
  with no gather, and a tied lm_head stays one tensor. At 70B on 8 ranks that costs 2 x 2.1 GB per rank, about 10%
  of its weights; splitting the vocabulary would save it at the price of an all-gather of logits per step.

Each rank's step is the model of its slice (`rank_config`: the head and column counts divided by N, with
`tensor_parallel` = N) plus two sums over the ranks per layer, after o_proj and after down_proj
(kernels/collectives.py), into buffers of the activation arena. Every rank has the same shapes, so one plan layout
holds for all of them; the plan records each rank's slice and its bytes (runtime.plan.ParallelSection).

A degree must divide the query heads, the KV heads and the MLP columns; with a quantized weight format the columns
cut from o_proj and down_proj must also be whole blocks (a GGUF block runs along a row).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from slabserve.runtime.config import ModelConfig

MAX_DEGREE = 64


def allowed_degrees(config: ModelConfig) -> list[int]:
    """The tensor-parallel degrees this model can be cut into: divisors of its query heads, KV heads and MLP
    columns."""
    common = math.gcd(config.num_heads, config.num_kv_heads, config.intermediate_size)
    return [d for d in range(1, min(common, MAX_DEGREE) + 1) if common % d == 0]


def check_degree(config: ModelConfig, degree: int) -> None:
    """Raise ValueError naming `parallel.tensor` and the allowed degrees when `degree` does not divide the model."""
    if degree == 1:
        return
    allowed = allowed_degrees(config)
    if degree not in allowed:
        raise ValueError(f"parallel.tensor: {degree} does not divide the model's {config.num_heads} query heads, "
                         f"{config.num_kv_heads} KV heads and {config.intermediate_size} MLP columns; allowed "
                         f"degrees: {', '.join(map(str, allowed))}")


def rank_config(config: ModelConfig, degree: int) -> ModelConfig:
    """The config of one rank's slice (every rank's is the same): heads, KV heads and MLP columns divided by
    `degree`, head_dim and everything else unchanged."""
    if degree == 1:
        return config
    check_degree(config, degree)
    return dataclasses.replace(config, num_heads=config.num_heads // degree,
                               num_kv_heads=config.num_kv_heads // degree,
                               intermediate_size=config.intermediate_size // degree, tensor_parallel=degree)


@dataclasses.dataclass(frozen=True, slots=True)
class RankSlice:
    """What rank `rank` of `degree` holds, as [start, stop) ranges of the whole model's heads and columns."""

    rank: int
    degree: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]


def rank_slice(config: ModelConfig, rank: int, degree: int) -> RankSlice:
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is outside [0, {degree})")
    check_degree(config, degree)

    def part(n: int) -> tuple[int, int]:
        return (rank * n // degree, (rank + 1) * n // degree)

    return RankSlice(rank, degree, part(config.num_heads), part(config.num_kv_heads),
                     part(config.intermediate_size))


def shard_of(name: str, s: RankSlice, head_dim: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the HF tensor `name` (HF layout: (out, in) for projections) that the rank of slice `s`
    holds, or None when every rank holds all of it (embedding, norms, lm_head)."""
    if s.degree == 1 or ".layers." not in name:
        return None
    d = head_dim
    if ".self_attn.q_proj." in name:
        return 0, s.heads[0] * d, s.heads[1] * d
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return 0, s.kv_heads[0] * d, s.kv_heads[1] * d
    if name.endswith("self_attn.o_proj.weight"):
        return 1, s.heads[0] * d, s.heads[1] * d
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return 0, s.intermediate[0], s.intermediate[1]
    if name.endswith("mlp.down_proj.weight"):
        return 1, s.intermediate[0], s.intermediate[1]
    return None


class ShardedSource:
    """A weight source (runtime.loader.WeightSource) seen by one rank: `config` is the rank's slice and every
    tensor comes back cut to what the rank holds. GGUF blocks are cut along rows, or along a row at whole blocks
    (the rank config's weight_blocks check that they are whole). Everything else is the whole model's source."""

    def __init__(self, source, rank: int, degree: int):
        self.source = source
        self.rank = rank
        self.degree = degree
        self.whole_config = source.config
        self.config = rank_config(source.config, degree)
        self.slice = rank_slice(source.config, rank, degree)  # once: every tensor is cut by it

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        tensor = self.source.get(name, dtype)
        cut = shard_of(name, self.slice, self.whole_config.head_dim)
        if cut is None:
            return tensor
        dim, start, stop = cut
        return tensor.narrow(dim, start, stop - start).contiguous()

    def get_blocks(self, name: str) -> tuple[str, torch.Tensor]:
        kind, rows = self.source.get_blocks(name)  # (N, row_bytes) uint8
        cut = shard_of(name, self.slice, self.whole_config.head_dim)
        if cut is None:
            return kind, rows
        dim, start, stop = cut
        if dim == 0:
            return kind, rows[start:stop].contiguous()
        k = self.source.shapes[name][1]
        per_weight = rows.shape[1] / k  # bytes per weight, whole blocks only (start and stop are block multiples)
        return kind, rows[:, round(start * per_weight) : round(stop * per_weight)].contiguous()
