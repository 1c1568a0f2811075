"""The Llama-family decoder written as slabserve's static-shape step (DESIGN.md, "The step").

One call runs one engine step over a flat batch of T tokens that may come from several sequences: decode tokens of
running sequences and prefill chunks of new ones, padded to the bucket size T. Each sequence owns a contiguous KV
slab (the same row range in every layer of the KV arena); the step writes the new K/V rows into the slabs and
returns the logits of the rows named by `logits_indices`. Shapes never depend on the data, so the step can be
traced once per bucket and replayed.

Covers Llama 2/3 (with Llama 3 rope scaling), SmolLM2/TinyLlama (tied embeddings), Mistral, Qwen2 (q/k/v bias),
GQA and MHA. The heavy ops go through `torch.ops.slabserve.*` (kernels/ops.py): native C kernels on CPU (fp32;
PyTorch references where those cannot run), Triton on CUDA. The model never allocates KV memory: the caches are
arguments, owned by the runtime's arenas.

Weight layout and matmul path (`gemm`, chosen by the plan): q/k/v are fused into one matrix and gate/up into
another, and every projection is stored for one of two matmul paths:
  "aten"    pre-transposed and contiguous, (in, out), multiplied by aten's mm (MKL on CPU, cuBLAS on CUDA):
            `x @ Wt` with a contiguous Wt is about twice as fast as `F.linear(x, W)` for skinny decode matmuls;
  "native"  (CPU, fp32) packed as column panels, (ceil(out / 16), in, 16), multiplied by slabserve::linear, the
            native kernel of kernels/cpu_native.c, which also adds the residual. On 2 AVX2 cores it reads the weights
            at 1.5x to 3x MKL's speed at 1 to 32 rows and computes 1.2x to 1.6x faster at 256.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

import slabserve.kernels.ops  # noqa: F401  (registers torch.ops.slabserve.*)
from slabserve.kernels import cpu_native
from slabserve.kernels.contracts import panel_shape
from slabserve.kernels.reference import cpu_workspace_numel
from slabserve.kernels.workspace import decode_workspace_shape
from slabserve.runtime.config import ModelConfig
from slabserve.runtime.plan import GEMMS
from slabserve.runtime.rope import rope_table

ops = torch.ops.slabserve


def default_gemm(device: str, dtype: torch.dtype) -> str:
    """The matmul path a plan for this machine takes: the native kernel for fp32 on a CPU that runs it."""
    return "native" if device == "cpu" and dtype == torch.float32 and cpu_native.available() else "aten"


def _check_gemm(gemm: str) -> None:
    if gemm not in GEMMS:
        raise ValueError(f"gemm {gemm!r} is not one of {', '.join(GEMMS)}")


class TensorSource(Protocol):
    """Anything that hands out HF-named tensors one at a time (runtime.loader.WeightSource)."""

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


def pack_weights(config: ModelConfig, source: TensorSource, dtype: torch.dtype,
                 place: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 gemm: str = "aten") -> dict[str, torch.Tensor]:
    """HF-named weights -> the step's compute layout (fused, pre-transposed or panel-packed for `gemm`, `dtype`).

    Reads the source tensor by tensor. `place(name, tensor)` (when given) moves each packed tensor to its final
    home and returns it there (`build_step`: its place in the weight arena), so the temporary copy is freed before
    the next one is made and peak memory stays near one copy of the model.
    """
    _check_gemm(gemm)

    def take(name: str) -> torch.Tensor:
        return source.get(name, dtype)

    def proj(w_in_out: torch.Tensor) -> torch.Tensor:  # (in, out) -> the gemm's layout
        return cpu_native.pack_panels(w_in_out) if gemm == "native" else w_in_out.contiguous()

    packed = _Placed(place)
    packed["embed"] = take("model.embed_tokens.weight").contiguous()
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        qkv = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"], dim=0)  # (q+2kv, hidden)
        packed[f"{n}.wqkv"] = proj(qkv.t())  # (hidden, q+2kv)
        if config.qkv_bias:
            packed[f"{n}.bqkv"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]).contiguous()
        packed[f"{n}.wo"] = proj(take(p + "self_attn.o_proj.weight").t())  # (q, hidden)
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
        packed[f"{n}.wgate_up"] = proj(gate_up.t())  # (hidden, 2I)
        packed[f"{n}.wdown"] = proj(take(p + "mlp.down_proj.weight").t())  # (I, hidden)
        packed[f"{n}.attn_norm"] = take(p + "input_layernorm.weight").contiguous()
        packed[f"{n}.ffn_norm"] = take(p + "post_attention_layernorm.weight").contiguous()
    packed["norm"] = take("model.norm.weight").contiguous()
    if config.tie_word_embeddings:
        packed["lm_head"] = proj(packed["embed"].t())  # (hidden, V)
    else:
        packed["lm_head"] = proj(take("lm_head.weight").t())  # (hidden, V)
    return dict(packed)


class _Placed(dict):
    """A dict that passes every tensor stored in it through `place` first."""

    def __init__(self, place: Callable[[str, torch.Tensor], torch.Tensor] | None):
        super().__init__()
        self._place = place

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        super().__setitem__(name, self._place(name, tensor) if self._place else tensor)


# Every weight starts on a boundary any vector load or TMA descriptor accepts.
WEIGHT_ALIGNMENT = 256
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one packed weight lives in the weight arena."""

    name: str                # pack_weights name ("embed", "3.wqkv", ...) or "rope_cos_sin"
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int              # bytes from the arena's start, a multiple of WEIGHT_ALIGNMENT
    nbytes: int


