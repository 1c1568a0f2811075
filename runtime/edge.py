"""What both front doors share: request validation, the status table, and the gateway onto the engine loop.

Contract: a front door (gRPC: runtime.grpc_api, HTTP: runtime.http_api) converts its wire format into a
`GenerationInput`, naming fields the way its own clients spell them (`FieldNames`), and hands it to
`Gateway.open`, which validates it (`Limits`, the sampler's ranges, the vocabulary, the slabs), submits it to the
`EngineLoop` and returns a `Stream`. The door then reads the stream's events and writes them out in its own format,
and ends every call with `Stream.finish` (one JSON log line per request, and the request counters). Every error,
whichever door it leaves by, goes through `status_for`, the one table from an exception to a gRPC code, an HTTP
status and OpenAI's error body: both doors refuse the same requests for the same reasons.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slabserve.runtime.admission import OverloadedError
from slabserve.runtime.engine import GenerationEvent, StoppingOptions
from slabserve.runtime.engine_loop import EngineFailed, EngineLoop, Sink
from slabserve.runtime.metrics import Metrics
from slabserve.runtime.sampler import SamplingParams
from slabserve.runtime.scheduler import InvalidRequestError, OutOfRangeError
from slabserve.runtime.tokenizer import ChatTemplateError

log = logging.getLogger("slabserve.server")
request_log = logging.getLogger("slabserve.requests")

KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool"})
# OpenAI's newer name for the system message ("developer" messages replace system messages in its API and SDK
# examples); chat templates know only "system", so it is rendered as one
ROLE_ALIASES = {"developer": "system"}
DEFAULT_MAX_TOKENS = 128
SINK_POLL_S = 1.0  # a reader waiting on its sink checks this often whether the engine thread still runs

Prompt = str | tuple[int, ...] | list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may carry (documented in serving.proto and the README); beyond them:
    INVALID_ARGUMENT / 400, and a message over `max_message_bytes`: RESOURCE_EXHAUSTED / 413."""

    max_message_bytes: int = 1 << 20     # gRPC receive/send limit per message; the HTTP request body limit
    max_request_id_chars: int = 128
    max_stop_strings: int = 16
    max_stop_string_chars: int = 128
    max_stop_token_ids: int = 64
    max_messages: int = 256


class Unavailable(Exception):
    """UNAVAILABLE / 503: warming up or draining."""


