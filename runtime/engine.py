"""The engine: the scheduler, the step, the sampler and the tokenizer joined into one Python API.

Contract: an `Engine` owns every buffer it uses (weights, the KV arena sized by its slab classes, step inputs per
bucket, sampler buffers), all made in the constructor. `submit` queues a request; each `step()` runs one engine
step and returns the token events it produced. `generate` (a batch, to completion) and `stream` (one request's
events as they come) are built on those two. Text stop strings are matched here, on the detokenized stream, and
end the request through `Scheduler.finish`; everything else about a request's life is the scheduler's.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import math
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from slabserve.kernels import contracts, cpu_native
from slabserve.runtime.admission import prefill_pairs
from slabserve.runtime.arena import committed_zeros
from slabserve.runtime.bundle_checks import (DTYPES, PlanMismatchError, check_fingerprints, check_gemm_runs_here,
                                             check_graph_fingerprints, check_weight_layout, plan_model_path)
from slabserve.runtime.executor import (ActivationPlan, CudaGraphRunner, PlannedExecutor,
                                        check_no_allocations, plan_sequential)
from slabserve.runtime.loader import WeightSource, open_model
from slabserve.runtime.tensor_parallel import ShardedSource
from slabserve.runtime.graph_io import GRAPHS_FILE, read_programs
from slabserve.runtime.plan import read_plan_and_id
from slabserve.runtime.model import build_step, default_gemm, source_blocks
from slabserve.runtime.sampler import Sampler, SamplingParams, make_generator
from slabserve.runtime.scheduler import FinishReason, InvalidRequestError, Request, ScheduledStep, Scheduler
from slabserve.runtime.slab_allocator import SlabClass
from slabserve.runtime.step import SeqChunk, StepInputs
from slabserve.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from slabserve.runtime.trace import export_step, k_cache_tiled, kv_rows_for

if TYPE_CHECKING:
    from slabserve.runtime.ranks import RankGroup



@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    try:  # the OpenMP runtime torch loaded (and the native kernels bind to): by soname, the one already in memory
        lib = ctypes.CDLL("libgomp.so.1")
        lib.omp_pause_resource_all.argtypes, lib.omp_pause_resource_all.restype = [ctypes.c_int], ctypes.c_int
        return lib
    except (OSError, AttributeError):  # another OpenMP runtime, or one before OpenMP 5.0
        return None


def release_openmp_team() -> bool:
    """Free the calling thread's OpenMP thread team: its worker threads exit, and the thread's next parallel region
    makes a new one. libgomp lets a waiting worker spin before it sleeps only while the process holds no more
    OpenMP threads than the machine has CPUs; past that each wait sleeps at once, and every one of a step's hundreds
    of parallel regions pays a futex wake-up. So a thread that built an engine and stops stepping it must not keep
    its team: an engine built on the main thread and served from the server's engine thread stepped 1.7x slower on
    two cores (8.0 against 4.8 ms at batch 1), the main thread's idle team counting against it. False where the
    runtime is not libgomp (nothing freed); calling it inside a parallel region frees nothing either."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(1) == 0  # omp_pause_soft


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str                           # HF folder or GGUF file
    classes: tuple[SlabClass, ...]       # KV slab classes, laid out one after another in the arena
    max_seqs: int = 16
    step_tokens: int = 256
    buckets: tuple[int, ...] = ()        # default: powers of two up to step_tokens
    dtype: str = "float32"
    queue_limit: int = 64                # waiting requests per slab class
    max_queue_delay_ms: int | None = None  # admission by latency (runtime.admission); None: slabs and queues only
    gemm: str | None = None              # matmul path (runtime.model.GEMMS); None: runtime.model.default_gemm
    device: str = "cpu"                  # where every arena lives: "cpu" or "cuda" (the current CUDA device)
    kv_dtype: str | None = None          # the KV arena's dtype; None: `dtype`
    graph_budget_bytes: int | None = None  # CUDA: what graph capture may add (the plan's target.reserve)
    prefix_reuse: bool = True            # slabs keep their prefixes for later prompts (where rows are exact)
    prefixes: tuple[tuple[str, tuple[int, ...]], ...] = ()  # declared (name, token ids): rows after the slabs
    weight_format: str = "float"         # the weight arena (kernels.quant.WEIGHT_FORMATS): float, gguf or q8_0


@dataclass(frozen=True, slots=True)
class StoppingOptions:
    max_tokens: int = 128
    stop: tuple[str, ...] = ()           # text that ends the output (not included in it)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class Timings:
    queue_s: float            # arrival -> first step that ran the request
    ttft_s: float             # arrival -> first output token
    tpot_s: float             # mean time per output token after the first
    promised_s: float | None = None   # arrival -> the first-token deadline admission promised (None: no promise)
    projected_s: float | None = None  # arrival -> the first token admission projected (None: not projected)


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    request_id: str
    token_ids: tuple[int, ...]            # tokens sampled for the request in this step (one, or none on a stop)
    text: str                             # new text only; held back while it may be the start of a stop string
    finished: FinishReason | None = None
    prompt_tokens: int = 0                # usage, set on the final event
    completion_tokens: int = 0
    timings: Timings | None = None
    cached_tokens: int = 0                # of prompt_tokens, those served from retained KV (final event)


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    timings: Timings
    cached_tokens: int = 0


