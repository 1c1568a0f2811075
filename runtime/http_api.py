"""The HTTP front door: OpenAI-compatible `/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`,
a thin translation onto the same Gateway as gRPC.

Contract: `HttpServer(gateway, host, port, access, limits)` binds at once (`.port`; 0 picks a free one), and
`start()` serves on a thread of its own (uvicorn, one asyncio event loop) until `stop()`. Requests are read as
JSON and converted to the gateway's `GenerationInput` here (`chat_input`, `completion_input`); every field this
server does not support (`n` > 1, `logprobs`, `tools`, ...) is refused with 400 naming it, never ignored, and every
error is OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status of the one status
table (runtime.edge.status_for): 400 a bad field, 413 over the size limits, 429 with `Retry-After` (and
`retry-after-ms`, which the openai SDK reads) when admission refuses, 503 while warming up or draining, 401
without the bearer token. Streaming answers are server-sent events, one chunk per token event, ending with
`data: [DONE]`; with `stream_options.include_usage` a last chunk carries the usage. A client that disconnects
cancels its request (the slab is freed at the next step).

Extensions beside OpenAI's fields (as vLLM names them where it has them): `top_k`, `min_p`, `ignore_eos`,
`stop_token_ids`, and `first_token_deadline_ms`, the caller's first-token deadline for admission (gRPC's deadline).
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from slabserve.runtime.access import UNAUTHENTICATED_MESSAGE, Access
from slabserve.runtime.edge import (SINK_POLL_S, STATUS_TABLE, Gateway, GenerationInput, Limits,
                                    RequestTooLargeError, Status, Stream, UnknownModelError, first_token_by,
                                    status_for)
from slabserve.runtime.engine import GenerationEvent
from slabserve.runtime.engine_loop import EngineFailed
from slabserve.runtime.sampler import SamplingParams
from slabserve.runtime.scheduler import FinishReason, InvalidRequestError

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}
_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "user", "top_k", "min_p", "ignore_eos", "stop_token_ids", "first_token_deadline_ms",
           "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias"}
_CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                          "response_format"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_TEXT_PARTS = {"type", "text"}


# ---- JSON -> the gateway's dataclasses (the only place either side sees the other) -----------------------------

def _bad(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(field, message)


def _typed(body: Mapping[str, Any], field: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(field, f"must be {what}, got {json.dumps(value)[:40]}")
    return value


def _unsupported(body: Mapping[str, Any], allowed: set[str]) -> None:
    """Refuse every field this server cannot honour, rather than ignore it."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(unknown[0], f"is not supported by this server (supported: {', '.join(sorted(allowed - _REFUSED))})")
    checks = (("n", lambda v: v in (None, 1), "only n = 1 is supported"),
              ("logprobs", lambda v: v in (None, False), "log probabilities are not supported"),
              ("top_logprobs", lambda v: v is None, "log probabilities are not supported"),
              ("presence_penalty", lambda v: v in (None, 0, 0.0), "penalties are not supported (0 only)"),
              ("frequency_penalty", lambda v: v in (None, 0, 0.0), "penalties are not supported (0 only)"),
              ("logit_bias", lambda v: not v, "logit_bias is not supported"),
              ("tools", lambda v: not v, "tool calling is not supported"),
              ("tool_choice", lambda v: v in (None, "none"), "tool calling is not supported"),
              ("functions", lambda v: not v, "function calling is not supported"),
              ("function_call", lambda v: v in (None, "none"), "function calling is not supported"),
              ("parallel_tool_calls", lambda v: v in (None, False), "tool calling is not supported"),
              ("response_format", lambda v: v is None or v == {"type": "text"}, "only {\"type\": \"text\"}"),
              ("echo", lambda v: v in (None, False), "echo is not supported"),
              ("best_of", lambda v: v in (None, 1), "only best_of = 1 is supported"),
              ("suffix", lambda v: v in (None, ""), "suffix is not supported"))
    for field, ok, why in checks:
        if field in body and not ok(body[field]):
            raise _bad(field, why)


