"""Helpers the CUDA checks share (tools/gpu_check.py and tests/test_cuda.py): a random-weight model of a given
config written as safetensors, the steady-state allocation count of a serving engine, and greedy parity against
`transformers` with near ties told apart from real differences.

Nothing here needs a GPU to import; the functions take the device they run on.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# The counters of torch.cuda.memory_stats() that move when the caching allocator hands out or reserves memory.
CUDA_ALLOCATOR_COUNTERS = ("allocation.all.allocated", "segment.all.allocated", "reserved_bytes.all.current",
                           "allocated_bytes.all.current")
NEAR_TIE = 0.05  # top-two logit gap under which a greedy difference is a tie the arithmetic may break either way


def write_random_llama(folder: Path, config: dict, dtype: torch.dtype = torch.bfloat16,
                       device: torch.device | str = "cpu", seed: int = 0, std: float = 0.02) -> Path:
    """`folder/config.json`, `folder/model.safetensors` (random N(0, std) weights, norms near 1, in `dtype`, drawn
    on `device` then written from the host one tensor at a time) and a word-level tokenizer covering the whole
    vocabulary ("t0", "t1", ...), so the engine can load and detokenize it. Returns `folder`."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    c = config
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim", hidden // heads)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        t = t.mul_(0.1).add_(1.0) if len(shape) == 1 else t.mul_(std)
        tensors[name] = t.to(dtype).cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**c, "torch_dtype": str(dtype).removeprefix("torch.")}))
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))
    eos = c.get("eos_token_id", vocab - 1)
    eos = eos if isinstance(eos, int) else eos[0]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos}", "add_bos_token": False}))
    return folder


def cuda_counters(device: torch.device | None = None) -> dict[str, int]:
    """The caching allocator's CUDA_ALLOCATOR_COUNTERS now."""
    stats = torch.cuda.memory_stats(device)
    return {key: stats[key] for key in CUDA_ALLOCATOR_COUNTERS}


def keep_busy(engine, prompts: int, prompt_len: int = 16, max_tokens: int = 4096, seed: int = 0) -> None:
    """Submit `prompts` greedy token-id requests that decode for `max_tokens` tokens (eos ignored)."""
    from slabserve.runtime.engine import StoppingOptions

    vocab = engine.model_config.vocab_size
    for i in range(prompts):
        ids = [(seed + 7919 * i + 31 * j) % vocab for j in range(prompt_len)]
        engine.submit(ids, stopping=StoppingOptions(max_tokens=max_tokens, ignore_eos=True))


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def steady_state(engine, steps: int) -> dict:
    """Step a busy engine `steps` times: on CUDA, what the caching allocator's counters did (they must not move,
    whatever thread or stream allocated); on CPU, the tensor storages the profiler saw (runtime.executor's check);
    and the wall time per step. The caller submits the work (keep_busy)."""
    from slabserve.runtime.executor import allocations

    engine.step()
    _sync(engine)
    cuda = engine.device.type == "cuda"
    before = cuda_counters(engine.device) if cuda else {}
    started = time.perf_counter()
    if cuda:
        for _ in range(steps):
            engine.step()
        _sync(engine)
        found = None
    else:
        found = allocations(lambda: engine.step(), steps, single_thread=False)
    seconds = time.perf_counter() - started
    after = cuda_counters(engine.device) if cuda else {}
    count = after["allocation.all.allocated"] - before["allocation.all.allocated"] if cuda else len(found)
    return {"steps": steps, "counters_before": before, "counters_after": after, "allocations": count,
            "step_ms": 1000 * seconds / steps}


def drain(engine) -> None:
    for request_id in list(engine._live):
        engine.abort(request_id)
    while engine.has_work():
        engine.step()


def decode_rate(engine, batch: int, steps: int = 64, prompt_len: int = 16) -> dict:
    """Decode tok/s of the engine at `batch` sequences: their prefill first, then `steps` timed steps in which every
    sequence decodes (each step syncs once, on the sampled ids)."""
    drain(engine)
    keep_busy(engine, batch, prompt_len=prompt_len, max_tokens=steps + 64)
    while engine.scheduler.load().running < batch or any(engine._live[r].num_tokens == 0 for r in engine._live):
        engine.step()
    _sync(engine)
    started = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(e.token_ids) for e in engine.step())
    _sync(engine)
    seconds = time.perf_counter() - started
    drain(engine)
    return {"batch": batch, "steps": steps, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "step_ms": 1000 * seconds / steps}


@dataclass
class PromptParity:
    prompt: str
    equal: bool
    first_difference: int | None   # index of the first differing generated token
    reference_gap: float | None    # the reference's top-two logit gap at that position
    near_tie: bool                 # differs only after a near tie in the reference
    ours: list[int]
    theirs: list[int]