class RequestTooLargeError(ValueError):
    """RESOURCE_EXHAUSTED / 413: the request's bytes exceed the server's limit (--max-message-bytes)."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"request: {size} bytes; at most {limit} (the server's --max-message-bytes)")
        self.field = "request"


class UnknownModelError(LookupError):
    """NOT_FOUND / 404: the request names a model this server does not serve."""

    def __init__(self, asked: str, served: str):
        super().__init__(f"model: {asked[:80]!r} is not served here; this server serves {served!r} (GET /v1/models)")
        self.field = "model"


# ---- the status table ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StatusRow:
    grpc_code: str         # grpc.StatusCode name
    http_status: int
    error_type: str        # OpenAI's error.type
    error_code: str | None  # OpenAI's error.code
    when: str              # for the README's table


# The one table: each kind of refusal, its gRPC code and its HTTP status side by side (the README prints it).
STATUS_TABLE: Mapping[str, StatusRow] = {
    "invalid": StatusRow("INVALID_ARGUMENT", 400, "invalid_request_error", None,
                         "a bad field; the message starts with its name"),
    "too_long": StatusRow("OUT_OF_RANGE", 413, "invalid_request_error", "context_length_exceeded",
                          "prompt + max_tokens exceeds the largest slab"),
    "too_large": StatusRow("RESOURCE_EXHAUSTED", 413, "invalid_request_error", "request_too_large",
                           "the request's bytes exceed --max-message-bytes"),
    "overloaded": StatusRow("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "rate_limit_exceeded",
                            "the slab class's queue is full, or the first token would miss its deadline"),
    "unauthenticated": StatusRow("UNAUTHENTICATED", 401, "authentication_error", "invalid_api_key",
                                 "--auth-token-file is set and the bearer token is missing or wrong"),
    "unknown_model": StatusRow("NOT_FOUND", 404, "invalid_request_error", "model_not_found",
                               "the request names another model (HTTP only)"),
    "unavailable": StatusRow("UNAVAILABLE", 503, "service_unavailable", None,
                             "the server is warming up or draining"),
    "internal": StatusRow("INTERNAL", 500, "server_error", None, "the engine failed; the server stops serving"),
}


@dataclass(frozen=True, slots=True)
class Status:
    """An exception as a front door answers it."""

    row: StatusRow
    message: str
    param: str | None = None                   # the offending field, as the client spells it
    retry_after_ms: int | None = None
    trailers: tuple[tuple[str, str], ...] = ()  # gRPC trailing metadata


def status_for(exc: BaseException) -> Status:
    """The one map from exceptions to what a client gets back."""
    if isinstance(exc, InvalidRequestError):
        return Status(STATUS_TABLE["invalid"], str(exc), exc.field, trailers=(("slabserve-field", exc.field),))
    if isinstance(exc, ChatTemplateError):
        name = f"messages[{exc.message_index}].role" if exc.message_index is not None else "messages"
        return Status(STATUS_TABLE["invalid"], f"{name}: {exc}", name, trailers=(("slabserve-field", name),))
    if isinstance(exc, OutOfRangeError):
        return Status(STATUS_TABLE["too_long"], str(exc), "max_tokens",
                      trailers=(("slabserve-limit-tokens", str(exc.limit_tokens)),))
    if isinstance(exc, RequestTooLargeError):
        return Status(STATUS_TABLE["too_large"], str(exc), exc.field)
    if isinstance(exc, OverloadedError):  # a full queue, or a first token that would miss its deadline
        ms = str(exc.retry_after_ms)
        return Status(STATUS_TABLE["overloaded"], str(exc), retry_after_ms=exc.retry_after_ms,
                      trailers=(("slabserve-slab-class", str(exc.class_index)), ("retry-after-ms", ms),
                                ("grpc-retry-pushback-ms", ms)))
    if isinstance(exc, UnknownModelError):
        return Status(STATUS_TABLE["unknown_model"], str(exc), exc.field)
    if isinstance(exc, Unavailable):
        return Status(STATUS_TABLE["unavailable"], str(exc))
    log.error(json.dumps({"event": "internal_error", "error": repr(exc)}))
    return Status(STATUS_TABLE["internal"], f"internal error: {type(exc).__name__}")


# ---- requests in -----------------------------------------------------------------------------------------------

# Field names as slabserve's own code raises them -> as a front door's clients spell them.
FieldNames = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """One generation request, taken off the wire but not yet validated."""

    prompt: Prompt
    request_id: str | None = None
    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None              # None: DEFAULT_MAX_TOKENS, lowered to what fits beside the prompt
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    first_token_by: float | None = None        # the caller's first-token deadline, time.monotonic()
    peer: str = ""
    names: FieldNames = field(default_factory=dict)


def rename(exc: InvalidRequestError, names: FieldNames) -> InvalidRequestError:
    """`exc` with its field as the front door's clients spell it."""
    if exc.field in names:
        return InvalidRequestError(names[exc.field], str(exc).partition(": ")[2])
    head = exc.field.split("[", 1)[0]  # messages[3].role
    if head in names and head != exc.field:
        return InvalidRequestError(names[head] + exc.field[len(head):], str(exc).partition(": ")[2])
    return exc


def check_messages(messages: list[dict[str, str]], limits: Limits) -> list[dict[str, str]]:
    if not messages:
        raise InvalidRequestError("messages", "is empty; at least one message is needed")
    if len(messages) > limits.max_messages:
        raise InvalidRequestError("messages", f"{len(messages)} messages; at most {limits.max_messages}")
    checked = []
    for i, m in enumerate(messages):
        role = ROLE_ALIASES.get(m["role"], m["role"])
        if role not in KNOWN_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"{m['role'][:40]!r} is not one of "
                                                             f"{', '.join(sorted(KNOWN_ROLES | set(ROLE_ALIASES)))}")
        checked.append(m if role == m["role"] else {**m, "role": role})
    return checked


