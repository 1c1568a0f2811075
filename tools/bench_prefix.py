"""Prefix reuse on against off, side by side in one run: the same workload against a server of each bundle in turn
(never both at once: on two cores each would slow the other).

    # multi-turn chat: time to first token of the opening turns and of the turns that resend their history
    .venv/bin/python tools/bench_prefix.py build/smollm2 build/smollm2-noreuse --mix chat-sessions \\
        --rate 0.3 --duration 240 --out build/bench-prefix/chat
    # served capacity of a workload under a P99 TTFT bound (tools/loadgen.py sweep), with reuse and without
    .venv/bin/python tools/bench_prefix.py build/smollm2 build/smollm2-noreuse --mix repeated-context \\
        --sweep --start 0.05 --factor 1.6 --ttft-bound 10 --out build/bench-prefix/context

ON and OFF are plan bundles of the same model and slabs, built from specs that differ in `prefix_reuse` only
(`build-plan` a copy of the spec with `prefix_reuse: false` for OFF). Each server is started on a free loopback
port, waited for until SERVING, driven by the load generator (tools/loadgen.py: `run` at --rate for --duration, or
`sweep`), and stopped. It prints per class P50/P99 TTFT and the share of prompt tokens served from retained KV
(or each capacity) for both and their ratio, and writes compare.json beside each side's loadgen output.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from slabserve.tools import loadgen
from slabserve.tools.loadgen import LoadgenError
from slabserve.tools.soak import free_port, start_server, stop_server, wait_serving


def run_side(bundle: str, out: Path, args: argparse.Namespace, start: float | None = None) -> dict:
    """Serve `bundle`, drive it, stop it; the loadgen document (run) or sweep result (sweep)."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    log = out / "server.log"
    process = start_server(bundle, port, log, [])
    try:
        wait_serving(addr, process, args.start_timeout, log)
        common = ["--addr", addr, "--mix", args.mix, "--seed", str(args.seed), "--no-progress", "--no-plots",
                  "--server-pid", str(process.pid), "--drain-timeout", str(args.drain_timeout)]
        if args.sweep:
            cmd = ["sweep", *common, "--start", str(start or args.start), "--factor", str(args.factor),
                   "--ttft-bound", str(args.ttft_bound), "--step-duration", str(args.step_duration), "--refine",
                   str(args.refine), "--past-bound", str(args.past_bound), "--min-step-requests",
                   str(args.min_step_requests), "--out", str(out)]
            if args.ttft_classes:
                cmd += ["--ttft-classes", args.ttft_classes]
            if loadgen.main(cmd) != 0:
                raise LoadgenError(f"the sweep against {bundle} failed")
            return json.loads((out / "sweep.json").read_text())
        if loadgen.main(["run", *common, "--rate", str(args.rate), "--duration", str(args.duration),
                         "--out", str(out)]) != 0:
            raise LoadgenError(f"the run against {bundle} failed")
        return json.loads((out / "loadgen.json").read_text())
    finally:
        print(f"bench_prefix: server for {bundle} stopped (exit {stop_server(process)})", file=sys.stderr)


def _earlier(out: Path, args: argparse.Namespace) -> dict:
    """A side run before into the same --out (when --sides leaves it out)."""
    path = out / ("sweep.json" if args.sweep else "loadgen.json")
    if not path.is_file():
        raise LoadgenError(f"--sides leaves a side out, but {path} holds no earlier result of it")
    return json.loads(path.read_text())


def _p(dist: dict | None, key: str) -> float | None:
    return None if dist is None else dist[key]


def compare_runs(on: dict, off: dict) -> dict:
    """Per class: P50/P99 TTFT with reuse and without, their ratios (off / on), the cached share with reuse."""
    rows = {}
    for name in sorted(set(on["summary"]["classes"]) | {"all"}):
        a = on["summary"]["overall"] if name == "all" else on["summary"]["classes"].get(name)
        b = off["summary"]["overall"] if name == "all" else off["summary"]["classes"].get(name)
        if a is None or b is None:
            continue
        row = {"requests": [a["requests"], b["requests"]], "ok": [a["status"].get("OK", 0), b["status"].get("OK", 0)],
               "cached_fraction_on": a.get("cached_fraction", 0.0)}
        for q in ("p50", "p99"):
            x, y = _p(a["ttft_s"], q), _p(b["ttft_s"], q)
            row[f"ttft_{q}_s"] = [x, y]
            row[f"ttft_{q}_ratio"] = None if not x or y is None else y / x
        rows[name] = row
    return rows


