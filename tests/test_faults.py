"""Faults against real `slabserve serve` processes on a tiny plan bundle (tests/_served_process.py).

One server process takes every client-side fault: disconnects and deadline expiries mid-stream, a burst of 1,000
aborts with streams cancelled among them. After each, every slab is free and the server still serves; after all of
them, its resident memory is back at its figure after a warm-up round of the same faults, within 1 MiB. Other
processes show what happens at start and at death: SIGKILL then a restart on the same bundle (a clean start: the
server writes no files), a plan larger than the memory free here or than --memory-limit (refused with figures
before anything is allocated), and a bundle whose model no longer matches its fingerprints (refused with the
reason).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from _served_process import ServerProcess, assert_every_slab_free, assert_serves, build_tiny_bundle, idle_load
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.plan import read_plan

LONG = pb.StoppingOptions(max_tokens=200, ignore_eos=True)   # needs the 256-token class; about 200 engine steps
MiB = 1 << 20


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return build_tiny_bundle(tmp_path_factory.mktemp("faults"))


def _resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _settled_rss(server: ServerProcess, stub) -> int:
    """VmRSS once the server is idle and has had a quiet second to give freed heap back (it does so once per idle
    spell): the first of two readings half a second apart that agree within 64 KiB."""
    idle_load(stub)
    time.sleep(1.0)
    last = _resident_bytes(server.pid)
    for _ in range(20):
        time.sleep(0.5)
        now = _resident_bytes(server.pid)
        if abs(now - last) <= 64 * 1024:
            return last
        last = now
    return last


# ---- the faults, each a function so the warm-up round and the tests run the same traffic ------------------------

def disconnect_mid_stream(address: str, n: int = 8) -> list[bool]:
    """`n` clients, each on its own connection, read their stream's first token and close the channel."""
    got_a_token = []
    for i in range(n):
        channel = grpc.insecure_channel(address)
        call = pb_grpc.SlabServeStub(channel).Generate(pb.GenerateRequest(prompt=f"story {i}", stopping=LONG),
                                                       timeout=60)
        got_a_token.append(next(call).HasField("token"))
        channel.close()
    return got_a_token


def deadlines_mid_stream(stub, n: int = 10) -> list[tuple[str, int]]:
    """`n` long streams at once with deadlines from 50 ms to 5 s (whatever this machine's speed, some pass while
    tokens flow): (how each ended, events received)."""
    def run(i: int) -> tuple[str, int]:
        call = stub.Generate(pb.GenerateRequest(prompt=f"tale {i}", stopping=LONG), timeout=0.05 * 1.67 ** i)
        events = 0
        try:
            for response in call:
                events += 1
                if response.HasField("finished"):
                    return pb.FinishReason.Name(response.finished.reason), events
        except grpc.RpcError as exc:
            return exc.code().name, events
        return "no final event", events

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def abort_burst(stub, num_streams: int = 16, num_cancelled: int = 8, num_aborts: int = 1000):
    """`num_streams` long streams with ids (2 run, the rest queue), `num_cancelled` more that the client cancels
    during a burst of `num_aborts` Abort calls (32 at a time) on the streams' ids and as many unknown ones.
    Returns (id -> Abort answers, id -> how its stream ended)."""
    ids = [f"burst-{i}" for i in range(num_streams)]
    calls = {rid: stub.Generate(pb.GenerateRequest(request_id=rid, prompt=rid, stopping=LONG), timeout=60)
             for rid in ids}
    cancelled = [stub.Generate(pb.GenerateRequest(prompt=f"cancel {i}", stopping=LONG), timeout=60)
                 for i in range(num_cancelled)]
    next(calls[ids[0]])  # the streams are in: the first one is running
    targets = [f"burst-{i % (2 * num_streams)}" for i in range(num_aborts)]
    random.Random(0).shuffle(targets)

    def abort(rid: str):
        try:
            return rid, stub.Abort(pb.AbortRequest(request_id=rid), timeout=30).aborted
        except grpc.RpcError as exc:
            return rid, exc.code().name

    with ThreadPoolExecutor(32) as pool:
        answers = [pool.submit(abort, rid) for rid in targets]
        for call in cancelled:
            call.cancel()
        answers = [a.result() for a in answers]
    by_id: dict[str, list] = {}
    for rid, answer in answers:
        by_id.setdefault(rid, []).append(answer)
    ends = {}
    for rid, call in calls.items():
        try:
            *_, last = call
            ends[rid] = pb.FinishReason.Name(last.finished.reason)
        except grpc.RpcError as exc:
            ends[rid] = exc.code().name
    return by_id, ends


