"""The bundled SmolLM2-135M GGUF through slabserve's step against transformers loading the same GGUF.

Five chat prompts run together in flat steps (one prefill step, then 64 batched decode steps, greedy); the
reference runs each prompt alone with its own KV cache. Token ids must be identical and the logits of every
step within 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from _models import smollm2_path
from slabserve.kernels import cpu_native
from slabserve.runtime.loader import open_model
from slabserve.runtime.model import build_step, default_gemm
from slabserve.runtime.step import SeqChunk, StepInputs
from slabserve.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def prompt_ids():
    tok = Tokenizer.from_gguf(smollm2_path())
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def slabserve_greedy(prompt_ids: list[list[int]]):
    source = open_model(smollm2_path())
    c = source.config
    step = build_step(source, torch.float32, rope_positions=1024, gemm=default_gemm("cpu", torch.float32))
    slab = 256
    k_cache = torch.zeros(c.num_layers, slab * len(prompt_ids), c.num_kv_heads, c.head_dim)  # (L, N, Hkv, D)
    v_cache = torch.zeros_like(k_cache)
    prefill = StepInputs(sum(map(len, prompt_ids)), len(prompt_ids))
    decode = StepInputs(8, 8)
    seqs = [list(ids) for ids in prompt_ids]
    logits_per_step = []
    inputs = prefill
    chunks = [SeqChunk(i * slab, 0, ids, slab) for i, ids in enumerate(seqs)]
    for _ in range(NEW_TOKENS):
        inputs.fill(chunks)
        with torch.no_grad():
            logits = step(**inputs.tensors(), k_cache=k_cache, v_cache=v_cache)[: len(seqs)]  # (S, V)
        logits_per_step.append(logits.clone())
        for s, token in enumerate(logits.argmax(-1).tolist()):
            seqs[s].append(token)
        chunks = [SeqChunk(i * slab, len(ids) - 1, ids[-1:], slab) for i, ids in enumerate(seqs)]
        inputs = decode
    return [ids[len(p):] for ids, p in zip(seqs, prompt_ids)], torch.stack(logits_per_step, 1)  # (S, steps, V)


def transformers_greedy(prompt_ids: list[list[int]], new_tokens: int = NEW_TOKENS):
    import transformers

    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    outputs, logits_all = [], []
    for ids in prompt_ids:
        past, cur, new, step_logits = None, torch.tensor([ids]), [], []
        with torch.no_grad():
            for _ in range(new_tokens):
                out = model(cur, past_key_values=past, use_cache=True)
                past, last = out.past_key_values, out.logits[0, -1]
                step_logits.append(last)
                new.append(int(last.argmax()))
                cur = torch.tensor([[new[-1]]])
        outputs.append(new)
        logits_all.append(torch.stack(step_logits))
    return outputs, torch.stack(logits_all)  # (S, steps, V)


@pytest.fixture(scope="module")
def reference(prompt_ids):
    return transformers_greedy(prompt_ids)


def test_smollm2_greedy_matches_transformers(prompt_ids, reference):
    ours, our_logits = slabserve_greedy(prompt_ids)
    ref, ref_logits = reference
    for p, a, b in zip(PROMPTS, ours, ref):
        assert a == b, f"prompt {p!r}: token ids differ at {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
    first_step = (our_logits[:, 0] - ref_logits[:, 0]).abs().max().item()
    every_step = (our_logits - ref_logits).abs().max().item()
    print(f"SmolLM2: {len(PROMPTS)} prompts x {NEW_TOKENS} tokens identical; max |logit diff| after prefill "
          f"{first_step:.3g}, over all steps {every_step:.3g}")
    assert first_step < 1e-3, f"last-position logits after prefill differ by {first_step:.3g}"
    assert every_step < 1e-3, f"logits differ by up to {every_step:.3g} over {NEW_TOKENS} steps"


@pytest.mark.parametrize("weights", ["float", pytest.param("gguf", marks=pytest.mark.skipif(
    not cpu_native.available(), reason="GGUF blocks need the native CPU kernels"))])
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "16-together"])
def test_engine_greedy_matches_transformers(prompt_ids, reference, batched, weights):
    """`weights` gguf: the file's Q4_1 and Q8_0 blocks stay in the weight arena and the native kernels decode them
    in registers; transformers runs on the same file dequantized by the gguf package."""
    from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions
    from slabserve.runtime.slab_allocator import SlabClass

    ref, _ = reference
    engine = Engine(EngineConfig(str(smollm2_path()), (SlabClass(256, 16),), max_seqs=16, step_tokens=256,
                                 weight_format=weights))
    assert {s.block_type for s in engine.step_fn.weight_slots if s.block_type} == (
        {"Q4_1", "Q8_0"} if weights == "gguf" else set())
    stopping = StoppingOptions(max_tokens=NEW_TOKENS, ignore_eos=True)
    if batched:  # 16 requests in flight at once: the five prompts, repeated
        prompts = [prompt_ids[i % len(prompt_ids)] for i in range(16)]
        outputs = [c.token_ids for c in engine.generate(prompts, stopping=stopping)]
    else:
        outputs = [engine.generate([ids], stopping=stopping)[0].token_ids for ids in prompt_ids]
    for i, got in enumerate(outputs):
        assert list(got) == ref[i % len(ref)], f"request {i} ({PROMPTS[i % len(PROMPTS)]!r}) differs"
    assert engine.scheduler.load().free_per_class == (16,)


@pytest.mark.skipif(not cpu_native.available(), reason="the key partitions are the native kernel's")
def test_engine_greedy_matches_transformers_past_key_partitions():
    """A prompt over more keys than two of the native attention's partitions (512 keys each, merged in order; one
    decoding row's partitions go to different threads): greedy ids equal transformers' alone (the split step) and
    beside two others (not split), and the prompt prefills in chunks of 256 that cross the partitions."""
    from slabserve.runtime.engine import Engine, EngineConfig, StoppingOptions
    from slabserve.runtime.slab_allocator import SlabClass

    tok = Tokenizer.from_gguf(smollm2_path())
    text = " ".join(f"Note {i}: {p}" for i, p in enumerate(PROMPTS * 24))
    long_ids = tok.encode_chat([{"role": "user", "content": "Summarize these notes in one line. " + text}])
    assert 1100 < len(long_ids) < 1900, len(long_ids)
    short_ids = tok.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    new_tokens = 24
    ref, _ = transformers_greedy([long_ids, short_ids], new_tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs two threads
    try:
        engine = Engine(EngineConfig(str(smollm2_path()), (SlabClass(2048, 4),), max_seqs=4, step_tokens=256,
                                     weight_format="gguf"))
        stopping = StoppingOptions(max_tokens=new_tokens, ignore_eos=True)
        alone = engine.generate([long_ids], stopping=stopping)[0].token_ids
        together = engine.generate([long_ids, short_ids, long_ids], stopping=stopping)
    finally:
        torch.set_num_threads(threads)
    assert list(alone) == ref[0], "the long prompt alone differs from transformers"
    assert [list(c.token_ids) for c in together] == [ref[0], ref[1], ref[0]], "beside others it differs"
