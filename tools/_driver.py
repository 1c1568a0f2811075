"""The open-loop driver: sends a schedule of Generate calls over gRPC, or of streamed `/v1/completions` calls over
an OpenAI-compatible HTTP API (`Target.protocol`), and records what each one saw.

Contract: `run_schedule(target, arrivals, options)` sends arrival i at `start + arrivals[i].offset_s` on its own
asyncio task whatever the earlier calls are doing (open loop: a slow server never slows the arrivals), with a
prompt of exactly `prompt_tokens` random token ids and `max_tokens = output_tokens` with EOS ignored, so outputs
are as long as drawn. While it runs it samples the server's resident memory and GetLoad about every
`sample_interval_s`. After the last arrival it waits up to `drain_timeout_s` for the calls in flight, then cancels
the rest and marks them `drain_cancelled`. Everything is measured on the monotonic clock, in seconds from start.
Over HTTP the prompt is the same token ids (OpenAI's `prompt` as a list of ids), with `ignore_eos` (vLLM's and
slabserve's extension), and a refusal's status is named as gRPC names it (429: RESOURCE_EXHAUSTED); there is no
GetLoad to sample.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import grpc

from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.tools._target import resident_bytes
from slabserve.tools._workload import Arrival, prompt_ids

_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "cancelled"}


@dataclass(frozen=True, slots=True)
class Target:
    addr: str                 # a loopback HOST:PORT (checked by the caller)
    vocab_size: int           # from GetModelInfo: prompt ids are drawn below it
    server_pid: int | None    # whose VmRSS to sample; None: no memory samples
    protocol: str = "grpc"    # "grpc" (slabserve.v1) or "http" (OpenAI-compatible, at http://addr/v1)
    model: str = ""           # HTTP: the model to name in each request
    api_key: str | None = None  # HTTP: sent as a bearer token


# HTTP statuses as the records name them (gRPC's names, so both protocols' runs are judged alike)
HTTP_STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "OUT_OF_RANGE",
                     429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


@dataclass(frozen=True, slots=True)
class DriveOptions:
    seed: int = 0
    drain_timeout_s: float = 60.0
    sample_interval_s: float = 0.5
    request_timeout_s: float | None = None   # gRPC deadline of each call; None: run length + drain timeout
    progress: bool = True
    label: str = "loadgen"


@dataclass(slots=True)
class RequestRecord:
    index: int
    class_name: str
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    end_s: float | None = None
    status: str = "NOT_SENT"          # a gRPC status code name once the call ended
    drain_cancelled: bool = False     # still running at the drain timeout, cancelled by the load generator
    finish_reason: str | None = None
    completion_tokens: int = 0
    ttft_s: float | None = None       # client: sent to first token event
    tpot_s: float | None = None       # client: first to last token, per token after the first
    e2e_s: float | None = None        # client: sent to the end of the call (rejections included)
    server_queue_s: float | None = None
    server_ttft_s: float | None = None
    server_tpot_s: float | None = None
    error: str | None = None
    cached_tokens: int = 0            # of prompt_tokens, those the server served from retained KV (its usage)
    slab_class: int | None = None     # RESOURCE_EXHAUSTED trailer slabserve-slab-class
    retry_after_ms: int | None = None  # RESOURCE_EXHAUSTED trailer retry-after-ms

    def as_dict(self) -> dict:
        out = asdict(self)
        out["class"] = out.pop("class_name")
        return out


@dataclass(slots=True)
class RunResult:
    records: list[dict]
    rss_samples: list[tuple[float, int]]       # (seconds from start, bytes)
    load_samples: list[dict]                   # {"t_s", "running", "queued", "classes": [...]}
    window_s: float                            # the arrivals' span (the run's duration)
    drained_s: float                           # when the last call ended (or was cancelled)
    started_unix: float


@dataclass(slots=True)
class _Live:
    """Counters the progress line shows."""
    sent: int = 0
    done: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    draining: bool = False
    records: list[RequestRecord] = field(default_factory=list)


def run_schedule(target: Target, arrivals: Sequence[Arrival], window_s: float, options: DriveOptions,
                 clock: Callable[[], float] = time.monotonic) -> RunResult:
    """Drive one open-loop run (blocking); see the module docstring."""
    return asyncio.run(_drive(target, tuple(arrivals), window_s, options, clock))


async def _drive(target: Target, arrivals: tuple[Arrival, ...], window_s: float, options: DriveOptions,
                 clock: Callable[[], float]) -> RunResult:
    live = _Live(records=[RequestRecord(i, a.class_name, a.prompt_tokens, a.output_tokens, a.offset_s)
                          for i, a in enumerate(arrivals)])
    deadline_s = options.request_timeout_s or (window_s + options.drain_timeout_s + 30.0)
    started_unix = time.time()
    start = clock()
    now = lambda: clock() - start  # noqa: E731
    rss: list[tuple[float, int]] = []
    loads: list[dict] = []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(target.addr) as channel, _http_client(target) as http:
        stub = pb_grpc.SlabServeStub(channel) if target.protocol == "grpc" else _HttpStub(http, target)
        samplers = [asyncio.create_task(_sample_rss(target.server_pid, rss, now, options, stop))]
        if target.protocol == "grpc":
            samplers.append(asyncio.create_task(_sample_load(stub, loads, now, options, stop)))
        progress = asyncio.create_task(_show_progress(live, len(arrivals), now, options, stop))
        # 1) launch every arrival at its time, each on its own task
        tasks = await _launch(stub, target, arrivals, live, now, options.seed, deadline_s)
        # 2) drain: wait for the calls in flight, then cancel what outlived the drain timeout
        live.draining = True
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=options.drain_timeout_s)
            for i, task in enumerate(tasks):
                if task in pending:
                    live.records[i].drain_cancelled = True
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        drained_s = now()
        stop.set()
        await asyncio.gather(*samplers, progress)
    return RunResult([r.as_dict() for r in live.records], rss, loads, window_s, drained_s, started_unix)


async def _launch(stub, target: Target, arrivals: tuple[Arrival, ...], live: _Live, now, seed: int,
                  deadline_s: float) -> list[asyncio.Task]:
    """One task per arrival, or per conversation (its turns in order): started at the (first) arrival's time."""
    tasks = []
    turns: dict[int, list[int]] = {}
    for i, arrival in enumerate(arrivals):
        if arrival.session >= 0:
            turns.setdefault(arrival.session, []).append(i)
    contexts: dict[int, list[int]] = {}
    for i, arrival in enumerate(arrivals):
        if arrival.session >= 0 and arrival.turn > 0:
            continue  # sent by its conversation's task
        # build the request before sleeping, so the send happens at its time and not after building 6k ids
        rng = random.Random(seed * 1_000_003 + i)
        if arrival.context >= 0:
            if arrival.context_seed not in contexts:
                contexts[arrival.context_seed] = prompt_ids(arrival.context_tokens, target.vocab_size,
                                                            random.Random(arrival.context_seed))
            ids = contexts[arrival.context_seed] + prompt_ids(arrival.prompt_tokens - arrival.context_tokens,
                                                              target.vocab_size, rng)
        else:
            ids = prompt_ids(arrival.prompt_tokens, target.vocab_size, rng)
        request = _request(f"loadgen-{seed}-{i}", ids, arrival.output_tokens)
        delay = arrival.offset_s - now()
        if delay > 0:
            await asyncio.sleep(delay)
        if arrival.session >= 0:
            order = sorted(turns[arrival.session], key=lambda j: arrivals[j].turn)
            tasks.append(asyncio.create_task(_conversation(stub, target, arrivals, order, request, live, now,
                                                           seed, deadline_s)))
        else:
            tasks.append(asyncio.create_task(_one_call(stub, request, live.records[i], live, now, deadline_s)))
    return tasks


