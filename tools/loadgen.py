"""Open-loop load generator for a slabserve server, and its capacity sweep.

Open loop: request i is sent at its scheduled time on its own task whatever the server is doing, so a slow
server meets the same arrivals as a fast one (a closed loop would slow its own arrivals down and hide the tail).
Arrivals are Poisson at --rate for --duration seconds or --requests requests, or read from --trace. Request
lengths come from a workload mix (--mix FILE; default: the IDE mix of tools/_workload.py: 70% completions of
64-512 prompt / 16-64 output tokens, 20% chat turns of 128-1024 / 32-256, 10% analyses of 2048-6144 / 128-256).
Prompts are random token ids of exactly the drawn length; max_tokens is the drawn output length, EOS ignored.
It only targets loopback (127.0.0.0/8, ::1, localhost) and stops by itself: after the last arrival it waits
--drain-timeout seconds for the calls in flight, then cancels and counts the rest.

Output (--out DIR): loadgen.json (meta, summary percentiles P50/P90/P99/max per class and overall, counts per
status, every per-request record, the server's memory and GetLoad samples) and latency_cdf.png,
latency_over_time.png, server_memory.png, slab_occupancy.png.

On the default plan (start the server first: `.venv/bin/slabserve build-plan plans/smollm2-135m.yaml --out
build/smollm2 && .venv/bin/slabserve serve build/smollm2 --port 50051 --metrics-port -1`; the figures below suit
this 2-core CPU, where a 4k-token analysis takes about 30 s to its first token even alone):

    # one run: Poisson 0.05 req/s of the IDE mix for 10 minutes
    .venv/bin/python tools/loadgen.py run --addr 127.0.0.1:50051 --rate 0.05 --duration 600 --out build/loadgen/run
    # the capacity sweep: 0.03, 0.045, 0.0675, ... req/s, each step offering at least 20 requests (and lasting at
    # least 120 s), until two steps in a row break the bound, then 2 bisection steps (about 40-60 minutes here).
    # The bound is on completions and chat turns; analyses are reported per class but left out of it.
    .venv/bin/python tools/loadgen.py sweep --addr 127.0.0.1:50051 --start 0.03 --factor 1.5 \\
        --ttft-bound 10 --ttft-classes completion,chat --out build/loadgen/sweep
    # the 10-minute soak at 70% of the swept capacity, and the 2-minute overload at 3x (start their own server)
    .venv/bin/python tools/soak.py build/smollm2 --sweep build/loadgen/sweep/sweep.json --out build/soak
    .venv/bin/python tools/soak.py build/smollm2 --sweep build/loadgen/sweep/sweep.json --overload \\
        --out build/overload
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.tools._driver import DriveOptions, RunResult, Target, run_schedule
from slabserve.tools._stats import summarize
from slabserve.tools._sweep import SweepPlan, step_figures, sweep
from slabserve.tools._target import TargetError, listening_pid, loopback_target
from slabserve.tools._workload import Arrival, Mix, WorkloadError, load_trace, mix_named, poisson_schedule


class LoadgenError(RuntimeError):
    """A run that cannot start (server unreachable, a mix the server cannot hold); the message says why."""


# ---- the server ---------------------------------------------------------------------------------------------------

def model_info(addr: str, timeout: float = 10.0) -> pb.GetModelInfoResponse:
    with grpc.insecure_channel(addr) as channel:
        try:
            return pb_grpc.SlabServeStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
        except grpc.RpcError as err:
            raise LoadgenError(f"{addr}: GetModelInfo failed: {err.code().name}: {err.details()}") from None


def info_to_dict(info: pb.GetModelInfoResponse) -> dict:
    return {"model_name": info.model_name, "plan_id": info.plan_id, "vocab_size": info.vocab_size,
            "max_request_tokens": info.max_request_tokens, "max_running": info.max_running,
            "step_tokens": info.step_tokens, "queue_limit": info.queue_limit,
            "max_queue_delay_ms": info.max_queue_delay_ms,
            "slab_classes": [{"index": c.index, "tokens": c.tokens, "count": c.count} for c in info.slab_classes]}


def check_fits(arrivals: Sequence[Arrival], info: pb.GetModelInfoResponse) -> None:
    """Refuse a workload with requests no slab can hold: they would all be OUT_OF_RANGE, not load."""
    too_big = [a for a in arrivals if a.prompt_tokens + a.output_tokens > info.max_request_tokens]
    if too_big:
        worst = max(too_big, key=lambda a: a.prompt_tokens + a.output_tokens)
        raise LoadgenError(f"{len(too_big)} requests need more than the server's largest slab "
                           f"({info.max_request_tokens} tokens), e.g. class {worst.class_name!r} with "
                           f"{worst.prompt_tokens} + {worst.output_tokens}; use a mix whose prompt + output fits")


def http_model_info(addr: str, vocab_size: int, api_key: str | None = None) -> pb.GetModelInfoResponse:
    """What an OpenAI-compatible server tells of its model (GET /v1/models), in GetModelInfo's shape: its id, and
    its longest request (`max_model_len`, as vLLM and slabserve report it). The vocabulary size is not served, so
    the caller gives one that holds for the model (prompt ids are drawn below it)."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"http://{addr}/v1/models", headers=headers, timeout=10)
        response.raise_for_status()
        model = response.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        raise LoadgenError(f"{addr}: GET /v1/models failed: {err}") from None
    return pb.GetModelInfoResponse(model_name=model["id"], vocab_size=vocab_size,
                                   max_request_tokens=int(model.get("max_model_len") or 1 << 30),
                                   plan_id=str(model.get("plan_id", "")))


