"""The plan bundle's schema: frozen dataclasses, their canonical encoding, and a strict reader for untrusted input.

Contract: a `Plan` is everything the server needs to allocate its arenas and rebuild its `Engine`, decided by the
compiler (`build-plan`) ahead of time. `encode_plan(plan)` gives its canonical bytes: msgpack of plain data, maps
with sorted keys, no extension types, so the same plan always gives the same bytes; their sha256 is the plan id.
`read_plan(dir)` / `decode_plan(data)` are safe on an untrusted CI artifact: no pickle and no code, a size limit
before reading, msgpack with strict options and small container limits, and then every field checked for its type
and range, and the whole plan for consistency (weights and slabs inside their arenas, activations that live at
the same time never sharing bytes, totals that add up). Anything wrong raises one `PlanFormatError` naming the field
(`kv.classes[1].row_offset`), before anything is allocated.

This module lives in runtime/ because the server reads plans; it imports nothing of ours.
"""
from __future__ import annotations

import functools
import hashlib
import math
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import msgpack

from slabserve.kernels.contracts import KV_TILE
from slabserve.runtime.units import round_up

SCHEMA = "slabserve.plan"
SCHEMA_VERSION = 5  # 2: target.requires; 3: engine.prefix_reuse, kv.prefixes; 4: engine.weight_format(_note),
#                     weights.entries[].block_type; 5: parallel, staging.collective_bytes
GEMMS = ("aten", "native")  # runtime.model.GEMMS (this module imports nothing of ours)
# Weight arena formats (kernels/quant.py): float dequantizes at load; gguf keeps a GGUF file's blocks; q8_0 quantizes
WEIGHT_FORMATS = ("float", "gguf", "q8_0")
MAX_QUEUE_DELAY_MS = 3_600_000  # an hour: beyond it admission by latency is off in all but name
PLAN_FILE = "plan.msgpack"
MAX_PLAN_BYTES = 64 * 1024**2  # a 30-layer model at 9 buckets is well under 1 MiB
MAX_INT = 2**62  # any byte count or offset above this is corrupt (and would overflow int64 arithmetic)
_MAX_STR = 4096
_MAX_ITEMS = 1 << 20
_MAX_SPEC_DEPTH = 8
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class PlanFormatError(ValueError):
    """A plan file that cannot be trusted: unreadable, truncated, of an unknown version, or inconsistent."""


# ---------------------------------------------------------------------------------------------------------------
# The schema. Every int is a non-negative count, offset or byte size unless its comment says otherwise.


@dataclass(frozen=True, slots=True)
class Fingerprints:
    model_config: str  # sha256 of the canonical ModelConfig
    weights: str | None  # sha256 of the weight files' bytes; None for a plan made without weights
    torch: str  # torch version the step was traced with
    triton: str | None  # triton version, None when not installed
    device: str  # "cpu" or the target GPU's name (e.g. "H100-80GB")


@dataclass(frozen=True, slots=True)
class EngineSection:
    """What `Engine.from_plan` needs beside the arenas (runtime.engine.EngineConfig's fields)."""

    model_path: str  # the model as resolved at build time (relative to the build's directory when inside it)
    model_format: str  # "gguf", "hf" or "config" (config.json only: not servable)
    model_package: str | None  # the installed package holding the model file, when the spec named one
    model_file: str | None
    dtype: str
    kv_dtype: str
    device: str  # "cpu" or "cuda"
    max_seqs: int
    step_tokens: int
    buckets: tuple[int, ...]  # ascending; the last is step_tokens
    queue_limit: int  # waiting requests per slab class
    rope_positions: int  # rows of the rope table in the weight arena
    max_queue_delay_ms: int | None = None  # admission by latency (runtime.admission); None: off
    gemm: str = "aten"  # matmul path and projection layout (runtime.model.GEMMS): "aten" or "native" (CPU fp32)
    prefix_reuse: bool = True  # slabs keep their prefixes for later prompts (runtime.prefix_cache)
    weight_format: str = "float"  # the weight arena's format (kernels.quant.WEIGHT_FORMATS): float, gguf or q8_0
    weight_format_note: str | None = None  # why the spec's `weight_format: auto` chose float, when it did


