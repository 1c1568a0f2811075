"""Prometheus metrics of one server, in their own registry (no process-global collectors).

Contract: the engine thread calls `observe_load` after every step and `observe_finished` for every final event;
the gRPC edge calls `count_request` once per call it answers. `serve(host, port)` exposes the registry over HTTP
and returns a function that stops it. Names and labels:

    slabserve_requests_queued{slab_class}          requests waiting for a slab, per home class
    slabserve_requests_running                     requests holding a slab
    slabserve_free_slabs{slab_class}               free slabs per class (slab_class = "<index>:<tokens>")
    slabserve_kv_utilization                       share of the KV arena's rows in slabs held by requests, 0..1
    slabserve_time_to_first_token_seconds          histogram, arrival -> first token
    slabserve_time_per_output_token_seconds        histogram, mean per token after the first, per request
    slabserve_queue_seconds                        histogram, arrival -> first step
    slabserve_first_token_projection_ratio         histogram, time to first token over admission's projection of it
    slabserve_first_token_promises_total           first tokens of requests admission promised one by a deadline
    slabserve_first_token_promises_missed_total    those that came after it
    slabserve_admission_projection_error           the relative error admission allows its projections (0: exact)
    slabserve_generated_tokens_total               tokens sampled for requests
    slabserve_requests_total{code, finish_reason}  answered Generate calls by status code and finish reason
    slabserve_prefix_hit_tokens_total              prompt tokens whose KV was already held (retained prefixes)
    slabserve_prefix_miss_tokens_total             prompt tokens that had to be prefilled
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from slabserve.runtime.slab_allocator import SlabClass

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, classes: Sequence[SlabClass]):
        self.registry = CollectorRegistry()
        r = self.registry
        self._labels = tuple(f"{i}:{c.tokens}" for i, c in enumerate(classes))
        self._class_rows = tuple(c.tokens for c in classes)
        self._total_rows = sum(c.tokens * c.count for c in classes)
        self.queued = Gauge("slabserve_requests_queued", "Requests waiting for a slab, per home slab class",
                            ["slab_class"], registry=r)
        self.running = Gauge("slabserve_requests_running", "Requests holding a KV slab", registry=r)
        self.free_slabs = Gauge("slabserve_free_slabs", "Free KV slabs per class", ["slab_class"], registry=r)
        self.kv_utilization = Gauge("slabserve_kv_utilization",
                                    "Share of the KV arena's rows in slabs held by requests (0..1)", registry=r)
        self.ttft = Histogram("slabserve_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("slabserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.queue_time = Histogram("slabserve_queue_seconds", "Arrival to the first engine step of the request",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.projection = Histogram("slabserve_first_token_projection_ratio",
                                    "Time to first token over the one admission by latency projected",
                                    buckets=_RATIO_BUCKETS, registry=r)
        self.promises = Counter("slabserve_first_token_promises",
                                "First tokens of requests that admission by latency promised a deadline", registry=r)
        self.promises_missed = Counter("slabserve_first_token_promises_missed",
                                       "First tokens that came after the deadline admission promised", registry=r)
        self.projection_error = Gauge("slabserve_admission_projection_error",
                                      "Relative error of first-token projections that admission allows when it "
                                      "protects admitted promises (runtime.admission.ProjectionError)", registry=r)
        self.tokens = Counter("slabserve_generated_tokens", "Tokens sampled for requests", registry=r)
        self.requests = Counter("slabserve_requests", "Answered Generate calls", ["code", "finish_reason"],
                                registry=r)
        self.prefix_hits = Counter("slabserve_prefix_hit_tokens",
                                   "Prompt tokens whose KV rows a slab already held (not computed)", registry=r)
        self.prefix_misses = Counter("slabserve_prefix_miss_tokens", "Prompt tokens prefilled", registry=r)
        self._prefix_seen = (0, 0)
        for label in self._labels:  # every class appears from the first scrape, not after its first request
            self.queued.labels(label).set(0)
            self.free_slabs.labels(label).set(0)

    def observe_load(self, free_per_class: Sequence[int], total_per_class: Sequence[int],
                     queued_per_class: Sequence[int], running: int) -> None:
        used_rows = 0
        for label, rows, free, total, queued in zip(self._labels, self._class_rows, free_per_class,
                                                    total_per_class, queued_per_class):
            self.free_slabs.labels(label).set(free)
            self.queued.labels(label).set(queued)
            used_rows += (total - free) * rows
        self.running.set(running)
        self.kv_utilization.set(used_rows / self._total_rows if self._total_rows else 0.0)

    def observe_projection_error(self, relative: float) -> None:
        self.projection_error.set(relative)

    def observe_prefix(self, hit_tokens: int, miss_tokens: int) -> None:
        """The scheduler's running totals (runtime.scheduler: prefix_hit_tokens, prefix_miss_tokens)."""
        seen_hits, seen_misses = self._prefix_seen
        if hit_tokens > seen_hits:
            self.prefix_hits.inc(hit_tokens - seen_hits)
        if miss_tokens > seen_misses:
            self.prefix_misses.inc(miss_tokens - seen_misses)
        self._prefix_seen = (max(hit_tokens, seen_hits), max(miss_tokens, seen_misses))

    def observe_tokens(self, count: int) -> None:
        self.tokens.inc(count)

    def observe_finished(self, queue_s: float, ttft_s: float, tpot_s: float, completion_tokens: int,
                         promised_s: float | None = None, projected_s: float | None = None) -> None:
        self.queue_time.observe(queue_s)
        if completion_tokens:
            self.ttft.observe(ttft_s)
            if projected_s is not None and projected_s > 0:
                self.projection.observe(ttft_s / projected_s)
            if promised_s is not None:
                self.promises.inc()
                if ttft_s > promised_s:
                    self.promises_missed.inc()
        if completion_tokens > 1:
            self.tpot.observe(tpot_s)

    def count_request(self, code: str, finish_reason: str) -> None:
        self.requests.labels(code, finish_reason).inc()

    def serve(self, host: str, port: int) -> Callable[[], None]:
        """Expose the registry on http://host:port/metrics; returns a function that stops the HTTP server."""
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)

        def stop() -> None:
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)

        return stop
