"""`slabserve generate`: stream one answer from a slabserve server; and `health`: wait until a server is SERVING.

Contract: `main(argv)` writes the generated text to stdout as it arrives (flushed per event) and the finish reason,
usage and timings to stderr; a gRPC error prints its status code and message to stderr and exits 1. argv may start
with the subcommand ("generate", the default, or "health").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc

_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "cancelled"}


def build_request(text: str, chat: bool, max_tokens: int | None, temperature: float | None,
                  seed: int | None = None) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    if chat:
        request.messages.messages.add(role="user", content=text)
    else:
        request.prompt = text
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    if temperature is not None:
        request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    return request


# gRPC's own retries: a call refused with RESOURCE_EXHAUSTED (a full queue, or a first token that would miss its
# deadline) is sent again after the server's `grpc-retry-pushback-ms` trailer, up to 5 attempts within the call's
# deadline. Nothing was streamed before such a refusal, so a retry never repeats output.
RETRY_SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": "slabserve.v1.SlabServe"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.5s", "maxBackoff": "10s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]})
CHANNEL_OPTIONS = (("grpc.enable_retries", 1), ("grpc.service_config", RETRY_SERVICE_CONFIG))


def open_channel(addr: str, tls_ca: str | None = None, retry: bool = True) -> grpc.Channel:
    """A channel to the server (retrying refusals as RETRY_SERVICE_CONFIG says, unless `retry` is False): TLS
    verified against the PEM file `tls_ca` when given, plaintext otherwise."""
    options = CHANNEL_OPTIONS if retry else ()
    if tls_ca is None:
        return grpc.insecure_channel(addr, options=options)
    return grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes()),
                               options=options)


def auth_metadata(token_file: str | None) -> tuple[tuple[str, str], ...]:
    """The bearer-token header for servers started with --auth-token-file."""
    if token_file is None:
        return ()
    return (("authorization", f"Bearer {Path(token_file).read_text().strip()}"),)


def generate(args: argparse.Namespace) -> int:
    request = build_request(args.text, args.chat, args.max_tokens, args.temperature, args.seed)
    if args.first_token_deadline_ms is not None:
        request.first_token_deadline_ms = args.first_token_deadline_ms
    with open_channel(args.addr, args.tls_ca) as channel:
        stub = pb_grpc.SlabServeStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout, metadata=auth_metadata(args.auth_token_file)):
                if response.HasField("token"):
                    sys.stdout.write(response.token.text)
                    sys.stdout.flush()
                else:
                    _finish(response.finished)
        except grpc.RpcError as exc:
            sys.stdout.write("\n")
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def _finish(finished: pb.GenerationFinished) -> None:
    sys.stdout.write("\n")
    sys.stdout.flush()
    t, u = finished.timings, finished.usage
    cached = f" ({u.cached_tokens} from retained KV)" if u.cached_tokens else ""
    print(f"[finish: {_REASONS.get(finished.reason, finished.reason)}; prompt {u.prompt_tokens} tokens{cached}, "
          f"completion {u.completion_tokens} tokens; queue {t.queue_seconds * 1000:.0f} ms, "
          f"time to first token {t.time_to_first_token_seconds * 1000:.0f} ms, "
          f"{t.time_per_output_token_seconds * 1000:.1f} ms per token after it]", file=sys.stderr)


def serving_status(addr: str, timeout: float = 1.0, tls_ca: str | None = None,
                   token_file: str | None = None) -> str:
    """The server's overall health status name (SERVING, NOT_SERVING, ...), or UNREACHABLE."""
    with open_channel(addr, tls_ca) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout, metadata=auth_metadata(token_file))
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    status = "UNREACHABLE"
    while True:
        status = serving_status(args.addr, tls_ca=args.tls_ca, token_file=args.auth_token_file)
        if status == "SERVING":
            print(f"{args.addr}: SERVING", file=sys.stderr)
            return 0
        if args.pid is not None and not _alive(args.pid):
            print(f"{args.addr}: the server process {args.pid} exited before it was SERVING", file=sys.stderr)
            return 1
        if time.monotonic() >= deadline:
            print(f"{args.addr}: not SERVING after {args.wait:g} s (last health: {status})", file=sys.stderr)
            return 1
        time.sleep(0.25)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slabserve", description="Talk to a slabserve server.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream an answer to stdout; usage and timings to stderr")
    gen.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT of the server")
    gen.add_argument("--chat", action="store_true", help="send the text as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, help="tokens to generate at most (default: the server's)")
    gen.add_argument("--temperature", type=float, help="0 (the default) is greedy")
    gen.add_argument("--seed", type=int, help="seed for sampling")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline of the call, in seconds")
    gen.add_argument("--first-token-deadline-ms", type=int,
                     help="refuse at once (and retry after the server's pushback) when the first token would "
                          "come later than this")
    gen.add_argument("text", help="the prompt, or the user message with --chat")
    hl = sub.add_parser("health", help="wait until the server's health is SERVING (exit 1 on timeout)")
    hl.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT of the server")
    hl.add_argument("--wait", type=float, default=0.0, help="seconds to keep trying (0: check once)")
    hl.add_argument("--pid", type=int, help="stop waiting early if this process (the server) exits")
    for command in (gen, hl):
        command.add_argument("--tls-ca", help="PEM certificate(s) to verify a TLS server with (default: plaintext)")
        command.add_argument("--auth-token-file", help="file holding the server's bearer token")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("generate", "health", "-h", "--help"):
        argv = ["generate", *argv]
    args = _parser().parse_args(argv)
    return generate(args) if args.command == "generate" else wait_serving(args)


if __name__ == "__main__":
    sys.exit(main())
