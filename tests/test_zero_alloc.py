"""Zero allocation: steady-state steps create no tensor storage; the detector sees one when it happens; the Engine
checks its warm-up and refuses a violated plan. CUDA: graph replays leave the caching allocator's counters still."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from _models import make_hf_model, smollm2_path
from slabserve.kernels import cpu_native
from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions
from slabserve.runtime.executor import (ActivationPlan, CudaGraphRunner, PlannedExecutor,
                                        PlanViolationError, allocations, count_allocations, plan_sequential)
from slabserve.runtime.loader import open_model
from slabserve.runtime.model import build_step
from slabserve.runtime.sampler import Sampler, SamplingParams, make_generator
from slabserve.runtime.slab_allocator import SlabClass
from slabserve.runtime.step import SeqChunk, StepInputs
from slabserve.kernels.contracts import k_cache_shape
from slabserve.runtime.trace import export_step, k_cache_tiled

BUCKETS, MAX_SEQS, KV_ROWS, STEADY_STEPS = (1, 4), 2, 128, 200


def tiny_executor(folder, device="cpu"):
    source = open_model(make_hf_model(folder, "llama"))
    c = source.config
    step = build_step(source, torch.float32, rope_positions=KV_ROWS).to(device)
    tiled = k_cache_tiled(c, torch.device(device).type, torch.float32, torch.float32)  # as the Engine keeps K
    programs = {b: export_step(step, b, MAX_SEQS, KV_ROWS, device, k_tiled=tiled) for b in BUCKETS}
    executor = PlannedExecutor.allocate(programs, plan_sequential(programs), device)
    v = torch.zeros(c.num_layers, KV_ROWS, c.num_kv_heads, c.head_dim, device=device)  # (L, N, Hkv, D)
    return c, executor, torch.zeros(k_cache_shape(tuple(v.shape), tiled), device=device), v


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_executor(tmp_path_factory.mktemp("llama"))


def steady_loop(config, executor, k, v):
    """A step function like the engine's: two sequences decoding (bucket 1 and 4 alternating), then sampling."""
    inputs = {b: StepInputs(b, MAX_SEQS) for b in BUCKETS}
    sampler = Sampler(MAX_SEQS, config.vocab_size)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)]
    generators = [make_generator(0), make_generator(1)]
    state = {"pos": 0, "tokens": [1, 2]}

    def one_step():
        pos, (a, b) = state["pos"] % (KV_ROWS // 2 - 1), state["tokens"]
        bucket = 4 if pos % 2 else 1
        chunks = [SeqChunk(0, pos, [a]), SeqChunk(KV_ROWS // 2, pos, [b])] if bucket == 4 else [SeqChunk(0, pos, [a])]
        inputs[bucket].fill(chunks)
        logits = executor.run(bucket, inputs[bucket].tensors(), k, v)  # (R, V): one row at bucket 1, two at 4
        n = logits.shape[0]
        state["tokens"] = [*sampler.sample(logits, params[:n], generators[:n]).tolist(), b][:2]
        state["pos"] += 1

    return one_step


def test_steady_state_steps_create_no_tensor_storage(tiny):
    step = steady_loop(*tiny)
    for _ in range(4):  # first runs bind the graphs
        step()
    assert allocations(step, STEADY_STEPS) == []


def test_cpu_kernel_references_allocate_nothing(tiny):
    step = steady_loop(*tiny)
    step()
    assert count_allocations(step, 5) == 0


def test_detector_sees_an_allocation(tiny):
    step = steady_loop(*tiny)
    step()
    extra = torch.ones(8)
    assert count_allocations(lambda: (step(), extra.clone()), 3) == 3
    found = allocations(lambda: torch.empty(5, 7), 2)
    assert [a.nbytes for a in found] == [140, 140] and found[0].ops[0] == "aten::empty"


# ---- the engine's warm-up check (SmolLM2: the tiny random models have no tokenizer)


WEIGHT_FORMATS = ["float", pytest.param("gguf", marks=pytest.mark.skipif(
    not cpu_native.available(), reason="GGUF blocks need the native CPU kernels"))]


@pytest.fixture(scope="module", params=WEIGHT_FORMATS)
def engine(request):
    """SmolLM2 with its weights dequantized to fp32 (float) or kept in the file's Q4_1/Q8_0 blocks (gguf)."""
    return Engine(EngineConfig(str(smollm2_path()), (SlabClass(64, 2),), max_seqs=2, step_tokens=4, buckets=(1, 4),
                               weight_format=request.param))


def test_engine_warm_up_passes_and_serves(engine):
    out = engine.generate(["Hello"], stopping=StoppingOptions(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    engine.warm_up()  # the same check again, after serving


def test_engine_refuses_when_serving_allocates(engine, monkeypatch):
    sample = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, *a: sample(self, logits.clone(), *a))
    with pytest.raises(PlanViolationError, match=r"warm-up \(mixed steps\) created .* tensor storages .*aten::clone"):
        engine.warm_up()


def test_warm_up_attends_over_the_longest_slab_and_checks_busy_steps():
    # in the first warm-up runs, the first chunk of every bucket ends on the last row of the longest slab (rows
    # 64..1087 here), so what the libraries under attention size by the context (MKL's buffers) is at its largest
    # before serving; the checked runs start every chunk at position 0, then mix a decode row at the end of the
    # longest slab with prefill chunks and decode rows that start mid-slab
    config = EngineConfig("unused", (SlabClass(32, 2), SlabClass(1024, 1), SlabClass(96, 3)), max_seqs=4,
                          step_tokens=64)
    holder = SimpleNamespace(config=config)
    holder._slabs = lambda: Engine._slabs(holder)
    for bucket, want in [(1, [(64, 1023, 1)]), (64, [(64, 960, 64)]),
                         (1100, [(64, 0, 1024), (0, 0, 32), (32, 0, 32), (1088, 0, 12)])]:
        chunks = Engine._warm_up_chunks(holder, bucket, "longest")
        assert [(c.slab_offset, c.start_pos, len(c.token_ids)) for c in chunks] == want
        assert all(c.start_pos + len(c.token_ids) <= c.slab_tokens for c in chunks)
    chunks = Engine._warm_up_chunks(holder, 100, "start")
    assert [(c.slab_offset, c.start_pos, len(c.token_ids)) for c in chunks] == [(0, 0, 32), (32, 0, 32), (64, 0, 36)]
    for bucket, want in [(1, [(64, 1023, 1)]), (64, [(64, 1023, 1), (0, 16, 16), (32, 16, 1), (1088, 48, 46)])]:
        chunks = Engine._warm_up_chunks(holder, bucket, "mixed")
        assert [(c.slab_offset, c.start_pos, len(c.token_ids)) for c in chunks] == want
        assert all(c.start_pos + len(c.token_ids) <= c.slab_tokens for c in chunks)


def test_the_warm_up_check_runs_at_the_serving_thread_count(engine, monkeypatch):
    """A step that allocates only when torch runs more than one thread is refused by the warm-up too."""
    sample = Sampler.sample

    def allocating_with_threads(self, logits, *a):
        return sample(self, logits.clone() if torch.get_num_threads() > 1 else logits, *a)

    monkeypatch.setattr(Sampler, "sample", allocating_with_threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(PlanViolationError,
                           match=r"warm-up \(mixed steps\) created .* tensor storages in 1 steps at 2 threads"):
            engine.warm_up()
    finally:
        torch.set_num_threads(threads)


def test_engine_steps_only_after_a_warm_up():
    cold = Engine(EngineConfig(str(smollm2_path()), (SlabClass(64, 1),), max_seqs=1, step_tokens=4, buckets=(1, 4)),
                  warm_up=False)
    cold.submit([1, 2, 3], stopping=StoppingOptions(max_tokens=1))
    with pytest.raises(RuntimeError, match="has not run its warm-up"):
        cold.step()
    cold.warm_up()
    assert cold.warmed_on == threading.get_ident()
    assert len(cold.generate([[1, 2, 3]], stopping=StoppingOptions(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_engine_refuses_a_plan_that_does_not_fit():
    bad = ActivationPlan(64, {1: {}, 4: {}})
    with pytest.raises(PlanViolationError, match="bucket 1: no planned offset"):
        Engine(EngineConfig(str(smollm2_path()), (SlabClass(64, 2),), max_seqs=2, step_tokens=4, buckets=(1, 4)),
               activation_plan=bad)


# ---- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_leave_allocator_counters_still(tmp_path):
    config, executor, k, v = tiny_executor(tmp_path, "cuda")
    inputs = {b: StepInputs(b, MAX_SEQS, "cuda") for b in BUCKETS}
    runner = CudaGraphRunner(executor, {b: i.tensors() for b, i in inputs.items()}, k, v)
    assert sorted(runner.graphs) == sorted(BUCKETS) and runner.added_bytes >= 0
    assert not k.any() and not v.any()  # warm-up and capture ran on padding inputs: no KV row written
    inputs[4].fill([SeqChunk(0, 0, [1, 2, 3]), SeqChunk(KV_ROWS // 2, 0, [4])])
    want = executor.run(4, inputs[4].tensors(), k.clone(), v.clone()).clone()
    torch.testing.assert_close(runner.replay(4).clone(), want, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    keys = ("allocation.all.allocated", "segment.all.allocated", "reserved_bytes.all.current",
            "allocated_bytes.all.current")
    before = {key: torch.cuda.memory_stats()[key] for key in keys}
    for i in range(1000):
        bucket = BUCKETS[i % 2]
        inputs[bucket].fill([SeqChunk(0, i % 60, [5])])
        logits = runner.replay(bucket)
    torch.cuda.synchronize()
    assert {key: torch.cuda.memory_stats()[key] for key in keys} == before
    assert logits.untyped_storage().data_ptr() == executor.arena.untyped_storage().data_ptr()
