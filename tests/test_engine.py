"""Engine behaviour on a tiny random model: stop strings, seeds, aborts, errors, and every slab coming back."""
from __future__ import annotations

import random

import pytest

from _models import smollm2_path
from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions, _find_stop, _held_back
from slabserve.runtime.sampler import SamplingParams
from slabserve.runtime.scheduler import FinishReason, InvalidRequestError, OutOfRangeError
from slabserve.runtime.slab_allocator import SlabClass

CLASSES = (SlabClass(128, 6), SlabClass(512, 2))


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(str(smollm2_path()), CLASSES, max_seqs=8, step_tokens=64))


def _all_free(engine):
    load = engine.scheduler.load()
    return load.free_per_class == load.total_per_class and load.running == 0 and sum(load.queued_per_class) == 0


def test_same_seed_same_tokens_whatever_the_batch(engine):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    stopping = StoppingOptions(max_tokens=24, ignore_eos=True)
    alone = engine.generate(["Once upon a time"], sampling, stopping)[0].token_ids
    others = SamplingParams(temperature=1.0, seed=7)
    engine.submit("Unrelated prompt one", others, stopping)
    engine.submit("Another unrelated prompt", others, stopping)
    together = engine.generate(["Once upon a time"], sampling, stopping)[0].token_ids
    while engine.has_work():
        engine.step()
    assert alone == together
    assert engine.generate(["Once upon a time"], SamplingParams(temperature=0.9, top_p=0.95, seed=99),
                           stopping)[0].token_ids != alone
    assert _all_free(engine)


def test_stop_string_ends_output_before_it(engine):
    greedy = engine.generate(["List the numbers: 1, 2, 3,"], stopping=StoppingOptions(max_tokens=20,
                                                                                       ignore_eos=True))[0]
    assert len(greedy.text) > 4
    stop = greedy.text[3:5]  # two characters from inside the greedy answer
    got = engine.generate(["List the numbers: 1, 2, 3,"], stopping=StoppingOptions(max_tokens=20, stop=(stop,),
                                                                                    ignore_eos=True))[0]
    assert got.finish_reason == FinishReason.STOP
    assert got.text == greedy.text[: greedy.text.find(stop)]
    assert _all_free(engine)


def test_stream_pieces_join_to_the_text(engine):
    pieces = list(engine.stream("The weather today", stopping=StoppingOptions(max_tokens=16, ignore_eos=True)))
    assert pieces[-1].finished == FinishReason.LENGTH and pieces[-1].completion_tokens == 16
    joined = "".join(p.text for p in pieces)
    ids = [t for p in pieces for t in p.token_ids]
    assert joined == engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_random_requests_with_aborts_leave_every_slab_free(engine):
    rng = random.Random(0)
    live = set()
    for i in range(60):
        rid = engine.submit([rng.randrange(1, 4000) for _ in range(rng.randrange(1, 300))],
                            SamplingParams(temperature=1.0, seed=i),
                            StoppingOptions(max_tokens=rng.randrange(1, 12)))
        live.add(rid)
        if rng.random() < 0.3:
            for event in engine.step():
                if event.finished:
                    live.discard(event.request_id)
        if live and rng.random() < 0.33:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
        while engine.scheduler.load().running >= 8 or sum(engine.scheduler.load().queued_per_class) > 4:
            for event in engine.step():
                if event.finished:
                    live.discard(event.request_id)
    while engine.has_work():
        for event in engine.step():
            if event.finished:
                live.discard(event.request_id)
    assert not live and _all_free(engine)


def test_bad_requests_are_refused_with_the_field(engine):
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.submit("hi", SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidRequestError, match="top_p"):
        engine.submit("hi", SamplingParams(top_p=0.0))
    with pytest.raises(InvalidRequestError, match="token_ids"):
        engine.submit([1, 2, 10**6])
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.submit("")
    with pytest.raises(OutOfRangeError, match="512"):
        engine.submit("hi", stopping=StoppingOptions(max_tokens=600))
    assert _all_free(engine)


def test_stop_matching_helpers():
    assert _find_stop("abc STOP def", 0, ("STOP",)) == 4
    assert _find_stop("abcST", 3, ("STOP",)) is None
    assert _held_back("abcST", ("STOP",)) == 2
    assert _held_back("abc", ("STOP", "xyz")) == 0


