"""Which KV rows every slab holds, found by prefix. Pure Python, no torch: token ids and slabs only.

A slab's rows 0 .. n-1 hold the KV of the n tokens the scheduler last computed into it (a running request's prompt
and outputs so far, or what a finished one left behind). The index keeps those token ids per slab and, for every
full block of BLOCK_TOKENS of them, a chained hash (block i's hash covers tokens 0 .. (i+1)*BLOCK_TOKENS - 1), with a
map from each hash to the slabs that hold that prefix. Finding the slabs that share the longest prefix with a prompt
walks the prompt's own block hashes down that map, so it costs O(prompt / BLOCK_TOKENS) dictionary lookups whatever
the slabs hold; the last partial block is then compared token by token in the best slabs, and a match is verified
against the slab's token ids before it is used (a hash collision costs a lookup, never a wrong row).

Like the arenas, the index is sized once: every slab is registered at construction (a declared prefix at start-up),
with preallocated arrays for its token ids and block hashes, and the holders of a hash are chained through
preallocated per-block links. What grows while serving is the hash -> first holder map, bounded by the arena's
blocks, so a server's memory after hours of reuse is what it was once every slab had been used.

Keeping the index true is the scheduler's job (runtime/scheduler.py): `extend` after a step has written rows,
`truncate` when a slab goes to a new request that keeps only its first rows, `assign` when rows are copied in.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from slabserve.runtime.slab_allocator import Slab

BLOCK_TOKENS = 16
_NONE = -1


@dataclass(frozen=True, slots=True)
class Match:
    slab: Slab | None  # None: no slab shares a block with the prompt
    tokens: int        # leading prompt tokens whose KV rows `slab` holds (0 when slab is None)


NO_MATCH = Match(None, 0)


class PrefixIndex:
    """Token ids of the KV rows each registered slab holds, and their block hashes. One owner (the scheduler)
    changes it; `estimate` may be called from other threads."""

    def __init__(self, slabs: Iterable[Slab] = (), block_tokens: int = BLOCK_TOKENS):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block = block_tokens
        self._ids: dict[Slab, int] = {}
        self._slabs: list[Slab] = []
        self._tokens: list[array] = []     # per slab: its rows' token ids (int64, slab.tokens long)
        self._hashes: list[array] = []     # per slab: the chained hash of each full block held
        self._held = array("q")            # per slab: rows holding known tokens
        self._first = array("q")           # per slab: its first block's entry (entries number every block)
        self._owner = array("q")           # per entry: its slab
        self._next = array("q")            # per entry: the next entry holding the same hash, or _NONE
        self._prev = array("q")            # per entry: the one before it, or _NONE (then it is the head)
        self._heads: dict[int, int] = {}   # block hash -> the first entry holding it
        for slab in slabs:
            self.register(slab)

    def register(self, slab: Slab) -> None:
        """Make room for `slab` (its arrays, sized by its rows); it holds nothing yet."""
        if slab in self._ids:
            raise ValueError(f"{slab} is registered already")
        blocks = slab.tokens // self.block
        self._ids[slab] = len(self._slabs)
        self._slabs.append(slab)
        self._tokens.append(array("q", bytes(8 * slab.tokens)))
        self._hashes.append(array("q", bytes(8 * blocks)))
        self._held.append(0)
        self._first.append(len(self._owner))
        self._owner.extend([len(self._slabs) - 1] * blocks)
        self._next.extend([_NONE] * blocks)
        self._prev.extend([_NONE] * blocks)

    def held(self, slab: Slab | None) -> int:
        """Rows of `slab` holding known tokens (its rows 0 .. held-1)."""
        return 0 if slab is None else self._held[self._ids[slab]]

    def tokens(self, slab: Slab) -> tuple[int, ...]:
        i = self._ids[slab]
        return tuple(self._tokens[i][: self._held[i]])

    def extend(self, slab: Slab, token_ids: Sequence[int]) -> None:
        """Rows held .. held + len(token_ids) - 1 of `slab` now hold these tokens."""
        i = self._ids[slab]
        start, tokens, b = self._held[i], self._tokens[i], self.block
        end = start + len(token_ids)
        if end > len(tokens):
            raise ValueError(f"{slab}: {end} rows would pass its {len(tokens)}")
        tokens[start:end] = array("q", token_ids)
        self._held[i] = end
        for j in range(start // b, end // b):  # the blocks this completes
            h = hash((self._hashes[i][j - 1] if j else 0, tuple(tokens[j * b : (j + 1) * b])))
            self._hashes[i][j] = h
            self._link(self._first[i] + j, h)

    def truncate(self, slab: Slab, keep: int) -> None:
        """Only rows 0 .. keep-1 of `slab` still hold what the index says (its new owner rewrites the rest)."""
        i = self._ids[slab]
        held = self._held[i]
        if held <= keep:
            return
        b = self.block
        for j in range(held // b - 1, keep // b - 1, -1):  # the whole blocks that go
            self._unlink(self._first[i] + j, self._hashes[i][j])
        self._held[i] = keep

    def assign(self, slab: Slab, token_ids: Sequence[int]) -> None:
        """`slab` now holds exactly `token_ids` (rows copied in from another slab)."""
        self.truncate(slab, 0)
        self.extend(slab, token_ids)

    def estimate(self, prompt: Sequence[int], limit: int) -> int:
        """Tokens of prompt[:limit] some slab holds, to the block: the prefill a placement will most likely skip,
        for admission by latency. It only reads the hash map (lookups, each atomic under the GIL), so the server's
        gRPC threads may call it while the engine thread updates the index; the slab may be taken before the
        request is placed, which is why it is an estimate."""
        held = 0
        for depth, h in enumerate(self._prompt_hashes(prompt, limit), start=1):
            if self._heads.get(h) is None:
                break
            held = depth * self.block
        return held

    def longest(self, prompt: Sequence[int], limit: int, eligible: Callable[[Slab], bool]) -> Match:
        """The eligible slab holding the longest prefix of prompt[:limit], and its length (at least one block), or
        NO_MATCH. Ties go to the slab that holds the fewest other rows (taking it loses the least).

        The prompt's block hashes are walked down the index while some slab holds them (a dict probe a block).
        When an eligible slab holds the deepest of them, those are the candidates; else the eligible slabs among
        the holders of the first block are. Each holds the prompt's
        first d blocks for d up to some depth and none past it (its hashes chain), and that depth is found by
        bisection over its own hash array (integer compares): O(blocks + holders + candidates * log blocks) even
        when hundreds of slabs share a long system prompt."""
        b = self.block
        chain: list[int] = []  # chain[d - 1]: the hash of the prompt's first d blocks, while some slab holds it
        for h in self._prompt_hashes(prompt, limit):
            if h not in self._heads:
                break
            chain.append(h)
        if not chain:
            return NO_MATCH
        ranked = [(len(chain), self._ids[s], s) for s in self._holders(chain[-1]) if eligible(s)]
        for slab in () if ranked else self._holders(chain[0]):  # the deepest holders first: often the answer
            if not eligible(slab):
                continue
            i = self._ids[slab]
            hashes = self._hashes[i]
            lo, hi = 1, min(len(chain), self._held[i] // b)  # it holds block 1; find its deepest held block
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] == chain[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            ranked.append((lo, i, slab))
        if not ranked:
            return NO_MATCH
        blocks = max(r[0] for r in ranked)
        depth, best = blocks * b, []
        for d, i, slab in ranked:
            if d != blocks:
                continue
            tokens = self._tokens[i]
            n, end = depth, min(limit, len(prompt), self._held[i])
            while n < end and tokens[n] == prompt[n]:  # the partial block after the last whole one
                n += 1
            best.append((-n, self._held[i], slab.offset, slab))
        for minus_n, _, _, slab in sorted(best):  # the best first; verified, as a hash collision could lie
            if self._tokens[self._ids[slab]][:depth].tolist() == list(prompt[:depth]):
                return Match(slab, -minus_n)
        return NO_MATCH

    # ---- internals ------------------------------------------------------------------------------------------------

    def _prompt_hashes(self, prompt: Sequence[int], limit: int) -> Iterator[int]:
        """The chained hashes of the prompt's whole blocks within prompt[:limit]."""
        b, h = self.block, 0
        for j in range(min(limit, len(prompt)) // b):
            h = hash((h, tuple(prompt[j * b : (j + 1) * b])))
            yield h

    def _holders(self, h: int) -> Iterator[Slab]:
        e = self._heads.get(h, _NONE)
        while e != _NONE:
            yield self._slabs[self._owner[e]]
            e = self._next[e]

    def _link(self, e: int, h: int) -> None:
        head = self._heads.get(h, _NONE)
        self._next[e], self._prev[e] = head, _NONE
        if head != _NONE:
            self._prev[head] = e
        self._heads[h] = e

    def _unlink(self, e: int, h: int) -> None:
        nxt, prev = self._next[e], self._prev[e]
        if prev != _NONE:
            self._next[prev] = nxt
        elif nxt != _NONE:
            self._heads[h] = nxt
        else:
            del self._heads[h]
        if nxt != _NONE:
            self._prev[nxt] = prev
        self._next[e] = self._prev[e] = _NONE
