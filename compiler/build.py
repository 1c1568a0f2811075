"""build-plan's pipeline: a serving spec in, a verified `runtime.plan.Plan` out (DESIGN.md, "Data flow").

Contract: `build_plan(spec, base_dir)` decides every byte the server will use and returns a `Built` (the plan and
the traced graph of one bucket for the ONNX export), or raises `BuildError` (a model that cannot be read) or
`compiler.fit.FitError` (the plan does not fit its target; the message lists consumers and fixes). The same
inputs give the same plan: nothing here reads the clock, the host or the environment, and the device fingerprint
is the target's, not the build machine's.

Phases:
  1) the model: its config (and, with `weights: load`, the weight files' content hash), never the tensor data;
  2) the weight arena: the packed compute layout (runtime.model.pack_weights) computed on meta tensors;
  3) the activation arena: the step traced at every bucket on meta weights, lifetimes planned best-fit into one
     arena shared by all buckets (compiler.memplan), verified;
  4) staging buffers (step inputs per bucket, the sampler's (S, V) buffers);
  5) the KV arena: slab classes planned under what the target has left (compiler.slabs), verified;
  6) totals against the target; a plan that does not fit raises FitError with suggestions.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from slabserve.compiler import fit
from slabserve.compiler.memplan import DEFAULT_ALIGNMENT, TensorSpec, plan_shared
from slabserve.compiler.slabs import SlabPlan, SlabPlanError, kv_bytes_per_token, plan_kv
from slabserve.compiler.spec import DTYPES, ResolvedModel, Spec, resolve_model, spec_to_dict
from slabserve.compiler.tracing import TracedBucket, trace_buckets
from slabserve.runtime import plan as P
from slabserve.runtime.config import ModelConfig, ModelLoadError
from slabserve.runtime.devices import GPU_KINDS
from slabserve.runtime.loader import open_config, open_model
from slabserve.kernels import cpu_native
from slabserve.runtime.model import DTYPE_NAMES, WEIGHT_ALIGNMENT, default_gemm, weight_blocks, weight_layout
from slabserve.runtime.ranks import collective_bytes
from slabserve.runtime.step import logits_rows
from slabserve.runtime.tensor_parallel import rank_config, rank_slice
from slabserve.runtime.trace import kv_rows_for

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class BuildError(ValueError):
    """The model cannot be read or planned; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class Built:
    plan: P.Plan
    onnx_bucket: TracedBucket  # the traced step the bundle exports to ONNX
    traced: tuple[TracedBucket, ...] = ()  # every bucket's traced step, stored for the server (CPU targets)


@dataclass(frozen=True, slots=True)
class ModelInputs:
    resolved: ResolvedModel
    config: ModelConfig
    weights_hash: str | None
    tensor_types: dict[str, str] | None = None  # a GGUF file's block type of each tensor (HF names)