def connect(addr: str, server_pid: int | None, protocol: str = "grpc", vocab_size: int = 32000,
            api_key: str | None = None) -> tuple[Target, pb.GetModelInfoResponse]:
    """Check the address is loopback, ask the server for its model, and find its pid (for memory samples)."""
    _, port = loopback_target(addr)
    info = model_info(addr) if protocol == "grpc" else http_model_info(addr, vocab_size, api_key)
    pid = server_pid if server_pid is not None else listening_pid(port)
    if pid is None:
        print(f"loadgen: no process found listening on port {port}; server memory will not be sampled "
              f"(give --server-pid)", file=sys.stderr)
    return Target(addr, info.vocab_size, pid, protocol, info.model_name, api_key), info


def wait_idle(addr: str, timeout_s: float) -> dict | None:
    """Poll GetLoad until nothing runs or waits (or the timeout); the last load seen, None if unreachable (as an
    HTTP-only server is: the caller then starts its next step after the drain alone)."""
    deadline = time.monotonic() + timeout_s
    last = None
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.SlabServeStub(channel)
        while True:
            try:
                last = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
            except grpc.RpcError:
                last = None
            if last is not None and last.running == 0 and last.queued == 0:
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.25)
    if last is None:
        return None
    return {"running": last.running, "queued": last.queued,
            "classes": [{"index": c.index, "tokens": c.tokens, "free_slabs": c.free_slabs,
                         "total_slabs": c.total_slabs, "queued": c.queued} for c in last.classes]}


# ---- one run ------------------------------------------------------------------------------------------------------

def mix_to_dict(mix: Mix) -> dict:
    shaped = {} if mix.shape == "independent" else {
        "shape": mix.shape, "think_s": mix.think_s, "turns": list(mix.turns), "contexts": mix.contexts,
        "context_tokens": list(mix.context_tokens), "context_seed": mix.context_seed}
    return {"name": mix.name, **shaped,
            "classes": [{"name": c.name, "share": round(c.share, 6), "prompt": list(c.prompt),
                         "output": list(c.output)} for c in mix.classes]}


def run_document(result: RunResult, meta: dict) -> dict:
    """The JSON document of one run: meta, summary, records, samples."""
    meta = dict(meta, window_s=result.window_s, drained_s=result.drained_s, started_unix=result.started_unix)
    return {
        "meta": meta,
        "summary": summarize(result.records, result.window_s),
        "records": result.records,
        "samples": {"server_rss": [{"t_s": t, "bytes": b} for t, b in result.rss_samples],
                    "load": result.load_samples},
    }


