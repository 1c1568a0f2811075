"""`slabserve plan inspect | diff | verify` and the dispatch of `serve` / `generate`, on tiny config-only plans."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import yaml

from slabserve.compiler.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_SPEC = ROOT / "tests" / "golden" / "tiny-llama.yaml"


def _build(folder: Path, **changes) -> Path:
    data = yaml.safe_load(TINY_SPEC.read_text())
    data["model"]["path"] = str(ROOT / data["model"]["path"])
    data.update(changes)
    spec = folder / f"{folder.name}.yaml"
    spec.write_text(yaml.safe_dump(data))
    assert main(["build-plan", str(spec), "--out", str(folder / "bundle")]) == 0
    return folder / "bundle"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tools")
    (base / "a").mkdir()
    (base / "b").mkdir()
    # b: half the sequences, so half the admitted concurrency: a capacity regression
    return {"a": _build(base / "a"), "b": _build(base / "b", max_seqs=2, step_tokens=8)}


def test_inspect(bundles, capsys):
    assert main(["plan", "inspect", str(bundles["a"])]) == 0
    out = capsys.readouterr().out
    for text in ("plan tiny-llama  id ", "weights (packed + rope table)", "KV arena", "slab class", "capacity:",
                 "baseline max_context slots", "fingerprints:", "NOT servable", "bucket"):
        assert text in out, text


def test_diff_same_plan_is_clean(bundles, capsys):
    assert main(["plan", "diff", str(bundles["a"]), str(bundles["a"])]) == 0
    assert "no regression" in capsys.readouterr().out


def test_diff_flags_a_capacity_regression(bundles, capsys):
    assert main(["plan", "diff", str(bundles["a"]), str(bundles["b"]), "--max-regression", "5"]) == 1
    out = capsys.readouterr().out
    assert "concurrency" in out and "REGRESSION" in out and "-50.0%" in out
    # the same change under a generous threshold passes
    assert main(["plan", "diff", str(bundles["a"]), str(bundles["b"]), "--max-regression", "60"]) == 0
    capsys.readouterr()
    # the other way round doubles the concurrency but also the sampler's (S, V) buffers: a memory regression
    assert main(["plan", "diff", str(bundles["b"]), str(bundles["a"])]) == 1
    out = capsys.readouterr().out
    assert "REGRESSED: staging" in out and "concurrency" not in out.split("REGRESSED:")[1]


def test_verify_against_targets(bundles, capsys):
    assert main(["plan", "verify", str(bundles["a"]), "--target", "plan"]) == 0
    assert "fits its own target" in capsys.readouterr().out
    assert main(["plan", "verify", str(bundles["a"]), "--target", "L4-24GB"]) == 0
    assert "fits L4-24GB" in capsys.readouterr().out
    assert main(["plan", "verify", str(bundles["a"]), "--target", "cpu:1250KiB", "--reserve", "0B"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "consumers, largest first" in out and "fewer" in out


@pytest.mark.parametrize("argv, message", [
    (["--target", "H100-40GB"], "not a known target"),
    (["--target", "cpu:8gb"], "unit"),
    (["--target", "plan", "--reserve", "lots"], "--reserve"),
])
def test_verify_bad_arguments(bundles, capsys, argv, message):
    assert main(["plan", "verify", str(bundles["a"]), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_and_generate_dispatch(monkeypatch):
    seen = {}
    for name in ("slabserve.runtime.server", "slabserve.runtime.client"):
        module = types.ModuleType(name)
        module.main = lambda argv, name=name: seen.setdefault(name, list(argv)) and 0
        monkeypatch.setitem(sys.modules, name, module)
    assert main(["serve", "build/smollm2", "--port", "0"]) == 0
    assert main(["generate", "--prompt", "hi"]) == 0
    assert seen == {"slabserve.runtime.server": ["build/smollm2", "--port", "0"],
                    "slabserve.runtime.client": ["generate", "--prompt", "hi"]}  # the client parses both commands
    seen.clear()
    assert main(["health", "--wait", "5"]) == 0
    assert seen == {"slabserve.runtime.client": ["health", "--wait", "5"]}


@pytest.mark.parametrize("command", ["generate", "health"])
def test_a_client_command_s_help_is_its_own(capsys, command):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"usage: slabserve {command} ") and "--addr" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("build-plan", "serve", "generate", "health"))


def test_missing_runtime_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "slabserve.runtime.server", None)  # import raises ModuleNotFoundError
    assert main(["serve"]) == 2
    assert "needs slabserve.runtime.server" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "build-plan" in capsys.readouterr().err
