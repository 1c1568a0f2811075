"""The plan bundle on disk: `plan.msgpack` (canonical), `plan.yaml` (the same plan for people), `step.onnx`, and
for servable CPU plans `graphs.msgpack` (every bucket's traced step, which the server loads instead of tracing).

Contract: `write_bundle(built, out_dir)` writes the files and returns the plan id (sha256 of plan.msgpack).
Each file is written to a temporary name and renamed, so a bundle directory never holds a half-written plan. The
same plan gives the same bytes in every file; nothing of the build machine (time, paths of temporary files) is
recorded. No weights are ever written: step.onnx takes them as graph inputs.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from slabserve.compiler.build import Built
from slabserve.compiler.onnx_export import step_to_onnx
from slabserve.runtime import plan as P
from slabserve.runtime.graph_io import GRAPHS_FILE, programs_to_bytes

YAML_FILE = "plan.yaml"
ONNX_FILE = "step.onnx"
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def write_bundle(built: Built, out_dir: str | Path) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = P.encode_plan(built.plan)
    plan_id = P.plan_id(data)
    _write(out / P.PLAN_FILE, data)
    _write(out / YAML_FILE, plan_yaml(built.plan, plan_id).encode("utf-8"))
    model = step_to_onnx(built.onnx_bucket.program, graph_name=f"{built.plan.name}_T{built.onnx_bucket.tokens}")
    _write(out / ONNX_FILE, model.SerializeToString())
    graphs = out / GRAPHS_FILE
    if built.plan.servable and built.plan.engine.device == "cpu" and built.traced:
        # The server rebuilds its executor from these instead of tracing every bucket again (seconds at start-up);
        # it checks each against the plan's graph fingerprint. CUDA plans are traced on meta: the server traces.
        _write(graphs, programs_to_bytes({b.tokens: b.program for b in built.traced}))
    elif graphs.exists():
        graphs.unlink()
    return plan_id


def plan_yaml(plan: P.Plan, plan_id: str) -> str:
    header = (f"# slabserve plan {plan.name}, id {plan_id} (sha256 of plan.msgpack, the canonical file).\n"
              f"# Written by build-plan for people to read; the server reads plan.msgpack only.\n"
              f"# step.onnx is the traced step at T={plan.activations.buckets[0].tokens} tokens.\n")
    body = yaml.dump(P.plan_to_data(plan), Dumper=_Dumper, sort_keys=True, default_flow_style=None, width=120)
    return header + body


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