def build_plan(spec: Spec, base_dir: str | Path | None = None) -> Built:
    base = Path.cwd() if base_dir is None else Path(base_dir)
    # 1) the model, and the slice of it one rank holds (the whole model on one device): every arena below is one
    #    rank's, on one device of the target (runtime/tensor_parallel.py)
    model = load_model(spec, base)
    whole = model.config
    try:
        config = rank_config(whole, spec.tensor_parallel)
    except ValueError as err:
        raise BuildError(f"{spec.source}: {err}") from None
    model = dataclasses.replace(model, config=config)
    # 2) weights, with a rope table for max_context positions until the slabs are known (then: the largest slab,
    #    as runtime.engine builds it; never more bytes, so the KV budget planned below still holds)
    gemm = choose_gemm(spec)
    weight_format, blocks, format_note = choose_weight_format(spec, model, gemm)
    weights = weight_arena(config, spec.dtype, spec.max_context, gemm, blocks)
    # 3) activations: the largest bucket traced on meta weights sizes the arena (the KV rows are not known yet)
    dtype = TORCH_DTYPES[spec.dtype]
    kv_dtype = TORCH_DTYPES[spec.kv_dtype]
    sizing = trace_buckets(config, dtype, spec.buckets[-1:], spec.max_seqs, kv_rows=spec.max_context,
                           rope_positions=spec.max_context, device=spec.target.device, gemm=gemm, kv_dtype=kv_dtype,
                           blocks=blocks)
    activation_bytes = shared_arena_bytes(sizing)
    # 4) staging
    staging = staging_buffers(spec, config)
    # 5) KV: the declared prefixes' rows first, slab classes under what is left; then every bucket traced at the
    #    planned rows (their graph fingerprints)
    prefixes = declared_prefixes(spec, model)
    prefix_bytes = sum(len(ids) for _, ids in prefixes) * kv_bytes_per_token(
        config.num_layers, config.num_kv_heads, config.head_dim, DTYPES[spec.kv_dtype])
    while True:
        slabs = plan_slabs_for(spec, config, weights.arena_bytes, activation_bytes,
                               staging.total_bytes + prefix_bytes, weight_format)
        kv = kv_arena(config, spec.kv_dtype, slabs, prefixes)
        rope_positions = slabs.max_request_tokens
        traced = trace_buckets(config, dtype, spec.buckets, spec.max_seqs, kv_rows=kv.rows,
                               rope_positions=rope_positions, device=spec.target.device, gemm=gemm,
                               kv_dtype=kv_dtype, blocks=blocks)
        _check_same_activations(sizing, traced[-1:], spec.target.device)
        activations = activation_arena(traced)
        if activations.arena_bytes <= activation_bytes:
            break
        activation_bytes = activations.arena_bytes  # a smaller bucket needs more than the largest: plan again
    for name, ids in prefixes:
        if len(ids) >= slabs.max_request_tokens:
            raise BuildError(f"{spec.source}: prefixes: {name!r} has {len(ids)} tokens and the largest slab holds "
                             f"{slabs.max_request_tokens}: a request starting with it could never fit; shorten it by "
                             f"{len(ids) - slabs.max_request_tokens + 1} tokens or plan larger slabs")
    # 6) totals
    weights = weight_arena(config, spec.dtype, rope_positions, gemm, blocks)
    totals = _totals(spec, weights.arena_bytes, kv.arena_bytes, activations.arena_bytes, staging.total_bytes)
    if not totals.fits:
        raise fit.FitError(fit.report(spec, totals, slabs, weight_format))
    plan = P.Plan(
        schema=P.SCHEMA, version=P.SCHEMA_VERSION, name=spec.name, servable=spec.servable,
        spec=spec_to_dict(spec), fingerprints=fingerprints(spec, whole, model.weights_hash),
        engine=engine_section(spec, model.resolved, base, rope_positions, gemm, weight_format, format_note),
        model=model_summary(whole),
        target=P.TargetSection(spec.target.device, spec.target.gpu, spec.target.memory_bytes,
                               spec.target.reserve_bytes, requirements(spec, totals)),
        weights=weights, kv=kv, activations=activations, staging=staging, totals=totals,
        capacity=capacity(slabs), parallel=parallel_section(whole, spec.tensor_parallel, weights, totals))
    P.check_plan(plan)
    return Built(plan=plan, onnx_bucket=traced[0], traced=tuple(traced))


# ---------------------------------------------------------------------------------------------------------------
# 1) The model


def load_model(spec: Spec, base: Path) -> ModelInputs:
    resolved = resolve_model(spec.model, base_dir=base, source=spec.source)
    try:
        if not spec.model.servable:
            return ModelInputs(resolved, open_config(resolved.config or resolved.path).config, None)
        if spec.model.path is not None and (base / spec.model.path).is_file() and resolved.kind == "hf":
            raise BuildError(f"{spec.source}: model.path names a config.json; with weights: load, name the model "
                             f"folder, or set model.weights: none to plan from the config alone")
        source = open_model(resolved.path)
        source.check_shapes()
        types = source.tensor_types() if source.format == "gguf" else None
        return ModelInputs(resolved, source.config, source.content_hash(), types)
    except ModelLoadError as err:
        raise BuildError(f"{spec.source}: the model cannot be read: {err}") from None


