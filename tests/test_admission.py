"""Admission by latency (runtime/admission.py): projections under the prefill order, refusals that protect admitted
requests, the scheduler's measured step times, and the server refusing at the gRPC edge without the engine thread."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import pytest

from slabserve.runtime.admission import (ERROR_MIN_FIRST_TOKENS, LOAD_WINDOW_S, MAX_ERROR, MAX_LOAD, AdmissionView,
                                         Arrival, DelayBoundError, OverloadedError, Pending, ProjectionError,
                                         StepTimes, prefill_pairs)
from slabserve.runtime.scheduler import QueueFullError, Request, Scheduler
from slabserve.runtime.slab_allocator import SlabClass

BUCKETS = (1, 2, 4, 8, 16, 32)


def _view(pending=(), *, bound=1.0, seconds=None, decoding=0, oldest=None, slab_wait=(0.0, 0.0), share=0.25,
          pair_seconds=0.0, arrivals=(), error=0.0):
    seconds = {b: 0.125 for b in BUCKETS} if seconds is None else seconds  # 1/8 s a step, whatever its size
    return AdmissionView(bound, pending, oldest, decoding, 32, BUCKETS, seconds, share, slab_wait,
                         next_seq_no=100, pair_seconds=pair_seconds, arrivals=arrivals, projection_error=error)


def _busy(tokens: int, seconds_of_work: float, now: float = 0.0) -> list[Arrival]:
    """Prompts of `tokens` tokens admitted over the window, `seconds_of_work` of prefill at 1/256 s a token."""
    n = round(seconds_of_work * 256 / tokens)
    return [Arrival(now - LOAD_WINDOW_S * (i + 0.5) / n, tokens) for i in range(n)]


def test_seconds_for_counts_full_steps_then_the_bucket_of_the_rest():
    v = _view(seconds={32: 1.0, 8: 0.25, 1: 0.05}, decoding=4)  # 28 prefill tokens a step beside 4 decodes
    assert v.seconds_for(0) == 0.0
    assert v.seconds_for(28) == 1.0                  # one full step
    assert v.seconds_for(56 + 3) == 2.0 + 0.25       # two full steps, then 4 + 3 rows: bucket 8
    assert v.seconds_for(29) == 1.0 + 0.25           # bucket 2 unmeasured: the next larger measured one (8)


def test_prefill_pairs_count_every_row_against_the_keys_before_it():
    assert prefill_pairs(0, 1) == 1 and prefill_pairs(0, 4) == 1 + 2 + 3 + 4
    assert prefill_pairs(10, 3) == 11 + 12 + 13
    assert prefill_pairs(5, 0) == 0
    assert Pending(3, seq_no=0, deadline=1.0, done=10).pairs == 36


def test_seconds_for_adds_attention_over_the_pairs():
    v = _view(seconds={32: 1.0, 8: 0.25}, decoding=4, pair_seconds=1e-4)
    assert v.seconds_for(28, pairs=5000) == pytest.approx(1.0 + 0.5)
    assert v.seconds_for(0, pairs=5000) == 0.0


def test_a_long_prompt_is_promised_its_attention_too():
    """A 3,200-token prompt: 100 steps of 1/8 s, plus 5,121,600 pairs at 2 us: 12.5 + 10.2 s of its own prefill,
    and as long again to wait. Without the pairs it would be promised 25 s, about half of what it needs; a prompt
    whose first 1,000 tokens are reused attends over more keys per row than the same count from position 0."""
    ps = 2e-6
    own = 100 * 0.125 + ps * prefill_pairs(0, 3200)
    assert _view(pair_seconds=ps).admit(3200, 1, now=0.0) == pytest.approx(2 * own)
    assert _view().admit(3200, 1, now=0.0) == pytest.approx(25.0)
    own_after = 100 * 0.125 + ps * prefill_pairs(1000, 3200)
    assert _view(pair_seconds=ps).admit(3200, 1, now=0.0, done=1000) == pytest.approx(2 * own_after)


def test_the_work_ahead_counts_its_attention():
    # a 256-token prompt (8 steps, due in 1 + 1 s) behind 7 steps of a shorter one: 1.875 s by steps alone, but
    # those 224 rows sit deep in their slab and attend over 4,000 keys each (0.92 s more at 1 us a pair)
    ahead = [Pending(224, seq_no=1, deadline=1e9, done=4000)]
    _view(ahead).admit(256, 0, now=0.0)
    with pytest.raises(DelayBoundError, match="its own first token"):
        _view(ahead, pair_seconds=1e-6).admit(256, 0, now=0.0)


def test_the_load_to_come_stretches_a_long_prompt_and_its_promise():
    """256-token prompts that took half the machine over the window will overtake a 3,200-token prompt at the same
    rate while it waits (its 64 steps ahead take twice their idle length) and while more than 256 of its own tokens
    are left, so its own 100 steps take (2944 * 2 + 256) / 3200 = 1.92x theirs. An idle server
    projects 20.5 s and promises 25 s; prompts longer than it, or admitted before the window, do not count."""
    ahead = [Pending(32 * 64, seq_no=1, deadline=1e9)]
    idle = _view(ahead).decide(3200, 1, now=0.0)
    assert (idle.promise, idle.projected) == (pytest.approx(25.0), pytest.approx(20.5))
    busy = _busy(256, LOAD_WINDOW_S / 2)
    v = _view(ahead, arrivals=busy)
    assert v.load_below(3200, 0.0) == pytest.approx(0.5) and v.stretch(3200, 0.0) == pytest.approx(2.0)
    own = 12.5 * (2944 * 2 + 256) / 3200
    assert v.own_stretch(3200, 0.0) == pytest.approx(own / 12.5)
    loaded = _view(ahead, arrivals=busy).decide(3200, 1, now=0.0)
    assert (loaded.promise, loaded.projected) == (pytest.approx(2 * own), pytest.approx(8.0 * 2 + own))
    others = _busy(5000, LOAD_WINDOW_S / 2) + [Arrival(-LOAD_WINDOW_S - 1.0, 256)] * 100
    assert _view(ahead, arrivals=others).decide(3200, 1, now=0.0) == idle


def test_a_short_prompt_is_stretched_only_by_shorter_arrivals():
    v = _view(arrivals=_busy(256, LOAD_WINDOW_S / 2))
    assert v.stretch(32, 0.0) == 1.0 and v.stretch(256, 0.0) == 1.0 and v.stretch(257, 0.0) == pytest.approx(2.0)
    assert v.own_stretch(256, 0.0) == 1.0 and v.own_stretch(512, 0.0) == pytest.approx(1.5)
    assert v.admit(32, 0, now=0.0) == pytest.approx(1.0 + 0.125)


def test_the_stretch_is_bounded_by_the_oldest_sequences_share():
    v = _view(arrivals=_busy(64, 10 * LOAD_WINDOW_S))
    assert v.stretch(1000, 0.0) == pytest.approx(1 / (1 - MAX_LOAD))
    assert v.own_stretch(1000, 0.0) == pytest.approx((64 + 936 / (1 - MAX_LOAD)) / 1000)


def test_a_busy_server_refuses_what_an_idle_one_admits():
    """A 128-token prompt (0.5 s alone) behind 6 steps of shorter work (0.75 s), bound 1 s: idle, its first token is
    projected at 1.25 s against a promise of 1.5 s; with 64-token prompts taking half the machine, 1.5 s of waiting
    and 0.75 s of its own prefill (half of it overtaken), 2.25 s against 1.75 s, and it is refused."""
    ahead = [Pending(32, seq_no=i, deadline=1e9) for i in range(6)]
    admitted = _view(ahead).decide(128, 0, now=0.0)
    assert admitted.projected == pytest.approx(1.25) and admitted.promise == pytest.approx(1.5)
    with pytest.raises(DelayBoundError, match="its own first token") as err:
        _view(ahead, arrivals=_busy(64, LOAD_WINDOW_S / 2)).decide(128, 0, now=0.0)
    assert err.value.late_ms == 500


def test_an_admitted_promise_is_protected_as_if_nothing_else_arrived():
    """A 1,280-token prompt's promise was made at the load to come: shorter newcomers overtaking it are that load,
    so one is refused only when it would make the prompt late with nothing else arriving (5 s of its own steps and
    the newcomer's one), not by a projection that counts newcomers like it at the load once more (10 s)."""
    busy = _busy(64, LOAD_WINDOW_S / 2)
    for deadline, admitted in ((9.9, True), (5.2, True), (5.1, False)):
        v = _view([Pending(32 * 40, seq_no=1, deadline=deadline)], arrivals=busy)
        if admitted:
            v.admit(32, 0, now=0.0)
        else:
            with pytest.raises(DelayBoundError, match="an admitted request's first token"):
                v.admit(32, 0, now=0.0)


def test_a_newcomer_waits_for_the_step_in_flight():
    """The view published after the last step is read while the next one runs: a newcomer's first step comes after
    it, so what is left of it (by the step times) counts, and makes a request that would just fit late."""
    due = [0.0]

    def view() -> AdmissionView:
        return AdmissionView(1.0, [Pending(32, seq_no=i, deadline=1e9) for i in range(6)], None, 0, 32, BUCKETS,
                             {b: 0.125 for b in BUCKETS}, 0.25, (0.0,), next_seq_no=100, step_due=lambda: due[0])

    assert view().decide(96, 0, now=10.0).projected == pytest.approx(10.0 + 0.75 + 0.375)
    due[0] = 10.2
    assert view().decide(96, 0, now=10.0).projected == pytest.approx(10.0 + 0.2 + 0.75 + 0.375)
    due[0] = 10.4  # 0.4 + 0.75 + 0.375 s: past its promise of 1 + 0.375 s
    with pytest.raises(DelayBoundError, match="its own first token"):
        view().decide(96, 0, now=10.0)
    due[0] = 9.0  # a step that overran its time: nothing left to wait for by the model
    assert view().decide(96, 0, now=10.0).projected == pytest.approx(10.0 + 0.75 + 0.375)


def test_unmeasured_view_admits_and_records():
    v = _view(seconds={})
    assert not v.measured
    for _ in range(50):
        v.admit(1000, 0, now=0.0)  # no step time known yet: the queue limits alone apply


def test_refuses_a_request_whose_shorter_work_ahead_exceeds_the_bound():
    # 1/8 s per 32-token step, bound 1 s: a 4-step prompt may wait 8 steps; four 3-step prompts are 12
    v = _view([Pending(96, seq_no=i, deadline=1e9) for i in range(4)])
    with pytest.raises(DelayBoundError) as err:
        v.admit(128, 1, now=0.0)
    e = err.value
    assert isinstance(e, OverloadedError) and e.class_index == 1 and e.bound_ms == 1000
    assert e.late_ms == 500 and e.retry_after_ms == 625  # late, plus one full step of margin
    assert "its own first token" in str(e) and "max_queue_delay_ms" in str(e)


def test_a_long_prompt_may_wait_as_long_as_its_own_prefill():
    # 64 steps of a shorter prompt ahead: far past the 1 s bound, but a 100-step prompt may wait 100 steps
    ahead = [Pending(32 * 64, seq_no=1, deadline=1e9)]
    assert _view(ahead).admit(32 * 100, 1, now=0.0) == 2 * 100 * 0.125
    with pytest.raises(DelayBoundError, match="its own first token"):  # but not 128 steps
        _view(ahead * 2).admit(32 * 100, 1, now=0.0)



def test_a_short_prompt_overtakes_long_ones_and_is_admitted():
    """Shortest remaining prompt first: 2,000 tokens of long prompts ahead do not delay a 32-token one."""
    v = _view([Pending(1000, seq_no=1, deadline=1e9), Pending(1000, seq_no=2, deadline=1e9)])
    deadline = v.admit(32, 0, now=10.0)
    assert deadline == 10.0 + 1.0 + 0.125


def test_the_oldest_sequence_share_counts_against_shorter_prompts():
    # alone, 7 steps of shorter work fits a 1 s bound; the oldest (longer) sequence takes a quarter of each step
    pending = [Pending(32 * 7, seq_no=2, deadline=1e9), Pending(5000, seq_no=1, deadline=1e9)]
    _view(pending).admit(32 * 8, 0, now=0.0)
    with pytest.raises(DelayBoundError):
        _view(pending, oldest=1).admit(32 * 8, 0, now=0.0)


def test_refuses_a_short_request_that_would_make_an_admitted_one_late():
    # the admitted 224-token prompt is due in 1 s and needs 7 steps (0.875 s): one more step ahead still fits
    admitted = Pending(224, seq_no=1, deadline=1.0)
    with pytest.raises(DelayBoundError) as err:
        _view([admitted]).admit(64, 0, now=0.0)
    assert "an admitted request's first token" in str(err.value)
    _view([admitted]).admit(32, 0, now=0.0)
    _view([admitted]).admit(640, 0, now=0.0)      # a longer prompt goes after it: no harm done


def test_protection_allows_for_the_projections_own_error():
    """The admitted 224-token prompt is projected at 0.875 s against a promise of 1 s. A 64-token newcomer pushes it
    0.125 s past: refused while the projection is taken as exact or 10% off (0.0875 s of error), admitted when it
    is 20% off (0.175 s); a 96-token one (0.25 s past) is refused at 20% too."""
    admitted = Pending(224, seq_no=1, deadline=1.0)
    for error in (0.0, 0.1):
        with pytest.raises(DelayBoundError, match="an admitted request's first token"):
            _view([admitted], error=error).admit(64, 0, now=0.0)
    _view([admitted], error=0.2).admit(64, 0, now=0.0)
    with pytest.raises(DelayBoundError, match="an admitted request's first token"):
        _view([admitted], error=0.2).admit(96, 0, now=0.0)


def test_a_newcomers_own_promise_allows_for_the_error_but_a_callers_deadline_does_not():
    """Nine 32-token prompts ahead of a 32-token one: its first token is projected at 1.25 s against the cap's
    promise of 1.125 s, 0.125 s late: refused as exact or 5% off (0.0625 s), admitted at 10% (0.125 s), with the
    promise it was given; a caller's deadline of 1.125 s refuses it whatever the error."""
    ahead = [Pending(32, seq_no=i, deadline=1e9) for i in range(9)]
    for error in (0.0, 0.05):
        with pytest.raises(DelayBoundError, match="its own first token") as err:
            _view(ahead, error=error).admit(32, 0, now=0.0)
        assert err.value.late_ms == 125
    admitted = _view(ahead, error=0.1).decide(32, 0, now=0.0)
    assert admitted.promise == pytest.approx(1.125) and admitted.projected == pytest.approx(1.25)
    with pytest.raises(DelayBoundError, match="the caller's deadline"):
        _view(ahead, error=MAX_ERROR).admit(32, 0, now=0.0, caller_deadline=1.125)


def test_projection_error_is_the_weighted_rms_of_long_projections():
    e = ProjectionError()
    for _ in range(ERROR_MIN_FIRST_TOKENS - 1):
        e.observe(10.0, 12.0)
    assert e.relative == 0.0  # too few to tell: projections are taken as exact
    e.observe(0.2, 2.0)       # projected a step ahead: its jitter is not the projection's error
    assert e.relative == 0.0
    e.observe(10.0, 8.0)
    assert e.relative == pytest.approx(0.2)
    for _ in range(ERROR_MIN_FIRST_TOKENS):
        e.observe(1.0, 1.5)   # short ones count by their length: 8 s of 50% against 80 s of 20%
    assert e.relative == pytest.approx(((8 * 0.25 + 80 * 0.04) / 88) ** 0.5)
    for _ in range(100):
        e.observe(2.0, 10.0)
    assert e.relative == MAX_ERROR


def test_an_admitted_request_already_late_does_not_refuse_newcomers():
    # due in 1 s but 16 steps (2 s) of its own left: past its promise whatever comes, so a short request goes first
    late = Pending(512, seq_no=1, deadline=1.0)
    assert _view([late], oldest=1).admit(64, 0, now=0.0) == 1.0 + 0.25
    # one still on time is protected, beside the late one
    on_time = Pending(224, seq_no=2, deadline=1.0)
    with pytest.raises(DelayBoundError, match="an admitted request's first token"):
        _view([late, on_time], oldest=1, share=0.0).admit(64, 0, now=0.0)


def test_admissions_against_one_view_see_each_other():
    v = _view()
    admitted = 0
    with pytest.raises(DelayBoundError):
        for _ in range(100):
            v.admit(32, 0, now=0.0)
            admitted += 1
    assert admitted == 9  # the ninth waits 8 steps (the bound) before its own one


def test_slab_wait_counts():
    with pytest.raises(DelayBoundError):
        _view(slab_wait=(0.0, 5.0)).admit(32, 1, now=0.0)
    _view(slab_wait=(0.0, 5.0)).admit(32, 0, now=0.0)


def test_step_times_average_real_steps():
    t = StepTimes(BUCKETS)
    t.seed({32: 2.0, 7: 1.0, 8: 0.0})  # not a bucket, and not a time: ignored
    assert t.snapshot() == {32: 2.0}
    t.observe(32, 1.0)
    assert t.snapshot()[32] == pytest.approx(2.0 - 0.3)


def test_step_times_split_a_step_into_its_base_and_its_attention():
    t = StepTimes(BUCKETS)
    # seeded from a step at position 0 that attended over 1,000 pairs, with the warm-up's pair cost
    t.seed({32: 1.1}, {32: 1000}, pair_seconds=1e-4)
    assert t.snapshot() == {32: pytest.approx(1.0)} and t.pair_seconds == 1e-4
    t.observe(32, 1.0 + 0.05, pairs=500)       # attention short of the base: the base learns, the pair cost stays
    assert t.snapshot()[32] == pytest.approx(1.0) and t.pair_seconds == 1e-4
    t.observe(32, 1.3, pairs=1000)
    assert t.snapshot()[32] == pytest.approx(1.0 + 0.3 * 0.2)
    base = t.snapshot()[32]
    t.observe(32, base + 3.0, pairs=20_000)    # attention-bound (2 s by the old cost): the pair cost learns
    assert t.snapshot()[32] == base
    assert t.pair_seconds == pytest.approx(1e-4 + 0.3 * (1.5e-4 - 1e-4))
    t.observe(32, 0.5, pairs=20_000)           # faster than the base alone: nothing to learn about the pairs
    assert t.pair_seconds == pytest.approx(1.15e-4) and t.snapshot()[32] == base


# ---- in the scheduler -------------------------------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sched(clock, **kw) -> Scheduler:
    return Scheduler([SlabClass(512, 8)], 8, 32, BUCKETS, queue_limit=8, clock=clock, max_queue_delay_s=1.0, **kw)


def _req(rid: str, n: int, **kw) -> Request:
    return Request(rid, tuple(range(1, n + 1)), 4, **kw)


def test_scheduler_measures_steps_and_refuses_then_admits_as_the_backlog_drains():
    clock = _Clock()
    s = _sched(clock)
    s.submit(_req("a", 200))  # no step measured yet: admitted on slabs alone
    s.submit(_req("a2", 200))
    step = s.schedule()
    clock.now += 0.25  # a full 32-token step takes 0.25 s
    s.complete_step(step, {})
    assert s.step_times.snapshot() == {32: 0.25}
    # 368 tokens of shorter prompts ahead (12 steps, 3 s): a 210-token prompt (7 steps) may wait 1.75 s
    with pytest.raises(DelayBoundError, match="its own first token"):
        s.submit(_req("b", 210))
    assert s.load().running == 2 and "b" not in s._live  # the refusal left nothing behind
    s.submit(_req("c", 100))  # shorter than what is left of either: it goes first
    while "a" in s._prefilling or "a2" in s._prefilling:
        step = s.schedule()
        clock.now += 0.25
        s.complete_step(step, {c.request_id: 7 for c in step.chunks if c.sample})
    s.submit(_req("b", 210))  # the work ahead has drained


def test_admission_counts_only_the_prefill_that_retained_prefixes_leave():
    """A 300-token prompt whose first 288 tokens a slab holds costs one step, not ten: admitted where the same
    prompt without reuse, behind 6 s of shorter prompts, is refused; the estimate the server's gRPC threads use
    agrees."""
    def run(reuse: bool) -> Scheduler:
        clock = _Clock()
        s = _sched(clock, prefix_reuse=reuse, copy_min_tokens=16 if reuse else None)
        s.submit(_req("first", 300))
        while s.has_work():
            step = s.schedule()
            clock.now += 0.25  # 0.25 s a 32-token step
            s.complete_step(step, {c.request_id: 7 for c in step.chunks if c.sample})
        for rid in ("busy1", "busy2", "busy3"):  # 24 steps (6 s) of shorter prompts' prefill ahead
            s.submit(Request(rid, tuple(range(1000, 1250)), 4, deadline=clock.now + 100))  # admitted by callers
        return s

    with pytest.raises(DelayBoundError):
        run(False).submit(_req("again", 300))
    s = run(True)
    assert s.expected_cached(tuple(range(1, 301))) == 288
    s.submit(_req("again", 300))
    assert s._live["again"].cached >= 288


def test_scheduler_observes_what_its_prefill_chunks_attend_over():
    clock = _Clock()
    s = _sched(clock)
    s.step_times.seed({32: 0.25}, pair_seconds=1e-4)
    s.submit(_req("a", 20))
    s.submit(_req("b", 100))
    step = s.schedule()  # a's 20 tokens and b's first 12: 210 + 78 pairs
    assert [len(c.token_ids) for c in step.chunks] == [20, 12]
    clock.now += 0.25 + 288e-4
    s.complete_step(step, {c.request_id: 7 for c in step.chunks if c.sample})
    assert s.step_times.snapshot()[32] == pytest.approx(0.25)
    step = s.schedule()  # a decodes (its row is in the base), b prefills 31 rows from position 12
    assert [c.start_pos for c in step.chunks] == [20, 12]
    clock.now += 0.25 + 1e-4 * prefill_pairs(12, 31)
    s.complete_step(step, {c.request_id: 7 for c in step.chunks if c.sample})
    assert s.step_times.snapshot()[32] == pytest.approx(0.25)
    assert s.admission_view().seconds_for(31, pairs=1000) == pytest.approx(0.25 + 0.1)  # one step beside a decode


def test_scheduler_counts_the_load_of_the_last_minute():
    """Every admitted request's prefill work is kept for LOAD_WINDOW_S: the views made from it project longer
    prompts at that load, until it ages out; the promise and projection of each request are kept with it."""
    clock = _Clock()
    s = _sched(clock)
    s.step_times.seed({32: 0.125})
    s.submit(_req("short", 64))
    assert s.admission_view().load_below(100, clock.now) == pytest.approx(64 / 256 / LOAD_WINDOW_S)
    assert s.admission_view().load_below(64, clock.now) == 0.0
    deadline, projected = s.first_token_promise("short")
    assert deadline == pytest.approx(1.0 + 0.25) and projected == pytest.approx(0.25)
    clock.now += LOAD_WINDOW_S + 1
    assert s.admission_view().load_below(100, clock.now) == 0.0
    s.submit(_req("given", 64, deadline=5.0, projected=3.0))  # the server's gRPC thread decided
    assert s.first_token_promise("given") == (5.0, 3.0)


def test_scheduler_says_when_the_step_in_flight_should_end():
    clock = _Clock()
    s = _sched(clock)
    s.step_times.seed({32: 0.25}, pair_seconds=1e-4)
    s.submit(_req("a", 20))
    assert s.step_due == 0.0
    step = s.schedule()  # 20 rows attending over 210 pairs
    assert s.step_due == pytest.approx(0.25 + 210e-4)
    clock.now += 0.3
    s.complete_step(step, {c.request_id: 7 for c in step.chunks if c.sample})
    assert s.step_due == 0.0
    s.discard_step(s.schedule())
    assert s.step_due == 0.0


def test_scheduler_measures_the_projections_error_at_first_tokens():
    """Each first token is set against its admission's projection (from its arrival); the views carry the error."""
    clock = _Clock()
    s = _sched(clock)
    s.step_times.seed({32: 0.125})
    seen = []
    for i in range(ERROR_MIN_FIRST_TOKENS):
        arrival = clock.now
        s.submit(_req(f"r{i}", 128, arrival_time=arrival))  # 4 steps of prefill
        projected = s.first_token_promise(f"r{i}")[1] - arrival
        while s.has_work():
            step = s.schedule()
            clock.now += 0.15
            if s.complete_step(step, {c.request_id: 7 for c in step.chunks if c.sample}) and len(seen) == i:
                seen.append((projected, clock.now - arrival))  # its first token
    assert len(seen) == ERROR_MIN_FIRST_TOKENS and all(a == pytest.approx(0.6) for _, a in seen)
    weight = sum(p for p, _ in seen)
    expected = (sum(p * (a / p - 1) ** 2 for p, a in seen) / weight) ** 0.5
    assert expected > 0.05 and s.projection_error.relative == pytest.approx(expected)
    assert s.admission_view().projection_error == pytest.approx(expected)


def test_scheduler_takes_a_deadline_from_the_caller_without_checking():
    clock = _Clock()
    s = _sched(clock)
    s.step_times.seed({32: 10.0})  # every step would blow the bound
    s.submit(_req("a", 300, deadline=5.0))
    s.submit(_req("b", 300, deadline=5.0))
    with pytest.raises(DelayBoundError):
        s.submit(_req("c", 300))
    assert s.load().running == 2


def test_off_by_default():
    s = Scheduler([SlabClass(512, 8)], 8, 32, BUCKETS, queue_limit=8)
    assert s.admission_view().bound_s is None  # no cap: only callers' deadlines (none here) and the queues
    s.step_times.seed({32: 100.0})
    for i in range(8):
        s.submit(_req(f"r{i}", 400))
    with pytest.raises(QueueFullError):  # only the queue limit
        for i in range(8, 100):
            s.submit(_req(f"r{i}", 400))
    with pytest.raises(ValueError, match="max_queue_delay_s"):
        Scheduler([SlabClass(512, 8)], 8, 32, BUCKETS, queue_limit=8, max_queue_delay_s=0)


# ---- at the gRPC edge -------------------------------------------------------------------------------------------

def test_server_refuses_at_once_with_the_engine_thread_busy(tmp_path: Path, monkeypatch):
    from _served_process import build_tiny_bundle

    from slabserve.proto.slabserve.v1 import serving_pb2 as pb
    from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
    from slabserve.runtime.engine import Engine
    from slabserve.runtime.plan import read_plan
    from slabserve.runtime.server import create_server

    root = build_tiny_bundle(tmp_path, max_queue_delay_ms=1)
    monkeypatch.chdir(root)  # the plan names its model relative to where it was built
    assert read_plan(root / "bundle").engine.max_queue_delay_ms == 1
    engine = Engine.from_plan(root / "bundle")
    assert engine.scheduler.max_queue_delay_s == 0.001 and engine.scheduler.step_times.snapshot()
    server = create_server(engine, "127.0.0.1", 0, metrics_port=None)
    server.start()
    server.warm_up()
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.SlabServeStub(channel)
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).max_queue_delay_ms == 1
    held = threading.Event()

    def measured_steps() -> None:  # 20 ms a step, whatever this machine measured (tiny steps: about 0.1 ms here,
        engine.scheduler.step_times.seed({b: 0.02 for b in engine.scheduler.buckets})  # under the 1 ms bound)
        server.loop._publish_admission()  # the view the edge reads: no step runs from here to the end

    try:
        server.loop.call(measured_steps, timeout=10)
        server.loop.post(lambda: held.wait(60))  # the engine thread is busy: only the edge can answer

        def request(n: int) -> pb.GenerateRequest:  # n prompt tokens + 8: slab class 1 (2 slabs of 256)
            return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(10, 10 + n))),
                                      stopping=pb.StoppingOptions(max_tokens=8, ignore_eos=True))

        # 32-token steps of 20 ms: each 100-token prompt prefills in 4 and may wait 4 (its own time, over the 1 ms
        # bound)
        admitted = [stub.Generate(request(100), timeout=60) for _ in range(2)]  # the second waits 4: admitted
        deadline = time.monotonic() + 10
        while len(server.loop._unsubmitted) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(110), timeout=10))  # 200 tokens ahead: 7 steps, it may wait 4
        assert time.monotonic() - started < 5, "refused by the engine thread, not at the edge"
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(err.value.trailing_metadata())
        assert trailers["slabserve-slab-class"] == "1" and int(trailers["retry-after-ms"]) >= 1
        assert "max_queue_delay_ms" in err.value.details()
        held.set()
        for call in admitted:
            assert sum(len(r.token.token_ids) for r in call if r.HasField("token")) >= 1
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        while load.running:
            time.sleep(0.05)
            load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        assert [c.free_slabs for c in load.classes] == [c.total_slabs for c in load.classes]
        assert not server.loop._unsubmitted
    finally:
        held.set()
        channel.close()
        server.stop()


