"""The step against transformers: tiny random models in the real formats, several sequences in one flat step.

Each scenario runs three sequences through mixed steps (a full prefill beside a chunked one, then a step that mixes
decode, the rest of a chunk and a late prefill, then 32 decode steps) and compares every logit row with
transformers' forward over the whole sequence. Tokens are fixed in advance (teacher forcing), so a single
argmax flip cannot hide or cause a mismatch.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _models import GGUF_TINY, make_hf_model, save_reference_as_hf, write_gguf
from slabserve.kernels import cpu_native
from slabserve.runtime.loader import open_model
from slabserve.runtime.model import build_step
from slabserve.runtime.step import SeqChunk, StepInputs

DECODE_STEPS = 32
SLAB = 64  # rows per slab in these tests
PROMPTS = {"a": 7, "b": 12, "c": 4}


def _schedule() -> list[list[tuple[str, int, int]]]:
    """Steps as lists of (sequence, first position, token count)."""
    steps = [[("a", 0, 7), ("b", 0, 8)], [("a", 7, 1), ("b", 8, 4), ("c", 0, 4)]]
    pos = {"a": 8, "b": 12, "c": 4}
    for _ in range(DECODE_STEPS):
        steps.append([(s, pos[s], 1) for s in ("a", "b", "c")])
        pos = {s: p + 1 for s, p in pos.items()}
    return steps


def run_step_logits(step_module, config, tokens: dict[str, list[int]], num_tokens: int = 32, max_seqs: int = 4):
    """Run the schedule; return {sequence: {position: logits row}} for every row the step computed."""
    offsets = {"a": 0, "b": SLAB, "c": 2 * SLAB}
    k_cache = torch.zeros(config.num_layers, 3 * SLAB, config.num_kv_heads, config.head_dim)  # (L, N, Hkv, D)
    v_cache = torch.zeros_like(k_cache)
    inputs = StepInputs(num_tokens, max_seqs)
    out: dict[str, dict[int, torch.Tensor]] = {s: {} for s in tokens}
    all_rows = torch.arange(num_tokens)
    for step in _schedule():
        chunks = [SeqChunk(offsets[s], start, tokens[s][start : start + n], SLAB) for s, start, n in step]
        inputs.fill(chunks)
        with torch.no_grad():
            logits = step_module(**inputs.tensors() | {"logits_indices": all_rows}, k_cache=k_cache,
                                 v_cache=v_cache)  # (T, V)
        row = 0
        for s, start, n in step:
            for j in range(n):
                out[s][start + j] = logits[row + j]
            row += n
    return out


def reference_logits(hf_model, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {s: hf_model(torch.tensor([ids])).logits[0] for s, ids in tokens.items()}


def assert_parity(step_module, hf_model, config, vocab: int, atol: float = 1e-4, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    lengths = {"a": 8 + DECODE_STEPS, "b": 12 + DECODE_STEPS, "c": 4 + DECODE_STEPS}
    tokens = {s: rng.integers(0, vocab, n).tolist() for s, n in lengths.items()}
    ours = run_step_logits(step_module, config, tokens)
    ref = reference_logits(hf_model, tokens)
    worst = 0.0
    for s, rows in ours.items():
        assert sorted(rows) == list(range(lengths[s])), f"sequence {s} missed positions"
        for pos, row in rows.items():
            worst = max(worst, float((row - ref[s][pos]).abs().max()))
    assert worst < atol, f"max |logit diff| {worst:.3g} >= {atol}"
    print(f"max |logit diff| {worst:.3g}")
    return worst


HF_CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 32}}),
    "qwen2-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
}


GEMMS = ["aten", pytest.param("native", marks=pytest.mark.skipif(
    not cpu_native.available(), reason=f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}"))]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_safetensors_parity(case, gemm, tmp_path):
    from _models import hf_reference

    arch, overrides = HF_CASES[case]
    folder = make_hf_model(tmp_path / case, arch, **overrides)
    source = open_model(folder)
    assert source.format == "hf"
    step = build_step(source, torch.float32, gemm=gemm)
    assert_parity(step, hf_reference(folder), source.config, source.config.vocab_size)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_tensor_types_match_dequantized_reference(type_name, tmp_path):
    from _models import hf_reference
    from slabserve.runtime.loader import gguf_to_hf_name

    config, reference = write_gguf(tmp_path / f"tiny-{type_name}.gguf", type_name, tied=type_name == "Q8_0")
    source = open_model(tmp_path / f"tiny-{type_name}.gguf")
    assert source.format == "gguf"
    assert set(source.tensor_types().values()) == {type_name, "F32"} or type_name == "F32"
    for gguf_name, expected in reference.items():  # weights, q/k rows back in HF order
        got = source.get(gguf_to_hf_name(gguf_name)).numpy()
        np.testing.assert_array_equal(got, expected, err_msg=gguf_name)
    # and the model built from it computes what transformers computes on the same (dequantized) weights
    hf = hf_reference(save_reference_as_hf(tmp_path / "ref", config, reference))
    assert_parity(build_step(source, torch.float32), hf, source.config, GGUF_TINY["vocab_size"])
