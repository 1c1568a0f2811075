"""The gRPC front door: slabserve.v1 (proto/slabserve/v1/serving.proto) as a thin translation onto the Gateway.

Contract: `SlabServeServicer(gateway)` answers the slabserve.v1 service. Protobuf is converted to the gateway's
`GenerationInput` here and nowhere else (`generation_from_pb`, `event_to_pb`), and every error leaves through
`abort_with`, which reads the one status table (runtime.edge.status_for). `DecodeErrorsAsInvalidArgument` and
`HandlerThreads` are the gRPC server's interceptor and thread pool (runtime.server builds the server).

Cancellation: each Generate call registers a gRPC termination callback that posts `abort` to the engine thread.
It fires when the client cancels or disconnects, when the call's deadline passes, and after normal completion
(where the abort finds nothing). The abort frees the slab before the next step; the engine's CANCELLED event then
wakes the handler, which returns. Engine-side ids are the server's own (`s<n>`), never the client's, so a late
abort can never hit a newer request that reused the client's id.

Deadlines: the call's gRPC deadline, and the request's `first_token_deadline_ms`, are the caller's first-token
deadline for admission (runtime.admission): a request that would miss it is refused at once with
RESOURCE_EXHAUSTED and the `grpc-retry-pushback-ms` trailer, which a client's retry policy obeys.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.edge import (FieldNames, Gateway, GenerationInput, Limits, Prompt, first_token_by,
                                    status_for)
from slabserve.runtime.engine import GenerationEvent
from slabserve.runtime.sampler import SamplingParams
from slabserve.runtime.scheduler import FinishReason, InvalidRequestError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SlabServe"].full_name   # "slabserve.v1.SlabServe"

_FINISH_TO_PB = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                 FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED}
# slabserve's field names -> the proto's paths
GRPC_NAMES: FieldNames = {
    "max_tokens": "stopping.max_tokens", "stop": "stopping.stop", "stop_token_ids": "stopping.stop_token_ids",
    "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
    "min_p": "sampling.min_p", "seed": "sampling.seed",
}


def abort_with(context: grpc.ServicerContext, exc: BaseException) -> None:
    """End the call with the status the table gives `exc` (raises, as context.abort does)."""
    status = status_for(exc)
    context.set_trailing_metadata(status.trailers)
    context.abort(getattr(grpc.StatusCode, status.row.grpc_code), status.message)


# ---- protobuf <-> the gateway's dataclasses (the only place either side sees the other) ------------------------

def input_from_pb(message, limits: Limits) -> Prompt:
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
    if len(messages) > limits.max_messages:  # before copying them
        raise InvalidRequestError("messages", f"{len(messages)} messages; at most {limits.max_messages}")
    return [{"role": m.role, "content": m.content} for m in messages]


def sampling_from_pb(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        seed=s.seed if s.HasField("seed") else None,
    )


def generation_from_pb(request: pb.GenerateRequest, limits: Limits, remaining_s: float | None,
                       peer: str) -> GenerationInput:
    """A GenerateRequest (and the call's time remaining, None without a deadline) -> a GenerationInput."""
    s = request.stopping
    deadline_ms = request.first_token_deadline_ms if request.HasField("first_token_deadline_ms") else None
    return GenerationInput(
        prompt=input_from_pb(request, limits), request_id=request.request_id or None,
        sampling=sampling_from_pb(request.sampling),
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        first_token_by=first_token_by(deadline_ms, remaining_s, time.monotonic()), peer=peer, names=GRPC_NAMES)


def event_to_pb(request_id: str, event: GenerationEvent) -> pb.GenerateResponse:
    """A token event, or the finished one (reason, usage, timings: its tokens came in a token event before)."""
    if event.finished is None:
        return pb.GenerateResponse(request_id=request_id,
                                   token=pb.TokenOutput(token_ids=event.token_ids, text=event.text))
    t = event.timings
    timings = pb.Timings(queue_seconds=t.queue_s, time_to_first_token_seconds=t.ttft_s,
                         time_per_output_token_seconds=t.tpot_s) if t is not None else None
    return pb.GenerateResponse(request_id=request_id, finished=pb.GenerationFinished(
        reason=_FINISH_TO_PB[event.finished],
        usage=pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                       cached_tokens=event.cached_tokens),
        timings=timings))


# ---- the service ------------------------------------------------------------------------------------------------

