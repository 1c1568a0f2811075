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

Weight format (`weights`, chosen by the plan; kernels/quant.py): "float" dequantizes every tensor to the plan's
dtype in the layout above. "gguf" keeps every projection and the embedding in the GGUF file's own blocks (Q4_1,
Q8_0, Q4_K, ...) and "q8_0" quantizes them to Q8_0 at load: each is then a (N, row_bytes) uint8 tensor of blocks,
multiplied by slabserve::linear_q and gathered by slabserve::embed_q (native CPU kernels, fp32 activations), a tied
lm_head reads the embedding's own blocks, and the parts of a fused projection (q/k/v, gate/up) stay one tensor when
they share a block type and become one per run of a type when they do not. `blocks` (weight_blocks) names each
quantized tensor's type; the plan's weight manifest records it per slot.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

import slabserve.kernels.ops  # noqa: F401  (registers torch.ops.slabserve.*)
from slabserve.kernels import collectives, cpu_native, quant
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


def _block_tensors(config: ModelConfig) -> dict[str, int]:
    """HF name -> K (weights per row) of every tensor a quantized weight format keeps in blocks."""
    c = config
    names = {"model.embed_tokens.weight": c.hidden_size}
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        names.update({p + "self_attn.q_proj.weight": c.hidden_size, p + "self_attn.k_proj.weight": c.hidden_size,
                      p + "self_attn.v_proj.weight": c.hidden_size, p + "self_attn.o_proj.weight": c.q_size,
                      p + "mlp.gate_proj.weight": c.hidden_size, p + "mlp.up_proj.weight": c.hidden_size,
                      p + "mlp.down_proj.weight": c.intermediate_size})
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = c.hidden_size
    return names


def weight_blocks(config: ModelConfig, weights: str, tensor_types: Mapping[str, str] | None = None
                  ) -> dict[str, str] | None:
    """HF name -> block type (kernels.quant.BLOCK_TYPES) of every tensor the weight format `weights` keeps in
    blocks; None for "float". `tensor_types`: the GGUF file's own types (WeightSource.tensor_types), which "gguf"
    keeps. Raises ValueError naming the tensor and what is allowed when the kernels cannot take a block type."""
    if weights == "float":
        return None
    if weights not in quant.WEIGHT_FORMATS:
        raise ValueError(f"weight_format: {weights!r} is not one of {', '.join(quant.WEIGHT_FORMATS)}")
    sizes = _block_tensors(config)
    if weights == "q8_0":
        blocks = dict.fromkeys(sizes, "Q8_0")
    elif tensor_types is None:
        raise ValueError("weight_format: gguf keeps a GGUF file's own blocks and this model is not a GGUF file: use "
                         "weight_format: q8_0 (quantized at load) or float")
    else:
        blocks = {name: tensor_types[name] for name in sizes}
    for name, kind in blocks.items():
        quant.block_type(kind, f"weight_format: {weights}: {name}")
        if not quant.fits(kind, sizes[name]):
            raise ValueError(f"weight_format: {weights}: {name} has rows of {sizes[name]} weights, which do not split into "
                             f"whole {kind} blocks of {quant.BLOCK_TYPES[kind].block_size}: use weight_format: float")
    return blocks


def source_blocks(source, weight_format: str, gemm: str, device: str, dtype: str) -> dict[str, str] | None:
    """weight_blocks for a weight source (its GGUF tensor types when it is one), after checking the format runs on
    this path: the block kernels are the native float32 CPU ones (gemm native)."""
    if weight_format == "float":
        return None
    if device != "cpu" or dtype != "float32" or gemm != "native":
        raise ValueError(f"weight_format: {weight_format} is multiplied by the native float32 CPU kernels; this engine "
                         f"runs {device} {dtype} with gemm {gemm}: use weight_format: float")
    types = source.tensor_types() if getattr(source, "format", None) == "gguf" else None
    return weight_blocks(source.config, weight_format, types)


