"""The traced step of one bucket as an ONNX model, for people and tools to inspect (Netron, onnx.checker).

Contract: `step_to_onnx(program)` turns the `torch.export` graph that compiler.tracing made (non-functional IR,
meta weights) into an `onnx.ModelProto` that passes `onnx.checker.check_model`. It is an inspection artifact, not
something slabserve runs, and it holds no weights: every weight, step input and KV cache is a graph input with its
shape and dtype, so the file stays small and a bundle never carries the model.

Mapping: the aten ops the step uses become standard ONNX ops (MatMul, Add, Gather, Reshape, Slice,
ConstantOfShape); each `slabserve::` kernel op becomes one node in the custom `slabserve` domain whose outputs are
new values of the arguments it writes (ONNX is single-assignment: `rms_norm(x, w, out)` reads as
`out' = slabserve.rms_norm(x, w, out)`), and later reads of that argument use the new value. Aliasing through views
is not modelled (a write into a slice of a buffer does not create a new value of the whole buffer), which is enough
to read the step's dataflow. Any other aten op becomes a node of the `aten` domain named after the op, so an export
never fails on an op it does not know. The same graph gives the same bytes.
"""
from __future__ import annotations

from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

OPSET = 18
ONNX_DTYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
               torch.bfloat16: TensorProto.BFLOAT16, torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32,
               torch.bool: TensorProto.BOOL, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8}


class _Emitter:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.current: dict[str, str] = {}  # fx node name -> ONNX value holding its latest contents
        self.versions: dict[str, int] = {}
        self._consts = 0

    def value(self, arg: Any) -> str:
        return self.current[arg.name]

    def const(self, values: list[int] | int, scalar: bool = False) -> str:
        name = f"const_{self._consts}"
        self._consts += 1
        dims = [] if scalar else [len(values)]
        vals = [values] if scalar else list(values)
        self.initializers.append(helper.make_tensor(name, TensorProto.INT64, dims, vals))
        return name

    def new_version(self, fx_name: str) -> str:
        self.versions[fx_name] = self.versions.get(fx_name, 0) + 1
        name = f"{fx_name}__v{self.versions[fx_name]}"
        self.current[fx_name] = name
        return name

    def emit(self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs) -> None:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))


def step_to_onnx(program: torch.export.ExportedProgram, graph_name: str = "slabserve_step") -> onnx.ModelProto:
    e = _Emitter()
    inputs, outputs = [], []
    for node in program.graph.nodes:
        if node.op == "placeholder":
            e.current[node.name] = node.name
            inputs.append(_value_info(node.name, node.meta["val"]))
        elif node.op == "output":
            for i, out in enumerate(_flat(node.args[0])):
                name = f"output_{i}"
                e.emit("Identity", [e.value(out)], [name], name=f"{name}_identity")
                outputs.append(_value_info(name, out.meta["val"]))
        else:
            _call(e, node)
    graph = helper.make_graph(e.nodes, graph_name, inputs, outputs, initializer=e.initializers)
    model = helper.make_model(graph, producer_name="slabserve", producer_version="1",
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("slabserve", 1),
                                             helper.make_opsetid("aten", 1)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _flat(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _value_info(name: str, val: torch.Tensor) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ONNX_DTYPES.get(val.dtype, TensorProto.UNDEFINED),
                                         [int(s) for s in val.shape])


def _call(e: _Emitter, node) -> None:
    target = node.target
    name = node.name
    op = str(target)
    out = [name]
    e.current[name] = name
    args = node.args
    if op == "aten.matmul.default":
        e.emit("MatMul", [e.value(args[0]), e.value(args[1])], out, name)
    elif op == "aten.add.Tensor" and node.kwargs.get("alpha", 1) == 1 and all(hasattr(a, "name") for a in args):
        e.emit("Add", [e.value(args[0]), e.value(args[1])], out, name)
    elif op == "aten.view.default":
        e.emit("Reshape", [e.value(args[0]), e.const([int(s) for s in args[1]])], out, name)
    elif op == "aten.slice.Tensor":
        dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
        size = int(args[0].meta["val"].shape[dim])
        start, end = start or 0, size if end is None else min(int(end), size)
        e.emit("Slice", [e.value(args[0]), e.const([start]), e.const([end]), e.const([dim]), e.const([step])], out,
               name)
    elif op == "aten.select.int":
        e.emit("Gather", [e.value(args[0]), e.const(int(args[2]), scalar=True)], out, name, axis=int(args[1]))
    elif op == "aten.index.Tensor" and len(args[1]) == 1 and args[1][0] is not None:
        e.emit("Gather", [e.value(args[0]), e.value(args[1][0])], out, name, axis=0)
    elif op in ("aten.empty.memory_format", "aten.empty_like.default", "aten.zeros.default",
                "aten.zeros_like.default"):
        val = node.meta["val"]
        zero = helper.make_tensor("value", ONNX_DTYPES.get(val.dtype, TensorProto.FLOAT), [1], [0])
        e.emit("ConstantOfShape", [e.const([int(s) for s in val.shape])], out, name, value=zero)
    elif getattr(target, "namespace", None) == "slabserve":
        _custom(e, node)
    else:
        _fallback(e, node)


def _custom(e: _Emitter, node) -> None:
    """A kernel op: tensor arguments in, new values of the arguments it writes out, scalars as attributes."""
    schema = node.target._schema
    inputs, outputs, attrs = [], [], {}
    written = []
    for arg_schema, arg in zip(schema.arguments, node.args):
        if hasattr(arg, "name"):
            inputs.append(e.value(arg))
            if arg_schema.alias_info is not None and arg_schema.alias_info.is_write:
                written.append(arg.name)
        elif isinstance(arg, (int, float)):
            attrs[arg_schema.name] = arg
    for fx_name in written:
        outputs.append(e.new_version(fx_name))
    e.emit(node.target._opname, inputs, outputs or [node.name], node.name, domain="slabserve", **attrs)


def _fallback(e: _Emitter, node) -> None:
    inputs = [e.value(a) for a in node.all_input_nodes]
    e.emit(str(node.target).replace(".", "_"), inputs, [node.name], node.name, domain="aten",
           torch_op=str(node.target), torch_args=repr(node.args)[:500])
