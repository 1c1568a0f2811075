"""Tracing the step at static shapes, and what the memory planner and the planned executor read from the trace.

Contract: `export_step(step, T, S, kv_rows)` exports `LlamaStep.forward` for one token bucket with
`torch.export` under `no_grad`, in the non-functional IR: the `slabserve::*` ops stay single nodes that write into
their arguments (the KV caches are graph inputs written in place by `kv_write`), so every buffer a kernel writes is a
node of the graph. With a step built by `meta_step` (weights on the `meta` device) the same trace runs without
weights, which is how the compiler plans an 8B model on a laptop.

`activation_tensors(ep)` lists the intermediates that need storage (the outputs of compute ops and of `empty`-like
allocations), each alive from the node that creates it to the last node that reads it or any view of it (node
indices in graph order; the step's output lives to the end). `graph_fingerprint(ep)` hashes the op sequence with
every shape and dtype, so a plan made by the compiler can be checked against the graph the runtime traces at
start-up. `node_kind` is the one classification of nodes that the planner's view (this module) and the executor
(runtime/executor.py) share.
"""
from __future__ import annotations

import enum
import hashlib
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.export import ExportedProgram

import slabserve.kernels.ops  # noqa: F401  (registers torch.ops.slabserve.*)
from slabserve.kernels import contracts, cpu_native
from slabserve.runtime.config import ModelConfig
from slabserve.runtime.model import LlamaStep, empty_packed
from slabserve.runtime.step import logits_rows
from slabserve.runtime.units import round_up


class NodeKind(enum.Enum):
    PLACEHOLDER = "placeholder"  # weights, step inputs, KV caches: storage owned elsewhere
    VIEW = "view"                # aliases its first argument's storage (view, slice, select, t, permute, ...)
    INPLACE = "inplace"          # writes its first argument in place and returns it (add_, copy_, ...)
    ALLOC = "alloc"              # empty / empty_like / empty_strided / new_empty: planned storage, contents undefined
    ZEROS = "zeros"              # zeros / zeros_like / new_zeros: planned storage, zeroed every step
    COMPUTE = "compute"          # an aten op returning one new tensor: planned storage, run through its .out form
    CUSTOM = "custom"            # a slabserve:: op: writes into its arguments, returns nothing
    OUTPUT = "output"
    UNSUPPORTED = "unsupported"


_ALLOC_OPS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
              torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default}
_ZEROS_OPS = {torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default}
_STORAGE_KINDS = (NodeKind.ALLOC, NodeKind.ZEROS, NodeKind.COMPUTE)


@dataclass(frozen=True, slots=True)
class ActivationTensor:
    """One intermediate that needs storage: alive from node `first_use` through node `last_use` (inclusive)."""

    name: str                 # the node's name, stable across traces of the same step
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int               # bytes its strides span (the traced strides are the ones the executor binds)
    first_use: int
    last_use: int


def node_kind(node: fx.Node) -> NodeKind:
    if node.op == "placeholder":
        return NodeKind.PLACEHOLDER
    if node.op == "output":
        return NodeKind.OUTPUT
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return NodeKind.UNSUPPORTED
    if target.namespace == "slabserve":
        return NodeKind.CUSTOM
    if target.namespace != "aten":
        return NodeKind.UNSUPPORTED
    if target in _ALLOC_OPS:
        return NodeKind.ALLOC
    if target in _ZEROS_OPS:
        return NodeKind.ZEROS
    returns = target._schema.returns
    if len(returns) != 1 or str(returns[0].type) != "Tensor":
        return NodeKind.UNSUPPORTED
    alias = returns[0].alias_info
    if alias is None:
        return NodeKind.COMPUTE
    return NodeKind.INPLACE if alias.is_write else NodeKind.VIEW


# ---------------------------------------------------------------------------------------------------- export


def meta_step(config: ModelConfig, dtype: torch.dtype = torch.float32, rope_positions: int | None = None,
              gemm: str = "aten", blocks: dict[str, str] | None = None) -> LlamaStep:
    """The step module with every weight (and the rope table) on the `meta` device: traceable, holds no memory."""
    with torch.device("meta"):
        return LlamaStep(config, empty_packed(config, dtype, gemm, blocks), rope_positions, gemm=gemm, blocks=blocks)


