"""The planned executor: same logits as the eager step at buckets sharing one arena; bad plans and nodes refused."""
from __future__ import annotations

import pytest
import torch

from _models import make_hf_model
from slabserve.compiler.memplan import TensorSpec, plan_shared
from slabserve.runtime.executor import ActivationPlan, PlannedExecutor, PlanViolationError, out_overload
from slabserve.runtime.loader import open_model
from slabserve.runtime.model import build_step
from slabserve.runtime.step import SeqChunk, StepInputs
from slabserve.runtime.trace import activation_tensors, export_step, graph_fingerprint, meta_step

BUCKETS, MAX_SEQS, KV_ROWS = (1, 4, 8), 3, 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    source = open_model(make_hf_model(tmp_path_factory.mktemp("llama"), "llama"))
    step = build_step(source, torch.float32, rope_positions=KV_ROWS)
    programs = {b: export_step(step, b, MAX_SEQS, KV_ROWS) for b in BUCKETS}
    return source.config, step, programs


def compiler_plan(programs) -> ActivationPlan:
    graphs = {str(b): [TensorSpec(t.name, t.nbytes, t.first_use, t.last_use) for t in activation_tensors(ep)]
              for b, ep in programs.items()}
    shared = plan_shared(graphs)
    return ActivationPlan(shared.arena_size, {int(b): p.offsets for b, p in shared.placements.items()})


def caches(config):
    k = torch.zeros(config.num_layers, KV_ROWS, config.num_kv_heads, config.head_dim)  # (L, N, Hkv, D)
    return k, torch.zeros_like(k)


def test_planned_executor_equals_eager_step(tiny):
    config, step, programs = tiny
    plan = compiler_plan(programs)
    naive = sum(t.nbytes for ep in programs.values() for t in activation_tensors(ep))
    assert plan.arena_bytes < naive  # buckets share the arena and tensors reuse bytes
    executor = PlannedExecutor.allocate(programs, plan)
    k, v = caches(config)
    k_ref, v_ref = caches(config)
    inputs = {b: StepInputs(b, MAX_SEQS) for b in BUCKETS}
    # a prefill of two prompts, a mixed step, then decodes: each bucket at least once, the arena reused across them
    steps = [(8, [SeqChunk(0, 0, [5, 9, 11, 3, 7]), SeqChunk(32, 0, [1, 2])]),
             (4, [SeqChunk(0, 5, [42]), SeqChunk(32, 2, [8, 9]), SeqChunk(64, 0, [17])]),
             (1, [SeqChunk(32, 4, [100])]),
             (4, [SeqChunk(0, 6, [43]), SeqChunk(32, 5, [101]), SeqChunk(64, 1, [18])])]
    for bucket, chunks in steps:
        inputs[bucket].fill(chunks)
        with torch.no_grad():
            want = step(**inputs[bucket].tensors(), k_cache=k_ref, v_cache=v_ref)
        got = executor.run(bucket, inputs[bucket].tensors(), k, v)
        assert got.untyped_storage().data_ptr() == executor.arena.untyped_storage().data_ptr()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_overlapping_or_out_of_arena_offsets_are_refused(tiny):
    config, step, programs = tiny
    plan = compiler_plan(programs)
    tensors = {t.name: t for t in activation_tensors(programs[4])}
    a, b = "matmul", "empty"  # qkv and the attention output: alive together (attention reads q from qkv)
    assert tensors[a].first_use <= tensors[b].last_use and tensors[b].first_use <= tensors[a].last_use
    overlapping = {**plan.offsets, 4: {**plan.offsets[4], b: plan.offsets[4][a]}}
    with pytest.raises(PlanViolationError, match="bucket 4: tensors .*share bytes while both are alive"):
        PlannedExecutor.allocate(programs, ActivationPlan(plan.arena_bytes, overlapping))
    outside = {**plan.offsets, 1: {**plan.offsets[1], "matmul": plan.arena_bytes - 8}}
    with pytest.raises(PlanViolationError, match="bucket 1: tensor 'matmul' .* outside the activation arena"):
        PlannedExecutor.allocate(programs, ActivationPlan(plan.arena_bytes, outside))
    missing = {**plan.offsets, 8: {n: o for n, o in plan.offsets[8].items() if n != "add"}}
    with pytest.raises(PlanViolationError, match=r"bucket 8: no planned offset for \['add'\]"):
        PlannedExecutor.allocate(programs, ActivationPlan(plan.arena_bytes, missing))
    with pytest.raises(PlanViolationError, match=r"no layout for buckets \[8\]"):
        PlannedExecutor.allocate(programs, ActivationPlan(plan.arena_bytes, {1: plan.offsets[1], 4: plan.offsets[4]}))


def test_node_without_out_overload_is_refused_by_name(tiny):
    config, step, _ = tiny
    ep = export_step(step, 1, MAX_SEQS, KV_ROWS)
    plan = compiler_plan({1: ep})
    assert out_overload(torch.ops.aten.dropout.default) is None
    node = next(n for n in ep.graph.nodes if n.name == "add")
    node.target, node.args = torch.ops.aten.dropout.default, (node.args[0], 0.0, False)
    with pytest.raises(PlanViolationError, match=r"node 'add' \(aten.dropout.default\) has no .out overload"):
        PlannedExecutor.allocate({1: ep}, plan)


def test_trace_is_stable_and_runs_on_meta_weights(tiny):
    config, step, programs = tiny
    again = export_step(step, 4, MAX_SEQS, KV_ROWS)
    assert graph_fingerprint(again) == graph_fingerprint(programs[4])
    assert graph_fingerprint(programs[4]) != graph_fingerprint(programs[8])
    meta = export_step(meta_step(config, torch.float32, rope_positions=KV_ROWS), 4, MAX_SEQS, KV_ROWS)
    logits = activation_tensors(meta)[-1]
    assert (logits.shape, logits.last_use) == ((MAX_SEQS, config.vocab_size), len(meta.graph.nodes) - 1)
    assert graph_fingerprint(meta) == graph_fingerprint(
        export_step(meta_step(config, torch.float32, rope_positions=KV_ROWS), 4, MAX_SEQS, KV_ROWS))


def test_weight_layout_shapes_are_what_pack_weights_makes(tiny):
    """The weight arena's layout is computed from shapes alone; it must name pack_weights' tensors in its order."""
    from slabserve.runtime.model import packed_shapes

    config, step, _ = tiny
    slots = [(s.name, s.shape) for s in step.weight_slots if s.name != "rope_cos_sin"]
    assert slots == list(packed_shapes(config).items())
    buffers = [(n.removeprefix("w_"), tuple(b.shape)) for n, b in step.named_buffers() if n != "rope_cos_sin"]
    assert [shape for _, shape in buffers] == [shape for _, shape in slots]