def test_kv_dtype_is_honoured_on_cpu(tmp_path):
    """A CPU engine with bf16 KV keeps its KV arena in bf16 (half the bytes), warms up and serves with zero
    allocations, and its logits are the fp32-KV engine's up to the rounding of the cached rows (which they show:
    the decode step reads rounded keys)."""
    import torch

    from _models import make_served_tiny_model
    from slabserve.runtime.executor import allocations
    from slabserve.runtime.step import SeqChunk

    folder = str(make_served_tiny_model(tmp_path / "model"))
    engines = {kv: Engine(EngineConfig(folder, (SlabClass(64, 2),), max_seqs=2, step_tokens=8, buckets=(1, 8),
                                       kv_dtype=kv)) for kv in ("float32", "bfloat16")}
    full, half = engines["float32"], engines["bfloat16"]
    assert half.k_cache.dtype == half.v_cache.dtype == torch.bfloat16 and full.k_cache.dtype == torch.float32
    assert 2 * half.k_cache.nbytes == full.k_cache.nbytes
    logits = {}
    for kv, engine in engines.items():
        engine.inputs[8].fill([SeqChunk(0, 0, [5, 9, 11, 3, 7])])
        prefill = engine._run_step(8)[:1].clone()
        engine.inputs[1].fill([SeqChunk(0, 5, [42])])
        logits[kv] = (prefill, engine._run_step(1)[:1].clone())
    torch.testing.assert_close(logits["bfloat16"][0], logits["float32"][0], rtol=0, atol=0.05)
    torch.testing.assert_close(logits["bfloat16"][1], logits["float32"][1], rtol=0, atol=0.05)
    assert not torch.equal(logits["bfloat16"][1], logits["float32"][1])
    stopping = StoppingOptions(max_tokens=12, ignore_eos=True)
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]):
        half.submit(prompt, SamplingParams(temperature=0.7, seed=3), stopping)
    half.step()
    assert allocations(lambda: half.step(), 8) == []
    while half.has_work():
        half.step()
    assert _all_free(half)


def test_the_thread_that_builds_an_engine_keeps_no_openmp_team(tmp_path):
    """Building (and warming up) an engine runs OpenMP regions on the building thread, which makes that thread a
    team; kept, it would count against libgomp's spinning for the thread that steps the engine (the server's: with
    more OpenMP threads than CPUs every wait sleeps, and a served step ran 1.7x slower). The engine frees it: a
    second release right after finds no worker thread to end."""
    import os
    import threading
    import time

    import torch

    from _models import make_served_tiny_model
    from slabserve.runtime.engine import release_openmp_team

    folder = str(make_served_tiny_model(tmp_path / "model"))
    out: dict = {}

    def tasks() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    def build() -> None:
        torch.set_num_threads(2)  # a team of one worker beside this thread, whatever the machine
        Engine(EngineConfig(folder, (SlabClass(64, 2),), max_seqs=2, step_tokens=8, buckets=(1, 8)))
        after = tasks()
        out["freed"] = release_openmp_team()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and tasks() >= after:  # a freed worker would exit within milliseconds
            time.sleep(0.02)
        out["ended"] = after - tasks()

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    if not out["freed"]:
        pytest.skip("the OpenMP runtime is not libgomp")
    assert out["ended"] == set(), f"{len(out['ended'])} OpenMP worker(s) of the building thread were still there"


@pytest.mark.parametrize("src,dst,rows", [(0, 64, 40), (3, 70, 29), (16, 70, 50), (40, 8, 1), (5, 90, 0),
                                          (32, 80, 16)])
def test_copied_cache_rows_are_the_same_rows_whether_k_is_tiled_or_not(src, dst, rows):
    """Prefix reuse copies a slab's rows to another slab, or a declared prefix's rows (any offset) to a slab: the
    tiled K cache must end up holding, row for row, what a row cache does after the same copy."""
    import torch

    from slabserve.kernels.contracts import k_rows, k_tiles
    from slabserve.runtime.engine import copy_cache_rows

    rows_cache = torch.randn(2, 128, 3, 8)  # (L, N, Hkv, D)
    before = rows_cache.clone()
    tiled_cache = torch.stack([k_tiles(layer) for layer in rows_cache])
    copy_cache_rows(rows_cache, src, dst, rows, tiled=False)
    copy_cache_rows(tiled_cache, src, dst, rows, tiled=True)
    assert torch.equal(torch.stack([k_rows(layer) for layer in tiled_cache]), rows_cache)
    assert torch.equal(rows_cache[:, dst : dst + rows], before[:, src : src + rows])
