"""Soak and overload tests of a slabserve server, judged against the project's promise.

Starts `slabserve serve BUNDLE` on a free loopback port (or attaches to a running server with --addr), waits for
health SERVING, warms it up with --warmup seconds of load (opening with one request of each class at its longest
prompt and output, so the baseline comes after the largest request the mix sends), lets it go idle and takes its
resident memory as the baseline, runs the open-loop load generator (tools/loadgen.py) for --lead-in seconds (not judged: the server
reaches its steady concurrency) and then the judged --duration seconds, drains, lets it go idle again and judges:

  soak (default: 70% of --capacity for 600 s)
    memory       server VmRSS when idle after the run minus when idle after warm-up: under 1 MiB
    TTFT drift   P99 time to first token of requests sent in the last tenth of the run within 20% of the first
                 tenth's (only a rise counts). The last tenth's arrivals replay the first tenth's (same classes,
                 lengths and spacing), so both get the same offered work: with a few requests a tenth, P99 is
                 nearly the max and would otherwise mostly say whether a long analysis landed in the tenth.
    TPOT drift   the same for time per output token
    errors       no request ended in anything but OK and RESOURCE_EXHAUSTED (drain-timeout cancels count)
    slabs free   GetLoad after the run: every slab of every class free, nothing running or queued
  overload (--overload: 3x --capacity for 120 s; the warm-up runs at capacity)
    admitted TTFT  P99 TTFT of admitted requests within 2x the P99 TTFT at capacity (--reference-ttft, else the
                   sweep's figure at its capacity, else the warm-up's), over the sweep's --ttft-classes if it had any
    rejections   P99 client-measured latency of RESOURCE_EXHAUSTED answers under 50 ms (the max is reported)
    memory, errors, slabs free   as above

It prints a verdict table, writes soak.json (verdict, figures, the run's summary) and run/ (the run's
loadgen.json and plots) under --out, and exits 0 only when every criterion passes (1: failed, 2: could not run).

On the default plan, with the capacity from a sweep (see tools/loadgen.py):

    .venv/bin/python tools/soak.py build/smollm2 --sweep build/loadgen/sweep/sweep.json --out build/soak
    .venv/bin/python tools/soak.py build/smollm2 --sweep build/loadgen/sweep/sweep.json --overload --out build/overload
    # or with a capacity measured some other way, in requests per second:
    .venv/bin/python tools/soak.py build/smollm2 --capacity 0.2 --out build/soak
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from slabserve.runtime.client import serving_status
from slabserve.tools._driver import DriveOptions
from slabserve.tools._stats import OK, REJECTED, distribution, in_window
from slabserve.tools._target import TargetError, loopback_target, resident_bytes
from slabserve.tools._workload import (Arrival, Mix, WorkloadError, largest_of_each_class, mix_named,
                                       poisson_schedule)
from slabserve.tools.loadgen import LoadgenError, connect, describe, execute, mix_to_dict, wait_idle, write_run

MiB = 1 << 20


# ---- the judgment (pure) ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Criterion:
    name: str
    passed: bool
    measured: str
    limit: str
    note: str = ""


def judge_memory(baseline_bytes: int | None, final_bytes: int | None, limit_bytes: int = MiB) -> Criterion:
    if baseline_bytes is None or final_bytes is None:
        return Criterion("server memory growth", False, "not measured", f"< {limit_bytes / MiB:g} MiB",
                         "the server's VmRSS could not be read")
    growth = final_bytes - baseline_bytes
    return Criterion("server memory growth", growth < limit_bytes, f"{growth / MiB:+.2f} MiB",
                     f"< {limit_bytes / MiB:g} MiB",
                     f"idle after warm-up {baseline_bytes / MiB:.1f} MiB, idle after the run {final_bytes / MiB:.1f} MiB")


def soak_schedule(mix: Mix, rate: float, seed: int, lead_in_s: float, duration_s: float) -> tuple[Arrival, ...]:
    """Poisson arrivals over lead_in_s + duration_s whose last tenth replays the first tenth of the judged window
    (the same classes, lengths and spacing, shifted), so the two tenths the drift criteria compare get the same
    offered work and a difference between them is the server's, not the dice's. The lead-in lets the server reach
    its steady concurrency before the first tenth starts; it is not judged."""
    tenth = duration_s / 10
    body = poisson_schedule(mix, rate, seed, duration_s=lead_in_s + 9 * tenth)
    # a conversation replays whole when its opening turn was in the first tenth, as a new conversation
    in_first = [a for a in body if lead_in_s <= a.offset_s < lead_in_s + tenth]
    opened = {a.session for a in in_first if a.session >= 0 and a.turn == 0}
    first = [a for a in in_first if a.session < 0] + [a for a in body if a.session in opened]
    renumber = max((a.session for a in body), default=-1) + 1
    replay = [replace(a, offset_s=a.offset_s + 9 * tenth, session=a.session + renumber if a.session >= 0 else -1)
              for a in first]
    return tuple(sorted(body + tuple(replay), key=lambda a: a.offset_s))


def tenth_p99(records: Sequence[dict], start_s: float, duration_s: float, key: str,
              which: str) -> tuple[float | None, int]:
    """(P99 of `key` over OK requests sent in the first or last tenth of [start_s, start_s + duration_s), and how
    many there were)."""
    begin = start_s + (0.0 if which == "first" else duration_s * 0.9)
    ok = [r for r in in_window(records, begin, begin + duration_s / 10) if r["status"] == OK]
    d = distribution(r.get(key) for r in ok)
    return (None if d is None else d["p99"]), (0 if d is None else d["n"])


def judge_drift(records: Sequence[dict], start_s: float, duration_s: float, key: str, label: str,
                limit: float = 0.2) -> Criterion:
    first, n_first = tenth_p99(records, start_s, duration_s, key, "first")
    last, n_last = tenth_p99(records, start_s, duration_s, key, "last")
    name = f"P99 {label}, last tenth vs first"
    if first is None or last is None:
        return Criterion(name, False, "not measured", f"<= +{limit:.0%}",
                         f"completed requests: {n_first} in the first tenth, {n_last} in the last")
    change = last / first - 1 if first > 0 else float("inf")
    note = f"{first * 1000:.1f} ms (n={n_first}) -> {last * 1000:.1f} ms (n={n_last})"
    if min(n_first, n_last) < 20:
        note += "; under 20 requests a tenth: P99 is close to the max"
    return Criterion(name, change <= limit, f"{change:+.1%}", f"<= +{limit:.0%}", note)


def judge_errors(records: Sequence[dict]) -> Criterion:
    bad: dict[str, int] = {}
    for r in records:
        if r["status"] not in (OK, REJECTED):
            bad[r["status"]] = bad.get(r["status"], 0) + 1
    rejected = sum(1 for r in records if r["status"] == REJECTED)
    measured = ", ".join(f"{n} {s}" for s, n in sorted(bad.items())) or "0"
    return Criterion("errors other than RESOURCE_EXHAUSTED", not bad, measured, "0",
                     f"{len(records)} requests, {rejected} RESOURCE_EXHAUSTED")


def judge_slabs_free(load: dict | None) -> Criterion:
    name = "every slab free after the run"
    if load is None:
        return Criterion(name, False, "not measured", "all free", "GetLoad failed")
    held = {c["index"]: c["total_slabs"] - c["free_slabs"] for c in load["classes"]
            if c["free_slabs"] != c["total_slabs"]}
    free = sum(c["free_slabs"] for c in load["classes"])
    total = sum(c["total_slabs"] for c in load["classes"])
    passed = not held and load["running"] == 0 and load["queued"] == 0
    note = "" if passed else (f"held per class {held}, " if held else "") + \
        f"running {load['running']}, queued {load['queued']}"
    return Criterion(name, passed, f"{free}/{total} free", "all free", note)


def judge_admitted_ttft(records: Sequence[dict], reference_s: float | None, factor: float = 2.0,
                        classes: Sequence[str] = ()) -> Criterion:
    """P99 TTFT of admitted requests (of `classes`, or all, as the reference was measured) against the reference."""
    d = distribution(r.get("ttft_s") for r in records if r["status"] == OK and (not classes or r["class"] in classes))
    name = "P99 TTFT of admitted requests" + (f" ({', '.join(classes)})" if classes else "")
    if reference_s is None:
        return Criterion(name, False, "not judged", f"<= {factor:g}x at capacity", "no TTFT figure at capacity")
    limit = f"<= {factor:g}x {reference_s * 1000:.0f} ms = {factor * reference_s * 1000:.0f} ms"
    if d is None:
        return Criterion(name, False, "no request completed", limit)
    return Criterion(name, d["p99"] <= factor * reference_s, f"{d['p99'] * 1000:.0f} ms", limit, f"n={d['n']}")


def judge_rejection_latency(records: Sequence[dict], limit_s: float = 0.05) -> Criterion:
    d = distribution(r.get("e2e_s") for r in records if r["status"] == REJECTED)
    name = "P99 rejection latency (client)"
    if d is None:
        return Criterion(name, True, "no rejections", f"< {limit_s * 1000:.0f} ms",
                         "nothing was rejected at this load")
    return Criterion(name, d["p99"] < limit_s, f"{d['p99'] * 1000:.1f} ms", f"< {limit_s * 1000:.0f} ms",
                     f"n={d['n']}, max {d['max'] * 1000:.1f} ms")


def judge_soak(records: Sequence[dict], start_s: float, duration_s: float, baseline_bytes: int | None,
               final_bytes: int | None, final_load: dict | None) -> list[Criterion]:
    """The soak's criteria; the drift ones over requests sent in [start_s, start_s + duration_s), the others over
    every record."""
    return [judge_memory(baseline_bytes, final_bytes),
            judge_drift(records, start_s, duration_s, "ttft_s", "TTFT"),
            judge_drift(records, start_s, duration_s, "tpot_s", "TPOT"),
            judge_errors(records),
            judge_slabs_free(final_load)]


def judge_overload(records: Sequence[dict], start_s: float, duration_s: float, reference_ttft_s: float | None,
                   baseline_bytes: int | None, final_bytes: int | None, final_load: dict | None,
                   ttft_classes: Sequence[str] = ()) -> list[Criterion]:
    """The overload check's criteria; latencies over requests sent in [start_s, start_s + duration_s), errors
    over every record."""
    judged = in_window(records, start_s, start_s + duration_s)
    return [judge_admitted_ttft(judged, reference_ttft_s, classes=ttft_classes),
            judge_rejection_latency(judged),
            judge_memory(baseline_bytes, final_bytes),
            judge_errors(records),
            judge_slabs_free(final_load)]


def verdict_table(criteria: Sequence[Criterion]) -> str:
    rows = [("criterion", "measured", "limit", "result", "detail")]
    rows += [(c.name, c.measured, c.limit, "PASS" if c.passed else "FAIL", c.note) for c in criteria]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    lines.insert(1, "-" * (sum(widths) + 8))
    passed = all(c.passed for c in criteria)
    lines.append(f"verdict: {'PASS' if passed else 'FAIL'}")
    return "\n".join(line.rstrip() for line in lines)


# ---- the server process -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle: str | None, port: int, log_path: Path, extra_args: Sequence[str]) -> subprocess.Popen:
    """`slabserve serve` on 127.0.0.1:port in its own process group, its output in log_path."""
    cmd = [sys.executable, "-m", "slabserve.runtime.server", *([bundle] if bundle else []), "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", "-1", "--grace-seconds", "5", *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_serving(addr: str, process: subprocess.Popen | None, timeout_s: float, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while serving_status(addr) != "SERVING":
        if process is not None and process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise LoadgenError(f"the server exited with {process.returncode} before it was SERVING; its log ends:\n"
                               f"{tail}")
        if time.monotonic() > deadline:
            raise LoadgenError(f"{addr} was not SERVING after {timeout_s:g} s")
        time.sleep(0.25)


def stop_server(process: subprocess.Popen, grace_s: float = 20.0) -> int | None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    return process.returncode


def idle_memory(addr: str, pid: int | None, drain_timeout_s: float, settle_s: float) -> tuple[int | None, dict | None]:
    """(median VmRSS of 5 samples once the server is idle and settled, the GetLoad seen when idle)."""
    load = wait_idle(addr, drain_timeout_s)
    time.sleep(settle_s)
    if pid is None:
        return None, load
    samples = []
    for _ in range(5):
        value = resident_bytes(pid)
        if value is not None:
            samples.append(value)
        time.sleep(0.2)
    return (int(statistics.median(samples)) if samples else None), load


# ---- the run ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Setup:
    """What one soak or overload run does, resolved from the command line."""
    mode: str                        # "soak" | "overload"
    capacity_rps: float
    rate_rps: float                  # the judged run's arrival rate
    warm_rate_rps: float             # the warm-up's (capacity for an overload: its P99 TTFT is the fallback reference)
    duration_s: float                # judged
    lead_in_s: float                 # run before the judged window, not judged
    reference_ttft_s: float | None   # overload: P99 TTFT at capacity
    ttft_classes: tuple[str, ...]    # overload: the classes that P99 is over (empty: all)


def setup_from(args: argparse.Namespace) -> Setup:
    """The run's setup from --capacity or --sweep (whose capacity, P99 TTFT there and TTFT classes it reads;
    --reference-ttft and --ttft-classes override those)."""
    classes = tuple(c for c in (args.ttft_classes or "").split(",") if c)
    capacity, reference = args.capacity, args.reference_ttft
    if capacity is None:
        sweep = json.loads(Path(args.sweep).read_text())
        if sweep.get("capacity_rps") is None:
            raise LoadgenError(f"{args.sweep}: the sweep found no capacity (no step passed)")
        capacity = sweep["capacity_rps"]
        reference = reference if reference is not None else (sweep.get("at_capacity") or {}).get("p99_ttft_s")
        classes = classes or tuple(sweep.get("ttft_classes", ()))
    overload = args.overload
    rate = capacity * (args.factor if overload else args.fraction)
    return Setup("overload" if overload else "soak", capacity, rate, capacity if overload else rate,
                 args.duration if args.duration is not None else (120.0 if overload else 600.0),
                 args.lead_in if args.lead_in is not None else (10.0 if overload else 60.0), reference, classes)


def soak(args: argparse.Namespace) -> int:
    if args.addr is not None:
        loopback_target(args.addr)  # before any call: nothing is ever sent off this machine
    setup = setup_from(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    process = None
    if args.addr is None:
        port = free_port()
        addr, log_path = f"127.0.0.1:{port}", out / "server.log"
        process = start_server(args.bundle, port, log_path, args.server_arg)
        print(f"soak: server pid {process.pid} on {addr} (log {log_path}); waiting for SERVING", file=sys.stderr)
        try:
            wait_serving(addr, process, args.start_timeout, log_path)
        except BaseException:
            stop_server(process)
            raise
    else:
        addr = args.addr
        wait_serving(addr, None, args.start_timeout, None)
    try:
        report = measure(args, setup, addr, process.pid if process is not None else args.server_pid, out)
    finally:
        if process is not None:
            print(f"soak: server stopped (exit {stop_server(process)})", file=sys.stderr)
    return 0 if report["passed"] else 1


def measure(args: argparse.Namespace, setup: Setup, addr: str, server_pid: int | None, out: Path) -> dict:
    """Warm up, take the idle baseline, run, take the idle final figures, judge; writes and prints the report."""
    target, info = connect(addr, server_pid)
    mix = mix_named(args.mix)

    def phase(name: str, rate: float, seconds: float, seed: int, arrivals: tuple[Arrival, ...] = ()) -> dict:
        arrivals = arrivals or poisson_schedule(mix, rate, seed, duration_s=seconds)
        title = describe(f"{setup.mode} {name}, Poisson {rate:g} req/s", mix, seconds, info.plan_id)
        options = DriveOptions(seed, args.drain_timeout, args.sample_interval, None, not args.no_progress,
                               label=f"{setup.mode} {name}")
        meta = {"tool": f"soak {name}", "title": title, "addr": addr, "rate": rate, "mix": mix_to_dict(mix),
                "classes": [c.name for c in mix.classes], "requests": len(arrivals)}
        return execute(target, info, arrivals, seconds, options, meta)

    # 1) warm up (the largest request of each class first, then Poisson arrivals), go idle, take the memory baseline
    poisson = poisson_schedule(mix, setup.warm_rate_rps, args.seed + 1, duration_s=args.warmup)
    warm = phase("warm-up", setup.warm_rate_rps, args.warmup, args.seed + 1,
                 tuple(sorted(largest_of_each_class(mix) + poisson, key=lambda a: a.offset_s)))
    write_run(warm, out / "warmup", plots=False)
    baseline, _ = idle_memory(addr, target.server_pid, args.drain_timeout, args.settle)
    # 2) the run (a soak's last tenth replays its first), then idle again: final memory and load
    replaying = setup.mode == "soak"
    run = phase("run", setup.rate_rps, setup.lead_in_s + setup.duration_s, args.seed,
                soak_schedule(mix, setup.rate_rps, args.seed, setup.lead_in_s, setup.duration_s) if replaying else ())
    final, final_load = idle_memory(addr, target.server_pid, args.drain_timeout, args.settle)
    write_run(run, out / "run", plots=not args.no_plots)
    # 3) judge
    report = judge_run(setup, warm, run, baseline, final, final_load)
    report["meta"].update(bundle=args.bundle, addr=addr, mix=mix_to_dict(mix), seed=args.seed, warmup_s=args.warmup)
    path = out / "soak.json"
    path.write_text(json.dumps(report, indent=1))
    print(run["meta"]["title"])
    print(verdict_table([Criterion(**c) for c in report["criteria"]]))
    print(f"wrote {path} and {out / 'run'}/")
    return report


def judge_run(setup: Setup, warm: dict, run: dict, baseline: int | None, final: int | None,
              final_load: dict | None) -> dict:
    """The report of a finished run: its criteria and verdict, and the figures behind them."""
    records, start, duration = run["records"], setup.lead_in_s, setup.duration_s
    reference = setup.reference_ttft_s
    if setup.mode == "overload":
        if reference is None:  # the warm-up ran at capacity
            warm_ok = [r for r in warm["records"]
                       if r["status"] == OK and (not setup.ttft_classes or r["class"] in setup.ttft_classes)]
            reference = (distribution(r.get("ttft_s") for r in warm_ok) or {}).get("p99")
        criteria = judge_overload(records, start, duration, reference, baseline, final, final_load,
                                  setup.ttft_classes)
    else:
        criteria = judge_soak(records, start, duration, baseline, final, final_load)
    rss = [s["bytes"] for s in run["samples"]["server_rss"]]
    return {
        "meta": dict(asdict(setup), reference_ttft_s=reference, title=run["meta"]["title"],
                     server=run["meta"]["server"]),
        "passed": all(c.passed for c in criteria),
        "criteria": [asdict(c) for c in criteria],
        "memory": {"baseline_idle_bytes": baseline, "final_idle_bytes": final,
                   "growth_bytes": None if baseline is None or final is None else final - baseline,
                   "peak_during_run_bytes": max(rss) if rss else None,
                   "min_during_run_bytes": min(rss) if rss else None},
        "tenths": {which: {key: dict(zip(("p99_s", "n"), tenth_p99(records, start, duration, key, which)))
                           for key in ("ttft_s", "tpot_s")} for which in ("first", "last")},
        "final_load": final_load,
        "summary": run["summary"],
        "warmup_summary": warm["summary"]["overall"],
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/soak.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", nargs="?", metavar="BUNDLE", help="plan bundle to serve (build-plan --out)")
    cap = p.add_mutually_exclusive_group(required=True)
    cap.add_argument("--capacity", type=float, help="the server's capacity, requests per second")
    cap.add_argument("--sweep", help="sweep.json of `tools/loadgen.py sweep` (its capacity and P99 TTFT there)")
    p.add_argument("--fraction", type=float, default=0.7, help="soak load as a fraction of capacity (default 0.7)")
    p.add_argument("--overload", action="store_true", help="the overload check instead of the soak")
    p.add_argument("--factor", type=float, default=3.0, help="overload load as a multiple of capacity (default 3)")
    p.add_argument("--reference-ttft", type=float,
                   help="overload: P99 TTFT at capacity, seconds (default: the sweep's, else the warm-up's)")
    p.add_argument("--ttft-classes", help="overload: request classes the TTFT comparison is over, comma-separated "
                                          "(default: the sweep's --ttft-classes, else all)")
    p.add_argument("--duration", type=float, help="seconds of load (default 600; 120 with --overload)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of warm-up load before the baseline")
    p.add_argument("--lead-in", type=float,
                   help="seconds of load after the baseline and before the judged --duration, not judged "
                        "(default 60; 10 with --overload, whose queues fill in seconds)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds idle before reading memory")
    p.add_argument("--mix", help="workload: a mix YAML file, or ide (the default), chat-sessions or "
                                 "repeated-context (tools/_workload.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for calls in flight after the last arrival (then cancelled: errors)")
    p.add_argument("--sample-interval", type=float, default=0.5)
    p.add_argument("--out", default="build/soak", help="folder for soak.json, run/ and warmup/")
    p.add_argument("--addr", help="attach to a running server on this loopback HOST:PORT instead of starting one")
    p.add_argument("--server-pid", type=int, help="with --addr: the server's pid (default: found by its port)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for health SERVING")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for `slabserve serve` (repeat; e.g. --server-arg=--queue-limit=32)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.bundle is not None and args.addr is not None:
        p.error("give a BUNDLE to serve or --addr of a running server, not both")
    if args.bundle is None and args.addr is None and not args.server_arg:
        p.error("give a BUNDLE to serve, or --addr of a running server")
    try:
        return soak(args)
    except (TargetError, WorkloadError, LoadgenError, OSError, ValueError) as err:
        print(f"soak: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
