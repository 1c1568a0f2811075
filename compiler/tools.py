"""Plan tools for people and CI: the summary table, `inspect`, `diff` with a regression threshold, `verify`.

Contract: each function takes plans already read by `runtime.plan.read_plan` (so a bad bundle never gets here)
and returns text, plus a verdict where there is one. `diff_plans` reports memory and capacity deltas; a regression
is a relative change for the worse above `max_regression_pct` in: the fixed memory (weights + activations +
staging), the activation arena, the admitted concurrency, the KV utilization, or the longest request a slab holds,
or a plan that no longer fits its target. The KV arena's own size is not a regression by itself (by default it
grows into whatever the other parts leave).
"""
from __future__ import annotations

from dataclasses import dataclass

from slabserve.runtime.units import format_bytes
from slabserve.runtime import plan as P


def summary(plan: P.Plan, plan_id: str) -> str:
    """The table build-plan prints at the end, and `plan inspect` shows: memory by part, slabs, capacity."""
    t, kv, cap = plan.totals, plan.kv, plan.capacity
    lines = [f"plan {plan.name}  id {plan_id}",
             f"model {plan.model.arch} {plan.model.num_layers} layers, {plan.model.num_parameters:,} parameters; "
             f"{plan.engine.dtype}, KV {plan.engine.kv_dtype}; target {plan.fingerprints.device}; "
             f"{'servable' if plan.servable else 'NOT servable (planned without weights)'}",
             "", f"  {'memory':<34}{'bytes':>16}{'':>3}{'':>12}"]
    rows = [("weights (packed + rope table)", t.weights_bytes),
            (f"KV arena ({kv.rows} rows x {format_bytes(kv.bytes_per_token)})", t.kv_bytes),
            (f"activations ({len(plan.activations.buckets)} buckets, shared)", t.activations_bytes),
            ("staging (step inputs, sampler)", t.staging_bytes),
            ("planned", t.planned_bytes), ("reserve", t.reserve_bytes), ("target", t.target_bytes),
            ("headroom", t.headroom_bytes)]
    lines += [f"  {name:<34}{size:>16,}   {format_bytes(size):>12}" for name, size in rows]
    naive = plan.activations.naive_bytes
    lines.append(f"  activations vs naive sum of intermediates: {format_bytes(t.activations_bytes)} vs "
                 f"{format_bytes(naive)}")
    lines += ["", f"  {'slab class':<14}{'count':>7}{'row offset':>13}{'share of mix':>15}"]
    lines += [f"  {c.tokens:>8} tok  {c.count:>7}{c.row_offset:>13}{c.share:>15.3f}" for c in kv.classes]
    lines += ["", f"  weights: {weight_format_line(plan)}"]
    if plan.engine.weight_format_note:
        lines.append(f"    ({plan.engine.weight_format_note})")
    lines += ["", f"  prefix reuse: {'on' if plan.engine.prefix_reuse else 'off'}"
                  + (f"; {len(kv.prefixes)} declared prefix(es), prefilled at start-up:" if kv.prefixes else "")]
    lines += [f"    {p.name:<24}{len(p.token_ids):>7} tok  row {p.row_offset:>9}  {format_bytes(p.kv_bytes):>12}"
              for p in kv.prefixes]
    lines += ["", f"  capacity: {cap.concurrency} requests of the mix at once (KV budget "
                  f"{format_bytes(cap.kv_budget_bytes)}); longest request {cap.max_request_tokens} tokens"]
    if cap.utilization is not None:
        lines.append(f"  KV utilization {cap.utilization:.1%}, internal waste {cap.internal_waste:.1%} "
                     f"({format_bytes(cap.internal_waste_bytes or 0)})")
    for b in cap.baselines:
        lines.append(f"  baseline {b.name:<18} concurrency {b.concurrency:>5}, utilization {b.utilization:.1%}")
    if plan.parallel.tensor > 1:
        lines += ["", *ranks_table(plan)]
    return "\n".join(lines)


