"""The OpenAI-compatible HTTP door, driven by the real `openai` client (and httpx for raw bytes) against a live
server that also serves gRPC on the same engine: no mocks of either stack."""
from __future__ import annotations

import json
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from _models import make_served_tiny_model, smollm2_path
from _served_process import ServerProcess, build_tiny_bundle, idle_load, self_signed_cert
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.edge import STATUS_TABLE, Limits
from slabserve.runtime.engine import Engine, EngineConfig
from slabserve.runtime.server import Access, create_server
from slabserve.runtime.slab_allocator import SlabClass
from slabserve.runtime.scheduler import InvalidRequestError

CLASSES = (SlabClass(64, 8), SlabClass(256, 4))
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish.",
             "What is 2 + 2?", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def served():
    engine = Engine(EngineConfig(str(smollm2_path()), CLASSES, max_seqs=12, step_tokens=64, queue_limit=64))
    server = create_server(engine, "127.0.0.1", 0, http_port=0, limits=Limits(max_message_bytes=64 * 1024))
    server.start()
    server.warm_up()
    channel = grpc.insecure_channel(server.address)
    yield server, pb_grpc.SlabServeStub(channel)
    channel.close()
    server.stop()


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http.port}/v1", api_key="unused", max_retries=0, **kw)


def _model(server) -> str:
    return server.gateway.served_name


def _grpc_text(stub, request: pb.GenerateRequest) -> tuple[str, int]:
    text, usage = [], None
    for response in stub.Generate(request, timeout=120):
        if response.HasField("token"):
            text.append(response.token.text)
        else:
            usage = response.finished.usage.completion_tokens
    return "".join(text), usage


@pytest.mark.slow
@pytest.mark.parametrize("question", QUESTIONS[:3])
def test_chat_equals_grpc_streaming_and_not(served, question):
    server, stub = served
    client = _client(server)
    expected, count = _grpc_text(stub, pb.GenerateRequest(
        messages=pb.Messages(messages=[pb.Message(role="user", content=question)]),
        stopping=pb.StoppingOptions(max_tokens=24)))
    whole = client.chat.completions.create(model=_model(server), messages=[{"role": "user", "content": question}],
                                           max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == count and whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": question}], max_completion_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


@pytest.mark.slow
def test_completion_equals_grpc_text_and_token_ids(served):
    server, stub = served
    client = _client(server)
    expected, count = _grpc_text(stub, pb.GenerateRequest(prompt="The sky is", stopping=pb.StoppingOptions(
        max_tokens=1)))
    one = client.completions.create(model=_model(server), prompt="The sky is", max_tokens=1, temperature=0)
    assert one.choices[0].text == expected != "" and one.usage.completion_tokens == 1 == count  # max_tokens 1: kept
    expected, count = _grpc_text(stub, pb.GenerateRequest(prompt="Once upon a time", stopping=pb.StoppingOptions(
        max_tokens=16, stop=["."])))
    whole = client.completions.create(model=_model(server), prompt="Once upon a time", max_tokens=16, stop=".",
                                      temperature=0)
    assert whole.choices[0].text == expected and whole.object == "text_completion"
    streamed = client.completions.create(model=_model(server), prompt="Once upon a time", max_tokens=16, stop=".",
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    ids = list(stub.Tokenize(pb.TokenizeRequest(prompt="Once upon a time"), timeout=30).token_ids)
    by_ids = client.completions.create(model=_model(server), prompt=ids, max_tokens=16, stop=".", temperature=0)
    assert by_ids.choices[0].text == expected and by_ids.usage.prompt_tokens == len(ids)


@pytest.mark.slow
def test_seeded_sampling_repeats(served):
    server, _ = served
    client = _client(server)
    args = dict(model=_model(server), prompt="My favourite animal is", max_tokens=12, temperature=0.9, top_p=0.9,
                seed=7)
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


@pytest.mark.slow
def test_64_concurrent_streams_complete_and_free_every_slab(served):
    server, stub = served
    client = _client(server, timeout=300)

    def run(i: int) -> tuple[str, str | None]:
        text, finish = [], None
        for chunk in client.chat.completions.create(
                model=_model(server), messages=[{"role": "user", "content": QUESTIONS[i % 5]}], max_tokens=8,
                temperature=0, stream=True):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(text), finish

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, range(64)))
    assert all(finish in ("stop", "length") for _, finish in results)
    for i, (text, _) in enumerate(results):  # greedy: the same question, the same answer, whatever the crowd
        assert text == results[i % 5][0]
    load = idle_load(stub)
    assert [c.free_slabs for c in load.classes] == [c.total_slabs for c in load.classes]


def _raw(server, path: str, body, headers=None) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"http://127.0.0.1:{server.http.port}{path}", content=data, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def _error(response: httpx.Response, status: int, param) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error


