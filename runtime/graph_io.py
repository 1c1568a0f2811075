"""The traced step graphs of a plan bundle (`graphs.msgpack`): written by the compiler, read by the server instead of
tracing every bucket again at start-up.

Contract: the file is plain msgpack, no pickle, no code. Each node names its op as `namespace.op.overload`, and
only ops of the `aten` and `slabserve` namespaces that exist in this process are accepted (looked up attribute by
attribute on `torch.ops`, never evaluated). Arguments are node references, numbers, strings, booleans, None,
dtypes, devices and lists of these. The reader rebuilds an `fx.Graph` whose node values are meta tensors with the
traced shapes, strides and dtypes, binds the weights from the live step module by name, and then checks that the
rebuilt graph's `runtime.trace.graph_fingerprint` equals the plan's for that bucket and that every slabserve op's
schema is the one the graph was traced against: a stale or edited file is refused, never run.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
from torch import fx
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

GRAPHS_FILE = "graphs.msgpack"
FORMAT = "slabserve.graphs"
VERSION = 1
MAX_GRAPHS_BYTES = 64 << 20
_NAMESPACES = ("aten", "slabserve")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                       torch.int64, torch.int32, torch.int16, torch.int8,
                                                       torch.uint8, torch.bool)}


class GraphFormatError(ValueError):
    """graphs.msgpack is missing, corrupt, edited, or was written for other ops: rebuild the plan."""


@dataclass
class StoredProgram:
    """What the planned executor reads of an ExportedProgram: the graph, its signature and the weights."""

    graph: fx.Graph
    graph_signature: Any
    state_dict: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class _Signature:
    input_specs: list
    output_specs: list


# ---------------------------------------------------------------------------------------------------- writing


def programs_to_bytes(programs: Mapping[int, Any]) -> bytes:
    """Encode {bucket tokens: ExportedProgram} canonically (sorted keys, deterministic)."""
    data = {"format": FORMAT, "version": VERSION,
            "buckets": [{"tokens": int(b), **_program_data(ep)} for b, ep in sorted(programs.items())]}
    return msgpack.packb(data, use_bin_type=True)


def _program_data(ep) -> dict:
    inputs = [{"name": s.arg.name, "kind": "user" if s.kind == InputKind.USER_INPUT else "weight",
               "target": s.target or ""} for s in ep.graph_signature.input_specs]
    nodes, schemas = [], {}
    for node in ep.graph.nodes:
        entry = {"name": node.name, "op": node.op, "target": "", "args": _arg(node.args), "kwargs": {},
                 "val": _val(node)}
        if node.op == "call_function":
            entry["target"] = f"{node.target.namespace}.{node.target._opname}.{node.target._overloadname}"
            entry["kwargs"] = {k: _arg(v) for k, v in sorted(node.kwargs.items())}
            if node.target.namespace == "slabserve":
                schemas[entry["target"]] = str(node.target._schema)
        nodes.append(entry)
    return {"inputs": inputs, "nodes": nodes, "schemas": dict(sorted(schemas.items()))}


def _arg(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, tuple):
        return {"tuple": [_arg(v) for v in value]}
    if isinstance(value, list):
        return [_arg(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"enum": str(value).removeprefix("torch.")}
    raise TypeError(f"cannot store an argument of type {type(value).__name__} in {GRAPHS_FILE}")


def _val(node: fx.Node) -> dict | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return {"shape": [int(s) for s in val.shape], "stride": [int(s) for s in val.stride()],
            "dtype": str(val.dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------------------------------- reading


def read_programs(directory: str | Path, weights: Mapping[str, torch.Tensor]) -> dict[int, StoredProgram]:
    """The bundle's graphs rebuilt over `weights` (the step module's buffers by name), or GraphFormatError."""
    path = Path(directory) / GRAPHS_FILE
    try:
        if path.stat().st_size > MAX_GRAPHS_BYTES:
            raise GraphFormatError(f"{path}: larger than {MAX_GRAPHS_BYTES} bytes; not a graphs file")
        data = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except FileNotFoundError:
        raise GraphFormatError(f"{path}: no such file (plans built before graphs were stored: rebuild)") from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        raise GraphFormatError(f"{path}: not a valid graphs file ({err})") from None
    try:
        if data["format"] != FORMAT or data["version"] != VERSION:
            raise GraphFormatError(f"{path}: format {data['format']!r} version {data['version']!r}, this runtime "
                                   f"reads {FORMAT!r} version {VERSION}")
        return {int(b["tokens"]): _rebuild(b, weights) for b in data["buckets"]}
    except GraphFormatError as err:
        raise GraphFormatError(f"{path}: {err}") from None
    except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as err:
        raise GraphFormatError(f"{path}: malformed graph ({type(err).__name__}: {err})") from None


def _rebuild(data: dict, weights: Mapping[str, torch.Tensor]) -> StoredProgram:
    for target, schema in data["schemas"].items():
        if str(_op(target)._schema) != schema:
            raise GraphFormatError(f"op {target} changed since the plan was built ({schema} -> "
                                   f"{_op(target)._schema}); rebuild the plan")
    graph, env = fx.Graph(), {}
    for entry in data["nodes"]:
        env[entry["name"]] = _node(graph, entry, env)
    inputs, state = [], {}
    for spec in data["inputs"]:
        if spec["kind"] == "user":
            inputs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(spec["name"]), None))
        else:
            if spec["target"] not in weights:
                raise GraphFormatError(f"the graph reads weight {spec['target']!r}, which the model does not have")
            inputs.append(InputSpec(InputKind.BUFFER, TensorArgument(spec["name"]), spec["target"], True))
            state[spec["target"]] = weights[spec["target"]]
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(output.args[0][0].name), None)]
    return StoredProgram(graph, _Signature(inputs, outputs), state)


def _node(graph: fx.Graph, entry: dict, env: dict) -> fx.Node:
    name, op = entry["name"], entry["op"]
    if not _IDENT.match(name):
        raise GraphFormatError(f"bad node name {name!r}")
    if op == "placeholder":
        node = graph.create_node("placeholder", name, name=name)
    elif op == "output":
        node = graph.create_node("output", "output", _unarg(entry["args"], env), name=name)
    elif op == "call_function":
        node = graph.create_node("call_function", _op(entry["target"]), _unarg(entry["args"], env),
                                 {k: _unarg(v, env) for k, v in entry["kwargs"].items()}, name=name)
    else:
        raise GraphFormatError(f"node {name!r} has op {op!r}; only placeholder, call_function and output are stored")
    if node.name != name:
        raise GraphFormatError(f"node name {name!r} is not unique")
    val = entry["val"]
    if val is not None:
        node.meta["val"] = torch.empty_strided(val["shape"], val["stride"], dtype=_dtype(val["dtype"]), device="meta")
    return node


def _op(target: str):
    parts = target.split(".")
    if len(parts) != 3 or parts[0] not in _NAMESPACES or not all(_IDENT.match(p) for p in parts):
        raise GraphFormatError(f"op {target!r} is not an aten or slabserve op")
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise GraphFormatError(f"op {target!r} does not exist in this torch/slabserve") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise GraphFormatError(f"{target!r} is not an op overload")
    return op


def _unarg(value: Any, env: dict) -> Any:
    if isinstance(value, list):
        return [_unarg(v, env) for v in value]
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(_unarg(value["tuple"], env))
        if "node" in value:
            if value["node"] not in env:
                raise GraphFormatError(f"reference to node {value['node']!r} before it is defined")
            return env[value["node"]]
        if "dtype" in value:
            return _dtype(value["dtype"])
        if "device" in value:
            return torch.device(_choice(value["device"], ("cpu", "cuda", "meta")))
        if "enum" in value:
            return getattr(torch, _choice(value["enum"], ("strided", "contiguous_format", "preserve_format")))
        raise GraphFormatError(f"unknown argument {value!r}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise GraphFormatError(f"unknown argument of type {type(value).__name__}")


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise GraphFormatError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _choice(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise GraphFormatError(f"{value!r} is not one of {allowed}")
    return value
