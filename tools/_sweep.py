"""The capacity sweep: raise the offered rate step by step and find the highest one the server serves within a
TTFT bound.

Contract: `sweep(plan, run_step)` calls `run_step(rate)` for rising rates; run_step runs one open-loop step at that
rate and returns `step_figures(...)` of it. A step passes when its admitted requests' P99 TTFT (over the `ttft_classes`, or all) is at most the bound,
at most `max_reject_fraction` of its requests were rejected, and none ended in another error (timeouts, cancels at
the drain timeout, anything but OK and RESOURCE_EXHAUSTED). The geometric (or linear) climb stops after
`past_bound` failing steps in a row or at `max_rate`; then `refine` bisection steps narrow the gap between the
highest passing rate and the lowest failing one. The capacity is the highest passing rate below every failing
rate, so one lucky step above a failure never raises it. Pure: no gRPC, no clock.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slabserve.tools._stats import OK, REJECTED, distribution


@dataclass(frozen=True, slots=True)
class SweepPlan:
    start_rps: float
    ttft_bound_s: float
    factor: float | None = None        # geometric climb (rate *= factor) ...
    increment_rps: float | None = None  # ... or linear (rate += increment)
    max_rate_rps: float = 1000.0
    past_bound: int = 2                # failing steps in a row that end the climb
    refine: int = 2                    # bisection steps between the last pass and the first fail
    max_reject_fraction: float = 0.01
    ttft_classes: tuple[str, ...] = ()  # request classes the TTFT bound applies to; empty: all

    def __post_init__(self) -> None:
        if not self.start_rps > 0 or not self.ttft_bound_s > 0:
            raise ValueError("the start rate and the TTFT bound must be > 0")
        if (self.factor is None) == (self.increment_rps is None):
            raise ValueError("give exactly one of a factor and an increment")
        if self.factor is not None and not self.factor > 1:
            raise ValueError(f"factor {self.factor} must be > 1")
        if self.increment_rps is not None and not self.increment_rps > 0:
            raise ValueError(f"increment {self.increment_rps} must be > 0")
        if self.past_bound < 1 or self.refine < 0:
            raise ValueError("past_bound must be >= 1 and refine >= 0")

    def next_rate(self, rate: float) -> float:
        return rate * self.factor if self.factor is not None else rate + self.increment_rps


def step_figures(rate: float, records: Sequence[dict], window_s: float, load_samples: Sequence[dict],
                 plan: SweepPlan) -> dict:
    """What a sweep keeps of one step, with its verdict."""
    n = len(records)
    ok = [r for r in records if r["status"] == OK]
    rejected = [r for r in records if r["status"] == REJECTED]
    others = n - len(ok) - len(rejected)
    bounded = [r for r in ok if not plan.ttft_classes or r["class"] in plan.ttft_classes]
    ttft = distribution(r.get("ttft_s") for r in bounded)
    per_class = {name: distribution(r.get("ttft_s") for r in ok if r["class"] == name)
                 for name in sorted({r["class"] for r in ok})}
    figures = {
        "rate": rate,
        "requests": n,
        "completed": len(ok),
        "completed_per_s": len(ok) / window_s if window_s > 0 else 0.0,
        "p50_ttft_s": ttft["p50"] if ttft else None,
        "p99_ttft_s": ttft["p99"] if ttft else None,
        "p99_ttft_s_per_class": {name: d["p99"] for name, d in per_class.items() if d},
        "rejected": len(rejected),
        "rejected_fraction": len(rejected) / n if n else 0.0,
        "rejection_latency_s": distribution(r.get("e2e_s") for r in rejected),
        "other_errors": others,
        "other_error_fraction": others / n if n else 0.0,
        "other_error_statuses": sorted({r["status"] for r in records} - {OK, REJECTED}),
        "queues": queue_figures(load_samples, window_s),
    }
    figures["passed"], figures["why"] = _verdict(figures, plan)
    return figures


def _verdict(f: dict, plan: SweepPlan) -> tuple[bool, str]:
    if f["other_errors"]:
        return False, f"{f['other_errors']} requests ended in {', '.join(f['other_error_statuses'])}"
    if f["rejected_fraction"] > plan.max_reject_fraction:
        return False, (f"{100 * f['rejected_fraction']:.1f}% rejected (more than "
                       f"{100 * plan.max_reject_fraction:g}%)")
    if f["p99_ttft_s"] is None:
        return False, "no request completed"
    if f["p99_ttft_s"] > plan.ttft_bound_s:
        return False, f"P99 TTFT {f['p99_ttft_s'] * 1000:.0f} ms over the bound {plan.ttft_bound_s * 1000:.0f} ms"
    return True, f"P99 TTFT {f['p99_ttft_s'] * 1000:.0f} ms within the bound"


def queue_figures(load_samples: Sequence[dict], window_s: float) -> dict:
    """How the server's queues behaved during the arrival window: largest depth, depth at its end, and the
    least-squares slope of the depth (requests per second; near 0 when queues stay bounded)."""
    points = [(s["t_s"], s["queued"]) for s in load_samples if s["t_s"] <= window_s]
    if not points:
        return {"max_queued": None, "queued_at_window_end": None, "slope_per_s": None}
    return {"max_queued": max(q for _, q in points), "queued_at_window_end": points[-1][1],
            "slope_per_s": _slope(points)}


def _slope(points: Sequence[tuple[float, float]]) -> float:
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mean_t) * (y - mean_y) for t, y in points) / var


def sweep(plan: SweepPlan, run_step: Callable[[float], dict]) -> dict:
    """Run the climb and the refinement; returns {"steps" (by rate), "capacity_rps", "at_capacity", "above"}."""
    steps: list[dict] = []
    rate, failing_in_a_row = plan.start_rps, 0
    while rate <= plan.max_rate_rps * (1 + 1e-9) and failing_in_a_row < plan.past_bound:
        steps.append(run_step(rate))
        failing_in_a_row = 0 if steps[-1]["passed"] else failing_in_a_row + 1
        rate = plan.next_rate(rate)
    for _ in range(plan.refine):
        low, high = _bracket(steps)
        if low is None or high is None:
            break
        steps.append(run_step(round((low + high) / 2, 6)))
    return analyse(steps, plan)


def _bracket(steps: Sequence[dict]) -> tuple[float | None, float | None]:
    """(highest passing rate below every failure, lowest failing rate)."""
    failing = [s["rate"] for s in steps if not s["passed"]]
    lowest_fail = min(failing) if failing else None
    passing = [s["rate"] for s in steps if s["passed"] and (lowest_fail is None or s["rate"] < lowest_fail)]
    return (max(passing) if passing else None), lowest_fail


def analyse(steps: Sequence[dict], plan: SweepPlan) -> dict:
    steps = sorted(steps, key=lambda s: s["rate"])
    capacity, lowest_fail = _bracket(steps)
    at = next((s for s in steps if s["rate"] == capacity), None)
    above = [s for s in steps if capacity is None or s["rate"] > capacity]
    return {"ttft_bound_s": plan.ttft_bound_s, "ttft_classes": list(plan.ttft_classes), "capacity_rps": capacity, "lowest_failing_rps": lowest_fail,
            "bound_crossed": lowest_fail is not None, "at_capacity": at, "steps": steps,
            "above_capacity": describe_above(above)}


def describe_above(above: Sequence[dict]) -> dict:
    """What happened past the capacity: rejections and their latency, other errors, queue growth."""
    if not above:
        return {"steps": 0, "summary": "no step above the capacity was run"}
    rejected = sum(s["rejected"] for s in above)
    others = sum(s["other_errors"] for s in above)
    worst_reject = max((s["rejection_latency_s"]["max"] for s in above if s["rejection_latency_s"]), default=None)
    slopes = [s["queues"]["slope_per_s"] for s in above if s["queues"]["slope_per_s"] is not None]
    parts = [f"{rejected} of {sum(s['requests'] for s in above)} requests rejected with RESOURCE_EXHAUSTED"]
    if worst_reject is not None:
        parts.append(f"slowest rejection {worst_reject * 1000:.0f} ms")
    parts.append(f"{others} other errors" if others else "no timeouts or other errors")
    if slopes:
        parts.append(f"queue depth slope up to {max(slopes):.2f} requests/s")
    return {"steps": len(above), "rejected": rejected, "other_errors": others,
            "slowest_rejection_s": worst_reject, "max_queue_slope_per_s": max(slopes) if slopes else None,
            "summary": "; ".join(parts)}
