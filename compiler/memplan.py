"""Activation memory planning: offsets for a graph's intermediates in one arena, and the proof that they are safe.

Contract: a graph is a sequence of `TensorSpec`s, each alive from the op that writes it (`first_use`) to the last op
that reads it (`last_use`), both inclusive. `plan_best_fit(specs)` returns a `Placement`, offsets into an arena,
such that no two tensors alive at the same op share a byte. Several graphs (one per token bucket) that never run at
the same time share one arena: `plan_shared(graphs)` plans each on its own and sizes the arena for the largest.
Every placement is checked by `verify` / `verify_shared`, which raise `PlanError` naming the offending tensors; the
planners call them before returning, always. Pure functions over frozen data: inputs are never mutated, and the
same inputs give the same placement.

Modeled on ExecuTorch's `exir/memory_planning.py` (greedy by size, best-fit gaps), with immutable specs and
placements instead of attributes stashed on graph nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from slabserve.runtime.units import round_up

DEFAULT_ALIGNMENT = 64  # bytes: a cache line, and enough for any dtype and vector load


class PlanError(ValueError):
    """A placement that is unsafe (overlap, out of the arena, misaligned) or inputs that cannot be planned."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One intermediate: `nbytes` alive from op `first_use` through op `last_use` (inclusive)."""

    name: str
    nbytes: int
    first_use: int
    last_use: int

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.nbytes, self.first_use,
                                                                             self.last_use)):
            raise PlanError(f"tensor {self.name!r}: nbytes, first_use and last_use must be integers")
        if self.nbytes < 0:
            raise PlanError(f"tensor {self.name!r}: nbytes {self.nbytes} is negative")
        if not 0 <= self.first_use <= self.last_use:
            raise PlanError(f"tensor {self.name!r}: lifetime [{self.first_use}, {self.last_use}] is not "
                            f"0 <= first_use <= last_use")

    def lives_with(self, other: TensorSpec) -> bool:
        """Whether both are alive at some op (inclusive lifetimes)."""
        return self.first_use <= other.last_use and other.first_use <= self.last_use


@dataclass(frozen=True, slots=True)
class Placement:
    """Offsets (bytes from the arena's start) by tensor name, in name order."""

    offsets: Mapping[str, int]
    arena_size: int  # bytes; a multiple of `alignment`
    alignment: int
    naive_size: int  # bytes if every intermediate had its own aligned buffer: what planning saves against

    def __post_init__(self) -> None:
        frozen = MappingProxyType({name: self.offsets[name] for name in sorted(self.offsets)})
        object.__setattr__(self, "offsets", frozen)


@dataclass(frozen=True, slots=True)
class SharedPlacement:
    """One arena for several graphs that never run at once (token buckets): each has its own placement in it."""

    placements: Mapping[str, Placement]  # by graph name, in name order
    arena_size: int  # the largest graph's arena
    alignment: int

    def __post_init__(self) -> None:
        frozen = MappingProxyType({name: self.placements[name] for name in sorted(self.placements)})
        object.__setattr__(self, "placements", frozen)

    @property
    def naive_size(self) -> int:
        """Bytes if every intermediate of every graph had its own buffer."""
        return sum(p.naive_size for p in self.placements.values())


def naive_size(specs: Iterable[TensorSpec], alignment: int = DEFAULT_ALIGNMENT) -> int:
    return sum(round_up(s.nbytes, alignment) for s in specs)


def plan_best_fit(specs: Sequence[TensorSpec], alignment: int = DEFAULT_ALIGNMENT) -> Placement:
    """Greedy by size, best fit: offsets for `specs` in one arena, verified before they are returned.

    Tensors are placed largest first (ties: earlier first_use, then name, so the result is deterministic). Each is
    sized up to a multiple of `alignment` and put into the smallest gap that holds it among the byte ranges of
    the already-placed tensors whose lifetimes overlap its own (ties: the lowest gap); with no such gap, right
    after the highest of those ranges. The arena is the highest end of any range.

    Why it is safe: when a tensor is placed, its range is disjoint from the range of every already-placed tensor
    it lives with, because gaps and the space above the highest range are, by construction, free of them. Living
    together is symmetric, so for any two tensors alive at the same op, whichever was placed second avoided the
    first. Every range starts at 0, at the end of an aligned range or at the end of the highest one, and all sizes
    are multiples of `alignment`, so by induction every offset is aligned.

    Why largest first: a large tensor placed late finds only gaps too small for it and goes on top; placed early,
    the small ones fill in around it (ExecuTorch's and TFLite's greedy-by-size).
    """
    _check_alignment(alignment)
    _check_unique(specs)
    order = sorted(specs, key=lambda s: (-s.nbytes, s.first_use, s.name))
    placed: list[tuple[TensorSpec, int, int]] = []  # (spec, offset, aligned size), in placement order
    offsets: dict[str, int] = {}
    arena = 0
    for spec in order:
        size = round_up(spec.nbytes, alignment)
        busy = sorted((off, off + sz) for other, off, sz in placed if sz and other.lives_with(spec))
        offset = _best_gap(busy, size)
        placed.append((spec, offset, size))
        offsets[spec.name] = offset
        arena = max(arena, offset + size)
    placement = Placement(offsets=offsets, arena_size=arena, alignment=alignment,
                          naive_size=naive_size(specs, alignment))
    verify(specs, placement)
    return placement