@dataclass(frozen=True, slots=True)
class BlockGroup:
    """One run of a quantized projection's parts that share a block type: a (rows, row_bytes) uint8 slot."""

    slot: str        # packed name of the tensor holding it ("3.wqkv", "3.wqkv.1", or "embed" for a tied lm_head)
    block_type: str
    start: int       # its first output column in the projection
    rows: int
    k: int


def block_groups(config: ModelConfig, blocks: Mapping[str, str]) -> dict[str, list[BlockGroup]]:
    """Projection name ("3.wqkv", ..., "lm_head") -> its block groups, in pack order. A projection whose parts share
    a block type is one group named like the projection; else one group per run of a type, named
    "<projection>.<index>"."""
    c = config
    out: dict[str, list[BlockGroup]] = {}

    def add(proj: str, k: int, parts: list[tuple[str, int]]) -> None:
        runs: list[list] = []
        start = 0
        for name, rows in parts:
            kind = blocks[name]
            if runs and runs[-1][0] == kind:
                runs[-1][2] += rows
            else:
                runs.append([kind, start, rows])
            start += rows
        out[proj] = [BlockGroup(proj if len(runs) == 1 else f"{proj}.{i}", kind, first, rows, k)
                     for i, (kind, first, rows) in enumerate(runs)]

    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        add(f"{n}.wqkv", c.hidden_size, [(p + "self_attn.q_proj.weight", c.q_size),
                                          (p + "self_attn.k_proj.weight", c.kv_size),
                                          (p + "self_attn.v_proj.weight", c.kv_size)])
        add(f"{n}.wo", c.q_size, [(p + "self_attn.o_proj.weight", c.hidden_size)])
        add(f"{n}.wgate_up", c.hidden_size, [(p + "mlp.gate_proj.weight", c.intermediate_size),
                                              (p + "mlp.up_proj.weight", c.intermediate_size)])
        add(f"{n}.wdown", c.intermediate_size, [(p + "mlp.down_proj.weight", c.hidden_size)])
    if c.tie_word_embeddings:
        out["lm_head"] = [BlockGroup("embed", blocks["model.embed_tokens.weight"], 0, c.vocab_size, c.hidden_size)]
    else:
        add("lm_head", c.hidden_size, [("lm_head.weight", c.vocab_size)])
    return out