class SlabServeServicer(pb_grpc.SlabServeServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.engine = gateway.engine
        self.limits = gateway.limits

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        started = time.monotonic()
        # "open" is popped by whoever logs the call first: the handler, or the termination callback on a cancel
        record: dict[str, Any] = {"event": "request", "request_id": request.request_id[:128], "peer": context.peer(),
                                  "open": True}
        stream = None
        try:
            self.gateway.check_serving()  # warming up or draining: UNAVAILABLE before anything else
            g = generation_from_pb(request, self.limits, context.time_remaining(), context.peer())
            stream = self.gateway.open(g, record, started)
            if not context.add_callback(lambda: self._on_terminated(context, stream)):
                self._on_terminated(context, stream)  # the call ended before we got here
            for event in self.gateway.events(stream):
                if event.finished is not None:  # log first: after a cancel, gRPC may never resume us
                    stream.finish("OK", event)
                yield event_to_pb(stream.request_id, event)
                if event.finished is not None:
                    return
        except Exception as exc:  # noqa: BLE001 - every error leaves through the status table
            status = status_for(exc)
            self.gateway.log(record, started, status.row.grpc_code, None, status.message)
            context.set_trailing_metadata(status.trailers)
            context.abort(getattr(grpc.StatusCode, status.row.grpc_code), status.message)
        finally:
            if stream is not None:
                self.gateway.close(stream)

    def _on_terminated(self, context: grpc.ServicerContext, stream) -> None:
        """gRPC's termination callback: free the slab at the next step (a no-op after a normal end) and log a cancel."""
        stream.abort()
        if "open" in stream.record:
            remaining = context.time_remaining()  # None without a deadline
            expired = remaining is not None and remaining <= 0
            stream.finish("DEADLINE_EXCEEDED" if expired else "CANCELLED")

    # ---- unary calls ----------------------------------------------------------------------------------------------

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        try:
            return pb.TokenizeResponse(token_ids=self.gateway.prompt_ids(input_from_pb(request, self.limits)))
        except Exception as exc:  # noqa: BLE001
            abort_with(context, exc)

    def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        engine, scheduler = self.engine, self.engine.scheduler
        classes = scheduler.allocator.classes
        return pb.GetModelInfoResponse(
            model_name=self.gateway.model_name,
            plan_id=engine.plan_id,
            context_limit=engine.model_config.context_limit,
            max_request_tokens=scheduler.max_request_tokens,
            slab_classes=[pb.SlabClass(index=i, tokens=c.tokens, count=c.count) for i, c in enumerate(classes)],
            vocab_size=engine.model_config.vocab_size, max_running=scheduler.max_seqs,
            step_tokens=scheduler.step_tokens, queue_limit=scheduler.queue_limit,
            has_chat_template=engine.tokenizer.chat_template is not None,
            max_queue_delay_ms=round(scheduler.max_queue_delay_s * 1000) if scheduler.max_queue_delay_s else 0,
            prefix_reuse=engine.prefix_reuse_off is None, prefix_reuse_off_reason=engine.prefix_reuse_off or "",
            declared_prefixes=[pb.DeclaredPrefix(name=n, tokens=t) for n, t in engine.declared.items()])

    def GetLoad(self, request, context) -> pb.GetLoadResponse:
        try:
            load = self.gateway.loop.call(self.engine.scheduler.load, timeout=30)
        except Exception as exc:  # noqa: BLE001
            abort_with(context, exc)
        classes = self.engine.scheduler.allocator.classes
        return pb.GetLoadResponse(
            classes=[pb.ClassLoad(index=i, tokens=c.tokens, free_slabs=f, total_slabs=t, queued=q)
                     for i, (c, f, t, q) in enumerate(zip(classes, load.free_per_class, load.total_per_class,
                                                          load.queued_per_class))],
            running=load.running, queued=sum(load.queued_per_class), draining=self.gateway.state == "draining")

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        try:
            if not request.request_id:
                raise InvalidRequestError("request_id", "is empty")
            return pb.AbortResponse(aborted=self.gateway.abort_by_client_id(request.request_id))
        except Exception as exc:  # noqa: BLE001
            abort_with(context, exc)


# ---- the gRPC server's interceptor and threads ------------------------------------------------------------------

class _Undecodable:
    """What a tolerant deserializer returns for bytes that are not the method's request message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class DecodeErrorsAsInvalidArgument(grpc.ServerInterceptor):
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
        abort_with(context, InvalidRequestError("request", f"cannot be decoded: {request.reason}"))

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
