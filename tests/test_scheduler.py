"""Scheduler and slab allocator, driven by fake executors: admission, packing, stopping, cancellation, invariants."""
from __future__ import annotations

import ast
import collections
import math
import pathlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slabserve.runtime.scheduler import (FinishReason, InvalidRequestError, OutOfRangeError, QueueFullError, Request,
                                         ScheduledStep, Scheduler, TokenEvent)
from slabserve.runtime.slab_allocator import Slab, SlabAllocator, SlabClass

ROOT = pathlib.Path(__file__).resolve().parents[1]
STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


def _req(rid: str, prompt_len: int, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, tuple(range(100, 100 + prompt_len)), max_tokens, **kw)


def _buckets(step_tokens: int) -> tuple[int, ...]:
    return (*(1 << k for k in range(step_tokens.bit_length()) if 1 << k < step_tokens), step_tokens)


def _sched(classes=((16, 2), (64, 2), (256, 1)), max_seqs=4, step_tokens=32, queue_limit=4, **kw) -> Scheduler:
    return Scheduler([SlabClass(t, c) for t, c in classes], max_seqs, step_tokens, _buckets(step_tokens),
                     queue_limit, **kw)


def _run(s: Scheduler, token: int = 7, overrides: dict[str, int] | None = None) -> tuple[ScheduledStep, list]:
    """One step with a fake executor that samples `token` (or `overrides[rid]`) for every chunk that samples."""
    step = s.schedule()
    assert step is not None
    sampled = {c.request_id: (overrides or {}).get(c.request_id, token) for c in step.chunks if c.sample}
    return step, s.complete_step(step, sampled)


# ---- modules stay free of torch -----------------------------------------------------------------------------------

@pytest.mark.parametrize("module", ["runtime/scheduler.py", "runtime/slab_allocator.py"])
def test_no_torch_import(module):
    tree = ast.parse((ROOT / module).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"torch", "numpy", "triton"}


# ---- slab allocator -----------------------------------------------------------------------------------------------

def test_allocator_layout_lifo_and_errors():
    a = SlabAllocator([SlabClass(16, 2), SlabClass(64, 3)])
    assert a.total_rows == 16 * 2 + 64 * 3
    assert [a.class_for(n) for n in (1, 16, 17, 64)] == [0, 0, 1, 1]
    assert a.class_for(65) is None
    s0, s1 = a.allocate(0), a.allocate(0)
    assert (s0, s1) == (Slab(0, 0, 16), Slab(0, 16, 16))
    assert a.allocate(1) == Slab(1, 32, 64)  # class 1 starts after class 0's slabs
    assert not a.can_allocate(0) and a.free_class_for(10) == 1
    a.free(s0)
    assert a.allocate(0) == s0  # LIFO: the slab freed last comes back first
    a.free(s1)
    with pytest.raises(ValueError, match="double free"):
        a.free(s1)
    with pytest.raises(ValueError, match="not a slab"):
        a.free(Slab(0, 8, 16))
    with pytest.raises(ValueError, match="ascending"):
        SlabAllocator([SlabClass(64, 1), SlabClass(16, 1)])


# ---- admission ----------------------------------------------------------------------------------------------------

def test_smallest_free_class_then_home_queue():
    s = _sched()
    for rid in "abc":
        s.submit(_req(rid, 8))  # needs 12 rows: home class 0
    # two fill class 0; the third borrows class 1 rather than wait while a slab that fits is idle
    assert s.load().free_per_class == (0, 1, 1)
    s.submit(_req("d", 8))
    s.submit(_req("e", 8))  # max_seqs (4) running: e waits in its home queue
    assert s.load().queued_per_class == (1, 0, 0) and s.load().running == 4
    step = s.schedule()
    slabs = {c.request_id: (c.slab_offset, c.slab_tokens) for c in step.chunks}
    assert slabs["a"] == (0, 16) and slabs["b"] == (16, 16) and slabs["c"][1] == slabs["d"][1] == 64
    s.complete_step(step, {c.request_id: 7 for c in step.chunks if c.sample})
    s.abort("a")
    assert s.load().queued_per_class == (0, 0, 0)  # e took a's slab at once
    assert {c.request_id: c.slab_offset for c in s.schedule().chunks}["e"] == 0


