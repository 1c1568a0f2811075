"""PNG plots of a load run and of a capacity sweep (matplotlib, headless).

Contract: `plot_run(run, out_dir)` reads the dict that loadgen writes as JSON (meta, records, samples) and writes
four PNGs into out_dir, returning their paths: latency CDFs per request class, TTFT and TPOT over time, server
memory over time, slab occupancy per slab class over time. `plot_sweep(sweep, path)` writes one PNG. Every axis
names its unit, each request class keeps one color in every plot (the mix's order), and every title says what ran.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

_CLASS_COLORS = plt.get_cmap("tab10").colors
_SLAB_COLORS = plt.get_cmap("Dark2").colors
MiB = 1 << 20


def class_colors(class_names: list[str]) -> dict[str, tuple]:
    """One color per request class, in the given (mix) order, the same in every plot."""
    return {name: _CLASS_COLORS[i % len(_CLASS_COLORS)] for i, name in enumerate(class_names)}


def _class_order(run: dict) -> list[str]:
    names = list(run["meta"].get("classes", []))
    names += sorted({r["class"] for r in run["records"]} - set(names))
    return names


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(run: dict, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = class_colors(_class_order(run))
    title = run["meta"]["title"]
    return [_latency_cdf(run, colors, title, out_dir / "latency_cdf.png"),
            _latency_over_time(run, colors, title, out_dir / "latency_over_time.png"),
            _memory(run, title, out_dir / "server_memory.png"),
            _slabs(run, title, out_dir / "slab_occupancy.png")]


def _cdf(ax, values: list[float], **style) -> None:
    values = sorted(values)
    n = len(values)
    ax.step(values, [(i + 1) / n for i in range(n)], where="post", **style)


def _latency_cdf(run: dict, colors: dict, title: str, path: Path) -> Path:
    ok = [r for r in run["records"] if r["status"] == "OK"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, name in ((axes[0], "ttft_s", "time to first token"), (axes[1], "e2e_s", "end-to-end latency")):
        for cls, color in colors.items():
            values = [r[key] * 1000 for r in ok if r["class"] == cls and r.get(key) is not None]
            if values:
                _cdf(ax, values, color=color, label=f"{cls} (n={len(values)})")
        every = [r[key] * 1000 for r in ok if r.get(key) is not None]
        if every:
            _cdf(ax, every, color="black", linestyle="--", linewidth=1, label=f"all (n={len(every)})")
            ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of completed requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"{name}: CDF per request class", fontsize=10)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def _latency_over_time(run: dict, colors: dict, title: str, path: Path) -> Path:
    ok = [r for r in run["records"] if r["status"] == "OK"]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for ax, key, label in ((axes[0], "ttft_s", "time to first token (ms)"),
                           (axes[1], "tpot_s", "time per output token (ms)")):
        for cls, color in colors.items():
            points = [(r["sent_s"], r[key] * 1000) for r in ok if r["class"] == cls and r.get(key) is not None]
            if points:
                ax.scatter(*zip(*points), s=10, color=color, alpha=0.7, label=cls)
        ax.set_ylabel(label)
    rejected = [(r["sent_s"], r["e2e_s"] * 1000) for r in run["records"]
                if r["status"] == "RESOURCE_EXHAUSTED" and r.get("e2e_s") is not None]
    if rejected:
        axes[0].scatter(*zip(*rejected), s=12, marker="x", color="grey", alpha=0.6,
                        label=f"rejected, RESOURCE_EXHAUSTED (n={len(rejected)}): time to the error")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(loc="upper left", fontsize=8, markerscale=2)
    axes[0].set_title("per completed request, at the time it was sent", fontsize=10)
    axes[1].set_xlabel("time since the run started (s)")
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def _memory(run: dict, title: str, path: Path) -> Path:
    samples = run["samples"]["server_rss"]
    fig, ax = plt.subplots(figsize=(12, 4.2))
    if samples:
        t, rss = zip(*((s["t_s"], s["bytes"] / MiB) for s in samples))
        ax.plot(t, rss, color="tab:blue", linewidth=1.2, label="server resident memory (VmRSS)")
        span = max(rss) - min(rss)
        ax.set_title(f"min {min(rss):.1f} MiB, max {max(rss):.1f} MiB, range {span:.2f} MiB", fontsize=10)
        if span < 8:  # keep a flat line looking flat, not blown up to fill the axis
            mid = (max(rss) + min(rss)) / 2
            ax.set_ylim(mid - 4, mid + 4)
    else:
        ax.set_title("no memory samples (server pid unknown)", fontsize=10)
    ax.axvline(run["meta"]["window_s"], color="grey", linestyle=":", label="last arrival window ends")
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("resident memory (MiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def _slabs(run: dict, title: str, path: Path) -> Path:
    samples = run["samples"]["load"]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    if samples:
        t = [s["t_s"] for s in samples]
        for i, first in enumerate(samples[0]["classes"]):
            color = _SLAB_COLORS[i % len(_SLAB_COLORS)]
            label = f"slab class {i}: {first['tokens']} tokens x {first['total_slabs']}"
            used = [100 * (1 - s["classes"][i]["free_slabs"] / max(s["classes"][i]["total_slabs"], 1))
                    for s in samples]
            axes[0].plot(t, used, color=color, linewidth=1.2, drawstyle="steps-post", label=label)
            axes[1].plot(t, [s["classes"][i]["queued"] for s in samples], color=color, linewidth=1.2,
                         drawstyle="steps-post", label=label)
    axes[0].set_ylabel("slabs in use (% of the class)")
    axes[0].set_ylim(-2, 102)
    axes[1].set_ylabel("requests queued for the class")
    axes[1].set_ylim(bottom=-0.5, top=max(axes[1].get_ylim()[1], 4))
    axes[1].yaxis.get_major_locator().set_params(integer=True)
    axes[1].set_xlabel("time since the run started (s)")
    axes[0].set_title("slab occupancy per slab class (GetLoad)", fontsize=10)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def plot_sweep(sweep: dict, path: Path) -> Path:
    steps = sweep["steps"]
    rates = [s["rate"] for s in steps]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    p99 = [s["p99_ttft_s"] * 1000 if s["p99_ttft_s"] is not None else float("nan") for s in steps]
    of = f"{', '.join(sweep['ttft_classes'])} requests" if sweep.get("ttft_classes") else "admitted requests"
    axes[0].plot(rates, p99, marker="o", color="tab:red", label=f"P99 time to first token ({of})")
    axes[0].axhline(sweep["ttft_bound_s"] * 1000, color="grey", linestyle="--",
                    label=f"bound {sweep['ttft_bound_s'] * 1000:g} ms")
    axes[0].set_ylabel("P99 time to first token (ms)")
    axes[1].plot(rates, rates, color="grey", linestyle=":", label="offered")
    axes[1].plot(rates, [s["completed_per_s"] for s in steps], marker="o", color="tab:blue", label="completed")
    axes[1].set_ylabel("throughput (requests/s)")
    axes[2].plot(rates, [100 * s["rejected_fraction"] for s in steps], marker="o", color="tab:purple",
                 label="rejected (RESOURCE_EXHAUSTED)")
    axes[2].plot(rates, [100 * s["other_error_fraction"] for s in steps], marker="x", color="black",
                 label="other errors and drain cancels")
    axes[2].set_ylabel("requests (% of offered)")
    axes[2].set_xlabel("offered load (requests/s)")
    capacity = sweep.get("capacity_rps")
    for ax in axes:
        if capacity is not None:
            ax.axvline(capacity, color="tab:green", linestyle="-.", label=f"capacity {capacity:g} req/s")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(sweep["meta"]["title"], fontsize=11)
    return _save(fig, path)
