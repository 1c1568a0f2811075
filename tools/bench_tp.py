"""What tensor parallelism costs on this machine: the same model served at degree 1 and at degree N, side by side.

    .venv/bin/python tools/bench_tp.py BUNDLE_DEGREE_1 BUNDLE_DEGREE_N [--streams 1 4] [--tokens 64] [--prompt 32]
                                       [--repeats 2] [--json FILE]

Each bundle is served in turn by `slabserve serve` (which starts a tensor-parallel plan's ranks itself), and N
concurrent gRPC streams decode `--tokens` tokens after a `--prompt`-token prompt; the figure is the median time per
output token after the first, and the output tokens/s of all streams (best of `--repeats`). Beside them, the
latency of one gloo all-reduce of a hidden-size row between N processes on this machine, the floor of a
tensor-parallel step: a Llama step makes two per layer (kernels/collectives.py).

On a 2-core CPU the ranks share the cores, so degree N cannot run faster than degree 1 here: this measures the
price of the collectives and of the step message, which is what a CPU run of a tensor-parallel plan (a CI check of
a plan meant for GPUs, a model that does not fit one host's memory budget) pays.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.plan import read_plan
from slabserve.tools.bench_served import served_tpot_ms
from slabserve.tools.soak import free_port, start_server, stop_server, wait_serving

_ALL_REDUCE = r"""
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(int(sys.argv[1]))
for _ in range(50):
    dist.all_reduce(x)
t = time.perf_counter()
for _ in range(500):
    dist.all_reduce(x)
if dist.get_rank() == 0:
    print((time.perf_counter() - t) / 500)
dist.destroy_process_group()
"""


def all_reduce_us(degree: int, numel: int) -> float:
    """Microseconds per gloo all-reduce of `numel` float32 among `degree` local processes (one thread each)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _ALL_REDUCE, str(numel)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(degree), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
             for r in range(degree)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    return float(out[0].strip()) * 1e6


def served(bundle: str, streams: list[int], prompt: int, tokens: int, repeats: int, log: Path) -> dict:
    plan = read_plan(bundle)
    port = free_port()
    process = start_server(bundle, port, log, [])
    addr = f"127.0.0.1:{port}"
    try:
        started = time.monotonic()
        wait_serving(addr, process, 600, log)
        ready = time.monotonic() - started
        out = {"degree": plan.parallel.tensor, "ready_s": round(ready, 1), "streams": {}}
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.SlabServeStub(channel)
            for n in streams:
                runs = [served_tpot_ms(stub, n, prompt, tokens, salt, plan.model.vocab_size)
                        for salt in range(repeats)]
                best = min(runs)
                out["streams"][str(n)] = {"tpot_ms": round(best[0], 2), "tok_s": round(max(r[1] for r in runs), 1)}
        return out
    finally:
        stop_server(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs=2, metavar="BUNDLE")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    plans = [read_plan(b) for b in args.bundles]
    degree = plans[1].parallel.tensor
    if plans[0].parallel.tensor != 1 or degree < 2 or plans[0].fingerprints.model_config != \
            plans[1].fingerprints.model_config:
        parser.error("give a degree-1 bundle and a degree-N bundle of the same model, in that order")
    report = {"model": plans[0].model.arch, "hidden_size": plans[0].model.hidden_size,
              "layers": plans[0].model.num_layers, "cpus": os.cpu_count(),
              "all_reduce_us": round(all_reduce_us(degree, plans[0].model.hidden_size), 1), "runs": []}
    for bundle in args.bundles:
        report["runs"].append(served(bundle, args.streams, args.prompt, args.tokens, args.repeats,
                                     Path(bundle) / "bench_tp.server.log"))
    one, many = report["runs"]
    print(f"{report['model']} ({report['layers']} layers): one gloo all-reduce of a {report['hidden_size']}-wide row "
          f"among {degree} processes: {report['all_reduce_us']:.0f} us; a step makes {2 * report['layers']}")
    print(f"{'streams':>8}{'degree 1 ms/token':>19}{f'degree {degree} ms/token':>19}{'ratio':>8}"
          f"{'degree 1 tok/s':>16}{f'degree {degree} tok/s':>16}")
    for n in map(str, args.streams):
        a, b = one["streams"][n], many["streams"][n]
        print(f"{n:>8}{a['tpot_ms']:>19.2f}{b['tpot_ms']:>19.2f}{b['tpot_ms'] / a['tpot_ms']:>8.1f}"
              f"{a['tok_s']:>16.1f}{b['tok_s']:>16.1f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
