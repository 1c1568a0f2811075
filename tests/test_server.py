"""The gRPC server over a real Engine (SmolLM2) on a free loopback port: no mocks of grpc.

One module-scoped server serves most tests; the SIGTERM drain runs `python -m slabserve.runtime.server` as a subprocess.
"""
from __future__ import annotations

import json
import logging
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _models import smollm2_path
from _served_process import idle_load
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions
from slabserve.runtime.server import SERVICE_NAME, create_server
from slabserve.runtime.slab_allocator import SlabClass

pytestmark = pytest.mark.slow

CLASSES = (SlabClass(64, 16), SlabClass(256, 4))
MAX_SEQS, QUEUE_LIMIT = 16, 64
WORDS = "the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea".split()
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Served:
    server: object
    engine: Engine
    channel: grpc.Channel
    stub: pb_grpc.SlabServeStub
    metrics_port: int
    before_warm_up: tuple          # (health status, Generate status code) seen before warm_up()
    after_warm_up: int             # health status after warm_up()
    reference: dict                # request index -> (token ids, text, finish reason) from the Engine itself


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mixed_requests(n: int = 64, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs of mixed prompt and output lengths; some need the 256-token class."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.randrange(1, 12) if i % 4 else rng.randrange(45, 70)
        out.append((" ".join(rng.choice(WORDS) for _ in range(words)), rng.randrange(1, 9)))
    return out


MIXED = _mixed_requests()


def _engine_reference(engine: Engine, requests) -> dict:
    """Greedy outputs of the Engine's own submit/step loop, one request per prompt with its own max_tokens."""
    ids = {engine.submit(p, stopping=StoppingOptions(max_tokens=m)): i for i, (p, m) in enumerate(requests)}
    got: dict[int, list] = {i: [[], "", None] for i in ids.values()}
    while engine.has_work():
        for event in engine.step():
            entry = got[ids[event.request_id]]
            entry[0].extend(event.token_ids)
            entry[1] += event.text
            if event.finished is not None:
                entry[2] = event.finished.value
    return {i: (tuple(t), text, reason) for i, (t, text, reason) in got.items()}


def _health(channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.fixture(scope="module")
def served():
    engine = Engine(EngineConfig(str(smollm2_path()), CLASSES, max_seqs=MAX_SEQS, step_tokens=64,
                                 queue_limit=QUEUE_LIMIT))
    reference = _engine_reference(engine, MIXED)  # before the server's engine thread owns the engine
    metrics_port = _free_port()
    server = create_server(engine, "127.0.0.1", 0, metrics_port=metrics_port)
    server.start()
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.SlabServeStub(channel)
    try:
        list(stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=5))
        early_code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        early_code = exc.code()
    before = (_health(channel), early_code)
    server.warm_up()
    yield Served(server, engine, channel, stub, metrics_port, before, _health(channel), reference)
    channel.close()
    server.stop()


def _collect(call) -> tuple[tuple[int, ...], str, pb.GenerationFinished]:
    tokens, text = [], []
    for response in call:
        if response.HasField("token"):
            tokens.extend(response.token.token_ids)
            text.append(response.token.text)
        else:
            return tuple(tokens), "".join(text), response.finished
    raise AssertionError("stream ended without a finished event")


def _assert_every_slab_free(stub) -> None:
    load = idle_load(stub)  # cancellations land at the next step
    assert load.running == 0 and load.queued == 0
    assert [(c.free_slabs, c.total_slabs) for c in load.classes] == [(c.count, c.count) for c in CLASSES]


REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "cancelled"}


# ---- life cycle -------------------------------------------------------------------------------------------------

def test_health_not_serving_before_warm_up_then_serving(served):
    assert served.before_warm_up == (NOT_SERVING, grpc.StatusCode.UNAVAILABLE)
    assert served.after_warm_up == SERVING
    assert _health(served.channel, SERVICE_NAME) == SERVING


def test_warm_up_ran_on_the_engine_thread(served):
    # built (and warmed) on this thread; the server warmed it again on the thread that steps it
    assert served.engine.warmed_on == served.server.loop._thread.ident != threading.get_ident()


