"""Generate the Python stubs of proto/slabserve/v1/*.proto with grpc_tools (a dev dependency).

The stubs are committed beside the protos, so a serving image needs neither protoc nor grpcio-tools; they are never
edited by hand. `python -m slabserve.proto.build` (or `make proto`) rewrites them; `python -m slabserve.proto.build
--check` exits 1, naming the stale files, when they differ from what the protos generate now (tests/test_proto.py
runs the same check). Only the lines that record which protobuf/grpcio-tools wrote a file are ignored by the check: a newer
grpcio-tools that generates the same code otherwise is not drift.

protoc writes `from slabserve.v1 import serving_pb2` into the gRPC stubs (import paths follow the `-I` root); the
package here is `slabserve.proto.slabserve.v1`, so that one import is rewritten.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent           # the folder protoc's -I points at
PROTOS = ("slabserve/v1/serving.proto",)
_IMPORT = re.compile(r"^from slabserve\.(\S+) import (\S+)_pb2 as", re.M)
# Lines that carry tool versions, not content: ignored by --check.
_VERSION_LINES = re.compile(r"^# Protobuf Python Version:[^\n]*$|^GRPC_GENERATED_VERSION = [^\n]*$|"
                            r"^_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*^\)$", re.M)


def generate(out: Path, root: Path = ROOT) -> list[Path]:
    """Run protoc on the PROTOS under `root` into `out` (a mirror of `root`); return the files written."""
    from grpc_tools import protoc  # dev dependency: only the build and the drift test need it
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(PROTOS)}")
    written = sorted(p for p in out.rglob("*_pb2*.py*") if p.is_file())
    for path in written:
        text = _IMPORT.sub(r"from slabserve.proto.slabserve.\1 import \2_pb2 as", path.read_text())
        path.write_text(text)
    return written


def stale_files(root: Path = ROOT) -> list[str]:
    """Generated files (relative to `root`) that are missing, extra, or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp).as_posix(): _content(p) for p in generate(Path(tmp), root)}
    ours = {p.relative_to(root).as_posix(): _content(p) for d in {Path(x).parent for x in PROTOS}
            for p in (root / d).glob("*_pb2*.py*")}
    return sorted(name for name in fresh.keys() | ours.keys() if fresh.get(name) != ours.get(name))


def _content(path: Path) -> str:
    return _VERSION_LINES.sub("", path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slabserve.proto.build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated stubs: {', '.join(stale)}; run `make proto`", file=sys.stderr)
            return 1
        return 0
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
