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
from slabserve.runtime.model import build_step, weight_blocks
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
    """Every logit row within atol of transformers'."""
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
    assert worst < atol, f"max |logit diff| {worst:.3g} >= {atol:.3g}"
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


needs_native = pytest.mark.skipif(not cpu_native.available(),
                                  reason=f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
# (main type, per-tensor overrides): one type throughout, and mixed files as llama.cpp's Q4_K_M / Q4_0 write them,
# where the fused q/k/v and gate/up projections hold more than one block type
BLOCK_CASES = {
    "Q4_0": ("Q4_0", None), "Q4_1": ("Q4_1", None), "Q8_0": ("Q8_0", None), "Q4_K": ("Q4_K", None),
    "Q6_K": ("Q6_K", None), "F16": ("F16", None),
    "Q4_K_M": ("Q4_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "token_embd.weight": "Q6_K"}),
    "mixed": ("Q4_1", {"attn_k.weight": "Q8_0", "ffn_up.weight": "Q4_0", "token_embd.weight": "Q8_0"}),
}


@needs_native
@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_gguf_blocks_kept_in_the_arena_match_transformers(case, tmp_path):
    """weight_format gguf: the step multiplies the file's own blocks (native linear_q, embed_q) and computes what
    transformers computes on the same weights dequantized by the gguf package."""
    from _models import hf_reference

    main, types = BLOCK_CASES[case]
    tied = case in ("Q8_0", "mixed")
    config, reference = write_gguf(tmp_path / f"{case}.gguf", main, tied=tied, types=types)
    source = open_model(tmp_path / f"{case}.gguf")
    blocks = weight_blocks(source.config, "gguf", source.tensor_types())
    step = build_step(source, torch.float32, gemm="native", blocks=blocks)
    assert all(s.dtype == torch.uint8 for s in step.weight_slots if s.block_type)
    assert {s.block_type for s in step.weight_slots if s.block_type} == set(blocks.values())
    assert "lm_head" not in {s.name for s in step.weight_slots} or not tied  # a tied head reads the embedding
    hf = hf_reference(save_reference_as_hf(tmp_path / "ref", config, reference))
    assert_parity(step, hf, source.config, GGUF_TINY["vocab_size"])


@needs_native
def test_q8_0_weights_quantized_at_load_match_transformers_on_the_quantized_values(tmp_path):
    """weight_format q8_0 on a safetensors model: every projection and the embedding quantized to Q8_0 by the gguf
    package at load; the step computes what transformers computes on those values dequantized."""
    import json

    from safetensors.torch import load_file, save_file

    from _models import hf_reference
    from slabserve.kernels import quant

    folder = make_hf_model(tmp_path / "model", "llama", hidden_size=64, intermediate_size=128)
    source = open_model(folder)
    blocks = weight_blocks(source.config, "q8_0")
    step = build_step(source, torch.float32, gemm="native", blocks=blocks)
    tensors = load_file(str(folder / "model.safetensors"))
    rounded = {name: (quant.dequantize(quant.quantize_q8_0(t), "Q8_0", t.shape[1]) if name in blocks else t)
               for name, t in tensors.items()}
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text())))
    save_file({k: v.contiguous() for k, v in rounded.items()}, str(ref / "model.safetensors"))
    assert_parity(step, hf_reference(ref), source.config, source.config.vocab_size)


def test_weight_blocks_refuse_what_the_kernels_cannot_take(tmp_path):
    from slabserve.runtime.model import _block_tensors

    narrow = open_model(make_hf_model(tmp_path / "narrow", "llama", hidden_size=48, intermediate_size=96)).config
    with pytest.raises(ValueError, match="weight_format: gguf keeps a GGUF file's own blocks and this model is not "
                                         "a GGUF"):
        weight_blocks(narrow, "gguf", None)
    with pytest.raises(ValueError, match=r"weight_format: q8_0: model.embed_tokens.weight has rows of 48 weights, "
                                         r"which do not split into whole Q8_0 blocks of 32"):
        weight_blocks(narrow, "q8_0")
    config = open_model(make_hf_model(tmp_path / "tiny", "llama")).config
    types = {**dict.fromkeys(_block_tensors(config), "Q8_0"), "model.layers.1.mlp.up_proj.weight": "Q5_K"}
    with pytest.raises(ValueError, match=r"weight_format: gguf: model.layers.1.mlp.up_proj.weight: block type Q5_K "
                                         r"has no native kernel; the kernels read F32, F16, BF16, Q4_0"):
        weight_blocks(config, "gguf", types)