def greedy_parity(engine, hf_model, prompts: Sequence[str], max_tokens: int) -> list[PromptParity]:
    """Greedy ids of the engine and of `hf_model` (transformers, on its device) for each chat prompt, up to
    `max_tokens` or the first EOS (each stops there: suppressing EOS in one and not the other would differ at the
    first EOS); where they differ, the reference's top-two logit gap at the first difference (from its own logits
    over the shared prefix) says whether it was a near tie (< NEAR_TIE)."""
    from slabserve.runtime.engine import StoppingOptions

    results = []
    stop = StoppingOptions(max_tokens=max_tokens)
    for prompt in prompts:
        ids = list(engine.prompt_ids([{"role": "user", "content": prompt}]))
        ours = list(engine.generate([ids], stopping=stop)[0].token_ids)
        device = next(hf_model.parameters()).device
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids], device=device), max_new_tokens=max_tokens, do_sample=False,
                                    pad_token_id=0)
        theirs = out[0, len(ids):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None and len(ours) != len(theirs):
            first = min(len(ours), len(theirs))
        gap = None
        if first is not None:
            with torch.no_grad():
                logits = hf_model(torch.tensor([ids + theirs[:first]], device=device)).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            gap = float(top[0] - top[1])
        results.append(PromptParity(prompt, first is None, first, gap, first is not None and gap < NEAR_TIE,
                                    ours, theirs))
    return results


def llama8b_kernel_check(device: torch.device, timed: bool = False) -> dict:
    """The step's Triton attention and kv_write against the PyTorch references in bf16 at Llama-3-8B's heads (32 q,
    8 kv, head_dim 128) over 8k-token slabs: one mixed step (56 decode rows of random context, which the split
    decode kernel takes, 3 prefill chunks of 200 rows at 4,000 and 8,192 keys and from 0, 5 empty sequence slots,
    7 padding rows), outputs poisoned with NaN first. `timed`: also the decode attention's time at 64 sequences x
    8k keys (do_bench median) and the bandwidth it reaches reading K and V."""
    from slabserve.kernels import reference
    from slabserve.kernels.triton_kv_write import kv_write_triton
    from slabserve.kernels.triton_slab_attention import slab_prefill_attention_triton
    from slabserve.kernels.workspace import decode_workspace_shape

    dev, dt = device, torch.bfloat16
    heads, kv_heads, head_dim, slab, num_slabs = 32, 8, 128, 8192, 64
    gen = torch.Generator(device=dev).manual_seed(1)
    k_cache = torch.randn(num_slabs * slab, kv_heads, head_dim, generator=gen, device=dev).to(dt)
    v_cache = torch.randn(num_slabs * slab, kv_heads, head_dim, generator=gen, device=dev).to(dt)
    q_lens = [1] * 56 + [200, 200, 200] + [0] * 5
    contexts = torch.randint(1, slab, (56,), generator=gen, device=dev).tolist() + [4000, 8192, 200] + [0] * 5
    offsets = [i * slab for i in range(len(q_lens))]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1] + 7, heads, head_dim, generator=gen, device=dev).to(dt)
    meta = (torch.tensor(starts, dtype=torch.int32, device=dev), torch.tensor(offsets, device=dev),
            torch.tensor(contexts, dtype=torch.int32, device=dev))
    spec = decode_workspace_shape(len(q_lens), heads, head_dim, slab)
    workspace = torch.full(spec.shape, float("nan"), device=dev)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    slab_prefill_attention_triton(q, k_cache, v_cache, *meta, scale, out, workspace)
    want = reference.slab_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), *meta, scale,
                                                torch.empty(q.shape, device=dev))
    result = {"attention_rel_err": float((out.float() - want).norm() / want.norm()),
              "attention_nan": bool(out.isnan().any()), "splits": spec.num_splits}
    slots = torch.randperm(num_slabs * slab, generator=gen, device=dev)[:512]
    k_new = torch.randn(512, kv_heads, head_dim, generator=gen, device=dev)
    v_new = torch.randn(512, kv_heads, head_dim, generator=gen, device=dev)
    kv_write_triton(k_new.to(dt), v_new.to(dt), k_cache, v_cache, slots)
    result["kv_write_exact"] = bool(torch.equal(k_cache[slots], k_new.to(dt))
                                    and torch.equal(v_cache[slots], v_new.to(dt)))
    if timed:
        import triton.testing

        dq = torch.randn(num_slabs, heads, head_dim, generator=gen, device=dev).to(dt)
        dmeta = (torch.arange(num_slabs + 1, dtype=torch.int32, device=dev),
                 torch.tensor(offsets[:num_slabs], device=dev),
                 torch.full((num_slabs,), slab, dtype=torch.int32, device=dev))
        dws = torch.empty(decode_workspace_shape(num_slabs, heads, head_dim, slab).shape, device=dev)
        dout = torch.empty_like(dq)
        ms = triton.testing.do_bench(lambda: slab_prefill_attention_triton(dq, k_cache, v_cache, *dmeta, scale, dout,
                                                                           dws), return_mode="median")
        kv_bytes = 2 * num_slabs * slab * kv_heads * head_dim * 2
        result.update(decode_attention_ms=ms, decode_attention_bytes_per_s=kv_bytes / (ms / 1000))
    return result


def as_dicts(items) -> list[dict]:
    return [asdict(i) for i in items]