def test_reflection_lists_the_services(served):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    db = ProtoReflectionDescriptorDatabase(served.channel)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(db.get_services())
    methods = {m.name for m in db.FindFileContainingSymbol(SERVICE_NAME).service[0].method}
    assert methods == {"Generate", "Tokenize", "GetModelInfo", "GetLoad", "Abort"}


# ---- serving ----------------------------------------------------------------------------------------------------

def test_64_concurrent_streams_match_the_engine(served, caplog):
    caplog.set_level(logging.INFO, logger="slabserve.requests")
    calls = [served.stub.Generate(pb.GenerateRequest(request_id=f"mix-{i}", prompt=p,
                                                     stopping=pb.StoppingOptions(max_tokens=m)), timeout=120)
             for i, (p, m) in enumerate(MIXED)]  # every call is in flight before any is read
    for i, call in enumerate(calls):
        tokens, text, finished = _collect(call)
        assert (tokens, text, REASONS[finished.reason]) == served.reference[i], i
        assert finished.usage.completion_tokens == len(tokens)
        assert finished.timings.time_to_first_token_seconds >= finished.timings.queue_seconds >= 0
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "slabserve.requests"]
    mine = {line["request_id"]: line for line in lines if line["request_id"].startswith("mix-")}
    assert len(mine) == 64 and all(line["code"] == "OK" and "ttft_ms" in line for line in mine.values())
    # no cap in this plan: admission projects each first token but promises none
    assert all("projected_ttft_ms" in line and "promised_ttft_ms" not in line for line in mine.values())
    _assert_every_slab_free(served.stub)


def test_streams_tokens_as_they_are_sampled(served):
    call = served.stub.Generate(pb.GenerateRequest(prompt="Count: one two three",
                                                   stopping=pb.StoppingOptions(max_tokens=6, ignore_eos=True)))
    arrivals, kinds = [], []
    for response in call:
        arrivals.append(time.monotonic())
        kinds.append(response.WhichOneof("event"))
        if response.HasField("finished"):
            assert response.finished.usage.completion_tokens == 6
        else:
            assert len(response.token.token_ids) == 1
    assert kinds == ["token"] * 6 + ["finished"]  # every token in a token event, then the end alone
    assert arrivals[-2] - arrivals[0] > 0.02  # spread over engine steps, not sent at the end