def fingerprints(spec: Spec, config: ModelConfig, weights_hash: str | None) -> P.Fingerprints:
    return P.Fingerprints(
        model_config=P.config_fingerprint(config), weights=weights_hash, torch=str(torch.__version__),
        triton=_version("triton"), device=spec.target.gpu or spec.target.device)


def requirements(spec: Spec, totals: P.Totals) -> P.Requirements:
    """What the serving machine must have (runtime.plan.Requirements): the traced torch's major.minor; for a CUDA
    target also triton's, the compute capability of target.gpu and the device memory the plan and its reserve take."""
    cuda = spec.target.device == "cuda"
    triton = _version("triton")
    kind = GPU_KINDS.get(spec.target.gpu) if spec.target.gpu else None
    return P.Requirements(
        torch=_major_minor(str(torch.__version__)), triton=_major_minor(triton) if cuda and triton else None,
        compute_capability=tuple(kind.capability) if cuda and kind else None,
        device_memory_bytes=totals.planned_bytes + totals.reserve_bytes if cuda else 0)


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def model_summary(c: ModelConfig) -> P.ModelSummary:
    return P.ModelSummary(
        arch=c.arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        num_parameters=c.num_parameters(), context_limit=c.context_limit)


def choose_gemm(spec: Spec) -> str:
    """The spec's matmul path; `auto` is the native CPU kernel for float32 on cpu when this machine runs it (the
    plan is built where it will be served, as its device fingerprint says), else aten."""
    if spec.gemm != "auto":
        return spec.gemm
    return default_gemm(spec.target.device, TORCH_DTYPES[spec.dtype])


def choose_weight_format(spec: Spec, model: ModelInputs, gemm: str) -> tuple[str, dict[str, str] | None, str | None]:
    """(weight format, block type of each quantized tensor or None, why `auto` chose float or None). `auto` keeps a
    quantized GGUF's blocks where the native CPU kernels multiply them (float32 on cpu with gemm native); an
    explicit gguf or q8_0 that cannot be served is refused, naming the key and what is allowed."""
    want = spec.weight_format
    if want == "float":
        return "float", None, None
    why = None
    if want != "q8_0" and model.tensor_types is None:
        why = ("the model is not a GGUF file (or is planned from its config alone), so it has no blocks of its own "
               "to keep; weight_format: q8_0 quantizes it at load")
    elif want == "auto" and all(model.tensor_types.get(n) in (None, "F32", "F16", "BF16")
                                for n in model.tensor_types):
        why = "the GGUF file holds no quantized tensors (F32/F16/BF16 only)"
    elif spec.target.device != "cpu" or spec.dtype != "float32" or gemm != "native":
        why = (f"GGUF blocks are multiplied by the native CPU kernels (float32 on a cpu target with gemm native); "
               f"this plan is {spec.target.device} {spec.dtype} with gemm {gemm}")
        if spec.target.device == "cpu" and spec.dtype == "float32" and not cpu_native.available():
            why += f" because {cpu_native.unavailable_reason()}"
    if why is None:
        fmt = "gguf" if want == "auto" else want
        try:
            return fmt, weight_blocks(model.config, fmt, model.tensor_types), None
        except ValueError as err:
            why = str(err)
            degree = model.config.tensor_parallel
            if degree > 1:
                why += (f" (at parallel.tensor: {degree} each rank's rows of o_proj and down_proj are 1/{degree} of "
                        f"the model's; a degree whose slices are whole blocks, or weight_format: float, serves it)")
    if want == "auto":
        return "float", None, f"weight_format auto chose float: {why}"
    raise BuildError(f"{spec.source}: weight_format: {want} cannot be served: {why}; allowed here: float")


