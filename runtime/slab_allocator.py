"""KV slab bookkeeping: which slab of which class is free. Pure Python, no torch: it only hands out row ranges.

The KV arena holds the planned slab classes one after another: class 0's `count` slabs first, each `tokens` rows,
then class 1's, and so on. A `Slab` names one of them by its first row (`offset`) in the arena; the same row range
is used in every layer. The allocator never creates or resizes anything after construction: `allocate` pops a
pre-made `Slab` off its class's free stack and `free` pushes it back, both O(1).

Admission policy (DESIGN.md "smallest free class that fits"): a request needing `n` rows has a *home* class, the
smallest class with `tokens >= n` (`class_for`). It is placed in the smallest class at or above its home that has a
free slab (`free_class_for`), so a short request may borrow a longer slab rather than wait while one is idle. When
every class that fits is full it waits in the queue of its home class; the scheduler owns those queues.
"""
from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlabClass:
    tokens: int  # capacity of one slab, in token positions (KV rows)
    count: int   # slabs of this class in the arena

    def __post_init__(self) -> None:
        if type(self.tokens) is not int or self.tokens < 1:
            raise ValueError(f"SlabClass.tokens must be a positive int, got {self.tokens!r}")
        if type(self.count) is not int or self.count < 1:
            raise ValueError(f"SlabClass.count must be a positive int, got {self.count!r}")


# The class_index of a declared prefix's rows (runtime.scheduler.declare_prefix): outside every class, never
# allocated or freed, only copied from.
DECLARED = -1


@dataclass(frozen=True, slots=True)
class Slab:
    class_index: int  # index into the allocator's classes
    offset: int       # first KV row of the slab in the KV arena
    tokens: int       # rows of the slab: positions 0 .. tokens-1 of a sequence live at offset .. offset+tokens-1


class SlabAllocator:
    """Free lists of a fixed set of slabs. Not thread-safe: one owner (the scheduler) calls it."""

    def __init__(self, classes: Sequence[SlabClass]):
        self.classes: tuple[SlabClass, ...] = tuple(classes)
        if not self.classes:
            raise ValueError("SlabAllocator needs at least one slab class")
        for i in range(1, len(self.classes)):
            if self.classes[i].tokens <= self.classes[i - 1].tokens:
                raise ValueError(f"slab classes must be strictly ascending in tokens: class {i} has "
                                 f"{self.classes[i].tokens}, class {i - 1} has {self.classes[i - 1].tokens}")
        self._class_tokens = tuple(c.tokens for c in self.classes)
        self._bases, self.total_rows = _class_bases(self.classes)
        # Every Slab object exists from the start, so allocate() builds nothing.
        self._slabs = tuple(
            tuple(Slab(ci, base + k * c.tokens, c.tokens) for k in range(c.count))
            for ci, (c, base) in enumerate(zip(self.classes, self._bases))
        )
        # Free slab indices per class in the order they fell free, oldest first (at the start as if slab 0 fell free
        # last, so the first allocate() returns it).
        # allocate() hands out the slab freed last (its rows are the most likely still in cache); allocate_lru() the
        # one freed longest ago (whose retained prefix has gone unused the longest); allocate_slab() a given one.
        self._free: list[OrderedDict[int, None]] = [OrderedDict.fromkeys(range(c.count - 1, -1, -1))
                                                    for c in self.classes]
        self._in_use = [bytearray(c.count) for c in self.classes]

    @property
    def max_tokens(self) -> int:
        """The largest request (prompt + max_tokens) any slab can hold."""
        return self._class_tokens[-1]

    def class_for(self, need_tokens: int) -> int | None:
        """Home class of a request needing `need_tokens` rows: the smallest class that can ever hold it."""
        if need_tokens < 1:
            raise ValueError(f"need_tokens must be >= 1, got {need_tokens}")
        i = bisect_left(self._class_tokens, need_tokens)
        return i if i < len(self._class_tokens) else None

    def smallest_free_class(self, from_class: int) -> int | None:
        """The smallest class >= `from_class` with a free slab, or None. O(classes), and there are few."""
        for ci in range(from_class, len(self._free)):
            if self._free[ci]:
                return ci
        return None

    def free_class_for(self, need_tokens: int) -> int | None:
        """Where a request needing `need_tokens` rows is placed now, or None if it has to wait (or never fits)."""
        home = self.class_for(need_tokens)
        return None if home is None else self.smallest_free_class(home)

    def can_allocate(self, class_index: int) -> bool:
        return bool(self._free[class_index])

    def allocate(self, class_index: int) -> Slab:
        """The free slab of `class_index` freed last."""
        k = self._free_of(class_index).popitem(last=True)[0]
        self._in_use[class_index][k] = 1
        return self._slabs[class_index][k]

    def allocate_lru(self, class_index: int, avoid: Slab | None = None) -> Slab:
        """The free slab of `class_index` freed longest ago, other than `avoid` (a copy's source) when another is
        free."""
        free = self._free_of(class_index)
        k = next(iter(free))
        if avoid is not None and avoid.class_index == class_index and len(free) > 1 and k == self._index_of(avoid):
            k = next(itertools.islice(free, 1, None))
        del free[k]
        self._in_use[class_index][k] = 1
        return self._slabs[class_index][k]

    def allocate_slab(self, slab: Slab) -> Slab:
        """`slab` itself, which must be free (a retained prefix admission chose)."""
        k = self._index_of(slab)
        if not self.is_free(slab):
            raise ValueError(f"{slab} is not free")
        del self._free[slab.class_index][k]
        self._in_use[slab.class_index][k] = 1
        return slab

    def is_free(self, slab: Slab) -> bool:
        return not self._in_use[slab.class_index][self._index_of(slab)]

    def slabs(self) -> tuple[Slab, ...]:
        """Every slab, in arena order."""
        return tuple(s for per_class in self._slabs for s in per_class)

    def _free_of(self, class_index: int) -> OrderedDict[int, None]:
        free = self._free[class_index]
        if not free:
            raise ValueError(f"slab class {class_index} ({self._class_tokens[class_index]} tokens) has no free slab")
        return free

    def free(self, slab: Slab) -> None:
        """Return `slab`; freeing a slab twice, or one this allocator did not hand out, is an error."""
        k = self._index_of(slab)
        in_use = self._in_use[slab.class_index]
        if not in_use[k]:
            raise ValueError(f"double free of slab {slab}")
        in_use[k] = 0
        self._free[slab.class_index][k] = None

    def free_counts(self) -> tuple[int, ...]:
        return tuple(len(f) for f in self._free)

    def total_counts(self) -> tuple[int, ...]:
        return tuple(c.count for c in self.classes)

    def _index_of(self, slab: Slab) -> int:
        ci = slab.class_index
        if not 0 <= ci < len(self.classes):
            raise ValueError(f"{slab} names no class of this allocator ({len(self.classes)} classes)")
        k, rem = divmod(slab.offset - self._bases[ci], self.classes[ci].tokens)
        if rem or not 0 <= k < self.classes[ci].count or (self._slabs[ci][k] is not slab
                                                           and self._slabs[ci][k] != slab):
            raise ValueError(f"{slab} is not a slab of this allocator")
        return k


def _class_bases(classes: Sequence[SlabClass]) -> tuple[tuple[int, ...], int]:
    """First arena row of each class, and the arena's total rows: classes are laid out back to back."""
    bases = []
    row = 0
    for c in classes:
        bases.append(row)
        row += c.tokens * c.count
    return tuple(bases), row
