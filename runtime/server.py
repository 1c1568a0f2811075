"""The server: one Engine behind one engine loop, with its front doors (gRPC always, OpenAI-compatible HTTP when
asked), health, reflection and metrics.

Contract: `create_server(engine, host, port, ..., http_port=None)` takes an `Engine` and returns a `SlabServer`;
`start()` binds and answers at once with health NOT_SERVING (HTTP /health 503), `warm_up()` runs the engine's
warm-up on the engine thread (the thread that will step it) unless it ran there already, then a request through
the engine, and turns health SERVING; `drain(grace_s)` stops admission (UNAVAILABLE / 503, health NOT_SERVING),
lets running streams finish within the grace period, cancels what is left and stops.

Rooms: the engine loop and its thread (runtime.engine_loop); what both doors share, validation and the status
table (runtime.edge); the gRPC door (runtime.grpc_api) and the HTTP door (runtime.http_api), each a thin
translation onto the same `Gateway`; access control (runtime.access); the `slabserve serve` command
(runtime.serve_cli, also `python -m slabserve.runtime.server`).

Threads (the Engine is not thread-safe): gRPC worker threads (`HandlerThreads`) and the HTTP door's event loop
validate and convert requests, tokenize (the tokenizer is read-only), and reach the engine only through the
`EngineLoop`'s commands; one engine thread owns the Engine.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.access import Access, BearerTokenInterceptor
from slabserve.runtime.edge import Gateway, Limits
from slabserve.runtime.engine import Engine, StoppingOptions
from slabserve.runtime.engine_loop import EngineLoop
from slabserve.runtime.grpc_api import (SERVICE_NAME, DecodeErrorsAsInvalidArgument, HandlerThreads,
                                        SlabServeServicer)
from slabserve.runtime.http_api import HttpServer
from slabserve.runtime.metrics import Metrics
from slabserve.runtime.scheduler import FinishReason

__all__ = ["SERVICE_NAME", "Access", "Limits", "SlabServer", "create_server", "main"]

log = logging.getLogger("slabserve.server")


class SlabServer:
    """A gRPC server over one Engine; see the module docstring for its life: start, warm_up, drain."""

    def __init__(self, engine: Engine, host: str, port: int, metrics_port: int | None, limits: Limits,
                 max_workers: int | None, access: Access = Access(), http_port: int | None = None):
        scheduler = engine.scheduler
        self.metrics = Metrics(scheduler.allocator.classes)
        self.health = health.HealthServicer()
        self.loop = EngineLoop(engine, self.metrics, on_failure=lambda exc: self._set_health(False))
        self.gateway = Gateway(self.loop, limits, self.metrics)
        self.servicer = SlabServeServicer(self.gateway)
        # One worker per stream the engine can hold (running + every class queue full), plus room for unary calls;
        # beyond that gRPC answers RESOURCE_EXHAUSTED instead of queueing calls without bound.
        streams = scheduler.max_seqs + scheduler.queue_limit * len(scheduler.allocator.classes)
        workers = max_workers or streams + 16
        options = [("grpc.max_receive_message_length", limits.max_message_bytes),
                   ("grpc.max_send_message_length", limits.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        # The token check comes first: a caller without it learns nothing, not even whether its bytes parse.
        interceptors = [BearerTokenInterceptor(access)] if access.token else []
        interceptors.append(DecodeErrorsAsInvalidArgument())
        self._pool = HandlerThreads(workers)
        self.grpc_server = grpc.server(self._pool, options=options, maximum_concurrent_rpcs=workers,
                                       interceptors=interceptors)
        pb_grpc.add_SlabServeServicer_to_server(self.servicer, self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.grpc_server)
        self.host = host
        if access.tls_cert is not None:
            credentials = grpc.ssl_server_credentials([(access.tls_key, access.tls_cert)])
            self.port = self.grpc_server.add_secure_port(f"{host}:{port}", credentials)
        else:
            self.port = self.grpc_server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self._metrics_port = metrics_port
        self._stop_metrics: Callable[[], None] | None = None
        # The HTTP door: its own thread and event loop, the same gateway (state, ids, validation, engine loop).
        self.http = HttpServer(self.gateway, host, http_port, access, limits) if http_port is not None else None
        self._set_health(False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Start the engine thread and answer calls (health NOT_SERVING, Generate UNAVAILABLE until warm_up)."""
        self.loop.start()
        self.grpc_server.start()
        if self.http is not None:
            self.http.start()
        if self._metrics_port is not None:
            self._stop_metrics = self.metrics.serve(self.host, self._metrics_port)

    def warm_up(self, timeout: float = 300.0) -> None:
        """Run the engine's warm-up (every bucket under the allocation check; PlanViolationError if the plan is
        violated) unless the engine thread ran it already, then one short request end to end; if every slab comes
        back, turn health SERVING. The engine thread runs both, so nothing else touches the engine meanwhile, and
        the per-thread pools under the step (MKL's buffers, OpenMP's team) reach their high-water mark on the
        thread that serves (an engine warmed on another thread would grow them at its first long prompt)."""
        engine = self.loop.engine
        num_prompt = max(1, min(8, engine.scheduler.max_request_tokens - 2))

        def run() -> None:
            if engine.warmed_on != threading.get_ident():
                engine.warm_up()
            done = engine.generate([[1] * num_prompt], stopping=StoppingOptions(max_tokens=2, ignore_eos=True))
            if done[0].finish_reason is not FinishReason.LENGTH or len(done[0].token_ids) != 2:
                raise RuntimeError(f"warm-up request ended with {done[0].finish_reason}")
            load = engine.scheduler.load()
            if load.free_per_class != load.total_per_class:
                raise RuntimeError(f"warm-up left slabs in use: free {load.free_per_class} of {load.total_per_class}")

        self.loop.call(run, timeout=timeout)
        self.loop.post(self.loop.observe_load)
        self.gateway.state = "serving"
        self._set_health(True)

    def drain(self, grace_s: float = 30.0) -> bool:
        """Refuse new requests, let open streams finish within `grace_s`, cancel the rest, stop. True if none was
        cut short."""
        self.gateway.state = "draining"
        self._set_health(False)
        deadline = time.monotonic() + grace_s
        while self.loop.num_streams() and time.monotonic() < deadline and self.loop.failure is None:
            time.sleep(0.05)
        left = self.loop.num_streams()
        if left:
            log.warning(json.dumps({"event": "drain_grace_expired", "cancelled_streams": left}))
            self.loop.post(self.loop.abort_all)
        self.stop(grace_s=5.0)
        return left == 0

    def stop(self, grace_s: float = 0.0) -> None:
        if self.http is not None:
            self.http.stop()
        self.grpc_server.stop(grace_s).wait()
        self._pool.shutdown(wait=False)  # idle threads end now, busy ones when their call returns
        self.loop.stop()
        if self._stop_metrics is not None:
            self._stop_metrics()
            self._stop_metrics = None

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            self.health.set(service, status)


def create_server(engine: Engine, host: str = "127.0.0.1", port: int = 50051, *, metrics_port: int | None = None,
                  limits: Limits = Limits(), max_workers: int | None = None, access: Access = Access(),
                  http_port: int | None = None) -> SlabServer:
    """A server over a ready Engine, bound but not started (`port=0` picks a free port: see `.port`);
    `http_port` (None: off; 0: any free port, see `.http.port`) adds the OpenAI-compatible HTTP door."""
    return SlabServer(engine, host, port, metrics_port, limits, max_workers, access, http_port)


def main(argv: Sequence[str] | None = None) -> int:
    """`slabserve serve`: see runtime.serve_cli."""
    from slabserve.runtime.serve_cli import main as serve_main

    return serve_main(argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