def engine_section(spec: Spec, resolved: ResolvedModel, base: Path, rope_positions: int,
                   gemm: str, weight_format: str = "float", format_note: str | None = None) -> P.EngineSection:
    path = resolved.path if spec.model.servable else (resolved.config or resolved.path)
    try:
        shown = str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        shown = str(Path(path).resolve())
    return P.EngineSection(
        model_path=shown, model_format=resolved.kind if spec.model.servable else "config",
        model_package=spec.model.package, model_file=spec.model.file, dtype=spec.dtype, kv_dtype=spec.kv_dtype,
        device=spec.target.device, max_seqs=spec.max_seqs, step_tokens=spec.step_tokens, buckets=spec.buckets,
        queue_limit=spec.queue_limit, rope_positions=rope_positions, max_queue_delay_ms=spec.max_queue_delay_ms,
        gemm=gemm, prefix_reuse=spec.prefix_reuse, weight_format=weight_format, weight_format_note=format_note)


def declared_prefixes(spec: Spec, model: ModelInputs) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, token ids) of each declared prefix, encoded by the model's own tokenizer as the server encodes a
    prompt: text as a text prompt is, messages rendered with the chat template without the generation prompt."""
    if not spec.prefixes:
        return ()
    gemm = choose_gemm(spec)
    if spec.target.device != "cpu" or gemm != "native":
        raise BuildError(f"{spec.source}: prefixes: declared prefixes are served by exact prefix reuse, which needs "
                         f"the native CPU kernels (gemm native on a cpu target); this plan is {spec.target.device} "
                         f"with gemm {gemm}: remove `prefixes` (its rows would never be used)")
    from slabserve.runtime.tokenizer import Tokenizer  # the compiler needs it only here

    path = model.resolved.path
    try:
        if model.resolved.kind == "gguf":
            tokenizer = Tokenizer.from_gguf(path)
        else:
            tokenizer = Tokenizer.from_hf_dir(path if Path(path).is_dir() else Path(path).parent)
    except (OSError, ValueError) as err:
        raise BuildError(f"{spec.source}: prefixes: the model's tokenizer is needed to encode declared prefixes "
                         f"and cannot be read: {err}") from None
    out = []
    for i, prefix in enumerate(spec.prefixes):
        try:
            if prefix.messages:
                messages = [{"role": r, "content": c} for r, c in prefix.messages]
                ids = tokenizer.encode_chat(messages, add_generation_prompt=False)
            else:
                ids = tokenizer.encode(prefix.text)
        except ValueError as err:
            raise BuildError(f"{spec.source}: prefixes[{i}] ({prefix.name}): cannot be encoded: {err}") from None
        if not ids:
            raise BuildError(f"{spec.source}: prefixes[{i}] ({prefix.name}): encodes to no tokens")
        if len(ids) >= spec.max_context:
            raise BuildError(f"{spec.source}: prefixes[{i}] ({prefix.name}): {len(ids)} tokens, not below "
                             f"max_context ({spec.max_context}); a request starting with it could never fit: "
                             f"shorten it by {len(ids) - spec.max_context + 1} tokens or more")
        out.append((prefix.name, tuple(int(t) for t in ids)))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# 2) Weights


def weight_arena(config: ModelConfig, dtype: str, rope_positions: int, gemm: str,
                 blocks: dict[str, str] | None = None) -> P.WeightArena:
    """The runtime's weight layout (runtime.model.weight_layout) for the matmul path `gemm` (or the GGUF blocks
    `blocks` names): the packed weights in pack order, then the (P, D) float32 rope table, each aligned to
    WEIGHT_ALIGNMENT. Block entries record their block type (the plan's weight manifest)."""
    slots, arena_bytes = weight_layout(config, TORCH_DTYPES[dtype], rope_positions, gemm, blocks)
    entries = tuple(P.WeightEntry(name=s.name, shape=s.shape, dtype=DTYPE_NAMES[s.dtype], offset=s.offset,
                                  nbytes=s.nbytes, block_type=s.block_type) for s in slots)
    parameter_bytes = sum(e.nbytes for e in entries if e.name != "rope_cos_sin")
    return P.WeightArena(alignment=WEIGHT_ALIGNMENT, arena_bytes=arena_bytes, parameter_bytes=parameter_bytes,
                         entries=entries)


# ---------------------------------------------------------------------------------------------------------------
# 3) Activations


def activation_arena(traced: list[TracedBucket]) -> P.ActivationArena:
    graphs = {_graph_key(b.tokens): [TensorSpec(t.name, t.nbytes, t.first_use, t.last_use) for t in b.tensors]
              for b in traced}
    shared = plan_shared(graphs, DEFAULT_ALIGNMENT)  # verified inside
    buckets = []
    for b in traced:
        placement = shared.placements[_graph_key(b.tokens)]
        tensors = tuple(P.ActivationEntry(name=t.name, offset=placement.offsets[t.name], nbytes=t.nbytes,
                                          shape=t.shape, dtype=t.dtype, first_use=t.first_use, last_use=t.last_use)
                        for t in sorted(b.tensors, key=lambda t: t.name))
        buckets.append(P.BucketLayout(tokens=b.tokens, graph_fingerprint=b.fingerprint,
                                      arena_bytes=placement.arena_size, naive_bytes=placement.naive_size,
                                      tensors=tensors))
    return P.ActivationArena(alignment=DEFAULT_ALIGNMENT, arena_bytes=shared.arena_size,
                             naive_bytes=shared.naive_size, buckets=tuple(buckets))


def _graph_key(tokens: int) -> str:
    return f"T{tokens:08d}"


def shared_arena_bytes(traced: list[TracedBucket]) -> int:
    return activation_arena(traced).arena_bytes


def _check_same_activations(sizing: list[TracedBucket], traced: list[TracedBucket], device: str) -> None:
    if device == "cpu":
        return  # the CPU attention scratch grows with the rope positions (the largest slab): sized again below
    for a, b in zip(sizing, traced):
        if a.tensors != b.tensors:
            raise BuildError(f"bucket {a.tokens}: the step's intermediates changed with the KV rows "
                             f"({a.kv_rows} -> {b.kv_rows}); the activation plan would not hold")


# ---------------------------------------------------------------------------------------------------------------
# 4) Staging


def staging_buffers(spec: Spec, config: ModelConfig) -> P.Staging:
    """Device bytes of runtime.step.StepInputs for every bucket and of runtime.sampler.Sampler, as those classes
    make them: per bucket 3 (T,) int64 + (S+1,) int32 + (S,) int64 + (S,) int32 + (R,) int64 logits rows
    (R = runtime.step.logits_rows(T, S)); the sampler's (S, V) buffers are three float32, one int64 and two bool,
    plus an int64 arange of V and per row 65 bytes (threshold, u * mass, choice, drawn id, greedy id, token id,
    four float32 parameters, top-k, greedy flag); the engine's (S, V) float32 rows picked for sampling. On CUDA
    the pinned host copies (two sets of step inputs, the sampler's row parameters and ids) are host memory, not
    counted here."""
    s, v = spec.max_seqs, config.vocab_size
    step_inputs = sum(24 * t + 4 * (s + 1) + 8 * s + 4 * s + 8 * logits_rows(t, s) for t in spec.buckets)
    sampler = s * v * (3 * 4 + 8 + 2 * 1 + 4) + 8 * v + s * SAMPLER_ROW_BYTES
    collective = collective_bytes(spec.buckets, s, spec.tensor_parallel)
    return P.Staging(step_inputs_bytes=step_inputs, sampler_bytes=sampler, collective_bytes=collective,
                     total_bytes=step_inputs + sampler + collective)


SAMPLER_ROW_BYTES = 4 + 4 + 8 + 8 + 8 + 8 + 4 * 4 + 8 + 1


# ---------------------------------------------------------------------------------------------------------------
# 5) KV


def plan_slabs_for(spec: Spec, config: ModelConfig, weights: int, activations: int, staging: int,
                   weight_format: str) -> SlabPlan:
    """Slab classes in what the target has left after the other arenas (or in kv.budget when the spec sets it)."""
    bytes_per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim,
                                         DTYPES[spec.kv_dtype])
    left = spec.target.usable_bytes - weights - activations - staging
    try:
        return plan_kv(spec.kv, max_context=spec.max_context, max_seqs=spec.max_seqs,
                       kv_bytes_per_token=bytes_per_token, default_budget_bytes=max(left, 0))
    except SlabPlanError as err:
        raise fit.FitError(fit.report_without_kv(spec, weights, activations, staging, bytes_per_token,
                                                 str(err), weight_format)) from None