def test_out_of_range_gives_limit():
    s = _sched()
    with pytest.raises(OutOfRangeError, match="256 tokens") as err:
        s.submit(_req("big", 250, max_tokens=10))
    assert (err.value.need_tokens, err.value.limit_tokens) == (260, 256)
    assert s.max_request_tokens == 256
    s.submit(_req("fits", 250, max_tokens=6))  # exactly 256


def test_queue_full_names_class_and_hints_retry():
    now = [0.0]
    s = _sched(classes=((16, 1), (64, 1)), max_seqs=2, queue_limit=1, clock=lambda: now[0])
    s.submit(_req("a", 8))
    s.submit(_req("b", 8))   # borrows the 64-token slab
    s.submit(_req("c", 8))   # queued on its home, class 0
    with pytest.raises(QueueFullError, match=r"class 0 \(16 tokens\)") as err:
        s.submit(_req("d", 8))
    assert err.value.class_index == 0 and err.value.retry_after_ms == 1000  # nothing finished yet: the fallback
    s.submit(_req("e", 30))  # class 1's own queue is separate
    assert s.load().queued_per_class == (1, 1)
    assert "all 2 sequence slots are running" in str(err.value)
    s = _sched(classes=((16, 1),), max_seqs=4, queue_limit=0)
    s.submit(_req("a", 8))
    with pytest.raises(QueueFullError, match="every slab that fits is in use"):
        s.submit(_req("b", 8))


def test_queue_full_retry_hint_follows_recent_completions():
    now = [0.0]
    s = _sched(classes=((16, 1),), max_seqs=1, step_tokens=8, queue_limit=1, clock=lambda: now[0])
    running, queued = "a", ["b"]
    s.submit(_req("a", 4))
    s.submit(_req("b", 4))
    for i, t in enumerate((1.0, 1.2, 1.4, 1.6)):  # a slab frees every 200 ms
        now[0] = t
        assert s.abort(running)
        running = queued.pop(0)
        queued.append(f"r{i}")
        s.submit(_req(f"r{i}", 4))
    with pytest.raises(QueueFullError, match="retry in about 200 ms") as err:
        s.submit(_req("late", 4))
    assert err.value.retry_after_ms == 200


@pytest.mark.parametrize("kwargs, field", [
    (dict(request_id="", prompt_ids=(1,), max_tokens=1), "request_id"),
    (dict(request_id="r", prompt_ids=(), max_tokens=1), "prompt_ids"),
    (dict(request_id="r", prompt_ids=(1, -2), max_tokens=1), "prompt_ids"),
    (dict(request_id="r", prompt_ids=(1,), max_tokens=0), "max_tokens"),
])
def test_invalid_request_names_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=f"^{field}:") as err:
        _sched().submit(Request(**kwargs))
    assert err.value.field == field


def test_duplicate_live_request_id_rejected_but_reusable_after_end():
    s = _sched()
    s.submit(_req("a", 4))
    with pytest.raises(InvalidRequestError, match="request_id"):
        s.submit(_req("a", 4))
    assert s.abort("a") and not s.abort("a")
    s.submit(_req("a", 4))


# ---- packing ------------------------------------------------------------------------------------------------------

def test_bucket_is_smallest_that_holds_the_step():
    s = _sched(step_tokens=32)
    s.submit(_req("a", 5))
    step, _ = _run(s)
    assert (step.num_scheduled_tokens, step.bucket) == (5, 8)
    s.submit(_req("b", 2))
    s.submit(_req("c", 1))
    step, _ = _run(s)  # a decodes (1) + b (2) + c (1)
    assert (step.num_scheduled_tokens, step.bucket) == (4, 4)
    step, _ = _run(s)
    assert (step.num_scheduled_tokens, step.bucket) == (3, 4)


def test_chunked_prefill_sample_flags_and_positions():
    s = _sched(step_tokens=32)
    s.submit(_req("a", 70, max_tokens=3))
    seen = []
    for _ in range(3):
        step, events = _run(s, token=11)
        (c,) = step.chunks
        seen.append((c.start_pos, len(c.token_ids), c.sample, len(events)))
    assert seen == [(0, 32, False, 0), (32, 32, False, 0), (64, 6, True, 1)]
    step, events = _run(s, token=12)
    (c,) = step.chunks
    assert (c.start_pos, c.token_ids, c.sample) == (70, (11,), True)
    assert events == [TokenEvent("a", 12, None)]