def packed_shapes(config: ModelConfig, gemm: str = "aten") -> dict[str, tuple[int, ...]]:
    """Shapes of `pack_weights`' output (the step's compute layout for `gemm`), in its order."""
    _check_gemm(gemm)
    c = config

    def proj(k: int, n: int) -> tuple[int, ...]:  # a (k in, n out) projection
        return panel_shape(k, n) if gemm == "native" else (k, n)

    shapes = {"embed": (c.vocab_size, c.hidden_size)}
    for n in range(c.num_layers):
        shapes[f"{n}.wqkv"] = proj(c.hidden_size, c.q_size + 2 * c.kv_size)
        if c.qkv_bias:
            shapes[f"{n}.bqkv"] = (c.q_size + 2 * c.kv_size,)
        shapes[f"{n}.wo"] = proj(c.q_size, c.hidden_size)
        shapes[f"{n}.wgate_up"] = proj(c.hidden_size, 2 * c.intermediate_size)
        shapes[f"{n}.wdown"] = proj(c.intermediate_size, c.hidden_size)
        shapes[f"{n}.attn_norm"] = (c.hidden_size,)
        shapes[f"{n}.ffn_norm"] = (c.hidden_size,)
    shapes["norm"] = (c.hidden_size,)
    shapes["lm_head"] = proj(c.hidden_size, c.vocab_size)
    return shapes


