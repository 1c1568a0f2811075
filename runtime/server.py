"""The gRPC edge: slabserve.v1 (proto/slabserve/v1/serving.proto), grpc.health.v1 and reflection over one Engine.

Contract: `create_server(engine, host, port, ...)` takes an `Engine` and returns a `SlabServer`; `start()`
binds and answers at once with health NOT_SERVING, `warm_up()` runs the engine's warm-up on the engine thread (the
thread that will step it) unless it ran there already, then a request through the engine, and turns health
SERVING, `drain(grace_s)` stops admission (UNAVAILABLE, health NOT_SERVING), lets running streams finish within the
grace period, cancels what is left and stops. Protobuf is converted to the engine's dataclasses here and nowhere
else (`_request_from_pb`, `_event_to_pb`), and `_status_for` is the one place exceptions become status codes.

Threads (the Engine is not thread-safe):
- gRPC worker threads (`HandlerThreads`: all started with the server, the last to go idle reused first) run the
  handlers: they validate and convert requests, tokenize (the tokenizer is read-only), and reach the engine only
  through `EngineLoop` commands. A Generate handler then blocks on its own event queue (its *sink*) and yields
  each event as it arrives. A request that does not even parse as protobuf is INVALID_ARGUMENT too.
- One engine thread (`EngineLoop`) owns the Engine: between steps it runs every queued command (submit, abort,
  load, ...), then runs one step and puts each event into its request's sink. It sleeps on the command queue when
  the engine has no work, and gives malloc's free pages back to the OS once per idle spell.
- `main` caps glibc's malloc arenas, checks that the plan fits the memory free here (runtime.memcheck) before
  the Engine allocates, then waits on the main thread for SIGTERM/SIGINT and drains. The server writes no files:
  a SIGKILL leaves nothing half-written, and a restart on the same bundle is a clean start.

Cancellation: each Generate call registers a gRPC termination callback that posts `abort` to the engine thread.
It fires when the client cancels or disconnects, when the call's deadline passes, and after normal completion
(where the abort finds nothing). The abort frees the slab before the next step; the engine's CANCELLED event then
wakes the handler, which returns. Engine-side ids are the server's own (`s<n>`), never the client's, so a late
abort can never hit a newer request that reused the client's id.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import functools
import hmac
import itertools
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.admission import AdmissionView, OverloadedError
from slabserve.runtime.engine import Engine, EngineConfig, GenerationEvent, StoppingOptions
from slabserve.runtime.executor import PlanViolationError
from slabserve.runtime.memcheck import InsufficientMemoryError, check_plan_fits, free_memory, parse_size
from slabserve.runtime.metrics import Metrics
from slabserve.runtime.sampler import SamplingParams
from slabserve.runtime.scheduler import FinishReason, InvalidRequestError, OutOfRangeError, QueueFullError
from slabserve.runtime.slab_allocator import SlabClass
from slabserve.runtime.tokenizer import ChatTemplateError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SlabServe"].full_name   # "slabserve.v1.SlabServe"
log = logging.getLogger("slabserve.server")
request_log = logging.getLogger("slabserve.requests")

_FINISH_TO_PB = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                 FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED}
_KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool"})
_DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may carry (documented in serving.proto); beyond them: INVALID_ARGUMENT."""

    max_message_bytes: int = 1 << 20     # gRPC receive/send limit per message (grpc answers RESOURCE_EXHAUSTED)
    max_request_id_chars: int = 128
    max_stop_strings: int = 16
    max_stop_string_chars: int = 128
    max_stop_token_ids: int = 64
    max_messages: int = 256


class Unavailable(Exception):
    """UNAVAILABLE: warming up or draining."""


class EngineFailed(RuntimeError):
    """INTERNAL: the engine thread hit an error and stopped; the server no longer serves."""


# ---- the engine thread ------------------------------------------------------------------------------------------