def test_prefill_chunk_caps_one_sequence_per_step():
    s = _sched(step_tokens=32, prefill_chunk=10)
    s.submit(_req("a", 25))
    lengths = [len(_run(s)[0].chunks[0].token_ids) for _ in range(3)]
    assert lengths == [10, 10, 5]


def test_decode_first_then_prefill_within_budget():
    s = _sched(classes=((64, 8),), max_seqs=8, step_tokens=16)
    for rid in "abc":
        s.submit(_req(rid, 2, max_tokens=20))
    _run(s)
    s.submit(_req("long", 40))
    step, _ = _run(s)
    assert [len(c.token_ids) for c in step.chunks] == [1, 1, 1, 13]
    assert step.num_scheduled_tokens == 16 and step.chunks[-1].request_id == "long"


def test_short_prompt_not_delayed_by_long_prefill():
    s = _sched(classes=((512, 8), (8192, 2)), max_seqs=16, step_tokens=512)
    s.submit(_req("long", 6000))
    for _ in range(3):
        _run(s)
    s.submit(_req("short", 40))
    step, events = _run(s)  # the very next step prefills all of the short prompt and samples it
    short = [c for c in step.chunks if c.request_id == "short"]
    assert short and short[0].token_ids == tuple(range(100, 140)) and short[0].sample
    assert [e.request_id for e in events] == ["short"]
    assert any(c.request_id == "long" for c in step.chunks)  # and the long one still progressed


def test_long_prompt_not_starved_by_stream_of_short_ones():
    max_seqs, step_tokens, share = 16, 512, 0.25
    s = _sched(classes=((512, 14), (8192, 2)), max_seqs=max_seqs, step_tokens=step_tokens, queue_limit=10_000,
               oldest_prefill_share=share)
    s.submit(_req("long", 6000))
    bound = math.ceil(6000 / max(1, int(share * (step_tokens - max_seqs + 1))))  # the documented bound
    n = 0
    for step_no in range(1, bound + 1):
        for _ in range(3):  # 600 prompt tokens per step arrive: SRPT alone would never reach "long"
            s.submit(_req(f"s{n}", 200, max_tokens=2))
            n += 1
        _, events = _run(s)
        if any(e.request_id == "long" for e in events):
            break
    else:
        pytest.fail(f"long prompt had no first token after {bound} steps")
    assert step_no <= bound


# ---- stopping -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, tokens, want", [
    (dict(eos_token_ids=frozenset({2})), [5, 2], [(5, None), (2, STOP)]),
    (dict(eos_token_ids=frozenset({2}), ignore_eos=True), [5, 2, 2, 2], [(5, None), (2, None), (2, None),
                                                                         (2, LENGTH)]),
    (dict(stop_token_ids=frozenset({9}), ignore_eos=True), [5, 9], [(5, None), (9, STOP)]),
    (dict(), [5, 6, 7, 8], [(5, None), (6, None), (7, None), (8, LENGTH)]),
])
def test_finish_reasons(kw, tokens, want):
    s = _sched()
    s.submit(_req("a", 3, max_tokens=4, **kw))
    got = []
    for t in tokens:
        got += [(e.token_id, e.finished) for e in _run(s, token=t)[1]]
    assert got == want
    assert s.schedule() is None and s.load().free_per_class == (2, 2, 1)


def test_finish_for_stop_string_frees_slab():
    s = _sched()
    s.submit(_req("a", 3, max_tokens=10))
    _run(s)
    assert s.finish("a", STOP) and not s.has_work()
    assert s.schedule() is None and s.load().free_per_class == (2, 2, 1)


# ---- cancellation -------------------------------------------------------------------------------------------------

def test_abort_queued():
    s = _sched(classes=((16, 1),), max_seqs=1, step_tokens=8)
    s.submit(_req("a", 4))
    s.submit(_req("b", 4))
    assert s.load().queued_per_class == (1,)
    assert s.abort("b") and s.load().queued_per_class == (0,)
    step, _ = _run(s)
    assert {c.request_id for c in step.chunks} == {"a"}


def test_abort_running_mid_step_drops_token_and_frees_slab_for_next_step():
    s = _sched(classes=((16, 1),), max_seqs=2, step_tokens=8)
    s.submit(_req("a", 4, max_tokens=8))
    s.submit(_req("b", 4))  # waits for a's slab
    _run(s)
    step = s.schedule()
    assert [c.request_id for c in step.chunks] == ["a"]
    assert s.abort("a")  # while the step is in flight
    assert s.load().free_per_class == (0,) and s.load().queued_per_class == (0,)  # b got a's slab at once
    events = s.complete_step(step, {"a": 5})
    assert events == []  # a's in-flight token is ignored
    step = s.schedule()
    assert [c.request_id for c in step.chunks] == ["b"] and step.chunks[0].start_pos == 0