def kv_arena(config: ModelConfig, kv_dtype: str, slabs: SlabPlan,
             prefixes: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> P.KVArena:
    """The slab classes back to back, then the declared prefixes' rows, then up to KV_TILE - 1 unused rows (a whole
    number of K tiles: runtime.trace.kv_rows_for)."""
    rows = kv_rows_for(slabs.arena_tokens + sum(len(ids) for _, ids in prefixes))
    one = config.num_layers * rows * config.num_kv_heads * config.head_dim * DTYPES[kv_dtype]  # (L, N, Hkv, D)
    classes, row = [], 0
    for c in slabs.classes:
        classes.append(P.SlabEntry(tokens=c.tokens, count=c.count, row_offset=row, share=round(c.share, 9)))
        row += c.tokens * c.count
    declared = []
    for name, ids in prefixes:
        declared.append(P.PrefixEntry(name=name, token_ids=ids, row_offset=row,
                                      kv_bytes=len(ids) * slabs.kv_bytes_per_token))
        row += len(ids)
    return P.KVArena(num_layers=config.num_layers, rows=rows, num_kv_heads=config.num_kv_heads,
                     head_dim=config.head_dim, dtype=kv_dtype, bytes_per_token=slabs.kv_bytes_per_token,
                     k_bytes=one, v_bytes=one, arena_bytes=2 * one, classes=tuple(classes),
                     prefixes=tuple(declared))


def parallel_section(whole: ModelConfig, degree: int, weights: P.WeightArena, totals: P.Totals) -> P.ParallelSection:
    """Each rank's slice of the model and its bytes on its device: the same arenas on every rank, since every rank
    holds the same number of heads and columns (runtime/tensor_parallel.py)."""
    ranks = []
    for r in range(degree):
        s = rank_slice(whole, r, degree)
        ranks.append(P.RankPlan(
            rank=r, heads=s.heads, kv_heads=s.kv_heads, intermediate=s.intermediate,
            weights_bytes=totals.weights_bytes, parameter_bytes=weights.parameter_bytes, kv_bytes=totals.kv_bytes,
            activations_bytes=totals.activations_bytes, staging_bytes=totals.staging_bytes,
            planned_bytes=totals.planned_bytes, headroom_bytes=totals.headroom_bytes, fits=totals.fits))
    return P.ParallelSection(tensor=degree, ranks=tuple(ranks))


def capacity(slabs: SlabPlan) -> P.Capacity:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 9)

    return P.Capacity(
        kv_budget_bytes=slabs.budget_bytes, concurrency=slabs.concurrency,
        max_request_tokens=slabs.max_request_tokens, utilization=r(slabs.utilization),
        internal_waste=r(slabs.internal_waste), internal_waste_bytes=slabs.internal_waste_bytes,
        unservable_share=r(slabs.unservable_share),
        baselines=tuple(P.Baseline(name=b.name, unit_tokens=b.unit_tokens, units=b.units, arena_bytes=b.arena_bytes,
                                   concurrency=b.concurrency, utilization=round(b.utilization, 9))
                        for b in slabs.baselines))


# ---------------------------------------------------------------------------------------------------------------
# 6) Totals


def _totals(spec: Spec, weights: int, kv: int, activations: int, staging: int) -> P.Totals:
    planned = weights + kv + activations + staging
    headroom = spec.target.memory_bytes - spec.target.reserve_bytes - planned
    return P.Totals(weights_bytes=weights, kv_bytes=kv, activations_bytes=activations, staging_bytes=staging,
                    reserve_bytes=spec.target.reserve_bytes, planned_bytes=planned,
                    target_bytes=spec.target.memory_bytes, headroom_bytes=headroom, fits=headroom >= 0)
