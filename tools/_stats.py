"""Figures from a load run's per-request records: percentiles per class, counts per status, throughput.

Contract: pure functions over plain dicts (the records as written to the JSON file), so a saved run can be
summarised again without a server. A record has at least `class`, `status` (a gRPC status code name), `sent_s` and
`scheduled_s` (seconds from the run's start), and for OK requests `ttft_s`, `tpot_s`, `e2e_s` (client-measured) and
`server_queue_s`, `server_ttft_s`, `server_tpot_s` (the server's Timings). Latencies are in seconds.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

QUANTILES = (50, 90, 99)
OK = "OK"
REJECTED = "RESOURCE_EXHAUSTED"
# Latency figures summarised for OK requests: record key -> what it is
OK_METRICS = {
    "ttft_s": "time to first token (client)",
    "tpot_s": "time per output token after the first (client)",
    "e2e_s": "end-to-end latency (client)",
    "server_queue_s": "queue time (server)",
    "server_ttft_s": "time to first token (server)",
    "server_tpot_s": "time per output token (server)",
}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float | None]) -> dict | None:
    """{n, mean, p50, p90, p99, max} of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    out = {"n": len(present), "mean": sum(present) / len(present)}
    out.update({f"p{q}": percentile(present, q) for q in QUANTILES})
    out["max"] = max(present)
    return out


def summarize_group(records: Sequence[dict], window_s: float) -> dict:
    """Counts per status, latency distributions of OK requests, rejection latency and throughput of one group."""
    ok = [r for r in records if r["status"] == OK]
    rejected = [r for r in records if r["status"] == REJECTED]
    window = max(window_s, 1e-9)
    summary = {
        "requests": len(records),
        "status": dict(sorted(Counter(r["status"] for r in records).items())),
        "drain_cancelled": sum(1 for r in records if r.get("drain_cancelled")),
        "completed_per_s": len(ok) / window,
        "output_tokens_per_s": sum(r.get("completion_tokens") or 0 for r in ok) / window,
        "rejected_fraction": len(rejected) / len(records) if records else 0.0,
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
    }
    summary["cached_fraction"] = summary["cached_tokens"] / summary["prompt_tokens"] if summary["prompt_tokens"] \
        else 0.0
    for key in OK_METRICS:
        summary[key] = distribution(r.get(key) for r in ok)
    summary["rejection_latency_s"] = distribution(r.get("e2e_s") for r in rejected)
    return summary


def summarize(records: Sequence[dict], window_s: float) -> dict:
    """{"overall": ..., "classes": {name: ...}, "schedule_lag_s": ...} for a run whose arrivals spanned window_s.

    schedule_lag_s is how late each request was sent against its schedule: an open-loop run keeps it near zero
    whatever the server's latency; a large lag means the client machine could not keep up and the figures
    understate the offered load."""
    names = sorted({r["class"] for r in records})
    return {
        "overall": summarize_group(records, window_s),
        "classes": {name: summarize_group([r for r in records if r["class"] == name], window_s)
                    for name in names},
        "schedule_lag_s": distribution(r["sent_s"] - r["scheduled_s"] for r in records
                                       if r.get("sent_s") is not None),
    }


def in_window(records: Sequence[dict], start_s: float, end_s: float) -> list[dict]:
    """Records sent in [start_s, end_s)."""
    return [r for r in records if r.get("sent_s") is not None and start_s <= r["sent_s"] < end_s]


def p99(records: Sequence[dict], key: str) -> float | None:
    d = distribution(r.get(key) for r in records if r["status"] == OK)
    return None if d is None else d["p99"]
