"""Token sampling on preallocated buffers: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Contract: `Sampler(max_seqs, vocab_size)` allocates every buffer it will use once; `sample` writes only into them
(every op below has an `out=` form), so sampling adds no tensor storage while serving. Each request owns a
`torch.Generator` seeded from its seed, and draws exactly one uniform number per sampled token from it, so the
same request with the same seed gives the same tokens whatever else shares the batch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = no top-k cut
    top_p: float = 1.0        # nucleus mass in (0, 1]
    min_p: float = 0.0        # keep tokens with prob >= min_p * max prob; [0, 1]
    seed: int | None = None   # None = drawn by the server

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the field and its allowed range."""
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0.0, "a finite number >= 0"),
            ("top_k", 0 <= self.top_k <= vocab_size, f"an integer in [0, {vocab_size}] (0 = off)"),
            ("top_p", math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
            ("min_p", math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0, "a number in [0, 1]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "an integer in [0, 2^63)"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"sampling.{name} = {getattr(self, name)!r} is out of range: must be {allowed}")


def make_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Samples one token per logits row. Buffers are (S, V) for S = max_seqs rows of V logits."""

    def __init__(self, max_seqs: int, vocab_size: int):
        s, v = max_seqs, vocab_size
        self.vocab_size = v
        self.sorted = torch.zeros(s, v)                       # (S, V) logits / T, descending
        self.order = torch.zeros(s, v, dtype=torch.int64)     # (S, V) token id of each sorted column
        self.probs = torch.zeros(s, v)                        # (S, V) softmax of `sorted`, then cut
        self.cumsum = torch.zeros(s, v)                       # (S, V)
        self.keep = torch.zeros(s, v, dtype=torch.bool)       # (S, V)
        self.mask = torch.zeros(s, v, dtype=torch.bool)       # (S, V)
        self.threshold = torch.zeros(s, 1)                    # (S, 1)
        self.column = torch.arange(v, dtype=torch.int64).expand(s, v)  # (S, V) view, no storage per row
        self.inv_temp = torch.ones(s, 1)                      # (S, 1)
        self.top_k = torch.zeros(s, 1, dtype=torch.int64)     # (S, 1)
        self.top_p = torch.ones(s, 1)                         # (S, 1)
        self.min_p = torch.zeros(s, 1)                        # (S, 1)
        self.uniform = torch.empty(s, 1)                      # (S, 1)
        self.choice = torch.empty(s, 1, dtype=torch.int64)    # (S, 1)
        self.greedy_ids = torch.empty(s, dtype=torch.int64)   # (S,)
        self.token_ids = torch.empty(s, dtype=torch.int64)    # (S,)
        # numpy views of the same memory: per-row scalar writes through them create no 0-dim tensors
        self._np = {name: getattr(self, name).numpy() for name in ("inv_temp", "top_k", "top_p", "min_p", "order",
                                                                   "choice", "token_ids")}

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """logits (R, V) float32 -> token ids (R,) int64, a view of a preallocated buffer."""
        r = logits.shape[0]
        torch.argmax(logits, dim=-1, out=self.greedy_ids[:r])
        out = self.token_ids[:r]
        out.copy_(self.greedy_ids[:r])
        if all(p.greedy for p in params):
            return out
        self._load_params(params)
        self._filtered_probs(logits)
        for row, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:
                torch.rand(1, generator=g, out=self.uniform[row])
        self._draw(r)
        order, choice, token_ids = self._np["order"], self._np["choice"], self._np["token_ids"]
        for row, p in enumerate(params):
            if not p.greedy:
                token_ids[row] = order[row, choice[row, 0]]
        return out

    def _load_params(self, params: Sequence[SamplingParams]) -> None:
        a = self._np
        for row, p in enumerate(params):
            a["inv_temp"][row, 0] = 1.0 / p.temperature if p.temperature > 0 else 1.0
            a["top_k"][row, 0] = p.top_k if p.top_k > 0 else self.vocab_size
            a["top_p"][row, 0] = p.top_p
            a["min_p"][row, 0] = p.min_p

    def _filtered_probs(self, logits: torch.Tensor) -> None:
        """probs[:r] = softmax(logits / T), sorted descending, with top-k, min-p and top-p cuts set to 0."""
        r = logits.shape[0]
        srt, order, probs, cum = self.sorted[:r], self.order[:r], self.probs[:r], self.cumsum[:r]
        keep, mask, threshold = self.keep[:r], self.mask[:r], self.threshold[:r]
        # topk over the whole row is a descending sort that, unlike aten::sort, makes no index temporary
        torch.topk(logits, self.vocab_size, dim=-1, out=(srt, order))
        torch.mul(srt, self.inv_temp[:r], out=srt)
        torch.ops.aten._softmax.out(srt, -1, False, out=probs)
        torch.lt(self.column[:r], self.top_k[:r], out=keep)      # top-k: the first k columns
        torch.mul(probs[:, :1], self.min_p[:r], out=threshold)   # min-p: prob >= min_p * max prob
        torch.ge(probs, threshold, out=mask)
        keep.logical_and_(mask)
        torch.cumsum(probs, dim=-1, out=cum)
        torch.sub(cum, probs, out=cum)                           # mass strictly before each column
        torch.lt(cum, self.top_p[:r], out=mask)                  # top-p: keep while the mass before is < p
        keep.logical_and_(mask)
        keep[:, 0].fill_(True)                                   # the most likely token always stays
        torch.logical_not(keep, out=mask)
        probs.masked_fill_(mask, 0.0)                            # (mul_ by a bool mask would copy it to float)
        torch.cumsum(probs, dim=-1, out=cum)

    def _draw(self, r: int) -> None:
        """Inverse CDF: the first sorted column whose cumulative kept mass exceeds u * total."""
        cum = self.cumsum[:r]
        torch.mul(self.uniform[:r], cum[:, -1:], out=self.uniform[:r])
        torch.searchsorted(cum, self.uniform[:r], right=True, out=self.choice[:r])
        self.choice[:r].clamp_(max=self.vocab_size - 1)
