"""Activation planner: toy graphs with their optimal offsets written beside them, the verifier, and properties."""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slabserve.compiler.memplan import (
                                        Placement,
                                        PlanError,
                                        SharedPlacement,
                                        TensorSpec,
                                        plan_best_fit,
                                        plan_shared,
                                        verify,
                                        verify_shared,
                                        )


def T(name: str, nbytes: int, first: int, last: int) -> TensorSpec:
    return TensorSpec(name, nbytes, first, last)


# --- toy graphs with known offsets ---------------------------------------------------------------------------


def test_chain_reuses_two_buffers():
    # op i writes t{i} and op i+1 reads it: at most two are alive at once, so two 64-byte buffers ping-pong.
    specs = [T(f"t{i}", 64, i, i + 1) for i in range(5)]
    placement = plan_best_fit(specs)
    assert dict(placement.offsets) == {"t0": 0, "t1": 64, "t2": 0, "t3": 64, "t4": 0}
    assert placement.arena_size == 128  # optimal: two tensors alive at op 1
    assert placement.naive_size == 5 * 64


def test_largest_first_and_alignment():
    # b (200 -> 256 aligned) goes first at 0; a lives with b so it goes on top; c lives with b (not a): on top too;
    # d lives with c only, and the 256-byte gap below c holds it.
    specs = [T("a", 100, 0, 1), T("b", 200, 1, 2), T("c", 100, 2, 3), T("d", 50, 3, 4)]
    placement = plan_best_fit(specs)
    assert dict(placement.offsets) == {"a": 256, "b": 0, "c": 256, "d": 0}
    assert placement.arena_size == 384  # optimal: b and a are alive together at op 1, 256 + 128 bytes
    assert placement.naive_size == 128 + 256 + 128 + 64


def test_best_fit_picks_the_tightest_gap():
    # Alignment 1 to keep the numbers plain. A, B, C, D are alive together at op 0 and stack up to 134 bytes.
    # N (ops 2-4) lives with B at [40, 75) and D at [105, 134): the gaps are [0, 40) (40 bytes) and [75, 105)
    # (30 bytes). First fit would take 0; best fit takes the 30-byte gap at 75 and keeps the 40 bytes whole.
    specs = [T("A", 40, 0, 0), T("B", 35, 0, 4), T("C", 30, 0, 0), T("D", 29, 0, 4), T("N", 28, 2, 4)]
    placement = plan_best_fit(specs, alignment=1)
    assert dict(placement.offsets) == {"A": 0, "B": 40, "C": 75, "D": 105, "N": 75}
    assert placement.arena_size == 134  # optimal: the live bytes at op 0


def test_disjoint_lifetimes_share_offset_zero():
    specs = [T("x", 1000, 0, 0), T("y", 10, 1, 1), T("z", 500, 2, 3)]
    placement = plan_best_fit(specs)
    assert dict(placement.offsets) == {"x": 0, "y": 0, "z": 0}
    assert placement.arena_size == 1024


def test_zero_byte_tensor_takes_no_space():
    placement = plan_best_fit([T("big", 128, 0, 2), T("empty", 0, 0, 2)])
    assert dict(placement.offsets) == {"big": 0, "empty": 0}
    assert placement.arena_size == 128


def test_empty_graph():
    placement = plan_best_fit([])
    assert placement.arena_size == 0 and dict(placement.offsets) == {}


def test_shared_arena_is_the_largest_bucket():
    # Two buckets never run at once: each is planned alone, names may repeat, the arena is the larger one.
    graphs = {
        "T=1": [T("h", 64, 0, 1), T("o", 64, 1, 2)],
        "T=4": [T("h", 256, 0, 1), T("o", 256, 1, 2), T("s", 64, 0, 2)],
    }
    shared = plan_shared(graphs)
    assert dict(shared.placements["T=1"].offsets) == {"h": 0, "o": 64}
    # h at 0; o lives with h: 256; s lives with both: 512.
    assert dict(shared.placements["T=4"].offsets) == {"h": 0, "o": 256, "s": 512}
    assert shared.arena_size == 576
    assert shared.naive_size == 128 + 576
    assert list(shared.placements) == ["T=1", "T=4"]


def test_plan_shared_needs_a_graph():
    with pytest.raises(PlanError, match="no graphs"):
        plan_shared({})


# --- the verifier ----------------------------------------------------------------------------------------------


SPECS = [T("q", 128, 0, 2), T("k", 128, 1, 3), T("v", 64, 4, 5)]


def test_verifier_accepts_a_correct_hand_placement():
    verify(SPECS, Placement({"q": 0, "k": 128, "v": 0}, arena_size=256, alignment=64, naive_size=320))


def test_verifier_catches_overlap_of_live_tensors():
    bad = Placement({"q": 0, "k": 64, "v": 0}, arena_size=256, alignment=64, naive_size=320)
    with pytest.raises(PlanError, match=r"'q' and 'k' share bytes while both alive"):
        verify(SPECS, bad)


def test_verifier_allows_overlap_of_tensors_alive_at_different_ops():
    # q (ops 0-2) and v (ops 4-5) never live together, so sharing bytes is fine.
    verify(SPECS, Placement({"q": 0, "k": 128, "v": 64}, arena_size=256, alignment=64, naive_size=320))