def describe(schedule: str, mix: Mix, window_s: float, plan_id: str) -> str:
    return f"slabserve load: {schedule}, mix {mix.name}, {window_s:g} s, plan {plan_id[:12] or '(none)'}"


def write_run(document: dict, out_dir: Path, plots: bool, name: str = "loadgen.json") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots:
        from slabserve.tools._plots import plot_run
        document["plots"] = [p.name for p in plot_run(document, out_dir)]
    path = out_dir / name
    path.write_text(json.dumps(document, indent=1))
    return path


def execute(target: Target, info: pb.GetModelInfoResponse, arrivals: Sequence[Arrival], window_s: float,
            options: DriveOptions, meta: dict) -> dict:
    check_fits(arrivals, info)
    if target.protocol != "grpc" and any(a.session >= 0 for a in arrivals):
        raise LoadgenError("chat-sessions resends each answer's token ids, which only the gRPC API returns: "
                           "use --protocol grpc")
    result = run_schedule(target, arrivals, window_s, options)
    return run_document(result, dict(meta, server=info_to_dict(info), server_pid=target.server_pid,
                                     seed=options.seed, drain_timeout_s=options.drain_timeout_s))


def _run_command(args: argparse.Namespace) -> int:
    target, info = _connect(args)
    mix = mix_named(args.mix)
    if args.trace:
        arrivals = load_trace(args.trace, mix, args.seed)
        window_s, schedule = arrivals[-1].offset_s, f"trace {Path(args.trace).name}"
    else:
        if args.rate is None or (args.duration is None) == (args.requests is None):
            raise LoadgenError("give --rate with one of --duration and --requests, or --trace")
        arrivals = poisson_schedule(mix, args.rate, args.seed, duration_s=args.duration, num_requests=args.requests)
        window_s = args.duration if args.duration is not None else (arrivals[-1].offset_s if arrivals else 0.0)
        schedule = f"Poisson {args.rate:g} req/s"
    title = describe(schedule, mix, window_s, info.plan_id)
    meta = {"tool": "loadgen run", "title": title, "addr": args.addr, "schedule": schedule, "rate": args.rate,
            "mix": mix_to_dict(mix), "classes": [c.name for c in mix.classes], "requests": len(arrivals)}
    options = DriveOptions(args.seed, args.drain_timeout, args.sample_interval, args.request_timeout,
                           not args.no_progress)
    document = execute(target, info, arrivals, window_s, options, meta)
    path = write_run(document, Path(args.out), not args.no_plots)
    print_summary(document, path)
    return 0


def print_summary(document: dict, path: Path) -> None:
    summary = document["summary"]
    print(document["meta"]["title"])
    print(f"{'class':<12} {'requests':>8} {'ok':>6} {'rejected':>8} {'other':>6} "
          f"{'TTFT p50':>9} {'p99':>9} {'TPOT p50':>9} {'p99':>9} {'E2E p99':>9}")
    rows = [("all", summary["overall"])] + list(summary["classes"].items())
    for name, s in rows:
        status = s["status"]
        ok, rej = status.get("OK", 0), status.get("RESOURCE_EXHAUSTED", 0)
        print(f"{name:<12} {s['requests']:>8} {ok:>6} {rej:>8} {s['requests'] - ok - rej:>6} "
              f"{_ms(s['ttft_s'], 'p50')} {_ms(s['ttft_s'], 'p99')} {_ms(s['tpot_s'], 'p50')} "
              f"{_ms(s['tpot_s'], 'p99')} {_ms(s['e2e_s'], 'p99')}")
    lag = summary["schedule_lag_s"]
    if lag:
        print(f"send lag against the schedule: p99 {lag['p99'] * 1000:.1f} ms, max {lag['max'] * 1000:.1f} ms")
    print(f"wrote {path}" + (f" and {', '.join(document.get('plots', []))}" if document.get("plots") else ""))