def test_metrics_count_promises_missed_and_the_projections_error():
    from slabserve.runtime.metrics import Metrics

    m = Metrics([SlabClass(512, 8)])
    m.observe_finished(0.1, 2.0, 0.05, 10, promised_s=1.5, projected_s=1.0)   # late, at twice its projection
    m.observe_finished(0.1, 0.5, 0.05, 10, promised_s=1.5, projected_s=1.0)   # on time, early
    m.observe_finished(0.1, 0.5, 0.05, 10)                                      # nothing promised or projected
    m.observe_finished(0.1, 0.5, 0.05, 0, promised_s=0.1, projected_s=0.1)     # no first token: nothing to judge
    value = m.registry.get_sample_value
    assert value("slabserve_first_token_promises_total") == 2
    assert value("slabserve_first_token_promises_missed_total") == 1
    assert value("slabserve_first_token_projection_ratio_count") == 2
    assert value("slabserve_first_token_projection_ratio_bucket", {"le": "0.5"}) == 1
    assert value("slabserve_first_token_projection_ratio_bucket", {"le": "1.5"}) == 1
    assert value("slabserve_first_token_projection_ratio_bucket", {"le": "2.0"}) == 2
    assert value("slabserve_admission_projection_error") == 0.0
    m.observe_projection_error(0.125)
    assert value("slabserve_admission_projection_error") == 0.125