def stopping_options(g: GenerationInput, limits: Limits, vocab_size: int, num_prompt: int,
                     max_request_tokens: int) -> StoppingOptions:
    if g.max_tokens is not None:
        if g.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {g.max_tokens}")
        max_tokens = g.max_tokens
    else:  # the default, lowered to what fits beside the prompt (a prompt that leaves no room gets OUT_OF_RANGE)
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, max_request_tokens - num_prompt))
    if len(g.stop) > limits.max_stop_strings:
        raise InvalidRequestError("stop", f"{len(g.stop)} stop strings; at most {limits.max_stop_strings}")
    for i, stop in enumerate(g.stop):
        if not 1 <= len(stop) <= limits.max_stop_string_chars:
            raise InvalidRequestError(f"stop[{i}]", f"has {len(stop)} characters; 1 to "
                                                    f"{limits.max_stop_string_chars} allowed")
    if len(g.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError("stop_token_ids", f"{len(g.stop_token_ids)} ids; at most "
                                                    f"{limits.max_stop_token_ids}")
    bad = [t for t in g.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError("stop_token_ids", f"id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return StoppingOptions(max_tokens=max_tokens, stop=g.stop, stop_token_ids=g.stop_token_ids,
                           ignore_eos=g.ignore_eos)


def first_token_by(deadline_ms: int | None, call_remaining_s: float | None, now: float) -> float | None:
    """The caller's first-token deadline (time.monotonic()): the request's own `first_token_deadline_ms`, or the
    call's deadline (gRPC's), whichever is first; None when the caller set neither."""
    if deadline_ms is not None and deadline_ms < 1:
        raise InvalidRequestError("first_token_deadline_ms", f"must be >= 1, got {deadline_ms}")
    options = [now + deadline_ms / 1000 if deadline_ms is not None else math.inf,
               now + call_remaining_s if call_remaining_s is not None else math.inf]
    return min(options) if min(options) < math.inf else None


# ---- the gateway ---------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Stream:
    """One open generation: its events arrive in `sink`; `finish` logs it (once, whoever calls first)."""

    request_id: str
    engine_id: str
    sink: Sink
    record: dict[str, Any]
    started: float
    gateway: "Gateway"
    prompt_tokens: int = 0

    def finish(self, code: str, event: GenerationEvent | None = None, message: str | None = None) -> None:
        self.gateway.log(self.record, self.started, code, event, message)

    def abort(self) -> None:
        """Free the slab at the next step (a no-op once the request has ended)."""
        self.gateway.loop.abort(self.engine_id)


class Gateway:
    """The front doors' one way onto the engine loop: serving state, request ids, validation, submit, logging."""

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

    @property
    def model_name(self) -> str:
        """The model's own name (its metadata, or its file name): GetModelInfo's `model_name`."""
        return self.engine.model_config.name or Path(self.engine.config.model).name

    @property
    def served_name(self) -> str:
        """The name clients ask for over HTTP (`model`, `/v1/models`): the plan's name, or the model's without one."""
        return self.engine.plan_name or self.model_name

    def check_serving(self) -> None:
        if self.state != "serving":
            raise Unavailable(f"the server is {self.state}; retry later or on another replica")

    def prompt_ids(self, prompt: Prompt, names: FieldNames = {}) -> tuple[int, ...]:
        if isinstance(prompt, list):
            prompt = check_messages(prompt, self.limits)
        try:
            return self.engine.prompt_ids(prompt)
        except InvalidRequestError as exc:
            raise rename(exc, names) from None

    def open(self, g: GenerationInput, record: dict[str, Any], started: float, sink: Sink | None = None) -> Stream:
        """Validate and submit `g`; the Stream's sink then receives its events. Raises what `status_for` maps."""
        self.check_serving()
        request_id = g.request_id or f"req-{next(self._client_ids)}"
        record["request_id"] = request_id[:128]
        try:
            if len(request_id) > self.limits.max_request_id_chars:
                raise InvalidRequestError("request_id", f"has {len(request_id)} characters; at most "
                                                        f"{self.limits.max_request_id_chars}")
            prompt_ids = self.prompt_ids(g.prompt, g.names)
            record["prompt_tokens"] = len(prompt_ids)
            try:
                g.sampling.validate(self.engine.model_config.vocab_size)
            except ValueError as exc:  # "sampling.top_p = 1.5 is out of range: ..."
                name, _, detail = str(exc).partition(" = ")
                raise InvalidRequestError(name.removeprefix("sampling."), detail) from None
            stopping = stopping_options(g, self.limits, self.engine.model_config.vocab_size, len(prompt_ids),
                                        self.engine.scheduler.max_request_tokens)
        except InvalidRequestError as exc:
            raise rename(exc, g.names) from None
        engine_id = self._claim(request_id)
        try:
            sink = self.loop.submit(prompt_ids, g.sampling, stopping, engine_id, first_token_by=g.first_token_by,
                                    sink=sink)
        except BaseException:
            self._release(request_id, engine_id)
            raise
        return Stream(request_id, engine_id, sink, record, started, self, len(prompt_ids))

    def close(self, stream: Stream) -> None:
        self._release(stream.request_id, stream.engine_id)

    def events(self, stream: Stream) -> Iterator[GenerationEvent]:
        """A blocking reader of a `queue.SimpleQueue` sink (the gRPC door's): events until the finished one."""
        import queue

        while True:
            try:
                event = self.received(stream.sink.get(timeout=SINK_POLL_S))
            except queue.Empty:
                self.check_alive()
                continue
            yield event
            if event.finished is not None:
                return

    def check_alive(self) -> None:
        """What a reader does when its sink stays empty for SINK_POLL_S: raise EngineFailed if the engine stopped."""
        if self.loop.failure is not None:
            raise EngineFailed(f"the engine stopped: {self.loop.failure!r}")

    @staticmethod
    def received(item: GenerationEvent | BaseException) -> GenerationEvent:
        """An item taken from a sink: the event, or the error the engine loop put there, raised."""
        if isinstance(item, BaseException):
            raise item
        return item

    def abort_by_client_id(self, request_id: str) -> bool:
        with self._lock:
            engine_id = self._live.get(request_id)
        return engine_id is not None and bool(self.loop.call(lambda: self.engine.abort(engine_id), timeout=30))

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

    def log(self, record: dict, started: float, code: str, event: GenerationEvent | None,
            message: str | None = None) -> None:
        """One JSON line per request; `record["open"]` is popped by whoever logs first (the handler, or a
        termination callback on a cancel)."""
        if record.pop("open", None) is None:  # already logged (dict.pop is atomic)
            return
        record["code"] = code
        record["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
        reason = event.finished.value if event is not None and event.finished is not None else ""
        if event is not None:
            record.update(finish_reason=reason, completion_tokens=event.completion_tokens,
                          cached_tokens=event.cached_tokens)
            if event.timings is not None:
                t = event.timings
                record.update(queue_ms=round(t.queue_s * 1000, 1), ttft_ms=round(t.ttft_s * 1000, 1),
                              tpot_ms=round(t.tpot_s * 1000, 2))
                if t.projected_s is not None:  # admission by latency's view of its first token
                    record["projected_ttft_ms"] = round(t.projected_s * 1000, 1)
                if t.promised_s is not None:
                    record["promised_ttft_ms"] = round(t.promised_s * 1000, 1)
        if message is not None:
            record["error"] = message[:300]
        request_log.info(json.dumps(record))
        if self.metrics is not None:
            self.metrics.count_request(code, reason)