def _ms(dist: dict | None, key: str) -> str:
    return f"{'-':>9}" if dist is None else f"{dist[key] * 1000:>7.0f}ms"


# ---- the sweep ----------------------------------------------------------------------------------------------------

def _sweep_command(args: argparse.Namespace) -> int:
    target, info = _connect(args)
    mix = mix_named(args.mix)
    ttft_classes = tuple(c for c in (args.ttft_classes or "").split(",") if c)
    for name in ttft_classes:
        mix.by_name(name)
    plan = SweepPlan(args.start, args.ttft_bound, None if args.increment else args.factor, args.increment,
                     args.max_rate, args.past_bound, args.refine, args.max_reject_fraction, ttft_classes)
    out = Path(args.out)
    (out / "steps").mkdir(parents=True, exist_ok=True)
    count = iter(range(10_000))

    def run_step(rate: float) -> dict:
        index = next(count)
        seconds = max(args.step_duration, args.min_step_requests / rate)
        arrivals = poisson_schedule(mix, rate, args.seed + index, duration_s=seconds)
        meta = {"tool": "loadgen sweep step", "title": describe(f"Poisson {rate:g} req/s", mix, seconds,
                                                                 info.plan_id),
                "addr": args.addr, "rate": rate, "mix": mix_to_dict(mix), "classes": [c.name for c in mix.classes],
                "requests": len(arrivals)}
        options = DriveOptions(args.seed + index, args.drain_timeout, args.sample_interval, args.request_timeout,
                               not args.no_progress, label=f"sweep {rate:g} req/s")
        document = execute(target, info, arrivals, seconds, options, meta)
        write_run(document, out / "steps", plots=False, name=f"step-{index:02d}-{rate:g}rps.json")
        figures = step_figures(rate, document["records"], seconds, document["samples"]["load"], plan)
        figures["duration_s"] = seconds
        print(f"sweep: {rate:g} req/s: {'pass' if figures['passed'] else 'FAIL'} ({figures['why']}; "
              f"{figures['completed_per_s']:.3f} completed/s, {figures['rejected']} rejected)", file=sys.stderr)
        if target.protocol == "grpc":
            wait_idle(args.addr, args.drain_timeout)  # the next step starts on an idle server
        return figures

    result = sweep(plan, run_step)
    bounded = f" of {'+'.join(ttft_classes)}" if ttft_classes else ""
    title = (f"slabserve capacity sweep: mix {mix.name}, >= {args.step_duration:g} s a step, P99 TTFT{bounded} "
             f"bound {args.ttft_bound:g} s, plan {info.plan_id[:12] or '(none)'}")
    result["meta"] = {"tool": "loadgen sweep", "title": title, "addr": args.addr, "mix": mix_to_dict(mix),
                      "step_duration_s": args.step_duration, "min_step_requests": args.min_step_requests,
                      "server": info_to_dict(info), "seed": args.seed}
    if not args.no_plots:
        from slabserve.tools._plots import plot_sweep
        result["plots"] = [plot_sweep(result, out / "sweep.png").name]
    path = out / "sweep.json"
    path.write_text(json.dumps(result, indent=1))
    print_sweep(result, path)
    return 0


def print_sweep(result: dict, path: Path) -> None:
    print(result["meta"]["title"])
    print(f"{'rate req/s':>10} {'verdict':>7} {'P99 TTFT':>9} {'done/s':>7} {'rejected':>8} {'other':>6} "
          f"{'max queued':>10}")
    for s in result["steps"]:
        p99 = "-" if s["p99_ttft_s"] is None else f"{s['p99_ttft_s'] * 1000:.0f}ms"
        print(f"{s['rate']:>10g} {'pass' if s['passed'] else 'FAIL':>7} {p99:>9} {s['completed_per_s']:>7.3f} "
              f"{s['rejected']:>8} {s['other_errors']:>6} {str(s['queues']['max_queued']):>10}")
    capacity = result["capacity_rps"]
    if capacity is None:
        print("capacity: no step passed; start lower")
    else:
        crossed = "" if result["bound_crossed"] else " (the bound was never crossed: raise --max-rate)"
        print(f"capacity: {capacity:g} req/s{crossed}")
    print(f"above it: {result['above_capacity']['summary']}")
    print(f"wrote {path}")