def _request(request_id: str, ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True))


async def _conversation(stub, target: Target, arrivals: tuple[Arrival, ...], order: list[int],
                        first: pb.GenerateRequest, live: _Live, now, seed: int, deadline_s: float) -> None:
    """A chat's turns one after another: each resends the history (every message, and each answer as the server
    gave it) with its new message, `think_s` after the answer before it ended (a turn that failed leaves no
    answer in the history)."""
    history: list[int] = []
    request = first
    for n, i in enumerate(order):
        arrival, record = arrivals[i], live.records[i]
        if n:  # nominal offsets are the first turn's + turn * think_s
            think = (arrival.offset_s - arrivals[order[0]].offset_s) / arrival.turn
            record.scheduled_s = now() + think
            await asyncio.sleep(think)
            message = prompt_ids(arrival.message_tokens, target.vocab_size, random.Random(seed * 1_000_003 + i))
            request = _request(f"loadgen-{seed}-{i}", history + message, arrival.output_tokens)
        record.prompt_tokens = len(request.token_ids.ids)
        answer: list[int] = []
        await _one_call(stub, request, record, live, now, deadline_s, answer)
        history = list(request.token_ids.ids) + answer


def _http_client(target: Target):
    import contextlib

    if target.protocol != "http":
        return contextlib.nullcontext(None)
    import httpx

    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    return httpx.AsyncClient(base_url=f"http://{target.addr}/v1", headers=headers, timeout=None,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


class _HttpStub:
    """Generate over OpenAI's streamed /v1/completions, yielding slabserve.v1 responses (so one recorder serves
    both protocols), and raising _HttpError for an error status."""

    def __init__(self, http, target: Target):
        self._http = http
        self._model = target.model

    def Generate(self, request: pb.GenerateRequest, timeout: float):
        return self._generate(request, timeout)

    async def _generate(self, request: pb.GenerateRequest, timeout: float):
        import httpx

        body = {"model": self._model, "prompt": list(request.token_ids.ids), "temperature": 0,
                "max_tokens": request.stopping.max_tokens, "ignore_eos": request.stopping.ignore_eos,
                "stream": True, "stream_options": {"include_usage": True}}
        async with self._http.stream("POST", "/completions", json=body,
                                     timeout=httpx.Timeout(timeout, connect=10)) as response:
            if response.status_code != 200:
                await response.aread()
                raise _HttpError(response)
            reason = pb.FINISH_REASON_UNSPECIFIED
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise _HttpError(None, chunk["error"].get("message", ""))
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):  # a text chunk stands for a token event (its ids are not sent)
                        yield pb.GenerateResponse(token=pb.TokenOutput(token_ids=[0], text=choice["text"]))
                    if choice.get("finish_reason"):
                        reason = _HTTP_REASONS.get(choice["finish_reason"], pb.FINISH_REASON_CANCELLED)
                usage = chunk.get("usage")
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    yield pb.GenerateResponse(finished=pb.GenerationFinished(
                        reason=reason, usage=pb.Usage(prompt_tokens=usage["prompt_tokens"],
                                                      completion_tokens=usage["completion_tokens"],
                                                      cached_tokens=cached)))


