"""Admission by latency: refuse at once the request whose first token the server cannot deliver in time.

Slabs and queue limits bound memory, not compute. On a machine where a full step takes a second, 32 running
sequences and a few waiting per class can push every first token back by tens of seconds when requests arrive
faster than the steps can prefill them. Who decides how long is too long? The caller first: a request may carry a
first-token deadline (its gRPC deadline, or the request's own `first_token_deadline_ms`), and the operator's
`max_queue_delay_s` (the plan's `max_queue_delay_ms`; None: no cap) bounds every request's wait:

- With a cap, every admitted request gets the server's promise of a first-token deadline: its arrival, plus the
  time its own prompt takes to prefill on an otherwise idle server (`AdmissionView.seconds_for`), plus the wait it
  may have for work admitted before it: `max_queue_delay_s`, or its own prefill time when that is longer (a
  6k-token analysis that prefills for 20 s may wait 20 s behind another one). Without a cap there is no promise.
- A new request is projected under the scheduler's prefill order (shortest remaining prompt first, the oldest
  prefilling sequence guaranteed its share of every step): its first token comes after the prompts shorter than
  its own, its own prompt, and the oldest sequence's share, plus the wait for a slab when none is free now. It is
  refused (`DelayBoundError`, RESOURCE_EXHAUSTED with a retry pushback) when that misses its own deadline (the
  caller's or the cap's, whichever is sooner), or when the prefill work it puts ahead of longer admitted prompts
  would make one of them miss the server's promise (counted as if nothing else arrived: their promises already
  allow for the load to come, below). An admitted prompt already projected past its promise without
  the newcomer (its prefill ran slower than projected: attention over a long prompt grows with its length) is not
  protected that way: refusing every shorter request for the rest of its prefill would save it only their few
  steps (measured on the IDE mix at 0.4 req/s: 15 of 92 completions refused, all for analyses already late),
  while the oldest sequence's share of each step keeps it moving whatever arrives. Nor is one the newcomer would
  make late by no more than the projection's own error (`ProjectionError`: how far first tokens have come from
  their projections, relative, times what is left of this one's): inside that error the projection cannot tell
  whether refusing saves the promise, and the refusal is certain. For the same reason a newcomer is not refused
  for its own promise (the cap's) when it would miss it by no more than that error; a caller's deadline is kept
  strictly. Until enough first tokens are measured the projection is taken as exact.
- A caller's deadline is checked once, at admission, and is not a promise the server keeps against later
  arrivals (their callers' deadlines would then refuse everyone who came after): the caller's own deadline
  cancels the call if the projection turns out wrong. A request with no deadline and no cap waits its turn,
  bounded only by the slabs and the per-class queues.

The load to come: under that order a prompt is overtaken not only by the shorter prompts pending when it arrives
but by every shorter one that arrives while it waits and prefills, so on a busy server a long prefill takes longer
than the same prefill alone (an analysis at 0.4 req/s of the IDE mix took 1.36x its projection, and one first
token came 8.6 s past its promise). The view therefore counts the prefill work admitted over the last
`LOAD_WINDOW_S` seconds: the prompts shorter than r tokens took a share `load_below(r)` of the machine's time, and
the same share of every second to come is projected to go to newcomers ahead of a prompt while it has r tokens
left. Its wait is projected at 1 / (1 - load_below(its tokens)) times its idle length, and its own prefill at the
mean of that factor as its tokens left run down (its last tokens are overtaken by fewer newcomers); the load is
taken at most `MAX_LOAD` (the oldest prefilling sequence's share of every step keeps it moving whatever arrives).
The promise is made at the same load: its own prefill time at the current load, and as long again (or the cap)
to wait. The view is published after a step and read while the next one runs, which a newcomer waits for: what the
step times say is left of it counts too. An idle server projects as before.

Step times are measured (an exponential average per bucket, seeded by the engine's warm-up), so the bound holds
on the machine the server runs on rather than the one the plan was built on. A step's time is modelled as its
bucket's base time plus `pair_seconds` for every (query row, key) pair its prefill chunks attend over: attention
grows with the context, so a 256-row chunk at position 6,000 costs about 3.5x the same chunk at position 0 on two
cores, and a projection linear in prompt length promised a 6k-token analysis its first token in about half the time
its prefill took. The warm-up measures the pair cost (a chunk deep in a slab against the same bucket at position
0); steps whose attention dominates keep refining it, the others the bucket's base. Everything here is pure Python: the
server runs `AdmissionView.admit` on a front door's thread against the view published after the last step, so a
refusal comes back without waiting for the step in progress.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

STEP_TIME_WEIGHT = 0.3  # weight of the newest step in the per-bucket average of step times
LOAD_WINDOW_S = 60.0    # admitted prefill work over this many seconds measures the load to come
MAX_LOAD = 0.75         # at most this share of the time to come is projected to go to newcomers (a 4x stretch)
ERROR_FIRST_TOKENS = 64  # the projection's error is measured over this many recent first tokens ...
ERROR_MIN_FIRST_TOKENS = 8  # ... once at least this many came (before: 0, every projection taken as exact)
ERROR_MIN_PROJECTED_S = 0.5  # ... that were projected at least this far ahead (a step's jitter is not the error)
MAX_ERROR = 0.25        # at most this relative error is allowed a projection: the leniency the error buys makes
                        # long prompts later, which the next measurements see as more error (sweep-1208c: 0.37-0.5)


def prefill_pairs(done: int, rows: int) -> int:
    """(query row, key) pairs a prefill of `rows` tokens attends over after `done` tokens of its sequence: row j
    (position done + j) sees done + j + 1 keys."""
    return rows * done + rows * (rows + 1) // 2 if rows > 0 else 0


class OverloadedError(RuntimeError):
    """RESOURCE_EXHAUSTED: the request was refused to protect latency or memory; retry after `retry_after_ms`."""

    class_index: int
    retry_after_ms: int


class DelayBoundError(OverloadedError):
    """RESOURCE_EXHAUSTED: admitting this request would delay a first token (its own or an admitted request's)
    past its deadline: the caller's, or the plan's `max_queue_delay_ms` (`bound_ms`, 0 when there is none)."""

    def __init__(self, class_index: int, late_ms: int, bound_ms: int, whose: str, retry_after_ms: int | None = None):
        limit = "the caller's deadline" if whose.endswith("(the caller's deadline)") else (
            f"a wait of max_queue_delay_ms = {bound_ms} ms, or of the prompt's own prefill time when longer")
        super().__init__(f"slab class {class_index}: with the prefill work already admitted, {whose.split(' (')[0]} "
                         f"first token would come about {late_ms} ms past its deadline ({limit}); retry in about "
                         f"{retry_after_ms or late_ms} ms")
        self.class_index = class_index
        self.late_ms = late_ms
        self.bound_ms = bound_ms
        self.retry_after_ms = retry_after_ms or late_ms
        self.whose = whose

    def __reduce__(self):
        return (DelayBoundError, (self.class_index, self.late_ms, self.bound_ms, self.whose, self.retry_after_ms))


class ProjectionError:
    """How far admission's projections of first tokens are off: over the last ERROR_FIRST_TOKENS first tokens that
    were projected at least ERROR_MIN_PROJECTED_S ahead, the root mean square of (actual / projected - 1) with each
    weighted by its projected time, so the long projections that protection judges count most. 0 until
    ERROR_MIN_FIRST_TOKENS are in; at most MAX_ERROR."""

    def __init__(self) -> None:
        self._seen: deque[tuple[float, float]] = deque(maxlen=ERROR_FIRST_TOKENS)  # (projected s, actual s)
        self.relative = 0.0

    def observe(self, projected_s: float, actual_s: float) -> None:
        """A first token projected `projected_s` after its admission came `actual_s` after it."""
        if not (projected_s >= ERROR_MIN_PROJECTED_S and math.isfinite(projected_s) and actual_s >= 0):
            return
        self._seen.append((projected_s, actual_s))
        if len(self._seen) >= ERROR_MIN_FIRST_TOKENS:
            weight = sum(p for p, _ in self._seen)
            square = sum(p * (a / p - 1.0) ** 2 for p, a in self._seen) / weight
            self.relative = min(MAX_ERROR, math.sqrt(square))


class StepTimes:
    """Seconds per step: each bucket's base time, plus `pair_seconds` per (query row, key) pair of its prefill
    chunks. Seeded by the warm-up, then exponential averages of real steps: a step whose attention takes at least
    as long as its base (by the current figures) refines the pair cost, any other step its bucket's base."""

    def __init__(self, buckets: Sequence[int]):
        self.buckets = tuple(buckets)
        self._seconds: dict[int, float] = {}
        self.pair_seconds = 0.0

    def seed(self, seconds: Mapping[int, float], pairs: Mapping[int, int] | None = None,
             pair_seconds: float = 0.0) -> None:
        """`seconds`: measured step times per bucket, of steps that attended over `pairs[bucket]` pairs."""
        self.pair_seconds = max(0.0, float(pair_seconds))
        for bucket, s in seconds.items():
            base = s - self.pair_seconds * (pairs or {}).get(bucket, 0)
            if bucket in self.buckets and base > 0:
                self._seconds[bucket] = float(base)

    def observe(self, bucket: int, seconds: float, pairs: int = 0) -> None:
        if seconds <= 0 or bucket not in self.buckets:
            return
        old = self._seconds.get(bucket)
        attention = self.pair_seconds * pairs
        if old is not None and pairs > 0 and self.pair_seconds > 0 and attention >= old:
            if seconds > old:  # attention-bound: what the pairs cost beyond the bucket's base
                observed = (seconds - old) / pairs
                self.pair_seconds += STEP_TIME_WEIGHT * (observed - self.pair_seconds)
            return
        base = seconds - attention
        if base <= 0:
            return
        self._seconds[bucket] = base if old is None else old + STEP_TIME_WEIGHT * (base - old)

    def expected(self, bucket: int, pairs: int = 0) -> float:
        """Seconds a step of `bucket` attending over `pairs` pairs should take (0 while nothing is measured)."""
        if not self._seconds:
            return 0.0
        return bucket_seconds(self._seconds, bucket) + self.pair_seconds * pairs

    def snapshot(self) -> dict[int, float]:
        return dict(self._seconds)


@dataclass(frozen=True, slots=True)
class Arrival:
    """An admitted request's prefill work, for the load to come: when, how many tokens, after how many reused."""

    at: float            # clock() when it was admitted
    tokens: int          # prompt tokens to prefill
    done: int = 0        # prompt tokens already in its slab before them


@dataclass(frozen=True, slots=True)
class Admitted:
    """What admission decided for a request: its promised first-token deadline (math.inf: none) and when the
    projection expects its first token (math.inf: nothing measured yet), both clock() times."""

    promise: float
    projected: float


@dataclass(frozen=True, slots=True)
class Pending:
    """A request that has prefill work left: queued for a slab, or prefilling."""

    remaining: int       # prompt tokens not yet prefilled
    seq_no: int          # submit order: ties in the prefill order go to the older one
    deadline: float      # clock() by which its first token is due
    done: int = 0        # prompt tokens already in its slab (prefilled, or reused): the remaining ones attend to them

    @property
    def pairs(self) -> int:
        return prefill_pairs(self.done, self.remaining)


class AdmissionView:
    """What admission needs to know, copied from the scheduler: the pending prompts, the step times, the slabs.

    `admit` both checks and records, so several requests checked against one view (between two steps) see each
    other. Not thread-safe: the caller holds a lock."""

    def __init__(self, bound_s: float | None, pending: Iterable[Pending], oldest_seq_no: int | None, decoding: int,
                 step_tokens: int, buckets: Sequence[int], step_seconds: Mapping[int, float],
                 oldest_share: float, slab_wait_s: Sequence[float], next_seq_no: int, pair_seconds: float = 0.0,
                 arrivals: Iterable[Arrival] = (), step_due: Callable[[], float] | None = None,
                 projection_error: float = 0.0):
        self.bound_s = bound_s
        self._pending = sorted(pending, key=_order)
        self._oldest = oldest_seq_no
        self._budget = max(1, step_tokens - decoding)  # prefill tokens one step can take
        self._decoding = decoding
        self._buckets = tuple(buckets)
        self._seconds = dict(step_seconds)
        self._share = oldest_share
        self._slab_wait = tuple(slab_wait_s)
        self._next_seq_no = next_seq_no
        self._pair_s = pair_seconds
        self._arrivals = list(arrivals)
        self._step_due = step_due  # clock() when the step in flight should end (0: none), read at each decision
        self._load: tuple[float, list[int], list[float], list[float]] | None = None  # _load_at's, and its now
        self._error = min(MAX_ERROR, max(0.0, projection_error))  # ProjectionError.relative

    @property
    def projection_error(self) -> float:
        """The relative error allowed for the projections of admitted requests' first tokens (see the module)."""
        return self._error

    @property
    def measured(self) -> bool:
        """False until a step time is known (the bound is not applied before)."""
        return bool(self._seconds)

    def seconds_for(self, tokens: int, pairs: int = 0) -> float:
        """Time to prefill `tokens` prompt tokens beside the decoding sequences (full steps, then one partial),
        their chunks attending over `pairs` (query row, key) pairs."""
        if tokens <= 0 or not self._seconds:
            return 0.0
        full, rest = divmod(tokens, self._budget)
        seconds = full * self._bucket_seconds(self._buckets[-1])
        if rest:
            rows = min(self._decoding + rest, self._buckets[-1])
            seconds += self._bucket_seconds(self._buckets[bisect_left(self._buckets, rows)])
        return seconds + self._pair_s * pairs

    def _load_at(self, now: float) -> tuple[list[int], list[float], list[float]]:
        """The window's admitted prompts by size: sizes ascending, the prefill seconds of the first k of them
        (sums[k]), and integral[k] = the integral over r in (0, sizes[k-1]] of 1 / (1 - load_below(r))."""
        if self._load is None or self._load[0] != now:
            recent = sorted((a.tokens, self._marginal_seconds(a)) for a in self._arrivals
                            if now - LOAD_WINDOW_S <= a.at <= now)
            sizes = [t for t, _ in recent]
            sums, integral = [0.0], [0.0]
            for k, (tokens, seconds) in enumerate(recent):
                below = sizes[k - 1] if k else 0
                integral.append(integral[-1] + (tokens - below) / (1.0 - min(MAX_LOAD, sums[-1] / LOAD_WINDOW_S)))
                sums.append(sums[-1] + seconds)
            self._load = (now, sizes, sums, integral)
        return self._load[1:]

    def load_below(self, tokens: int, now: float) -> float:
        """The share of the machine's time (0..MAX_LOAD) that prompts of fewer than `tokens` tokens to prefill took
        over the last LOAD_WINDOW_S seconds: what the prefill order will give newcomers ahead of such a prompt."""
        sizes, sums, _ = self._load_at(now)
        return min(MAX_LOAD, sums[bisect_left(sizes, tokens)] / LOAD_WINDOW_S)

    def stretch(self, tokens: int, now: float) -> float:
        """How much longer than alone a prompt with `tokens` tokens left waits for the work ahead of it, at the
        current load."""
        return 1.0 / (1.0 - self.load_below(tokens, now))

    def own_stretch(self, tokens: int, now: float) -> float:
        """The same for its own prefill, whose later tokens fewer newcomers overtake (the order goes by the tokens
        left): the mean of 1 / (1 - load_below(r)) over r = 1 .. tokens."""
        if tokens <= 0:
            return 1.0
        sizes, sums, integral = self._load_at(now)
        k = bisect_left(sizes, tokens)
        below = sizes[k - 1] if k else 0
        return (integral[k] + (tokens - below) / (1.0 - min(MAX_LOAD, sums[k] / LOAD_WINDOW_S))) / tokens

    def _marginal_seconds(self, a: Arrival) -> float:
        """What an admitted prompt's prefill adds to the steps it shares: its tokens at a full step's rate, and its
        attention."""
        if not self._seconds:
            return 0.0
        return a.tokens * self._bucket_seconds(self._buckets[-1]) / self._budget + self._pair_s * prefill_pairs(
            a.done, a.tokens)

    def deadline_for(self, prompt_tokens: int, now: float, done: int = 0) -> float:
        """The server's promise to a request arriving `now` with `done` tokens of its prompt already in a slab
        (reused): the cap's first-token deadline (math.inf: no cap). Its own prefill is counted at the current
        load (see the module docstring)."""
        if self.bound_s is None:
            return math.inf
        own = self.seconds_for(prompt_tokens, prefill_pairs(done, prompt_tokens))
        own *= self.own_stretch(prompt_tokens, now)
        return now + max(self.bound_s, own) + own

    def admit(self, prompt_tokens: int, home: int, now: float, caller_deadline: float | None = None,
              done: int = 0) -> float:
        """The server's promised deadline for a new request (see `decide`), or DelayBoundError."""
        return self.decide(prompt_tokens, home, now, caller_deadline, done).promise

    def decide(self, prompt_tokens: int, home: int, now: float, caller_deadline: float | None = None,
               done: int = 0) -> Admitted:
        """The server's promised deadline for a new request of `prompt_tokens` to prefill (after `done` reused
        ones) in slab class `home` (math.inf: none), and its projected first token, recorded in the view; or
        DelayBoundError if it cannot be admitted without a first token missing its deadline. `caller_deadline`:
        the clock() time by which the caller wants its first token (None: it set none), checked for this request
        only."""
        if not self.measured:  # no step has been timed: no promise can be made, and none is recorded
            self._record(prompt_tokens, math.inf, done, now)
            return Admitted(math.inf, math.inf)
        promise = self.deadline_for(prompt_tokens, now, done)
        deadline = min(promise, math.inf if caller_deadline is None else caller_deadline)
        new = Pending(prompt_tokens, self._next_seq_no, promise, done)
        entries = list(self._pending)
        insort(entries, new, key=_order)
        prefix = _prefix_sums(entries)
        oldest = next((e for e in entries if e.seq_no == self._oldest), None)
        # the new request itself: the slab wait, then everything before it in the prefill order
        i = entries.index(new)
        busy = max(0.0, self._step_due() - now) if self._step_due is not None else 0.0  # read once: one decision
        projected = now + self._slab_wait[home] + busy + self._projected(i, prefix, entries, oldest, now)
        late = projected - deadline
        ours = caller_deadline is None or promise < caller_deadline  # the deadline is the server's promise
        whose = "its own" if ours else "its own (the caller's deadline)"
        if ours and 0 < late <= self._error * (projected - now):
            # the server's own promise, missed by no more than the projection can tell (a 4,339-token analysis at
            # 0.4 req/s of the IDE mix was refused 40 ms past a 19 s promise); a caller's deadline is kept strictly
            late = 0.0
        # the admitted prompts it overtakes, each of which it may not make late; one already projected late without
        # it (its prefill ran slower than projected) is not protected by refusing newcomers, which would then be
        # refused for as long as it prefills while saving it only their few steps: the oldest sequence's share
        # keeps it moving whatever arrives. Their promises were made at the load to come, which is newcomers like
        # this one, so it is checked against them as if nothing else arrived: projected at the load again, its
        # work would count twice, and the shorter requests that load stands for would be refused to protect a
        # long prompt's margin (at 0.4 req/s of the IDE mix: four completions in a row, for an analysis whose
        # first token came late all the same).
        # Nor is one the newcomer would make late by no more than its projection's own error (the measured relative
        # error of the projections, times what is left of this one): within that the projection cannot tell whether
        # the refusal saves its promise, while the refusal itself is certain (at 0.4 req/s of the IDE mix, three and
        # four short prompts in a step refused for 0.06-1.6 s of a 4,339-token analysis's promise, on a projection
        # that was 1-2 s optimistic for it: it came 0.7-1.1 s late all the same).
        admitted = None  # prefix sums of the admitted entries alone, made once if some entry needs them
        for j in range(i + 1, len(entries)):
            e = entries[j]
            miss = now + busy + self._projected(j, prefix, entries, oldest, now, load=False) - e.deadline
            if miss > late and miss > 0:
                admitted = admitted or _prefix_sums(self._pending)
                # entries[j] is self._pending[j - 1]: on time without the newcomer, and late by more than the error?
                alone = busy + self._projected(j - 1, admitted, self._pending, oldest, now, load=False)
                if now + alone <= e.deadline and miss > self._error * alone:
                    late, whose = miss, "an admitted request's"
        if late > 0:
            # The work ahead shrinks as fast as the clock runs, so after `late` seconds the same request would just
            # make it; one full step more is the margin that makes a retry land on the right side of it.
            step = self._bucket_seconds(self._buckets[-1])
            raise DelayBoundError(home, max(1, math.ceil(late * 1000)), round((self.bound_s or 0) * 1000), whose,
                                  max(1, math.ceil((late + step) * 1000)))
        self._record(prompt_tokens, promise, done, now)
        return Admitted(promise, projected)

    def _projected(self, j: int, prefix: list[tuple[int, int]], entries: list[Pending], oldest: Pending | None,
                   now: float, load: bool = True) -> float:
        """Seconds to entries[j]'s first token once the step in flight is done (its slab wait aside): the work ahead
        of it, then its own prefill; at the current load (the newcomers that will overtake it), or with `load`
        False as if nothing more arrived."""
        e = entries[j]
        total = self.seconds_for(*self._ahead(j, prefix, entries, oldest))
        if not load:
            return total
        own = min(total, self.seconds_for(e.remaining, e.pairs))
        return (total - own) * self.stretch(e.remaining, now) + own * self.own_stretch(e.remaining, now)

    def _record(self, prompt_tokens: int, deadline: float, done: int, now: float) -> None:
        insort(self._pending, Pending(prompt_tokens, self._next_seq_no, deadline, done), key=_order)
        self._next_seq_no += 1
        self._arrivals.append(Arrival(now, prompt_tokens, done))
        self._load = None

    def _ahead(self, j: int, prefix: list[tuple[int, int]], entries: list[Pending],
               oldest: Pending | None) -> tuple[int, int]:
        """Prompt tokens prefilled before entries[j]'s first token, and the pairs they attend over: those before
        it in the order, its own, and the oldest sequence's guaranteed share while it is still behind."""
        work, pairs = prefix[j + 1]
        if oldest is not None and _order(oldest) > _order(entries[j]):
            extra = oldest.remaining if self._share >= 1.0 else math.ceil(work * self._share / (1.0 - self._share))
            extra = min(oldest.remaining, extra)
            work += extra
            pairs += prefill_pairs(oldest.done, extra)
        return work, pairs

    def _bucket_seconds(self, bucket: int) -> float:
        return bucket_seconds(self._seconds, bucket)


def bucket_seconds(seconds: Mapping[int, float], bucket: int) -> float:
    """The bucket's measured time, or else the nearest larger (then smaller) measured bucket's (some measured)."""
    if bucket in seconds:
        return seconds[bucket]
    larger = [b for b in seconds if b > bucket]
    return seconds[min(larger)] if larger else seconds[max(seconds)]


def _order(p: Pending) -> tuple[int, int]:
    return p.remaining, p.seq_no


def _prefix_sums(entries: Sequence[Pending]) -> list[tuple[int, int]]:
    """(tokens, pairs) of entries[:j] for every j."""
    sums = [(0, 0)]
    for e in entries:
        tokens, pairs = sums[-1]
        sums.append((tokens + e.remaining, pairs + e.pairs))
    return sums
