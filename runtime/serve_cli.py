"""The `slabserve serve` command: arguments, the memory check, the engine from a plan bundle, signals and drain.

Contract: `main(argv)` serves until SIGTERM or SIGINT, then drains (`--grace-seconds`) and returns 0; it returns 1
when the engine fails while serving, and exits with a message naming the problem when the bundle, a file or the
memory does not allow it to start. It caps glibc's malloc arenas, checks that the plan fits the memory free here
(runtime.memcheck) before the Engine allocates, then waits on the main thread for a signal. The server writes no
files: a SIGKILL leaves nothing half-written, and a restart on the same bundle is a clean start.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from slabserve.runtime.access import Access
from slabserve.runtime.edge import Limits
from slabserve.runtime.engine import Engine, EngineConfig
from slabserve.runtime.engine_loop import limit_malloc_arenas, on_a_passing_thread
from slabserve.runtime.executor import PlanViolationError, claim_profiler_for_this_thread
from slabserve.runtime.memcheck import InsufficientMemoryError, check_plan_fits, free_memory, parse_size
from slabserve.runtime.ranks import DEFAULT_COLLECTIVE_TIMEOUT_S, GroupFailed, RankGroup, launch, rendezvous_env
from slabserve.runtime.server import create_server
from slabserve.runtime.slab_allocator import SlabClass

log = logging.getLogger("slabserve.server")


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slabserve serve",
                                     description="Serve a plan bundle over gRPC (and OpenAI-compatible HTTP).")
    parser.add_argument("bundle", nargs="?", metavar="DIR", help="plan bundle directory (build-plan --out)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port, logged)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                             "/v1/models, /health) on this port too (0: any free port, logged; default: off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (-1: off)")
    parser.add_argument("--grace-seconds", type=float, default=30.0,
                        help="on SIGTERM, how long running streams may take to finish")
    parser.add_argument("--max-message-bytes", type=int, default=Limits().max_message_bytes)
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve both doors over TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--auth-token-file", help="file holding a bearer token every call must send")
    parser.add_argument("--open-health", action="store_true",
                        help="with --auth-token-file: answer health checks and reflection without the token")
    parser.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S, metavar="SECONDS",
                        help="tensor-parallel plans: how long a collective may wait for a rank before the group is "
                             "declared broken (health NOT_SERVING, every rank exits)")
    parser.add_argument("--memory-limit", type=_size_arg, metavar="SIZE",
                        help="most memory the server may use (8GiB, ...; a container's share, say): on CPU the "
                             "whole process, on CUDA the plan's arenas on the device; a plan that does not fit "
                             "it, or the memory free here, is refused at start")
    # Development and tests: build the engine from a model file and explicit sizes instead of a plan bundle.
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--classes", default="256x8,1024x4,2048x2", help=argparse.SUPPRESS)  # TOKENSxCOUNT,...
    parser.add_argument("--max-seqs", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--step-tokens", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--queue-limit", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv))
    if (args.bundle is None) == (args.model is None):
        parser.error("give a plan bundle DIR")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    return args


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _engine_from_args(args: argparse.Namespace, ranks: RankGroup | None = None) -> Engine:
    if args.bundle is not None:
        from slabserve.runtime.config import ModelLoadError
        from slabserve.runtime.bundle_checks import PlanMismatchError
        from slabserve.runtime.graph_io import GraphFormatError
        from slabserve.runtime.plan import PlanFormatError, read_plan

        try:
            _check_memory(read_plan(args.bundle), args.memory_limit)  # before Engine.from_plan allocates anything
            # server.warm_up runs the warm-up on the engine thread; the build runs where its OpenMP team ends with it
            return on_a_passing_thread(lambda: Engine.from_plan(args.bundle, warm_up=False, ranks=ranks))
        except (PlanFormatError, PlanMismatchError, PlanViolationError, ModelLoadError, GraphFormatError,
                InsufficientMemoryError) as err:
            raise SystemExit(f"slabserve serve: refusing to start: {err}") from None
    classes = []
    for item in args.classes.split(","):
        tokens, _, count = item.partition("x")
        classes.append(SlabClass(int(tokens), int(count)))
    config = EngineConfig(args.model, tuple(classes), max_seqs=args.max_seqs, step_tokens=args.step_tokens,
                          dtype=args.dtype, queue_limit=args.queue_limit)
    return on_a_passing_thread(lambda: Engine(config, warm_up=False))


def _check_memory(plan, limit_bytes: int | None) -> None:
    """Refuse (InsufficientMemoryError) a plan larger than the memory free here; log the figures either way."""
    free = free_memory(plan.engine.device, limit_bytes)
    log.info(json.dumps({"event": "memory_check", "planned_bytes": plan.totals.planned_bytes,
                         "free_bytes": free.free_bytes, "free_source": free.source}))
    check_plan_fits(plan, free)


def _seconds_since_process_start() -> float:
    """Wall time since this process was created (Linux /proc); since interpreter start elsewhere."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.process_time()


