"""Time per output token as a client gets it from a real server, beside the engine's own decode step, in one run.

    .venv/bin/python tools/bench_served.py build/smollm2 [--streams 1 8] [--tokens 128] [--prompt 64]
                                           [--repeats 3] [--json FILE]

Two sides, the same bundle. The engine alone: the bundle's Engine in this process (`Engine.from_plan`, warm-up
included) decodes N sequences of `--tokens` tokens after an `--prompt`-token prompt, and the figure is its time per
decode step (every sequence decoding; prefill left out). Served: `slabserve serve` in its own process on a free
loopback port, waited for until SERVING (that wait, from the process's start, is reported as the server's ready
time: health polled every 0.25 s; the server starts before this process builds its engine, so that nothing else
runs while it starts), then N concurrent `Generate` streams over gRPC with the same prompts (token ids,
`ignore_eos`) from this process; the figure is each stream's time per output token after its first (last token's
arrival minus first's, over tokens - 1), the median over the streams. The two sides alternate, engine then served,
`--repeats` times at each stream count, each idle while the other runs, and the best run of each side counts: this
machine's speed moves by 10-30% over minutes, and alternating puts both sides in the same minutes (measured one
side after the other, five runs of the same batch-1 code gave 1.10x-1.39x at 1 stream). Never run it beside another
benchmark.

The client runs on the same two cores as the server, as a local client would; its work per token (one protobuf
message read per token and stream) is part of what it measures, and is small beside a decode step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.engine import Engine, StoppingOptions
from slabserve.tools.soak import free_port, start_server, stop_server, wait_serving


def prompts(streams: int, length: int, salt: int, vocab: int) -> list[list[int]]:
    """Distinct prompts of ids in [0, vocab) (no two share a first block: prefix reuse never shortens a prefill)."""
    return [[(97 * (i + 1) + 13 * j + 7 * salt) % vocab for j in range(length)] for i in range(streams)]


def engine_step_ms(engine: Engine, streams: int, prompt: int, tokens: int, salt: int) -> float:
    """Milliseconds per Engine.step while all `streams` sequences decode (scheduling, step, sampling, events)."""
    stopping = StoppingOptions(max_tokens=tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [engine.submit(p, stopping=stopping) for p in prompts(streams, prompt, salt, vocab)]
    started: set[str] = set()
    while len(started) < streams:
        started.update(e.request_id for e in engine.step() if e.token_ids)
    steps, t0 = 0, time.perf_counter()
    done = 0
    while done < streams:
        done += sum(1 for e in engine.step() if e.finished is not None)
        steps += 1
    elapsed = time.perf_counter() - t0
    assert not engine.has_work(), ids
    return 1000 * elapsed / steps


def served_tpot_ms(stub, streams: int, prompt: int, tokens: int, salt: int, vocab: int) -> tuple[float, float]:
    """(median over streams of ms per output token after the first, output tokens/s of all streams together)."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    errors: list[BaseException] = []

    def one(i: int, ids: list[int]) -> None:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
        request.stopping.max_tokens = tokens
        request.stopping.ignore_eos = True
        try:
            for response in stub.Generate(request, timeout=600):
                if response.HasField("token"):
                    now = time.perf_counter()
                    arrivals[i].extend(now for _ in response.token.token_ids)
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, p))
               for i, p in enumerate(prompts(streams, prompt, salt, vocab))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {streams} streams failed: {errors[0]}")
    if any(len(a) != tokens for a in arrivals):
        raise RuntimeError(f"streams returned {[len(a) for a in arrivals]} tokens, expected {tokens} each")
    per_stream = [1000 * (a[-1] - a[0]) / (tokens - 1) for a in arrivals]
    return statistics.median(per_stream), streams * tokens / (max(a[-1] for a in arrivals) - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--server-arg", action="append", default=[], help="extra `slabserve serve` argument")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (a time per token needs two tokens)")

    port = free_port()
    log = Path(args.json).with_suffix(".server.log") if args.json else Path("build/bench-served.server.log")
    started = time.monotonic()
    process = start_server(args.bundle, port, log, args.server_arg)
    engine_ms: dict[int, float] = {}
    served: dict[int, tuple[float, float]] = {}
    try:
        addr = f"127.0.0.1:{port}"
        wait_serving(addr, process, args.start_timeout, log)
        ready_s = time.monotonic() - started  # process start to health SERVING, as an orchestrator sees it
        engine = Engine.from_plan(args.bundle)
        vocab = engine.model_config.vocab_size
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.SlabServeStub(channel)
            served_tpot_ms(stub, 1, args.prompt, 4, salt=99, vocab=vocab)  # warms the channel and the handlers
            for n in args.streams:
                alone, runs = [], []
                for r in range(args.repeats):  # alternately: both sides in the same minutes of this machine
                    alone.append(engine_step_ms(engine, n, args.prompt, args.tokens, salt=r))
                    runs.append(served_tpot_ms(stub, n, args.prompt, args.tokens, salt=r, vocab=vocab))
                engine_ms[n], served[n] = min(alone), min(runs)
    finally:
        code = stop_server(process)
    rows = [{"streams": n, "engine_step_ms": engine_ms[n], "served_ms_per_token": served[n][0],
             "served_tok_s": served[n][1], "ratio": served[n][0] / engine_ms[n]} for n in args.streams]
    print(f"bundle {args.bundle}; prompt {args.prompt} tokens, {args.tokens} out per stream; best of "
          f"{args.repeats}; server SERVING {ready_s:.1f} s after its start; exit {code}")
    print(f"{'streams':>7} {'engine ms/step':>15} {'served ms/token':>16} {'served/engine':>14} {'served tok/s':>13}")
    for r in rows:
        print(f"{r['streams']:>7} {r['engine_step_ms']:>15.1f} {r['served_ms_per_token']:>16.1f} "
              f"{r['ratio']:>13.2f}x {r['served_tok_s']:>13.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bundle": args.bundle, "prompt": args.prompt, "tokens": args.tokens,
                                               "repeats": args.repeats, "ready_s": ready_s, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