_REFUSED = {"n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "tools",
            "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format", "echo", "best_of",
            "suffix"}


def _common(body: Mapping[str, Any], served_model: str, names: dict[str, str]) -> dict[str, Any]:
    model = _typed(body, "model", (str,), "a string")
    if model is not None and model != served_model:
        raise UnknownModelError(model, served_model)
    max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    max_completion = _typed(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _bad("max_completion_tokens", f"is {max_completion} and max_tokens is {max_tokens}; give one")
    names["max_tokens"] = "max_completion_tokens" if max_completion is not None else "max_tokens"
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop", "must be a string or a list of strings")
    stop_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise _bad("stop_token_ids", "must be a list of integers")
    number = (int, float)
    temperature = _typed(body, "temperature", number, "a number")
    top_p = _typed(body, "top_p", number, "a number")
    top_k = _typed(body, "top_k", (int,), "an integer")
    min_p = _typed(body, "min_p", number, "a number")
    sampling = SamplingParams(temperature=1.0 if temperature is None else float(temperature),
                              top_p=1.0 if top_p is None else float(top_p),
                              top_k=0 if top_k is None or top_k < 0 else top_k,  # vLLM's -1: off
                              min_p=0.0 if min_p is None else float(min_p),
                              seed=_typed(body, "seed", (int,), "an integer"))
    deadline_ms = _typed(body, "first_token_deadline_ms", (int,), "an integer (milliseconds)")
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    if set(options) - {"include_usage"}:
        raise _bad("stream_options", f"{sorted(set(options) - {'include_usage'})[0]} is not supported "
                                     "(include_usage only)")
    _typed(body, "user", (str,), "a string")
    return dict(sampling=sampling, max_tokens=max_completion if max_completion is not None else max_tokens,
                stop=tuple(stop or ()), stop_token_ids=tuple(stop_ids),
                ignore_eos=bool(_typed(body, "ignore_eos", (bool,), "true or false")),
                first_token_by=first_token_by(deadline_ms, None, time.monotonic()),
                stream=bool(_typed(body, "stream", (bool,), "true or false")),
                include_usage=bool(_typed(options, "include_usage", (bool,), "true or false")))


def _message(i: int, m: Any) -> dict[str, str]:
    if not isinstance(m, dict):
        raise _bad(f"messages[{i}]", "must be an object with role and content")
    extra = sorted(set(m) - {"role", "content", "name"})
    if extra:
        raise _bad(f"messages[{i}].{extra[0]}", "is not supported (role, content and name only)")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        raise _bad(f"messages[{i}].role", "must be a string")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or set(part) - _TEXT_PARTS or \
                    not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}]", "only text parts are supported: "
                                                          "{\"type\": \"text\", \"text\": ...}")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:  # only an assistant turn may come without text (OpenAI's, beside its tool calls)
        if role != "assistant":
            raise _bad(f"messages[{i}].content", f"is required for a {role[:40]!r} message: a string or a list "
                                                 "of text parts")
        content = ""
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
    return {"role": role, "content": content}