FAULTS = {  # name -> how to cause it once
    "disconnect": lambda served: disconnect_mid_stream(served.server.address),
    "deadline": lambda served: deadlines_mid_stream(served.stub),
    "abort burst": lambda served: abort_burst(served.stub),
}


@dataclass
class Served:
    server: ServerProcess
    channel: grpc.Channel
    stub: pb_grpc.SlabServeStub
    rss_after_warm_up: int = 0
    faults_since_warm_up: set[str] = field(default_factory=set)

    def cause(self, fault: str):
        self.faults_since_warm_up.add(fault)
        return FAULTS[fault](self)


@pytest.fixture(scope="module")
def served(root):
    """The server every client-side fault goes to, with its resident memory after one warm-up round of every
    fault: the first round legitimately warms what stays (the handler threads the busiest moment needs, their
    stacks and malloc caches, gRPC's buffers, the tokenizer's cache for these prompts), so the figure to hold is
    the one after it."""
    server = ServerProcess.start(root, "--memory-limit", "4GiB")  # a limit the plan fits: it starts
    channel = server.channel()
    served = Served(server, channel, pb_grpc.SlabServeStub(channel))
    for fault in FAULTS.values():
        fault(served)
    assert_every_slab_free(served.stub)
    served.rss_after_warm_up = _settled_rss(server, served.stub)
    yield served
    server.stop()


# ---- client-side faults, one server process ---------------------------------------------------------------------

def test_client_disconnects_mid_stream_free_their_slabs(served):
    server, channel, stub = served.server, served.channel, served.stub
    assert served.cause("disconnect") == [True] * 8
    assert_every_slab_free(stub)
    assert_serves(stub, channel)
    assert '"code": "CANCELLED"' in server.text()


def test_deadlines_passing_mid_stream_free_their_slabs(served):
    channel, stub = served.channel, served.stub
    outcomes = served.cause("deadline")
    # A deadline shorter than the projected first token is refused at admission (RESOURCE_EXHAUSTED, before any
    # event: runtime/admission.py); one that passes later ends the stream with DEADLINE_EXCEEDED.
    assert {how for how, _ in outcomes} <= {"DEADLINE_EXCEEDED", "FINISH_REASON_LENGTH", "RESOURCE_EXHAUSTED"}, outcomes
    assert all(events == 0 for how, events in outcomes if how == "RESOURCE_EXHAUSTED"), outcomes
    assert any(how == "DEADLINE_EXCEEDED" and events > 0 for how, events in outcomes), outcomes  # mid-stream
    assert_every_slab_free(stub)
    assert_serves(stub, channel)


def test_a_burst_of_1000_aborts_with_cancels_frees_every_slab(served):
    channel, stub = served.channel, served.stub
    answers, ends = served.cause("abort burst")
    assert sum(len(a) for a in answers.values()) == 1000
    assert all(isinstance(a, bool) for each in answers.values() for a in each), answers  # every Abort answered OK
    for rid, end in ends.items():
        # A stream is cancelled by exactly one Abort that said True, or it finished first and none did.
        assert (end, answers[rid].count(True)) in {("FINISH_REASON_CANCELLED", 1), ("FINISH_REASON_LENGTH", 0)}
    # 2 run and 14 wait for a slab, some 3 s of generation on this model: how many finish before the burst reaches
    # them depends on the machine's load, so only "some were cancelled" is asserted.
    assert "FINISH_REASON_CANCELLED" in ends.values()
    unknown = [a for rid, each in answers.items() if rid not in ends for a in each]
    assert unknown and not any(unknown)
    assert_every_slab_free(stub)
    assert_serves(stub, channel)


