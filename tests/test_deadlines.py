"""Admission by the caller's deadline, on real servers: an idle default plan takes a burst without refusing any of
it, and a saturated server refuses a call whose deadline it would miss at once, with gRPC's retry pushback, which a
client with a retry policy obeys until it gets in."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from _models import smollm2_path
from _served_process import ServerProcess, idle_load
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.client import CHANNEL_OPTIONS
from slabserve.runtime.engine import Engine, EngineConfig
from slabserve.runtime.server import create_server
from slabserve.runtime.slab_allocator import SlabClass

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CHATS = ["What is the capital of France?", "Name a fruit.", "How many legs does a spider have?", "Say hi.",
         "What colour is the sky?", "Give me a synonym for happy.", "What is 3 times 4?", "Name a planet.",
         "Spell cat backwards.", "What day comes after Monday?", "Name an ocean.", "What is water made of?",
         "Who wrote Hamlet?", "What is the opposite of cold?", "Name a musical instrument.", "Is ice cold?"]


def test_idle_default_plan_takes_a_burst_of_16_chats(tmp_path: Path):
    from slabserve.compiler.build import build_plan
    from slabserve.compiler.bundle import write_bundle
    from slabserve.compiler.spec import load_spec

    write_bundle(build_plan(load_spec(REPO / "plans" / "smollm2-135m.yaml", base_dir=REPO), REPO),
                 tmp_path / "bundle")
    server = ServerProcess.start(tmp_path)
    try:
        stub = pb_grpc.SlabServeStub(server.channel())

        def ask(question: str) -> str:
            request = pb.GenerateRequest(messages=pb.Messages(messages=[pb.Message(role="user", content=question)]),
                                         stopping=pb.StoppingOptions(max_tokens=16))
            try:
                *_, last = stub.Generate(request, timeout=300)
                return pb.FinishReason.Name(last.finished.reason)
            except grpc.RpcError as err:
                return f"{err.code().name}: {err.details()}"

        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(ask, CHATS))
        assert all(o in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH") for o in outcomes), outcomes
        log = [json.loads(line) for line in server.text().splitlines() if line.startswith('{"event": "request"')]
        print("\nburst of 16 on the default plan: TTFT ms", sorted(r.get("ttft_ms") for r in log))
        # each was admitted against a promise (the plan's cap), with its first token projected no later
        assert len(log) == 16 and all(r["projected_ttft_ms"] <= r["promised_ttft_ms"] for r in log), log
    finally:
        server.stop()


@pytest.fixture(scope="module")
def saturated():
    engine = Engine(EngineConfig(str(smollm2_path()), (SlabClass(64, 4), SlabClass(512, 9)), max_seqs=13,
                                 step_tokens=64, queue_limit=16))
    server = create_server(engine, "127.0.0.1", 0)
    server.start()
    server.warm_up()
    yield server
    server.stop()


def _long(i: int, n: int = 400) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[(7 * i + k) % 4000 + 100 for k in range(n)]),
                              stopping=pb.StoppingOptions(max_tokens=4, ignore_eos=True))


def test_deadline_refused_at_once_with_pushback_and_a_retrying_client_gets_in(saturated):
    with grpc.insecure_channel(saturated.address) as plain:
        stub = pb_grpc.SlabServeStub(plain)
        # 3,200 prompt tokens ahead in 64-token steps: several seconds of prefill
        background = [stub.Generate(_long(i), timeout=300) for i in range(8)]
        time.sleep(0.5)  # all five admitted (the calls start when made)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_long(9), timeout=1.0))
        refused_in = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        trailers = dict(err.value.trailing_metadata())
        assert int(trailers["grpc-retry-pushback-ms"]) >= 1 and trailers["retry-after-ms"]
        assert "caller's deadline" in err.value.details()
        assert refused_in < 0.5, f"refused after {refused_in:.2f} s: not at once"
        # the same request, from a client whose service config retries RESOURCE_EXHAUSTED after the pushback,
        # with a first-token deadline of 1.5 s per attempt: refused while the backlog lasts, then admitted
        # The service config allows 5 attempts; on a slow day the backlog outlasts them, so the caller tries the
        # call again (as an application would) until the backlog has drained, each refusal with a pushback.
        with grpc.insecure_channel(saturated.address, options=CHANNEL_OPTIONS) as retrying:
            request = _long(9)
            request.first_token_deadline_ms = 1500
            started = time.monotonic()
            calls = 0
            while True:
                calls += 1
                try:
                    *_, last = pb_grpc.SlabServeStub(retrying).Generate(request, timeout=120)
                    break
                except grpc.RpcError as refused:
                    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
                    assert int(dict(refused.trailing_metadata())["grpc-retry-pushback-ms"]) >= 1
                    assert time.monotonic() - started < 120, "still refused after 120 s: the backlog never drained"
            assert last.finished.usage.completion_tokens == 4
            print(f"\nretrying client completed after {time.monotonic() - started:.1f} s ({calls} call(s))")
        for call in background:
            *_, end = call
            assert end.finished.reason == pb.FINISH_REASON_LENGTH
        load = idle_load(stub)
        assert [c.free_slabs for c in load.classes] == [c.total_slabs for c in load.classes]