def test_admission_report_reads_a_server_log(tmp_path: Path, capsys):
    from slabserve.tools.admission_report import main

    def line(tokens, code="OK", **kw):
        return json.dumps({"event": "request", "prompt_tokens": tokens, "code": code, **kw})

    log = tmp_path / "server.log"
    log.write_text("\n".join([
        '{"event": "serving"}', "not json at all {",
        line(100, ttft_ms=200.0, projected_ttft_ms=100.0, promised_ttft_ms=5100.0),
        line(300, ttft_ms=100.0, projected_ttft_ms=100.0, promised_ttft_ms=5100.0),
        line(4000, ttft_ms=12000.0, projected_ttft_ms=10000.0, promised_ttft_ms=11000.0),
        line(4000, "RESOURCE_EXHAUSTED", error="slab class 2: ... its own first token would come about 481 ms late"),
        line(50, "CANCELLED"),
    ]) + "\n")
    assert main([str(log), "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())[str(log)]
    assert r["requests"] == 5 and r["codes"] == {"OK": 3, "RESOURCE_EXHAUSTED": 1, "CANCELLED": 1}
    short, mid, long = r["by_size"]
    assert (short["requests"], short["ratio_median"], short["ratio_max"], short["missed"]) == (2, 1.5, 2.0, 0)
    assert mid["requests"] == 0 and mid["ratio_median"] is None
    assert (long["ratio_median"], long["missed"], long["missed_by_s"]) == (1.2, 1, [1.0])
    assert r["refusals"][0]["prompt_tokens"] == 4000
    assert "481 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.log")])