def test_cancel_200_streams_at_random_points_frees_every_slab(served):
    rng = random.Random(1)
    plans = [(i, rng.choice(["cancel", "deadline", "abort", "now"]), rng.randrange(0, 5), rng.uniform(0.05, 1.0),
              " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60)))) for i in range(200)]

    def run(plan) -> str:
        i, how, after, deadline, prompt = plan
        request = pb.GenerateRequest(request_id=f"cx-{i}", prompt=prompt,
                                     stopping=pb.StoppingOptions(max_tokens=40, ignore_eos=True))
        call = served.stub.Generate(request, timeout=deadline if how == "deadline" else 120)
        if how == "now":
            call.cancel()
            return "cancelled"
        try:
            for k, response in enumerate(call):
                if response.HasField("finished"):
                    return REASONS[response.finished.reason]
                if k >= after and how == "cancel":
                    call.cancel()
                if k >= after and how == "abort":
                    served.stub.Abort(pb.AbortRequest(request_id=f"cx-{i}"), timeout=30)
        except grpc.RpcError as exc:
            return exc.code().name
        return "no final event"

    with ThreadPoolExecutor(50) as pool:
        outcomes = list(pool.map(run, plans))
    assert "no final event" not in outcomes
    assert set(outcomes) <= {"cancelled", "CANCELLED", "DEADLINE_EXCEEDED", "length", "RESOURCE_EXHAUSTED"}
    assert outcomes.count("cancelled") + outcomes.count("CANCELLED") > 100
    _assert_every_slab_free(served.stub)


def test_abort_by_request_id_and_duplicate_ids(served):
    call = served.stub.Generate(pb.GenerateRequest(request_id="dup", prompt="Tell me a long story",
                                                   stopping=pb.StoppingOptions(max_tokens=50, ignore_eos=True)))
    first = next(call)
    assert first.request_id == "dup" and first.HasField("token")
    with pytest.raises(grpc.RpcError) as err:
        list(served.stub.Generate(pb.GenerateRequest(request_id="dup", prompt="again")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
    assert served.stub.Abort(pb.AbortRequest(request_id="dup")).aborted
    *_, finished = _collect(call)
    assert finished.reason == pb.FINISH_REASON_CANCELLED
    assert not served.stub.Abort(pb.AbortRequest(request_id="dup")).aborted
    _assert_every_slab_free(served.stub)


def test_queue_full_names_the_class_with_a_retry_hint(served):
    long = pb.StoppingOptions(max_tokens=150, ignore_eos=True)  # needs the 256-token class (class 1, 4 slabs)
    calls = [served.stub.Generate(pb.GenerateRequest(prompt="Write an essay", stopping=long), timeout=120)
             for _ in range(4 + QUEUE_LIMIT)]
    try:
        deadline = time.monotonic() + 30
        while served.stub.GetLoad(pb.GetLoadRequest()).classes[1].queued < QUEUE_LIMIT:
            assert time.monotonic() < deadline, "the long requests never filled class 1's queue"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            list(served.stub.Generate(pb.GenerateRequest(prompt="Write an essay", stopping=long), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(err.value.trailing_metadata())
        assert trailers["slabserve-slab-class"] == "1" and int(trailers["retry-after-ms"]) > 0
        assert "slab class 1" in err.value.details() and "retry in about" in err.value.details()
        # refused without waiting for the engine thread: held in a command here, it could not answer in 10 s
        held = threading.Event()
        served.server.loop.post(lambda: held.wait(60))
        try:
            with pytest.raises(grpc.RpcError) as err:
                list(served.stub.Generate(pb.GenerateRequest(prompt="Write an essay", stopping=long), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        finally:
            held.set()
    finally:
        for call in calls:
            call.cancel()
    _assert_every_slab_free(served.stub)


def test_tokenize_model_info_and_metrics(served):
    tok = served.engine.tokenizer
    assert list(served.stub.Tokenize(pb.TokenizeRequest(prompt="Hello there")).token_ids) == tok.encode("Hello there")
    chat = pb.TokenizeRequest(messages=pb.Messages(messages=[pb.Message(role="user", content="Hi")]))
    assert list(served.stub.Tokenize(chat).token_ids) == tok.encode_chat([{"role": "user", "content": "Hi"}])
    info = served.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_request_tokens == 256 and info.vocab_size == served.engine.model_config.vocab_size
    assert [(c.tokens, c.count) for c in info.slab_classes] == [(c.tokens, c.count) for c in CLASSES]
    assert info.has_chat_template and info.max_running == MAX_SEQS and info.queue_limit == QUEUE_LIMIT
    list(served.stub.Generate(pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingOptions(max_tokens=3))))
    text = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=10).read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("slabserve_")}
    assert values['slabserve_free_slabs{slab_class="1:256"}'] == 4
    assert values["slabserve_requests_running"] == 0 and values["slabserve_kv_utilization"] == 0
    assert values["slabserve_time_to_first_token_seconds_count"] >= 1
    assert values["slabserve_first_token_projection_ratio_count"] >= 1
    assert values["slabserve_first_token_promises_total"] == 0  # no cap, no promise
    assert values["slabserve_time_per_output_token_seconds_count"] >= 1
    assert values["slabserve_generated_tokens_total"] >= 3
    assert values['slabserve_requests_total{code="OK",finish_reason="length"}'] >= 1


def test_a_repeated_prompt_is_served_from_retained_kv_and_says_so(served):
    info = served.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.prefix_reuse and not info.prefix_reuse_off_reason
    request = pb.GenerateRequest(prompt="Name three colours of the rainbow, then three fruits of the same colours, "
                                        "then one sentence about why the sky looks blue at noon, please.",
                                 stopping=pb.StoppingOptions(max_tokens=6, ignore_eos=True))
    first_tokens, _, first = _collect(served.stub.Generate(request))
    again_tokens, _, again = _collect(served.stub.Generate(request))
    assert again_tokens == first_tokens
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1  # only its last token was computed
    text = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=10).read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("slabserve_prefix")}
    assert values["slabserve_prefix_hit_tokens_total"] >= again.usage.cached_tokens
    assert values["slabserve_prefix_miss_tokens_total"] >= first.usage.prompt_tokens


# ---- bad requests -----------------------------------------------------------------------------------------------

def _gen(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(**fields)


def _stop(**fields) -> pb.StoppingOptions:
    return pb.StoppingOptions(**fields)


def _msgs(*pairs) -> pb.Messages:
    return pb.Messages(messages=[pb.Message(role=r, content=c) for r, c in pairs])


INVALID, OUT_OF_RANGE, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
BAD_REQUESTS = {  # name: (request, expected code, field named in the message / trailer, or None)
    "no input": (_gen(), INVALID, "input"),
    "empty prompt": (_gen(prompt=""), INVALID, "prompt"),
    "empty token ids": (_gen(token_ids=pb.TokenIds()), INVALID, "token_ids"),
    "token id outside the vocabulary": (_gen(token_ids=pb.TokenIds(ids=[1, 49152])), INVALID, "token_ids"),
    "huge token id": (_gen(token_ids=pb.TokenIds(ids=[2**32 - 1])), INVALID, "token_ids"),
    "empty messages": (_gen(messages=pb.Messages()), INVALID, "messages"),
    "unknown role": (_gen(messages=_msgs(("user", "hi"), ("wizard", "x"))), INVALID, "messages[1].role"),
    "empty role": (_gen(messages=_msgs(("", "hi"))), INVALID, "messages[0].role"),
    "negative temperature": (_gen(prompt="a", sampling=pb.SamplingParams(temperature=-0.5)), INVALID,
                             "sampling.temperature"),
    "NaN temperature": (_gen(prompt="a", sampling=pb.SamplingParams(temperature=float("nan"))), INVALID,
                        "sampling.temperature"),
    "infinite temperature": (_gen(prompt="a", sampling=pb.SamplingParams(temperature=float("inf"))), INVALID,
                             "sampling.temperature"),
    "top_p zero": (_gen(prompt="a", sampling=pb.SamplingParams(top_p=0.0)), INVALID, "sampling.top_p"),
    "top_p above one": (_gen(prompt="a", sampling=pb.SamplingParams(top_p=1.5)), INVALID, "sampling.top_p"),
    "top_k above vocabulary": (_gen(prompt="a", sampling=pb.SamplingParams(top_k=10**6)), INVALID,
                               "sampling.top_k"),
    "min_p above one": (_gen(prompt="a", sampling=pb.SamplingParams(min_p=2.0)), INVALID, "sampling.min_p"),
    "seed at 2^63": (_gen(prompt="a", sampling=pb.SamplingParams(seed=2**63)), INVALID, "sampling.seed"),
    "max_tokens zero": (_gen(prompt="a", stopping=_stop(max_tokens=0)), INVALID, "stopping.max_tokens"),
    "too many stop strings": (_gen(prompt="a", stopping=_stop(stop=["x"] * 17)), INVALID, "stopping.stop"),
    "empty stop string": (_gen(prompt="a", stopping=_stop(stop=["ok", ""])), INVALID, "stopping.stop[1]"),
    "stop string too long": (_gen(prompt="a", stopping=_stop(stop=["y" * 129])), INVALID, "stopping.stop[0]"),
    "too many stop token ids": (_gen(prompt="a", stopping=_stop(stop_token_ids=[1] * 65)), INVALID,
                                "stopping.stop_token_ids"),
    "stop token id outside vocabulary": (_gen(prompt="a", stopping=_stop(stop_token_ids=[10**6])), INVALID,
                                         "stopping.stop_token_ids"),
    "request id too long": (_gen(request_id="r" * 129, prompt="a"), INVALID, "request_id"),
    "max_tokens beyond the largest slab": (_gen(prompt="a", stopping=_stop(max_tokens=10_000)), OUT_OF_RANGE,
                                           None),
    "max_tokens 2^32-1": (_gen(prompt="a", stopping=_stop(max_tokens=2**32 - 1)), OUT_OF_RANGE, None),
    "prompt longer than the largest slab": (_gen(token_ids=pb.TokenIds(ids=[5] * 300)), OUT_OF_RANGE, None),
    "message over the size limit": (_gen(prompt="z" * (2 << 20)), EXHAUSTED, None),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_gets_its_status_and_the_server_keeps_serving(served, name):
    request, code, field = BAD_REQUESTS[name]
    with pytest.raises(grpc.RpcError) as err:
        list(served.stub.Generate(request, timeout=30))
    assert err.value.code() == code, err.value.details()
    trailers = dict(err.value.trailing_metadata() or ())
    if field is not None:
        assert trailers["slabserve-field"] == field and err.value.details().startswith(field)
    if code == OUT_OF_RANGE:
        assert trailers["slabserve-limit-tokens"] == "256" and "256" in err.value.details()
    assert _health(served.channel) == SERVING


@pytest.mark.parametrize("call, message", [
    ("Tokenize", pb.TokenizeRequest()),
    ("Tokenize", pb.TokenizeRequest(messages=_msgs(("robot", "x")))),
    ("Abort", pb.AbortRequest()),
])
def test_bad_unary_requests_are_invalid_argument(served, call, message):
    with pytest.raises(grpc.RpcError) as err:
        getattr(served.stub, call)(message, timeout=10)
    assert err.value.code() == INVALID


def test_still_serving_after_bad_requests(served):
    tokens, text, finished = _collect(served.stub.Generate(
        pb.GenerateRequest(prompt="The sky is", stopping=pb.StoppingOptions(max_tokens=3, ignore_eos=True))))
    assert finished.reason == pb.FINISH_REASON_LENGTH and len(tokens) == 3
    _assert_every_slab_free(served.stub)


# ---- SIGTERM drain (a real process) -----------------------------------------------------------------------------

def _wait_for_line(log: Path, event: str, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == event:
                return json.loads(line)
        assert proc.poll() is None, f"server exited early:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {event!r} line within {timeout} s:\n{log.read_text()[-3000:]}")


def test_sigterm_drains_running_streams_then_exits_0(tmp_path):
    log = tmp_path / "server.log"
    started = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "slabserve.runtime.server", "--model", str(smollm2_path()),
                                 "--classes", "64x8,256x2", "--max-seqs", "8", "--step-tokens", "64",
                                 "--port", "0", "--metrics-port", "-1", "--grace-seconds", "60"],
                                stdout=sink, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    try:
        address = _wait_for_line(log, "listening", proc, 300)["address"]
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.SlabServeStub(channel)
        ready = _wait_for_line(log, "serving", proc, 300)
        seconds_to_serving = time.monotonic() - started
        assert _health(channel) == SERVING
        print(f"\nstart to health SERVING: {seconds_to_serving:.1f} s (server's own figure {ready['startup_s']} s)")
        # The target is 20 s (about 11 s measured on this 2-core machine when idle); the bound here only catches a
        # pathological start, since other jobs may share the cores.
        assert seconds_to_serving < 300
        # 48 tokens each (the prompt and they fit the 64-token slabs): a drain long enough (about 47 steps) for the
        # health checks below to see it; with 12 the streams could finish and the server exit before the first check
        # reached it (a CI run on 2026-12-07: connection refused)
        calls = [stub.Generate(pb.GenerateRequest(prompt=f"Story number {i}:",
                                                  stopping=pb.StoppingOptions(max_tokens=48, ignore_eos=True)),
                               timeout=120) for i in range(6)]
        firsts = [next(call) for call in calls]  # every stream is running
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _health(channel) != NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt="late"), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for first, call in zip(firsts, calls):
            tokens, _, finished = _collect(call)
            assert finished.reason == pb.FINISH_REASON_LENGTH and len(first.token.token_ids) + len(tokens) == 48
        assert proc.wait(timeout=30) == 0
        assert '"clean": true' in log.read_text()
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_build_runs_on_a_passing_thread_and_reports_its_result_or_error():
    """serve builds its Engine on a thread that ends (its OpenMP team goes with it: engine_loop.on_a_passing_thread)."""
    import threading

    from slabserve.runtime.engine_loop import on_a_passing_thread

    seen = []
    assert on_a_passing_thread(lambda: seen.append(threading.current_thread().name) or 7) == 7
    assert seen == ["engine_build"]
    with pytest.raises(ValueError, match="bad plan"):
        on_a_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad plan")))
    assert not any(t.name == "engine_build" for t in threading.enumerate())