# ---- command line -------------------------------------------------------------------------------------------------

def _connect(args: argparse.Namespace) -> tuple[Target, pb.GetModelInfoResponse]:
    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    return connect(args.addr, args.server_pid, args.protocol, args.vocab_size, api_key)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", default="127.0.0.1:50051", help="loopback HOST:PORT of the server")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                        help="grpc: slabserve.v1 Generate; http: streamed /v1/completions of any OpenAI-compatible "
                             "server at http://ADDR/v1 (token-id prompts, ignore_eos), e.g. slabserve serve "
                             "--http-port")
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="with --protocol http: prompt ids are drawn below this (the API does not say)")
    parser.add_argument("--api-key-file", help="with --protocol http: file holding the bearer token")
    parser.add_argument("--server-pid", type=int,
                        help="pid whose memory to sample (default: the process listening on the port)")
    parser.add_argument("--mix", help="workload: a mix YAML file, or a built-in one: ide (the default), "
                                      "chat-sessions (multi-turn chat resending its history), repeated-context "
                                      "(a few long contexts with changed tails); see tools/_workload.py")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and prompt ids")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds to wait for calls in flight after the last arrival; the rest are cancelled")
    parser.add_argument("--request-timeout", type=float, help="gRPC deadline of each call in seconds "
                        "(default: the run's length plus the drain timeout)")
    parser.add_argument("--sample-interval", type=float, default=0.5, help="seconds between memory/GetLoad samples")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="tools/loadgen.py", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    examples = __doc__[__doc__.index("On the default plan"):]
    run = sub.add_parser("run", help="one open-loop run", epilog=examples,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(run)
    run.add_argument("--rate", type=float, help="Poisson arrivals per second")
    run.add_argument("--duration", type=float, help="seconds of arrivals")
    run.add_argument("--requests", type=int, help="number of requests (instead of --duration)")
    run.add_argument("--trace", help="arrivals from a CSV/JSONL file (offset_s, class[, prompt_tokens, "
                                     "output_tokens]) instead of --rate")
    run.add_argument("--out", default="build/loadgen/run", help="folder for loadgen.json and the plots")
    sw = sub.add_parser("sweep", help="raise the rate step by step; report the capacity under a TTFT bound",
                        epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(sw)
    sw.add_argument("--ttft-bound", type=float, required=True, help="P99 time to first token bound, seconds")
    sw.add_argument("--start", type=float, required=True, help="first rate, requests per second")
    sw.add_argument("--factor", type=float, default=1.5, help="rate multiplier between steps (default 1.5)")
    sw.add_argument("--increment", type=float, help="add this many req/s a step instead of multiplying")
    sw.add_argument("--max-rate", type=float, default=1000.0, help="highest rate to try")
    sw.add_argument("--step-duration", type=float, default=120.0, help="seconds of arrivals per step (at least)")
    sw.add_argument("--min-step-requests", type=int, default=20,
                    help="lengthen a step to offer at least this many requests (a P99 over fewer is the max)")
    sw.add_argument("--ttft-classes", help="comma-separated request classes the TTFT bound applies to (default: "
                                           "all; e.g. completion,chat to leave long analyses out of it)")
    sw.add_argument("--past-bound", type=int, default=2, help="failing steps in a row that end the climb")
    sw.add_argument("--refine", type=int, default=2, help="bisection steps between the last pass and first fail")
    sw.add_argument("--max-reject-fraction", type=float, default=0.01,
                    help="a step with more rejected requests than this fraction fails (default 0.01)")
    sw.add_argument("--out", default="build/loadgen/sweep", help="folder for sweep.json, sweep.png and steps/")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run_command(args) if args.command == "run" else _sweep_command(args)
    except (TargetError, WorkloadError, LoadgenError, ValueError) as err:
        print(f"loadgen: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
