"""Plans across devices and dtypes, checked on CPU: the step traced at build time for a CUDA plan is the step the
engine traces on the device (same graph fingerprint, same planned intermediates), and a plan's kv_dtype is what
the engine allocates and serves with (issue 14, points 3 and 4)."""
from __future__ import annotations

import pytest
import torch
import yaml

from _models import make_served_tiny_model
from slabserve.compiler.build import build_plan
from slabserve.compiler.bundle import write_bundle
from slabserve.compiler.spec import load_spec
from slabserve.runtime.engine import Engine, StoppingOptions
from slabserve.runtime.executor import allocations
from slabserve.runtime.loader import open_model
from slabserve.runtime.model import build_step
from slabserve.runtime.trace import activation_tensors, export_step, graph_fingerprint

BASE_SPEC = {"max_seqs": 6, "step_tokens": 32, "buckets": [1, 8, 32], "max_context": 256,
             "kv": {"classes": [{"tokens": 64, "count": 4}, {"tokens": 256, "count": 2}]}}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_served_tiny_model(root / "model")
    return root


def _plan(root, name: str, **fields):
    spec = {"name": name, "model": {"path": "model"}, **BASE_SPEC, **fields}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return build_plan(load_spec(root / f"{name}.yaml", base_dir=root), root)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_cuda_plans_trace_is_the_step_the_engine_traces_on_the_device(model_root, dtype):
    """The compiler traces a CUDA plan on a meta step made from the config (runtime.trace.meta_step); the engine,
    on the GPU, loads the real weights into its weight arena on the device (build_step) and traces that step with
    its own KV arena in the plan's kv_dtype. The engine's path is run here as it runs there, on the `meta` device:
    a CPU-only torch cannot trace tensors on a (fake) CUDA device, since indexing takes a CUDA device guard, and
    meta takes the step's non-CPU branches as CUDA does (the step's one device test is cpu or not). Every bucket
    must come out with the plan's fingerprint and the plan's intermediates. On a GPU, Engine.from_plan checks the
    same fingerprints against its real trace before it allocates anything."""
    built = _plan(model_root, f"cuda-{dtype}", target={"device": "cuda", "gpu": "H100-80GB"}, dtype=dtype,
                  kv_dtype="bfloat16")
    plan, e = built.plan, built.plan.engine
    assert e.device == "cuda" and plan.kv.dtype == "bfloat16"
    step = build_step(open_model(model_root / "model"), getattr(torch, dtype), rope_positions=e.rope_positions,
                      device="meta", gemm=e.gemm)
    shape = (plan.kv.num_layers, plan.kv.rows, plan.kv.num_kv_heads, plan.kv.head_dim)  # (L, N, Hkv, D)
    k = torch.zeros(shape, dtype=torch.bfloat16, device="meta")
    programs = {b: export_step(step, b, e.max_seqs, plan.kv.rows, "meta", kv_caches=(k, torch.zeros_like(k)))
                for b in e.buckets}
    for layout in plan.activations.buckets:
        program = programs[layout.tokens]
        assert graph_fingerprint(program) == layout.graph_fingerprint, layout.tokens
        mine = sorted((t.name, t.shape, str(t.dtype).removeprefix("torch."), t.nbytes, t.first_use, t.last_use)
                      for t in activation_tensors(program))
        theirs = sorted((t.name, tuple(t.shape), t.dtype, t.nbytes, t.first_use, t.last_use) for t in layout.tensors)
        assert mine == theirs, layout.tokens
    # the device step plans the split decode attention's workspace (S, H, splits, D + 2) and no CPU scratch
    c = plan.model
    workspaces = [t for t in plan.activations.buckets[0].tensors if t.dtype == "float32" and len(t.shape) == 4]
    assert [tuple(t.shape)[:2] + (tuple(t.shape)[3],) for t in workspaces] == [(e.max_seqs, c.num_heads,
                                                                                c.head_dim + 2)]
    cpu = _plan(model_root, f"cpu-{dtype}", target={"device": "cpu", "memory": "1GiB"}, dtype=dtype,
                kv_dtype="bfloat16", gemm="aten")
    assert cpu.plan.activations.buckets[0].graph_fingerprint != plan.activations.buckets[0].graph_fingerprint