def weight_layout(config: ModelConfig, dtype: torch.dtype, rope_positions: int,
                  gemm: str = "aten") -> tuple[list[WeightSlot], int]:
    """The weight arena: every packed weight in pack order, then the (P, D) float32 rope table, each aligned to
    WEIGHT_ALIGNMENT; (slots, arena bytes). The compiler writes this layout into the plan and the runtime
    allocates and fills exactly it (build_step refuses a packed tensor that does not match its slot)."""
    items = [(name, shape, dtype) for name, shape in packed_shapes(config, gemm).items()]
    items.append(("rope_cos_sin", (rope_positions, config.head_dim), torch.float32))
    slots, offset = [], 0
    for name, shape, dt in items:
        nbytes = math.prod(shape) * torch.empty((), dtype=dt, device="meta").element_size()
        slots.append(WeightSlot(name, shape, dt, offset, nbytes))
        offset += -(-nbytes // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT
    return slots, offset


class LlamaStep(nn.Module):
    """The step function of one model. Parameters are buffers (never trained); KV caches are arguments."""

    def __init__(self, config: ModelConfig, packed: Mapping[str, torch.Tensor], rope_positions: int | None = None,
                 freq_factors: torch.Tensor | None = None, rope_cos_sin: torch.Tensor | None = None,
                 gemm: str = "aten"):
        """`rope_cos_sin`: the (P, D) float32 table already computed (and placed); else computed here. `gemm`: the
        matmul path `packed` was laid out for (pack_weights)."""
        super().__init__()
        _check_gemm(gemm)
        self.config = config
        self.gemm = gemm
        self.scale = config.head_dim ** -0.5
        for name, tensor in packed.items():
            self.register_buffer(_buffer_name(name), tensor, persistent=True)
        positions = rope_positions or config.context_limit
        self.max_context = positions
        if rope_cos_sin is None:
            rope_cos_sin = rope_table(config, positions, freq_factors)
        self.register_buffer("rope_cos_sin", rope_cos_sin)  # (P, D) float32

    def weight(self, name: str) -> torch.Tensor:
        return getattr(self, _buffer_name(name))

    def forward(
        self,
        input_ids: torch.Tensor,       # (T,) int64, padding rows 0
        positions: torch.Tensor,       # (T,) int64, position of each token in its sequence
        slot_mapping: torch.Tensor,    # (T,) int64, KV row each token writes; -1 for padding rows
        query_start: torch.Tensor,     # (S+1,) int32, flat row where each sequence's tokens start
        slab_offset: torch.Tensor,     # (S,) int64, first KV row of each sequence's slab
        context_len: torch.Tensor,     # (S,) int32, tokens in the slab after this step; 0 for padding sequences
        logits_indices: torch.Tensor,  # (R,) int64, flat rows whose logits are returned
        k_cache: torch.Tensor,         # (L, N, Hkv, D)
        v_cache: torch.Tensor,         # (L, N, Hkv, D)
    ) -> torch.Tensor:                 # (R, V)
        c = self.config
        x = self.weight("embed")[input_ids]  # (T, hidden)
        # Planned intermediates like any other, shared by every layer (ops run one at a time). On CPU: the
        # references' scratch, sized by attention over the longest slab. Elsewhere (CUDA, and the meta trace of a
        # CUDA plan): the split decode attention's workspace (S, H, splits, D + 2), its splits sized by the
        # longest slab; no other kernel needs scratch there.
        if x.device.type == "cpu":
            scratch = torch.empty(cpu_workspace_numel(x.shape[0], c.num_heads, c.head_dim, self.max_context,
                                                      c.num_kv_heads, k_cache.dtype),
                                  dtype=torch.float32, device=x.device)
            attn_workspace = scratch
        else:
            scratch = None
            attn_workspace = torch.empty(decode_workspace_shape(slab_offset.shape[0], c.num_heads, c.head_dim,
                                                                self.max_context).shape,
                                         dtype=torch.float32, device=x.device)  # (S, H, splits, D + 2)
        for n in range(c.num_layers):
            x = self._attention_block(n, x, positions, slot_mapping, query_start, slab_offset, context_len,
                                      k_cache[n], v_cache[n], scratch, attn_workspace)
            x = self._mlp_block(n, x, scratch)
        x = self._norm(x, self.weight("norm"), scratch)
        return self._linear(x[logits_indices], "lm_head", c.vocab_size)  # (R, V)

    def _linear(self, x: torch.Tensor, name: str, out_features: int,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, in) @ the projection `name` (T, out), plus residual (T, out) when given."""
        w = self.weight(name)
        if self.gemm == "aten":
            y = x @ w
            return y if residual is None else residual + y
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)  # (T, out)
        ops.linear(x, w, out, residual)
        return out

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(x)
        ops.rms_norm(x, weight, self.config.rms_norm_eps, out, scratch)
        return out

    def _attention_block(self, n, x, positions, slot_mapping, query_start, slab_offset, context_len, k_cache,
                         v_cache, scratch, attn_workspace):
        c = self.config
        t = x.shape[0]
        qkv = self._linear(self._norm(x, self.weight(f"{n}.attn_norm"), scratch), f"{n}.wqkv",
                           c.q_size + 2 * c.kv_size)  # (T, q+2kv)
        if c.qkv_bias:
            qkv = qkv + self.weight(f"{n}.bqkv")
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)  # (T, H, D)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)  # (T, Hkv, D)
        v = qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)  # (T, Hkv, D)
        ops.rope(q, k, positions, self.rope_cos_sin, scratch)
        ops.kv_write(k, v, k_cache, v_cache, slot_mapping)
        attn = torch.empty(t, c.num_heads, c.head_dim, dtype=x.dtype, device=x.device)  # (T, H, D)
        ops.slab_attention(q, k_cache, v_cache, query_start, slab_offset, context_len, self.scale, attn,
                           attn_workspace)
        return self._linear(attn.view(t, c.q_size), f"{n}.wo", c.hidden_size, residual=x)

    def _mlp_block(self, n: int, x: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
        inter = self.config.intermediate_size
        gate_up = self._linear(self._norm(x, self.weight(f"{n}.ffn_norm"), scratch), f"{n}.wgate_up",
                               2 * inter)  # (T, 2I)
        act = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)  # (T, I)
        ops.silu_mul(gate_up, act)
        return self._linear(act, f"{n}.wdown", self.config.hidden_size, residual=x)


def _buffer_name(name: str) -> str:
    return "w_" + name.replace(".", "_")


def build_step(source, dtype: torch.dtype = torch.float32, rope_positions: int | None = None,
               device: torch.device | str = "cpu", gemm: str = "aten") -> LlamaStep:
    """Load and pack a model from a runtime.loader.WeightSource into a ready step module whose weights (and rope
    table) all live in one weight arena, allocated once at `weight_layout`'s size (`step.weight_arena`), laid out
    for the matmul path `gemm`."""
    config = source.config
    positions = rope_positions or config.context_limit
    slots, arena_bytes = weight_layout(config, dtype, positions, gemm)
    where = {s.name: s for s in slots}
    arena = torch.empty(arena_bytes, dtype=torch.uint8, device=device)  # (arena_bytes,) the weight arena

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        slot = where[name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"weight {name}: packed as {tuple(tensor.shape)} {tensor.dtype}, the weight layout "
                             f"has {slot.shape} {slot.dtype}")
        view = arena[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        return view.copy_(tensor)

    packed = pack_weights(config, source, dtype, place, gemm)
    rope = place("rope_cos_sin", rope_table(config, positions, source.freq_factors()))
    step = LlamaStep(config, packed, positions, rope_cos_sin=rope, gemm=gemm)
    step.weight_arena = arena
    step.weight_slots = slots
    return step