def test_abort_then_resubmit_same_id_mid_step():
    s = _sched(classes=((16, 2),), max_seqs=2, step_tokens=8)
    s.submit(_req("a", 4, max_tokens=8))
    _run(s)
    step = s.schedule()
    s.abort("a")
    s.submit(_req("a", 3))  # a new request with the reused id: the old step's token must not reach it
    assert s.complete_step(step, {"a": 5}) == []
    step = s.schedule()
    assert step.chunks[0].start_pos == 0 and len(step.chunks[0].token_ids) == 3


def test_step_protocol_errors():
    s = _sched()
    s.submit(_req("a", 10))
    step = s.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        s.complete_step(step, {})
    s.discard_step(step)  # the step failed: the same work comes again
    again = s.schedule()
    assert again.chunks == step.chunks


# ---- property: random traffic through a checking fake executor ----------------------------------------------------

class _Checker:
    """Fake executor and bookkeeper: samples random tokens and asserts the scheduler's invariants every step."""

    def __init__(self, s: Scheduler, rng: random.Random):
        self.s, self.rng = s, rng
        self.requests: dict[str, Request] = {}
        self.written: dict[str, int] = {}      # KV rows written per live request
        self.outputs: dict[str, list[int]] = {}
        self.owner = [None] * s.allocator.total_rows
        self.slab: dict[str, tuple[int, int]] = {}
        self.ended: dict[str, FinishReason] = {}
        self.stop_strings: set[str] = set()    # ended through finish(), as the engine does for a stop string
        self.stats: collections.Counter[str] = collections.Counter()

    def run_step(self, abort_mid_step: list[str]) -> None:
        step = self.s.schedule()
        load = self.s.load()
        assert load.running <= self.s.max_seqs
        assert sum(load.total_per_class) - sum(load.free_per_class) == load.running
        if step is None:
            assert not self.s.has_work()
            return
        self._check_step(step)
        sampled = {c.request_id: self.rng.randrange(12) for c in step.chunks if c.sample}
        for rid in abort_mid_step:
            self.end(rid, FinishReason.CANCELLED, self.s.abort(rid))
        for e in self.s.complete_step(step, sampled):
            assert e.request_id not in self.ended and e.token_id == sampled[e.request_id]
            self.outputs[e.request_id].append(e.token_id)
            if e.finished is not None:
                self.end(e.request_id, e.finished, True)

    def _check_step(self, step: ScheduledStep) -> None:
        ids = [c.request_id for c in step.chunks]
        assert len(ids) == len(set(ids)) <= self.s.max_seqs
        assert step.num_scheduled_tokens == sum(len(c.token_ids) for c in step.chunks) <= self.s.step_tokens
        assert step.bucket == min(b for b in self.s.buckets if b >= step.num_scheduled_tokens)
        for c in step.chunks:
            self._check_chunk(c)

    def _check_chunk(self, c) -> None:
        req = self.requests[c.request_id]
        assert c.request_id not in self.ended
        p, n = len(req.prompt_ids), len(c.token_ids)
        assert c.start_pos == self.written[c.request_id] and n >= 1
        assert c.start_pos + n <= c.slab_tokens and c.slab_tokens >= p + req.max_tokens
        if c.start_pos < p:
            assert c.token_ids == req.prompt_ids[c.start_pos:c.start_pos + n] and c.sample == (c.start_pos + n == p)
        else:
            outs = self.outputs[c.request_id]
            assert n == 1 and c.sample and c.token_ids == (outs[-1],) and c.start_pos == p + len(outs) - 1
        self._claim(c.request_id, c.slab_offset, c.slab_tokens)
        self.written[c.request_id] += n

    def _claim(self, rid: str, offset: int, tokens: int) -> None:
        if rid in self.slab:
            assert self.slab[rid] == (offset, tokens)
            return
        rows = range(offset, offset + tokens)
        assert all(self.owner[r] is None for r in rows), "two running sequences share slab rows"
        for r in rows:
            self.owner[r] = rid
        self.slab[rid] = (offset, tokens)

    def end(self, rid: str, reason: FinishReason, ended: bool) -> None:
        if not ended:
            return
        assert rid not in self.ended
        self.ended[rid] = reason
        self.stats[reason.name] += 1
        offset, tokens = self.slab.pop(rid, (0, 0))
        for r in range(offset, offset + tokens):
            self.owner[r] = None


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), max_seqs=st.integers(1, 8), extra_budget=st.integers(0, 40),
       queue_limit=st.integers(0, 12), prefill_chunk=st.one_of(st.none(), st.integers(1, 24)),
       share=st.sampled_from([0.1, 0.25, 1.0]))