def k_cache_tiled(config: ModelConfig, device_type: str, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether a step on `device_type` keeps its K cache in tiles (kernels.contracts.KV_TILE): on CPU, where its
    slab_attention takes the native kernel, which reads K only so. Elsewhere (CUDA's Triton kernels, the CPU
    reference) K is rows, like V."""
    return device_type == "cpu" and cpu_native.attention_runs_natively(dtype, kv_dtype, config.num_heads,
                                                                       config.num_kv_heads, config.head_dim)


def kv_rows_for(tokens: int) -> int:
    """Rows of a KV arena whose slabs and declared prefixes take `tokens` rows: a whole number of K tiles, so that a
    tiled K cache and the row caches hold the same rows (at most KV_TILE - 1 of them unused)."""
    return round_up(tokens, contracts.KV_TILE)


def step_example_inputs(config: ModelConfig, num_tokens: int, max_seqs: int, kv_rows: int,
                        dtype: torch.dtype, device: torch.device | str = "cpu",
                        k_tiled: bool = False) -> dict[str, torch.Tensor]:
    """Inputs of the step's signature at one bucket's shapes (padding values), for tracing; `dtype` is the KV
    caches' (the plan's kv_dtype); `k_tiled`: the K cache in tiles (k_cache_tiled), kv_rows rounded up to them."""
    c = config
    def z(n: int, dt: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dt, device=device)
    if k_tiled:
        kv_rows = kv_rows_for(kv_rows)
    kv = (c.num_layers, kv_rows, c.num_kv_heads, c.head_dim)
    return {"input_ids": z(num_tokens, torch.int64), "positions": z(num_tokens, torch.int64),
            "slot_mapping": torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            "query_start": z(max_seqs + 1, torch.int32), "slab_offset": z(max_seqs, torch.int64),
            "context_len": z(max_seqs, torch.int32), "logits_indices": z(logits_rows(num_tokens, max_seqs), torch.int64),
            "k_cache": torch.zeros(contracts.k_cache_shape(kv, k_tiled), dtype=dtype, device=device),
            "v_cache": torch.zeros(kv, dtype=dtype, device=device)}


def export_step(step_module: LlamaStep, num_tokens: int, max_seqs: int, kv_rows: int,
                device: torch.device | str = "cpu",
                kv_caches: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_dtype: torch.dtype | None = None, k_tiled: bool = False) -> ExportedProgram:
    """Export the step for a bucket of `num_tokens` tokens and `max_seqs` sequences over `kv_rows` KV rows.

    Weights stay where the module has them (a meta step traces on `meta` inputs whatever `device` says).
    `kv_caches`: the engine's own KV arena, used as the example caches so that tracing allocates no second one
    (the exported program keeps its example inputs alive). `kv_dtype`: the example caches' dtype when none are
    given (default: the weights'). `k_tiled`: the example K cache in tiles (k_cache_tiled), when none is given."""
    weight = step_module.weight("embed")
    if weight.device.type == "meta":
        device = "meta"
    kv_rows_here = 0 if kv_caches is not None else kv_rows
    inputs = step_example_inputs(step_module.config, num_tokens, max_seqs, kv_rows_here, kv_dtype or weight.dtype,
                                 device, k_tiled)
    if kv_caches is not None:
        inputs["k_cache"], inputs["v_cache"] = kv_caches
    with torch.no_grad():
        return torch.export.export(step_module, (), inputs, strict=False)


# ---------------------------------------------------------------------------------------------------- analysis


def tensor_nbytes(val: torch.Tensor) -> int:
    """Bytes spanned by a tensor's (non-negative) strides: what a buffer bound with those strides needs."""
    if val.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride()))
    return span * val.element_size()


def storage_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node | None]:
    """For each tensor-valued node, the node whose storage it lives in (None: storage owned outside the graph)."""
    roots: dict[fx.Node, fx.Node | None] = {}
    for node in graph.nodes:
        kind = node_kind(node)
        if kind in _STORAGE_KINDS:
            roots[node] = node
        elif kind in (NodeKind.VIEW, NodeKind.INPLACE):
            base = node.args[0]
            roots[node] = roots.get(base) if isinstance(base, fx.Node) else None
        else:
            roots[node] = None
    return roots


def activation_tensors(ep: ExportedProgram) -> list[ActivationTensor]:
    """The intermediates of `ep` that need storage, in graph order, with their lifetimes in node indices.

    A tensor is alive from its creating node to the last node that reads it or any view of it (a view keeps its
    base's bytes alive); the graph's output is alive through the output node, where the caller takes it."""
    nodes = list(ep.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    roots = storage_roots(ep.graph)
    last = {node: index[node] for node in nodes if roots.get(node) is node}
    for node in nodes:
        for used in node.all_input_nodes:
            root = roots.get(used)
            if root is not None:
                last[root] = max(last[root], index[node])
    result = []
    for node in nodes:
        if roots.get(node) is not node:
            continue
        val = node.meta["val"]
        result.append(ActivationTensor(node.name, tuple(int(s) for s in val.shape), val.dtype, tensor_nbytes(val),
                                       index[node], last[node]))
    return result


def graph_fingerprint(ep: ExportedProgram) -> str:
    """sha256 over the op sequence: each node's op, target, arguments (nodes by index) and output shape/dtype.

    Devices are left out (a `meta` trace and a CPU trace of the same step agree); the torch version is checked
    elsewhere, since another version may trace the same model into a different graph."""
    nodes = list(ep.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    h = hashlib.sha256()
    for node in nodes:
        args = fx.node.map_arg(node.args, lambda n: f"%{index[n]}")
        kwargs = {k: fx.node.map_arg(v, lambda n: f"%{index[n]}") for k, v in node.kwargs.items() if k != "device"}
        h.update(f"{node.op}|{_target_name(node)}|{args!r}|{sorted(kwargs.items())!r}|{_val_sig(node)}\n".encode())
    return h.hexdigest()


def _target_name(node: fx.Node) -> str:
    if node.op == "placeholder":
        return node.name
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target)) if node.target is not operator.getitem else "getitem"


def _val_sig(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{tuple(int(s) for s in val.shape)}:{tuple(int(s) for s in val.stride())}:{val.dtype}"
    return "-"
