"""tools/bench_decode.py's own arithmetic on a tiny random model: repeats in turns, the best of them reported with
every run kept, and repeated prefills that prefix reuse cannot shorten."""
from __future__ import annotations

import json

import pytest

from _models import make_served_tiny_model
from slabserve.runtime.engine import Engine, EngineConfig
from slabserve.runtime.slab_allocator import SlabClass
from slabserve.tools import bench_decode


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # the benchmark's prompts use ids up to 1009
    return make_served_tiny_model(tmp_path_factory.mktemp("tiny"), vocab_size=1024)


def test_a_repeated_prefill_reuses_nothing_of_the_earlier_ones(folder):
    engine = Engine(EngineConfig(str(folder), (SlabClass(128, 4),), max_seqs=4, step_tokens=32, buckets=(8, 32)))
    if engine.prefix_reuse_off is not None:
        pytest.skip(f"prefix reuse is off here: {engine.prefix_reuse_off}")
    bench_decode.bench_prefill(engine, 100, salt=0)
    assert engine.scheduler.expected_cached(bench_decode.prefill_prompt(100, 0)) > 0  # the same prompt would reuse
    for salt in range(1, 142):
        assert engine.scheduler.expected_cached(bench_decode.prefill_prompt(100, salt)) == 0, salt
        assert engine.scheduler.expected_cached(bench_decode.prefill_prompt(100, salt, warm=True)) == 0, salt
    assert engine.scheduler.load().free_per_class == (4,)


def test_every_figure_is_the_best_of_its_repeats(folder, tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert bench_decode.main(["--model", str(folder), "--repeats", "2", "--batches", "1", "2", "--steps", "2",
                              "--prompt", "8", "--prefill", "40", "--weights", "float", "--skip-transformers",
                              "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["repeats"] == 2
    entry = report["formats"]["float"]
    assert [r["batch"] for r in entry["rows"]] == [1, 2]
    for row in entry["rows"]:
        assert len(row["samples"]) == 2 and row["slabserve_tok_s"] == max(row["samples"]) > 0
    assert len(entry["prefill_samples"]) == 2 and entry["prefill_tok_s"] == max(entry["prefill_samples"])
    assert "best of 2 runs" in capsys.readouterr().out


def test_repeats_out_of_range_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_decode.main(["--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats: 0 is not allowed; expected an integer from 1 to 142" in capsys.readouterr().err