class EngineLoop:
    """Owns the Engine on one thread; other threads send it commands. See the module docstring."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue = queue.SimpleQueue()   # (fn, Future | None)
        self._sinks: dict[str, queue.SimpleQueue] = {}            # engine request id -> its handler's events
        self._stopping = threading.Event()
        self.failure: BaseException | None = None
        self._heap_released = False
        # slab class -> the RESOURCE_EXHAUSTED its next request gets; replaced (never mutated) by the engine thread
        self._full_queues: dict[int, QueueFullError] = {}
        # admission by latency on the gRPC threads: the view published after the last step, plus the requests
        # admitted against it that the engine thread has not submitted yet (engine id -> (prompt tokens, deadline))
        self._admission_lock = threading.Lock()
        self._admission: AdmissionView | None = None
        self._unsubmitted: dict[str, tuple[int, float]] = {}
        self._thread = threading.Thread(target=self._run, name="slabserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put((lambda: None, None))  # wake it
        self._thread.join(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` on the engine thread between steps; return its result or raise its exception."""
        if self.failure is not None:
            raise EngineFailed(f"the engine stopped: {self.failure!r}")
        future: futures.Future = futures.Future()
        self._commands.put((fn, future))
        return future.result(timeout)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the engine thread between steps, without waiting (for gRPC callbacks, which must not block)."""
        self._commands.put((fn, None))

    def submit(self, prompt_ids: tuple[int, ...], sampling: SamplingParams, stopping: StoppingOptions,
               engine_id: str) -> queue.SimpleQueue:
        """Submit on the engine thread; returns the sink its events will arrive in. Raises the engine's errors.

        A request whose slab class has a full queue (as of the last step), or whose first token the work ahead
        would delay past the plan's bound (runtime.admission), is refused here, at once: waiting for the step in
        progress (up to a second on a CPU) to learn the same answer would make overload slow to refuse. A queue
        that looks open still gets the engine thread's exact check."""
        need = len(prompt_ids) + stopping.max_tokens
        home = self.engine.scheduler.allocator.class_for(need) if need >= 1 else None
        full = self._full_queues.get(home) if home is not None else None
        if full is not None:
            raise copy.copy(full)
        deadline = None
        if home is not None and prompt_ids:
            with self._admission_lock:
                if self._admission is not None:
                    deadline = self._admission.admit(len(prompt_ids), home, time.monotonic())  # or DelayBoundError
                    self._unsubmitted[engine_id] = (len(prompt_ids), deadline)
        sink: queue.SimpleQueue = queue.SimpleQueue()

        def submit() -> None:
            try:
                self.engine.submit(prompt_ids, sampling, stopping, engine_id, deadline=deadline)
            finally:
                with self._admission_lock:
                    self._unsubmitted.pop(engine_id, None)
            self._sinks[engine_id] = sink

        try:
            self.call(submit)
        finally:
            if deadline is not None:  # a no-op once submit() ran; when the engine thread failed first, forget it
                with self._admission_lock:
                    self._unsubmitted.pop(engine_id, None)
        return sink

    def abort(self, engine_id: str) -> None:
        self.post(lambda: self.engine.abort(engine_id))

    def num_streams(self) -> int:
        return len(self._sinks)  # read without the engine thread: a dict's len is atomic

    def abort_all(self) -> None:
        """Cancel every request with an open stream (engine thread only: post it)."""
        for engine_id in list(self._sinks):
            self.engine.abort(engine_id)

    def _run(self) -> None:
        try:
            self._publish_admission()
            while not self._stopping.is_set():
                self._run_commands(block=not self.engine.has_work())
                if self.engine.has_work():
                    self._route(self.engine.step())
                    self.observe_load()
                self._full_queues = self.engine.scheduler.full_queues()
                self._publish_admission()
        except BaseException as exc:  # noqa: BLE001 - the engine thread must report, not vanish
            self._fail(exc)

    def _publish_admission(self) -> None:
        with self._admission_lock:
            self._admission = self.engine.scheduler.admission_view(list(self._unsubmitted.values()))

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            if block and not self._heap_released:  # idle for a while: a good moment, and only once per idle spell
                _release_free_heap()
                self._heap_released = True
            return
        self._heap_released = False
        while True:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - a command's error belongs to its caller
                if future is not None:
                    future.set_exception(exc)
                else:
                    log.warning(json.dumps({"event": "command_failed", "error": repr(exc)}))
            else:
                if future is not None:
                    future.set_result(result)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _route(self, events: Sequence[GenerationEvent]) -> None:
        tokens = 0
        for event in events:
            tokens += len(event.token_ids)
            if event.finished is None:
                sink = self._sinks.get(event.request_id)
            else:
                sink = self._sinks.pop(event.request_id, None)
                if self.metrics is not None and event.timings is not None:
                    t = event.timings
                    self.metrics.observe_finished(t.queue_s, t.ttft_s, t.tpot_s, event.completion_tokens)
            if sink is not None:
                sink.put(event)
        if self.metrics is not None and tokens:
            self.metrics.observe_tokens(tokens)

    def observe_load(self) -> None:
        if self.metrics is not None:
            load = self.engine.scheduler.load()
            self.metrics.observe_load(load.free_per_class, load.total_per_class, load.queued_per_class,
                                      load.running)

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        log.error(json.dumps({"event": "engine_failed", "error": repr(exc)}))
        for sink in self._sinks.values():
            sink.put(EngineFailed(f"the engine stopped: {exc!r}"))
        self._sinks.clear()
        while True:  # callers waiting on a command must not hang
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.set_exception(EngineFailed(f"the engine stopped: {exc!r}"))
        if self._on_failure is not None:
            self._on_failure(exc)


