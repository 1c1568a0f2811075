"""Continuous-batching scheduler over KV slabs. Pure Python, no torch: it knows token ids, slabs and positions only.

Contract with the engine (one thread owns the scheduler; calls are not thread-safe):

    step = scheduler.schedule()          # None when nothing is running
    sampled = run_the_step(step)         # {request_id: token_id} for every chunk with sample=True
    events = scheduler.complete_step(step, sampled)

gRPC handlers run on other threads: the engine serializes every call (one lock, or a command queue drained by
the engine thread between steps). At most one step is in flight: `schedule()` refuses while the previous step
has not been completed (or discarded). `abort`, `finish` and `submit` may be called between those calls; a
sequence ended that way never appears in a later step, and its token in an in-flight step is ignored by
`complete_step`. A slab freed while a step is in flight may go to a new request at once: its first chunk runs in
a later step, after the in-flight one has finished writing, as long as steps run one after another.

Admission (DESIGN.md): a request needing `prompt + max_tokens` rows goes to the smallest class with a free slab
that can hold it. When every class that fits is full it waits in the FIFO queue of its *home* class (the smallest
class that fits), bounded by `queue_limit`; when slabs free, the oldest waiting request that can be placed goes
first, into the smallest free class at or above its home. Queues only ever hold requests that cannot be placed
(admission runs after every submit and every release), so a new request never overtakes a waiting one that could
have used the same slab. Nothing is ever preempted or recomputed: a request keeps its slab until it ends.

Retained prefixes (`prefix_reuse`): a slab keeps the token ids of the KV rows it holds (runtime.prefix_cache) as its
request runs and after it ends. A request being placed looks its prompt up there: it takes the free slab (of a class
it fits) that holds the longest prefix of its prompt when the request keeps at least half of what that slab holds,
or has that prefix copied into a least recently used free slab (the source running or free, of any class: a `RowCopy` the next
step runs before it computes anything), and its prefill starts after the prefix, always computing at least the last
prompt token. Without a useful match it takes its class's least recently used free slab, so hot prefixes survive.
Copies and takes happen at placement only, so ordering is simple: a copy runs before any step that could write its
source's rows past what a later owner kept.

Step packing: every decoding sequence contributes its one token, then prefill chunks fill the rest of
`step_tokens`. Prefill order is shortest remaining prompt first, so a short prompt is not stuck behind a long one,
except that the oldest prefilling sequence is first guaranteed `g = max(1, floor(oldest_prefill_share * B))`
tokens of the step's prefill budget B (capped by `prefill_chunk`). Because B >= step_tokens - max_seqs + 1 (decode
tokens come from the other running sequences, and step_tokens >= max_seqs), a sequence admitted behind prefilling
sequences of prompt lengths P_1..P_k gets its first token within sum(ceil(P_i / g_min)) + ceil(P / g_min) steps,
g_min = min(prefill_chunk, max(1, floor(share * (step_tokens - max_seqs + 1)))), whatever arrives after it.

Stop strings are not seen here (this module knows no text): the engine detokenizes the events and calls
`finish(request_id, FinishReason.STOP)` when a stop string completes.
"""
from __future__ import annotations

import enum
import math
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slabserve.runtime.admission import (LOAD_WINDOW_S, AdmissionView, Arrival, OverloadedError, Pending,
                                         ProjectionError, StepTimes, prefill_pairs)
from slabserve.runtime.prefix_cache import BLOCK_TOKENS, NO_MATCH, Match, PrefixIndex
from slabserve.runtime.slab_allocator import DECLARED, Slab, SlabAllocator, SlabClass

_RECENT_FREES = 32             # completions per class remembered for the retry hint
_DEFAULT_RETRY_MS = 1000       # retry hint before any request of the class has finished
_MAX_RETRY_MS = 60_000


# ---- errors the server maps to gRPC status codes ----------------------------------------------------------------