_HTTP_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class _HttpError(Exception):
    def __init__(self, response, message: str = ""):
        self.status = HTTP_STATUS_NAMES.get(response.status_code, f"HTTP_{response.status_code}") \
            if response is not None else "INTERNAL"
        try:
            message = message or response.json()["error"]["message"]
        except Exception:  # noqa: BLE001 - not OpenAI's error body: keep the text
            message = message or response.text
        self.message = message
        self.retry_after_ms = response.headers.get("retry-after-ms") if response is not None else None


async def _one_call(stub, request: pb.GenerateRequest, record: RequestRecord, live: _Live, now,
                    deadline_s: float, answer: list[int] | None = None) -> None:
    """One Generate call into `record` (and its token ids into `answer`, when given)."""
    record.sent_s = sent = now()
    live.sent += 1
    first = last = None
    call = stub.Generate(request, timeout=deadline_s)
    try:
        async for response in call:
            t = now()
            if response.HasField("token"):
                if response.token.token_ids:
                    first = t if first is None else first
                    last = t
                    if answer is not None:
                        answer.extend(response.token.token_ids)
                continue
            _finished(record, response.finished)
        record.status = "OK" if record.finish_reason is not None else "INCOMPLETE"
    except grpc.aio.AioRpcError as err:
        _failed(record, err)
    except _HttpError as err:
        record.status, record.error = err.status, err.message[:300]
        if err.retry_after_ms and err.retry_after_ms.isdigit():
            record.retry_after_ms = int(err.retry_after_ms)
    except asyncio.CancelledError:
        if isinstance(stub, _HttpStub):
            await call.aclose()
        else:
            call.cancel()
        record.status = "CANCELLED"
        if answer is not None:
            raise  # a conversation cancelled at the drain timeout sends no more turns
    finally:
        record.end_s = now()
        record.e2e_s = record.end_s - sent
        if first is not None:
            record.ttft_s = first - sent
            if record.completion_tokens > 1 and last is not None:
                record.tpot_s = (last - first) / (record.completion_tokens - 1)
        live.done += 1
        live.ok += record.status == "OK"
        live.rejected += record.status == "RESOURCE_EXHAUSTED"
        live.errors += record.status not in ("OK", "RESOURCE_EXHAUSTED")