def _best_gap(busy: list[tuple[int, int]], size: int) -> int:
    """The start of the smallest free gap below the top of `busy` (sorted ranges) that holds `size` bytes."""
    if size == 0:
        return 0
    best_offset, best_gap = None, None
    cursor = 0  # everything below cursor is taken by some range seen so far
    for start, end in busy:
        gap = start - cursor
        if gap >= size and (best_gap is None or gap < best_gap):
            best_offset, best_gap = cursor, gap
        cursor = max(cursor, end)
    return cursor if best_offset is None else best_offset


def plan_shared(graphs: Mapping[str, Sequence[TensorSpec]], alignment: int = DEFAULT_ALIGNMENT) -> SharedPlacement:
    """One arena for graphs that never run at the same time; each is planned with `plan_best_fit` on its own.

    Why it is safe: tensors of different graphs are never alive together (one step runs one bucket's graph), so
    only tensors of the same graph can conflict, and each graph's placement is verified. The arena is the largest
    graph's, which is the least any layout can use, since that graph alone needs it.
    """
    if not graphs:
        raise PlanError("no graphs to plan")
    placements = {name: plan_best_fit(specs, alignment) for name, specs in graphs.items()}
    shared = SharedPlacement(placements=placements, arena_size=max(p.arena_size for p in placements.values()),
                             alignment=alignment)
    verify_shared(graphs, shared)
    return shared


# ---------------------------------------------------------------------------------------------------------------
# Verification


def verify(specs: Sequence[TensorSpec], placement: Placement) -> None:
    """Raise `PlanError` unless every tensor of `specs` has an aligned offset inside the arena and no two tensors
    alive at the same op share a byte. Zero-byte tensors occupy nothing and conflict with nothing."""
    _check_alignment(placement.alignment)
    _check_unique(specs)
    _check_names(specs, placement)
    for spec in specs:
        _check_bounds(spec, placement)
    _check_no_overlap(specs, placement.offsets)


def verify_shared(graphs: Mapping[str, Sequence[TensorSpec]], shared: SharedPlacement) -> None:
    """`verify` for each graph, against the one shared arena."""
    if set(graphs) != set(shared.placements):
        raise PlanError(f"graphs {sorted(graphs)} and placements {sorted(shared.placements)} differ")
    for name, specs in graphs.items():
        placement = shared.placements[name]
        if placement.arena_size > shared.arena_size or placement.alignment != shared.alignment:
            raise PlanError(f"graph {name!r}: its arena ({placement.arena_size} bytes, alignment "
                            f"{placement.alignment}) does not fit the shared one ({shared.arena_size} bytes, "
                            f"alignment {shared.alignment})")
        try:
            verify(specs, placement)
        except PlanError as err:
            raise PlanError(f"graph {name!r}: {err}") from None


def _check_alignment(alignment: int) -> None:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
        raise PlanError(f"alignment {alignment!r} must be a positive integer")


def _check_unique(specs: Sequence[TensorSpec]) -> None:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise PlanError(f"tensor name {spec.name!r} appears twice")
        seen.add(spec.name)


def _check_names(specs: Sequence[TensorSpec], placement: Placement) -> None:
    names = {s.name for s in specs}
    missing = sorted(names - set(placement.offsets))
    extra = sorted(set(placement.offsets) - names)
    if missing or extra:
        raise PlanError(f"placement does not match the tensors: no offset for {missing}, offsets for unknown {extra}")


def _check_bounds(spec: TensorSpec, placement: Placement) -> None:
    offset = placement.offsets[spec.name]
    if offset < 0 or offset % placement.alignment:
        raise PlanError(f"tensor {spec.name!r}: offset {offset} is not a non-negative multiple of the "
                        f"alignment {placement.alignment}")
    if offset + spec.nbytes > placement.arena_size:
        raise PlanError(f"tensor {spec.name!r}: bytes [{offset}, {offset + spec.nbytes}) run past the arena "
                        f"({placement.arena_size} bytes)")


def _check_no_overlap(specs: Sequence[TensorSpec], offsets: Mapping[str, int]) -> None:
    """Sweep by offset: only tensors whose byte ranges are still open can share bytes with the next one."""
    ranges = sorted(((offsets[s.name], offsets[s.name] + s.nbytes, s) for s in specs if s.nbytes),
                    key=lambda r: (r[0], r[1], r[2].name))
    open_ranges: list[tuple[int, TensorSpec]] = []  # (end, spec) of ranges that may reach past the next start
    for start, end, spec in ranges:
        open_ranges = [(other_end, other) for other_end, other in open_ranges if other_end > start]
        for other_end, other in open_ranges:
            if other.lives_with(spec):
                raise PlanError(
                    f"tensors {other.name!r} and {spec.name!r} share bytes while both alive: {other.name!r} at "
                    f"bytes [{offsets[other.name]}, {other_end}) ops [{other.first_use}, {other.last_use}], "
                    f"{spec.name!r} at bytes [{start}, {end}) ops [{spec.first_use}, {spec.last_use}]")
        open_ranges.append((end, spec))