@pytest.mark.slow
def test_every_error_status(served):
    server, stub = served
    model = _model(server)
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for field, value in (("n", 2), ("logprobs", True), ("tools", [{"type": "function"}]), ("best_of", 2),
                         ("presence_penalty", 0.5), ("frobnicate", 1)):
        error = _error(_raw(server, "/v1/chat/completions", {**chat, field: value}), 400, field)
        assert field in error["message"] and error["type"] == "invalid_request_error"
    _error(_raw(server, "/v1/chat/completions", {**chat, "temperature": -1}), 400, "temperature")
    _error(_raw(server, "/v1/chat/completions", {**chat, "max_tokens": 0}), 400, "max_tokens")
    _error(_raw(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 0, "max_tokens": None}), 400,
           "max_completion_tokens")
    _error(_raw(server, "/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}), 400,
           "messages[0].role")
    _error(_raw(server, "/v1/chat/completions", {"model": model}), 400, "messages")
    _error(_raw(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user"}]}), 400, "messages[0].content")
    base = f"http://127.0.0.1:{server.http.port}"
    assert _error(httpx.get(f"{base}/v1/nope", timeout=60), 404, None)["message"] == "Invalid URL (GET /v1/nope)"
    assert "GET" in _error(httpx.get(f"{base}/v1/chat/completions", timeout=60), 405, None)["message"]
    _error(_raw(server, "/v1/completions", {"model": model, "prompt": [1, 10 ** 9]}), 400, "prompt")
    _error(_raw(server, "/v1/chat/completions", b"{not json"), 400, "request")
    _error(_raw(server, "/v1/chat/completions", {**chat, "model": "gpt-4"}), 404, "model")
    too_long = _error(_raw(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 300}), 413,
                      "max_tokens")
    assert too_long["code"] == "context_length_exceeded" and "256" in too_long["message"]
    _error(_raw(server, "/v1/completions", {"model": model, "prompt": "x" * 70_000}), 413, "request")
    refused = _raw(server, "/v1/completions", {"model": model, "prompt": "hello " * 40, "max_tokens": 4,
                                               "first_token_deadline_ms": 1})
    error = _error(refused, 429, None)
    assert int(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) >= 1
    assert error["code"] == "rate_limit_exceeded" and "deadline" in error["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the SDK sees the same body
        _client(server).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=3)
    assert err.value.body["param"] == "n"
    load = idle_load(stub)
    assert [c.free_slabs for c in load.classes] == [c.total_slabs for c in load.classes]


@pytest.mark.slow
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_a_client_that_hangs_up_is_cancelled_at_once(tmp_path, caplog, token):
    """Streaming or not, a client that disconnects mid-answer has its request cancelled and its slab freed, seen
    while no token is being produced (the engine held), so not only when the next token fails to send."""
    import logging
    import threading

    engine = Engine(EngineConfig(str(smollm2_path()), CLASSES, max_seqs=4, step_tokens=64, queue_limit=4))
    access = Access(token=token)
    server = create_server(engine, "127.0.0.1", 0, http_port=0, access=access)
    server.start()
    server.warm_up()
    channel = grpc.insecure_channel(server.address)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    headers = dict(metadata)
    held = threading.Event()
    try:
        caplog.set_level(logging.INFO, logger="slabserve.requests")
        base = f"http://127.0.0.1:{server.http.port}/v1"
        body = {"model": _model(server), "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        chat = {**body, "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True}
        gave_up = []

        def whole() -> None:
            try:
                httpx.post(f"{base}/completions", json={**body, "prompt": "Once upon a time"}, headers=headers,
                           timeout=1.0)
            except httpx.ReadTimeout:
                gave_up.append(True)

        with httpx.stream("POST", f"{base}/chat/completions", json=chat, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            caller = threading.Thread(target=whole)
            caller.start()
            deadline = time.monotonic() + 10
            while server.loop.num_streams() < 2 and time.monotonic() < deadline:  # both submitted
                time.sleep(0.002)
            server.loop.post(lambda: held.wait(60))  # no token comes from here on (200 take over a second)
        caller.join()
        assert gave_up == [True]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            codes = [json.loads(r.getMessage())["code"] for r in caplog.records if r.name == "slabserve.requests"]
            if len(codes) == 2:
                break
            time.sleep(0.05)
        assert codes == ["CANCELLED", "CANCELLED"], "both logged while the engine is held"
        held.set()
        load = pb_grpc.SlabServeStub(channel).GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=10)
        while load.running or load.queued:
            time.sleep(0.05)
            load = pb_grpc.SlabServeStub(channel).GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=10)
        assert [c.free_slabs for c in load.classes] == [c.total_slabs for c in load.classes]
    finally:
        held.set()
        channel.close()
        server.stop()


@pytest.mark.slow
def test_models_and_health(served):
    server, _ = served
    models = _client(server).models.list().data
    assert [m.id for m in models] == [_model(server)]
    assert _client(server).models.retrieve(_model(server)).id == _model(server)
    with pytest.raises(openai.NotFoundError) as err:
        _client(server).models.retrieve("gpt-4")
    assert err.value.body["param"] == "model" and _model(server) in err.value.body["message"]
    assert httpx.get(f"http://127.0.0.1:{server.http.port}/health").status_code == 200


def test_developer_messages_are_system_messages():
    from slabserve.runtime.edge import check_messages

    asked = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert check_messages(asked, Limits()) == [{"role": "system", "content": "Be brief."}, asked[1]]
    assert asked[0]["role"] == "developer"  # the caller's list is left as it was
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.role.*'wizard'.*developer"):
        check_messages([asked[1], {"role": "wizard", "content": "x"}], Limits())


@pytest.mark.slow
def test_a_developer_message_is_answered_as_a_system_message(served):
    server, _ = served
    answers = []
    for role in ("system", "developer"):
        done = _client(server).chat.completions.create(
            model=_model(server), messages=[{"role": role, "content": "Answer in one word."},
                                            {"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0)
        answers.append((done.choices[0].message.content, done.usage.prompt_tokens))
    assert answers[0] == answers[1] and answers[0][0]


def test_status_table_gives_both_codes():
    rows = {row.grpc_code: row.http_status for row in STATUS_TABLE.values()}
    assert rows["INVALID_ARGUMENT"] == 400 and rows["UNAUTHENTICATED"] == 401 and rows["UNAVAILABLE"] == 503
    assert STATUS_TABLE["overloaded"].http_status == 429 and STATUS_TABLE["too_long"].http_status == 413


# ---- a tiny model: warm-up, access control, TLS ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    folder = make_served_tiny_model(tmp_path_factory.mktemp("http") / "tiny")
    return Engine(EngineConfig(str(folder), (SlabClass(64, 4),), max_seqs=4, step_tokens=16, buckets=(1, 16)))


def test_503_until_warm_then_401_without_the_token(tiny_engine):
    server = create_server(tiny_engine, "127.0.0.1", 0, http_port=0, access=Access(token="t0k", open_health=True))
    server.start()
    try:
        base = f"http://127.0.0.1:{server.http.port}"
        assert httpx.get(f"{base}/health").status_code == 503  # open health: no token needed
        body = {"prompt": "hello", "max_tokens": 2}
        early = httpx.post(f"{base}/v1/completions", json=body, headers={"authorization": "Bearer t0k"})
        _error(early, 503, None)
        server.warm_up()
        assert httpx.get(f"{base}/health").status_code == 200
        _error(httpx.post(f"{base}/v1/completions", json=body), 401, None)
        _error(httpx.post(f"{base}/v1/completions", json=body, headers={"authorization": "Bearer nope"}), 401, None)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        ok = openai.OpenAI(base_url=f"{base}/v1", api_key="t0k", max_retries=0).completions.create(
            model=server.gateway.served_name, prompt="hello", max_tokens=2, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 2
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_on_both_doors(tiny_engine, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    access = Access.from_files(None, str(cert), str(key))
    server = create_server(tiny_engine, "127.0.0.1", 0, http_port=0, access=access)
    server.start()
    server.warm_up()
    try:
        client = openai.OpenAI(base_url=f"https://localhost:{server.http.port}/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(verify=str(cert)))
        done = client.completions.create(model=server.gateway.served_name, prompt="hi", max_tokens=3,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
        with pytest.raises(httpx.HTTPError):  # plaintext cannot talk to it
            httpx.get(f"http://127.0.0.1:{server.http.port}/health", timeout=5)
    finally:
        server.stop()


# ---- SIGTERM drain (a real process) ---------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_drains_http_streams(tmp_path: Path):
    root = build_tiny_bundle(tmp_path / "drain")
    server = ServerProcess.start(root, "--http-port", "0", "--grace-seconds", "60")
    try:
        port = server.wait_for("listening")["http_port"]
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        # the two 256-token slabs, each for 240 tokens: long enough to outlive the checks below
        streams = [client.completions.create(model=model, prompt=f"Story {i}", max_tokens=240, stream=True,
                                             extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
                   for i in range(2)]
        firsts = [next(iter(s)) for s in streams]
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _error(httpx.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2}), 503, None)
        for first, stream in zip(firsts, streams):
            chunks = [first, *stream]
            assert chunks[-1].usage.completion_tokens == 240
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert server.proc.wait(timeout=30) == 0
        assert '"clean": true' in server.text()
    finally:
        server.stop()


@pytest.mark.slow
def test_usage_reports_prompt_tokens_served_from_retained_kv(served):
    server, _ = served
    client = _client(server)
    prompt = ("Write a short poem about slabs of memory, contiguous and calm, that never fragment and never stall, "
              "then explain it in one sentence.")
    first = client.completions.create(model=_model(server), prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=_model(server), prompt=prompt, max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
