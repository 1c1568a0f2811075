"""The KV slab planner: slab classes (capacity in tokens, count) for a workload, under a KV memory budget.

Contract: a request needs `prompt + max_output` tokens of KV and holds one slab, of the smallest class with at least
that capacity, from admission to its end. Given what requests need (`NeedDistribution`, from a declared mix or an
observed trace), `plan_slabs` chooses classes and counts that maximize the number of requests of that mix held at
once within the budget and `max_seqs`; `evaluate_slabs` scores classes listed by hand. Both return a `SlabPlan`
with its figures (token-weighted utilization, internal waste, admitted concurrency) and, for the same budget and
mix, what one `max_context` slot per sequence and a 16-token paged pool would give. Every plan is verified
(`verify_slab_plan`) before it is returned. Pure functions of their inputs: the same inputs give the same plan.

Definitions used throughout:
- utilization: tokens the requests need / slab tokens they hold, token-weighted (E[need] / E[capacity held]).
- internal waste: 1 - utilization; in bytes, the held but never used KV at the admitted concurrency.
- admitted concurrency: the largest N such that N requests drawn in the mix's proportions all hold a slab at once
  (a request may take a larger class than its smallest fitting one), capped by `max_seqs`.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from slabserve.compiler.spec import KVSpec, RequestClass
from slabserve.runtime.units import format_bytes, round_up

PAGE_TOKENS = 16  # page size of the paged pool used for comparison (vLLM's default block size)
DEFAULT_GRANULARITY = 16  # planned slab capacities are multiples of this many tokens
DEFAULT_MAX_CLASSES = 4  # each class has its own admission queue: few classes, more slabs each, shorter waits
MAX_CANDIDATES = 128  # capacities the class search considers; above this, a quantile grid of the needs
_EPS = 1e-9  # float slack when a share times a count should be a whole number


class SlabPlanError(ValueError):
    """The slabs cannot be planned, or listed slabs do not fit. The message says which number to change."""


# ---------------------------------------------------------------------------------------------------------------
# What requests need


@dataclass(frozen=True, slots=True)
class NeedDistribution:
    """KV tokens a request needs (prompt + max output): distinct values, ascending, with their probabilities."""

    needs: tuple[int, ...]
    probs: tuple[float, ...]
    cdf: tuple[float, ...] = field(init=False, repr=False, compare=False)  # P(need <= needs[i]); the last is 1

    def __post_init__(self) -> None:
        if not self.needs or len(self.needs) != len(self.probs):
            raise SlabPlanError("a need distribution needs at least one value, with one probability each")
        if any(b <= a for a, b in zip(self.needs, self.needs[1:])) or self.needs[0] < 1:
            raise SlabPlanError("need values must be >= 1 and strictly ascending")
        if any(p < 0 for p in self.probs) or abs(math.fsum(self.probs) - 1.0) > 1e-6:
            raise SlabPlanError("need probabilities must be >= 0 and sum to 1")
        cdf = list(itertools.accumulate(self.probs))
        cdf[-1] = 1.0
        object.__setattr__(self, "cdf", tuple(min(c, 1.0) for c in cdf))

    @property
    def max_need(self) -> int:
        return self.needs[-1]

    @property
    def mean(self) -> float:
        return math.fsum(n * p for n, p in zip(self.needs, self.probs))

    def mass_upto(self, tokens: int) -> float:
        """P(need <= tokens)."""
        i = bisect.bisect_right(self.needs, tokens)
        return self.cdf[i - 1] if i else 0.0

    def quantile(self, q: float) -> int:
        """The smallest need value with P(need <= value) >= q."""
        return self.needs[min(bisect.bisect_left(self.cdf, q - _EPS), len(self.needs) - 1)]


def needs_from_mix(mix: Sequence[RequestClass]) -> NeedDistribution:
    """Prompt and output lengths uniform and independent within each class, classes weighted by share."""
    weights: dict[int, float] = {}
    for request in mix:
        for need, prob in _uniform_sum(request.prompt, request.output):
            weights[need] = weights.get(need, 0.0) + request.share * prob
    return _normalized(weights)


def _uniform_sum(a: tuple[int, int], b: tuple[int, int]) -> Iterable[tuple[int, float]]:
    """The distribution of X + Y for X, Y uniform on the inclusive integer ranges a, b: a trapezoid."""
    (a_lo, a_hi), (b_lo, b_hi) = a, b
    outcomes = (a_hi - a_lo + 1) * (b_hi - b_lo + 1)
    for total in range(a_lo + b_lo, a_hi + b_hi + 1):
        ways = min(a_hi, total - b_lo) - max(a_lo, total - b_hi) + 1  # x in a with total - x in b
        yield total, ways / outcomes


def needs_from_pairs(pairs: Iterable[tuple[int, int]]) -> NeedDistribution:
    """The empirical distribution of observed (prompt, output) length pairs."""
    counts: dict[int, float] = {}
    for prompt, output in pairs:
        counts[prompt + output] = counts.get(prompt + output, 0.0) + 1.0
    if not counts:
        raise SlabPlanError("a trace needs at least one (prompt, output) pair")
    return _normalized(counts)


def _normalized(weights: dict[int, float]) -> NeedDistribution:
    needs = tuple(sorted(n for n, w in weights.items() if w > 0))
    total = math.fsum(weights[n] for n in needs)
    return NeedDistribution(needs=needs, probs=tuple(weights[n] / total for n in needs))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token position in every layer: 2 * layers * kv_heads * head_dim * dtype size."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


# ---------------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True, slots=True)
class SlabClass:
    tokens: int  # capacity of one slab
    count: int
    share: float = 0.0  # of the mix's requests whose smallest fitting class this is (0.0 without a mix)


@dataclass(frozen=True, slots=True)
class Baseline:
    """What another KV layout gives for the same budget and mix."""

    name: str  # "max_context slots" or "paged-16"
    unit_tokens: int  # tokens per slot or page
    units: int  # slots or pages the budget holds
    arena_bytes: int
    concurrency: int
    utilization: float


@dataclass(frozen=True, slots=True)
class SlabPlan:
    classes: tuple[SlabClass, ...]  # ascending tokens; the arena holds them in this order, each class contiguous
    kv_bytes_per_token: int
    budget_bytes: int
    max_seqs: int
    arena_tokens: int
    arena_bytes: int
    concurrency: int  # requests of the mix held at once (without a mix: every slab holds one)
    utilization: float | None  # token-weighted, for the mix; None without a mix
    internal_waste: float | None  # 1 - utilization
    internal_waste_bytes: int | None  # held but unused KV bytes at `concurrency`
    unservable_share: float  # of the mix, needs above the largest class (listed classes only)
    baselines: tuple[Baseline, ...]  # () without a mix

    @property
    def max_request_tokens(self) -> int:
        """The longest prompt + max_tokens any slab holds; longer requests are refused at once."""
        return self.classes[-1].tokens

    def layout(self) -> tuple[tuple[int, int], ...]:
        """(offset, capacity) in tokens of every slab in the arena: classes ascending, each class contiguous."""
        slabs, offset = [], 0
        for slab_class in self.classes:
            for _ in range(slab_class.count):
                slabs.append((offset, slab_class.tokens))
                offset += slab_class.tokens
        return tuple(slabs)


def plan_kv(kv: KVSpec, *, max_context: int, max_seqs: int, kv_bytes_per_token: int,
            default_budget_bytes: int) -> SlabPlan:
    """The slab plan for a spec's `kv` section: listed classes evaluated, or a workload planned.

    The budget is `kv.budget` when the spec sets one, else `default_budget_bytes` (what the target has left)."""
    budget = kv.budget_bytes if kv.budget_bytes is not None else default_budget_bytes
    common = dict(max_context=max_context, max_seqs=max_seqs, kv_bytes_per_token=kv_bytes_per_token,
                  budget_bytes=budget)
    if kv.classes:
        return evaluate_slabs([(c.tokens, c.count) for c in kv.classes], None, **common)
    if kv.workload is None:
        raise SlabPlanError("kv: neither classes nor a workload to plan slabs from")
    workload = kv.workload
    needs = needs_from_pairs(workload.pairs) if workload.trace is not None else needs_from_mix(workload.mix)
    return plan_slabs(needs, max_classes=workload.max_classes, **common)


def plan_slabs(needs: NeedDistribution, *, max_context: int, max_seqs: int, kv_bytes_per_token: int,
               budget_bytes: int, granularity: int = DEFAULT_GRANULARITY,
               max_classes: int = DEFAULT_MAX_CLASSES) -> SlabPlan:
    """Classes and counts that hold the most requests of the mix at once within the budget and `max_seqs`.

    1) Candidate capacities: every need rounded up to `granularity` tokens (capped at `max_context`), or, when
       there are more than MAX_CANDIDATES, the needs at MAX_CANDIDATES evenly spaced quantiles. Nothing is lost
       by looking only at rounded needs: a capacity strictly between two candidates holds the same requests as
       the candidate below it, at a higher cost. The largest candidate, covering the longest request, is always
       a class, so no request of the mix is refused.
    2) For k = 1..max_classes classes, the k capacities that minimize the expected capacity a request holds,
       E[c(need)], by dynamic programming over the sorted candidates (exact over them). With N requests in
       proportion, the memory they hold is N * E[c(need)] * bytes_per_token, so the smallest E[c] holds the
       most requests in a budget: this is the fractional optimum for each k.
    3) For each k's capacities, the exact integer counts: the largest N (<= max_seqs) whose cheapest counts fit
       the budget (`_counts_for`), found by bisection since the cost grows with N; budget left over buys extra
       slabs of the largest class it can pay for, up to max_seqs slabs in all (headroom for bursts).
    4) The best of these by (concurrency, utilization, fewer classes), so ties resolve the same way every time.

    Concurrency counts requests in the mix's exact proportions; real arrivals vary around it, and a class with
    few slabs feels that most. Hence a small `max_classes` by default: more classes raise utilization (for the
    shipped mixes, about 0.67 -> 0.81 from 4 to 8) but split the slabs into smaller pools.
    """
    if needs.max_need > max_context:
        raise SlabPlanError(f"the workload's longest request needs {needs.max_need} tokens, above max_context "
                            f"({max_context}); raise max_context or shorten the workload's longest request")
    candidates = _candidate_capacities(needs, max_context, granularity)
    top_bytes = candidates[-1] * kv_bytes_per_token
    if top_bytes > budget_bytes:
        raise SlabPlanError(
            f"the KV budget ({format_bytes(budget_bytes)}) cannot hold one slab of {candidates[-1]} tokens "
            f"({format_bytes(top_bytes)}) for the workload's longest request: raise the KV budget by at least "
            f"{format_bytes(top_bytes - budget_bytes)}, use a smaller kv_dtype, or shorten the longest request")
    plans = []
    for capacities in _best_capacities(needs, candidates, max_classes):
        counts = _fill_budget(capacities, _max_counts(needs, capacities, max_seqs, kv_bytes_per_token,
                                                      budget_bytes), max_seqs, kv_bytes_per_token, budget_bytes)
        kept = [(c, n) for c, n in zip(capacities, counts) if n > 0]
        plans.append(evaluate_slabs(kept, needs, max_context=max_context, max_seqs=max_seqs,
                                    kv_bytes_per_token=kv_bytes_per_token, budget_bytes=budget_bytes))
    return min(plans, key=lambda p: (-p.concurrency, -(p.utilization or 0.0), len(p.classes),
                                     tuple(c.tokens for c in p.classes)))


def _candidate_capacities(needs: NeedDistribution, max_context: int, granularity: int) -> list[int]:
    def capacity(need: int) -> int:
        return min(round_up(need, granularity), max_context)

    candidates = sorted({capacity(n) for n in needs.needs})
    if len(candidates) > MAX_CANDIDATES:
        grid = (needs.quantile(j / MAX_CANDIDATES) for j in range(1, MAX_CANDIDATES + 1))
        candidates = sorted({capacity(n) for n in grid} | {capacity(needs.max_need)})
    return candidates


def _best_capacities(needs: NeedDistribution, candidates: list[int], max_classes: int) -> list[tuple[int, ...]]:
    """For each k <= max_classes, the k candidates (the largest among them) minimizing E[capacity held]."""
    cdf = [needs.mass_upto(c) for c in candidates]
    m = len(candidates)
    # cost[t][j]: least E[capacity] for needs <= candidates[j] using t classes, the largest being candidates[j].
    cost = [[c * f for c, f in zip(candidates, cdf)]]
    back: list[list[int]] = [[-1] * m]
    for _ in range(1, min(max_classes, m)):
        prev, row, links = cost[-1], [math.inf] * m, [-1] * m
        for j in range(m):
            for i in range(j):
                value = prev[i] + candidates[j] * (cdf[j] - cdf[i])
                if value < row[j] - _EPS:
                    row[j], links[j] = value, i
        cost.append(row)
        back.append(links)
    sets = []
    for t in range(len(cost)):
        if math.isinf(cost[t][m - 1]):
            continue
        chosen, j = [], m - 1
        for level in range(t, -1, -1):
            chosen.append(candidates[j])
            j = back[level][j]
        sets.append(tuple(reversed(chosen)))
    return sets


def _tails(needs: NeedDistribution, capacities: Sequence[int]) -> list[float]:
    """Q_i: the share of servable requests that need more than the class below i, so only class >= i holds them."""
    servable = needs.mass_upto(capacities[-1])
    return [1.0] + [(servable - needs.mass_upto(c)) / servable for c in capacities[:-1]]


def _counts_for(tails: Sequence[float], n: int) -> list[int]:
    """Cheapest counts holding n requests in proportion: the classes >= i hold ceil(n * Q_i) slabs (Hall's
    condition for nested classes: requests that only fit class >= i must not outnumber those slabs)."""
    at_least = [math.ceil(n * q - _EPS) for q in tails] + [0]
    return [at_least[i] - at_least[i + 1] for i in range(len(tails))]


def _max_counts(needs: NeedDistribution, capacities: Sequence[int], max_seqs: int, bytes_per_token: int,
                budget: int) -> list[int]:
    tails = _tails(needs, capacities)

    def cost(n: int) -> int:
        return bytes_per_token * sum(c * k for c, k in zip(capacities, _counts_for(tails, n)))

    lo, hi = 0, max_seqs  # cost(lo) fits; find the largest n whose cost fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    return _counts_for(tails, lo)


def _fill_budget(capacities: Sequence[int], counts: list[int], max_seqs: int, bytes_per_token: int,
                 budget: int) -> list[int]:
    counts = list(counts)
    left = budget - bytes_per_token * sum(c * k for c, k in zip(capacities, counts))
    while sum(counts) < max_seqs:
        affordable = [i for i, c in enumerate(capacities) if c * bytes_per_token <= left]
        if not affordable:
            break
        counts[affordable[-1]] += 1
        left -= capacities[affordable[-1]] * bytes_per_token
    return counts


# ---------------------------------------------------------------------------------------------------------------
# Evaluation


def evaluate_slabs(classes: Sequence[tuple[int, int]], needs: NeedDistribution | None, *, max_context: int,
                   max_seqs: int, kv_bytes_per_token: int, budget_bytes: int) -> SlabPlan:
    """The figures of `classes` ((tokens, count), ascending tokens) for the mix `needs` (None: no mix)."""
    _check_listed(classes, max_context, max_seqs, kv_bytes_per_token, budget_bytes)
    capacities = [tokens for tokens, _ in classes]
    arena_tokens = sum(tokens * count for tokens, count in classes)
    if needs is None or needs.needs[0] > capacities[-1]:
        slab_classes = tuple(SlabClass(tokens, count) for tokens, count in classes)
        return _finish(SlabPlan(
            classes=slab_classes, kv_bytes_per_token=kv_bytes_per_token, budget_bytes=budget_bytes,
            max_seqs=max_seqs, arena_tokens=arena_tokens, arena_bytes=arena_tokens * kv_bytes_per_token,
            concurrency=sum(count for _, count in classes) if needs is None else 0, utilization=None,
            internal_waste=None, internal_waste_bytes=None, unservable_share=0.0 if needs is None else 1.0,
            baselines=()))
    tails = _tails(needs, capacities)
    shares = [tails[i] - (tails[i + 1] if i + 1 < len(tails) else 0.0) for i in range(len(tails))]
    held = math.fsum(c * s for c, s in zip(capacities, shares))  # E[capacity held], per servable request
    need = _mean_need(needs, capacities[-1])
    suffix = [sum(count for _, count in classes[i:]) for i in range(len(classes))]
    concurrency = min(math.floor(s / q + _EPS) for s, q in zip(suffix, tails) if q > 0)
    return _finish(SlabPlan(
        classes=tuple(SlabClass(t, n, s) for (t, n), s in zip(classes, shares)),
        kv_bytes_per_token=kv_bytes_per_token, budget_bytes=budget_bytes, max_seqs=max_seqs,
        arena_tokens=arena_tokens, arena_bytes=arena_tokens * kv_bytes_per_token,
        concurrency=min(concurrency, max_seqs), utilization=need / held, internal_waste=1.0 - need / held,
        internal_waste_bytes=round(min(concurrency, max_seqs) * (held - need) * kv_bytes_per_token),
        unservable_share=1.0 - needs.mass_upto(capacities[-1]),
        baselines=_baselines(needs, max_context, max_seqs, kv_bytes_per_token, budget_bytes)))


def _finish(plan: SlabPlan) -> SlabPlan:
    verify_slab_plan(plan)
    return plan


def _mean_need(needs: NeedDistribution, upto: int) -> float:
    """E[need | need <= upto]."""
    pairs = [(n, p) for n, p in zip(needs.needs, needs.probs) if n <= upto]
    return math.fsum(n * p for n, p in pairs) / math.fsum(p for _, p in pairs)


def _check_listed(classes: Sequence[tuple[int, int]], max_context: int, max_seqs: int, bytes_per_token: int,
                  budget: int) -> None:
    if not classes:
        raise SlabPlanError("no slab classes")
    for i, (tokens, count) in enumerate(classes):
        if tokens < 1 or count < 1 or tokens > max_context:
            raise SlabPlanError(f"slab class {i}: {count} x {tokens} tokens; expected count >= 1 and "
                                f"1 <= tokens <= max_context ({max_context})")
        if i and tokens <= classes[i - 1][0]:
            raise SlabPlanError(f"slab class {i}: {tokens} tokens is not above the class before; list classes "
                                f"by strictly ascending tokens")
    total = sum(count for _, count in classes)
    if total > max_seqs:
        raise SlabPlanError(f"{total} slabs in all, more than max_seqs ({max_seqs}); lower the counts")
    need = bytes_per_token * sum(t * n for t, n in classes)
    if need > budget:
        raise SlabPlanError(f"the slabs need {format_bytes(need)}, above the KV budget ({format_bytes(budget)}); "
                            f"{_fewer_slabs_hint(classes, bytes_per_token, need - budget)}, or raise the budget "
                            f"by {format_bytes(need - budget)}")


def _fewer_slabs_hint(classes: Sequence[tuple[int, int]], bytes_per_token: int, excess: int) -> str:
    """E.g. `2 fewer 8192-token slabs free 2 GiB`: the fewest slabs, largest first, whose bytes cover the excess."""
    parts, freed = [], 0
    for tokens, count in reversed(classes):
        slab = tokens * bytes_per_token
        drop = min(count, math.ceil((excess - freed) / slab))
        if drop > 0:
            parts.append(f"{drop} fewer {tokens}-token slabs free {format_bytes(drop * slab)}")
            freed += drop * slab
        if freed >= excess:
            break
    return "; ".join(parts)


def _baselines(needs: NeedDistribution, max_context: int, max_seqs: int, bytes_per_token: int,
               budget: int) -> tuple[Baseline, ...]:
    """One `max_context` slot per sequence; a paged pool of PAGE_TOKENS-token pages, each request holding the
    pages for its whole need from admission (as slabs do: no preemption), from the same budget."""
    mean_need = _mean_need(needs, needs.max_need)
    slots = min(max_seqs, budget // (max_context * bytes_per_token))
    fixed = Baseline(name="max_context slots", unit_tokens=max_context, units=slots,
                     arena_bytes=slots * max_context * bytes_per_token, concurrency=slots,
                     utilization=mean_need / max_context)
    pages = budget // (PAGE_TOKENS * bytes_per_token)
    mean_pages = math.fsum(math.ceil(n / PAGE_TOKENS) * p for n, p in zip(needs.needs, needs.probs))
    paged = Baseline(name=f"paged-{PAGE_TOKENS}", unit_tokens=PAGE_TOKENS, units=pages,
                     arena_bytes=pages * PAGE_TOKENS * bytes_per_token,
                     concurrency=min(max_seqs, math.floor(pages / mean_pages + _EPS)),
                     utilization=mean_need / (mean_pages * PAGE_TOKENS))
    return fixed, paged


def verify_slab_plan(plan: SlabPlan) -> None:
    """Raise `SlabPlanError` unless every slab lies inside the arena without overlap and the totals add up."""
    if not plan.classes or any(b.tokens <= a.tokens for a, b in zip(plan.classes, plan.classes[1:])):
        raise SlabPlanError("slab classes must be non-empty and strictly ascending")
    if any(c.count < 1 or c.tokens < 1 for c in plan.classes):
        raise SlabPlanError("every slab class needs count >= 1 and tokens >= 1")
    end = 0
    for offset, capacity in plan.layout():
        if offset < end or offset + capacity > plan.arena_tokens:
            raise SlabPlanError(f"slab at token {offset} ({capacity} tokens) overlaps another or runs past the "
                                f"arena ({plan.arena_tokens} tokens)")
        end = offset + capacity
    if end != plan.arena_tokens or plan.arena_bytes != plan.arena_tokens * plan.kv_bytes_per_token:
        raise SlabPlanError(f"arena totals do not add up: slabs end at {end} tokens, arena {plan.arena_tokens} "
                            f"tokens, {plan.arena_bytes} bytes at {plan.kv_bytes_per_token} bytes per token")
    if plan.arena_bytes > plan.budget_bytes:
        raise SlabPlanError(f"KV arena {plan.arena_bytes} bytes is above its budget {plan.budget_bytes}")
    if sum(c.count for c in plan.classes) > plan.max_seqs or plan.concurrency > plan.max_seqs:
        raise SlabPlanError(f"more slabs or admitted requests than max_seqs ({plan.max_seqs})")