def test_random_traffic_keeps_invariants(seed, max_seqs, extra_budget, queue_limit, prefill_chunk, share):
    rng = random.Random(seed)
    s = _sched(classes=((16, 3), (48, 3), (96, 2)), max_seqs=max_seqs, step_tokens=max_seqs + extra_budget,
               queue_limit=queue_limit, prefill_chunk=prefill_chunk, oldest_prefill_share=share)
    chk = _Checker(s, rng)
    accepted: list[str] = []
    num_submitted = 0
    while num_submitted < 500:  # 15 examples: 7,500 requests
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            if _submit_random(chk, f"r{num_submitted}", rng):
                accepted.append(f"r{num_submitted}")
            num_submitted += 1
        _random_cancellations(chk, accepted, rng)
        chk.run_step(_mid_step_aborts(chk, accepted, rng))
    for _ in range(100_000):  # drain
        if not s.has_work():
            break
        chk.run_step(_mid_step_aborts(chk, accepted, rng))
    assert s.schedule() is None
    load = s.load()
    assert load.free_per_class == load.total_per_class and sum(load.queued_per_class) == 0 and load.running == 0
    for rid in accepted:  # every accepted request ended exactly once, for the right reason
        reason, outs, req = chk.ended[rid], chk.outputs[rid], chk.requests[rid]
        stops = _stops(req)
        assert len(outs) <= req.max_tokens and not any(t in stops for t in outs[:-1])
        if reason is FinishReason.CANCELLED or rid in chk.stop_strings:
            assert len(outs) < req.max_tokens and not (outs and outs[-1] in stops)
        else:
            assert reason is (STOP if outs[-1] in stops else LENGTH)
            assert reason is STOP or len(outs) == req.max_tokens


def _stops(req: Request) -> frozenset[int]:
    return req.stop_token_ids | (frozenset() if req.ignore_eos else req.eos_token_ids)


def _submit_random(chk: _Checker, rid: str, rng: random.Random) -> bool:
    """Submit a random request; True if accepted. Some are too long for any slab, some meet a full queue."""
    req = Request(rid, tuple(rng.randrange(12) for _ in range(rng.randint(1, 70))), rng.randint(1, 30),
                  eos_token_ids=frozenset({0}), stop_token_ids=frozenset(rng.sample(range(1, 12), rng.randint(0, 2))),
                  ignore_eos=rng.random() < 0.3)
    chk.requests[rid] = req
    try:
        chk.s.submit(req)
    except OutOfRangeError:
        assert len(req.prompt_ids) + req.max_tokens > 96
        return False
    except QueueFullError as err:
        assert chk.s.load().queued_per_class[err.class_index] == chk.s.queue_limit
        return False
    assert len(req.prompt_ids) + req.max_tokens <= 96
    chk.written[rid], chk.outputs[rid] = 0, []
    chk.stats["accepted"] += 1
    return True


def _random_cancellations(chk: _Checker, accepted: list[str], rng: random.Random) -> None:
    """Between steps: abort a recent request, or end one as the engine does when a stop string matches."""
    if accepted and rng.random() < 0.15:
        rid = rng.choice(accepted[-12:])
        chk.end(rid, FinishReason.CANCELLED, chk.s.abort(rid))
    if accepted and rng.random() < 0.05:
        rid = rng.choice(accepted[-12:])
        if chk.s.finish(rid, STOP):
            chk.stop_strings.add(rid)
            chk.end(rid, STOP, True)


def _mid_step_aborts(chk: _Checker, accepted: list[str], rng: random.Random) -> list[str]:
    """Requests to abort while the step is in flight (their sampled token must be dropped)."""
    return [rng.choice(accepted[-12:])] if accepted and rng.random() < 0.1 else []