@dataclass(slots=True)
class _Live:
    """Per-request state the scheduler does not keep: sampling, detokenization, stop strings, timings."""

    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    stop: tuple[str, ...]
    prompt_tokens: int
    arrival: float
    text: str = ""          # all text decoded so far
    sent: int = 0           # characters of `text` already returned
    num_tokens: int = 0
    started: float | None = None
    first_token: float | None = None
    cached: int = 0         # prompt tokens its slab already held when its prefill began
    deadline: float = math.inf   # admission's promise and projection of its first token (time.monotonic())
    projected: float = math.inf


WARM_UP_CHECKED_STEPS = 1  # every bucket once more under the allocation check (each run is a whole step)
# The warm-up's probe of attention's cost per (query row, key) pair: a chunk of the largest bucket (the chunks long
# prompts prefill in) ending at row PAIR_PROBE_DEPTH of the longest slab, or twice the bucket deep when that is
# more. On two cores a SmolLM2 row attending over about 2,000 keys costs as much again as the rest of its step, so
# the difference is well above the timing noise. A 64-row probe measured 0.20-0.31 us a pair where 128- and 256-row
# chunks cost 0.35-0.51 (AMD EPYC, 2026-12-08), and admission then projected a lone 3,251-token prompt's first token
# at 3.7 s that came at 6.7 s.
PAIR_PROBE_DEPTH = 2048


