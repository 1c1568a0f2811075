"""2,000 requests of random lengths through one Engine, half of them starting with one of a few shared contexts
(prefix reuse on), a third cancelled at random points: afterwards every slab is free, nothing is queued or running,
and no arena moved (the same storage, at the same address, as at start-up)."""
from __future__ import annotations

import random

import pytest

from _models import make_served_tiny_model
from slabserve.kernels import cpu_native
from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions
from slabserve.runtime.sampler import SamplingParams
from slabserve.runtime.scheduler import QueueFullError
from slabserve.runtime.slab_allocator import SlabClass

REQUESTS = 2000


def _addresses(engine: Engine) -> dict[str, int]:
    buffers = {"k_cache": engine.k_cache, "v_cache": engine.v_cache, "activations": engine.executor.arena,
               "sampler.probs": engine.sampler.probs, "sampler.order": engine.sampler.order}
    buffers.update({f"inputs[{b}].{n}": t for b, i in engine.inputs.items() for n, t in i.tensors().items()})
    return {name: t.untyped_storage().data_ptr() for name, t in buffers.items()}


@pytest.mark.parametrize("weights", ["float", pytest.param("q8_0", marks=pytest.mark.skipif(
    not cpu_native.available(), reason="Q8_0 blocks need the native CPU kernels"))])
def test_two_thousand_requests_with_cancellations_leave_every_slab_free(tmp_path, weights):
    """`weights` q8_0: the same churn with the projections and embedding in Q8_0 blocks in the weight arena."""
    folder = make_served_tiny_model(tmp_path / "tiny")
    engine = Engine(EngineConfig(str(folder), (SlabClass(32, 6), SlabClass(128, 2)), max_seqs=8, step_tokens=64,
                                 buckets=(1, 8, 64), queue_limit=16, weight_format=weights))
    before = _addresses(engine)
    rng = random.Random(1234)
    live: set[str] = set()
    to_cancel: dict[str, int] = {}  # request id -> steps until it is aborted
    submitted = cancelled = finished = 0

    def step() -> None:
        nonlocal finished, cancelled
        for event in engine.step():
            if event.finished is not None:
                live.discard(event.request_id)
                finished += 1
        for rid in list(to_cancel):
            to_cancel[rid] -= 1
            if to_cancel[rid] <= 0:
                del to_cancel[rid]
                cancelled += engine.abort(rid)

    vocab = engine.model_config.vocab_size
    contexts = [[rng.randrange(3, vocab) for _ in range(rng.choice((20, 50, 90)))] for _ in range(4)]
    while submitted < REQUESTS:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.choice((1, 3, 10, 40, 100)))]
        if rng.random() < 0.5:  # half start with a shared context: retained slabs are taken and copied from
            prompt = (rng.choice(contexts) + prompt)[:100]
        stopping = StoppingOptions(max_tokens=rng.randrange(1, 25), ignore_eos=rng.random() < 0.5)
        try:
            rid = engine.submit(prompt, SamplingParams(temperature=rng.choice((0.0, 1.0)), seed=submitted), stopping)
        except QueueFullError:
            step()
            continue
        submitted += 1
        live.add(rid)
        if rng.random() < 1 / 3:
            to_cancel[rid] = rng.randrange(0, 12)
        if rng.random() < 0.5:
            step()
    while engine.has_work() or to_cancel:
        step()
    assert engine.scheduler.prefix_hit_tokens > 0

    load = engine.scheduler.load()
    assert not live and finished == REQUESTS
    assert cancelled > REQUESTS // 5  # most of the planned third: the rest ended before their abort came
    assert load.free_per_class == load.total_per_class == (6, 2)
    assert load.running == 0 and sum(load.queued_per_class) == 0
    assert _addresses(engine) == before