def chat_input(body: Mapping[str, Any], served_model: str, peer: str) -> tuple[GenerationInput, dict[str, Any]]:
    """A /v1/chat/completions body -> (GenerationInput, the response options: stream, include_usage)."""
    _unsupported(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", "is required: a list of {role, content} objects")
    names: dict[str, str] = {}
    c = _common(body, served_model, names)
    prompt = [_message(i, m) for i, m in enumerate(messages)]
    return _input(prompt, c, peer, names), c


def completion_input(body: Mapping[str, Any], served_model: str,
                     peer: str) -> tuple[GenerationInput, dict[str, Any]]:
    """A /v1/completions body -> (GenerationInput, the response options)."""
    _unsupported(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise _bad("prompt", "is required: a string or a list of token ids (one prompt; batches: send one "
                             "request each)")
    names = {"token_ids": "prompt"}
    c = _common(body, served_model, names)
    return _input(prompt, c, peer, names), c


def _input(prompt, c: dict[str, Any], peer: str, names: dict[str, str]) -> GenerationInput:
    return GenerationInput(prompt=prompt, sampling=c["sampling"], max_tokens=c["max_tokens"], stop=c["stop"],
                           stop_token_ids=c["stop_token_ids"], ignore_eos=c["ignore_eos"],
                           first_token_by=c["first_token_by"], peer=peer, names=names)


def error_response(status: Status) -> JSONResponse:
    """OpenAI's error body with the table's HTTP status (and Retry-After on 429)."""
    headers = {}
    if status.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(status.retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(status.retry_after_ms)
    if status.row.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": {"message": status.message, "type": status.row.error_type, "param": status.param,
                      "code": status.row.error_code}}
    return JSONResponse(body, status_code=status.row.http_status, headers=headers)


# ---- events -> OpenAI's responses -----------------------------------------------------------------------------

class _AsyncSink:
    """A sink the engine thread fills and the event loop reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is stopping, nobody reads this any more
            pass

    async def get(self, timeout: float) -> Any:
        return await asyncio.wait_for(self._queue.get(), timeout)


class _Shape:
    """How one endpoint writes its objects: chat (messages, deltas) or text completion."""

    def __init__(self, chat: bool, request_id: str, model: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _head(self, streaming: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

    def whole(self, text: str, finish: str | None, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": usage}


def _usage(event: GenerationEvent) -> dict[str, Any]:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ---- the app ----------------------------------------------------------------------------------------------------

class _BearerToken:
    """Every request but an open /health needs the bearer token, or gets 401 in OpenAI's body.

    Plain ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hands the endpoint a receive
    channel of its own, on which a client's disconnect never arrives, so an answer that is not streamed went on
    decoding for a client that had hung up (measured: 240 tokens to the end, slab held throughout)."""

    def __init__(self, app, access: Access):
        self.app = app
        self.access = access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            open_path = scope["path"] == "/health" and self.access.open_health
            if not open_path and not self.access.allows(Headers(scope=scope).get("authorization")):
                response = error_response(Status(STATUS_TABLE["unauthenticated"], UNAUTHENTICATED_MESSAGE))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _hung_up(request: Request) -> None:
    """Returns once the client has disconnected (the body is read by then: all that is left to receive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(gateway: Gateway, access: Access, limits: Limits) -> FastAPI:
    app = FastAPI(title="slabserve", docs_url=None, redoc_url=None, openapi_url=None)
    if access.token is not None:
        app.add_middleware(_BearerToken, access=access)

    @app.get("/health")
    async def health() -> Response:
        serving = gateway.state == "serving" and gateway.loop.failure is None
        return JSONResponse({"status": gateway.state if gateway.loop.failure is None else "failed"},
                            status_code=200 if serving else 503)

    def model_card() -> dict[str, Any]:
        engine = gateway.engine
        return {"id": gateway.served_name, "object": "model", "created": 0, "owned_by": "slabserve",
                "max_model_len": engine.scheduler.max_request_tokens, "plan_id": engine.plan_id}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:  # the SDK's models.retrieve
        if model != gateway.served_name:
            return error_response(status_for(UnknownModelError(model, gateway.served_name)))
        return JSONResponse(model_card())

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, exc: StarletteHTTPException) -> Response:
        """A path or method this server lacks: OpenAI's error body too (its own words for it), not Starlette's."""
        message = (f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404 else
                   f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else
                   str(exc.detail))
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    async def _generate(request: Request, chat: bool) -> Response:
        started = time.monotonic()
        client = request.client
        peer = f"http:{client.host}:{client.port}" if client else "http"
        record: dict[str, Any] = {"event": "request", "request_id": "", "peer": peer, "open": True}
        try:
            gateway.check_serving()
            body = await _read_json(request, limits.max_message_bytes)
            g, options = (chat_input if chat else completion_input)(body, gateway.served_name, peer)
            sink = _AsyncSink(asyncio.get_running_loop())
            stream = await run_in_threadpool(gateway.open, g, record, started, sink)
        except Exception as exc:  # noqa: BLE001 - every error leaves through the status table
            status = status_for(exc)
            record["http_status"] = status.row.http_status
            gateway.log(record, started, status.row.grpc_code, None, status.message)
            return error_response(status)
        shape = _Shape(chat, stream.request_id, gateway.served_name)
        if options["stream"]:
            return StreamingResponse(_stream(stream, sink, shape, options["include_usage"]),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, stream, sink, shape)

    async def _events(stream: Stream, sink: _AsyncSink) -> AsyncIterator[GenerationEvent]:
        """The async twin of Gateway.events."""
        while True:
            try:
                event = gateway.received(await sink.get(timeout=SINK_POLL_S))
            except asyncio.TimeoutError:
                gateway.check_alive()
                continue
            yield event
            if event.finished is not None:
                return

    async def _stream(stream: Stream, sink: _AsyncSink, shape: _Shape, include_usage: bool) -> AsyncIterator[bytes]:
        try:
            if shape.chat:
                yield _sse(shape.chunk("", None, role=True))
            async for event in _events(stream, sink):
                if event.finished is None:
                    if event.text:
                        yield _sse(shape.chunk(event.text, None))
                    continue
                stream.finish("OK", event)
                yield _sse(shape.chunk(None if shape.chat else "", _FINISH[event.finished]))
                if include_usage:
                    yield _sse(shape.usage_chunk(_usage(event)))
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            status = status_for(exc)
            stream.finish(status.row.grpc_code, None, status.message)
            yield _sse({"error": {"message": status.message, "type": status.row.error_type, "param": None,
                                  "code": status.row.error_code}})
            yield b"data: [DONE]\n\n"
        finally:  # normal end: a no-op; a client that went away: free the slab, log CANCELLED
            stream.abort()
            stream.finish("CANCELLED")
            gateway.close(stream)

    async def _whole(request: Request, stream: Stream, sink: _AsyncSink, shape: _Shape) -> Response:
        texts: list[str] = []
        hung_up = asyncio.ensure_future(_hung_up(request))  # raced against every event: a client gone is seen at once
        try:
            events = _events(stream, sink)
            while True:
                next_event = asyncio.ensure_future(events.__anext__())
                await asyncio.wait([next_event, hung_up], return_when=asyncio.FIRST_COMPLETED)
                if not next_event.done():  # the client hung up (the slab is freed below)
                    next_event.cancel()
                    stream.finish("CANCELLED")
                    return Response(status_code=499)
                try:
                    event = next_event.result()
                except StopAsyncIteration:
                    raise EngineFailed("the request's events ended without a finish") from None
                texts.append(event.text)
                if event.finished is not None:
                    stream.finish("OK", event)
                    return JSONResponse(shape.whole("".join(texts), _FINISH[event.finished], _usage(event)))
        except Exception as exc:  # noqa: BLE001
            status = status_for(exc)
            stream.finish(status.row.grpc_code, None, status.message)
            return error_response(status)
        finally:
            hung_up.cancel()
            stream.abort()
            gateway.close(stream)

    return app


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(int(declared), limit)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise RequestTooLargeError(len(data), limit)
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError("request", f"is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("request", "must be a JSON object")
    return body


class HttpServer:
    """uvicorn on a thread of its own, serving `create_app`; bound in the constructor."""

    def __init__(self, gateway: Gateway, host: str, port: int, access: Access, limits: Limits):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(256)
        self.host = host
        self.port = self._socket.getsockname()[1]
        self.tls = access.tls_cert_file is not None
        if access.tls_cert is not None and not self.tls:
            raise ValueError("the HTTP door serves TLS from files: give Access.tls_cert_file and tls_key_file")
        config = uvicorn.Config(create_app(gateway, access, limits), log_level="warning", access_log=False,
                                lifespan="off", ssl_certfile=access.tls_cert_file, ssl_keyfile=access.tls_key_file,
                                timeout_graceful_shutdown=5, server_header=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="slabserve-http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()
