"""The committed gRPC stubs match proto/slabserve/v1/serving.proto, and the proto follows the house rules."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slabserve.proto import build

PROTO = build.ROOT / "slabserve/v1/serving.proto"


def test_committed_stubs_match_the_proto():
    assert build.stale_files() == [], "generated stubs drifted from the proto: run `make proto`"


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "proto"
    shutil.copytree(build.ROOT / "slabserve", root / "slabserve")
    return root


def test_a_proto_edit_without_regenerating_is_caught(tmp_path):
    root = _copy_tree(tmp_path)
    proto = root / "slabserve/v1/serving.proto"
    proto.write_text(proto.read_text().replace("  bool aborted = 1;\n", "  bool aborted = 1;\n  // new\n  uint32 n = 2;\n"))
    assert set(build.stale_files(root)) == {"slabserve/v1/serving_pb2.py", "slabserve/v1/serving_pb2.pyi"}


def test_a_hand_edited_stub_is_caught(tmp_path):
    root = _copy_tree(tmp_path)
    stub = root / "slabserve/v1/serving_pb2_grpc.py"
    stub.write_text(stub.read_text() + "\n# edited\n")
    assert build.stale_files(root) == ["slabserve/v1/serving_pb2_grpc.py"]


def _descriptor_with_comments(tmp_path: Path):
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    out = tmp_path / "serving.desc"
    assert protoc.main(["protoc", f"-I{build.ROOT}", "--include_source_info", f"--descriptor_set_out={out}",
                        "slabserve/v1/serving.proto"]) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


def test_every_message_field_enum_value_and_rpc_is_commented(tmp_path):
    fd = _descriptor_with_comments(tmp_path)
    commented = {tuple(loc.path) for loc in fd.source_code_info.location if loc.leading_comments.strip()}
    missing = []
    for i, message in enumerate(fd.message_type):
        if (4, i) not in commented:
            missing.append(message.name)
        missing += [f"{message.name}.{f.name}" for j, f in enumerate(message.field) if (4, i, 2, j) not in commented]
    for i, enum in enumerate(fd.enum_type):
        if (5, i) not in commented:
            missing.append(enum.name)
        missing += [v.name for j, v in enumerate(enum.value) if (5, i, 2, j) not in commented]
    for i, service in enumerate(fd.service):
        missing += [f"{service.name}.{m.name}" for j, m in enumerate(service.method) if (6, i, 2, j) not in commented]
    assert missing == []


def test_package_service_and_enum_prefixes(tmp_path):
    fd = _descriptor_with_comments(tmp_path)
    assert fd.package == "slabserve.v1"
    assert [s.name for s in fd.service] == ["SlabServe"]
    assert {m.name for m in fd.service[0].method} == {"Generate", "Tokenize", "GetModelInfo", "GetLoad", "Abort"}
    assert next(m for m in fd.service[0].method if m.name == "Generate").server_streaming
    for enum in fd.enum_type:
        prefix = "".join("_" + c if c.isupper() else c.upper() for c in enum.name).lstrip("_") + "_"
        assert all(v.name.startswith(prefix) for v in enum.value), (enum.name, prefix)


def test_runtime_imports_no_compiler():
    import subprocess
    import sys

    code = ("import sys, slabserve.runtime.server, slabserve.runtime.client; "
            "sys.exit(any(m.startswith('slabserve.compiler') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=build.ROOT.parent).returncode == 0