# ---- process memory ---------------------------------------------------------------------------------------------

@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): its malloc is left as it is
        return None


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (M_ARENA_MAX; MALLOC_ARENA_MAX in the environment wins). By default glibc gives
    threads that contend for malloc arenas of their own, up to 8 per core, and memory freed in one arena serves
    no other: with a pool of handler threads the process keeps each arena's high-water mark of gRPC and Python
    buffers, and its resident memory drifts up by megabytes under faults and bursts. The serving loop allocates
    nothing (its memory is planned), so malloc serves only the control path, which runs under the GIL anyway."""
    libc = _glibc()
    if libc is not None and "MALLOC_ARENA_MAX" not in os.environ:
        m_arena_max = -8  # malloc.h
        libc.mallopt(m_arena_max, arenas)


def _release_free_heap() -> None:
    """Give the pages malloc holds free back to the OS (glibc's malloc_trim). glibc returns only the top of a heap
    on its own, so after a burst the gRPC and Python buffers it freed would stay resident; the engine thread calls
    this once each time the server falls idle, off the serving path."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# ---- protobuf <-> engine dataclasses (the only place either side sees the other) ------------------------------

def _input_from_pb(message, limits: Limits) -> str | tuple[int, ...] | list[dict[str, str]]:
    """The `input` oneof of a GenerateRequest or TokenizeRequest -> what `Engine.prompt_ids` takes."""
    which = message.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("input", "set one of prompt, token_ids, messages")
    if which == "prompt":
        if not message.prompt:
            raise InvalidRequestError("prompt", "is empty")
        return message.prompt
    if which == "token_ids":
        if not message.token_ids.ids:
            raise InvalidRequestError("token_ids", "is empty")
        return tuple(message.token_ids.ids)
    messages = message.messages.messages
    if not messages:
        raise InvalidRequestError("messages", "is empty; at least one message is needed")
    if len(messages) > limits.max_messages:
        raise InvalidRequestError("messages", f"{len(messages)} messages; at most {limits.max_messages}")
    for i, m in enumerate(messages):
        if m.role not in _KNOWN_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"{m.role[:40]!r} is not one of "
                                                             f"{', '.join(sorted(_KNOWN_ROLES))}")
    return [{"role": m.role, "content": m.content} for m in messages]


def _sampling_from_pb(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        seed=s.seed if s.HasField("seed") else None,
    )


