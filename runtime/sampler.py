"""Token sampling on preallocated buffers: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Contract: `Sampler(max_seqs, vocab_size, device)` allocates every buffer it will use once, on the engine's device;
`sample` writes only into them (every op below has an `out=` form), so sampling adds no tensor storage while
serving. Each request owns a CPU `torch.Generator` seeded from its seed and draws exactly one uniform number per
sampled token from it, so the same request with the same seed gives the same tokens whatever else shares the batch,
on any device.

On CUDA the per-row parameters and uniforms are written into pinned host buffers and copied to the device in one
go; the sampled ids come back through one pinned host buffer, with one synchronisation per sampled step.
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

    def __init__(self, max_seqs: int, vocab_size: int, device: torch.device | str = "cpu"):
        s, v = max_seqs, vocab_size
        dev = torch.device(device)
        on_host = dev.type == "cpu"
        self.vocab_size = v
        self.device = dev

        def buf(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=dev)

        self.sorted = buf(s, v)                               # (S, V) logits / T, descending
        self.order = buf(s, v, dtype=torch.int64)             # (S, V) token id of each sorted column
        self.probs = buf(s, v)                                # (S, V) softmax of `sorted`, then cut
        self.cumsum = buf(s, v)                               # (S, V)
        self.keep = buf(s, v, dtype=torch.bool)               # (S, V)
        self.mask = buf(s, v, dtype=torch.bool)               # (S, V)
        self.threshold = buf(s, 1)                            # (S, 1)
        self.column = torch.arange(v, dtype=torch.int64, device=dev).expand(s, v)  # (S, V) view, no storage per row
        self.uniform = buf(s, 1)                              # (S, 1) u * kept mass
        self.choice = buf(s, 1, dtype=torch.int64)            # (S, 1) sorted column drawn
        self.drawn = buf(s, 1, dtype=torch.int64)             # (S, 1) token id of that column
        self.greedy_ids = buf(s, dtype=torch.int64)           # (S,)
        self.token_ids = buf(s, dtype=torch.int64)            # (S,)
        # per-row parameters: written on the host (pinned for a CUDA device), copied once per sampled step
        self.host_rows = torch.zeros(s, 4, pin_memory=not on_host)  # (S, 4) 1/T, top_p, min_p, u
        self.host_top_k = torch.zeros(s, 1, dtype=torch.int64, pin_memory=not on_host)  # (S, 1)
        self.host_greedy = torch.zeros(s, dtype=torch.bool, pin_memory=not on_host)    # (S,)
        self.rows = self.host_rows if on_host else buf(s, 4)
        self.top_k = self.host_top_k if on_host else buf(s, 1, dtype=torch.int64)
        self.greedy = self.host_greedy if on_host else buf(s, dtype=torch.bool)
        self.inv_temp, self.top_p = self.rows[:, 0:1], self.rows[:, 1:2]  # (S, 1) views
        self.min_p, self.draw = self.rows[:, 2:3], self.rows[:, 3:4]
        # the ids the caller reads: the device buffer itself on CPU, a pinned copy of it on CUDA
        self.host_ids = self.token_ids if on_host else torch.zeros(s, dtype=torch.int64, pin_memory=True)
        self._copied = None if on_host else torch.cuda.Event()
        # numpy views of the host memory: per-row scalar writes through them create no 0-dim tensors
        self._np = {"rows": self.host_rows.numpy(), "top_k": self.host_top_k.numpy(),
                    "greedy": self.host_greedy.numpy()}

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """logits (R, V) float32 on the sampler's device, row i sampled with params[i] -> token ids (R,) int64 on
        the host, a view of a preallocated buffer (valid until the next call)."""
        r = logits.shape[0]
        greedy = self.load(params, generators)
        self.select(logits, greedy)
        return self.ids_to_host(r)

    def load(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
             rows: Sequence[int] | None = None, total: int | None = None) -> bool:
        """Write the parameters of logits rows `rows` (default 0 .. len(params) - 1) and draw their uniforms; the
        other rows below `total` get greedy defaults. Copies them to the device (asynchronously, on the current
        stream) and returns whether every row is greedy (then `select` needs only the argmax)."""
        rows = range(len(params)) if rows is None else rows
        total = len(params) if total is None else total
        a = self._np
        uniform = self.host_rows[:, 3:4]
        a["rows"][:total] = (1.0, 1.0, 0.0, 0.0)
        a["top_k"][:total] = self.vocab_size
        a["greedy"][:total] = True
        for row, p, g in zip(rows, params, generators):
            a["rows"][row, :3] = (1.0 / p.temperature if p.temperature > 0 else 1.0, p.top_p, p.min_p)
            a["top_k"][row, 0] = p.top_k if p.top_k > 0 else self.vocab_size
            a["greedy"][row] = p.greedy
            if not p.greedy:
                torch.rand(1, generator=g, out=uniform[row])
        if self.rows is not self.host_rows:
            self.rows[:total].copy_(self.host_rows[:total], non_blocking=True)
            self.top_k[:total].copy_(self.host_top_k[:total], non_blocking=True)
            self.greedy[:total].copy_(self.host_greedy[:total], non_blocking=True)
        return all(p.greedy for p in params)

    def select(self, logits: torch.Tensor, greedy_only: bool) -> None:
        """token_ids[:R] for logits (R, V) with the loaded parameters: device work only, on fixed buffers, so a
        CUDA graph can capture it (runtime.executor.CudaGraphRunner does, per bucket and mode)."""
        r = logits.shape[0]
        torch.argmax(logits, dim=-1, out=self.greedy_ids[:r])
        if greedy_only:
            self.token_ids[:r].copy_(self.greedy_ids[:r])
            return
        self._filtered_probs(logits)
        self._draw(r)
        torch.gather(self.order[:r], 1, self.choice[:r], out=self.drawn[:r])
        torch.where(self.greedy[:r], self.greedy_ids[:r], self.drawn[:r, 0], out=self.token_ids[:r])

    def ids_to_host(self, r: int) -> torch.Tensor:
        """token_ids[:r] on the host: on CUDA copied into the pinned buffer, then the step's one synchronisation."""
        if self._copied is None:
            return self.token_ids[:r]
        self.host_ids[:r].copy_(self.token_ids[:r], non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return self.host_ids[:r]

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
        torch.mul(self.draw[:r], cum[:, -1:], out=self.uniform[:r])
        torch.searchsorted(cum, self.uniform[:r], right=True, out=self.choice[:r])
        self.choice[:r].clamp_(max=self.vocab_size - 1)