def ranks_table(plan: P.Plan) -> list[str]:
    """A tensor-parallel plan rank by rank: the slice each holds and its bytes on its own device, and how many
    slabs of the longest context one device's KV budget holds."""
    p, kv, cap = plan.parallel, plan.kv, plan.capacity
    device = plan.fingerprints.device
    lines = [f"  tensor parallel: {p.tensor} ranks, each one {device} device (the memory table above is one rank's); "
             f"embedding, norms and lm_head replicated",
             f"  {'rank':>6}{'query heads':>14}{'KV heads':>11}{'MLP columns':>16}{'weights':>12}{'KV arena':>12}"
             f"{'activations':>13}{'staging':>12}{'headroom':>12}  fits"]
    for r in p.ranks:
        lines.append(f"  {r.rank:>6}{_span(r.heads):>14}{_span(r.kv_heads):>11}{_span(r.intermediate):>16}"
                     f"{format_bytes(r.weights_bytes):>12}{format_bytes(r.kv_bytes):>12}"
                     f"{format_bytes(r.activations_bytes):>13}{format_bytes(r.staging_bytes):>12}"
                     f"{format_bytes(r.headroom_bytes):>12}  {'yes' if r.fits else 'NO'}")
    longest = plan.spec.get("max_context", cap.max_request_tokens)
    slabs = cap.kv_budget_bytes // (longest * kv.bytes_per_token)
    lines.append(f"  each rank's KV budget ({format_bytes(cap.kv_budget_bytes)} on one {device}, "
                 f"{format_bytes(kv.bytes_per_token)} per token: its {kv.num_kv_heads} KV head(s) of "
                 f"{kv.num_layers} layers) holds {slabs} slabs of {longest} tokens")
    if plan.staging.collective_bytes:
        lines.append(f"  collective buffers: {format_bytes(plan.staging.collective_bytes)} per rank (the step "
                     f"message rank 0 broadcasts); the all-reduces write into the activation arena")
    return lines


def _span(part) -> str:
    return f"{part[0]}-{part[1]}"


def weight_format_line(plan: P.Plan) -> str:
    """The weight arena's format, and for GGUF blocks the bytes held in each block type."""
    e = plan.engine
    if e.weight_format == "float":
        return f"{e.dtype}, dequantized at load (gemm {e.gemm})"
    by_type: dict[str, int] = {}
    for entry in plan.weights.entries:
        key = entry.block_type or entry.dtype
        by_type[key] = by_type.get(key, 0) + entry.nbytes
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    how = "the GGUF file's own blocks" if e.weight_format == "gguf" else "quantized to Q8_0 at load"
    return f"{e.weight_format}: {how} ({parts})"


def inspect(plan: P.Plan, plan_id: str) -> str:
    lines = [summary(plan, plan_id), "", "  fingerprints:"]
    f = plan.fingerprints
    lines += [f"    model config {f.model_config}", f"    weights      {f.weights or 'none (not servable)'}",
              f"    torch {f.torch}, triton {f.triton or 'not installed'}, device {f.device}", "",
              f"  engine: model {plan.engine.model_path} ({plan.engine.model_format}), max_seqs "
              f"{plan.engine.max_seqs}, step_tokens {plan.engine.step_tokens}, buckets {list(plan.engine.buckets)}",
              "", f"  {'bucket':>8}{'intermediates':>15}{'arena':>12}{'naive':>12}  graph"]
    for b in plan.activations.buckets:
        lines.append(f"  {b.tokens:>8}{len(b.tensors):>15}{format_bytes(b.arena_bytes):>12}"
                     f"{format_bytes(b.naive_bytes):>12}  {b.graph_fingerprint[:16]}")
    largest = sorted(plan.weights.entries, key=lambda e: (-e.nbytes, e.name))[:5]
    lines += ["", "  largest weights: " + ", ".join(f"{e.name} {list(e.shape)} {format_bytes(e.nbytes)}"
                                                    for e in largest)]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Delta:
    name: str
    old: float
    new: float
    worse_when: str  # "up", "down" or "" (informational)
    unit: str  # "bytes", "" or "ratio"

    @property
    def pct(self) -> float:
        if self.old == 0:
            return 0.0 if self.new == 0 else float("inf")
        return (self.new - self.old) / abs(self.old) * 100.0

    def regressed(self, threshold_pct: float) -> bool:
        if self.worse_when == "up":
            return self.pct > threshold_pct
        if self.worse_when == "down":
            return -self.pct > threshold_pct
        return False


