"""How well admission by latency kept its word, from a server's request log.

    .venv/bin/python tools/admission_report.py SERVER_LOG [SERVER_LOG ...] [--json FILE]

`slabserve serve` writes one JSON line per request on stderr; a request admission projected carries
`projected_ttft_ms` beside its `ttft_ms`, and one it promised a first-token deadline (the plan's
`max_queue_delay_ms` cap) `promised_ttft_ms`. For each file: requests by status code, then per prompt size (up to
512 tokens, 513-2,047, 2,048 and more) the time to first token over the projected one (median, 10th and 90th
percentile, max), the promises missed and by how much, and the refusals' messages. The live counterparts are the
Prometheus metrics `slabserve_first_token_projection_ratio` and `slabserve_first_token_promises_missed_total`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

SIZES = (("up to 512", 0, 512), ("513-2047", 513, 2047), ("2048 and more", 2048, None))


def requests(path: Path) -> list[dict]:
    """The request lines of a server log (other lines, and lines that are not JSON, are skipped)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event": "request"' in line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def report(rows: list[dict]) -> dict:
    """The figures for one log's request lines."""
    codes = Counter(r.get("code", "?") for r in rows)
    by_size = []
    for name, lo, hi in SIZES:
        group = [r for r in rows if r.get("code") == "OK" and "ttft_ms" in r
                 and lo <= r.get("prompt_tokens", 0) and (hi is None or r.get("prompt_tokens", 0) <= hi)]
        ratios = sorted(r["ttft_ms"] / r["projected_ttft_ms"] for r in group if r.get("projected_ttft_ms", 0) > 0)
        promised = [r for r in group if "promised_ttft_ms" in r]
        late = sorted(round((r["ttft_ms"] - r["promised_ttft_ms"]) / 1000, 2) for r in promised
                      if r["ttft_ms"] > r["promised_ttft_ms"])
        by_size.append({"prompt_tokens": name, "requests": len(group), "projected": len(ratios),
                        "ratio_median": statistics.median(ratios) if ratios else None,
                        "ratio_p10": _quantile(ratios, 0.1) if ratios else None,
                        "ratio_p90": _quantile(ratios, 0.9) if ratios else None,
                        "ratio_max": ratios[-1] if ratios else None,
                        "promised": len(promised), "missed": len(late), "missed_by_s": late})
    refusals = [{"prompt_tokens": r.get("prompt_tokens"), "error": r.get("error", "")} for r in rows
                if r.get("code") == "RESOURCE_EXHAUSTED"]
    return {"requests": len(rows), "codes": dict(codes), "by_size": by_size, "refusals": refusals}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    out = {}
    for path in args.logs:
        if not path.is_file():
            parser.error(f"logs: {path} is not a file")
        r = out[str(path)] = report(requests(path))
        print(f"{path}: {r['requests']} requests ({', '.join(f'{k} {v}' for k, v in sorted(r['codes'].items()))})")
        print(f"  {'prompt tokens':>14} {'n':>4}  ttft/projected: {'median':>6} {'p10':>5} {'p90':>5} {'max':>5}"
              f"  promises missed")
        for s in r["by_size"]:
            missed = f"{s['missed']} of {s['promised']}" + (f" (by {s['missed_by_s']} s)" if s["missed"] else "")
            print(f"  {s['prompt_tokens']:>14} {s['requests']:>4}  {'':15} {_fmt(s['ratio_median']):>6} "
                  f"{_fmt(s['ratio_p10']):>5} {_fmt(s['ratio_p90']):>5} {_fmt(s['ratio_max']):>5}  {missed}")
        for refusal in r["refusals"]:
            print(f"  refused, {refusal['prompt_tokens']} prompt tokens: {refusal['error'][:200]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
