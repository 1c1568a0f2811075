"""One decode step's program run op by op (one ctypes call per native kernel) against the same program with each
stretch of native kernels in one foreign call (kernels.cpu_native.fuse_calls, what the executor runs), alternately
in one process, on the same bound tensors.

    .venv/bin/python tools/bench_step_calls.py [build/smollm2] [--batch 1] [--rounds 6] [--steps 20]

The bundle's engine (warm-up included) prefills `--batch` sequences of 64 tokens and decodes a few steps; then the
decode bucket's bound calls run `--steps` times per round each way, `--rounds` rounds, alternating. Both ways run
the same kernels on the same arguments in the same order (the same bits); what differs is the Python and ctypes
work between them. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import time

from slabserve.runtime.engine import Engine, StoppingOptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", nargs="?", default="build/smollm2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    engine = Engine.from_plan(args.bundle)
    stopping = StoppingOptions(max_tokens=args.rounds * args.steps * 4 + 64, ignore_eos=True)
    for i in range(args.batch):
        engine.submit([(7 * i + j) % 1000 + 10 for j in range(64)], stopping=stopping)
    for _ in range(8 + args.batch):  # past every prefill (one 64-token chunk each at most): decode steps from here
        engine.step()
    program = min((p for p in engine.executor.buckets.values() if p.bound_to is not None and p.bucket >= args.batch),
                  key=lambda p: p.bucket)
    ways = {"one call per op": program._run_calls, "fused": program._fused_calls}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, calls in ways.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                for call in calls:
                    call()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    print(f"bucket {program.bucket}: {len(program._run_calls)} calls, {len(program._fused_calls)} after fusing")
    for name, values in times.items():
        print(f"{name:>16}: {min(values):.2f} ms a step (best of {args.rounds}; all: "
              f"{' '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