def _stopping_from_pb(s: pb.StoppingOptions, limits: Limits, vocab_size: int, num_prompt: int,
                      max_request_tokens: int) -> StoppingOptions:
    if s.HasField("max_tokens"):
        if s.max_tokens < 1:
            raise InvalidRequestError("stopping.max_tokens", f"must be >= 1, got {s.max_tokens}")
        max_tokens = s.max_tokens
    else:  # the default, lowered to what fits beside the prompt (a prompt that leaves no room gets OUT_OF_RANGE)
        max_tokens = max(1, min(_DEFAULT_MAX_TOKENS, max_request_tokens - num_prompt))
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidRequestError("stopping.stop", f"{len(s.stop)} stop strings; at most {limits.max_stop_strings}")
    for i, stop in enumerate(s.stop):
        if not 1 <= len(stop) <= limits.max_stop_string_chars:
            raise InvalidRequestError(f"stopping.stop[{i}]", f"has {len(stop)} characters; 1 to "
                                                             f"{limits.max_stop_string_chars} allowed")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError("stopping.stop_token_ids", f"{len(s.stop_token_ids)} ids; at most "
                                                             f"{limits.max_stop_token_ids}")
    bad = [t for t in s.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError("stopping.stop_token_ids", f"id {bad[0]} is outside the vocabulary "
                                                             f"[0, {vocab_size})")
    return StoppingOptions(max_tokens=max_tokens, stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
                           ignore_eos=s.ignore_eos)


def _event_to_pb(request_id: str, event: GenerationEvent) -> pb.GenerateResponse:
    if event.finished is None:
        return pb.GenerateResponse(request_id=request_id,
                                   token=pb.TokenOutput(token_ids=event.token_ids, text=event.text))
    t = event.timings
    timings = pb.Timings(queue_seconds=t.queue_s, time_to_first_token_seconds=t.ttft_s,
                         time_per_output_token_seconds=t.tpot_s) if t is not None else None
    return pb.GenerateResponse(request_id=request_id, finished=pb.GenerationFinished(
        reason=_FINISH_TO_PB[event.finished],
        usage=pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
        timings=timings, token_ids=event.token_ids, text=event.text))


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The one map from exceptions to (status code, message, trailing metadata)."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), (("slabserve-field", exc.field),)
    if isinstance(exc, ChatTemplateError):
        field = f"messages[{exc.message_index}].role" if exc.message_index is not None else "messages"
        return grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {exc}", (("slabserve-field", field),)
    if isinstance(exc, OutOfRangeError):
        return grpc.StatusCode.OUT_OF_RANGE, str(exc), (("slabserve-limit-tokens", str(exc.limit_tokens)),)
    if isinstance(exc, OverloadedError):  # a full queue, or admission by latency
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (("slabserve-slab-class", str(exc.class_index)),
                                                              ("retry-after-ms", str(exc.retry_after_ms)))
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc), ()
    log.error(json.dumps({"event": "internal_error", "error": repr(exc)}))
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", ()


# ---- the service ------------------------------------------------------------------------------------------------