def test_memory_after_every_fault_is_its_post_warm_up_figure(served):
    """Runs after the fault tests above (it causes any of them that did not run, under `-k` say): every slab is
    free and the process's resident memory is within 1 MiB of its figure after the warm-up round."""
    for fault in FAULTS:
        if fault not in served.faults_since_warm_up:
            served.cause(fault)
    assert_serves(served.stub, served.channel)
    assert_every_slab_free(served.stub)
    after, before = _settled_rss(served.server, served.stub), served.rss_after_warm_up
    print(f"\nVmRSS after warm-up {before / MiB:.2f} MiB, after every fault {after / MiB:.2f} MiB "
          f"({(after - before) / 1024:+.0f} KiB)")
    assert abs(after - before) <= MiB


# ---- death and restart --------------------------------------------------------------------------------------------

def _tree(*folders: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folders`: path -> (mode, sha256)."""
    out = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                out[str(path)] = (path.stat().st_mode, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def _files_open_for_writing(pid: int) -> list[str]:
    """Regular files the process holds open for writing (its stdout and stderr, the log the test gave it, aside),
    and files it maps shared and writable."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        except (FileNotFoundError, IndexError):
            continue  # closed meanwhile
        if fd in ("1", "2") or not target.startswith("/") or target.startswith(("/dev/", "/proc/")):
            continue
        if flags & os.O_ACCMODE != os.O_RDONLY and stat.S_ISREG(os.stat(target).st_mode):
            found.append(target)
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1][1] == "w" and parts[1][3] == "s" and parts[5].startswith("/") \
                and not parts[5].startswith("/dev/"):
            found.append(f"{parts[5]} (mapped shared, writable)")
    return found


def test_sigkill_mid_stream_then_a_clean_restart_on_the_same_bundle(root, tmp_path):
    scratch = root / "scratch"
    watched = (root / "bundle", root / "model")
    before = _tree(*watched)
    entries = sorted(p.name for p in root.iterdir() if p.suffix != ".log")
    first = ServerProcess.start(root, log_name="killed.log")
    try:
        stub = pb_grpc.SlabServeStub(first.channel())
        # Two long streams: the plan's two 256-token slabs, so both run (a third would wait for one to finish).
        calls = [stub.Generate(pb.GenerateRequest(prompt=f"doomed {i}", stopping=LONG), timeout=60) for i in range(2)]
        assert all(next(call).HasField("token") for call in calls)  # streaming when it dies
        assert _files_open_for_writing(first.pid) == []
        first.proc.send_signal(signal.SIGKILL)
        assert first.proc.wait(timeout=30) == -signal.SIGKILL
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        first.stop()
    # Nothing half-written: the bundle and model are as they were, no new file beside them, none in its temp dirs.
    assert _tree(*watched) == before
    assert sorted(p.name for p in root.iterdir() if p.suffix != ".log") == entries
    assert _tree(scratch) == {}
    second = ServerProcess.start(root, log_name="restarted.log")
    try:
        channel = second.channel()
        stub = pb_grpc.SlabServeStub(channel)
        assert_every_slab_free(stub)
        assert_serves(stub, channel)
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(timeout=60) == 0
    finally:
        second.stop()
    assert _tree(*watched) == before and _tree(scratch) == {}
    # the profiler's start-up noise (kineto's client claimed from the wrong thread, its per-profile lines) stays out
    noise = [line for line in second.text().splitlines() if line.startswith(("ERROR:", "USDT:", "STAGE:"))]
    assert noise == [], noise


# ---- refused at start -------------------------------------------------------------------------------------------

def _refusal(root: Path, *args: str) -> str:
    """Start the server expecting a refusal: exit 1 without serving; returns its output."""
    server = ServerProcess.start(root, *args, log_name="refused.log", wait=False)
    try:
        assert server.proc.wait(timeout=300) == 1, server.text()[-3000:]
    finally:
        server.stop()
    text = server.text()
    assert '"event": "serving"' not in text and "Traceback" not in text, text[-3000:]
    return text


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_a_plan_larger_than_free_memory_is_refused_at_start_with_figures(root, tmp_path):
    # The tiny model with a context long enough that 4 slabs of it need twice the memory free here: a real plan,
    # built by build-plan (which needs no memory for it: it traces on fake tensors).
    big = tmp_path / "big"
    shutil.copytree(root / "model", big / "model")
    context = 1 << max(20, (2 * _mem_available() // (4 * 512) - 1).bit_length())  # 512 bytes of KV per token
    config = json.loads((big / "model" / "config.json").read_text())
    (big / "model" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    build_tiny_bundle(big, name="too-big", max_context=context, target={"device": "cpu", "memory": 1 << 50},
                      kv={"classes": [{"tokens": 64, "count": 2}, {"tokens": context, "count": 4}]})
    plan = read_plan(big / "bundle")
    assert plan.kv.bytes_per_token == 512 and plan.totals.planned_bytes > 2 * _mem_available()
    text = _refusal(big)
    check = json.loads(next(line for line in text.splitlines() if '"memory_check"' in line))
    assert check["planned_bytes"] == plan.totals.planned_bytes
    assert check["free_source"] == "MemAvailable in /proc/meminfo"
    refusal = text[text.index("refusing to start"):]
    short = plan.totals.planned_bytes - check["free_bytes"]
    assert f"plan 'too-big' needs" in refusal and f"({plan.totals.planned_bytes} bytes:" in refusal
    assert f"({check['free_bytes']} bytes) is free (MemAvailable in /proc/meminfo)" in refusal
    assert f"shrink the plan by at least" in refusal and f"({short} bytes)" in refusal
    fewer = -(-short // (context * 512))  # the largest slabs first; 4 of them
    if fewer < 4:
        assert f"kv.classes: {fewer} fewer {context}-token slabs, count 4 -> {4 - fewer}" in refusal
    else:
        assert "no one slab class frees that much" in refusal


def test_a_plan_over_the_memory_limit_is_refused_at_start(root):
    text = _refusal(root, "--memory-limit", "64MiB")  # less than the interpreter and torch alone
    refusal = text[text.index("refusing to start"):]
    plan = read_plan(root / "bundle")
    assert f"plan 'tiny-served' needs " in refusal and f"({plan.totals.planned_bytes} bytes:" in refusal
    assert "is free (--memory-limit 64 MiB less the" in refusal and "this process already holds" in refusal
    assert "raise --memory-limit to at least" in refusal


def _flip_a_weight_byte(model: Path) -> None:
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x01  # inside the last tensor's data, past the header
    path.write_bytes(bytes(data))


def _change_the_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 10}))


@pytest.mark.parametrize("change, reason", [
    (_flip_a_weight_byte, "the weights differ from those plan 'tiny-served' was built for"),
    (_change_the_config, "the model's config differs from the one plan 'tiny-served' was built for"),
])
def test_a_bundle_whose_model_changed_is_refused_with_the_reason(root, tmp_path, change, reason):
    copy = tmp_path / "copy"
    shutil.copytree(root / "bundle", copy / "bundle")
    shutil.copytree(root / "model", copy / "model")
    change(copy / "model")
    text = _refusal(copy)
    assert reason in text and "rebuild it here: build-plan" in text
