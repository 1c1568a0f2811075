"""The plan file read as untrusted input: every corruption is one clear PlanFormatError, before anything is built.

One tiny plan (tests/golden/tiny-llama.yaml, config only) is built per module; each case edits its decoded data,
re-encodes it canonically, and checks the reader's message names the field.
"""
from __future__ import annotations

import copy
from pathlib import Path

import msgpack
import pytest

from slabserve.compiler.build import build_plan
from slabserve.compiler.bundle import write_bundle
from slabserve.compiler.cli import main
from slabserve.compiler.spec import load_spec
from slabserve.runtime import plan as P

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "bundle"
    spec = load_spec(ROOT / "tests" / "golden" / "tiny-llama.yaml", base_dir=ROOT)
    write_bundle(build_plan(spec, ROOT), out)
    return out


@pytest.fixture(scope="module")
def raw(bundle) -> dict:
    return msgpack.unpackb((bundle / P.PLAN_FILE).read_bytes())


def _write(tmp_path: Path, data: bytes) -> Path:
    (tmp_path / P.PLAN_FILE).write_bytes(data)
    return tmp_path


def _edited(raw: dict, edit) -> bytes:
    data = copy.deepcopy(raw)
    edit(data)
    return msgpack.packb(data, use_bin_type=True)


def test_round_trip_and_id(bundle):
    data = (bundle / P.PLAN_FILE).read_bytes()
    plan = P.read_plan(bundle)
    assert P.encode_plan(plan) == data and P.decode_plan(data) == plan
    assert len(P.plan_id(data)) == 64
    assert plan.engine.max_seqs == 4 and plan.kv.classes[0].row_offset == 0


def _set(path: str, value):
    def edit(data: dict) -> None:
        node = data
        keys = [int(k) if k.lstrip("-").isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return edit


def _delete(path: str):
    def edit(data: dict) -> None:
        node = data
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]
    return edit


def _overlap(data: dict) -> None:
    tensors = data["activations"]["buckets"][-1]["tensors"]
    busy = max(tensors, key=lambda t: t["last_use"] - t["first_use"])
    other = next(t for t in tensors if t is not busy and t["nbytes"] and t["first_use"] <= busy["last_use"]
                 and busy["first_use"] <= t["last_use"])
    other["offset"] = busy["offset"]


def _add_unknown(data: dict) -> None:
    data["totals"]["bonus"] = 1


CASES = [
    ("unknown version", _set("version", 6), "schema version 6 is not supported"),
    ("an older version", _set("version", 2), "schema version 2 is not supported; this runtime reads version 5"),
    ("another schema", _set("schema", "other.plan"), "not a slabserve plan"),
    ("missing field", _delete("kv.rows"), "kv.rows: missing"),
    ("missing section", _delete("capacity"), "capacity: missing"),
    ("unknown field", _add_unknown, "totals.bonus: unknown field"),
    ("negative weight offset", _set("weights.entries[1].offset", -256), "weights.entries[1].offset: -256 is out of range"),
    ("weight past the arena", _set("weights.arena_bytes", 1024), "run past the weight arena"),
    ("overlapping weights", _set("weights.entries[1].offset", 0), "overlaps the entry before"),
    ("misaligned weight", _set("weights.entries[1].offset", 300000 + 3), "not aligned"),
    ("weight bytes not its shape", _set("weights.entries[0].nbytes", 12), "is not prod(shape)"),
    ("slab outside the arena", _set("kv.classes[-1].count", 9), "outside the KV arena"),
    ("slab classes not back to back", _set("kv.classes[1].row_offset", 7), "kv.classes[1].row_offset: 7"),
    ("KV bytes that disagree with (L, N, Hkv, D)", _set("kv.k_bytes", 1), "kv.k_bytes"),
    ("overflowing size", _set("weights.entries[0].shape", [2**40, 2**40]), "overflows"),
    ("int above 2**62", _set("kv.rows", 2**63), "out of range"),
    ("string for an int", _set("engine.max_seqs", "4"), "engine.max_seqs: expected an integer"),
    ("bool for an int", _set("engine.max_seqs", True), "engine.max_seqs: expected an integer"),
    ("NaN utilization", _set("capacity.utilization", float("nan")), "capacity.utilization: expected a finite"),
    ("unknown dtype", _set("engine.dtype", "float8"), "engine.dtype: dtype 'float8'"),
    ("unknown gemm", _set("engine.gemm", "blas"), "engine.gemm: 'blas' is not one of aten, native"),
    ("buckets not ascending", _set("engine.buckets", [2, 1, 4, 8]), "not strictly ascending"),
    ("overlapping activations", _overlap, "share bytes while both alive"),
    ("totals that do not add up", _set("totals.planned_bytes", 5), "totals.planned_bytes"),
    ("fits that lies", _set("totals.fits", False), "totals.fits"),
    ("servable without weights", _set("servable", True), "not servable"),
    ("list where a map goes", _set("kv", [1, 2]), "kv: expected a map"),
]


@pytest.mark.parametrize("what, edit, message", CASES, ids=[c[0] for c in CASES])
def test_corrupt_field_refused(raw, tmp_path, what, edit, message):
    with pytest.raises(P.PlanFormatError) as info:
        P.read_plan(_write(tmp_path, _edited(raw, edit)))
    assert message in str(info.value), str(info.value)


def test_truncated_at_every_tenth(bundle, tmp_path):
    data = (bundle / P.PLAN_FILE).read_bytes()
    for cut in range(0, len(data), max(1, len(data) // 10)):
        with pytest.raises(P.PlanFormatError):
            P.read_plan(_write(tmp_path, data[:cut]))


def test_garbage_and_odd_encodings(bundle, raw, tmp_path):
    data = (bundle / P.PLAN_FILE).read_bytes()
    bad = {
        "not msgpack": b"\xc1" * 64,
        "extra bytes": data + b"\x00",
        "a list at the top": msgpack.packb([1, 2, 3]),
        "an extension type": msgpack.packb(msgpack.ExtType(5, b"evil")),
        "a bomb of nesting": b"\x91" * 100_000 + b"\x00",
        "non-canonical key order": msgpack.packb(dict(reversed(list(raw.items()))), use_bin_type=True),
        "a pickle": b"\x80\x04\x95" + bytes(32),
    }
    for what, blob in bad.items():
        with pytest.raises(P.PlanFormatError):
            P.read_plan(_write(tmp_path, blob))


def test_size_limit_checked_before_reading(tmp_path):
    with open(tmp_path / P.PLAN_FILE, "wb") as fh:
        fh.truncate(P.MAX_PLAN_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(P.PlanFormatError, match="above the limit"):
        P.read_plan(tmp_path)


def test_missing_bundle(tmp_path):
    with pytest.raises(P.PlanFormatError, match="no such file"):
        P.read_plan(tmp_path / "nowhere")


@pytest.mark.parametrize("command", [["plan", "inspect"], ["plan", "verify", "--target", "H100-80GB"]])
def test_cli_refuses_bad_bundles_without_traceback(bundle, raw, tmp_path, capsys, command):
    cases = {"truncated": (bundle / P.PLAN_FILE).read_bytes()[:1000], "version": _edited(raw, _set("version", 9))}
    for what, blob in cases.items():
        folder = tmp_path / what
        folder.mkdir()
        _write(folder, blob)
        code = main([*command[:2], str(folder), *command[2:]])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and "Traceback" not in err, (what, err)
