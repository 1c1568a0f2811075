"""The README's gRPC example, run as written against a live server: it prints the whole answer (max_tokens 1
included), and the README's status table is the one the server answers from."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import grpc
import pytest

from _models import make_served_tiny_model
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.edge import STATUS_TABLE
from slabserve.runtime.engine import Engine, EngineConfig
from slabserve.runtime.server import create_server
from slabserve.runtime.slab_allocator import SlabClass

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    return next(b for b in blocks if "stub.Generate(request" in b)


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    folder = make_served_tiny_model(tmp_path_factory.mktemp("readme") / "tiny")
    engine = Engine(EngineConfig(str(folder), (SlabClass(128, 4),), max_seqs=4, step_tokens=16, buckets=(1, 16)))
    server = create_server(engine, "127.0.0.1", 0)
    server.start()
    server.warm_up()
    yield server.address
    server.stop()


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_readme_example_prints_the_whole_answer(address, max_tokens):
    code = _example().replace("127.0.0.1:50051", address).replace("max_tokens=64", f"max_tokens={max_tokens}")
    assert f"max_tokens={max_tokens}" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    # the same request, collected event by event
    namespace: dict = {}
    exec(compile(code.split("for response in")[0], "README.md", "exec"), namespace)  # noqa: S102
    text = []
    with grpc.insecure_channel(address) as channel:
        for response in pb_grpc.SlabServeStub(channel).Generate(namespace["request"], timeout=60):
            if response.HasField("token"):
                text.append(response.token.text)
            else:
                count = response.finished.usage.completion_tokens
    printed = out.getvalue()
    assert printed.startswith("".join(text)) and "".join(text) != ""
    assert printed.endswith(f"{count} tokens\n") and count <= max_tokens


def test_readme_status_table_is_the_servers():
    rows = {(code, status, when.strip()) for code, status, when in
            re.findall(r"^\| `([A-Z_]+)` \| (\d{3}) \| ([^|]+) \|", README, re.M)}
    assert rows == {(r.grpc_code, str(r.http_status), r.when) for r in STATUS_TABLE.values()}
