"""The engine loop: one thread owns the Engine; the front doors (gRPC, HTTP) reach it only through commands.

Contract: `EngineLoop(engine).start()` runs the engine on its own thread. Between steps it runs every queued
command (`call` waits for the result, `post` does not), then one step, and puts each event into its request's
*sink* (anything with `put`: a `queue.SimpleQueue` for a gRPC handler thread, an asyncio bridge for HTTP). A
request whose engine event ends it with tokens arrives as two events: its last tokens (an event with no `finished`)
and then the end (no tokens), so that every token reaches a client in a token event. It sleeps on the command queue
when the engine has no work, and gives malloc's free pages back to the OS once per idle spell. If the engine raises,
the loop stops, every open sink gets `EngineFailed`, and `on_failure` is called (the server turns NOT_SERVING).

Admission runs on the caller's thread (`submit`): a full queue (as of the last step) or a first token the work
ahead would delay past its deadline (the caller's, or the plan's cap: runtime.admission) is refused there, at once;
waiting for the step in progress (up to a second on a CPU) to learn the same answer would make overload slow to
refuse. A queue that looks open still gets the engine thread's exact check.
"""
from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, Protocol

from slabserve.runtime.admission import AdmissionView
from slabserve.runtime.engine import Engine, GenerationEvent, StoppingOptions
from slabserve.runtime.metrics import Metrics
from slabserve.runtime.sampler import SamplingParams
from slabserve.runtime.scheduler import QueueFullError

log = logging.getLogger("slabserve.server")


class EngineFailed(RuntimeError):
    """INTERNAL: the engine thread hit an error and stopped; the server no longer serves."""


class Sink(Protocol):
    """Where one request's events go: `put(GenerationEvent | EngineFailed)`, called on the engine thread."""

    def put(self, item: Any) -> None: ...


class EngineLoop:
    """Owns the Engine on one thread; other threads send it commands. See the module docstring."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue = queue.SimpleQueue()   # (fn, Future | None)
        self._sinks: dict[str, Sink] = {}                         # engine request id -> its handler's events
        self._stopping = threading.Event()
        self.failure: BaseException | None = None
        self._heap_released = False
        # slab class -> the RESOURCE_EXHAUSTED its next request gets; replaced (never mutated) by the engine thread
        self._full_queues: dict[int, QueueFullError] = {}
        # admission by latency on the gRPC threads: the view published after the last step, plus the requests
        # admitted against it that the engine thread has not submitted yet (engine id -> (prompt tokens, deadline))
        self._admission_lock = threading.Lock()
        self._admission: AdmissionView | None = None
        self._unsubmitted: dict[str, tuple[int, float, int]] = {}
        self._thread = threading.Thread(target=self._run, name="slabserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put((lambda: None, None))  # wake it
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the engine thread is still alive (after stop(): whether it ended within the timeout)."""
        return self._thread.is_alive()

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
               engine_id: str, *, first_token_by: float | None = None, sink: Sink | None = None) -> Sink:
        """Submit on the engine thread; returns the sink its events will arrive in (`sink`, or a new
        queue.SimpleQueue). Raises the engine's errors, and admission's (see the module docstring).
        `first_token_by`: the caller's first-token deadline (time.monotonic()), or None."""
        need = len(prompt_ids) + stopping.max_tokens
        home = self.engine.scheduler.allocator.class_for(need) if need >= 1 else None
        full = self._full_queues.get(home) if home is not None else None
        if full is not None:
            raise copy.copy(full)
        deadline = projected = None
        if home is not None and prompt_ids:
            cached = self.engine.scheduler.expected_cached(prompt_ids)
            prefill = len(prompt_ids) - cached  # what reuse leaves
            with self._admission_lock:
                if self._admission is not None:  # or DelayBoundError
                    admitted = self._admission.decide(prefill, home, time.monotonic(), first_token_by, done=cached)
                    deadline, projected = admitted.promise, admitted.projected
                    self._unsubmitted[engine_id] = (prefill, deadline, cached)
        sink = sink if sink is not None else queue.SimpleQueue()

        def submit() -> None:
            try:
                self.engine.submit(prompt_ids, sampling, stopping, engine_id, deadline=deadline, projected=projected)
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
                else:
                    self.engine.keep_alive()  # a tensor-parallel group's heartbeat (runtime.ranks)
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
                release_free_heap()
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
                    self.metrics.observe_finished(t.queue_s, t.ttft_s, t.tpot_s, event.completion_tokens,
                                                  t.promised_s, t.projected_s)
            if sink is None:
                continue
            if event.finished is not None and (event.token_ids or event.text):  # tokens in a token event only
                sink.put(dataclasses.replace(event, finished=None, prompt_tokens=0, completion_tokens=0,
                                             cached_tokens=0, timings=None))
                event = dataclasses.replace(event, token_ids=(), text="")
            sink.put(event)
        if self.metrics is not None and tokens:
            self.metrics.observe_tokens(tokens)

    def observe_load(self) -> None:
        if self.metrics is not None:
            load = self.engine.scheduler.load()
            self.metrics.observe_load(load.free_per_class, load.total_per_class, load.queued_per_class,
                                      load.running)
            scheduler = self.engine.scheduler
            self.metrics.observe_prefix(scheduler.prefix_hit_tokens, scheduler.prefix_miss_tokens)
            self.metrics.observe_projection_error(scheduler.projection_error.relative)

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


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): its malloc is left as it is
        return None


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (M_ARENA_MAX; MALLOC_ARENA_MAX in the environment wins). By default glibc gives
    threads that contend for malloc arenas of their own, up to 8 per core, and memory freed in one arena serves
    no other: with a pool of handler threads the process keeps each arena's high-water mark of gRPC and Python
    buffers, and its resident memory drifts up by megabytes under faults and bursts. The serving loop allocates
    nothing (its memory is planned), so malloc serves only the control path, which runs under the GIL anyway."""
    libc = _glibc()
    if libc is not None and "MALLOC_ARENA_MAX" not in os.environ:
        m_arena_max = -8  # malloc.h
        libc.mallopt(m_arena_max, arenas)


def on_a_passing_thread(fn: Callable[[], Any]) -> Any:
    """fn() run on a thread of its own that ends when fn returns (its result, or its exception raised here).

    For the work that builds an Engine before its loop starts (loading and packing weights, zeroing the KV arena):
    those run OpenMP regions, and libgomp keeps a thread's team alive as long as the thread. With two teams alive
    (the main thread's and the engine thread's) a process has more OpenMP threads than cores, and libgomp then
    throttles its spin-wait to a few hundred iterations: between two kernels of a step the engine's workers fall
    asleep, and every next kernel waits for a futex wake-up. On two cores that took a served decode step from 11 to
    21 ms (tools/bench_served.py), while the same engine in a benchmark's single thread never saw it. A thread that
    ends takes its team with it, so the engine thread's team is the only one left."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="engine_build")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def release_free_heap() -> None:
    """Give the pages malloc holds free back to the OS (glibc's malloc_trim). glibc returns only the top of a heap
    on its own, so after a burst the gRPC and Python buffers it freed would stay resident; the engine thread calls
    this once each time the server falls idle, off the serving path."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