class SlabServeServicer(pb_grpc.SlabServeServicer):
    def __init__(self, loop: EngineLoop, limits: Limits, metrics: Metrics | None):
        self.loop = loop
        self.engine = loop.engine
        self.limits = limits
        self.metrics = metrics
        self.state = "warming up"          # "warming up" | "serving" | "draining"
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}    # client request id -> engine id, while its stream is open
        self._client_ids = itertools.count()   # ids for requests that came without one
        self._engine_ids = itertools.count()

    # ---- Generate -------------------------------------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        started = time.monotonic()
        request_id = request.request_id or f"req-{next(self._client_ids)}"
        # "open" is popped by whoever logs the call first: the handler, or the termination callback on a cancel
        record: dict[str, Any] = {"event": "request", "request_id": request_id[:128], "peer": context.peer(),
                                  "open": True}
        engine_id = None
        try:
            self._check_serving()
            prompt_ids, sampling, stopping = self._convert(request)
            record["prompt_tokens"] = len(prompt_ids)
            engine_id = self._claim(request_id)
            sink = self.loop.submit(prompt_ids, sampling, stopping, engine_id)
            if not context.add_callback(lambda: self._on_terminated(context, engine_id, record, started)):
                self._on_terminated(context, engine_id, record, started)  # the call ended before we got here
            for event in self._events(sink):
                if event.finished is not None:  # log first: after a cancel, gRPC may never resume us
                    self._log(record, started, "OK", event)
                yield _event_to_pb(request_id, event)
                if event.finished is not None:
                    return
        except Exception as exc:  # noqa: BLE001 - every error leaves through _status_for
            code, message, trailers = _status_for(exc)
            self._log(record, started, code.name, None, message)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        finally:
            if engine_id is not None:
                self._release(request_id, engine_id)

    def _convert(self, request: pb.GenerateRequest) -> tuple[tuple[int, ...], SamplingParams, StoppingOptions]:
        if len(request.request_id) > self.limits.max_request_id_chars:
            raise InvalidRequestError("request_id", f"has {len(request.request_id)} characters; at most "
                                                    f"{self.limits.max_request_id_chars}")
        prompt_ids = self.engine.prompt_ids(_input_from_pb(request, self.limits))
        sampling = _sampling_from_pb(request.sampling)
        try:
            sampling.validate(self.engine.model_config.vocab_size)
        except ValueError as exc:  # "sampling.top_p = 1.5 is out of range: ..."
            field, _, detail = str(exc).partition(" = ")
            raise InvalidRequestError(field, detail) from None
        stopping = _stopping_from_pb(request.stopping, self.limits, self.engine.model_config.vocab_size,
                                     len(prompt_ids), self.engine.scheduler.max_request_tokens)
        return prompt_ids, sampling, stopping

    def _on_terminated(self, context: grpc.ServicerContext, engine_id: str, record: dict, started: float) -> None:
        """gRPC's termination callback: free the slab at the next step (a no-op after a normal end) and log a cancel."""
        self.loop.abort(engine_id)
        if "open" in record:
            remaining = context.time_remaining()  # None without a deadline
            expired = remaining is not None and remaining <= 0
            self._log(record, started, "DEADLINE_EXCEEDED" if expired else "CANCELLED", None)

    def _events(self, sink: queue.SimpleQueue):
        while True:
            try:
                item = sink.get(timeout=1.0)
            except queue.Empty:
                if self.loop.failure is not None:
                    raise EngineFailed(f"the engine stopped: {self.loop.failure!r}") from None
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished is not None:
                return

    def _claim(self, request_id: str) -> str:
        with self._lock:
            if request_id in self._live:
                raise InvalidRequestError("request_id", f"{request_id!r} is already queued or running")
            engine_id = f"s{next(self._engine_ids)}"
            self._live[request_id] = engine_id
            return engine_id

    def _release(self, request_id: str, engine_id: str) -> None:
        with self._lock:
            if self._live.get(request_id) == engine_id:
                del self._live[request_id]

    def _check_serving(self) -> None:
        if self.state != "serving":
            raise Unavailable(f"the server is {self.state}; retry later or on another replica")

    def _log(self, record: dict, started: float, code: str, event: GenerationEvent | None,
             message: str | None = None) -> None:
        if record.pop("open", None) is None:  # already logged (dict.pop is atomic)
            return
        record["code"] = code
        record["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
        reason = event.finished.value if event is not None else ""
        if event is not None:
            record.update(finish_reason=reason, completion_tokens=event.completion_tokens)
            if event.timings is not None:
                record.update(queue_ms=round(event.timings.queue_s * 1000, 1),
                              ttft_ms=round(event.timings.ttft_s * 1000, 1),
                              tpot_ms=round(event.timings.tpot_s * 1000, 2))
        if message is not None:
            record["error"] = message[:300]
        request_log.info(json.dumps(record))
        if self.metrics is not None:
            self.metrics.count_request(code, reason)

    # ---- unary calls ----------------------------------------------------------------------------------------------

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        try:
            return pb.TokenizeResponse(token_ids=self.engine.prompt_ids(_input_from_pb(request, self.limits)))
        except Exception as exc:  # noqa: BLE001
            self._abort(context, exc)

    def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        engine, scheduler = self.engine, self.engine.scheduler
        classes = scheduler.allocator.classes
        return pb.GetModelInfoResponse(
            model_name=engine.model_config.name or Path(engine.config.model).name,
            plan_id=engine.plan_id,
            context_limit=engine.model_config.context_limit,
            max_request_tokens=scheduler.max_request_tokens,
            slab_classes=[pb.SlabClass(index=i, tokens=c.tokens, count=c.count) for i, c in enumerate(classes)],
            vocab_size=engine.model_config.vocab_size, max_running=scheduler.max_seqs,
            step_tokens=scheduler.step_tokens, queue_limit=scheduler.queue_limit,
            has_chat_template=engine.tokenizer.chat_template is not None,
            max_queue_delay_ms=round(scheduler.max_queue_delay_s * 1000) if scheduler.max_queue_delay_s else 0)

    def GetLoad(self, request, context) -> pb.GetLoadResponse:
        try:
            load = self.loop.call(self.engine.scheduler.load, timeout=30)
        except Exception as exc:  # noqa: BLE001
            self._abort(context, exc)
        classes = self.engine.scheduler.allocator.classes
        return pb.GetLoadResponse(
            classes=[pb.ClassLoad(index=i, tokens=c.tokens, free_slabs=f, total_slabs=t, queued=q)
                     for i, (c, f, t, q) in enumerate(zip(classes, load.free_per_class, load.total_per_class,
                                                          load.queued_per_class))],
            running=load.running, queued=sum(load.queued_per_class), draining=self.state == "draining")

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        try:
            if not request.request_id:
                raise InvalidRequestError("request_id", "is empty")
            with self._lock:
                engine_id = self._live.get(request.request_id)
            aborted = engine_id is not None and self.loop.call(lambda: self.engine.abort(engine_id), timeout=30)
            return pb.AbortResponse(aborted=bool(aborted))
        except Exception as exc:  # noqa: BLE001
            self._abort(context, exc)

    @staticmethod
    def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
        code, message, trailers = _status_for(exc)
        context.set_trailing_metadata(trailers)
        context.abort(code, message)


# ---- the server -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Access:
    """Who may call: TLS (PEM bytes of the server's certificate chain and key) and a bearer token. With a token,
    every call must send `authorization: Bearer <token>` or gets UNAUTHENTICATED; health checks and reflection
    are answered without it only when `open_health` says so (a load balancer's probe, say)."""

    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    token: str | None = None
    open_health: bool = False


_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class _BearerToken(grpc.ServerInterceptor):
    """Refuses calls without the operator's bearer token, before any handler (or the engine) sees them."""

    def __init__(self, token: str, open_health: bool):
        self._expected = f"Bearer {token}".encode()
        self._open_health = open_health

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or (self._open_health and handler_call_details.method.startswith(_OPEN_PREFIXES)):
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode(), self._expected):
            return handler
        return _refusal(handler)