def print_runs(rows: dict) -> None:
    print(f"{'class':<12} {'ok on/off':>11} {'TTFT p50 on':>12} {'off':>9} {'off/on':>7} "
          f"{'p99 on':>9} {'off':>9} {'off/on':>7} {'cached (on)':>11}")
    for name, r in rows.items():
        def ms(v):
            return f"{'-':>9}" if v is None else f"{v * 1000:>7.0f}ms"

        def ratio(v):
            return f"{'-':>7}" if v is None else f"{v:>6.1f}x"
        print(f"{name:<12} {r['ok'][0]:>5}/{r['ok'][1]:<5} {ms(r['ttft_p50_s'][0]):>12} {ms(r['ttft_p50_s'][1])} "
              f"{ratio(r['ttft_p50_ratio'])} {ms(r['ttft_p99_s'][0])} {ms(r['ttft_p99_s'][1])} "
              f"{ratio(r['ttft_p99_ratio'])} {r['cached_fraction_on']:>10.1%}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/bench_prefix.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("on", metavar="ON", help="bundle with prefix_reuse: true")
    p.add_argument("off", metavar="OFF", help="the same plan with prefix_reuse: false")
    p.add_argument("--mix", default="chat-sessions", help="workload (tools/loadgen.py --mix)")
    p.add_argument("--rate", type=float, default=0.3, help="run: requests per second")
    p.add_argument("--duration", type=float, default=240.0, help="run: seconds of arrivals")
    p.add_argument("--sweep", action="store_true", help="compare capacities (tools/loadgen.py sweep) instead")
    p.add_argument("--start", type=float, default=0.05, help="sweep: first rate")
    p.add_argument("--off-start", type=float, help="sweep: first rate without reuse (default: --start)")
    p.add_argument("--min-step-requests", type=int, default=20, help="sweep: requests a step offers at least")
    p.add_argument("--past-bound", type=int, default=2, help="sweep: failing steps in a row that end the climb")
    p.add_argument("--factor", type=float, default=1.5, help="sweep: rate multiplier between steps")
    p.add_argument("--ttft-bound", type=float, default=10.0, help="sweep: P99 TTFT bound, seconds")
    p.add_argument("--ttft-classes", help="sweep: classes the bound applies to (default: all)")
    p.add_argument("--step-duration", type=float, default=120.0, help="sweep: seconds per step (at least)")
    p.add_argument("--refine", type=int, default=2, help="sweep: bisection steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default="build/bench-prefix")
    p.add_argument("--sides", default="on,off",
                   help="which bundles to run now (on, off or both); a side left out is read from --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        on = run_side(args.on, out / "on", args) if "on" in args.sides else _earlier(out / "on", args)
        off = run_side(args.off, out / "off", args, args.off_start) if "off" in args.sides else \
            _earlier(out / "off", args)
    except (LoadgenError, OSError, ValueError) as err:
        print(f"bench_prefix: {err}", file=sys.stderr)
        return 2
    if args.sweep:
        a, b = on["capacity_rps"], off["capacity_rps"]
        result = {"mix": args.mix, "capacity_rps": {"on": a, "off": b},
                  "ratio": None if not a or not b else a / b}
        print(f"capacity with reuse {a} req/s, without {b} req/s"
              + (f": {result['ratio']:.2f}x" if result["ratio"] else ""))
    else:
        result = {"mix": args.mix, "rate": args.rate, "duration_s": args.duration, "classes": compare_runs(on, off)}
        print(f"prefix reuse on vs off: {args.mix}, Poisson {args.rate:g} req/s for {args.duration:g} s")
        print_runs(result["classes"])
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
