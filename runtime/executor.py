"""The planned executor: each bucket's traced step run node by node with every intermediate at its planned offset.

Contract: `PlannedExecutor({bucket: (program, offsets)}, arena)` takes one activation arena (a flat uint8 tensor
allocated once, at the planned size, shared by all buckets since one step runs one bucket) and, per bucket, the
exported step (runtime.trace.export_step) and the byte offset of each of its activation tensors
(runtime.trace.activation_tensors) in the arena. Construction checks the offsets (every tensor placed, inside the
arena, aligned for its dtype, no two tensors alive at the same node sharing a byte: the runtime's own check, since
it cannot import the compiler's) and resolves every node, refusing with `PlanViolationError` (naming the node and
its op) anything it cannot run in place. `run(bucket, inputs, k_cache, v_cache)` then writes only into the arena
and the KV caches and returns the logits as a view of the arena, valid until the next `run`.

Per node kind (runtime.trace.NodeKind): placeholders bind to the program's weights or the caller's tensors; views
and in-place ops alias their base; `empty`-like allocations are their arena view; `zeros`-like ones are zeroed
each run; aten compute ops run through their `.out` overload into their arena view; `slabserve::` ops run as they
are (they write into their arguments). Views depend only on metadata, so all of them are computed once when a
bucket is first bound to a set of input tensors; a run with the same tensors only dispatches the write ops, and
each run of consecutive native CPU kernels among them as one foreign call (kernels.cpu_native.fuse_calls).

`allocations(fn, steps)` / `count_allocations` run a function under the profiler's memory events and report every
tensor storage created: the engine runs its warm-up under it and refuses to serve on any.

On CUDA, `CudaGraphRunner` captures one graph per bucket (largest first, one shared memory pool) over fixed
device staging buffers, and replays it after copying the step inputs into them.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.profiler
from torch import fx
from torch._C._profiler import _EventType
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from slabserve.kernels.cpu_native import fuse_calls
from slabserve.kernels.ops import CPU_PREPARE
from slabserve.runtime.trace import ActivationTensor, NodeKind, activation_tensors, node_kind

STEP_INPUTS = ("input_ids", "positions", "slot_mapping", "query_start", "slab_offset", "context_len",
               "logits_indices", "k_cache", "v_cache")


class PlanViolationError(RuntimeError):
    """The activation plan does not fit the traced step, or serving would create tensor storage."""


@dataclass(frozen=True, slots=True)
class ActivationPlan:
    """The activation arena of a plan: its size and, per bucket, the byte offset of each activation tensor."""

    arena_bytes: int
    offsets: Mapping[int, Mapping[str, int]]  # bucket -> node name (runtime.trace.activation_tensors) -> offset


# ---------------------------------------------------------------------------------------------------- plan checks


def check_offsets(tensors: list[ActivationTensor], offsets: Mapping[str, int], arena_bytes: int,
                  label: str = "") -> None:
    """Raise PlanViolationError unless every tensor has an offset, lies inside the arena, is aligned for its dtype,
    and shares no byte with a tensor alive at the same node (lifetimes inclusive; empty tensors take no bytes)."""
    where = f"bucket {label}: " if label else ""
    missing = [t.name for t in tensors if t.name not in offsets]
    if missing:
        raise PlanViolationError(f"{where}no planned offset for {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                                 f"({len(missing)} tensors): the plan was made for another graph; rebuild it")
    for t in tensors:
        off = offsets[t.name]
        itemsize = torch.empty((), dtype=t.dtype, device="meta").element_size()
        if off < 0 or off + t.nbytes > arena_bytes:
            raise PlanViolationError(f"{where}tensor {t.name!r} at bytes [{off}, {off + t.nbytes}) is outside the "
                                     f"activation arena of {arena_bytes} bytes")
        if off % itemsize:
            raise PlanViolationError(f"{where}tensor {t.name!r} at offset {off} is not aligned to its "
                                     f"{itemsize}-byte {t.dtype}")
    placed = sorted(((offsets[t.name], offsets[t.name] + t.nbytes, t) for t in tensors if t.nbytes),
                    key=lambda r: (r[0], r[1], r[2].name))
    open_ranges: list[tuple[int, ActivationTensor]] = []  # (end, tensor) of ranges that may reach the next start
    for start, end, t in placed:
        open_ranges = [(e, o) for e, o in open_ranges if e > start]
        for other_end, other in open_ranges:
            if other.first_use <= t.last_use and t.first_use <= other.last_use:
                raise PlanViolationError(
                    f"{where}tensors {other.name!r} (bytes [{offsets[other.name]}, {other_end}), nodes "
                    f"{other.first_use}..{other.last_use}) and {t.name!r} (bytes [{start}, {end}), nodes "
                    f"{t.first_use}..{t.last_use}) share bytes while both are alive")
        open_ranges.append((end, t))


def sequential_offsets(tensors: list[ActivationTensor], alignment: int = 64) -> tuple[dict[str, int], int]:
    """Every tensor its own aligned bytes, no reuse: (offsets, arena bytes). Obviously safe and wasteful; for an
    engine started without a compiled plan (the plan bundle carries the compiler's reusing layout)."""
    offsets, cursor = {}, 0
    for t in tensors:
        offsets[t.name] = cursor
        cursor += -(-t.nbytes // alignment) * alignment
    return offsets, cursor


# ---------------------------------------------------------------------------------------------------- one bucket


@dataclass(frozen=True, slots=True)
class _Call:
    """A node that writes memory at run time: fn(*args, **kwargs) with the node's arguments resolved at bind time."""

    fn: Callable
    args: tuple
    kwargs: dict


class _BucketProgram:
    """One bucket's graph resolved against the arena: per node, what it is and where its result lives."""

    def __init__(self, bucket: int, ep: ExportedProgram, offsets: Mapping[str, int], arena: torch.Tensor):
        self.bucket = bucket
        self.nodes = list(ep.graph.nodes)
        self.tensors = activation_tensors(ep)
        check_offsets(self.tensors, offsets, arena.numel(), str(bucket))
        self.consts: dict[str, torch.Tensor] = {}   # placeholder name -> weight
        self.user: dict[str, fx.Node] = {}          # step input name -> placeholder
        self._bind_signature(ep)
        # node name -> arena view with the traced shape and strides
        self.views = {t.name: _arena_view(arena, offsets[t.name], n.meta["val"])
                      for t, n in zip(self.tensors, (self._node(t.name) for t in self.tensors))}
        self.kinds = {node: node_kind(node) for node in self.nodes}
        self.out_ops: dict[fx.Node, torch._ops.OpOverload] = {}
        for node in self.nodes:
            self._resolve(node)
        self.bound_to: tuple | None = None
        self.calls: list[_Call] = []
        self.call_nodes: list[fx.Node] = []
        self._run_calls: list[Callable[[], object]] = []  # self.calls as argument-free callables
        self._fused_calls: list[Callable[[], object]] = []  # the same, each run of native kernels as one call
        self.result: torch.Tensor | None = None

    def _node(self, name: str) -> fx.Node:
        return next(n for n in self.nodes if n.name == name)

    def _bind_signature(self, ep: ExportedProgram) -> None:
        for spec in ep.graph_signature.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.USER_INPUT:
                if name not in STEP_INPUTS:
                    raise PlanViolationError(f"bucket {self.bucket}: unknown step input {name!r}")
                self.user[name] = next(n for n in self.nodes if n.name == name)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                source = ep.state_dict if spec.target in ep.state_dict else ep.constants
                self.consts[name] = source[spec.target]
            else:
                raise PlanViolationError(f"bucket {self.bucket}: input {name!r} of kind {spec.kind.name} is not "
                                         f"supported by the planned executor")
        outputs = ep.graph_signature.output_specs
        if len(outputs) != 1 or outputs[0].kind != OutputKind.USER_OUTPUT:
            raise PlanViolationError(f"bucket {self.bucket}: the step must return one tensor and mutate inputs only "
                                     f"in place, got outputs {[o.kind.name for o in outputs]}")

    def _resolve(self, node: fx.Node) -> None:
        kind = self.kinds[node]
        if kind == NodeKind.UNSUPPORTED:
            raise PlanViolationError(f"bucket {self.bucket}: node {node.name!r} ({node.op} {node.target}) cannot be "
                                     f"run by the planned executor: only aten ops and slabserve:: ops are supported")
        if kind == NodeKind.COMPUTE:
            out = out_overload(node.target)
            if out is None:
                raise PlanViolationError(f"bucket {self.bucket}: node {node.name!r} ({node.target}) has no .out "
                                         f"overload, so its result cannot be written into the arena; rewrite the "
                                         f"step to use an op that has one, or a slabserve:: op writing into a buffer")
            self.out_ops[node] = out
        if kind == NodeKind.VIEW and node.target == torch.ops.aten.reshape.default:
            base = node.args[0].meta["val"]
            if not base.is_contiguous():
                raise PlanViolationError(f"bucket {self.bucket}: node {node.name!r} reshapes a non-contiguous "
                                         f"tensor, which copies; make the step reshape contiguous tensors only")
        if kind == NodeKind.VIEW and not node.args:
            raise PlanViolationError(f"bucket {self.bucket}: view node {node.name!r} has no base")

    # -- binding: resolve every node against concrete input tensors, once per set of input tensors

    def bind(self, inputs: Mapping[str, torch.Tensor]) -> None:
        env: dict[fx.Node, Any] = {}
        calls: list[_Call] = []
        call_nodes: list[fx.Node] = []  # the node each call runs
        result = None
        for node in self.nodes:
            kind = self.kinds[node]
            if kind == NodeKind.PLACEHOLDER:
                env[node] = self.consts[node.name] if node.name in self.consts else self._user_input(node, inputs)
                continue
            if kind == NodeKind.OUTPUT:
                result = env[node.args[0][0]]
                continue
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = {k: fx.node.map_arg(v, lambda n: env[n]) for k, v in node.kwargs.items()}
            call_nodes.extend([node] * (kind in (NodeKind.INPLACE, NodeKind.ZEROS, NodeKind.COMPUTE,
                                                 NodeKind.CUSTOM)))
            if kind == NodeKind.VIEW:
                env[node] = node.target(*args, **kwargs)
            elif kind == NodeKind.INPLACE:
                calls.append(_Call(node.target, args, kwargs))
                env[node] = args[0]
            elif kind == NodeKind.ALLOC:
                env[node] = self.views[node.name]
            elif kind == NodeKind.ZEROS:
                env[node] = self.views[node.name]
                calls.append(_Call(torch.Tensor.zero_, (env[node],), {}))
            elif kind == NodeKind.COMPUTE:
                env[node] = self.views[node.name]
                calls.append(_Call(_direct_out_op(self.out_ops[node], args), args, {**kwargs, "out": env[node]}))
            else:  # CUSTOM
                calls.append(_prepared_call(node.target, args, kwargs))
                env[node] = None
        self.calls, self.result, self.call_nodes = calls, result, call_nodes
        self._run_calls = [partial(c.fn, *c.args, **c.kwargs) for c in calls]
        self._fused_calls = fuse_calls([c.fn if not (c.args or c.kwargs) else run
                                        for c, run in zip(calls, self._run_calls)])
        self.bound_to = tuple(inputs[name] for name in STEP_INPUTS)

    def _user_input(self, node: fx.Node, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        tensor, want = inputs[node.name], node.meta["val"]
        if tuple(tensor.shape) != tuple(want.shape) or tensor.dtype != want.dtype:
            raise ValueError(f"bucket {self.bucket}: input {node.name} is {tuple(tensor.shape)} {tensor.dtype}, the "
                             f"step was traced for {tuple(want.shape)} {want.dtype}")
        return tensor

    def run(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        bound = self.bound_to
        if bound is None or any(a is not b for a, b in zip(bound, (inputs[name] for name in STEP_INPUTS))):
            self.bind(inputs)
        for call in self._fused_calls:
            call()
        return self.result

    def run_naming_failures(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """`run`, raising PlanViolationError that names the node and op of a call that fails (graph capture)."""
        if self.bound_to is None or any(a is not b for a, b in zip(self.bound_to,
                                                                   (inputs[name] for name in STEP_INPUTS))):
            self.bind(inputs)
        for call, node in zip(self._run_calls, self.call_nodes):
            try:
                call()
            except Exception as exc:
                raise PlanViolationError(f"bucket {self.bucket}: node {node.name!r} ({node.target}) failed: "
                                         f"{type(exc).__name__}: {exc}") from exc
        return self.result


def _direct_out_op(op: torch._ops.OpOverload, args: tuple) -> Callable:
    """The callable that runs `op` (an .out overload) at bind time: its C++ entry point, skipping the Python
    frame of OpOverload.__call__; a 2-D by 2-D `matmul.out` goes straight to `mm.out` (what matmul would call)."""
    if (op == torch.ops.aten.matmul.out and len(args) == 2 and all(isinstance(a, torch.Tensor) and a.dim() == 2
                                                                     for a in args)):
        op = torch.ops.aten.mm.out
    return getattr(op, "_op", op)


def _prepared_call(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> _Call:
    """A slabserve:: op bound to its tensors. On CPU the op's reference is prepared here, once (contract checks,
    views: kernels.reference), and the call runs only its arithmetic; the prepared run and the op compute the
    same values bit for bit. Elsewhere (CUDA) the op itself is called."""
    name = op._schema.name.split("::", 1)[1]
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if name in CPU_PREPARE and tensors and all(t.device.type == "cpu" for t in tensors):
        return _Call(CPU_PREPARE[name](*args, **kwargs), (), {})
    return _Call(op, args, kwargs)


def _arena_view(arena: torch.Tensor, offset: int, val: torch.Tensor) -> torch.Tensor:
    """The bytes [offset, offset + nbytes) of the arena as a tensor with `val`'s dtype, shape and strides."""
    itemsize = val.element_size()
    numel = 0 if val.numel() == 0 else 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()))
    flat = arena[offset : offset + numel * itemsize].view(val.dtype)  # (numel,)
    return flat.as_strided(tuple(val.shape), tuple(val.stride()))


_OUT_CACHE: dict[torch._ops.OpOverload, torch._ops.OpOverload | None] = {}


def out_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of `op`'s packet that takes the same arguments plus one keyword `out` tensor it writes."""
    if op in _OUT_CACHE:
        return _OUT_CACHE[op]
    packet = op.overloadpacket
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    found = None
    for name in packet.overloads():
        candidate = getattr(packet, name)
        schema = candidate._schema
        outs = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only]
        rest = [(a.name, str(a.type)) for a in schema.arguments if a not in outs]
        if len(outs) == 1 and outs[0].name == "out" and rest == want:
            found = candidate
            break
    _OUT_CACHE[op] = found
    return found


# ---------------------------------------------------------------------------------------------------- executor


class PlannedExecutor:
    """Runs each bucket's step with its intermediates at their planned places in one shared arena."""

    def __init__(self, programs: Mapping[int, tuple[ExportedProgram, Mapping[str, int]]], arena: torch.Tensor):
        if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
            raise ValueError("the activation arena must be a flat contiguous uint8 tensor")
        self.arena = arena  # (arena_bytes,) uint8, allocated once by the caller
        self.buckets = {b: _BucketProgram(b, ep, offsets, arena) for b, (ep, offsets) in sorted(programs.items())}

    @classmethod
    def allocate(cls, programs: Mapping[int, ExportedProgram], plan: ActivationPlan,
                 device: torch.device | str = "cpu") -> PlannedExecutor:
        """Allocate the arena (once, at exactly the planned size) and build the executor over it."""
        missing = sorted(set(programs) - set(plan.offsets))
        if missing:
            raise PlanViolationError(f"the activation plan has no layout for buckets {missing}; rebuild the plan")
        # zero-filled, so every page is resident from the start: memory does not grow the first time a long
        # sequence reaches a part of the scratch that warm-up left untouched
        arena = torch.zeros(plan.arena_bytes, dtype=torch.uint8, device=device)  # (arena_bytes,)
        return cls({b: (ep, plan.offsets[b]) for b, ep in programs.items()}, arena)

    def run(self, bucket: int, inputs: Mapping[str, torch.Tensor], k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor:
        """One step of `bucket`: logits (R, V), a view of the arena valid until the next run."""
        return self.buckets[bucket].run({**inputs, "k_cache": k_cache, "v_cache": v_cache})

    def run_naming_failures(self, bucket: int, inputs: Mapping[str, torch.Tensor], k_cache: torch.Tensor,
                            v_cache: torch.Tensor) -> torch.Tensor:
        """`run`, where a failing call raises PlanViolationError naming its node and op."""
        return self.buckets[bucket].run_naming_failures({**inputs, "k_cache": k_cache, "v_cache": v_cache})


def plan_sequential(programs: Mapping[int, ExportedProgram], alignment: int = 64) -> ActivationPlan:
    """A plan for programs without a compiled one: `sequential_offsets` per bucket, the arena sized for the largest."""
    offsets, arena = {}, 0
    for bucket, ep in programs.items():
        offsets[bucket], size = sequential_offsets(activation_tensors(ep), alignment)
        arena = max(arena, size)
    return ActivationPlan(arena, offsets)


# ---------------------------------------------------------------------------------------------------- allocations


@dataclass(frozen=True, slots=True)
class Allocation:
    """One tensor storage created: its size and the ops it was made under, outermost first."""

    nbytes: int
    ops: tuple[str, ...]  # e.g. ("slabserve::rope", "aten::to", "aten::_to_copy", "aten::empty_strided")


def claim_profiler_for_this_thread() -> None:
    """Start and stop the profiler once on the calling thread, which must be the one that imported torch.

    Kineto initializes its client on the first profile and only from the thread that registered it (the importing
    one); the server's first profile is an allocation check on the thread that builds the engine, and it printed
    "ERROR: External init callback must run in same thread as registerClient" into every server's log. Also quiets
    the lines torch 2.13's kineto prints at each profile's start and stop (KINETO_LOG_LEVEL 6, unless the
    environment sets it), read at that first profile. About a millisecond."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with torch.autograd.profiler.profile(use_cpu=True, profile_memory=True):
        pass


def allocations(fn: Callable[[], object], steps: int = 1, single_thread: bool = True) -> list[Allocation]:
    """Run `fn` `steps` times under the profiler's memory events; every CPU/CUDA tensor storage allocated meanwhile
    (an empty list: nothing was allocated).

    Why it cannot miss one: every tensor storage with bytes is allocated by a c10 allocator (the CPU allocator, the
    pinned-memory allocator or the CUDA caching allocator), and each reports each allocation to the profiler when
    memory profiling is on for the allocating thread; the raw allocation events are read (not the per-op totals,
    where a temporary freed inside its op nets to zero). The profiler's state is thread-local and ATen's intra-op
    worker threads do not inherit it, so by default the check runs with one intra-op thread: every `parallel_for`
    body then runs on the calling thread, under the profiler (a worker thread only runs chunks of a body that the
    calling thread runs whole here)."""
    watch = AllocationWatch(single_thread)
    try:
        for _ in range(steps):
            fn()
    finally:
        found = watch.stop()
    return found


class AllocationWatch:
    """`allocations` as a start and a stop, for code that is not one function: a tensor-parallel follower watches
    the steps its leader sends between two messages (runtime.ranks). Starts at construction."""

    def __init__(self, single_thread: bool = True):
        self._threads = torch.get_num_threads()
        self._single = single_thread
        if single_thread:
            torch.set_num_threads(1)
        # torch.autograd.profiler.profile is what torch.profiler.profile wraps; the wrapper's start asks
        # hasattr(torch, "_inductor"), which imports inductor: 1.5-2.6 s of every server's start-up
        self._prof = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True)
        try:
            self._prof.__enter__()
        except BaseException:
            torch.set_num_threads(self._threads)
            raise

    def stop(self) -> list[Allocation]:
        try:
            self._prof.__exit__(None, None, None)
        finally:
            torch.set_num_threads(self._threads)
        return list(_allocation_events(self._prof.kineto_results.experimental_event_tree(), ()))


def _allocation_events(events, ops: tuple[str, ...]):
    """Positive allocation events of the profiler's tree (they sit under the op that made them, or at the top)."""
    for event in events:
        if event.tag == _EventType.Allocation:
            if event.extra_fields.alloc_size > 0:
                yield Allocation(event.extra_fields.alloc_size, ops)
        else:
            yield from _allocation_events(event.children, ops + (event.name,))


def count_allocations(fn: Callable[[], object], steps: int = 1) -> int:
    """How many tensor storages `steps` calls of `fn` create (see `allocations`)."""
    return len(allocations(fn, steps))


def check_no_allocations(fn: Callable[[], object], steps: int, what: str, single_thread: bool = True,
                         device: torch.device | None = None) -> None:
    """Raise PlanViolationError if `steps` calls of `fn` create any tensor storage (`allocations`; with
    `single_thread` False at the caller's thread count, where what a worker thread allocates is not seen but what
    the thread count changes on the calling thread is). On a CUDA `device` the caching allocator's own counter of
    allocations, which sees every thread and stream, must not move either."""
    cuda = device is not None and device.type == "cuda"
    before = torch.cuda.memory_stats(device)["allocation.all.allocated"] if cuda else 0
    found = allocations(fn, steps, single_thread)
    if cuda:
        torch.cuda.synchronize(device)
        grew = torch.cuda.memory_stats(device)["allocation.all.allocated"] - before
        if grew:
            found.append(Allocation(0, (f"{grew} CUDA caching-allocator allocations",)))
    if found:
        where = sorted({" > ".join(a.ops) or "(no op)" for a in found})
        threads = "one thread" if single_thread else f"{torch.get_num_threads()} threads"
        raise PlanViolationError(f"{what} created {len(found)} tensor storages in {steps} steps at {threads} "
                                 f"({sum(a.nbytes for a in found)} bytes) under {where[:5]}: something runs outside "
                                 f"the plan; refusing to serve")


# ---------------------------------------------------------------------------------------------------- CUDA graphs


class CudaGraphRunner:
    """CUDA graphs captured at start-up into one private memory pool: per bucket, the step, and (given a sampler)
    the sampling of its logits rows in two modes, greedy (argmax) and sampled (runtime.sampler.Sampler.select).

    `inputs`: each bucket's device step inputs (runtime.step.StepInputs.tensors(): fixed tensors the caller fills
    before `replay`), so a replay reads and writes only memory fixed at capture. Sampling graphs read the bucket's
    logits (a view of the activation arena) through `picked` (fp32 rows) and the sampler's device parameters, and
    write its token ids: the sampler's own ops (sorts, scans, reductions) take scratch from the caching allocator
    when run eagerly, inside a graph they take it once, from the pool. Before capturing, every bucket runs once on
    the capture stream itself, so what libraries create on first use (Triton's compiled kernels, cuBLAS's handle
    and its per-stream workspace) exists before capture and is not first allocated inside it. Graphs are captured
    largest bucket first (later captures reuse its pool blocks). `added_bytes` is what all of this added to the
    caching allocator's reservation (the pool and the workspaces); over `budget_bytes` (the plan's line for it)
    it refuses, as it does when a capture fails (naming the node and op). Never recaptures."""

    def __init__(self, executor: PlannedExecutor, inputs: Mapping[int, Mapping[str, torch.Tensor]],
                 k_cache: torch.Tensor, v_cache: torch.Tensor, budget_bytes: int | None = None,
                 sampler=None, picked: torch.Tensor | None = None):
        import time

        self.executor, self.k_cache, self.v_cache = executor, k_cache, v_cache
        self.sampler, self.picked = sampler, picked
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for b in executor.buckets:
                logits = executor.run_naming_failures(b, inputs[b], k_cache, v_cache)
                for greedy in (True, False):
                    self._sample(logits, greedy)
        self.stream.synchronize()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sampling: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_s: dict[int, float] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(executor.buckets, reverse=True):
            started = time.perf_counter()
            self.graphs[b] = self._capture(pool, f"bucket {b}",
                                           lambda: self.logits.__setitem__(b, executor.run_naming_failures(
                                               b, inputs[b], k_cache, v_cache)))
            if sampler is not None:
                for greedy in (True, False):
                    self.sampling[b, greedy] = self._capture(pool, f"bucket {b}'s {'greedy' if greedy else ''} "
                                                                   f"sampling", lambda: self._sample(self.logits[b],
                                                                                                     greedy))
            self.capture_s[b] = time.perf_counter() - started
        torch.cuda.synchronize()
        self.added_bytes = torch.cuda.memory_reserved() - reserved
        if budget_bytes is not None and self.added_bytes > budget_bytes:
            raise PlanViolationError(
                f"capturing the CUDA graphs of {len(self.graphs)} buckets added {self.added_bytes} bytes of device "
                f"memory, over the {budget_bytes} bytes the plan leaves for it (target.reserve): raise target.reserve "
                f"by {self.added_bytes - budget_bytes} bytes or use fewer buckets")

    def _capture(self, pool, what: str, body: Callable[[], object]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                body()
        except PlanViolationError as exc:
            raise PlanViolationError(f"CUDA graph capture failed: {exc}; refusing the plan") from exc
        except RuntimeError as exc:
            raise PlanViolationError(f"{what}: CUDA graph capture failed: {exc}; refusing the plan") from exc
        return graph

    def _sample(self, logits: torch.Tensor, greedy: bool) -> None:
        if self.sampler is None:
            return
        rows = self.picked[: logits.shape[0]]
        rows.copy_(logits)
        self.sampler.select(rows, greedy)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run `bucket`'s graph on the current stream over its filled inputs: the logits (R, V), the tensor the
        capture returned (a view of the activation arena)."""
        self.graphs[bucket].replay()
        return self.logits[bucket]

    def sample(self, bucket: int, greedy: bool) -> None:
        """Sample every logits row of `bucket`'s last replay into the sampler's token ids (parameters loaded)."""
        self.sampling[bucket, greedy].replay()