@dataclass(frozen=True, slots=True)
class ModelSummary:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    context_limit: int


@dataclass(frozen=True, slots=True)
class WeightEntry:
    name: str  # packed compute-layout name (runtime.model.pack_weights): "embed", "3.wqkv", ..., "rope_cos_sin"
    shape: tuple[int, ...]
    dtype: str
    offset: int  # bytes from the weight arena's start; a multiple of the arena's alignment
    nbytes: int  # prod(shape) * dtype size
    block_type: str | None = None  # GGUF block type of a (rows, row_bytes) uint8 entry (kernels.quant); else None


@dataclass(frozen=True, slots=True)
class WeightArena:
    alignment: int
    arena_bytes: int
    parameter_bytes: int  # the model's own parameters in the packed layout (tied embeddings appear twice)
    entries: tuple[WeightEntry, ...]  # ascending offsets


@dataclass(frozen=True, slots=True)
class SlabEntry:
    tokens: int  # capacity of one slab, in KV rows
    count: int
    row_offset: int  # first KV row of the class's first slab; classes lie back to back
    share: float  # of the mix's requests whose smallest fitting class this is (0.0 without a mix)


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    """A declared prefix: its token ids, prefilled at start-up into rows of their own, only ever copied from."""

    name: str
    token_ids: tuple[int, ...]
    row_offset: int  # first KV row; declared prefixes lie back to back after the slab classes
    kv_bytes: int  # len(token_ids) * bytes_per_token


@dataclass(frozen=True, slots=True)
class KVArena:
    """K and V, each one (L, N, Hkv, D) tensor of `dtype`: N = rows, the slab classes back to back, then the
    declared prefixes."""

    num_layers: int
    rows: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_token: int  # K and V of one row in every layer
    k_bytes: int
    v_bytes: int
    arena_bytes: int  # k_bytes + v_bytes
    classes: tuple[SlabEntry, ...]
    prefixes: tuple[PrefixEntry, ...] = ()


@dataclass(frozen=True, slots=True)
class ActivationEntry:
    name: str  # node name in the traced graph of this bucket (the executor's key)
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    first_use: int  # index of the op that writes it
    last_use: int  # index of the last op that reads it (inclusive)


@dataclass(frozen=True, slots=True)
class BucketLayout:
    tokens: int
    graph_fingerprint: str
    arena_bytes: int  # this bucket's own high-water mark in the shared arena
    naive_bytes: int  # every intermediate in its own buffer
    tensors: tuple[ActivationEntry, ...]  # by name


@dataclass(frozen=True, slots=True)
class ActivationArena:
    alignment: int
    arena_bytes: int  # the largest bucket's; all buckets share it
    naive_bytes: int  # every intermediate of every bucket in its own buffer
    buckets: tuple[BucketLayout, ...]  # ascending tokens