def deltas(a: P.Plan, b: P.Plan) -> list[Delta]:
    def fixed(p: P.Plan) -> int:
        return p.totals.weights_bytes + p.totals.activations_bytes + p.totals.staging_bytes

    return [
        Delta("weights", a.totals.weights_bytes, b.totals.weights_bytes, "up", "bytes"),
        Delta("activations", a.totals.activations_bytes, b.totals.activations_bytes, "up", "bytes"),
        Delta("staging", a.totals.staging_bytes, b.totals.staging_bytes, "up", "bytes"),
        Delta("fixed memory (weights+act+staging)", fixed(a), fixed(b), "up", "bytes"),
        Delta("KV arena", a.totals.kv_bytes, b.totals.kv_bytes, "", "bytes"),
        Delta("planned", a.totals.planned_bytes, b.totals.planned_bytes, "", "bytes"),
        Delta("headroom", a.totals.headroom_bytes, b.totals.headroom_bytes, "", "bytes"),
        Delta("concurrency", a.capacity.concurrency, b.capacity.concurrency, "down", ""),
        Delta("KV utilization", a.capacity.utilization or 0.0, b.capacity.utilization or 0.0, "down", "ratio"),
        Delta("longest request (tokens)", a.capacity.max_request_tokens, b.capacity.max_request_tokens, "down", ""),
    ]


def diff_plans(a: P.Plan, b: P.Plan, id_a: str, id_b: str, max_regression_pct: float) -> tuple[bool, str]:
    """(regressed, report). `a` is the old plan, `b` the new one."""
    lines = [f"plan diff {a.name} {id_a[:12]} -> {b.name} {id_b[:12]} (regression threshold {max_regression_pct}%)",
             f"  {'':<36}{'old':>16}{'new':>16}{'change':>10}"]
    regressed = []
    for d in deltas(a, b):
        mark = ""
        if d.regressed(max_regression_pct):
            regressed.append(d.name)
            mark = "  REGRESSION"
        lines.append(f"  {d.name:<36}{_show(d.old, d.unit):>16}{_show(d.new, d.unit):>16}{_pct(d):>10}{mark}")
    old_classes = [(c.tokens, c.count) for c in a.kv.classes]
    new_classes = [(c.tokens, c.count) for c in b.kv.classes]
    if old_classes != new_classes:
        lines.append(f"  slab classes (tokens x count): {old_classes} -> {new_classes}")
    old_prefixes = [(p.name, len(p.token_ids)) for p in a.kv.prefixes]
    new_prefixes = [(p.name, len(p.token_ids)) for p in b.kv.prefixes]
    if old_prefixes != new_prefixes or a.engine.prefix_reuse != b.engine.prefix_reuse:
        lines.append(f"  prefix reuse {'on' if a.engine.prefix_reuse else 'off'} -> "
                     f"{'on' if b.engine.prefix_reuse else 'off'}; declared prefixes (name, tokens): "
                     f"{old_prefixes} -> {new_prefixes}")
    if a.fingerprints.model_config != b.fingerprints.model_config:
        lines.append("  model config changed")
    if a.parallel.tensor > 1 or b.parallel.tensor > 1:
        lines += per_rank_diff(a, b)
    if a.totals.fits and not b.totals.fits:
        regressed.append("fits")
        lines.append("  the new plan no longer fits its target  REGRESSION")
    lines.append(f"  {'REGRESSED: ' + ', '.join(regressed) if regressed else 'no regression over the threshold'}")
    return bool(regressed), "\n".join(lines)


def per_rank_diff(a: P.Plan, b: P.Plan) -> list[str]:
    """Rank by rank (ranks only one plan has shown against nothing): the slice and the bytes of each."""
    lines = [f"  per rank (tensor parallel {a.parallel.tensor} -> {b.parallel.tensor}):"]
    old, new = {r.rank: r for r in a.parallel.ranks}, {r.rank: r for r in b.parallel.ranks}
    for rank in sorted(set(old) | set(new)):
        x, y = old.get(rank), new.get(rank)

        def side(r, field: str) -> str:
            return "-" if r is None else (_span(getattr(r, field)) if field in ("heads", "kv_heads", "intermediate")
                                          else format_bytes(getattr(r, field)))

        parts = [f"{label} {side(x, f)} -> {side(y, f)}" for label, f in
                 (("heads", "heads"), ("KV heads", "kv_heads"), ("MLP columns", "intermediate"),
                  ("weights", "weights_bytes"), ("KV", "kv_bytes"), ("planned", "planned_bytes"),
                  ("headroom", "headroom_bytes"))]
        lines.append(f"    rank {rank}: " + "; ".join(parts))
    return lines


def _show(value: float, unit: str) -> str:
    if unit == "bytes":
        return format_bytes(int(value))
    if unit == "ratio":
        return f"{value:.1%}"
    return f"{value:g}"


def _pct(d: Delta) -> str:
    if d.old == d.new:
        return "="
    return "new" if d.pct == float("inf") else f"{d.pct:+.1f}%"
