"""Slab planner: hand-computed evaluations, the default mix against the baselines, traces, and properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slabserve.compiler.spec import RequestClass, load_spec, parse_spec
from slabserve.compiler.slabs import (
                                      NeedDistribution,
                                      SlabPlanError,
                                      evaluate_slabs,
                                      kv_bytes_per_token,
                                      needs_from_mix,
                                      needs_from_pairs,
                                      plan_kv,
                                      plan_slabs,
                                      verify_slab_plan,
                                      )
from slabserve.runtime.units import round_up

GiB = 1024**3
SMOLLM2_BPT = 2 * 30 * 3 * 64 * 4  # fp32 K and V, 30 layers, 3 KV heads of 64


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(30, 3, 64, 4) == SMOLLM2_BPT == 46080
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072  # Llama 3 8B in bf16: 128 KiB per token


# --- need distributions --------------------------------------------------------------------------------------


def test_uniform_ranges_sum_to_a_trapezoid():
    needs = needs_from_mix([RequestClass(share=1.0, prompt=(1, 2), output=(1, 2))])
    assert needs.needs == (2, 3, 4)
    assert needs.probs == pytest.approx((0.25, 0.5, 0.25))
    assert needs.mean == pytest.approx(3.0)


def test_mix_weights_classes_by_share():
    needs = needs_from_mix([RequestClass(0.75, (10, 10), (6, 6)), RequestClass(0.25, (100, 100), (28, 28))])
    assert needs.needs == (16, 128) and needs.probs == pytest.approx((0.75, 0.25))
    assert needs.mass_upto(15) == 0.0 and needs.mass_upto(16) == pytest.approx(0.75) and needs.mass_upto(999) == 1
    assert needs.quantile(0.5) == 16 and needs.quantile(0.9) == 128


def test_pairs_give_the_empirical_distribution():
    needs = needs_from_pairs([(50, 50), (60, 40), (200, 100), (900, 100)])
    assert needs.needs == (100, 300, 1000) and needs.probs == (0.5, 0.25, 0.25)


# --- listed classes, evaluated by hand -----------------------------------------------------------------------

# Needs: 100 tokens (half the requests), 300 (a quarter), 1000 (a quarter). E[need] = 50 + 75 + 250 = 375.
HAND_NEEDS = needs_from_pairs([(50, 50), (50, 50), (200, 100), (900, 100)])
HAND = dict(max_context=1024, max_seqs=16, kv_bytes_per_token=10, budget_bytes=100_000)


def test_listed_classes_evaluated_by_hand():
    plan = evaluate_slabs([(128, 4), (512, 2), (1024, 2)], HAND_NEEDS, **HAND)
    assert [(c.tokens, c.count) for c in plan.classes] == [(128, 4), (512, 2), (1024, 2)]
    assert [c.share for c in plan.classes] == pytest.approx([0.5, 0.25, 0.25])
    # Requests that only class >= i holds: all of them; the 1/2 above 128; the 1/4 above 512.
    # Slabs of class >= i: 8, 4, 2. N = min(8 / 1, 4 / 0.5, 2 / 0.25) = 8.
    assert plan.concurrency == 8
    # Held: 0.5 * 128 + 0.25 * 512 + 0.25 * 1024 = 448 tokens per request; needed 375.
    assert plan.utilization == pytest.approx(375 / 448)
    assert plan.internal_waste == pytest.approx(73 / 448)
    assert plan.internal_waste_bytes == 8 * (448 - 375) * 10
    assert plan.arena_tokens == 512 + 1024 + 2048 and plan.arena_bytes == 35_840
    assert plan.unservable_share == 0.0
    assert plan.max_request_tokens == 1024
    fixed, paged = plan.baselines
    # 100_000 // (1024 * 10) = 9 max_context slots.
    assert (fixed.units, fixed.concurrency) == (9, 9) and fixed.utilization == pytest.approx(375 / 1024)
    # 625 pages of 16; E[pages] = 0.5 * 7 + 0.25 * 19 + 0.25 * 63 = 24; 625 // 24 = 26, capped at max_seqs 16.
    assert (paged.units, paged.concurrency) == (625, 16) and paged.utilization == pytest.approx(375 / 384)


def test_the_scarcest_class_limits_concurrency():
    # One 512-token slab: 3 slabs >= 512 for half the requests gives N = 6 (a long request may take a 512 slab).
    plan = evaluate_slabs([(128, 4), (512, 1), (1024, 2)], HAND_NEEDS, **HAND)
    assert plan.concurrency == 6


def test_needs_above_the_largest_class_are_unservable():
    plan = evaluate_slabs([(128, 4), (512, 2)], HAND_NEEDS, **HAND)
    assert plan.unservable_share == pytest.approx(0.25)
    # Among servable requests: 2/3 need 100, 1/3 need 300. N = min(6 / 1, 2 / (1/3)) = 6.
    assert plan.concurrency == 6
    assert plan.utilization == pytest.approx((100 * 2 / 3 + 300 / 3) / (128 * 2 / 3 + 512 / 3))


def test_listed_classes_without_a_mix():
    plan = evaluate_slabs([(128, 4), (1024, 2)], None, **HAND)
    assert plan.concurrency == 6 and plan.utilization is None and plan.baselines == ()
    assert plan.layout() == ((0, 128), (128, 128), (256, 128), (384, 128), (512, 1024), (1536, 1024))


def test_listed_classes_over_budget_say_what_to_drop():
    with pytest.raises(SlabPlanError, match=r"the slabs need .* above the KV budget .*1 fewer 1024-token slabs free"):
        evaluate_slabs([(128, 4), (1024, 10)], HAND_NEEDS, **{**HAND, "budget_bytes": 100_000, "max_seqs": 16})


def test_listed_classes_over_max_seqs():
    with pytest.raises(SlabPlanError, match=r"20 slabs in all, more than max_seqs \(16\)"):
        evaluate_slabs([(128, 20)], HAND_NEEDS, **HAND)


# --- planning --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_spec():
    return load_spec("plans/smollm2-135m.yaml")


def test_default_mix_beats_one_max_context_slot_per_sequence(default_spec):
    plan = plan_kv(default_spec.kv, max_context=default_spec.max_context, max_seqs=default_spec.max_seqs,
                   kv_bytes_per_token=SMOLLM2_BPT, default_budget_bytes=2 * GiB)
    fixed = next(b for b in plan.baselines if b.name == "max_context slots")
    assert plan.utilization > 3 * fixed.utilization
    assert plan.concurrency > 3 * fixed.concurrency
    assert plan.arena_bytes == sum(c.tokens * c.count for c in plan.classes) * SMOLLM2_BPT <= 2 * GiB
    assert sum(c.count for c in plan.classes) <= default_spec.max_seqs
    assert plan.max_request_tokens == 8192  # the analyses reach the full context
    assert all(c.tokens % 16 == 0 for c in plan.classes)


def test_a_large_budget_stops_at_max_seqs_with_the_least_memory(default_spec):
    common = dict(max_context=8192, max_seqs=32, kv_bytes_per_token=SMOLLM2_BPT)
    big = plan_kv(default_spec.kv, default_budget_bytes=64 * GiB, **common)
    assert big.concurrency == 32 and sum(c.count for c in big.classes) == 32
    assert big.arena_bytes < 4 * GiB  # sized for 32 requests of the mix, not for the budget


def test_plan_is_deterministic(default_spec):
    again = load_spec("plans/smollm2-135m.yaml")
    args = dict(max_context=8192, max_seqs=32, kv_bytes_per_token=SMOLLM2_BPT, default_budget_bytes=2 * GiB)
    assert plan_kv(default_spec.kv, **args) == plan_kv(again.kv, **args)


def test_a_trace_is_planned(tmp_path):
    lines = ["prompt,output"] + [f"{p},{o}" for p, o in [(100, 28)] * 60 + [(900, 124)] * 30 + [(3000, 1000)] * 10]
    (tmp_path / "trace.csv").write_text("\n".join(lines) + "\n")
    spec = parse_spec({
        "name": "traced", "model": {"path": "m.gguf"}, "target": {"device": "cpu", "memory": "8GiB"},
        "max_seqs": 64, "step_tokens": 64, "max_context": 4096,
        "kv": {"workload": {"trace": "trace.csv", "max_classes": 3}},
    }, base_dir=tmp_path)
    plan = plan_kv(spec.kv, max_context=4096, max_seqs=64, kv_bytes_per_token=1000, default_budget_bytes=10**8)
    # Three needs, three classes: every request gets exactly its need, rounded to 16 tokens: no waste at all.
    assert [c.tokens for c in plan.classes] == [128, 1024, 4000]
    assert plan.utilization == pytest.approx(1.0)
    assert plan.concurrency == 64  # max_seqs: the budget holds more
    # The cheapest counts for 64 requests: slabs >= 4000 tokens: ceil(0.1 * 64) = 7; >= 1024: ceil(0.4 * 64) = 26,
    # so 19 of 1024; all 64, so 38 of 128. (Rounding each class up on its own would give 39, 20, 7.)
    assert [c.count for c in plan.classes] == [38, 19, 7]
    assert plan.arena_bytes <= 10**8


def test_too_small_a_budget_says_by_how_much():
    needs = needs_from_pairs([(100, 28), (8000, 192)])
    with pytest.raises(SlabPlanError, match=r"cannot hold one slab of 8192 tokens .* raise the KV budget by at least"):
        plan_slabs(needs, max_context=8192, max_seqs=8, kv_bytes_per_token=SMOLLM2_BPT, budget_bytes=256 * 1024**2)


def test_a_need_above_max_context_is_refused():
    with pytest.raises(SlabPlanError, match=r"needs 9000 tokens, above max_context \(8192\)"):
        plan_slabs(needs_from_pairs([(8000, 1000)]), max_context=8192, max_seqs=8, kv_bytes_per_token=1,
                   budget_bytes=GiB)


def test_the_verifier_refuses_a_plan_over_budget():
    plan = evaluate_slabs([(128, 4)], HAND_NEEDS, **{**HAND, "max_context": 1024})
    from dataclasses import replace

    with pytest.raises(SlabPlanError, match="above its budget"):
        verify_slab_plan(replace(plan, budget_bytes=plan.arena_bytes - 1))
    with pytest.raises(SlabPlanError, match="totals do not add up"):
        verify_slab_plan(replace(plan, arena_tokens=plan.arena_tokens + 16))


# --- properties ------------------------------------------------------------------------------------------------


@st.composite
def mixes(draw):
    count = draw(st.integers(1, 3))
    weights = [draw(st.integers(1, 10)) for _ in range(count)]
    mix = []
    for w in weights:
        p_lo = draw(st.integers(1, 2000))
        o_lo = draw(st.integers(1, 1000))
        mix.append(RequestClass(share=w / sum(weights), prompt=(p_lo, p_lo + draw(st.integers(0, 2000))),
                                output=(o_lo, o_lo + draw(st.integers(0, 1000)))))
    return mix


@settings(max_examples=25, deadline=None)
@given(mix=mixes(), budget_slots=st.integers(1, 200), max_seqs=st.integers(1, 256), max_classes=st.integers(1, 5))
def test_planned_slabs_fit_and_never_lose_to_fixed_slots(mix, budget_slots, max_seqs, max_classes):
    needs = needs_from_mix(mix)
    max_context = round_up(needs.max_need, 1024)
    bpt = 1000
    budget = budget_slots * max_context * bpt
    plan = plan_slabs(needs, max_context=max_context, max_seqs=max_seqs, kv_bytes_per_token=bpt,
                      budget_bytes=budget, max_classes=max_classes)
    verify_slab_plan(plan)
    assert sum(c.tokens * c.count for c in plan.classes) * bpt == plan.arena_bytes <= budget
    assert len(plan.classes) <= max_classes and plan.classes[-1].tokens >= needs.max_need
    fixed = plan.baselines[0]
    assert plan.concurrency >= fixed.concurrency
    assert plan.utilization >= fixed.utilization - 1e-12
    assert plan.unservable_share == 0.0


def test_need_distribution_refuses_nonsense():
    with pytest.raises(SlabPlanError, match="strictly ascending"):
        NeedDistribution(needs=(5, 5), probs=(0.5, 0.5))
    with pytest.raises(SlabPlanError, match="sum to 1"):
        NeedDistribution(needs=(5, 6), probs=(0.5, 0.4))