def _finished(record: RequestRecord, finished: pb.GenerationFinished) -> None:
    record.finish_reason = _REASONS.get(finished.reason, str(finished.reason))
    record.completion_tokens = finished.usage.completion_tokens
    record.cached_tokens = finished.usage.cached_tokens
    if finished.HasField("timings"):
        t = finished.timings
        record.server_queue_s = t.queue_seconds
        record.server_ttft_s = t.time_to_first_token_seconds
        record.server_tpot_s = t.time_per_output_token_seconds if record.completion_tokens > 1 else None


def _failed(record: RequestRecord, err: grpc.aio.AioRpcError) -> None:
    record.status = err.code().name
    record.error = (err.details() or "")[:300]
    for key, value in err.trailing_metadata() or ():
        if key == "slabserve-slab-class" and value.isdigit():
            record.slab_class = int(value)
        elif key == "retry-after-ms" and value.isdigit():
            record.retry_after_ms = int(value)


# ---- samplers and progress ----------------------------------------------------------------------------------------

async def _tick(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`; True when stopped."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(seconds, 0.0))
    except asyncio.TimeoutError:
        return False
    return True


async def _sample_rss(pid: int | None, out: list, now, options: DriveOptions, stop: asyncio.Event) -> None:
    if pid is None:
        return
    while True:
        value = resident_bytes(pid)
        if value is not None:
            out.append((now(), value))
        if await _tick(stop, options.sample_interval_s):
            break
    value = resident_bytes(pid)
    if value is not None:
        out.append((now(), value))


async def _sample_load(stub, out: list, now, options: DriveOptions, stop: asyncio.Event) -> None:
    while True:
        asked = now()
        sample = await get_load(stub, now)
        if sample is not None:
            out.append(sample)
        if await _tick(stop, options.sample_interval_s - (now() - asked)):
            break
    sample = await get_load(stub, now)
    if sample is not None:
        out.append(sample)


async def get_load(stub, now, timeout: float = 10.0) -> dict | None:
    """One GetLoad as a dict stamped with its reply time, or None when the call failed."""
    try:
        load = await stub.GetLoad(pb.GetLoadRequest(), timeout=timeout)
    except grpc.aio.AioRpcError:
        return None
    return load_to_dict(load, now())


def load_to_dict(load: pb.GetLoadResponse, t_s: float) -> dict:
    return {"t_s": t_s, "running": load.running, "queued": load.queued, "draining": load.draining,
            "classes": [{"index": c.index, "tokens": c.tokens, "free_slabs": c.free_slabs,
                         "total_slabs": c.total_slabs, "queued": c.queued} for c in load.classes]}


async def _show_progress(live: _Live, total: int, now, options: DriveOptions, stop: asyncio.Event) -> None:
    if not options.progress:
        await stop.wait()
        return
    bar = _progress_bar(total, options.label)
    while True:
        stopped = await _tick(stop, 0.25)
        bar.update(live.sent - bar.n)
        bar.set_postfix_str(f"in flight {live.sent - live.done}, ok {live.ok}, rejected {live.rejected}, "
                            f"errors {live.errors}{', draining' if live.draining else ''}", refresh=True)
        if stopped:
            break
    bar.close()


def _progress_bar(total: int, label: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, label)
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True)


class _PlainProgress:
    """tqdm's few methods used here, as one rewritten stderr line."""

    def __init__(self, total: int, label: str):
        self.n, self.total, self.label, self.postfix = 0, total, label, ""

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        sys.stderr.write(f"\r{self.label}: sent {self.n}/{self.total}; {text}   ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
