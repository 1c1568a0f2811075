"""Stored step graphs (graphs.msgpack): the server rebuilds its executor from the bundle instead of tracing, gets
the same tokens as a traced engine, and refuses a file that was edited, truncated or names ops it must not run."""
from __future__ import annotations

import hashlib
import shutil

import msgpack
import pytest
import yaml

from _models import make_served_tiny_model
from slabserve.compiler.build import build_plan
from slabserve.compiler.bundle import write_bundle
from slabserve.compiler.spec import load_spec
from slabserve.runtime.engine import Engine, PlanMismatchError, StoppingOptions
from slabserve.kernels import cpu_native
from slabserve.runtime.graph_io import GRAPHS_FILE, GraphFormatError
from slabserve.runtime.plan import read_plan

PROMPTS = ["def main(argv):", "The quick brown fox", "for i in range(10):"]
STOP = StoppingOptions(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    make_served_tiny_model(root / "model")
    spec = {"name": "tiny-served", "model": {"path": "model"}, "target": {"device": "cpu", "memory": "1GiB"},
            "max_seqs": 6, "step_tokens": 32, "buckets": [1, 8, 32], "max_context": 256,
            "kv": {"classes": [{"tokens": 64, "count": 4}, {"tokens": 256, "count": 2}]}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    write_bundle(build_plan(load_spec(root / "spec.yaml", base_dir=root), root), root / "bundle")
    return root


def _tokens(engine: Engine) -> list[tuple[int, ...]]:
    return [c.token_ids for c in engine.generate(PROMPTS, stopping=STOP)]


def test_stored_graphs_give_the_traced_engines_tokens(bundle, monkeypatch):
    monkeypatch.chdir(bundle)
    assert (bundle / "bundle" / GRAPHS_FILE).is_file()
    stored = Engine.from_plan(bundle / "bundle")
    traced_dir = bundle / "traced"
    shutil.copytree(bundle / "bundle", traced_dir, dirs_exist_ok=True)
    (traced_dir / GRAPHS_FILE).unlink()
    traced = Engine.from_plan(traced_dir)
    assert _tokens(stored) == _tokens(traced)
    assert stored.plan_id == hashlib.sha256((bundle / "bundle" / "plan.msgpack").read_bytes()).hexdigest()


def _edit(bundle, name: str, change) -> None:
    src, dst = bundle / "bundle", bundle / name
    shutil.copytree(src, dst, dirs_exist_ok=True)
    data = msgpack.unpackb((src / GRAPHS_FILE).read_bytes(), raw=False)
    change(data)
    (dst / GRAPHS_FILE).write_bytes(msgpack.packb(data, use_bin_type=True))


def _first_call(data, target_prefix: str) -> dict:
    return next(n for n in data["buckets"][0]["nodes"] if n["target"].startswith(target_prefix))


def test_an_op_outside_aten_and_slabserve_is_refused(bundle, monkeypatch):
    monkeypatch.chdir(bundle)
    _edit(bundle, "hostile", lambda d: _first_call(d, "aten.").update(target="os.system.default"))
    with pytest.raises(GraphFormatError, match="'os.system.default' is not an aten or slabserve op"):
        Engine.from_plan(bundle / "hostile")


def test_an_edited_argument_fails_the_plans_fingerprint(bundle, monkeypatch):
    monkeypatch.chdir(bundle)
    def scale(d):  # the attention's softmax scale, a constant argument of the slabserve op
        node = _first_call(d, "slabserve.slab_attention")
        args = node["args"]["tuple"]  # (q, k_cache, v_cache, query_start, slab_offset, context_len, scale, ...)
        args[6] = args[6] * 2
    _edit(bundle, "edited", scale)
    with pytest.raises(PlanMismatchError, match="differs from the one the plan was built from"):
        Engine.from_plan(bundle / "edited")


def test_a_truncated_file_is_refused(bundle, monkeypatch):
    monkeypatch.chdir(bundle)
    dst = bundle / "truncated"
    shutil.copytree(bundle / "bundle", dst, dirs_exist_ok=True)
    data = (dst / GRAPHS_FILE).read_bytes()
    (dst / GRAPHS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(GraphFormatError, match="not a valid graphs file"):
        Engine.from_plan(dst)


def test_weights_fill_the_planned_weight_arena(bundle, monkeypatch):
    """One weight arena of exactly the plan's bytes; every weight and the rope table at its planned offset."""
    from slabserve.runtime.plan import read_plan

    monkeypatch.chdir(bundle)
    engine, plan = Engine.from_plan(bundle / "bundle"), read_plan(bundle / "bundle")
    arena = engine.step_fn.weight_arena
    assert arena.numel() == plan.weights.arena_bytes == plan.totals.weights_bytes
    buffers = dict(engine.step_fn.named_buffers())
    assert len(buffers) == len(plan.weights.entries)
    for entry in plan.weights.entries:
        tensor = engine.step_fn.rope_cos_sin if entry.name == "rope_cos_sin" else engine.step_fn.weight(entry.name)
        assert tensor.data_ptr() == arena.data_ptr() + entry.offset, entry.name
        assert tuple(tensor.shape) == tuple(entry.shape) and tensor.nbytes == entry.nbytes


def test_a_native_plan_is_refused_where_the_kernel_cannot_run(bundle, monkeypatch):
    """The plan chose the native CPU matmul (auto, on this machine); a machine without it gets told what to do."""
    monkeypatch.chdir(bundle)
    if read_plan(bundle / "bundle").engine.gemm != "native":
        pytest.skip(f"the plan uses aten here: {cpu_native.unavailable_reason()}")
    monkeypatch.setattr(cpu_native, "_state", {"error": "no C compiler found (test)"})
    with pytest.raises(PlanMismatchError, match=r"native CPU kernel .* cannot run here: no C compiler found \(test\); "
                                                r"rebuild the plan on this machine"):
        Engine.from_plan(bundle / "bundle")


def test_a_plan_with_another_weight_layout_is_refused(bundle, monkeypatch):
    """Two same-sized weights swapped in the plan: a consistent plan, but not the layout this runtime fills."""
    monkeypatch.chdir(bundle)
    src, dst = bundle / "bundle", bundle / "swapped"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    data = msgpack.unpackb((src / "plan.msgpack").read_bytes(), raw=False)
    entries = data["weights"]["entries"]
    a = next(i for i, e in enumerate(entries) if e["name"] == "0.attn_norm")
    b = next(i for i, e in enumerate(entries) if e["name"] == "0.ffn_norm")
    entries[a]["name"], entries[b]["name"] = entries[b]["name"], entries[a]["name"]
    (dst / "plan.msgpack").write_bytes(msgpack.packb(data, use_bin_type=True))
    with pytest.raises(PlanMismatchError, match="weight arena differs from this runtime's layout at .*0.attn_norm"):
        Engine.from_plan(dst)