def _projection_parts(config: ModelConfig) -> dict[str, list[str]]:
    """Projection name -> the HF tensors whose rows it stacks, in order (block_groups' order)."""
    parts = {}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        parts[f"{n}.wqkv"] = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        parts[f"{n}.wo"] = [p + "self_attn.o_proj.weight"]
        parts[f"{n}.wgate_up"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        parts[f"{n}.wdown"] = [p + "mlp.down_proj.weight"]
    if not config.tie_word_embeddings:
        parts["lm_head"] = ["lm_head.weight"]
    return parts


def pack_weights(config: ModelConfig, source: TensorSource, dtype: torch.dtype,
                 place: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 gemm: str = "aten", blocks: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """HF-named weights -> the step's compute layout (fused, pre-transposed or panel-packed for `gemm`, `dtype`;
    or, with `blocks`, the block rows of kernels.quant).

    Reads the source tensor by tensor. `place(name, tensor)` (when given) moves each packed tensor to its final
    home and returns it there (`build_step`: its place in the weight arena), so the temporary copy is freed before
    the next one is made and peak memory stays near one copy of the model.
    """
    _check_gemm(gemm)
    if blocks is not None:
        return _pack_blocks(config, source, blocks, place)

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


def _pack_blocks(config: ModelConfig, source, blocks: Mapping[str, str],
                 place: Callable[[str, torch.Tensor], torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """pack_weights for a quantized format: block rows read as the file holds them (source.get_blocks) or
    quantized to Q8_0 here, stacked per block group; norms (and a q/k/v bias) in float32."""

    def rows(name: str) -> torch.Tensor:  # (N, row_bytes) uint8
        kind = blocks[name]
        if hasattr(source, "get_blocks"):
            have, data = source.get_blocks(name)
            if have == kind:
                return data
        return quant.quantize_q8_0(source.get(name, torch.float32)) if kind == "Q8_0" else _no_blocks(name, kind)

    def take(name: str) -> torch.Tensor:
        return source.get(name, torch.float32).contiguous()

    packed = _Placed(place)
    packed["embed"] = rows("model.embed_tokens.weight")
    groups, parts = block_groups(config, blocks), _projection_parts(config)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        for proj in (f"{n}.wqkv", f"{n}.wo", f"{n}.wgate_up", f"{n}.wdown"):
            _place_groups(packed, groups[proj], parts[proj], rows)
        if config.qkv_bias:
            packed[f"{n}.bqkv"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]).contiguous()
        packed[f"{n}.attn_norm"] = take(p + "input_layernorm.weight")
        packed[f"{n}.ffn_norm"] = take(p + "post_attention_layernorm.weight")
    packed["norm"] = take("model.norm.weight")
    if not config.tie_word_embeddings:
        _place_groups(packed, groups["lm_head"], parts["lm_head"], rows)
    return dict(packed)


def _place_groups(packed: dict, groups: list[BlockGroup], names: list[str], rows: Callable) -> None:
    """Stack the parts' block rows into each group's slot (a run of parts of one type)."""
    pending = list(names)
    for g in groups:
        taken, count = [], 0
        while count < g.rows:
            r = rows(pending.pop(0))
            taken.append(r)
            count += r.shape[0]
        packed[g.slot] = taken[0] if len(taken) == 1 else torch.cat(taken, dim=0)


def _no_blocks(name: str, kind: str) -> torch.Tensor:
    raise ValueError(f"{name}: the model does not hold {kind} blocks for it (weight_format: gguf reads a GGUF file's own "
                     f"blocks; weight_format: q8_0 quantizes any model)")


class _Placed(dict):
    """A dict that passes every tensor stored in it through `place` first."""

    def __init__(self, place: Callable[[str, torch.Tensor], torch.Tensor] | None):
        super().__init__()
        self._place = place

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        super().__setitem__(name, self._place(name, tensor) if self._place else tensor)


# Every weight starts on a boundary any vector load or TMA descriptor accepts.
WEIGHT_ALIGNMENT = 256
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one packed weight lives in the weight arena."""

    name: str                # pack_weights name ("embed", "3.wqkv", ...) or "rope_cos_sin"
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int              # bytes from the arena's start, a multiple of WEIGHT_ALIGNMENT
    nbytes: int
    block_type: str | None = None  # GGUF block type of a (rows, row_bytes) uint8 slot (kernels.quant); else None


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


def packed_specs(config: ModelConfig, dtype: torch.dtype, gemm: str = "aten",
                 blocks: Mapping[str, str] | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype, str | None]]:
    """`pack_weights`' output in its order: name -> (shape, dtype, block type or None)."""
    if blocks is None:
        return {name: (shape, dtype, None) for name, shape in packed_shapes(config, gemm).items()}
    c = config
    embed = quant.BLOCK_TYPES[blocks["model.embed_tokens.weight"]]
    specs = {"embed": ((c.vocab_size, embed.row_bytes(c.hidden_size)), torch.uint8, embed.name)}
    groups = block_groups(config, blocks)

    def add(proj: str) -> None:
        for g in groups[proj]:
            specs[g.slot] = ((g.rows, quant.BLOCK_TYPES[g.block_type].row_bytes(g.k)), torch.uint8, g.block_type)

    for n in range(c.num_layers):
        add(f"{n}.wqkv")
        if c.qkv_bias:
            specs[f"{n}.bqkv"] = ((c.q_size + 2 * c.kv_size,), torch.float32, None)
        add(f"{n}.wo")
        add(f"{n}.wgate_up")
        add(f"{n}.wdown")
        specs[f"{n}.attn_norm"] = ((c.hidden_size,), torch.float32, None)
        specs[f"{n}.ffn_norm"] = ((c.hidden_size,), torch.float32, None)
    specs["norm"] = ((c.hidden_size,), torch.float32, None)
    if not c.tie_word_embeddings:
        add("lm_head")
    return specs


def empty_packed(config: ModelConfig, dtype: torch.dtype, gemm: str = "aten",
                 blocks: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of `pack_weights`' layout on the current default device (meta or fake: tracing)."""
    return {name: torch.empty(shape, dtype=dt) for name, (shape, dt, _) in
            packed_specs(config, dtype, gemm, blocks).items()}


def weight_layout(config: ModelConfig, dtype: torch.dtype, rope_positions: int,
                  gemm: str = "aten", blocks: Mapping[str, str] | None = None) -> tuple[list[WeightSlot], int]:
    """The weight arena: every packed weight in pack order, then the (P, D) float32 rope table, each aligned to
    WEIGHT_ALIGNMENT; (slots, arena bytes). The compiler writes this layout into the plan and the runtime
    allocates and fills exactly it (build_step refuses a packed tensor that does not match its slot)."""
    items = list(packed_specs(config, dtype, gemm, blocks).items())
    items.append(("rope_cos_sin", ((rope_positions, config.head_dim), torch.float32, None)))
    slots, offset = [], 0
    for name, (shape, dt, kind) in items:
        nbytes = math.prod(shape) * torch.empty((), dtype=dt, device="meta").element_size()
        slots.append(WeightSlot(name, shape, dt, offset, nbytes, kind))
        offset += -(-nbytes // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT
    return slots, offset


class LlamaStep(nn.Module):
    """The step function of one model. Parameters are buffers (never trained); KV caches are arguments."""

    def __init__(self, config: ModelConfig, packed: Mapping[str, torch.Tensor], rope_positions: int | None = None,
                 freq_factors: torch.Tensor | None = None, rope_cos_sin: torch.Tensor | None = None,
                 gemm: str = "aten", blocks: Mapping[str, str] | None = None):
        """`rope_cos_sin`: the (P, D) float32 table already computed (and placed); else computed here. `gemm`: the
        matmul path `packed` was laid out for (pack_weights); `blocks`: the block types of a quantized layout."""
        super().__init__()
        _check_gemm(gemm)
        self.config = config
        self.gemm = gemm
        self.blocks = dict(blocks) if blocks is not None else None
        # projection -> [(slot, GGML type id, first column, last column + 1)] for a quantized layout
        self.block_groups = {} if blocks is None else {
            proj: [(g.slot, quant.BLOCK_TYPES[g.block_type].ggml_id, g.start, g.start + g.rows) for g in groups]
            for proj, groups in block_groups(config, blocks).items()}
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
        x = self._embed(input_ids)  # (T, hidden)
        # On CPU the row-wise kernels compute only the real rows, query_start[S] of the bucket's T (kernels.ops:
        # ROWS); a CUDA graph replays its bucket whole.
        rows = query_start if x.device.type == "cpu" else None
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
                                      k_cache[n], v_cache[n], scratch, attn_workspace, rows)
            x = self._mlp_block(n, x, scratch, rows)
        x = self._norm(x, self.weight("norm"), scratch, rows)
        # (R, V). The engine asks a row per sequence slot (R <= S), and on CPU only the real sequences' rows are
        # computed; a caller asking more rows than slots (every token's logits, as the parity tests do) gets all.
        per_slot = logits_indices.shape[0] <= slab_offset.shape[0]
        return self._linear(x[logits_indices], "lm_head", c.vocab_size, rows=rows if per_slot else None,
                            per_sequence=per_slot)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return self.weight("embed")[input_ids]  # (T, hidden)
        out = torch.empty(input_ids.shape[0], self.config.hidden_size, dtype=torch.float32,
                          device=input_ids.device)  # (T, hidden)
        kind = quant.BLOCK_TYPES[self.blocks["model.embed_tokens.weight"]].ggml_id
        ops.embed_q(input_ids, self.weight("embed"), out, kind)
        return out

    def _linear(self, x: torch.Tensor, name: str, out_features: int, residual: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, per_sequence: bool = False) -> torch.Tensor:
        """x (T, in) @ the projection `name` (T, out), plus residual (T, out) when given; `rows`, `per_sequence`:
        the real rows (kernels.ops: ROWS)."""
        if self.blocks is not None:
            out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)  # (T, out)
            groups = self.block_groups[name]
            for slot, kind, start, end in groups:
                whole = len(groups) == 1
                ops.linear_q(x, self.weight(slot), out if whole else out[:, start:end],
                             residual if whole or residual is None else residual[:, start:end], kind, rows,
                             per_sequence)
            return out
        w = self.weight(name)
        if self.gemm == "aten":
            y = x @ w
            return y if residual is None else residual + y
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)  # (T, out)
        ops.linear(x, w, out, residual, rows, per_sequence)
        return out

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, scratch: torch.Tensor | None,
              rows: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(x)
        ops.rms_norm(x, weight, self.config.rms_norm_eps, out, scratch, rows)
        return out

    def _attention_block(self, n, x, positions, slot_mapping, query_start, slab_offset, context_len, k_cache,
                         v_cache, scratch, attn_workspace, rows):
        c = self.config
        t = x.shape[0]
        qkv = self._linear(self._norm(x, self.weight(f"{n}.attn_norm"), scratch, rows), f"{n}.wqkv",
                           c.q_size + 2 * c.kv_size, rows=rows)  # (T, q+2kv)
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
        return self._project_out(attn.view(t, c.q_size), f"{n}.wo", x, rows)

    def _mlp_block(self, n: int, x: torch.Tensor, scratch: torch.Tensor | None,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        inter = self.config.intermediate_size
        gate_up = self._linear(self._norm(x, self.weight(f"{n}.ffn_norm"), scratch, rows), f"{n}.wgate_up",
                               2 * inter, rows=rows)  # (T, 2I)
        act = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)  # (T, I)
        ops.silu_mul(gate_up, act, rows)
        return self._project_out(act, f"{n}.wdown", x, rows)

    def _project_out(self, x: torch.Tensor, name: str, residual: torch.Tensor,
                     rows: torch.Tensor | None) -> torch.Tensor:
        """o_proj or down_proj back into the residual stream. At tensor-parallel degree N each rank's product is a
        partial sum over its heads or columns: summed over the ranks in place, then the residual added
        (kernels/collectives.py)."""
        hidden = self.config.hidden_size
        if self.config.tensor_parallel == 1:
            return self._linear(x, name, hidden, residual=residual, rows=rows)
        out = self._linear(x, name, hidden, rows=rows)  # (T, hidden), this rank's part
        return collectives.all_reduce_residual(out, residual, rows)


def _buffer_name(name: str) -> str:
    return "w_" + name.replace(".", "_")


def build_step(source, dtype: torch.dtype = torch.float32, rope_positions: int | None = None,
               device: torch.device | str = "cpu", gemm: str = "aten",
               blocks: Mapping[str, str] | None = None) -> LlamaStep:
    """Load and pack a model from a runtime.loader.WeightSource into a ready step module whose weights (and rope
    table) all live in one weight arena, allocated once at `weight_layout`'s size (`step.weight_arena`), laid out
    for the matmul path `gemm`, or in the GGUF blocks `blocks` names (weight_blocks)."""
    config = source.config
    positions = rope_positions or config.context_limit
    slots, arena_bytes = weight_layout(config, dtype, positions, gemm, blocks)
    where = {s.name: s for s in slots}
    arena = torch.empty(arena_bytes, dtype=torch.uint8, device=device)  # (arena_bytes,) the weight arena

    def place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        slot = where[name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"weight {name}: packed as {tuple(tensor.shape)} {tensor.dtype}, the weight layout "
                             f"has {slot.shape} {slot.dtype}")
        view = arena[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        return view.copy_(tensor)

    packed = pack_weights(config, source, dtype, place, gemm, blocks)
    rope = place("rope_cos_sin", rope_table(config, positions, source.freq_factors()))
    step = LlamaStep(config, packed, positions, rope_cos_sin=rope, gemm=gemm, blocks=blocks)
    step.weight_arena = arena
    step.weight_slots = slots
    return step