class InvalidRequestError(ValueError):
    """INVALID_ARGUMENT: `field` names the offending request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class OutOfRangeError(ValueError):
    """OUT_OF_RANGE: prompt + max_tokens exceeds the largest slab; `limit_tokens` is the largest allowed size."""

    def __init__(self, need_tokens: int, limit_tokens: int):
        super().__init__(f"prompt + max_tokens is {need_tokens} tokens; the largest slab holds {limit_tokens} "
                         f"tokens: shorten the prompt or lower max_tokens to fit {limit_tokens}")
        self.need_tokens = need_tokens
        self.limit_tokens = limit_tokens


class QueueFullError(OverloadedError):
    """RESOURCE_EXHAUSTED: the queue of slab class `class_index` is full; retry after about `retry_after_ms`."""

    def __init__(self, class_index: int, class_tokens: int, queue_limit: int, retry_after_ms: int, measured: bool,
                 busy: str):
        basis = "from recent completions" if measured else "no request of this size has finished yet"
        super().__init__(f"slab class {class_index} ({class_tokens} tokens): {busy}, and its queue holds "
                         f"{queue_limit} requests (the limit); retry in about {retry_after_ms} ms ({basis})")
        self.class_index = class_index
        self.class_tokens = class_tokens
        self.queue_limit = queue_limit
        self.retry_after_ms = retry_after_ms
        self.measured = measured
        self.busy = busy

    def __reduce__(self):  # copy.copy: a fresh error with the same fields (the server raises one per refusal)
        return (QueueFullError, (self.class_index, self.class_tokens, self.queue_limit, self.retry_after_ms,
                                 self.measured, self.busy))


# ---- value types --------------------------------------------------------------------------------------------------

class FinishReason(enum.Enum):
    STOP = "stop"            # EOS, a stop token id, or (via finish()) a stop string
    LENGTH = "length"        # max_tokens generated
    CANCELLED = "cancelled"  # abort()


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int                              # tokens to generate at most; the slab holds prompt + max_tokens
    eos_token_ids: frozenset[int] = frozenset()  # end the sequence (reason STOP) unless ignore_eos
    stop_token_ids: frozenset[int] = frozenset() # end the sequence (reason STOP) even with ignore_eos
    ignore_eos: bool = False
    arrival_time: float = 0.0                    # clock() when the server received it; for timings only
    deadline: float | None = None                # first-token deadline when the caller already ran admission
    projected: float | None = None               # and when that admission projected its first token


@dataclass(frozen=True, slots=True)
class StepChunk:
    """One sequence's tokens in a step; duck-types `runtime.step.SeqChunk` for `StepInputs.fill`."""

    request_id: str
    slab_offset: int              # first KV row of the sequence's slab
    slab_tokens: int              # rows in the slab; start_pos + len(token_ids) <= slab_tokens always
    start_pos: int                # position of token_ids[0] (= tokens of the sequence already in its slab)
    token_ids: tuple[int, ...]    # a prefill chunk, or the one last sampled token of a decoding sequence
    sample: bool                  # True: the step must sample a token from this chunk's last row


@dataclass(frozen=True, slots=True)
class RowCopy:
    """KV rows to copy inside the arena before a step runs (every layer): src .. src+rows-1 -> dst .. dst+rows-1."""

    src: int
    dst: int
    rows: int


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    chunks: tuple[StepChunk, ...]  # decode chunks first, then prefill chunks
    bucket: int                    # smallest bucket >= num_scheduled_tokens: the static step shape to run
    num_scheduled_tokens: int      # real tokens in the step (the rest of the bucket is padding)
    copies: tuple[RowCopy, ...] = ()  # run in order before the step (retained prefixes copied into new slabs)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    token_id: int
    finished: FinishReason | None  # set on the request's last event; its slab is already free


@dataclass(frozen=True, slots=True)
class Load:
    free_per_class: tuple[int, ...]
    total_per_class: tuple[int, ...]
    queued_per_class: tuple[int, ...]
    running: int


