"""tools/gpu_check.py, the script the GPU session runs, dry-run on CPU at tiny shapes: every phase's plumbing (plan
builds, engines, the helpers that count allocations and time decode, greedy parity against transformers, real
servers driven over gRPC, the JSON report and the verdict) works before device time is spent on it."""
from __future__ import annotations

import json

from slabserve.tools import gpu_check


def test_gpu_check_runs_every_phase_on_cpu(tmp_path, capsys):
    gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                    "--phases", "env,bandwidth,kernels,smollm2,llama8b,served,tp_capture"])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    phases = report["phases"]
    assert {name: p["status"] for name, p in phases.items()} == dict.fromkeys(
        ("env", "bandwidth", "kernels", "smollm2", "llama8b", "served", "tp_capture"), "ok"), phases
    for model in ("smollm2", "llama8b"):
        assert phases[model]["steady"]["allocations"] == 0
        assert set(phases[model]["decode"]) == {"1", "8", "64"}
        assert all(d["tokens"] == d["batch"] * d["steps"] for d in phases[model]["decode"].values())
        for streams in ("1", "8", "64"):
            assert phases["served"][model][streams]["decode_tok_s"] > 0
    assert len(phases["smollm2"]["parity"]) == 2 and phases["smollm2"]["parity_ok"]
    assert phases["llama8b"]["hbm_limit_b1_tok_s"] > 0 and (tmp_path / "out" / "server-llama8b.log").is_file()
    assert "llama8b: allocations after warm-up" in report["verdict"]
    tp = phases["tp_capture"]  # tensor parallelism's one-GPU check: a degree-2 slice in a one-rank group
    assert tp["collective_nodes"] == 4 and tp["replay_equals_eager"]
    assert report["verdict"]["tp_capture: collectives in the step, replay = eager"]["pass"]
    assert "PASS  smollm2: allocations after warm-up: 0" in capsys.readouterr().out
