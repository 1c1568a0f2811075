"""The load tools (tools/loadgen.py, tools/soak.py): loopback only, open loop, what a run writes, the soak's
judgment and the sweep's capacity, against a real server on a tiny random-weight model, a fake server where a test
is about the client, and synthetic records where it is about the arithmetic. No assertion on speed."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from _models import make_served_tiny_model
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.engine import Engine, EngineConfig
from slabserve.runtime.server import create_server
from slabserve.runtime.slab_allocator import SlabClass
from slabserve.tools import loadgen, soak
from slabserve.tools._driver import DriveOptions, Target, run_schedule
from slabserve.tools._stats import percentile, summarize
from slabserve.tools._sweep import SweepPlan, step_figures, sweep
from slabserve.tools._target import TargetError, loopback_target
from slabserve.tools._workload import (Arrival, WorkloadError, largest_of_each_class, load_trace, mix_from_dict,
                                       poisson_schedule)

MiB = 1 << 20
TINY_MIX = {"name": "tiny", "classes": [
    {"name": "completion", "share": 0.7, "prompt": [8, 40], "output": [2, 8]},
    {"name": "analysis", "share": 0.3, "prompt": [100, 180], "output": [4, 12]},
]}


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    folder = make_served_tiny_model(tmp_path_factory.mktemp("loadgen") / "tiny")
    engine = Engine(EngineConfig(str(folder), (SlabClass(64, 8), SlabClass(256, 4)), max_seqs=8, step_tokens=32,
                                 buckets=(1, 8, 32), queue_limit=8))
    server = create_server(engine, "127.0.0.1", 0)
    server.start()
    server.warm_up()
    yield server
    server.stop()


@pytest.fixture
def mix_file(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text(json.dumps(TINY_MIX))  # JSON is YAML
    return path


# ---- loopback only ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("addr", ["127.0.0.1:50051", "127.8.9.10:1", "localhost:50051", "[::1]:50051"])
def test_loopback_targets_are_accepted(addr):
    assert loopback_target(addr)[1] == int(addr.rsplit(":", 1)[1])


@pytest.mark.parametrize("addr", ["10.0.0.5:50051", "192.168.1.2:50051", "8.8.8.8:443", "0.0.0.0:50051",
                                  "example.com:50051", "[2001:db8::1]:50051", "127.0.0.1", "127.0.0.1:0"])
def test_other_targets_are_refused(addr):
    with pytest.raises(TargetError):
        loopback_target(addr)


def test_the_clis_refuse_a_remote_target_before_opening_any_channel(tmp_path, capsys, monkeypatch):
    def no_channel(*args, **kwargs):
        raise AssertionError(f"a channel was opened to {args}")
    monkeypatch.setattr(grpc, "insecure_channel", no_channel)
    monkeypatch.setattr(grpc.aio, "insecure_channel", no_channel)
    code = loadgen.main(["run", "--addr", "10.1.2.3:50051", "--rate", "5", "--duration", "1",
                         "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    assert "refusing a non-loopback target" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert loadgen.main(["sweep", "--addr", "example.com:50051", "--start", "1", "--ttft-bound", "1"]) == 2
    assert soak.main(["--addr", "192.168.0.9:50051", "--capacity", "1", "--out", str(tmp_path / "s")]) == 2
    assert "refusing a non-loopback target" in capsys.readouterr().err


# ---- a run against a real server ------------------------------------------------------------------------------------

def test_a_short_run_writes_records_percentiles_samples_and_plots(tiny_server, mix_file, tmp_path):
    out = tmp_path / "run"
    code = loadgen.main(["run", "--addr", tiny_server.address, "--rate", "15", "--duration", "2", "--mix",
                         str(mix_file), "--out", str(out), "--no-progress", "--sample-interval", "0.2"])
    assert code == 0
    doc = json.loads((out / "loadgen.json").read_text())
    expected = poisson_schedule(mix_from_dict(TINY_MIX), 15, 0, duration_s=2)
    records = doc["records"]
    assert [(r["class"], r["prompt_tokens"], r["max_tokens"]) for r in records] == \
        [(a.class_name, a.prompt_tokens, a.output_tokens) for a in expected]
    ok = [r for r in records if r["status"] == "OK"]
    assert ok and all(r["completion_tokens"] == r["max_tokens"] for r in ok)  # EOS ignored: lengths as drawn
    assert all(r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"] and r["server_ttft_s"] is not None
               for r in ok)
    overall = doc["summary"]["overall"]
    assert overall["requests"] == len(records) and sum(overall["status"].values()) == len(records)
    for key in ("ttft_s", "tpot_s", "e2e_s", "server_queue_s"):
        d = overall[key]
        assert d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert set(doc["summary"]["classes"]) == {r["class"] for r in records}
    assert doc["meta"]["server_pid"] == __import__("os").getpid()  # found by its listening port
    assert doc["samples"]["server_rss"] and doc["samples"]["load"]
    assert doc["samples"]["load"][-1]["classes"][0]["total_slabs"] == 8
    assert "Poisson 15 req/s" in doc["meta"]["title"] and "mix tiny" in doc["meta"]["title"]
    for name in ("latency_cdf.png", "latency_over_time.png", "server_memory.png", "slab_occupancy.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert sorted(doc["plots"]) == sorted(p.name for p in out.glob("*.png"))


def test_a_trace_drives_the_arrivals(tiny_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"offset_s": 0.0, "class": "a", "prompt_tokens": 20, "output_tokens": 3}\n'
                     '{"offset_s": 0.3, "class": "b", "prompt_tokens": 150, "output_tokens": 5}\n'
                     '{"offset_s": 0.1, "class": "a", "prompt_tokens": 9, "output_tokens": 2}\n')
    out = tmp_path / "trace-run"
    assert loadgen.main(["run", "--addr", tiny_server.address, "--trace", str(trace), "--out", str(out),
                         "--no-progress", "--no-plots"]) == 0
    doc = json.loads((out / "loadgen.json").read_text())
    assert [(r["class"], r["scheduled_s"], r["prompt_tokens"], r["max_tokens"]) for r in doc["records"]] == \
        [("a", 0.0, 20, 3), ("a", 0.1, 9, 2), ("b", 0.3, 150, 5)]
    assert "trace trace.jsonl" in doc["meta"]["title"] and not list(out.glob("*.png"))


def test_a_mix_the_server_cannot_hold_is_refused_with_the_limit(tiny_server, tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text(json.dumps({"name": "big", "classes": [{"name": "huge", "share": 1, "prompt": [300, 400],
                                                           "output": [10, 20]}]}))
    code = loadgen.main(["run", "--addr", tiny_server.address, "--rate", "5", "--requests", "3", "--mix", str(big),
                         "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    assert "largest slab (256 tokens)" in capsys.readouterr().err


def test_soak_attached_to_a_server_writes_its_verdict(tiny_server, mix_file, tmp_path, capsys):
    out = tmp_path / "soak"
    code = soak.main(["--addr", tiny_server.address, "--capacity", "10", "--duration", "2", "--lead-in", "0.5",
                      "--warmup", "1", "--settle", "0.2", "--mix", str(mix_file), "--out", str(out),
                      "--no-progress", "--no-plots"])
    report = json.loads((out / "soak.json").read_text())
    assert code == (0 if report["passed"] else 1)
    names = [c["name"] for c in report["criteria"]]
    assert names == ["server memory growth", "P99 TTFT, last tenth vs first", "P99 TPOT, last tenth vs first",
                     "errors other than RESOURCE_EXHAUSTED", "every slab free after the run"]
    by_name = {c["name"]: c for c in report["criteria"]}
    assert by_name["errors other than RESOURCE_EXHAUSTED"]["passed"]
    assert by_name["every slab free after the run"]["passed"]  # the server frees every slab it lent
    assert report["meta"]["rate_rps"] == pytest.approx(7.0)
    assert report["memory"]["baseline_idle_bytes"] > 0
    assert "verdict:" in capsys.readouterr().out


def test_soak_reports_a_server_that_refuses_to_start(tmp_path, capsys):
    code = soak.main([str(tmp_path / "no-such-bundle"), "--capacity", "1", "--out", str(tmp_path / "s"),
                      "--start-timeout", "120"])
    assert code == 2
    assert "exited with" in capsys.readouterr().err


# ---- open loop, against a fake server -----------------------------------------------------------------------------

class _BarrierServicer(pb_grpc.SlabServeServicer):
    """Holds every Generate call until `expected` calls have arrived, then answers each with 3 tokens: a load
    generator that waited for an answer before sending the next request would never get one."""

    def __init__(self, expected: int):
        self.expected = expected
        self.arrived = 0
        self.lock = threading.Lock()
        self.all_in = threading.Event()

    def Generate(self, request, context):
        if request.stopping.max_tokens == 999:  # never finishes: the drain timeout must cancel it
            while context.is_active():
                time.sleep(0.05)
            return
        with self.lock:
            self.arrived += 1
            if self.arrived == self.expected:
                self.all_in.set()
        if not self.all_in.wait(timeout=20):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the other requests never came")
        for _ in range(3):  # every token in a token event (proto 0.2.0)
            yield pb.GenerateResponse(token=pb.TokenOutput(token_ids=[7], text="x"))
        yield pb.GenerateResponse(finished=pb.GenerationFinished(
            reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=len(request.token_ids.ids),
                                                           completion_tokens=3),
            timings=pb.Timings(queue_seconds=0.0, time_to_first_token_seconds=0.01,
                               time_per_output_token_seconds=0.001)))

    def GetLoad(self, request, context):
        return pb.GetLoadResponse(classes=[pb.ClassLoad(index=0, tokens=64, free_slabs=4, total_slabs=4)])


def _fake_server(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_SlabServeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_arrivals_follow_the_schedule_whatever_the_latency():
    arrivals = [Arrival(0.05 * i, "completion", 8, 3) for i in range(24)]
    server, addr = _fake_server(_BarrierServicer(expected=len(arrivals)))
    try:
        result = run_schedule(Target(addr, 100, None), arrivals, 1.2,
                              DriveOptions(drain_timeout_s=30, sample_interval_s=0.1, progress=False))
    finally:
        server.stop(0)
    records = result.records
    assert [r["status"] for r in records] == ["OK"] * len(arrivals)  # every call was sent before any finished
    last_sent = max(r["sent_s"] for r in records)
    assert all(r["end_s"] >= last_sent for r in records)
    lags = [r["sent_s"] - r["scheduled_s"] for r in records]
    assert min(lags) >= 0 and max(lags) < 0.5  # loose: shared cores; a closed loop would never finish at all
    assert all(r["completion_tokens"] == 3 and r["tpot_s"] is not None for r in records)
    assert result.load_samples and summarize(records, 1.2)["schedule_lag_s"]["n"] == len(arrivals)


def test_calls_past_the_drain_timeout_are_cancelled_and_counted():
    arrivals = [Arrival(0.0, "completion", 8, 3), Arrival(0.01, "stuck", 8, 999)]
    server, addr = _fake_server(_BarrierServicer(expected=1))
    try:
        result = run_schedule(Target(addr, 100, None), arrivals, 0.01,
                              DriveOptions(drain_timeout_s=0.5, sample_interval_s=0.1, progress=False))
    finally:
        server.stop(0)
    ok, stuck = result.records
    assert ok["status"] == "OK" and not ok["drain_cancelled"]
    assert stuck["status"] == "CANCELLED" and stuck["drain_cancelled"]
    assert summarize(result.records, 0.01)["overall"]["drain_cancelled"] == 1
    assert soak.judge_errors(result.records).passed is False


# ---- workloads ----------------------------------------------------------------------------------------------------

def test_mix_files_are_validated_with_the_key_named():
    with pytest.raises(WorkloadError, match="unknown key 'weight'"):
        mix_from_dict({"classes": [{"name": "a", "weight": 1, "share": 1, "prompt": [1, 2], "output": [1, 2]}]})
    with pytest.raises(WorkloadError, match=r"prompt: \[5, 2\] is not allowed"):
        mix_from_dict({"classes": [{"name": "a", "share": 1, "prompt": [5, 2], "output": [1, 2]}]})
    with pytest.raises(WorkloadError, match="share"):
        mix_from_dict({"classes": [{"name": "a", "share": 0, "prompt": [1, 2], "output": [1, 2]}]})
    mix = mix_from_dict({"name": "m", "classes": [{"name": "a", "share": 3, "prompt": [1, 2], "output": [1, 2]},
                                                  {"name": "b", "share": 1, "prompt": [1, 2], "output": [1, 2]}]})
    assert [c.share for c in mix.classes] == [0.75, 0.25]


def test_poisson_schedules_are_seeded_and_have_the_rate():
    mix = mix_from_dict(TINY_MIX)
    a = poisson_schedule(mix, 50, 7, duration_s=200)
    assert a == poisson_schedule(mix, 50, 7, duration_s=200)
    assert 9_000 < len(a) < 11_000 and all(x.offset_s < y.offset_s for x, y in zip(a, a[1:]))
    share = sum(x.class_name == "completion" for x in a) / len(a)
    assert 0.65 < share < 0.75
    assert all(8 <= x.prompt_tokens <= 40 and 2 <= x.output_tokens <= 8 for x in a if x.class_name == "completion")
    assert len(poisson_schedule(mix, 50, 7, num_requests=123)) == 123


def test_a_soak_warm_up_opens_with_the_largest_request_of_each_class():
    got = largest_of_each_class(mix_from_dict(TINY_MIX), gap_s=0.5)
    assert got == (Arrival(0.0, "analysis", 180, 12), Arrival(0.5, "completion", 40, 8))


def test_traces_are_read_from_csv_and_json_lines(tmp_path):
    mix = mix_from_dict(TINY_MIX)
    csv_file = tmp_path / "t.csv"
    csv_file.write_text("offset_s,class,prompt_tokens,output_tokens\n1.5,completion,,\n0.5,analysis,120,\n"
                        "2.0,other,10,5\n")
    got = load_trace(csv_file, mix, seed=0)
    assert [(a.offset_s, a.class_name) for a in got] == [(0.5, "analysis"), (1.5, "completion"), (2.0, "other")]
    assert got[0].prompt_tokens == 120 and 4 <= got[0].output_tokens <= 12 and got[2].output_tokens == 5
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"offset_s": 0.25, "class": "completion"}\n')
    assert load_trace(jsonl, mix, seed=0)[0].offset_s == 0.25
    bad = tmp_path / "bad.csv"
    bad.write_text("offset_s,class\n1,nope\n")
    with pytest.raises(WorkloadError, match="'nope' is not in mix"):
        load_trace(bad, mix, seed=0)


# ---- the soak's judgment on synthetic data ------------------------------------------------------------------------

def _rec(sent_s: float, status: str = "OK", ttft: float | None = 0.1, tpot: float | None = 0.02,
         e2e: float = 1.0, **extra) -> dict:
    r = {"class": "completion", "status": status, "sent_s": sent_s, "scheduled_s": sent_s, "e2e_s": e2e,
         "ttft_s": ttft if status == "OK" else None, "tpot_s": tpot if status == "OK" else None,
         "completion_tokens": 10 if status == "OK" else 0, "drain_cancelled": False}
    r.update(extra)
    return r


def _steady(ttft_last: float = 0.1, tpot_last: float = 0.02) -> list[dict]:
    """100 s of one request a second from t=10 (after a 10 s lead-in); the last tenth gets the given figures."""
    return [_rec(10 + i, ttft=ttft_last if i >= 90 else 0.1, tpot=tpot_last if i >= 90 else 0.02)
            for i in range(100)]


FREE = {"running": 0, "queued": 0, "classes": [{"index": 0, "tokens": 64, "free_slabs": 8, "total_slabs": 8},
                                               {"index": 1, "tokens": 256, "free_slabs": 4, "total_slabs": 4}]}


def test_judge_memory():
    assert soak.judge_memory(500 * MiB, 500 * MiB + MiB // 2).passed
    assert soak.judge_memory(500 * MiB, 499 * MiB).passed
    assert not soak.judge_memory(500 * MiB, 500 * MiB + MiB).passed
    assert not soak.judge_memory(None, 500 * MiB).passed


def test_judge_drift():
    assert soak.judge_drift(_steady(ttft_last=0.119), 10, 100, "ttft_s", "TTFT").passed
    assert soak.judge_drift(_steady(ttft_last=0.05), 10, 100, "ttft_s", "TTFT").passed  # faster is fine
    assert not soak.judge_drift(_steady(ttft_last=0.13), 10, 100, "ttft_s", "TTFT").passed
    assert soak.judge_drift(_steady(tpot_last=0.0239), 10, 100, "tpot_s", "TPOT").passed
    assert not soak.judge_drift(_steady(tpot_last=0.025), 10, 100, "tpot_s", "TPOT").passed
    early_only = [r for r in _steady() if r["sent_s"] < 100]
    missing = soak.judge_drift(early_only, 10, 100, "ttft_s", "TTFT")
    assert not missing.passed and "0 in the last" in missing.note
    # requests of the lead-in are not judged, however slow
    assert soak.judge_drift([_rec(5, ttft=9.0)] + _steady(), 10, 100, "ttft_s", "TTFT").passed


def test_judge_errors():
    good = [_rec(1), _rec(2, "RESOURCE_EXHAUSTED", e2e=0.01)]
    assert soak.judge_errors(good).passed
    for status in ("DEADLINE_EXCEEDED", "INTERNAL", "UNAVAILABLE", "CANCELLED"):
        verdict = soak.judge_errors(good + [_rec(3, status)])
        assert not verdict.passed and status in verdict.measured


def test_judge_slabs_free():
    assert soak.judge_slabs_free(FREE).passed
    held = json.loads(json.dumps(FREE))
    held["classes"][1]["free_slabs"] = 3
    assert not soak.judge_slabs_free(held).passed
    assert not soak.judge_slabs_free(dict(FREE, queued=1)).passed
    assert not soak.judge_slabs_free(dict(FREE, running=2)).passed
    assert not soak.judge_slabs_free(None).passed


def test_judge_overload_figures():
    admitted = [_rec(i, ttft=0.1 + 0.001 * i) for i in range(100)]
    assert soak.judge_admitted_ttft(admitted, reference_s=0.1).passed        # P99 about 0.2 s = 2x 0.1
    assert not soak.judge_admitted_ttft(admitted, reference_s=0.09).passed
    assert not soak.judge_admitted_ttft(admitted, reference_s=None).passed
    fast = [_rec(i, "RESOURCE_EXHAUSTED", e2e=0.01) for i in range(100)]
    assert soak.judge_rejection_latency(fast).passed
    slow = fast[:90] + [_rec(i, "RESOURCE_EXHAUSTED", e2e=0.2) for i in range(10)]
    assert not soak.judge_rejection_latency(slow).passed
    assert soak.judge_rejection_latency(admitted).passed  # nothing rejected: nothing slow


def test_whole_verdicts():
    assert all(c.passed for c in soak.judge_soak(_steady(), 10, 100, 400 * MiB, 400 * MiB, FREE))
    verdicts = soak.judge_soak(_steady(ttft_last=0.5), 10, 100, 400 * MiB, 402 * MiB, FREE)
    assert [c.passed for c in verdicts] == [False, False, True, True, True]
    table = soak.verdict_table(verdicts)
    assert "FAIL" in table and table.endswith("verdict: FAIL")
    records = [_rec(i, ttft=0.15) for i in range(50)] + [_rec(i, "RESOURCE_EXHAUSTED", e2e=0.01) for i in range(50)]
    assert all(c.passed for c in soak.judge_overload(records, 0, 100, 0.1, 400 * MiB, 400 * MiB, FREE))


def test_the_soak_schedule_replays_its_first_tenth_at_the_end():
    mix = mix_from_dict(TINY_MIX)
    arrivals = soak.soak_schedule(mix, 2.0, 3, lead_in_s=20, duration_s=100)
    first = [a for a in arrivals if 20 <= a.offset_s < 30]
    last = [a for a in arrivals if 110 <= a.offset_s < 120]
    assert first and [(a.offset_s + 90, a.class_name, a.prompt_tokens, a.output_tokens) for a in first] == \
        [(pytest.approx(a.offset_s), a.class_name, a.prompt_tokens, a.output_tokens) for a in last]
    assert max(a.offset_s for a in arrivals) < 120


# ---- the sweep on synthetic steps ---------------------------------------------------------------------------------

def _fake_step(capacity: float, plan: SweepPlan, lucky: set[float] = frozenset()):
    """A server whose P99 TTFT is 0.1 s below `capacity` req/s and 10 s above it, rejecting a third above it."""
    calls = []

    def run_step(rate: float) -> dict:
        calls.append(rate)
        over = rate > capacity and rate not in lucky
        n = 100
        records = [_rec(i * 0.1, ttft=10.0 if over else 0.1) for i in range(n * 2 // 3 if over else n)]
        records += [_rec(i * 0.1, "RESOURCE_EXHAUSTED", e2e=0.004) for i in range(n - len(records))]
        load = [{"t_s": t, "queued": min(int(t), 16) if over else 0} for t in range(10)]
        return step_figures(rate, records, 10.0, load, plan)
    return run_step, calls


def test_the_sweep_finds_the_highest_rate_within_the_bound():
    plan = SweepPlan(start_rps=1.0, ttft_bound_s=1.0, factor=2.0, refine=0)
    run_step, calls = _fake_step(capacity=5.0, plan=plan)
    result = sweep(plan, run_step)
    assert calls == [1.0, 2.0, 4.0, 8.0, 16.0]  # two failures in a row end the climb
    assert result["capacity_rps"] == 4.0 and result["lowest_failing_rps"] == 8.0
    assert result["at_capacity"]["p99_ttft_s"] == pytest.approx(0.1)
    above = result["above_capacity"]
    assert above["steps"] == 2 and above["rejected"] == 2 * 34 and above["other_errors"] == 0
    assert above["slowest_rejection_s"] == pytest.approx(0.004)
    assert above["max_queue_slope_per_s"] > 0
    assert "RESOURCE_EXHAUSTED" in above["summary"]


def test_the_sweep_refines_between_the_last_pass_and_the_first_fail():
    plan = SweepPlan(start_rps=1.0, ttft_bound_s=1.0, factor=2.0, refine=3)
    run_step, calls = _fake_step(capacity=5.0, plan=plan)
    result = sweep(plan, run_step)
    assert calls[5:] == [6.0, 5.0, 5.5]
    assert result["capacity_rps"] == 5.0 and result["lowest_failing_rps"] == 5.5
    assert [s["rate"] for s in result["steps"]] == sorted(calls)


def test_a_lucky_step_above_a_failure_does_not_raise_the_capacity():
    plan = SweepPlan(start_rps=1.0, ttft_bound_s=1.0, increment_rps=1.0, past_bound=3, refine=0)
    run_step, _ = _fake_step(capacity=2.5, plan=plan, lucky={4.0})
    result = sweep(plan, run_step)
    assert result["capacity_rps"] == 2.0


def test_rejections_or_errors_fail_a_step_even_under_the_bound():
    plan = SweepPlan(start_rps=1.0, ttft_bound_s=1.0, factor=2.0, max_reject_fraction=0.01)
    fine = [_rec(i) for i in range(99)]
    assert step_figures(1.0, fine + [_rec(1, "RESOURCE_EXHAUSTED")], 10, [], plan)["passed"]
    assert not step_figures(1.0, fine + [_rec(1, "RESOURCE_EXHAUSTED")] * 2, 10, [], plan)["passed"]
    timed_out = step_figures(1.0, fine + [_rec(1, "DEADLINE_EXCEEDED")], 10, [], plan)
    assert not timed_out["passed"] and "DEADLINE_EXCEEDED" in timed_out["why"]


def test_the_ttft_bound_can_leave_long_classes_out():
    plan = SweepPlan(start_rps=1.0, ttft_bound_s=1.0, factor=2.0, ttft_classes=("completion",))
    records = [_rec(i) for i in range(90)] + [dict(_rec(i, ttft=30.0), **{"class": "analysis"}) for i in range(10)]
    step = step_figures(1.0, records, 10, [], plan)
    assert step["passed"] and step["p99_ttft_s"] == pytest.approx(0.1)
    assert step["p99_ttft_s_per_class"]["analysis"] == pytest.approx(30.0)
    assert not step_figures(1.0, records, 10, [], SweepPlan(1.0, 1.0, factor=2.0))["passed"]
    assert soak.judge_admitted_ttft(records, 0.1, classes=("completion",)).passed
    assert not soak.judge_admitted_ttft(records, 0.1).passed


def test_a_sweep_against_the_server_writes_its_json_plot_and_steps(tiny_server, mix_file, tmp_path):
    out = tmp_path / "sweep"
    code = loadgen.main(["sweep", "--addr", tiny_server.address, "--mix", str(mix_file), "--start", "5",
                         "--factor", "2", "--max-rate", "10", "--step-duration", "1", "--min-step-requests", "0",
                         "--ttft-bound", "60", "--max-reject-fraction", "1", "--refine", "0", "--out", str(out),
                         "--no-progress"])  # about the plumbing, not this server's speed: every step passes
    assert code == 0
    result = json.loads((out / "sweep.json").read_text())
    assert [s["rate"] for s in result["steps"]] == [5, 10]
    assert result["capacity_rps"] == 10 and not result["bound_crossed"]
    assert len(list((out / "steps").glob("step-*.json"))) == 2
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_plots_and_percentiles(tmp_path):
    from slabserve.tools._plots import plot_sweep
    plan = SweepPlan(start_rps=1.0, ttft_bound_s=1.0, factor=2.0, refine=1)
    result = sweep(plan, _fake_step(capacity=5.0, plan=plan)[0])
    result["meta"] = {"title": "synthetic sweep"}
    data = plot_sweep(result, tmp_path / "sweep.png").read_bytes()
    assert data[:4] == b"\x89PNG"
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


# ---- workload shapes: multi-turn chat and repeated contexts -------------------------------------------------------

CHAT_MIX = {"name": "tiny-chat", "shape": "chat-sessions", "think_s": 0.1, "turns": [2, 3], "classes": [
    {"name": "first-turn", "share": 0.4, "prompt": [20, 40], "output": [4, 8]},
    {"name": "next-turn", "share": 0.6, "prompt": [5, 10], "output": [4, 8]}]}
CONTEXT_MIX = {"name": "tiny-context", "shape": "repeated-context", "contexts": 2, "context_tokens": [60, 120],
               "classes": [{"name": "edit", "share": 1.0, "prompt": [5, 10], "output": [2, 6]}]}


def test_chat_sessions_resend_their_history_and_repeated_contexts_share_their_start():
    chat = poisson_schedule(mix_from_dict(CHAT_MIX), 4.0, 7, duration_s=30)
    sessions: dict[int, list[Arrival]] = {}
    for a in chat:
        sessions.setdefault(a.session, []).append(a)
    assert len(sessions) > 5 and all(2 <= len(t) <= 3 for t in sessions.values())
    for turns in sessions.values():
        turns.sort(key=lambda a: a.turn)
        assert [a.class_name for a in turns] == ["first-turn"] + ["next-turn"] * (len(turns) - 1)
        history = 0
        for a in turns:  # each prompt is every earlier message and answer, then its own message
            assert a.prompt_tokens == history + a.message_tokens
            history += a.message_tokens + a.output_tokens
    assert 3.0 < len(chat) / 30 < 5.5  # turns arrive at about the rate
    context = poisson_schedule(mix_from_dict(CONTEXT_MIX), 5.0, 7, duration_s=20)
    seeds = {a.context: (a.context_seed, a.context_tokens) for a in context}
    assert set(seeds) == {0, 1} and all(60 <= n <= 120 for _, n in seeds.values())
    assert all(seeds[a.context] == (a.context_seed, a.context_tokens) for a in context)
    assert all(5 <= a.prompt_tokens - a.context_tokens <= 10 for a in context)
    replayed = soak.soak_schedule(mix_from_dict(CHAT_MIX), 4.0, 7, lead_in_s=10, duration_s=50)
    by_session: dict[int, int] = {}
    for a in replayed:
        by_session[a.session] = by_session.get(a.session, 0) + (a.turn == 0)
    assert set(by_session.values()) == {1}  # replayed conversations are new ones


def _shaped_run(server, tmp_path, mix: dict, rate: float, seconds: float) -> dict:
    """loadgen run of the mix `mix` against `server`; its loadgen.json."""
    path = tmp_path / f"{mix['name']}.yaml"
    path.write_text(json.dumps(mix))
    out = tmp_path / mix["name"]
    assert loadgen.main(["run", "--addr", server.address, "--rate", str(rate), "--duration", str(seconds), "--mix",
                         str(path), "--out", str(out), "--no-progress", "--no-plots"]) == 0
    return json.loads((out / "loadgen.json").read_text())


def test_a_chat_sessions_run_sends_each_turn_after_the_last_answer_with_it(tiny_server, tmp_path):
    doc = _shaped_run(tiny_server, tmp_path, CHAT_MIX, 6, 3)
    arrivals = poisson_schedule(mix_from_dict(CHAT_MIX), 6, 0, duration_s=3)
    records = doc["records"]
    assert all(r["status"] == "OK" for r in records)
    by_turn = {(a.session, a.turn): r for a, r in zip(arrivals, records)}
    for (session, turn), r in by_turn.items():
        assert r["prompt_tokens"] == next(a for a in arrivals if (a.session, a.turn) == (session, turn)).prompt_tokens
        if turn:
            before = by_turn[(session, turn - 1)]
            assert r["sent_s"] >= before["end_s"] + 0.1 - 1e-3  # after the answer, and the think time
            assert r["cached_tokens"] >= before["prompt_tokens"] - 16  # the history came back from retained KV
    nxt = doc["summary"]["classes"]["next-turn"]
    assert nxt["cached_fraction"] > 0.5 and doc["meta"]["mix"]["shape"] == "chat-sessions"


def test_a_repeated_context_run_reuses_the_contexts(tiny_server, tmp_path):
    doc = _shaped_run(tiny_server, tmp_path, CONTEXT_MIX, 8, 2)
    assert all(r["status"] == "OK" for r in doc["records"])
    assert doc["summary"]["overall"]["cached_fraction"] > 0.5


def test_chat_sessions_need_the_grpc_api():
    arrivals = poisson_schedule(mix_from_dict(CHAT_MIX), 2, 0, duration_s=20)
    assert arrivals
    target = Target("127.0.0.1:1", 512, None, "http")
    info = pb.GetModelInfoResponse(max_request_tokens=4096)
    with pytest.raises(loadgen.LoadgenError, match="only the gRPC API returns"):
        loadgen.execute(target, info, arrivals, 2.0, DriveOptions(progress=False), {})


def test_bench_prefix_runs_both_bundles_in_turn_and_compares(tmp_path, capsys, monkeypatch):
    from _served_process import build_tiny_bundle
    from slabserve.tools import bench_prefix

    on = build_tiny_bundle(tmp_path / "on")
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "model").symlink_to(on / "model")
    off = build_tiny_bundle(tmp_path / "off", prefix_reuse=False)
    mix = tmp_path / "chat.yaml"
    mix.write_text(json.dumps(CHAT_MIX))
    out = tmp_path / "bench"
    monkeypatch.chdir(on)  # the plans name their model relative to the folder they were built in, as served
    assert bench_prefix.main([str(on / "bundle"), str(off / "bundle"), "--mix", str(mix), "--rate", "5",
                              "--duration", "3", "--out", str(out), "--drain-timeout", "30"]) == 0
    result = json.loads((out / "compare.json").read_text())
    rows = result["classes"]
    assert set(rows) == {"all", "first-turn", "next-turn"}
    assert rows["next-turn"]["cached_fraction_on"] > 0.5 and rows["first-turn"]["ok"][0] > 0
    assert rows["all"]["ok"][0] == rows["all"]["requests"][0] and rows["all"]["ok"][1] == rows["all"]["requests"][1]
    assert "next-turn" in capsys.readouterr().out


def test_repeated_contexts_are_the_workloads_own_whatever_the_run_seed():
    mix = mix_from_dict(CONTEXT_MIX)
    one, two = (poisson_schedule(mix, 5.0, seed, duration_s=20) for seed in (1, 2))
    assert {(a.context_seed, a.context_tokens) for a in one} == {(a.context_seed, a.context_tokens) for a in two}
    other = mix_from_dict(dict(CONTEXT_MIX, context_seed=9))
    assert {a.context_seed for a in poisson_schedule(other, 5.0, 1, duration_s=20)}.isdisjoint(
        {a.context_seed for a in one})


def test_bench_served_times_the_engine_and_the_served_streams_of_one_bundle(tmp_path, capsys, monkeypatch):
    from _served_process import build_tiny_bundle
    from slabserve.tools import bench_served

    root = build_tiny_bundle(tmp_path)
    monkeypatch.chdir(root)  # the plan names its model relative to the folder it was built in
    out = tmp_path / "served.json"
    assert bench_served.main(["bundle", "--streams", "1", "3", "--tokens", "12", "--prompt", "8", "--repeats", "1",
                              "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert 0 < report["ready_s"] < 300  # the server's start to SERVING, measured on the way
    assert [r["streams"] for r in rows] == [1, 3]
    for r in rows:
        assert r["engine_step_ms"] > 0 and r["served_ms_per_token"] > 0 and r["served_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["served_ms_per_token"] / r["engine_step_ms"])
    printed = capsys.readouterr().out
    assert "served/engine" in printed and "server SERVING" in printed