@pytest.mark.parametrize(
    "offsets, arena, alignment, message",
    [
        ({"q": 0, "k": 128, "v": 0}, 200, 64, r"'k': bytes \[128, 256\) run past the arena \(200 bytes\)"),
        ({"q": 0, "k": 160, "v": 0}, 512, 64, r"'k': offset 160 is not a non-negative multiple of the alignment 64"),
        ({"q": -64, "k": 128, "v": 0}, 256, 64, r"'q': offset -64"),
        ({"q": 0, "k": 128}, 256, 64, r"no offset for \['v'\]"),
        ({"q": 0, "k": 128, "v": 0, "w": 0}, 256, 64, r"offsets for unknown \['w'\]"),
        ({"q": 0, "k": 128, "v": 0}, 256, 0, r"alignment 0 must be a positive integer"),
    ],
)
def test_verifier_refuses(offsets, arena, alignment, message):
    with pytest.raises(PlanError, match=message):
        verify(SPECS, Placement(offsets, arena_size=arena, alignment=alignment, naive_size=0))


def test_verify_shared_names_the_graph():
    graphs = {"T=1": [T("a", 64, 0, 1), T("b", 64, 0, 1)]}
    bad = SharedPlacement({"T=1": Placement({"a": 0, "b": 0}, 128, 64, 128)}, arena_size=128, alignment=64)
    with pytest.raises(PlanError, match=r"graph 'T=1': tensors 'a' and 'b' share bytes"):
        verify_shared(graphs, bad)


def test_verify_shared_refuses_a_bucket_larger_than_the_arena():
    graphs = {"T=1": [T("a", 256, 0, 1)]}
    bad = SharedPlacement({"T=1": Placement({"a": 0}, 256, 64, 256)}, arena_size=128, alignment=64)
    with pytest.raises(PlanError, match=r"graph 'T=1': its arena \(256 bytes"):
        verify_shared(graphs, bad)


@pytest.mark.parametrize(
    "args, message",
    [(("x", -1, 0, 0), "nbytes -1 is negative"), (("x", 8, 3, 2), r"lifetime \[3, 2\]"), (("x", 8, -1, 2), "lifetime"),
     (("x", 8.0, 0, 1), "must be integers"), (("x", True, 0, 1), "must be integers")],
)
def test_tensor_spec_refuses_nonsense(args, message):
    with pytest.raises(PlanError, match=message):
        TensorSpec(*args)


def test_duplicate_names_are_refused():
    with pytest.raises(PlanError, match="'a' appears twice"):
        plan_best_fit([T("a", 64, 0, 1), T("a", 64, 2, 3)])


def test_placement_is_immutable():
    placement = plan_best_fit(SPECS)
    with pytest.raises(TypeError):
        placement.offsets["q"] = 64  # type: ignore[index]
    with pytest.raises(AttributeError):
        placement.arena_size = 0  # type: ignore[misc]


# --- properties ------------------------------------------------------------------------------------------------


@st.composite
def graphs(draw):
    count = draw(st.integers(0, 40))
    specs = []
    for i in range(count):
        first = draw(st.integers(0, 30))
        last = draw(st.integers(first, first + 15))
        specs.append(T(f"t{i}", draw(st.integers(0, 5000)), first, last))
    return specs


def _live_peak(specs, alignment):
    ops = {op for s in specs for op in range(s.first_use, s.last_use + 1)}
    return max((sum(-(-s.nbytes // alignment) * alignment for s in specs if s.first_use <= op <= s.last_use)
                for op in ops), default=0)


@settings(max_examples=150, deadline=None)
@given(specs=graphs(), alignment=st.sampled_from([1, 16, 64, 256]))
def test_random_lifetimes_always_verify(specs, alignment):
    placement = plan_best_fit(specs, alignment)
    verify(specs, placement)
    # An independent pairwise check, not sharing code with the verifier's sweep.
    for a, b in itertools.combinations(specs, 2):
        if a.nbytes and b.nbytes and a.first_use <= b.last_use and b.first_use <= a.last_use:
            oa, ob = placement.offsets[a.name], placement.offsets[b.name]
            assert oa + a.nbytes <= ob or ob + b.nbytes <= oa, (a, b, placement)
    # No layout beats the bytes alive at the busiest op; none is worse than a buffer per tensor.
    assert _live_peak(specs, alignment) <= placement.arena_size <= placement.naive_size


@settings(max_examples=50, deadline=None)
@given(specs=graphs(), seed=st.integers(0, 2**32 - 1))
def test_placement_does_not_depend_on_input_order(specs, seed):
    shuffled = list(specs)
    random.Random(seed).shuffle(shuffled)
    assert plan_best_fit(shuffled) == plan_best_fit(specs)


@settings(max_examples=50, deadline=None)
@given(specs=graphs(), data=st.data())
def test_verifier_catches_any_forced_overlap(specs, data):
    live_pairs = [(a, b) for a, b in itertools.combinations(specs, 2)
                  if a.nbytes and b.nbytes and a.lives_with(b)]
    if not live_pairs:
        return
    a, b = data.draw(st.sampled_from(live_pairs))
    placement = plan_best_fit(specs)
    offsets = dict(placement.offsets)
    offsets[b.name] = offsets[a.name]  # b now starts where a starts, while both are alive
    forced = Placement(offsets, placement.arena_size + b.nbytes, placement.alignment, placement.naive_size)
    with pytest.raises(PlanError, match="share bytes while both alive"):
        verify(specs, forced)