@dataclass(frozen=True, slots=True)
class Staging:
    step_inputs_bytes: int  # runtime.step.StepInputs of every bucket (pinned on cuda)
    sampler_bytes: int  # runtime.sampler.Sampler's (S, V) buffers
    total_bytes: int
    collective_bytes: int = 0  # tensor parallelism: the step message each rank receives (runtime.ranks); 0 at one


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank of a tensor-parallel plan: the slice of the model it holds, as [start, stop) of the whole model's
    query heads, KV heads and MLP columns (runtime.tensor_parallel), and its bytes on its own device. Every rank's
    arenas have the same layout (the plan's weights, kv, activations and staging sections); only the slice differs."""

    rank: int
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    intermediate: tuple[int, ...]
    weights_bytes: int  # its weight shard, the replicated embedding, norms and lm_head, and the rope table
    parameter_bytes: int  # of which model parameters
    kv_bytes: int  # its KV heads of every slab
    activations_bytes: int
    staging_bytes: int  # step inputs, sampler and the collective buffer
    planned_bytes: int
    headroom_bytes: int  # one device of the target, less the reserve and the planned bytes; may be negative
    fits: bool


@dataclass(frozen=True, slots=True)
class ParallelSection:
    tensor: int  # tensor-parallel degree: ranks, one device each; 1 for one device
    ranks: tuple[RankPlan, ...]  # one per rank, in rank order


@dataclass(frozen=True, slots=True)
class Totals:
    weights_bytes: int
    kv_bytes: int
    activations_bytes: int
    staging_bytes: int
    reserve_bytes: int
    planned_bytes: int  # weights + kv + activations + staging
    target_bytes: int  # the target's memory
    headroom_bytes: int  # target - reserve - planned; may be negative (then fits is false)
    fits: bool


@dataclass(frozen=True, slots=True)
class Baseline:
    name: str
    unit_tokens: int
    units: int
    arena_bytes: int
    concurrency: int
    utilization: float


@dataclass(frozen=True, slots=True)
class Capacity:
    kv_budget_bytes: int
    concurrency: int  # requests of the mix held at once
    max_request_tokens: int  # longest prompt + max_tokens a slab holds
    utilization: float | None  # token-weighted KV utilization for the mix; None without a mix
    internal_waste: float | None
    internal_waste_bytes: int | None
    unservable_share: float
    baselines: tuple[Baseline, ...]


@dataclass(frozen=True, slots=True)
class Requirements:
    """What a machine needs to serve the plan, as the server can check it there (runtime.bundle_checks): never the
    build machine's own tags (a plan built with torch 2.13.0+cpu serves on 2.13.x+cu130)."""

    torch: str  # major.minor of the torch the step was traced with ("2.13"): another may trace another graph
    triton: str | None  # major.minor of triton for a CUDA plan (its kernels are Triton's); None for a CPU plan
    compute_capability: tuple[int, ...] | None  # (major, minor) of target.gpu (runtime.devices.GPU_KINDS); None:
                                                # any (a CPU plan, or a CUDA plan given target.memory alone)
    device_memory_bytes: int  # bytes the device must report (torch.cuda.get_device_properties().total_memory):
                              # the plan's planned bytes and its reserve; 0 for a CPU plan


@dataclass(frozen=True, slots=True)
class TargetSection:
    device: str
    gpu: str | None
    memory_bytes: int
    reserve_bytes: int
    requires: Requirements


@dataclass(frozen=True, slots=True)
class Plan:
    schema: str
    version: int
    name: str
    servable: bool  # false for a plan made without weights
    spec: dict  # the serving spec with every default written out (compiler.spec.spec_to_dict), plain data
    fingerprints: Fingerprints
    engine: EngineSection
    model: ModelSummary
    target: TargetSection
    weights: WeightArena
    kv: KVArena
    activations: ActivationArena
    staging: Staging
    totals: Totals
    capacity: Capacity
    parallel: ParallelSection

    def activation_offsets(self) -> dict[int, dict[str, int]]:
        """bucket tokens -> traced node name -> byte offset in the activation arena (runtime.executor.ActivationPlan
        takes this with `activations.arena_bytes`)."""
        return {b.tokens: {t.name: t.offset for t in b.tensors} for b in self.activations.buckets}

    def declared_prefixes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(name, token ids) per declared prefix, in arena order (runtime.engine.EngineConfig.prefixes)."""
        return tuple((p.name, p.token_ids) for p in self.kv.prefixes)

    def slab_classes(self) -> tuple[tuple[int, int], ...]:
        """(tokens, count) per slab class, in arena order (runtime.slab_allocator.SlabClass's fields)."""
        return tuple((c.tokens, c.count) for c in self.kv.classes)


_SIGNED = {("Totals", "headroom_bytes"), ("RankPlan", "headroom_bytes")}  # the only ints allowed below zero


# ---------------------------------------------------------------------------------------------------------------
# Encoding


def plan_to_data(plan: Plan) -> dict[str, Any]:
    """Plain data (dicts with sorted keys, lists, str, int, float, bool, None) in the schema's shape."""
    return _to_data(plan)


def _to_data(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _to_data(getattr(value, f.name)) for f in sorted(fields(value), key=lambda f: f.name)}
    if isinstance(value, dict):
        return {str(k): _to_data(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_to_data(v) for v in value]
    return value


def encode_plan(plan: Plan) -> bytes:
    """The canonical bytes of `plan` (checked first: an inconsistent plan is never written)."""
    check_plan(plan)
    return _pack(plan_to_data(plan))


def _pack(data: Any) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def plan_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_fingerprint(config: Any) -> str:
    """sha256 of a model config (runtime.config.ModelConfig, a dataclass) as canonical msgpack: the plan's
    `fingerprints.model_config`, computed the same way by the compiler and by the server that checks it."""
    return hashlib.sha256(_pack(_to_data(config))).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_plan(directory: str | Path) -> Plan:
    """The plan of the bundle `directory`, or `PlanFormatError`. Reads at most MAX_PLAN_BYTES."""
    return read_plan_and_id(directory)[0]


def read_plan_and_id(directory: str | Path) -> tuple[Plan, str]:
    """The plan of the bundle `directory` and its id (sha256 of the bytes it was decoded from), from one read."""
    path = Path(directory) / PLAN_FILE
    try:
        size = path.stat().st_size
        if size > MAX_PLAN_BYTES:
            raise PlanFormatError(f"{path}: {size} bytes, above the limit of {MAX_PLAN_BYTES}; not a plan")
        with open(path, "rb") as fh:
            data = fh.read(MAX_PLAN_BYTES + 1)
    except FileNotFoundError:
        raise PlanFormatError(f"{path}: no such file; a plan bundle is a directory written by build-plan") from None
    except OSError as err:
        raise PlanFormatError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        return decode_plan(data), plan_id(data)
    except PlanFormatError as err:
        raise PlanFormatError(f"{path}: {err}") from None


def decode_plan(data: bytes) -> Plan:
    """Bytes -> a checked `Plan`, or `PlanFormatError`."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_PLAN_BYTES:
        raise PlanFormatError("not plan bytes, or above the size limit")
    raw = _unpack(bytes(data))
    if not isinstance(raw, dict):
        raise PlanFormatError(f"expected a map at the top; got {type(raw).__name__} (truncated or not a plan?)")
    schema, version = raw.get("schema"), raw.get("version")
    if schema != SCHEMA:
        raise PlanFormatError(f"schema {schema!r} is not {SCHEMA!r}; not a slabserve plan")
    if version != SCHEMA_VERSION:
        raise PlanFormatError(f"schema version {version!r} is not supported; this runtime reads version "
                              f"{SCHEMA_VERSION}: rebuild the plan with the matching build-plan")
    plan = _from_data(Plan, raw, "")
    check_plan(plan)
    if _pack(plan_to_data(plan)) != bytes(data):
        raise PlanFormatError("the bytes are not in canonical form (keys out of order or re-encoded); the plan id "
                              "would not match: rebuild it with build-plan")
    return plan


def _unpack(data: bytes) -> Any:
    def no_ext(code: int, _payload: bytes) -> Any:
        raise PlanFormatError(f"msgpack extension type {code} is not allowed in a plan")

    try:
        return msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, ext_hook=no_ext,
            max_str_len=_MAX_STR, max_bin_len=0, max_array_len=_MAX_ITEMS, max_map_len=4096, max_ext_len=0)
    except PlanFormatError:
        raise
    except msgpack.ExtraData:
        raise PlanFormatError("extra bytes after the plan (two files concatenated?)") from None
    except (ValueError, msgpack.UnpackException, RecursionError, OverflowError) as err:
        kind = "truncated" if "incomplete" in str(err).lower() or not str(err) else "corrupt"
        raise PlanFormatError(f"not valid msgpack ({kind}: {type(err).__name__}: {err})") from None


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, Any], list[str]]:
    """A plan dataclass's resolved type hints and field names (resolving hints per map read cost 0.4 s a plan)."""
    return typing.get_type_hints(cls), [f.name for f in fields(cls)]


def _from_data(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise PlanFormatError(f"{path or 'plan'}: expected a map for {cls.__name__}; got {_kind(raw)}")
    hints, names = _fields_of(cls)
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise PlanFormatError(f"{_join(path, unknown[0])}: unknown field; {cls.__name__} has {', '.join(names)}")
    values = {}
    for name in names:
        where = _join(path, name)
        if name not in raw:
            raise PlanFormatError(f"{where}: missing")
        values[name] = _value(hints[name], raw[name], where, signed=(cls.__name__, name) in _SIGNED)
    return cls(**values)


def _value(hint: Any, raw: Any, path: str, signed: bool = False) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, raw, path, signed)
    if origin is tuple:
        if not isinstance(raw, list):
            raise PlanFormatError(f"{path}: expected a list; got {_kind(raw)}")
        return tuple(_value(args[0], item, f"{path}[{i}]") for i, item in enumerate(raw))
    if is_dataclass(hint):
        return _from_data(hint, raw, path)
    if hint is dict:
        _check_plain(raw, path, 0)
        if not isinstance(raw, dict):
            raise PlanFormatError(f"{path}: expected a map; got {_kind(raw)}")
        return raw
    if hint is bool:
        if not isinstance(raw, bool):
            raise PlanFormatError(f"{path}: expected true or false; got {_kind(raw)}")
        return raw
    if hint is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise PlanFormatError(f"{path}: expected an integer; got {_kind(raw)}")
        if not (-MAX_INT if signed else 0) <= raw <= MAX_INT:
            raise PlanFormatError(f"{path}: {raw} is out of range (0 .. 2**62)")
        return raw
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw < 0:
            raise PlanFormatError(f"{path}: expected a finite number >= 0; got {_kind(raw)}")
        return raw
    if hint is str:
        if not isinstance(raw, str):
            raise PlanFormatError(f"{path}: expected a string; got {_kind(raw)}")
        return raw
    raise PlanFormatError(f"{path}: no reader for {hint!r}")  # a schema bug, not bad input


def _check_plain(raw: Any, path: str, depth: int) -> None:
    if depth > _MAX_SPEC_DEPTH:
        raise PlanFormatError(f"{path}: nested deeper than {_MAX_SPEC_DEPTH}")
    if isinstance(raw, dict):
        for key, value in raw.items():
            _check_plain(value, _join(path, key), depth + 1)
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            _check_plain(value, f"{path}[{i}]", depth + 1)
    elif isinstance(raw, float) and not math.isfinite(raw):
        raise PlanFormatError(f"{path}: {raw} is not a finite number")
    elif raw is not None and not isinstance(raw, (str, int, float, bool)):
        raise PlanFormatError(f"{path}: {_kind(raw)} is not plain data")


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _kind(raw: Any) -> str:
    if raw is None:
        return "nothing (nil)"
    text = repr(raw)
    return f"{type(raw).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# ---------------------------------------------------------------------------------------------------------------
# Consistency. Run on every plan written and every plan read.


def check_plan(plan: Plan) -> None:
    """Raise `PlanFormatError` unless the plan's parts are consistent with each other and with their arenas."""
    if plan.schema != SCHEMA or plan.version != SCHEMA_VERSION:
        raise PlanFormatError(f"schema {plan.schema!r} version {plan.version} is not {SCHEMA!r} {SCHEMA_VERSION}")
    _check_engine(plan.engine, plan.servable)
    _check_requirements(plan)
    _check_weights(plan.weights)
    _check_kv(plan.kv, plan.model, plan.engine, plan.parallel.tensor)
    _check_activations(plan.activations, plan.engine.buckets)
    _check_totals(plan)
    _check_parallel(plan)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise PlanFormatError(message)


def _dtype_size(dtype: str, path: str) -> int:
    _need(dtype in DTYPE_SIZES, f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    return DTYPE_SIZES[dtype]


def _nbytes(shape: tuple[int, ...], dtype: str, path: str) -> int:
    size = _dtype_size(dtype, path + ".dtype")
    total = size
    for dim in shape:
        total *= dim
        _need(total <= MAX_INT, f"{path}.shape: {list(shape)} overflows")
    return total


def _check_requirements(plan: Plan) -> None:
    r, cuda = plan.target.requires, plan.target.device == "cuda"
    _need(r.torch == ".".join(plan.fingerprints.torch.split("+")[0].split(".")[:2]),
          f"target.requires.torch: {r.torch!r} is not the major.minor of fingerprints.torch")
    _need(cuda or (r.triton is None and r.compute_capability is None and r.device_memory_bytes == 0),
          "target.requires: a CPU plan requires no triton, compute capability or device memory")
    _need(r.compute_capability is None or len(r.compute_capability) == 2,
          "target.requires.compute_capability: expected (major, minor)")
    _need(not cuda or r.device_memory_bytes == plan.totals.planned_bytes + plan.totals.reserve_bytes,
          "target.requires.device_memory_bytes: not the plan's planned bytes and reserve")


def _check_engine(e: EngineSection, servable: bool) -> None:
    _need(e.model_format in ("gguf", "hf", "config"), f"engine.model_format: {e.model_format!r} is not gguf, hf "
                                                       f"or config")
    _need(not (servable and e.model_format == "config"), "servable: a plan made from a config alone is not servable")
    _need(e.device in ("cpu", "cuda"), f"engine.device: {e.device!r} is not cpu or cuda")
    _dtype_size(e.dtype, "engine.dtype")
    _dtype_size(e.kv_dtype, "engine.kv_dtype")
    _need(e.max_seqs >= 1 and e.step_tokens >= e.max_seqs, "engine: need 1 <= max_seqs <= step_tokens")
    _need(bool(e.buckets) and all(b >= 1 for b in e.buckets), "engine.buckets: expected positive token counts")
    _need(all(a < b for a, b in zip(e.buckets, e.buckets[1:])), "engine.buckets: not strictly ascending")
    _need(e.buckets[-1] == e.step_tokens, f"engine.buckets: the last bucket {e.buckets[-1]} is not step_tokens "
                                          f"({e.step_tokens})")
    _need(e.queue_limit >= 1 and e.rope_positions >= 1, "engine: queue_limit and rope_positions must be >= 1")
    _need(e.max_queue_delay_ms is None or 1 <= e.max_queue_delay_ms <= MAX_QUEUE_DELAY_MS,
          f"engine.max_queue_delay_ms: expected null or 1 to {MAX_QUEUE_DELAY_MS}")
    _need(e.gemm in GEMMS, f"engine.gemm: {e.gemm!r} is not one of {', '.join(GEMMS)}")
    _need(e.gemm != "native" or (e.device == "cpu" and e.dtype == "float32"),
          f"engine.gemm: native needs device cpu and dtype float32, not {e.device} {e.dtype}")
    _need(e.weight_format in WEIGHT_FORMATS, f"engine.weight_format: {e.weight_format!r} is not one of "
                                             f"{', '.join(WEIGHT_FORMATS)}")
    _need(e.weight_format == "float" or e.gemm == "native",
          f"engine.weight_format: {e.weight_format} needs gemm native (the CPU kernels that read the blocks)")


def _check_weights(w: WeightArena) -> None:
    _need(w.alignment >= 1, "weights.alignment: must be >= 1")
    end = 0
    for i, entry in enumerate(w.entries):
        where = f"weights.entries[{i}] ({entry.name})"
        _need(entry.nbytes == _nbytes(entry.shape, entry.dtype, where),
              f"{where}.nbytes: {entry.nbytes} is not prod(shape) * dtype size")
        _need(entry.block_type is None or (entry.dtype == "uint8" and len(entry.shape) == 2),
              f"{where}.block_type: {entry.block_type} blocks are held as (rows, row_bytes) uint8")
        _need(entry.offset % w.alignment == 0, f"{where}.offset: {entry.offset} is not aligned to {w.alignment}")
        _need(entry.offset >= end, f"{where}.offset: {entry.offset} overlaps the entry before (which ends at {end})")
        end = entry.offset + entry.nbytes
        _need(end <= w.arena_bytes, f"{where}: bytes [{entry.offset}, {end}) run past the weight arena "
                                    f"({w.arena_bytes} bytes)")
    _need(len({e.name for e in w.entries}) == len(w.entries), "weights.entries: a name appears twice")
    _need(w.parameter_bytes <= w.arena_bytes, "weights.parameter_bytes: above the arena")


def _check_kv(kv: KVArena, model: ModelSummary, engine: EngineSection, degree: int = 1) -> None:
    _need(degree >= 1 and model.num_kv_heads % degree == 0,
          f"parallel.tensor: {degree} does not divide the model's {model.num_kv_heads} KV heads")
    _need((kv.num_layers, kv.num_kv_heads, kv.head_dim) == (model.num_layers, model.num_kv_heads // degree,
                                                            model.head_dim),
          "kv: (L, Hkv, D) does not match the model (Hkv: a rank's share of the KV heads)")
    _need(kv.dtype == engine.kv_dtype, f"kv.dtype: {kv.dtype!r} is not engine.kv_dtype ({engine.kv_dtype!r})")
    size = _dtype_size(kv.dtype, "kv.dtype")
    _need(kv.bytes_per_token == 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * size,
          "kv.bytes_per_token: is not 2 * L * Hkv * D * dtype size")
    one = _nbytes((kv.num_layers, kv.rows, kv.num_kv_heads, kv.head_dim), kv.dtype, "kv")
    _need(kv.k_bytes == one and kv.v_bytes == one, f"kv.k_bytes/v_bytes: expected {one} each for (L, N, Hkv, D)")
    _need(kv.arena_bytes == 2 * one, f"kv.arena_bytes: expected {2 * one}")
    _need(bool(kv.classes), "kv.classes: no slab classes")
    row = 0
    for i, c in enumerate(kv.classes):
        where = f"kv.classes[{i}]"
        _need(c.tokens >= 1 and c.count >= 1, f"{where}: tokens and count must be >= 1")
        _need(i == 0 or c.tokens > kv.classes[i - 1].tokens, f"{where}.tokens: not above the class before")
        _need(c.row_offset == row, f"{where}.row_offset: {c.row_offset}, expected {row} (classes lie back to back)")
        _need(c.share <= 1.0 + 1e-9, f"{where}.share: {c.share} is above 1")
        row += c.tokens * c.count
        _need(row <= kv.rows, f"{where}: slabs end at row {row}, outside the KV arena ({kv.rows} rows)")
    _need(not kv.prefixes or engine.prefix_reuse, "kv.prefixes: declared prefixes need engine.prefix_reuse")
    _need(len({p.name for p in kv.prefixes}) == len(kv.prefixes), "kv.prefixes: a name appears twice")
    for i, p in enumerate(kv.prefixes):
        where = f"kv.prefixes[{i}] ({p.name})"
        _need(len(p.token_ids) >= 1, f"{where}.token_ids: empty")
        _need(p.row_offset == row, f"{where}.row_offset: {p.row_offset}, expected {row} (after the slabs and the "
                                   f"prefixes before it)")
        _need(p.kv_bytes == len(p.token_ids) * kv.bytes_per_token, f"{where}.kv_bytes: is not tokens * "
                                                                    f"bytes_per_token")
        row += len(p.token_ids)
    _need(kv.rows == round_up(row, KV_TILE),
          f"kv.rows: {kv.rows}, but the slabs and declared prefixes end at row {row} (rounded up to a multiple of "
          f"{KV_TILE}: {round_up(row, KV_TILE)})")
    _need(sum(c.count for c in kv.classes) <= engine.max_seqs, "kv.classes: more slabs than max_seqs")


def _check_activations(a: ActivationArena, buckets: tuple[int, ...]) -> None:
    _need(a.alignment >= 1, "activations.alignment: must be >= 1")
    _need(tuple(b.tokens for b in a.buckets) == buckets,
          f"activations.buckets: tokens {[b.tokens for b in a.buckets]} are not engine.buckets {list(buckets)}")
    for i, bucket in enumerate(a.buckets):
        where = f"activations.buckets[{i}]"
        _need(bucket.arena_bytes <= a.arena_bytes, f"{where}.arena_bytes: above the shared arena")
        names = [t.name for t in bucket.tensors]
        _need(len(set(names)) == len(names), f"{where}.tensors: a name appears twice")
        for j, t in enumerate(bucket.tensors):
            tw = f"{where}.tensors[{j}] ({t.name})"
            _nbytes(t.shape, t.dtype, tw)  # a known dtype, no overflow; nbytes is the span of the traced strides
            _need(t.offset % a.alignment == 0, f"{tw}.offset: {t.offset} is not aligned to {a.alignment}")
            _need(t.offset + t.nbytes <= bucket.arena_bytes, f"{tw}: bytes [{t.offset}, {t.offset + t.nbytes}) "
                                                             f"run past the bucket's arena ({bucket.arena_bytes})")
            _need(t.first_use <= t.last_use, f"{tw}: first_use after last_use")
        _check_no_overlap(bucket.tensors, where)
    _need(a.arena_bytes == max((b.arena_bytes for b in a.buckets), default=0),
          "activations.arena_bytes: is not the largest bucket's arena")


def _check_no_overlap(tensors: tuple[ActivationEntry, ...], where: str) -> None:
    """Sweep by offset: tensors alive at the same op must not share a byte."""
    ranges = sorted((t for t in tensors if t.nbytes), key=lambda t: (t.offset, t.name))
    open_: list[ActivationEntry] = []
    for t in ranges:
        open_ = [o for o in open_ if o.offset + o.nbytes > t.offset]
        for o in open_:
            _need(not (o.first_use <= t.last_use and t.first_use <= o.last_use),
                  f"{where}: tensors {o.name!r} and {t.name!r} share bytes while both alive")
        open_.append(t)


def _check_totals(plan: Plan) -> None:
    t = plan.totals
    _need(t.weights_bytes == plan.weights.arena_bytes, "totals.weights_bytes: is not weights.arena_bytes")
    _need(t.kv_bytes == plan.kv.arena_bytes, "totals.kv_bytes: is not kv.arena_bytes")
    _need(t.activations_bytes == plan.activations.arena_bytes, "totals.activations_bytes: is not the arena's")
    _need(plan.staging.total_bytes == plan.staging.step_inputs_bytes + plan.staging.sampler_bytes
          + plan.staging.collective_bytes, "staging.total_bytes: does not add up")
    _need(t.staging_bytes == plan.staging.total_bytes, "totals.staging_bytes: is not staging.total_bytes")
    _need(t.planned_bytes == t.weights_bytes + t.kv_bytes + t.activations_bytes + t.staging_bytes,
          "totals.planned_bytes: does not add up")
    _need(t.target_bytes == plan.target.memory_bytes and t.reserve_bytes == plan.target.reserve_bytes,
          "totals: target or reserve differ from the target section")
    _need(t.headroom_bytes == t.target_bytes - t.reserve_bytes - t.planned_bytes, "totals.headroom_bytes: wrong")
    _need(t.fits == (t.headroom_bytes >= 0), "totals.fits: disagrees with the headroom")
    _need(plan.capacity.max_request_tokens == plan.kv.classes[-1].tokens,
          "capacity.max_request_tokens: is not the largest slab class")


def _check_parallel(plan: Plan) -> None:
    p, m, t = plan.parallel, plan.model, plan.totals
    _need(p.tensor >= 1, "parallel.tensor: must be >= 1")
    _need(len(p.ranks) == p.tensor, f"parallel.ranks: {len(p.ranks)} ranks for parallel.tensor {p.tensor}")
    _need(p.tensor > 1 or plan.staging.collective_bytes == 0, "staging.collective_bytes: a one-device plan has none")
    wholes = {"heads": m.num_heads, "kv_heads": m.num_kv_heads, "intermediate": m.intermediate_size}
    ends = dict.fromkeys(wholes, 0)
    for i, r in enumerate(p.ranks):
        where = f"parallel.ranks[{i}]"
        _need(r.rank == i, f"{where}.rank: {r.rank}, expected {i}")
        for key, whole in wholes.items():
            part = getattr(r, key)
            _need(len(part) == 2 and part[0] == ends[key] and part[1] - part[0] == whole // p.tensor,
                  f"{where}.{key}: {list(part)} is not rank {i}'s [start, stop) of {whole}")
            ends[key] = part[1]
        mine = (r.weights_bytes, r.parameter_bytes, r.kv_bytes, r.activations_bytes, r.staging_bytes,
                r.planned_bytes, r.headroom_bytes, r.fits)
        _need(mine == (t.weights_bytes, plan.weights.parameter_bytes, t.kv_bytes, t.activations_bytes,
                       t.staging_bytes, t.planned_bytes, t.headroom_bytes, t.fits),
              f"{where}: its bytes are not the plan's per-rank totals (every rank has the same layout)")
    _need(all(ends[k] == w for k, w in wholes.items()), "parallel.ranks: the slices do not cover the model")