def test_a_cpu_plan_with_bf16_kv_serves_with_its_kv_dtype(model_root, monkeypatch):
    monkeypatch.chdir(model_root)
    built = _plan(model_root, "cpu-bf16-kv", target={"device": "cpu", "memory": "1GiB"}, kv_dtype="bfloat16")
    write_bundle(built, model_root / "bf16kv")
    full = _plan(model_root, "cpu-f32-kv", target={"device": "cpu", "memory": "1GiB"}, kv_dtype="float32")
    assert 2 * built.plan.kv.arena_bytes == full.plan.kv.arena_bytes
    engine = Engine.from_plan(model_root / "bf16kv")  # the traced step's fingerprints match the plan's
    assert engine.k_cache.dtype == torch.bfloat16
    assert engine.k_cache.nbytes + engine.v_cache.nbytes == built.plan.kv.arena_bytes
    stop = StoppingOptions(max_tokens=10, ignore_eos=True)
    for prompt in ("def main(argv):", "The quick brown fox"):
        engine.submit(prompt, stopping=stop)
    engine.step()
    assert allocations(lambda: engine.step(), 6) == []
    while engine.has_work():
        engine.step()
    load = engine.scheduler.load()
    assert load.free_per_class == load.total_per_class


def test_a_cuda_plan_records_what_its_target_needs_and_the_server_checks_that(model_root, monkeypatch):
    """Built here (torch x.y.z+cpu), the plan records torch and triton by major.minor and the H100's compute
    capability and the memory it plans; a server with a CUDA build of the same torch.minor and an H200 passes, an
    A100 or a smaller GPU is refused with what differs (the device read from torch.cuda.get_device_properties,
    simulated here)."""
    from importlib.metadata import version
    from types import SimpleNamespace

    from slabserve.runtime.bundle_checks import PlanMismatchError, check_cuda_device, check_fingerprints

    plan = _plan(model_root, "cuda-requires", target={"device": "cuda", "gpu": "H100-80GB"}, dtype="bfloat16").plan
    r = plan.target.requires
    assert r.torch == ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert r.triton == ".".join(version("triton").split(".")[:2]) and r.compute_capability == (9, 0)
    assert r.device_memory_bytes == plan.totals.planned_bytes + plan.totals.reserve_bytes
    cpu = _plan(model_root, "cpu-requires", target={"device": "cpu", "memory": "1GiB"}).plan.target.requires
    assert (cpu.triton, cpu.compute_capability, cpu.device_memory_bytes) == (None, None, 0)
    device = {"props": SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_110_011_392)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device["props"])
    monkeypatch.setattr(torch, "__version__", torch.__version__.split("+")[0] + "+cu130")
    check_fingerprints(plan, open_model(model_root / "model"), model_root)  # passes: same torch minor, an H200
    device["props"] = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, total_memory=85_899_345_920)
    with pytest.raises(PlanMismatchError, match=r"built for H100-80GB; this device \(NVIDIA A100-SXM4-80GB\) has "
                                                r"compute capability 8.0, the plan needs 9.0"):
        check_cuda_device(plan.name, r, plan.fingerprints.device, "rebuild")
    device["props"] = SimpleNamespace(name="small", major=9, minor=0, total_memory=r.device_memory_bytes // 2)
    with pytest.raises(PlanMismatchError, match="MiB of memory, the plan needs"):
        check_cuda_device(plan.name, r, plan.fingerprints.device, "rebuild")
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu130")
    with pytest.raises(PlanMismatchError, match=rf"plan 'cuda-requires' needs torch {r.torch}.x"):
        check_fingerprints(plan, open_model(model_root / "model"), model_root)
