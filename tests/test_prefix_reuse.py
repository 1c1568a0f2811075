"""Prefix reuse (retained slabs): the index, the scheduler's placement and copies, checked against a simulated KV
arena in which every row's content depends on all the tokens before it, as attention's does; and on the bundled
SmolLM2 GGUF, the same tokens with reuse as without it (greedy and sampled), alone and in a crowd."""
from __future__ import annotations

import random

import pytest

from slabserve.runtime.prefix_cache import Match, PrefixIndex
from slabserve.runtime.scheduler import Request, ScheduledStep, Scheduler
from slabserve.runtime.slab_allocator import Slab, SlabClass


def _sched(classes=((64, 3), (256, 2)), max_seqs=4, step_tokens=32, copy_min_tokens: int | None = 16,
           **kw) -> Scheduler:
    buckets = (1, 2, 4, 8, 16, 32)
    return Scheduler([SlabClass(t, c) for t, c in classes], max_seqs, step_tokens, buckets, queue_limit=8,
                     prefix_reuse=True, copy_min_tokens=copy_min_tokens, **kw)


class Arena:
    """A fake executor over a simulated KV arena: row p of a sequence holds hash(row p-1, token p), so a row is
    right only when every row before it in its slab is (what attention over a wrong prefix would get wrong)."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.rows: list[int | None] = [None] * s.allocator.total_rows
        self.tokens: dict[str, list[int]] = {}  # every token of each live request: prompt, then outputs
        self.cached: dict[str, int] = {}
        self.rng = random.Random(0)

    def submit(self, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
        self.s.submit(Request(rid, tuple(prompt), max_tokens))
        self.tokens[rid] = list(prompt)

    @staticmethod
    def truth(tokens: list[int]) -> list[int]:
        rows, h = [], 0
        for t in tokens:
            h = hash((h, t))
            rows.append(h)
        return rows

    def step(self, abort_mid_step: str | None = None, submit_mid_step: tuple | None = None) -> ScheduledStep | None:
        """One step; `abort_mid_step` / `submit_mid_step` (rid, prompt, max_tokens) happen while it runs."""
        step = self.s.schedule()
        if step is None:
            return None
        if abort_mid_step is not None:
            self.s.abort(abort_mid_step)
        if submit_mid_step is not None:
            self.submit(*submit_mid_step)
        for copy in step.copies:
            self.rows[copy.dst : copy.dst + copy.rows] = self.rows[copy.src : copy.src + copy.rows]
        sampled = {}
        for chunk in step.chunks:
            self.cached.setdefault(chunk.request_id, chunk.start_pos)
            for j, token in enumerate(chunk.token_ids):
                p = chunk.start_pos + j
                prev = self.rows[chunk.slab_offset + p - 1] if p else 0
                self.rows[chunk.slab_offset + p] = hash((prev, token))
            want = self.truth(self.tokens[chunk.request_id][: chunk.start_pos + len(chunk.token_ids)])
            got = self.rows[chunk.slab_offset : chunk.slab_offset + chunk.start_pos + len(chunk.token_ids)]
            assert got == want, f"{chunk.request_id}: its slab's rows are not its tokens' rows"
            if chunk.sample:
                sampled[chunk.request_id] = self.rng.randrange(50)
        for event in self.s.complete_step(step, sampled):
            self.tokens[event.request_id].append(event.token_id)
        return step

    def drain(self) -> None:
        while self.step() is not None:
            pass


# ---- the index ----------------------------------------------------------------------------------------------------

def test_index_finds_the_longest_block_prefix_then_the_tail_and_forgets_truncated_rows():
    a, b = Slab(0, 0, 64), Slab(0, 64, 64)
    index = PrefixIndex([a, b], block_tokens=4)
    index.extend(a, range(10))            # 0..9
    index.extend(b, [0, 1, 2, 3, 9, 9])   # shares one block with a
    prompt = list(range(12))
    anywhere = lambda s: True  # noqa: E731
    assert index.longest(prompt, 11, anywhere).slab == a and index.longest(prompt, 11, anywhere).tokens == 10
    assert index.longest(prompt, 6, anywhere).tokens == 6      # the limit caps it (the last token is computed)
    assert index.longest(prompt, 11, lambda s: s == b).tokens == 4
    assert index.longest([5, 5, 5, 5, 5], 4, anywhere).slab is None
    index.truncate(a, 5)
    assert index.held(a) == 5 and index.longest(prompt, 11, lambda s: s == a).tokens == 5
    index.assign(b, list(range(8)))
    assert index.tokens(b) == tuple(range(8)) and index.longest(prompt, 11, lambda s: s == b).tokens == 8


def test_index_never_trusts_a_hash_without_the_tokens():
    a = Slab(0, 0, 16)
    index = PrefixIndex([a], block_tokens=2)
    index.extend(a, [1, 2, 3, 4])
    # a prompt whose first block hashes like a's first block (as a collision would) is verified against a's tokens
    index._heads[hash((0, (7, 7)))] = index._heads[hash((0, (1, 2)))]
    assert index.longest([7, 7, 7, 7, 7], 4, lambda s: True).slab is None
    assert index.longest([1, 2, 3, 4, 5], 4, lambda s: True).tokens == 4


def test_index_chains_many_holders_and_unlinks_them_in_any_order():
    slabs = [Slab(0, 32 * k, 32) for k in range(6)]
    index = PrefixIndex(slabs, block_tokens=4)
    shared = list(range(100, 112))
    for k, slab in enumerate(slabs):
        index.extend(slab, shared + [k] * 8)
    assert {s for s in index._holders(hash((0, (100, 101, 102, 103))))} == set(slabs)
    for k in (3, 0, 5):  # head, middle and tail of the chain go
        index.truncate(slabs[k], 2)
    left = [slabs[k] for k in (1, 2, 4)]
    assert set(index._holders(hash((0, (100, 101, 102, 103))))) == set(left)
    assert index.longest(shared + [4] * 8 + [0], 20, lambda s: True) == Match(slabs[4], 20)
    assert index.estimate(shared + [9], 13) == 12
    for slab in left:
        index.truncate(slab, 0)
    assert not index._heads and index.estimate(shared, 12) == 0
    with pytest.raises(ValueError, match="pass its 32"):
        index.extend(slabs[0], list(range(40)))


# ---- placement ----------------------------------------------------------------------------------------------------

def test_a_second_turn_takes_its_conversations_slab_and_prefills_only_what_is_new():
    s = _sched()
    arena = Arena(s)
    arena.submit("t1", list(range(1, 41)), max_tokens=5)
    arena.drain()
    history = arena.tokens["t1"]  # 40 prompt tokens + 5 outputs; the last output's row was never written
    arena.submit("t2", history + [7, 8, 9], max_tokens=3)
    arena.drain()
    assert arena.cached["t2"] == 44  # every row t1 wrote
    assert s.prefix_hit_tokens == 44 and s.prefix_miss_tokens == 40 + 4


def test_identical_prompt_recomputes_only_its_last_token():
    s = _sched()
    arena = Arena(s)
    arena.submit("a", list(range(30)), max_tokens=2)
    arena.drain()
    arena.submit("b", list(range(30)), max_tokens=2)
    arena.drain()
    assert arena.cached["b"] == 29


def test_a_shared_system_prompt_is_copied_so_the_conversation_holding_it_keeps_its_history():
    s = _sched(classes=((128, 3), (256, 2)))
    arena = Arena(s)
    system = list(range(500, 532))  # two blocks
    arena.submit("c1", system + list(range(1, 60)), max_tokens=8)  # its history outweighs the shared part
    arena.drain()
    c1_slab_tokens = len(arena.tokens["c1"]) - 1
    arena.submit("c2", system + list(range(200, 210)), max_tokens=4)
    step = arena.step()
    assert [c.rows for c in step.copies] == [32] and arena.cached["c2"] == 32
    arena.drain()
    arena.submit("c1-turn2", arena.tokens["c1"] + [3, 3, 3], max_tokens=2)
    arena.drain()
    assert arena.cached["c1-turn2"] == c1_slab_tokens, "c2 took c1's slab instead of copying its prefix"


def test_a_context_with_another_tail_takes_the_slab_holding_it_and_keeps_the_other_contexts():
    s = _sched(classes=((128, 2),))
    arena = Arena(s)
    contexts = {name: list(range(base, base + 80)) for name, base in (("a", 1000), ("b", 2000))}
    for name, context in contexts.items():
        arena.submit(f"{name}-1", context + [1, 2, 3], max_tokens=4)
        arena.drain()
    arena.submit("a-2", contexts["a"] + [9, 9], max_tokens=4)
    step = arena.step()
    assert not step.copies and arena.cached["a-2"] == 80  # took a's slab; losing its old tail, not context b
    arena.drain()
    arena.submit("b-2", contexts["b"] + [8], max_tokens=4)
    arena.step()
    assert arena.cached["b-2"] == 80


def test_a_prefix_held_by_a_running_request_is_copied_and_the_runner_never_notices():
    s = _sched()
    arena = Arena(s)
    context = list(range(1000, 1048))
    arena.submit("long", context + [1, 2], max_tokens=40)
    for _ in range(4):
        arena.step()  # its prompt is in, it is decoding
    arena.submit("peer", context + [5, 6, 7], max_tokens=3)
    step = arena.step()
    assert step.copies and step.copies[0].rows == 48 and arena.cached["peer"] == 48
    arena.drain()  # every later row of both requests is checked against its own tokens


def test_no_copies_without_a_measured_gain_and_an_unmatched_prompt_takes_the_least_recently_used_slab():
    s = _sched(classes=((64, 3),), copy_min_tokens=None)
    arena = Arena(s)
    for rid, base in (("x", 100), ("y", 200), ("z", 300)):
        arena.submit(rid, list(range(base, base + 20)), max_tokens=2)
        arena.drain()  # one at a time: x's slab falls free first, then y's and z's
    used = {rid: s.prefix.longest(list(range(base, base + 20)), 19, lambda _: True).slab
            for rid, base in (("x", 100), ("y", 200), ("z", 300))}
    arena.submit("new", list(range(900, 920)), max_tokens=2)
    step = arena.step()
    assert not step.copies
    assert step.chunks[0].slab_offset == used["x"].offset  # x's prefix was the least recently used
    arena.drain()
    arena.submit("y-again", list(range(200, 220)) + [1], max_tokens=2)
    arena.step()
    assert arena.cached["y-again"] == 20


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_with_shared_prefixes_every_row_right_and_every_slab_free(seed):
    """Conversations, shared contexts, cancellations (also mid-step) and queueing, with copies on or off: every
    chunk's rows must be its own tokens' rows (Arena.step checks each), reuse must happen, and everything ends free."""
    rng = random.Random(seed)
    s = _sched(max_seqs=rng.choice([2, 4]), copy_min_tokens=rng.choice([None, 16, 40]))
    arena = Arena(s)
    arena.rng = rng
    contexts = [[rng.randrange(50) for _ in range(rng.randrange(10, 120))] for _ in range(4)]
    finished: list[str] = []
    n = 0
    for _ in range(160):
        if rng.random() < 0.35 and len(s._live) < 10:
            n += 1
            rid = f"r{n}"
            if finished and rng.random() < 0.4:  # a next turn of a finished request
                base = arena.tokens[rng.choice(finished)]
            else:
                base = list(rng.choice(contexts))
            prompt = (base + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])[:230]
            try:
                arena.submit(rid, prompt, max_tokens=rng.randrange(1, 20))
            except Exception:  # noqa: BLE001 - a full queue or a prompt no slab holds: refused, nothing placed
                arena.tokens.pop(rid)
                continue
        if s._live and rng.random() < 0.08:
            s.abort(rng.choice(list(s._live)))
        done_before = set(s._live)
        mid = rng.choice(list(s._live)) if s._live and rng.random() < 0.08 else None
        arena.step(abort_mid_step=mid)
        finished += [rid for rid in done_before - set(s._live) if rid in arena.tokens]
    while s.has_work():
        arena.step()
    assert s.allocator.free_counts() == s.allocator.total_counts()
    assert s.prefix_hit_tokens > 0


def _copy_pending() -> tuple[Scheduler, Arena]:
    """"dst" placed with a copy of 40 rows out of the running "src", not yet run by any step."""
    s = _sched()
    arena = Arena(s)
    arena.submit("src", list(range(40)) + [1], max_tokens=30)
    for _ in range(3):
        arena.step()
    arena.submit("dst", list(range(40)) + [2], max_tokens=3)
    assert [seq.request.request_id for seq in s._copies] == ["dst"]
    return s, arena


def test_an_abort_before_the_copy_runs_leaves_the_slab_holding_nothing():
    s, arena = _copy_pending()
    s.abort("dst")
    assert not s._copies
    step = arena.step()
    assert not step.copies
    arena.drain()
    assert s.allocator.free_counts() == s.allocator.total_counts()


def test_a_discarded_step_that_carried_a_copy_prefills_that_prompt_from_its_first_token():
    s, arena = _copy_pending()
    step = s.schedule()
    assert step.copies
    s.discard_step(step)  # the engine failed before (or while) running it
    arena.cached.pop("dst", None)
    arena.drain()
    assert arena.cached["dst"] == 0
    assert s.allocator.free_counts() == s.allocator.total_counts()


def test_reuse_off_finds_nothing():
    s = Scheduler([SlabClass(64, 2)], 2, 16, (1, 2, 4, 8, 16), queue_limit=2)
    assert s.prefix is None
    s.submit(Request("a", tuple(range(20)), 2))
    while (step := s.schedule()) is not None:
        s.complete_step(step, {c.request_id: 1 for c in step.chunks if c.sample})
    s.submit(Request("b", tuple(range(20)), 2))
    assert s.schedule().chunks[0].start_pos == 0 and s.prefix_hit_tokens == 0


def test_a_slab_freed_mid_step_keeps_only_the_rows_written_before_that_step():
    s = _sched(classes=((64, 1),))
    arena = Arena(s)
    arena.submit("a", list(range(40)), max_tokens=20)
    for _ in range(4):
        arena.step()  # prefill (32 + 8), then decoding
    held = s.prefix.held(s._live["a"].slab)
    # cancelled while a step writes its next row; the next prompt, submitted meanwhile, takes the slab at once
    arena.step(abort_mid_step="a", submit_mid_step=("b", arena.tokens["a"] + [1, 2], 2))
    arena.drain()
    assert arena.cached["b"] == held

# ---- the real model: the same tokens with reuse as without --------------------------------------------------------

CONTEXT = ("The slab planner reads a workload mix, sizes KV slab classes under the memory budget, and reports the "
           "expected utilization. Requests get one contiguous slab at admission and keep it until they finish. "
           "Prefill runs in chunks beside decode rows, and every step runs at a bucketed static shape. ")


@pytest.fixture(scope="module")
def smollm2_engines():
    """The bundled SmolLM2 with reuse on and off; steps of 64 tokens, so long prompts are prefilled in chunks."""
    from _models import smollm2_path
    from slabserve.runtime.engine import Engine, EngineConfig

    def engine(reuse: bool):
        config = EngineConfig(str(smollm2_path()), (SlabClass(320, 4), SlabClass(1024, 2)), max_seqs=6,
                              step_tokens=64, queue_limit=8, prefix_reuse=reuse)
        return Engine(config)

    on = engine(True)
    if on.prefix_reuse_off is not None:
        pytest.skip(on.prefix_reuse_off)
    return on, engine(False)


def _same_tokens(on, off, prompts, sampling=None, stopping=None):
    """Run `prompts` as one batch on both engines; the completions with reuse (checked equal, token for token)."""
    from slabserve.runtime.engine import StoppingOptions
    from slabserve.runtime.sampler import SamplingParams

    sampling = sampling or SamplingParams()
    stopping = stopping or StoppingOptions(max_tokens=24)
    got = on.generate(prompts, sampling, stopping)
    want = off.generate(prompts, sampling, stopping)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids, f"reuse changed the output of {g.request_id}"
        assert w.cached_tokens == 0
    return got


@pytest.mark.slow
def test_smollm2_same_tokens_with_reuse_single_turn_multi_turn_partial_and_full_prefix(smollm2_engines):
    from slabserve.runtime.sampler import SamplingParams

    on, off = smollm2_engines
    question = [{"role": "user", "content": CONTEXT + "What does a request get at admission?"}]
    first = _same_tokens(on, off, [question])[0]
    assert first.cached_tokens == 0
    # full prefix: the same prompt again recomputes only its last token
    again = _same_tokens(on, off, [question])[0]
    assert again.cached_tokens == first.prompt_tokens - 1
    # multi-turn: the history (with the answer the model gave) comes back with a new question
    turn2 = question + [{"role": "assistant", "content": first.text},
                        {"role": "user", "content": "And when does it give the slab back?"}]
    second = _same_tokens(on, off, [turn2])[0]
    assert second.cached_tokens >= first.prompt_tokens
    # partial prefix: the same context, another question (sampled, with a seed)
    other = [{"role": "user", "content": CONTEXT + "How is prefill scheduled?"}]
    sampled = _same_tokens(on, off, [other], SamplingParams(temperature=0.9, top_p=0.95, seed=7))[0]
    assert 0 < sampled.cached_tokens < sampled.prompt_tokens - 5


def _scripted(engine, arrivals, sampling, stopping):
    """Submit arrivals[k] (a list of prompts) before step k, run until every request ends; rid -> final event,
    token ids."""
    tokens, finals, k = {}, {}, 0
    while k < len(arrivals) or engine.has_work():
        for prompt in arrivals[k] if k < len(arrivals) else ():
            rid = engine.submit(prompt, sampling, stopping, request_id=f"p{len(tokens)}")
            tokens[rid] = []
        k += 1
        for event in engine.step():
            tokens[event.request_id].extend(event.token_ids)
            if event.finished is not None:
                finals[event.request_id] = event
    return {rid: (finals[rid], tuple(t)) for rid, t in tokens.items()}


@pytest.mark.slow
def test_smollm2_same_tokens_with_reuse_in_a_crowd_with_copies(smollm2_engines):
    """Requests arriving into busy steps: two share a long context with a finished request (copied out of its free
    slab, which keeps its rows), one arrives while another with the same long context is running (copied out of the
    running slab), beside unrelated ones; all in the same chunked steps, sampled with seeds."""
    from slabserve.runtime.engine import StoppingOptions
    from slabserve.runtime.sampler import SamplingParams

    on, off = smollm2_engines
    _same_tokens(on, off, [CONTEXT + "Summarize this."])
    copies = []
    real_copy = on._copy_rows
    on._copy_rows = lambda src, dst, rows: (copies.append(rows), real_copy(src, dst, rows))
    try:
        shared = CONTEXT * 2 + "Question: "
        arrivals = [[CONTEXT + "Summarize this in one line.", shared + "what is a bucket?", "Hello there!"],
                    [], [], [], [], [], [], [],
                    [shared + "what is a slab?", CONTEXT + "Name the unit of admission.", "2 + 2 ="]]
        sampling, stopping = SamplingParams(temperature=0.7, top_k=40, seed=3), StoppingOptions(max_tokens=20)
        got = _scripted(on, arrivals, sampling, stopping)
    finally:
        on._copy_rows = real_copy
    want = _scripted(off, arrivals, sampling, stopping)
    assert {rid: t for rid, (_, t) in got.items()} == {rid: t for rid, (_, t) in want.items()}
    cached = {rid: final.cached_tokens for rid, (final, _) in got.items()}
    assert cached["p0"] > 0 and cached["p4"] > 0, cached  # from the finished request's slab
    assert cached["p3"] > 100, cached                     # from p1, running when p3 arrived
    assert len(copies) >= 3, copies
    assert on.scheduler.allocator.free_counts() == on.scheduler.allocator.total_counts()


def test_serving_steps_that_reuse_and_copy_prefixes_create_no_tensor_storage(tmp_path):
    """Steps that run copies of retained rows, start prefills after a reused prefix and decode beside them: the
    serving loop still creates no tensor storage (the copies are views of the arena)."""
    from _models import make_served_tiny_model
    from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions
    from slabserve.runtime.executor import allocations

    engine = Engine(EngineConfig(str(make_served_tiny_model(tmp_path / "tiny")), (SlabClass(64, 4), SlabClass(256, 2)),
                                 max_seqs=6, step_tokens=32, buckets=(1, 8, 32), queue_limit=8))
    assert engine.prefix_reuse_off is None and engine.scheduler.copy_min_tokens is not None
    context = list(range(3, 70))
    stopping = StoppingOptions(max_tokens=6, ignore_eos=True)
    engine.generate([context + [5]], stopping=stopping)  # leaves its rows in a free slab
    copies = []
    real_copy = engine._copy_rows
    engine._copy_rows = lambda *a: (copies.append(a), real_copy(*a))
    for k in range(4):
        engine.submit(context + [k + 7, k + 8], stopping=stopping)
    finals = []

    def step() -> None:
        finals.extend(e for e in engine.step() if e.finished is not None)

    assert allocations(step, steps=12) == []
    while engine.has_work():
        step()
    assert copies and len(finals) == 4 and all(e.cached_tokens >= len(context) for e in finals)
