"""Model configuration for the Llama family, read from an HF `config.json` or from GGUF metadata.

Contract: `ModelConfig` is the one description of a decoder that the rest of slabserve uses. Every option that
changes the maths is either understood here or refused with its name (`UnsupportedModelError`); nothing is
silently ignored. Keys that change nothing at inference (dropout, initializer range, tensor-parallel hints) are
not read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model file is missing, unreadable, truncated or inconsistent. The message names the file."""


class UnsupportedModelError(ModelLoadError):
    """The model uses an architecture or option slabserve does not implement. The message names it."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How inverse frequencies are rescaled. `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Sliding-window models (Mistral v0.1) are served up to their window, where full attention is identical.
    max_context: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # 1 for a whole model. N > 1: this config is one rank's slice of a model served at tensor-parallel degree N
    # (runtime/tensor_parallel.py): num_heads, num_kv_heads and intermediate_size are already divided by N, and the
    # step sums the outputs of o_proj and down_proj over the ranks.
    tensor_parallel: int = 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def context_limit(self) -> int:
        return self.max_context or self.max_position

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, by its HF name, with its HF shape ((out, in) for projections)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (self.q_size, h)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_size, h)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_size, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (self.kv_size,)
                shapes[p + "self_attn.v_proj.bias"] = (self.kv_size,)
        return shapes

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())


def _rope_from_hf(cfg: dict, source: str) -> tuple[float, RopeScaling]:
    """HF writes rope settings as `rope_theta` + `rope_scaling` (v4) or as `rope_parameters` (v5)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _refuse_options(cfg: dict, arch: str, source: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=true (bias on o_proj) is not supported for {arch}")


def _sliding_window(cfg: dict, arch: str) -> int:
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        return 0
    return int(cfg.get("sliding_window") or 0)


def config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json; `source` names the file in errors."""
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{source}: model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ModelLoadError(f"{source}: missing required keys {missing}")
    _refuse_options(cfg, arch, source)
    theta, scaling = _rope_from_hf(cfg, source)
    heads = int(cfg["num_attention_heads"])
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = _sliding_window(cfg, arch)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        rope_scaling=scaling,
        max_context=min(max_pos, window) if window else 0,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=str(cfg.get("_name_or_path", "")),
    )


def config_from_gguf(meta: dict, has_output_tensor: bool, source: str) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values (`meta` maps key -> python value)."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise UnsupportedModelError(f"{source}: GGUF architecture {arch!r} is not supported (supported: llama, qwen2)")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata key {arch}.{key} is missing")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // heads)
    vocab = int(meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens.count") or 0)
    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise UnsupportedModelError(f"{source}: GGUF rope scaling type {rope_type!r} is not supported (none, linear)")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(get("context_length")),
        tie_word_embeddings=not has_output_tensor,
        qkv_bias=arch == "qwen2",
        rope_scaling=RopeScaling(rope_type="linear" if rope_type == "linear" else "default", factor=factor),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(meta.get("general.name", "")),
    )
