"""Declared prefixes end to end: the spec's `prefixes` encoded into the plan with their rows and bytes, prefilled by
a real server before it reports SERVING, and copied into the slab of every request whose prompt starts with one:
its usage says so, and its tokens are those of a server with reuse off."""
from __future__ import annotations

import json

import pytest

from _served_process import SERVING, TINY_CLASSES, ServerProcess, build_tiny_bundle, health
from slabserve.compiler.tools import inspect
from slabserve.kernels.contracts import KV_TILE
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.plan import read_plan_and_id
from slabserve.runtime.tokenizer import Tokenizer

SYSTEM = "You answer questions about KV slabs and buckets in short, plain sentences, and never guess. " * 2
QUESTIONS = ["What is a slab?", "Why buckets?", "Say hi."]


def _chat(question: str) -> pb.GenerateRequest:
    messages = pb.Messages(messages=[pb.Message(role="system", content=SYSTEM),
                                     pb.Message(role="user", content=question)])
    return pb.GenerateRequest(messages=messages, stopping=pb.StoppingOptions(max_tokens=12, ignore_eos=True))


def _run(stub, request) -> tuple[tuple[int, ...], pb.Usage]:
    tokens = []
    for response in stub.Generate(request, timeout=60):
        if response.HasField("token"):
            tokens.extend(response.token.token_ids)
        else:
            return tuple(tokens), response.finished.usage
    raise AssertionError("no finished event")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    on = build_tiny_bundle(tmp_path_factory.mktemp("on"), prefixes=[
        {"name": "assistant", "messages": [{"role": "system", "content": SYSTEM}]},
        {"name": "greeting", "text": "Hello, and welcome to the slab service. "}])
    off_root = tmp_path_factory.mktemp("off")
    (off_root / "model").symlink_to(on / "model")  # the same weights and tokenizer
    off = build_tiny_bundle(off_root, prefix_reuse=False)
    return on, off


def test_the_plan_records_each_prefix_its_tokens_rows_and_bytes(bundles):
    on, _ = bundles
    plan, plan_id = read_plan_and_id(on / "bundle")
    tok = Tokenizer.from_hf_dir(on / "model")
    system_ids = tok.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    greeting_ids = tok.encode("Hello, and welcome to the slab service. ")
    slab_rows = sum(c["tokens"] * c["count"] for c in TINY_CLASSES)
    assistant, greeting = plan.kv.prefixes
    assert (assistant.name, assistant.token_ids, assistant.row_offset) == ("assistant", tuple(system_ids), slab_rows)
    assert (greeting.name, greeting.token_ids) == ("greeting", tuple(greeting_ids))
    assert greeting.row_offset == slab_rows + len(system_ids)
    declared_end = slab_rows + len(system_ids) + len(greeting_ids)  # then unused rows to a whole K tile
    assert plan.kv.rows == -(-declared_end // KV_TILE) * KV_TILE and plan.kv.rows - declared_end < KV_TILE
    assert assistant.kv_bytes == len(system_ids) * plan.kv.bytes_per_token
    assert plan.engine.prefix_reuse
    shown = inspect(plan, plan_id)
    assert "prefix reuse: on; 2 declared prefix(es)" in shown and "assistant" in shown


def test_served_prefixes_are_copied_and_change_no_token(bundles):
    on_root, off_root = bundles
    on, off = ServerProcess.start(on_root), ServerProcess.start(off_root)
    try:
        on_stub, off_stub = pb_grpc.SlabServeStub(on.channel()), pb_grpc.SlabServeStub(off.channel())
        assert health(on.channels[0]) == SERVING  # after the prefixes were prefilled
        info, off_info = (s.GetModelInfo(pb.GetModelInfoRequest()) for s in (on_stub, off_stub))
        plan, _ = read_plan_and_id(on_root / "bundle")
        assert info.prefix_reuse and not info.prefix_reuse_off_reason
        assert [(p.name, p.tokens) for p in info.declared_prefixes] == [
            (p.name, len(p.token_ids)) for p in plan.kv.prefixes]
        assert not off_info.prefix_reuse and "prefix_reuse: false" in off_info.prefix_reuse_off_reason
        system_tokens = len(plan.kv.prefixes[0].token_ids)
        for question in QUESTIONS:
            got, usage = _run(on_stub, _chat(question))
            want, off_usage = _run(off_stub, _chat(question))
            assert got == want, f"{question!r}: the copied prefix changed the output"
            assert usage.cached_tokens >= system_tokens and off_usage.cached_tokens == 0
            assert usage.prompt_tokens == off_usage.prompt_tokens
        logged = [json.loads(line) for line in on.text().splitlines()
                  if line.startswith("{") and '"cached_tokens"' in line]
        assert logged and all(r["cached_tokens"] >= system_tokens for r in logged)
    finally:
        on.stop()
        off.stop()


def test_declared_prefixes_on_a_plan_without_exact_reuse_are_refused_at_build(tmp_path):
    from slabserve.compiler.build import BuildError

    with pytest.raises(BuildError, match=r"prefixes: declared prefixes are served by exact prefix reuse, which needs "
                                         r"the native CPU kernels .* gemm aten: remove `prefixes`"):
        build_tiny_bundle(tmp_path, gemm="aten", prefixes=[{"name": "sys", "text": SYSTEM}])