def main(argv: Sequence[str] | None = None) -> int:
    limit_malloc_arenas()  # before the engine's and gRPC's threads first allocate
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # before the engine: a bad file fails in milliseconds, not after loading
    access = Access.from_files(args.auth_token_file, args.tls_cert, args.tls_key, args.open_health)
    degree = _plan_degree(args)
    env = rendezvous_env()
    ranks = None
    if degree > 1 or (env is not None and int(env["WORLD_SIZE"]) > 1):  # a one-rank torchrun serves as plain serve
        if env is None:  # `slabserve serve DIR` of a tensor-parallel plan: start its ranks
            return launch(degree, argv, args.collective_timeout)
        ranks = _join(args, degree)
    claim_profiler_for_this_thread()  # the engine's allocation checks profile on another thread
    engine = _engine_from_args(args, ranks)
    if ranks is not None:
        try:
            ranks.ready(STARTUP_TIMEOUT_S)
        except GroupFailed as err:
            raise SystemExit(f"slabserve serve: refusing to start: {err}") from None
        if not ranks.leads:
            return _follow(engine, ranks)
    server = create_server(engine, args.host, args.port,
                           metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                           limits=Limits(max_message_bytes=args.max_message_bytes), access=access,
                           http_port=args.http_port)
    server.start()
    log.info(json.dumps({"event": "listening", "address": server.address, "metrics_port": args.metrics_port,
                         "http_port": server.http.port if server.http is not None else None}))
    try:
        server.warm_up()
    except (PlanViolationError, GroupFailed) as err:
        server.stop()
        raise SystemExit(f"slabserve serve: refusing to start: {err}") from None
    reuse = ({"prefix_reuse": True, "copy_min_tokens": engine.scheduler.copy_min_tokens,
              "copy_us_per_row": _us(engine.copy_row_s), "prefill_us_per_token": _us(engine.prefill_token_s),
              "declared_prefixes": engine.declared}
             if engine.prefix_reuse_off is None else {"prefix_reuse": False, "why": engine.prefix_reuse_off})
    log.info(json.dumps({"event": "serving", "address": server.address, "gemm": engine.gemm, **reuse,
                         "attention_us_per_1k_pairs": _us(engine.pair_seconds * 1000),
                         "startup_s": round(_seconds_since_process_start(), 2)}))
    while not stop.wait(0.5):
        if server.loop.failure is not None:
            if ranks is not None:
                _report_group_failure(ranks, server.loop.failure)
            server.stop()
            return 1
    log.info(json.dumps({"event": "draining", "grace_s": args.grace_seconds}))
    clean = server.drain(args.grace_seconds)
    if ranks is not None:
        _stop_followers(server, ranks)
    log.info(json.dumps({"event": "stopped", "clean": clean}))
    return 0


STARTUP_TIMEOUT_S = 600.0  # every rank builds its engine (reads its weights) before the first step
LINGER_S = 2.0  # after a group failure, health stays NOT_SERVING this long before the process ends


def _plan_degree(args: argparse.Namespace) -> int:
    if args.bundle is None:
        return 1
    from slabserve.runtime.plan import PlanFormatError, read_plan

    try:
        return read_plan(args.bundle).parallel.tensor
    except (PlanFormatError, OSError) as err:
        raise SystemExit(f"slabserve serve: refusing to start: {err}") from None


def _join(args: argparse.Namespace, degree: int) -> RankGroup:
    from slabserve.runtime.plan import read_plan

    env = rendezvous_env()
    if int(env["WORLD_SIZE"]) != degree:
        raise SystemExit(f"slabserve serve: refusing to start: plan {args.bundle} is tensor-parallel over {degree} "
                         f"rank(s) and this group has WORLD_SIZE={env['WORLD_SIZE']}: launch {degree} processes "
                         f"(torchrun --nproc-per-node {degree}), or `slabserve serve {args.bundle}` without torchrun")
    ranks = RankGroup.join(args.collective_timeout, read_plan(args.bundle).engine.device)
    log.info(json.dumps({"event": "rank_joined", "rank": ranks.rank, "world": ranks.world, "pid": os.getpid(),
                         "collective_timeout_s": args.collective_timeout}))
    return ranks


def _follow(engine: Engine, ranks: RankGroup) -> int:
    """A follower rank: run the steps rank 0 sends until it says stop (0) or the group breaks (1)."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains, then stops this rank
        signal.signal(sig, lambda *_: log.info(json.dumps({"event": "signal_ignored", "rank": ranks.rank,
                                                           "why": "rank 0 drains and then stops every rank"})))
    log.info(json.dumps({"event": "following", "rank": ranks.rank}))
    try:
        ranks.follow(engine)
    except GroupFailed as err:
        log.error(json.dumps({"event": "group_failed", "rank": ranks.rank, "error": str(err)}))
        return 1
    log.info(json.dumps({"event": "stopped", "rank": ranks.rank, "clean": True}))
    ranks.close()
    return 0


def _report_group_failure(ranks: RankGroup, failure: BaseException) -> None:
    """Name the ranks that stopped answering, hold health NOT_SERVING for LINGER_S, and let the process end (the
    others end when the group breaks, or by the launcher)."""
    suspects = ranks.diagnose() if isinstance(failure, GroupFailed) else []
    for s in suspects:
        log.error(json.dumps({"event": "rank_failed", **s}))
    log.error(json.dumps({"event": "group_failed", "rank": ranks.rank, "error": repr(failure),
                          "ranks_failed": [s["rank"] for s in suspects]}))
    time.sleep(LINGER_S)


def _stop_followers(server, ranks: RankGroup) -> None:
    """After the drain: the engine thread has ended, so this thread may use the group: tell every rank to stop."""
    if server.loop.running or server.loop.failure is not None:
        return
    try:
        ranks.stop()
    except GroupFailed as err:
        log.error(json.dumps({"event": "group_failed", "rank": 0, "error": str(err)}))
    ranks.close()



def _us(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e6, 2)


if __name__ == "__main__":
    sys.exit(main())