class _Undecodable:
    """What a tolerant deserializer returns for bytes that are not the method's request message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class _DecodeErrorsAsInvalidArgument(grpc.ServerInterceptor):
    """Answers a request that does not parse (truncated bytes, a wrong wire type, a string that is not UTF-8: a
    client that skips protobuf's own checks) with INVALID_ARGUMENT naming `request`, instead of grpc's INTERNAL
    "Exception deserializing request!", so every status a client can provoke is a documented one. Methods whose
    requests stream (reflection) keep grpc's own handling."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return _tolerant(handler)


def _tolerant(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that never raises and a behavior that refuses what it could not decode."""
    decode = handler.request_deserializer
    behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

    def deserialize(data: bytes):
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or anything a parser raises on garbage
            return _Undecodable(str(exc) or type(exc).__name__)

    def refuse(request: _Undecodable, context: grpc.ServicerContext) -> None:
        code, message, trailers = _status_for(InvalidRequestError("request", f"cannot be decoded: {request.reason}"))
        context.set_trailing_metadata(trailers)
        context.abort(code, message)

    def unary(request, context):
        if isinstance(request, _Undecodable):
            refuse(request, context)
        return behavior(request, context)

    def streaming(request, context):
        if isinstance(request, _Undecodable):
            refuse(request, context)
        yield from behavior(request, context)

    codec = dict(request_deserializer=deserialize, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "authorization: missing or wrong bearer token (send 'authorization: Bearer <token>')")

    def deny_stream(request, context):
        deny(request, context)
        yield  # never reached: makes this a generator for streaming handlers

    codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(deny, **codec)


class HandlerThreads(futures.Executor):
    """The threads that run gRPC handlers: all started at once, and each call goes to the thread that went idle
    last (a stack, not a queue).

    Why not grpc's usual ThreadPoolExecutor: it starts one more thread at each new peak of concurrent calls and
    hands calls to its idle threads in turn, so over time every thread of the pool (one per stream the plan can
    hold: 150 for a small plan, more for big ones) runs every kind of handler and keeps the stack pages, Python
    frame chunks and malloc caches that took. The process's memory then creeps up for hours after warm-up, though
    nothing leaks. Reused most-recent first, only as many threads as the busiest moment needed are ever warm, and
    memory settles once that peak has been seen. Calls beyond the threads wait in arrival order (grpc's
    `maximum_concurrent_rpcs` keeps that brief)."""

    def __init__(self, workers: int, name: str = "grpc"):
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []   # each idle thread's inbox; the last one is the next to work
        self._backlog: list = []                   # calls that found no idle thread, oldest first
        self._closed = False
        self._threads = [threading.Thread(target=self._work, args=(queue.SimpleQueue(),), name=f"{name}_{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        item = (future, fn, args, kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit after shutdown")
            if not self._idle:
                self._backlog.append(item)
                return future
            inbox = self._idle.pop()
        inbox.put(item)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self, inbox: queue.SimpleQueue) -> None:
        item = None
        while True:
            if item is None:
                with self._lock:
                    if self._backlog:
                        item = self._backlog.pop(0)
                    elif self._closed:
                        return
                    else:
                        self._idle.append(inbox)
                if item is None:
                    item = inbox.get()
                    if item is None:
                        return
            future, fn, args, kwargs = item
            item = None
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - the caller reads it from the future
                    future.set_exception(exc)
            del future, fn, args, kwargs


class SlabServer:
    """A gRPC server over one Engine; see the module docstring for its life: start, warm_up, drain."""

    def __init__(self, engine: Engine, host: str, port: int, metrics_port: int | None, limits: Limits,
                 max_workers: int | None, access: Access = Access()):
        scheduler = engine.scheduler
        self.metrics = Metrics(scheduler.allocator.classes)
        self.health = health.HealthServicer()
        self.loop = EngineLoop(engine, self.metrics, on_failure=lambda exc: self._set_health(False))
        self.servicer = SlabServeServicer(self.loop, limits, self.metrics)
        # One worker per stream the engine can hold (running + every class queue full), plus room for unary calls;
        # beyond that gRPC answers RESOURCE_EXHAUSTED instead of queueing calls without bound.
        streams = scheduler.max_seqs + scheduler.queue_limit * len(scheduler.allocator.classes)
        workers = max_workers or streams + 16
        options = [("grpc.max_receive_message_length", limits.max_message_bytes),
                   ("grpc.max_send_message_length", limits.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        # The token check comes first: a caller without it learns nothing, not even whether its bytes parse.
        interceptors = [_BearerToken(access.token, access.open_health)] if access.token else []
        interceptors.append(_DecodeErrorsAsInvalidArgument())
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
        self._set_health(False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Start the engine thread and answer calls (health NOT_SERVING, Generate UNAVAILABLE until warm_up)."""
        self.loop.start()
        self.grpc_server.start()
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
        self.servicer.state = "serving"
        self._set_health(True)

    def drain(self, grace_s: float = 30.0) -> bool:
        """Refuse new requests, let open streams finish within `grace_s`, cancel the rest, stop. True if none was
        cut short."""
        self.servicer.state = "draining"
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
                  limits: Limits = Limits(), max_workers: int | None = None, access: Access = Access()) -> SlabServer:
    """A server over a ready Engine, bound but not started (`port=0` picks a free port: see `.port`)."""
    return SlabServer(engine, host, port, metrics_port, limits, max_workers, access)


# ---- the `slabserve serve` command ------------------------------------------------------------------------------

def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slabserve serve", description="Serve a plan bundle over gRPC.")
    parser.add_argument("bundle", nargs="?", metavar="DIR", help="plan bundle directory (build-plan --out)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port, logged)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (-1: off)")
    parser.add_argument("--grace-seconds", type=float, default=30.0,
                        help="on SIGTERM, how long running streams may take to finish")
    parser.add_argument("--max-message-bytes", type=int, default=Limits().max_message_bytes)
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--auth-token-file", help="file holding a bearer token every call must send")
    parser.add_argument("--open-health", action="store_true",
                        help="with --auth-token-file: answer health checks and reflection without the token")
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


def _access_from_args(args: argparse.Namespace) -> Access:
    """Read the TLS files and the token once, at start; a missing or empty file stops the server with its name."""
    def read(path: str, what: str) -> bytes:
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise SystemExit(f"slabserve serve: cannot read {what} {path}: {err.strerror or err}") from None
        if not data.strip():
            raise SystemExit(f"slabserve serve: {what} {path} is empty")
        return data

    token = read(args.auth_token_file, "--auth-token-file").decode().strip() if args.auth_token_file else None
    cert = read(args.tls_cert, "--tls-cert") if args.tls_cert else None
    key = read(args.tls_key, "--tls-key") if args.tls_key else None
    return Access(cert, key, token, args.open_health)


def _engine_from_args(args: argparse.Namespace) -> Engine:
    if args.bundle is not None:
        from slabserve.runtime.config import ModelLoadError
        from slabserve.runtime.engine import PlanMismatchError
        from slabserve.runtime.graph_io import GraphFormatError
        from slabserve.runtime.plan import PlanFormatError, read_plan

        try:
            _check_memory(read_plan(args.bundle), args.memory_limit)  # before Engine.from_plan allocates anything
            return Engine.from_plan(args.bundle, warm_up=False)  # server.warm_up runs it on the engine thread
        except (PlanFormatError, PlanMismatchError, PlanViolationError, ModelLoadError, GraphFormatError,
                InsufficientMemoryError) as err:
            raise SystemExit(f"slabserve serve: refusing to start: {err}") from None
    classes = []
    for item in args.classes.split(","):
        tokens, _, count = item.partition("x")
        classes.append(SlabClass(int(tokens), int(count)))
    return Engine(EngineConfig(args.model, tuple(classes), max_seqs=args.max_seqs, step_tokens=args.step_tokens,
                               dtype=args.dtype, queue_limit=args.queue_limit), warm_up=False)


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
    _limit_malloc_arenas()  # before the engine's and gRPC's threads first allocate
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    access = _access_from_args(args)  # before the engine: a bad file fails in milliseconds, not after loading
    engine = _engine_from_args(args)
    server = create_server(engine, args.host, args.port,
                           metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                           limits=Limits(max_message_bytes=args.max_message_bytes), access=access)
    server.start()
    log.info(json.dumps({"event": "listening", "address": server.address, "metrics_port": args.metrics_port}))
    try:
        server.warm_up()
    except PlanViolationError as err:
        server.stop()
        raise SystemExit(f"slabserve serve: refusing to start: {err}") from None
    log.info(json.dumps({"event": "serving", "address": server.address, "gemm": engine.gemm,
                         "startup_s": round(_seconds_since_process_start(), 2)}))
    while not stop.wait(0.5):
        if server.loop.failure is not None:
            server.stop()
            return 1
    log.info(json.dumps({"event": "draining", "grace_s": args.grace_seconds}))
    clean = server.drain(args.grace_seconds)
    log.info(json.dumps({"event": "stopped", "clean": clean}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
