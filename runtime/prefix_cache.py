"""Which KV rows every slab holds, found by prefix. Pure Python, no torch: token ids and slabs only.

A slab's rows 0 .. n-1 hold the KV of the n tokens the scheduler last computed into it (a running request's prompt
and outputs so far, or what a finished one left behind). The index keeps those token ids per slab and, for every
full block of BLOCK_TOKENS of them, a chained hash (block i's hash covers tokens 0 .. (i+1)*BLOCK_TOKENS - 1), with a
map from each hash to the slabs that hold that prefix. Finding the slabs that share the longest prefix with a prompt
walks the prompt's own block hashes down that map, so it costs O(prompt / BLOCK_TOKENS) dictionary lookups whatever
the slabs hold; the last partial block is then compared token by token in the best slabs, and a match is verified
against the slab's token ids before it is used (a hash collision costs a lookup, never a wrong row).

Keeping the index true is the scheduler's job (runtime/scheduler.py): `extend` after a step has written rows,
`truncate` when a slab goes to a new request that keeps only its first rows, `assign` when rows are copied in.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from slabserve.runtime.slab_allocator import Slab

BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Match:
    slab: Slab | None  # None: no slab shares a block with the prompt
    tokens: int        # leading prompt tokens whose KV rows `slab` holds (0 when slab is None)


NO_MATCH = Match(None, 0)


class PrefixIndex:
    """Token ids of the KV rows each slab holds, and their block hashes. One owner (the scheduler) calls it."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block = block_tokens
        self._tokens: dict[Slab, list[int]] = {}
        self._hashes: dict[Slab, list[int]] = {}
        self._index: dict[int, set[Slab]] = {}

    def held(self, slab: Slab) -> int:
        """Rows of `slab` holding known tokens (its rows 0 .. held-1)."""
        return len(self._tokens.get(slab, ()))

    def tokens(self, slab: Slab) -> tuple[int, ...]:
        return tuple(self._tokens.get(slab, ()))

    def extend(self, slab: Slab, token_ids: Iterable[int]) -> None:
        """Rows held .. held + len(token_ids) - 1 of `slab` now hold these tokens."""
        tokens = self._tokens.setdefault(slab, [])
        hashes = self._hashes.setdefault(slab, [])
        tokens.extend(token_ids)
        b = self.block
        while (len(hashes) + 1) * b <= len(tokens):
            i = len(hashes)
            h = hash((hashes[-1] if hashes else 0, tuple(tokens[i * b : (i + 1) * b])))
            hashes.append(h)
            self._index.setdefault(h, set()).add(slab)

    def truncate(self, slab: Slab, keep: int) -> None:
        """Only rows 0 .. keep-1 of `slab` still hold what the index says (its new owner rewrites the rest)."""
        tokens = self._tokens.get(slab)
        if tokens is None or len(tokens) <= keep:
            return
        del tokens[keep:]
        hashes = self._hashes[slab]
        while len(hashes) * self.block > keep:
            h = hashes.pop()
            holders = self._index[h]
            holders.discard(slab)
            if not holders:
                del self._index[h]

    def assign(self, slab: Slab, token_ids: Sequence[int]) -> None:
        """`slab` now holds exactly `token_ids` (rows copied in from another slab)."""
        self.truncate(slab, 0)
        self.extend(slab, token_ids)

    def estimate(self, prompt: Sequence[int], limit: int) -> int:
        """Tokens of prompt[:limit] some slab holds, to the block: the prefill a placement will most likely skip,
        for admission by latency. It only reads (dict lookups and the truthiness of a set, each atomic under the
        GIL), so the server's gRPC threads may call it while the engine thread updates the index; the slab may be
        taken before the request is placed, which is why it is an estimate."""
        b, h, held = self.block, 0, 0
        for i in range(min(limit, len(prompt)) // b):
            h = hash((h, tuple(prompt[i * b : (i + 1) * b])))
            if not self._index.get(h):
                break
            held = (i + 1) * b
        return held

    def longest(self, prompt: Sequence[int], limit: int, eligible: Callable[[Slab], bool]) -> Match:
        """The eligible slab holding the longest prefix of prompt[:limit], and its length (at least one block), or
        NO_MATCH. Ties go to the slab that holds the fewest other rows (taking it loses the least).

        The prompt's block hashes are walked down the index while some slab holds them (a dict probe a block);
        slabs holding block i hold every block before it, so "an eligible slab holds block i" is true up to some
        depth and false after it, and that depth is found by bisection: O(blocks + holders * log blocks) even when
        hundreds of slabs share a long system prompt."""
        b = self.block
        chain: list[set[Slab]] = []  # chain[i]: the slabs holding the prompt's first i + 1 blocks
        h = 0
        for i in range(min(limit, len(prompt)) // b):
            h = hash((h, tuple(prompt[i * b : (i + 1) * b])))
            holders = self._index.get(h)
            if not holders:
                break
            chain.append(holders)

        def any_eligible(depth: int) -> bool:
            return any(eligible(s) for s in chain[depth - 1])

        if not chain or not any_eligible(1):
            return NO_MATCH
        lo, hi = 1, len(chain)  # any_eligible(lo) holds; find the deepest depth where it does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if any_eligible(mid):
                lo = mid
            else:
                hi = mid - 1
        depth = lo * b
        ranked = []
        for slab in (s for s in chain[lo - 1] if eligible(s)):
            tokens = self._tokens[slab]
            n, end = depth, min(limit, len(prompt), len(tokens))
            while n < end and tokens[n] == prompt[n]:  # the partial block after the last whole one
                n += 1
            ranked.append((-n, len(tokens), slab.offset, slab))
        for minus_n, _, _, slab in sorted(ranked):  # the best first; verified, as a hash collision could lie
            if self._tokens[slab][:depth] == list(prompt[:depth]):
                return Match(slab, -minus_n)
        return NO_MATCH