class _Seq:
    """Mutable state of one request, from submit to its end. Lives in exactly one of: a queue, prefilling, decoding."""

    __slots__ = ("request", "seq_no", "home", "slab", "num_prompt", "num_computed", "num_output", "last_token",
                 "done", "grant", "deadline", "projected", "cached", "copy")

    def __init__(self, request: Request, seq_no: int, home: int):
        self.request = request
        self.seq_no = seq_no            # submit order: ties and FIFO admission across queues
        self.home = home                # smallest class that fits prompt + max_tokens
        self.slab: Slab | None = None
        self.num_prompt = len(request.prompt_ids)
        self.num_computed = 0           # tokens whose KV is written (completed steps only)
        self.num_output = 0
        self.last_token = -1            # the token the next decode step feeds
        self.done = False
        self.grant = 0                  # prefill tokens granted in the step being packed
        self.deadline = math.inf        # clock() by which its first token is due (admission by latency)
        self.projected = math.inf       # clock() when admission expected its first token (inf: not projected)
        self.cached = 0                 # prompt tokens whose KV it found in its slab (or had copied in)
        self.copy: RowCopy | None = None  # its copy, until the step that runs it is scheduled


# ---- the scheduler ------------------------------------------------------------------------------------------------

class Scheduler:
    """Admission into slabs and packing of steps, for one engine. Sizes come from the plan: `classes` (the slab
    table), `max_seqs`, `step_tokens` and `buckets` (ascending, the last one is step_tokens); `queue_limit` bounds
    each class's queue; `prefill_chunk` caps one sequence's prefill tokens per step (None: step_tokens);
    `oldest_prefill_share` is the share of the prefill budget guaranteed to the oldest prefilling sequence;
    `max_queue_delay_s` (None: off) turns on admission by latency (runtime.admission). `prefix_reuse` keeps each
    slab's token ids as it falls free and places a new request where its prompt's longest prefix already is
    (module docstring); `copy_min_tokens` (None: never) is the shortest prefix worth copying from another slab."""

    def __init__(self, classes: Sequence[SlabClass], max_seqs: int, step_tokens: int, buckets: Sequence[int],
                 queue_limit: int, prefill_chunk: int | None = None, clock: Callable[[], float] = time.monotonic,
                 *, oldest_prefill_share: float = 0.25, max_queue_delay_s: float | None = None,
                 prefix_reuse: bool = False, copy_min_tokens: int | None = None,
                 prefix_block: int = BLOCK_TOKENS):
        _check_config(max_seqs, step_tokens, buckets, queue_limit, prefill_chunk, oldest_prefill_share)
        if max_queue_delay_s is not None and not max_queue_delay_s > 0:
            raise ValueError(f"max_queue_delay_s must be > 0 or None, got {max_queue_delay_s}")
        self.allocator = SlabAllocator(classes)
        self.max_seqs = max_seqs
        self.step_tokens = step_tokens
        self.buckets = tuple(buckets)
        self.queue_limit = queue_limit
        self.prefill_chunk = prefill_chunk if prefill_chunk is not None else step_tokens
        self.oldest_prefill_share = oldest_prefill_share
        self._clock = clock
        n = len(self.allocator.classes)
        self._queues: list[OrderedDict[str, _Seq]] = [OrderedDict() for _ in range(n)]
        self._num_queued = 0
        self._live: dict[str, _Seq] = {}         # every queued or running request
        self._prefilling: dict[str, _Seq] = {}   # admission order: the first one is the oldest
        self._decoding: dict[str, _Seq] = {}
        self._inflight: tuple[ScheduledStep, tuple[_Seq, ...]] | None = None
        self._next_seq_no = 0
        self._recent_frees = [deque(maxlen=_RECENT_FREES) for _ in range(n)]
        self.max_queue_delay_s = max_queue_delay_s
        self.step_times = StepTimes(self.buckets)  # measured by schedule() .. complete_step()
        self._step_started = 0.0
        self._step_pairs = 0  # (query row, key) pairs the in-flight step's prefill chunks attend over
        self.step_due = 0.0   # clock() when the step in flight should end (0: none): a newcomer waits for it
        self.prefix = PrefixIndex(self.allocator.slabs(), prefix_block) if prefix_reuse else None
        self.copy_min_tokens = copy_min_tokens
        self._copies: list[_Seq] = []     # placed with a copy that no scheduled step has run yet
        self.prefix_hit_tokens = 0       # prompt tokens served from retained KV, over every placed request
        self.prefix_miss_tokens = 0      # prompt tokens placed requests had to prefill
        self._arrivals: deque[Arrival] = deque()  # admitted prefill work of the last LOAD_WINDOW_S: the load to come
        self.projection_error = ProjectionError()  # first tokens against their projections, measured as they come

    @property
    def max_request_tokens(self) -> int:
        """Largest prompt + max_tokens accepted (for GetModelInfo)."""
        return self.allocator.max_tokens

    @property
    def num_running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    def has_work(self) -> bool:
        return bool(self._live)

    # ---- requests in ----------------------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Admit `request` to a slab now, or queue it. Raises InvalidRequestError, OutOfRangeError, QueueFullError."""
        _validate(request)
        if request.request_id in self._live:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already queued or running")
        need = len(request.prompt_ids) + request.max_tokens
        home = self.allocator.class_for(need)
        if home is None:
            raise OutOfRangeError(need, self.allocator.max_tokens)
        seq = _Seq(request, self._next_seq_no, home)
        # Queues hold only requests that cannot be placed, so a slab free now is one no waiting request can use.
        target = self.allocator.smallest_free_class(home) if self.num_running < self.max_seqs else None
        if target is None and len(self._queues[home]) >= self.queue_limit:
            raise self._queue_full(home)
        seq.cached = self.expected_cached(request.prompt_ids)  # for admission by latency until it is placed
        if request.deadline is not None:
            seq.deadline = request.deadline
            seq.projected = request.projected if request.projected is not None else math.inf
        elif self.max_queue_delay_s is not None:
            admitted = self.admission_view().decide(seq.num_prompt - seq.cached, home, self._clock(),
                                                    done=seq.cached)  # or DelayBoundError
            seq.deadline, seq.projected = admitted.promise, admitted.projected
        self._arrivals.append(Arrival(self._clock(), seq.num_prompt - seq.cached, seq.cached))
        self._next_seq_no += 1
        self._live[request.request_id] = seq
        if target is None:
            self._queues[home][request.request_id] = seq
            self._num_queued += 1
        else:
            self._start(seq, target)

    def first_token_promise(self, request_id: str) -> tuple[float, float]:
        """(deadline, projected first token) that admission by latency gave a queued or running request
        (clock() times; math.inf: none)."""
        seq = self._live[request_id]
        return seq.deadline, seq.projected

    def abort(self, request_id: str) -> bool:
        """Cancel a queued or running request; its slab is free at once. False if it is not queued or running."""
        return self.finish(request_id, FinishReason.CANCELLED)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """End a request for a reason found outside the scheduler (a stop string). False if it already ended.

        No event is produced: the caller, which chose `reason`, sends the request's final event itself.
        """
        if not isinstance(reason, FinishReason):
            raise TypeError(f"reason must be a FinishReason, got {reason!r}")
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._end(seq)
        self._admit_queued()
        return True

    # ---- steps ----------------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Pack the next step, or None when nothing is running (and so nothing is queued either)."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called while the previous step is in flight: complete_step() or "
                               "discard_step() it first")
        # 1) admit: normally a no-op, since admission also runs after every submit and release
        self._admit_queued()
        chunks: list[StepChunk] = []
        seqs: list[_Seq] = []
        # 2) decode: one token for every sequence past its prompt
        for seq in self._decoding.values():
            slab = seq.slab
            chunks.append(StepChunk(seq.request.request_id, slab.offset, slab.tokens, seq.num_computed,
                                    (seq.last_token,), True))
            seqs.append(seq)
        # 3) prefill: chunks of prompts into what is left of the token budget
        decode_rows = len(chunks)
        num_tokens = decode_rows + self._pack_prefills(self.step_tokens - decode_rows, chunks, seqs)
        if not chunks:
            return None
        # what the prefill chunks attend over (admission's step-time model; decode rows are in the buckets' base)
        self._step_pairs = sum(prefill_pairs(c.start_pos, len(c.token_ids)) for c in chunks[decode_rows:])
        copies = tuple(seq.copy for seq in self._copies)  # every pending copy, in admission order
        for seq in self._copies:
            seq.copy = None
        self._copies.clear()
        step = ScheduledStep(tuple(chunks), self.buckets[bisect_left(self.buckets, num_tokens)], num_tokens, copies)
        self._inflight = (step, tuple(seqs))
        self._step_started = self._clock()
        self.step_due = self._step_started + self.step_times.expected(step.bucket, self._step_pairs)
        return step

    def complete_step(self, step: ScheduledStep, sampled: Mapping[str, int]) -> list[TokenEvent]:
        """Record the step's KV writes and sampled tokens; return one event per sampled, still-live sequence.

        `sampled` must hold a token for every chunk with sample=True whose request is still live; tokens for other
        request ids (aborted mid-step, non-final prefill chunks) are ignored.
        """
        seqs = self._check_inflight(step, sampled)
        self._inflight = None
        self.step_due = 0.0
        self.step_times.observe(step.bucket, self._clock() - self._step_started, self._step_pairs)
        events: list[TokenEvent] = []
        for chunk, seq in zip(step.chunks, seqs):
            if seq.done:  # aborted or finished while the step ran: its token is dropped
                continue
            if self.prefix is not None:  # its rows start_pos .. now hold these tokens
                self.prefix.extend(seq.slab, chunk.token_ids)
            seq.num_computed += len(chunk.token_ids)
            if chunk.sample:
                events.append(self._append_token(seq, sampled[chunk.request_id]))
        self._admit_queued()
        return events

    def discard_step(self, step: ScheduledStep) -> None:
        """Forget an in-flight step that failed to run: nothing advanced, so the same work is scheduled again (a
        prompt whose copy the step carried is prefilled from its first token instead)."""
        if self._inflight is None or self._inflight[0] is not step:
            raise ValueError("discard_step(): this step is not the one in flight")
        self._inflight = None
        self.step_due = 0.0
        for copy in step.copies:  # it may have failed before its copies ran: those prompts start from row 0
            for seq in self._prefilling.values():
                if seq.slab.offset == copy.dst and seq.num_computed == seq.cached == copy.rows:
                    self.prefix_hit_tokens -= seq.cached
                    self.prefix_miss_tokens += seq.cached
                    seq.cached = seq.num_computed = 0
                    self.prefix.truncate(seq.slab, 0)

    # ---- introspection --------------------------------------------------------------------------------------------

    def full_queues(self) -> dict[int, QueueFullError]:
        """Per slab class whose next request `submit` would refuse right now (its queue at the limit and nothing
        free that fits), the error it would raise. A snapshot: the server publishes it after every step so it can
        answer RESOURCE_EXHAUSTED without waiting for the step in progress."""
        full = {}
        for home, waiting in enumerate(self._queues):
            if len(waiting) >= self.queue_limit and (self.num_running >= self.max_seqs
                                                     or self.allocator.smallest_free_class(home) is None):
                full[home] = self._queue_full(home)
        return full

    def admission_view(self, unsubmitted: Sequence[tuple[int, float, int]] = ()) -> AdmissionView:
        """A copy of what admission by latency needs (its cap is `max_queue_delay_s`; callers' deadlines apply
        without one). `unsubmitted`: (prompt tokens to prefill, deadline, tokens reused before them) of requests a
        caller has admitted against an earlier view but not yet submitted."""
        pending = [Pending(_remaining_prompt(s), s.seq_no, s.deadline, s.num_computed)
                   for s in self._prefilling.values()]
        pending += [Pending(s.num_prompt - s.cached, s.seq_no, s.deadline, s.cached)
                    for q in self._queues for s in q.values()]
        pending += [Pending(n, self._next_seq_no + i, d, c) for i, (n, d, c) in enumerate(unsubmitted)]
        oldest = next(iter(self._prefilling.values())).seq_no if self._prefilling else None
        since = self._clock() - LOAD_WINDOW_S
        while self._arrivals and self._arrivals[0].at < since:
            self._arrivals.popleft()
        return AdmissionView(self.max_queue_delay_s, pending, oldest, len(self._decoding), self.step_tokens,
                             self.buckets, self.step_times.snapshot(), self.oldest_prefill_share,
                             [self._slab_wait_s(h) for h in range(len(self._queues))],
                             self._next_seq_no + len(unsubmitted), self.step_times.pair_seconds, self._arrivals,
                             self._step_due, self.projection_error.relative)

    def _step_due(self) -> float:
        return self.step_due  # read on a front door's thread: one attribute, replaced whole by the engine thread

    def expected_cached(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens a placement will most likely find in a slab (0 with reuse off). Safe to call from other
        threads (PrefixIndex.estimate): the server's admission by latency counts only the prefill left."""
        return 0 if self.prefix is None else self.prefix.estimate(prompt_ids, len(prompt_ids) - 1)

    def declare_prefix(self, first_row: int, token_ids: Sequence[int]) -> None:
        """Rows first_row .. first_row + len(token_ids) - 1 of the arena (outside every slab class) hold these
        tokens' KV for good: a declared prefix, which placement copies from and never hands out."""
        if self.prefix is None:
            raise RuntimeError("declare_prefix: prefix reuse is off")
        slab = Slab(DECLARED, first_row, len(token_ids))
        self.prefix.register(slab)
        self.prefix.extend(slab, token_ids)

    def forget_free_prefixes(self) -> None:
        """Free slabs hold nothing known any more (the engine's warm-up wrote into them)."""
        if self.prefix is not None:
            for slab in self.allocator.slabs():
                if self.allocator.is_free(slab):
                    self.prefix.truncate(slab, 0)

    def load(self) -> Load:
        return Load(self.allocator.free_counts(), self.allocator.total_counts(),
                    tuple(len(q) for q in self._queues), self.num_running)

    # ---- internals ------------------------------------------------------------------------------------------------

    def _pack_prefills(self, budget: int, chunks: list[StepChunk], seqs: list[_Seq]) -> int:
        """Append prefill chunks within `budget` tokens; return the tokens used. O(prefilling log prefilling)."""
        if not self._prefilling or budget <= 0:
            return 0
        # a) the oldest prefilling sequence's guaranteed share: the starvation bound in the module docstring
        oldest = next(iter(self._prefilling.values()))
        share = max(1, int(budget * self.oldest_prefill_share))
        oldest.grant = min(oldest.num_prompt - oldest.num_computed, share, self.prefill_chunk)
        left = budget - oldest.grant
        # b) shortest remaining prompt first (stable sort: ties stay in admission order)
        order = sorted(self._prefilling.values(), key=_remaining_prompt)
        for seq in order:
            if left == 0:
                break
            extra = min(seq.num_prompt - seq.num_computed, self.prefill_chunk) - seq.grant
            if extra > 0:
                extra = min(extra, left)
                seq.grant += extra
                left -= extra
        # c) emit in SRPT order, so the chunks of short prompts lead the batch
        for seq in order:
            if seq.grant:
                self._emit_prefill(seq, chunks, seqs)
        return budget - left

    def _emit_prefill(self, seq: _Seq, chunks: list[StepChunk], seqs: list[_Seq]) -> None:
        start, end = seq.num_computed, seq.num_computed + seq.grant
        seq.grant = 0
        slab = seq.slab
        chunks.append(StepChunk(seq.request.request_id, slab.offset, slab.tokens, start,
                                seq.request.prompt_ids[start:end], end == seq.num_prompt))
        seqs.append(seq)

    def _check_inflight(self, step: ScheduledStep, sampled: Mapping[str, int]) -> tuple[_Seq, ...]:
        """The in-flight step's sequences, after checking `sampled` covers it (before any state changes)."""
        if self._inflight is None or self._inflight[0] is not step:
            raise ValueError("complete_step(): this step is not the one in flight")
        seqs = self._inflight[1]
        missing = [c.request_id for c, s in zip(step.chunks, seqs)
                   if c.sample and not s.done and c.request_id not in sampled]
        if missing:
            raise ValueError(f"complete_step(): no sampled token for {len(missing)} request(s), e.g. {missing[:3]}")
        return seqs

    def _append_token(self, seq: _Seq, token: int) -> TokenEvent:
        request = seq.request
        seq.num_output += 1
        seq.last_token = token
        if token in request.stop_token_ids or (not request.ignore_eos and token in request.eos_token_ids):
            reason: FinishReason | None = FinishReason.STOP
        elif seq.num_output >= request.max_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = None
        first = seq.num_output == 1
        if first and seq.projected < math.inf:  # admission's projection of this first token, against it
            arrival = request.arrival_time
            self.projection_error.observe(seq.projected - arrival, self._clock() - arrival)
        if reason is not None:
            self._end(seq)
        elif first:  # the first token ends the prefill
            del self._prefilling[request.request_id]
            self._decoding[request.request_id] = seq
        return TokenEvent(request.request_id, token, reason)

    def _start(self, seq: _Seq, class_index: int) -> None:
        """Give `seq` a slab (class_index: the smallest free class at or above its home) and start its prefill,
        after the prefix its slab already holds when reuse is on."""
        if self.prefix is None:
            seq.slab = self.allocator.allocate(class_index)
        else:
            self._place(seq, class_index)
        self.prefix_hit_tokens += seq.cached
        self.prefix_miss_tokens += seq.num_prompt - seq.cached
        self._prefilling[seq.request.request_id] = seq

    def _place(self, seq: _Seq, class_index: int) -> None:
        """Where a request goes when slabs keep their prefixes. Its prompt's longest prefix held by a free slab it
        fits (direct) and by any slab at all (copy source) are looked up; then, in order:
          1. the direct slab, when the request keeps at least half of the rows it holds (a conversation's next turn,
             a file context with another tail: what is lost is the old tail, worth less than the rows kept) and no
             slab holds a prefix longer by `copy_min_tokens` or more;
          2. a copy of the longest prefix into the least recently used free slab of `class_index`, when it is at
             least `copy_min_tokens` long and no shorter than the direct one (copying keeps the source's rows for
             others: a shared system prompt does not cost a conversation its history);
          3. the direct slab anyway, when a copy is not possible;
          4. the least recently used free slab of `class_index`, from position 0.
        At least the prompt's last token is always computed, for its logits."""
        prompt, limit, prefix = seq.request.prompt_ids, seq.num_prompt - 1, self.prefix
        home, allocator = seq.home, self.allocator
        direct = prefix.longest(prompt, limit, lambda s: s.class_index >= home and allocator.is_free(s))
        anywhere = prefix.longest(prompt, limit, _anywhere) if self.copy_min_tokens is not None else NO_MATCH
        loses = prefix.held(direct.slab) - direct.tokens if direct.slab is not None else 0
        copy = anywhere.slab is not None and anywhere.tokens >= max(self.copy_min_tokens, direct.tokens)
        if direct.slab is not None and loses <= direct.tokens and not (
                copy and anywhere.tokens >= direct.tokens + self.copy_min_tokens):
            self._take(seq, direct)
        elif copy:
            seq.slab = allocator.allocate_lru(class_index, avoid=anywhere.slab)
            if seq.slab == anywhere.slab:  # the source is the only free slab that fits: take it as it is
                allocator.free(seq.slab)
                self._take(seq, prefix.longest(prompt, limit, lambda s: s == anywhere.slab))
                return
            seq.copy = RowCopy(anywhere.slab.offset, seq.slab.offset, anywhere.tokens)
            self._copies.append(seq)
            prefix.assign(seq.slab, prompt[: anywhere.tokens])
            seq.cached = seq.num_computed = anywhere.tokens
        elif direct.slab is not None:
            self._take(seq, direct)
        else:
            seq.slab = allocator.allocate_lru(class_index)
            prefix.truncate(seq.slab, 0)
            seq.cached = seq.num_computed = 0

    def _take(self, seq: _Seq, match: Match) -> None:
        seq.slab = self.allocator.allocate_slab(match.slab)
        self.prefix.truncate(seq.slab, match.tokens)
        seq.cached = seq.num_computed = match.tokens

    def _end(self, seq: _Seq) -> None:
        """Drop `seq` from wherever it is and free its slab now. The caller runs admission afterwards."""
        rid = seq.request.request_id
        seq.done = True
        del self._live[rid]
        if seq.slab is None:
            del self._queues[seq.home][rid]
            self._num_queued -= 1
            return
        if self._prefilling.pop(rid, None) is None:
            del self._decoding[rid]
        if seq.copy is not None:  # ended before its copy ran: its slab holds nothing known
            self._copies.remove(seq)
            seq.copy = None
            self.prefix.truncate(seq.slab, 0)
        self.allocator.free(seq.slab)
        self._recent_frees[seq.slab.class_index].append(self._clock())

    def _admit_queued(self) -> None:
        """Place waiting requests, oldest first among those with a free slab at or above their home class."""
        while self._num_queued and self.num_running < self.max_seqs:
            best: _Seq | None = None
            target = None
            for home, queue in enumerate(self._queues):
                if not queue:
                    continue
                head = next(iter(queue.values()))
                if best is not None and head.seq_no > best.seq_no:
                    continue
                free = self.allocator.smallest_free_class(home)
                if free is not None:
                    best, target = head, free
            if best is None:
                return
            del self._queues[best.home][best.request.request_id]
            self._num_queued -= 1
            self._start(best, target)

    def _free_rate(self, home: int) -> float:
        """Slabs freed per second in classes >= home (any of them can take this queue's head); 0 if unknown."""
        now = self._clock()
        rate = 0.0
        for frees in self._recent_frees[home:]:
            if len(frees) >= 2 and now > frees[0]:
                rate += (len(frees) - 1) / (now - frees[0])
        return rate

    def _slab_wait_s(self, home: int) -> float:
        """Expected wait for a slab of a new request of class `home`: 0 when one is free now, else its place in
        the queue over the measured rate of frees (0 while unmeasured: the queue limit still bounds it)."""
        if self.num_running < self.max_seqs and self.allocator.smallest_free_class(home) is not None:
            return 0.0
        rate = self._free_rate(home)
        return (len(self._queues[home]) + 1) / rate if rate > 0 else 0.0

    def _queue_full(self, home: int) -> QueueFullError:
        """The error for a full queue, with a retry hint: the mean gap between recent slab frees it could use."""
        rate = self._free_rate(home)
        measured = rate > 0
        retry_ms = min(_MAX_RETRY_MS, max(1, round(1000 / rate))) if measured else _DEFAULT_RETRY_MS
        busy = (f"all {self.max_seqs} sequence slots are running" if self.num_running >= self.max_seqs
                else "every slab that fits is in use")
        return QueueFullError(home, self.allocator.classes[home].tokens, self.queue_limit, retry_ms, measured, busy)


def _anywhere(slab: Slab) -> bool:
    return True


def _remaining_prompt(seq: _Seq) -> int:
    return seq.num_prompt - seq.num_computed


def _validate(request: Request) -> None:
    """INVALID_ARGUMENT checks, cheap enough to run on every submit (no per-token Python loop)."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    if not isinstance(request.prompt_ids, tuple):
        raise InvalidRequestError("prompt_ids",
                                  f"must be a tuple of token ids, got {type(request.prompt_ids).__name__}")
    if not request.prompt_ids:
        raise InvalidRequestError("prompt_ids", "the prompt is empty; at least one token is needed")
    if min(request.prompt_ids) < 0:
        raise InvalidRequestError("prompt_ids", f"token id {min(request.prompt_ids)} is negative")
    if type(request.max_tokens) is not int or request.max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {request.max_tokens!r}")


def _check_config(max_seqs: int, step_tokens: int, buckets: Sequence[int], queue_limit: int,
                  prefill_chunk: int | None, oldest_prefill_share: float) -> None:
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    if step_tokens < max_seqs:
        raise ValueError(f"step_tokens ({step_tokens}) must be >= max_seqs ({max_seqs}) so one step can decode "
                         f"every running sequence")
    if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] != step_tokens:
        raise ValueError(f"buckets must be strictly ascending positive token counts ending at step_tokens "
                         f"({step_tokens}), got {tuple(buckets)}")
    if queue_limit < 0:
        raise ValueError(f"queue_limit must be >= 0, got {queue_limit}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")
    if not 0.0 < oldest_prefill_share <= 1.0:
        raise ValueError(f"oldest_prefill_share must be in (0, 1], got {oldest_prefill_share}")