def copy_cache_rows(cache: torch.Tensor, src: int, dst: int, rows: int, tiled: bool) -> None:
    """Rows src .. src+rows-1 of every layer of `cache` (L, N, Hkv, D) onto dst .. dst+rows-1 (the two runs apart),
    or of a tiled K cache (L, N / KV_TILE, Hkv, D, KV_TILE): whole tiles where both runs are at a tile's start (a
    slab's prefix onto another slab's, when slab sizes are multiples of KV_TILE), else the lanes of one tile at a
    time. Views only, no new storage."""
    if not tiled:
        cache[:, dst : dst + rows].copy_(cache[:, src : src + rows])
        return
    tile, done = contracts.KV_TILE, 0
    while done < rows:
        s, d = src + done, dst + done
        if s % tile == 0 and d % tile == 0 and rows - done >= tile:
            n = (rows - done) // tile
            cache[:, d // tile : d // tile + n].copy_(cache[:, s // tile : s // tile + n])
            done += n * tile
            continue
        n = min(tile - s % tile, tile - d % tile, rows - done)
        cache[:, d // tile, ..., d % tile : d % tile + n].copy_(cache[:, s // tile, ..., s % tile : s % tile + n])
        done += n


class KVCommit:
    """The K and V caches of `shape` and `dtype`, committed (runtime.arena) on a thread of their own that ends when
    they are: the page faults run in the kernel beside the caller's Python, which holds the GIL (madvise does not).
    `result()` waits for them and raises what the thread raised."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self._caches: tuple[torch.Tensor, torch.Tensor] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._commit, args=(shape, dtype), name="kv-commit", daemon=True)
        self._thread.start()

    def _commit(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        try:
            self._caches = (committed_zeros(shape, dtype), committed_zeros(shape, dtype))
        except BaseException as exc:  # handed to result(), on the caller's thread
            self._error = exc

    def wait(self) -> None:
        """Until the thread has ended (what it committed is dropped with this object)."""
        self._thread.join()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.wait()
        if self._error is not None:
            raise self._error
        caches, self._caches = self._caches, None
        return caches  # type: ignore[return-value]


class Engine:
    def __init__(self, config: EngineConfig, source: WeightSource | None = None,
                 activation_plan: ActivationPlan | None = None, graph_fingerprints: Mapping[int, str] | None = None,
                 graphs_dir: Path | None = None, warm_up: bool = True, kv_arena: "KVCommit | None" = None,
                 ranks: "RankGroup | None" = None):
        """`activation_plan`: the plan bundle's activation layout; without one every intermediate gets its own
        bytes (`runtime.executor.plan_sequential`). `graph_fingerprints`: the plan's fingerprint of each bucket's
        traced step, checked against this process's trace (or the stored graphs of `graphs_dir`, read instead of
        tracing: runtime.graph_io) before anything is allocated. Refuses
        (PlanViolationError) a plan that does not fit the traced step, or warm-up steps that create storage.
        `kv_arena`: the K and V caches already being committed (from_plan starts that before the model is read),
        used when their shape and dtype are the ones this engine computes. `ranks`: this process's place in a
        tensor-parallel group (runtime.ranks; `source` is then the rank's slice, runtime.tensor_parallel): rank 0
        sends every step and KV copy to the other ranks before running it."""
        source = source or open_model(config.model)
        self.ranks = ranks
        self.config = config
        self.model_config = c = source.config
        self.tokenizer = _tokenizer_for(source)
        self.device = engine_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = DTYPES[config.kv_dtype or config.dtype]
        buckets = config.buckets or _powers_of_two(config.step_tokens)
        max_slab = max(k.tokens for k in config.classes)
        if max_slab > c.context_limit:
            raise ValueError(f"slab class of {max_slab} tokens exceeds the model's context of {c.context_limit}: "
                             f"lower it by {max_slab - c.context_limit}")
        for name, ids in config.prefixes:
            if not 1 <= len(ids) < max_slab:
                raise ValueError(f"declared prefix {name!r} has {len(ids)} tokens; it must be shorter than the "
                                 f"largest slab ({max_slab})")
        self.gemm = config.gemm or default_gemm(self.device.type, self.dtype)
        check_gemm_runs_here(self.gemm, self.device.type)
        self.weight_format = config.weight_format
        blocks = source_blocks(source, config.weight_format, self.gemm, self.device.type, config.dtype)
        self.step_fn = build_step(source, self.dtype, rope_positions=max_slab, device=self.device,
                                  gemm=self.gemm, blocks=blocks)  # one weight arena
        rows = kv_rows_for(sum(k.tokens * k.count for k in config.classes)
                           + sum(len(ids) for _, ids in config.prefixes))
        kv_shape = (c.num_layers, rows, c.num_kv_heads, c.head_dim)  # (L, N, Hkv, D)
        caches = kv_arena.result() if kv_arena is not None else None
        if caches is None or any(t.shape != kv_shape or t.dtype != self.kv_dtype for t in caches):
            caches = KVCommit(kv_shape, self.kv_dtype).result() if self.device.type == "cpu" else tuple(
                torch.zeros(kv_shape, dtype=self.kv_dtype, device=self.device) for _ in range(2))
        self.k_tiled = k_cache_tiled(c, self.device.type, self.dtype, self.kv_dtype)
        # K in tiles where the native attention reads it so (the same bytes: a view of the rows committed)
        self.k_cache, self.v_cache = caches[0].view(contracts.k_cache_shape(kv_shape, self.k_tiled)), caches[1]
        self.inputs = {b: StepInputs(b, config.max_seqs, self.device) for b in buckets}
        if ranks is not None:
            ranks.bind(buckets, config.max_seqs)
        if graphs_dir is not None:
            programs = read_programs(graphs_dir, dict(self.step_fn.named_buffers()))
        else:
            programs = {b: export_step(self.step_fn, b, config.max_seqs, rows, self.device,
                                       kv_caches=(self.k_cache, self.v_cache)) for b in buckets}
        check_graph_fingerprints(programs, graph_fingerprints)
        plan = activation_plan or plan_sequential(programs)
        self.executor = PlannedExecutor.allocate(programs, plan, self.device)
        self._graphs: CudaGraphRunner | None = None  # CUDA: captured by warm_up, before its first step
        self.sampler = Sampler(config.max_seqs, c.vocab_size, self.device)
        self._picked = torch.zeros(config.max_seqs, c.vocab_size, device=self.device)  # (S, V) float32 rows to sample
        delay_s = config.max_queue_delay_ms / 1000 if config.max_queue_delay_ms is not None else None
        self.prefix_reuse_off = prefix_reuse_off_reason(config.prefix_reuse, self.gemm, self.device.type)
        self.scheduler = Scheduler(config.classes, config.max_seqs, config.step_tokens, buckets, config.queue_limit,
                                   max_queue_delay_s=delay_s, prefix_reuse=self.prefix_reuse_off is None)
        self.declared: dict[str, int] = {}  # declared prefix name -> tokens, once prefilled (warm_up)
        self.copy_row_s: float | None = None      # measured by warm_up: copying one KV row (every layer)
        self.prefill_token_s: float | None = None  # measured by warm_up: prefilling one token in the largest bucket
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._cancelled: list[str] = []  # aborted requests whose CANCELLED event is not yet returned
        self._backlog: list[GenerationEvent] = []  # events `generate`/`stream` saw for requests they don't own
        self._seed_source = random.Random()
        self.plan_id = ""  # sha256 of the bundle's plan.msgpack when built by from_plan
        self.plan_name = ""  # the spec's `name` when built by from_plan
        self.warmed_on: int | None = None  # thread ident of the last warm-up; step() refuses to run before one
        self.pair_seconds = 0.0  # attention's seconds per (query row, key) pair of a prefill chunk, from warm_up
        if warm_up:
            self.warm_up()
        release_openmp_team()  # this thread's, made by building: the engine may be stepped on another

    @classmethod
    def from_plan(cls, directory: str | Path, warm_up: bool = True, ranks: "RankGroup | None" = None) -> "Engine":
        """The engine a plan bundle describes, after checking the bundle against this machine: the model's config
        and weight contents, the torch/triton versions and the device must be the ones the plan was built for
        (PlanMismatchError names which differs and how to rebuild); the KV and activation arenas are allocated at
        exactly the planned sizes. `warm_up`: as for the constructor. `ranks`: this process's place in the group of
        a tensor-parallel plan (runtime.ranks), which needs one of its plan's degree."""
        plan, plan_id = read_plan_and_id(directory)
        degree = plan.parallel.tensor
        if degree > 1 and (ranks is None or ranks.world != degree):
            raise PlanMismatchError(
                f"{directory}: plan {plan.name!r} is tensor-parallel over {degree} ranks"
                + (f" and this group has {ranks.world}" if ranks is not None else "")
                + f": serve it with `slabserve serve {directory}` (which starts its {degree} ranks) or "
                  f"`torchrun --nproc-per-node {degree} -m slabserve.runtime.serve_cli {directory}`")
        if degree == 1 and ranks is not None and ranks.world != 1:
            raise PlanMismatchError(f"{directory}: plan {plan.name!r} serves on one device and this process is one "
                                    f"of {ranks.world} ranks: start it once, without torchrun")
        if not plan.servable:
            raise PlanMismatchError(f"{directory}: plan {plan.name!r} was built without weights (weights: none), for "
                                    "capacity planning only; build a plan from the model's weights to serve it")
        kv = plan.kv  # commit the KV arena (seconds of page faults) while the model's file is read and checked
        kv_arena = KVCommit((kv.num_layers, kv.rows, kv.num_kv_heads, kv.head_dim), DTYPES[kv.dtype]) \
            if engine_device(plan.engine.device).type == "cpu" and kv.dtype in DTYPES else None
        try:
            source = open_model(plan_model_path(plan))
            check_fingerprints(plan, source, Path(directory))
            if degree > 1:
                source = ShardedSource(source, ranks.rank, degree)
            check_weight_layout(plan, source)
            config = EngineConfig(str(source.path), tuple(SlabClass(t, n) for t, n in plan.slab_classes()),
                                  plan.engine.max_seqs, plan.engine.step_tokens, tuple(plan.engine.buckets),
                                  plan.engine.dtype, plan.engine.queue_limit, plan.engine.max_queue_delay_ms,
                                  plan.engine.gemm, plan.engine.device, plan.engine.kv_dtype, plan.target.reserve_bytes,
                                  plan.engine.prefix_reuse, plan.declared_prefixes(), plan.engine.weight_format)
            fingerprints = {b.tokens: b.graph_fingerprint for b in plan.activations.buckets}
            graphs = Path(directory) if (Path(directory) / GRAPHS_FILE).is_file() else None
            engine = cls(config, source, ActivationPlan(plan.activations.arena_bytes, plan.activation_offsets()),
                         fingerprints, graphs, warm_up=warm_up, kv_arena=kv_arena,
                         ranks=ranks if degree > 1 else None)
        except BaseException:
            if kv_arena is not None:  # a refusal: let the commit end before the exception can end the process
                kv_arena.wait()
            raise
        engine.plan_id = plan_id
        engine.plan_name = plan.name
        return engine

    # ---- requests in ----------------------------------------------------------------------------------------------

    def prompt_ids(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]]) -> tuple[int, ...]:
        """Text, token ids, or chat messages (rendered with the model's template) -> prompt token ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif prompt and isinstance(prompt[0], Mapping):
            self.tokenizer.validate_roles(prompt)
            ids = self.tokenizer.encode_chat(prompt)
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.model_config.vocab_size]
            if bad:
                raise InvalidRequestError("token_ids", f"id {bad[0]} is outside the vocabulary "
                                                       f"[0, {self.model_config.vocab_size})")
        if not ids:
            raise InvalidRequestError("prompt", "is empty")
        return tuple(ids)

    def submit(self, prompt, sampling: SamplingParams = SamplingParams(), stopping: StoppingOptions = StoppingOptions(),
               request_id: str | None = None, *, deadline: float | None = None,
               projected: float | None = None) -> str:
        """Queue a request; raises the scheduler's errors (invalid, out of range, queue full, delay bound).
        Returns its id. `deadline`: its first-token deadline (time.monotonic()) when the caller has already run
        admission by latency against a `Scheduler.admission_view` (the server does, on its gRPC threads), and
        `projected` the first token that admission projected."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        try:
            sampling.validate(self.model_config.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc).split(" =")[0], str(exc)) from None
        ids = self.prompt_ids(prompt)
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        now = time.monotonic()
        self.scheduler.submit(Request(request_id, ids, stopping.max_tokens, eos, frozenset(stopping.stop_token_ids),
                                      stopping.ignore_eos, now, deadline, projected))
        seed = sampling.seed if sampling.seed is not None else self._seed_source.getrandbits(63)
        promise, expected = self.scheduler.first_token_promise(request_id)
        self._live[request_id] = _Live(sampling, make_generator(seed),
                                       IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=True),
                                       tuple(s for s in stopping.stop if s), len(ids), now,
                                       deadline=promise, projected=expected)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its slab is free for the next step. Its stream ends with a CANCELLED event."""
        live = self._live.get(request_id)
        if live is None or not self.scheduler.abort(request_id):
            return False
        self._cancelled.append(request_id)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._cancelled) or bool(self._backlog)

    # ---- steps ----------------------------------------------------------------------------------------------------

    def step(self) -> list[GenerationEvent]:
        """Run one engine step; return the events it produced (cancellations first)."""
        if self.warmed_on is None:
            raise RuntimeError("the engine has not run its warm-up: call warm_up() on the thread that steps it")
        events = self._backlog + [self._final(rid, FinishReason.CANCELLED, ()) for rid in self._cancelled]
        self._backlog, self._cancelled = [], []
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return events
        # 1) pack the bucket's inputs in place and run the step
        inputs = self.inputs[scheduled.bucket]
        inputs.fill(scheduled.chunks)
        now = time.monotonic()
        for chunk in scheduled.chunks:
            live = self._live[chunk.request_id]
            if live.started is None:
                live.started, live.cached = now, chunk.start_pos
        for copy in scheduled.copies:  # retained prefixes into new slabs, before the step reads or writes them
            self._copy_rows(copy.src, copy.dst, copy.rows)
        logits = self._run_step(scheduled.bucket)  # (R, V)
        # 2) sample the rows that end a sequence's known tokens
        sampled = self._sample(scheduled, logits)
        # 3) let the scheduler advance, then turn tokens into text and match stop strings
        for event in self.scheduler.complete_step(scheduled, sampled):
            events.append(self._token_event(event.request_id, event.token_id, event.finished))
        return events

    def _copy_rows(self, src: int, dst: int, rows: int) -> None:
        """KV rows src .. src+rows-1 onto dst .. dst+rows-1 in every layer: views of the arena, no new storage."""
        if self.ranks is not None and self.ranks.leads:
            self.ranks.send_copy(src, dst, rows)
        copy_cache_rows(self.k_cache, src, dst, rows, self.k_tiled)
        copy_cache_rows(self.v_cache, src, dst, rows, False)

    def _run_step(self, bucket: int) -> torch.Tensor:
        """The step of `bucket` on its filled inputs: logits (R, V) (R = runtime.step.logits_rows), a view into the
        activation arena."""
        if self.ranks is not None and self.ranks.leads:
            self.ranks.send_step(bucket, self.inputs[bucket].tensors())
        if self._graphs is not None:
            return self._graphs.replay(bucket)
        return self.executor.run(bucket, self.inputs[bucket].tensors(), self.k_cache, self.v_cache)

    def capture_graphs(self) -> None:
        """CUDA: one graph per bucket (and its sampling), captured into one private pool (CudaGraphRunner). A
        tensor-parallel follower calls it when rank 0 does (runtime.ranks: CAPTURE), so the eager runs before each
        capture meet rank 0's collectives in the same order."""
        self._graphs = CudaGraphRunner(self.executor, {b: i.tensors() for b, i in self.inputs.items()},
                                       self.k_cache, self.v_cache, self.config.graph_budget_bytes,
                                       self.sampler, self._picked)

    def keep_alive(self) -> None:
        """Called by the engine loop while idle: a tensor-parallel leader pings its group (runtime.ranks), so a rank
        that died or hangs is found with no traffic."""
        if self.ranks is not None and self.ranks.leads:
            self.ranks.ping_if_idle()

    def _check_no_allocations(self, fn, steps: int, what: str, single_thread: bool) -> None:
        """check_no_allocations here, and on every other rank of a tensor-parallel group over the same steps."""
        if self.ranks is None:
            check_no_allocations(fn, steps, what, single_thread=single_thread, device=self.device)
            return
        self.ranks.check_begin(single_thread)
        try:
            check_no_allocations(fn, steps, what, single_thread=single_thread, device=self.device)
        finally:
            counts = self.ranks.check_end()
        bad = {r: n for r, n in enumerate(counts) if n}
        if bad:
            raise PlanViolationError(f"{what} created tensor storages on rank(s) "
                                     f"{', '.join(f'{r} ({n})' for r, n in bad.items())} of the tensor-parallel "
                                     f"group (each rank's log names the ops); refusing to serve")

    def _sample(self, scheduled: ScheduledStep, logits: torch.Tensor) -> dict[str, int]:
        rows = [i for i, chunk in enumerate(scheduled.chunks) if chunk.sample]
        if not rows:
            return {}
        lives = [self._live[scheduled.chunks[i].request_id] for i in rows]
        tokens = self._sample_rows(scheduled.bucket, logits, rows, [l.params for l in lives],
                                   [l.generator for l in lives])
        return {scheduled.chunks[i].request_id: t for i, t in zip(rows, tokens)}

    def _sample_rows(self, bucket: int, logits: torch.Tensor, rows: list[int], params, generators) -> list[int]:
        """Sample logits[rows] with the preallocated buffers only. On CUDA the bucket's captured sampling graph
        samples every logits row (greedy rows cost an argmax) and the rows wanted are read from the one pinned copy
        of the ids; on CPU only the rows wanted are sampled (no fancy indexing, which allocates)."""
        if self._graphs is not None:
            greedy = self.sampler.load(params, generators, rows, logits.shape[0])
            self._graphs.sample(bucket, greedy)
            ids = self.sampler.ids_to_host(logits.shape[0]).tolist()
            return [ids[i] for i in rows]
        r = len(rows)
        if rows[-1] == r - 1 and logits.dtype == torch.float32:  # rows 0..r-1: a view is enough
            picked = logits[:r]
        elif rows[-1] == r - 1:
            picked = self._picked[:r].copy_(logits[:r])
        else:
            picked = self._picked[:r]
            for j, i in enumerate(rows):
                picked[j].copy_(logits[i])
        return self.sampler.sample(picked, params, generators).tolist()

    def warm_up(self) -> None:
        """Run every bucket full of real tokens (first runs bind the graphs and initialize libraries), then again
        under the allocation check with greedy and random sampling; refuse to serve if anything allocates.
        The warm-up writes K/V rows of free slabs only; a request's prefill overwrites them before it reads.

        In the first runs each bucket's first sequence attends over the longest slab, so what the libraries under
        the step keep and size by the largest call they have seen (MKL's buffers for the reference attention's
        GEMMs) is at its high-water mark before serving, not the first time a long prompt arrives. Those are kept
        per thread, as is OpenMP's thread team: call this on the thread that steps the engine (runtime.server
        does). Then every sequence starts at position 0, like most steps, and those times seed admission by
        latency. The checked runs are busy steps (a decode row at the end of the longest slab beside prefill chunks
        and decode rows that start mid-slab), at the serving thread count and again at one thread; on CUDA the
        caching allocator's counter is checked too. On CUDA the graphs are captured first (CudaGraphRunner) and
        every run here is a replay."""
        if self.device.type == "cuda" and self._graphs is None:
            if self.ranks is not None and self.ranks.leads:
                self.ranks.send_capture()  # every rank captures too: their warm-up runs meet these collectives
            self.capture_graphs()
        params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)]
        generators = [make_generator(0), make_generator(1)]
        seconds: dict[int, float] = {}
        sequences: dict[int, int] = {}  # bucket -> sequences of its warm-up chunks (only their logits are computed)

        pairs: dict[int, int] = {}  # bucket -> (query row, key) pairs its warm-up chunks attend over

        def fill(kind: str, max_chunk: int | None = None, buckets=self.inputs) -> None:
            for bucket in buckets:
                chunks = self._warm_up_chunks(bucket, kind, max_chunk)
                self.inputs[bucket].fill(chunks)
                sequences[bucket] = len(chunks)
                pairs[bucket] = sum(prefill_pairs(c.start_pos, len(c.token_ids)) for c in chunks)

        def every_bucket(buckets=self.inputs) -> None:
            for bucket in buckets:
                started = time.perf_counter()
                logits = self._run_step(bucket)  # (R, V), R = logits_rows(bucket, max_seqs)
                rows = list(range(min(2, sequences[bucket])))
                self._sample_rows(bucket, logits, rows, params[: len(rows)], generators[: len(rows)])
                took = time.perf_counter() - started
                seconds[bucket] = min(seconds.get(bucket, took), took)

        # the largest call a step makes (the largest bucket's chunk ending on the longest slab's last row) sets the
        # high-water mark of what libraries keep; then every bucket from position 0. The native CPU attention keeps
        # nothing (its stack only), so there a decode row at the end of the longest slab is enough: it binds the
        # largest bucket without a full prefill over the longest context (about 1.5 s of start-up)
        if self.k_tiled:  # the CPU step's attention runs native (runtime.trace.k_cache_tiled)
            fill("mixed", max_chunk=1)
        else:
            fill("longest")
        every_bucket([max(self.inputs)])
        seconds.clear()  # a step over the longest context is not what a typical step costs
        fill("start")
        every_bucket()
        typical, typical_pairs = dict(seconds), dict(pairs)  # chunks from position 0: admission starts from these
        # what attention over a long context adds: one chunk ending deep in the longest slab against the same bucket
        # from position 0 (its attention then costs about as much as the rest of the step; a few tenths of a second)
        deep = max(self.inputs)
        fill("deep", buckets=[deep])
        seconds.pop(deep)
        every_bucket([deep])
        extra = pairs[deep] - typical_pairs[deep]
        self.pair_seconds = max(0.0, (seconds[deep] - typical[deep]) / extra) if extra > 0 else 0.0
        copy = self._measure_copies(typical)

        def busy_steps() -> None:
            if copy is not None:
                self._copy_rows(*copy)
            every_bucket()

        # checked: steps that mix a decode row at the end of the longest slab with prefill chunks and decode rows
        # starting mid-slab (after a copy of retained rows between slabs), at the serving thread count; then at one
        # thread (where every parallel body runs on this thread, under the check) the same kinds of rows, three
        # sequences a bucket (that decode row, a prefill chunk of at most 8 tokens, a decode row): every node and
        # every parallel body runs, and the CPU kernels compute the real rows only (kernels.ops: ROWS), so it costs
        # a fraction of full buckets at one thread
        fill("mixed")
        self._check_no_allocations(busy_steps, WARM_UP_CHECKED_STEPS, "the engine's warm-up (mixed steps)",
                                   single_thread=False)
        fill("mixed", max_chunk=8)
        self._check_no_allocations(busy_steps, WARM_UP_CHECKED_STEPS, "the engine's warm-up (mixed steps)",
                                   single_thread=True)
        self.scheduler.step_times.seed(typical, typical_pairs, self.pair_seconds)  # then it measures
        self.scheduler.forget_free_prefixes()  # the warm-up wrote into free slabs
        self._prefill_declared()
        if self.device.type == "cuda":  # what start-up freed (tracing's temporaries) goes back: reserved = planned
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.warmed_on = threading.get_ident()

    def _prefill_declared(self) -> None:
        """Prefill each declared prefix into its own rows (after the slabs; the warm-up never writes there) in
        chunks of up to step_tokens, and hand them to the scheduler, which only ever copies from them. Once: they
        stay valid for the engine's life. Skipped, with the reason in `prefix_reuse_off`, where reuse is off."""
        if self.scheduler.prefix is None or self.declared or not self.config.prefixes:
            return
        row = sum(k.tokens * k.count for k in self.config.classes)
        step = self.config.step_tokens
        for name, ids in self.config.prefixes:
            for start in range(0, len(ids), step):
                chunk = SeqChunk(row, start, list(ids[start : start + step]), len(ids))
                bucket = next(b for b in self.inputs if b >= len(chunk.token_ids))
                self.inputs[bucket].fill([chunk])
                self._run_step(bucket)
            self.scheduler.declare_prefix(row, ids)
            self.declared[name] = len(ids)
            row += len(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _measure_copies(self, typical: Mapping[int, float]) -> tuple[int, int, int] | None:
        """Time copying KV rows between two slabs against prefilling them (the largest bucket's time per token),
        and let the scheduler copy retained prefixes only where that pays: from `copy_min_tokens` rows, the length
        from which a copy's fixed cost plus its rows costs less than prefilling them. The probe copy (src, dst,
        rows) for the checked warm-up steps, or None with fewer than two slabs."""
        slabs = self._slabs()
        if len(slabs) < 2:
            return None
        (src, a), (dst, b) = slabs[0], slabs[1]
        rows = min(a, b)

        def timed(n: int) -> float:
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                self._copy_rows(src, dst, n)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                best = min(best, time.perf_counter() - started)
            return best

        fixed = timed(1)
        self.copy_row_s = max(timed(rows) - fixed, 0.0) / max(rows - 1, 1)
        largest = max(typical)
        self.prefill_token_s = typical[largest] / largest
        prefix = self.scheduler.prefix
        if prefix is not None and self.copy_row_s < self.prefill_token_s:
            self.scheduler.copy_min_tokens = max(prefix.block,
                                                 math.ceil(fixed / (self.prefill_token_s - self.copy_row_s)))
        return src, dst, rows

    def _slabs(self) -> list[tuple[int, int]]:
        """(first row, rows) of every slab, in arena order."""
        slabs, offset = [], 0
        for slab_class in self.config.classes:
            for _ in range(slab_class.count):
                slabs.append((offset, slab_class.tokens))
                offset += slab_class.tokens
        return slabs

    def _warm_up_chunks(self, bucket: int, kind: str = "start", max_chunk: int | None = None) -> list[SeqChunk]:
        """`bucket` tokens spread over free slabs (at most max_seqs sequences), real token ids, rows of free slabs
        only. `kind`:
          "start"    every chunk from position 0 (most steps' shape);
          "longest"  the same, but the first chunk ends on the last row of the longest slab (attention over the
                     longest context: what libraries size by the largest call reaches its high-water mark);
          "mixed"    a decode row at the last position of the longest slab, then prefill chunks that start in the
                     middle of their slabs, then decode rows mid-slab: the shapes of a busy step. With `max_chunk`:
                     the first three of them, the prefill chunk at most max_chunk tokens;
          "deep"     one chunk of the whole bucket in the longest slab, ending at row PAIR_PROBE_DEPTH or twice the
                     bucket (or the slab's last): the step whose extra time over "start" is what attention over a long
                     context costs."""
        slabs = self._slabs()
        longest = max(range(len(slabs)), key=lambda i: slabs[i][1])
        if kind == "deep":
            first_row, rows = slabs[longest]
            n = min(bucket, rows)
            return [SeqChunk(first_row, min(rows, max(2 * n, PAIR_PROBE_DEPTH)) - n, [0] * n, rows)]
        if kind == "mixed":
            first_row, rows = slabs[longest]
            chunks, left = [SeqChunk(first_row, rows - 1, [0], rows)], bucket - 1
            for n, i in enumerate(i for i in range(len(slabs)) if i != longest):
                if left == 0 or len(chunks) == (3 if max_chunk else self.config.max_seqs):
                    break
                first_row, rows = slabs[i]
                size = 1 if n % 2 else min(left, rows - rows // 2, max_chunk or left)  # decode rows between chunks
                chunks.append(SeqChunk(first_row, rows // 2, [0] * size, rows))
                left -= size
            return chunks  # may leave padding rows: a busy step need not fill its bucket
        order = [longest] + [i for i in range(len(slabs)) if i != longest] if kind == "longest" else range(len(slabs))
        chunks, left = [], bucket
        for i in order:
            if left == 0 or len(chunks) == self.config.max_seqs:
                break
            first_row, rows = slabs[i]
            n = min(left, rows)
            chunks.append(SeqChunk(first_row, rows - n if kind == "longest" and i == longest else 0, [0] * n, rows))
            left -= n
        return chunks

    def _token_event(self, request_id: str, token_id: int, finished: FinishReason | None) -> GenerationEvent:
        live = self._live[request_id]
        now = time.monotonic()
        live.first_token = live.first_token or now
        live.num_tokens += 1
        live.text += live.detok.push(token_id)
        hit = _find_stop(live.text, live.sent, live.stop)
        if hit is not None:
            live.text = live.text[:hit]
            self.scheduler.finish(request_id, FinishReason.STOP)
            return self._final(request_id, FinishReason.STOP, (token_id,))
        if finished is not None:
            live.text += live.detok.flush()
            return self._final(request_id, finished, (token_id,))
        end = len(live.text) - _held_back(live.text, live.stop)
        piece, live.sent = live.text[live.sent : end], max(live.sent, end)
        return GenerationEvent(request_id, (token_id,), piece)

    def _final(self, request_id: str, reason: FinishReason, token_ids: tuple[int, ...]) -> GenerationEvent:
        live = self._live.pop(request_id)
        now = time.monotonic()
        first = live.first_token or now
        timings = Timings(queue_s=(live.started or now) - live.arrival, ttft_s=first - live.arrival,
                          tpot_s=(now - first) / max(1, live.num_tokens - 1),
                          promised_s=live.deadline - live.arrival if live.deadline < math.inf else None,
                          projected_s=live.projected - live.arrival if live.projected < math.inf else None)
        return GenerationEvent(request_id, token_ids, live.text[live.sent :], reason, live.prompt_tokens,
                               live.num_tokens, timings, live.cached if live.started is not None else 0)

    # ---- whole requests -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence, sampling: SamplingParams = SamplingParams(),
                 stopping: StoppingOptions = StoppingOptions()) -> list[Completion]:
        """Run a batch to completion; results in the order of `prompts`."""
        ids = [self.submit(p, sampling, stopping) for p in prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        done: dict[str, GenerationEvent] = {}
        while len(done) < len(ids):
            for event in self._own_events(tokens):
                tokens[event.request_id].extend(event.token_ids)
                texts[event.request_id].append(event.text)
                if event.finished is not None:
                    done[event.request_id] = event
        return [Completion(rid, tuple(tokens[rid]), "".join(texts[rid]), done[rid].finished,
                           done[rid].prompt_tokens, done[rid].timings, done[rid].cached_tokens) for rid in ids]

    def _own_events(self, owned) -> list[GenerationEvent]:
        """One step's events for `owned` requests; the others wait in the backlog for the next `step()` caller."""
        mine = []
        for event in self.step():
            (mine if event.request_id in owned else self._backlog).append(event)
        return mine

    def stream(self, prompt, sampling: SamplingParams = SamplingParams(),
               stopping: StoppingOptions = StoppingOptions()) -> Iterator[GenerationEvent]:
        """One request's events as they are produced (other submitted requests advance too)."""
        request_id = self.submit(prompt, sampling, stopping)
        try:
            while True:
                for event in self._own_events((request_id,)):
                    yield event
                    if event.finished is not None:
                        return
        finally:
            if request_id in self._live:
                self.abort(request_id)


def _find_stop(text: str, sent: int, stops: tuple[str, ...]) -> int | None:
    """Earliest index where a stop string starts in the unsent text (and the held-back tail before it)."""
    if not stops:
        return None
    start = max(0, sent - max(map(len, stops)) + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def prefix_reuse_off_reason(wanted: bool, gemm: str, device: str) -> str | None:
    """Why prefix reuse is off for an engine (None: it is on). Reuse promises the same tokens as without it, so a
    KV row must not depend on how its prompt was chunked or batched: the native CPU kernels give every row the same
    arithmetic (kernels/cpu_native.c); aten's GEMMs (MKL, cuBLAS) choose their blocking by the number of rows."""
    if not wanted:
        return "turned off by the plan (prefix_reuse: false)"
    if device != "cpu" or gemm != "native":
        return (f"off on {device} with gemm {gemm}: its matmuls do not give a row the same result in every chunk "
                f"size, so reused rows could change outputs (exact reuse needs the native CPU kernels)")
    return None


def engine_device(name: str) -> torch.device:
    """The device a plan's `engine.device` names: the CPU, or the current CUDA device (refused without one)."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PlanMismatchError(f"the engine's device is {name!r} and this machine has no CUDA device")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported: use cpu or cuda")
    return device


def _powers_of_two(limit: int) -> tuple[int, ...]:
    sizes = [1 << i for i in range(limit.bit_length()) if (1 << i) < limit]
    return tuple(sizes + [limit])


def _tokenizer_for(source: WeightSource) -> Tokenizer:
    if getattr(source, "format", None) == "gguf":  # a GGUFSource, or one rank's view of it
        return Tokenizer.from_gguf(source.path, reader=source.reader)
    return Tokenizer.from_hf_dir(Path(source.path))
