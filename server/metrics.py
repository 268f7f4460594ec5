"""Prometheus metrics with vLLM's names under the ``kvllm:`` prefix .

Each app gets its own `CollectorRegistry`, so tests can build several apps in one process.

* Engine-wide gauges and counters are read from ``engine.stats()`` at scrape time (a custom collector):
  ``kvllm:num_requests_running``, ``kvllm:num_requests_waiting``, ``kvllm:kv_cache_usage_perc`` (0..1),
  ``kvllm:num_kv_blocks``, ``kvllm:num_free_kv_blocks``, ``kvllm:prompt_tokens_total``,
  ``kvllm:generation_tokens_total``, ``kvllm:num_preemptions_total`` and the compression counters
  ``kvllm:compression_rounds_total``, ``kvllm:compression_blocks_freed_total``,
  ``kvllm:compression_tokens_evicted_total``, ``kvllm:compression_seconds_total``, and the prefix cache's
  ``kvllm:prefix_cache_queries_total`` / ``kvllm:prefix_cache_hits_total`` (tokens, as vLLM counts them).
  Per compression method (label ``method``, from ``EngineStats.compression_by_method``):
  ``kvllm:compression_method_rounds_total``, ``..._tokens_seen_total``, ``..._tokens_evicted_total``,
  ``..._tokens_merged_total``, ``..._blocks_freed_total``, ``..._seconds_total``; tokens, blocks and seconds add up
  to the totals (a round that compressed sequences of two methods counts once for each of them).
* Per-request histograms observed by the HTTP layer (seconds, vLLM's buckets):
  ``kvllm:time_to_first_token_seconds``, ``kvllm:inter_token_latency_seconds``,
  ``kvllm:e2e_request_latency_seconds``, ``kvllm:request_prompt_tokens``, ``kvllm:request_generation_tokens``;
  counters ``kvllm:request_success_total{finished_reason}`` and ``kvllm:admission_rejections_total``.
"""
from __future__ import annotations

import time
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# No "<name>_created" series (vLLM hides them too); process-wide, which is what a server process wants.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


class EngineStatsCollector(Collector):
    """Reads ``engine.stats()`` when scraped."""

    GAUGES = (
        ("num_requests_running", "num_running", "Number of sequences running in the engine."),
        ("num_requests_waiting", "num_waiting", "Number of sequences waiting to be scheduled."),
        ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage: fraction of KV blocks in use (0..1)."),
        ("num_kv_blocks", "num_blocks", "Total KV blocks in the pool."),
        ("num_free_kv_blocks", "num_free_blocks", "Free KV blocks in the pool."),
        ("full_tier_bytes", "full_tier_bytes", "Host memory holding lossless full caches and swapped blocks."),
    )
    COUNTERS = (
        ("prompt_tokens", "prompt_tokens_total", "Prefill tokens processed."),
        ("generation_tokens", "generation_tokens_total", "Generation tokens produced."),
        ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
        ("compression_rounds", "compression_rounds", "KV-compression rounds run."),
        ("compression_blocks_freed", "compression_blocks_freed", "KV blocks freed by compression."),
        ("compression_tokens_evicted", "compression_tokens_evicted", "KV tokens evicted by compression."),
        ("compression_seconds", "compression_seconds", "Wall time spent compressing (seconds)."),
        ("compression_tokens_seen", "compression_tokens_seen", "KV tokens scored by compression."),
        ("compression_tokens_merged", "compression_tokens_merged",
         "KV tokens folded into a kept slot by merging compression (counted in the evicted tokens too)."),
        ("compression_on_demand_rounds", "compression_on_demand_rounds",
         "Compression rounds run on demand before a preemption."),
        ("swapped_out_blocks", "swapped_out_blocks", "KV blocks swapped out to host memory by preemptions."),
        ("recomputed_tokens", "recomputed_tokens", "Computed tokens thrown away by recompute preemptions."),
        ("lossless_drafted_tokens", "lossless_drafted", "Lossless mode: tokens drafted from compressed caches."),
        ("lossless_accepted_tokens", "lossless_accepted", "Lossless mode: drafts the full cache agreed with."),
        ("lossless_verifications", "lossless_verifications", "Lossless mode: verification steps."),
        ("lossless_verify_seconds", "lossless_verify_seconds", "Lossless mode: time spent verifying (seconds)."),
        ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of prompt tokens looked up."),
        ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of prompt tokens found cached."),
    )

    METHOD_COUNTERS = (
        ("rounds", "Compression rounds that compressed sequences of this method."),
        ("tokens_seen", "KV tokens scored by this compression method."),
        ("tokens_evicted", "KV tokens removed by this compression method (merged ones included)."),
        ("tokens_merged", "KV tokens folded into a kept slot by this compression method."),
        ("blocks_freed", "KV blocks freed by this compression method."),
        ("seconds", "Wall time spent compressing with this method (seconds; a round's shared work split by tokens)."),
    )

    def __init__(self, engine: Any, model_name: str, prefix: str = "kvllm:"):
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def describe(self):
        return []

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # a dead engine must not break /metrics
            stats = None
        for name, attr, doc in self.GAUGES:
            g = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(stats, attr, 0) or 0))
            yield g
        for name, attr, doc in self.COUNTERS:
            c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(stats, attr, 0) or 0))
            yield c
        by_method = getattr(stats, "compression_by_method", None) or {}
        for key, doc in self.METHOD_COUNTERS:
            c = CounterMetricFamily(self.prefix + "compression_method_" + key, doc, labels=["model_name", "method"])
            for method in sorted(by_method):
                c.add_metric([self.model_name, method], float(by_method[method].get(key, 0) or 0))
            yield c
        healthy = GaugeMetricFamily(self.prefix + "engine_healthy", "1 while the engine loop runs.",
                                    labels=["model_name"])
        try:
            ok = bool(self.engine.is_healthy())
        except Exception:
            ok = False
        healthy.add_metric([self.model_name], 1.0 if ok else 0.0)
        yield healthy


class ServerMetrics:
    """All metrics of one app, in a private registry."""

    def __init__(self, engine: Any, model_name: str, prefix: str = "kvllm:"):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram(prefix + "time_to_first_token_seconds", "Time to first token (seconds).",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(prefix + "inter_token_latency_seconds", "Inter-token latency (seconds).",
                             labels, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(prefix + "e2e_request_latency_seconds", "End-to-end request latency (seconds).",
                             labels, buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        self.prompt_tokens = Histogram(prefix + "request_prompt_tokens", "Prompt tokens per request.",
                                       labels, buckets=TOKEN_BUCKETS, registry=reg).labels(model_name)
        self.generation_tokens = Histogram(prefix + "request_generation_tokens",
                                           "Generated tokens per request.", labels, buckets=TOKEN_BUCKETS,
                                           registry=reg).labels(model_name)
        self._success = Counter(prefix + "request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=reg)
        self.rejections = Counter(prefix + "admission_rejections",
                                  "Requests rejected with 503 because the queue was full.", labels,
                                  registry=reg).labels(model_name)
        reg.register(EngineStatsCollector(engine, model_name, prefix))

    def request_finished(self, finished_reason: str | None) -> None:
        self._success.labels(self.model_name, finished_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per engine request: observes TTFT, inter-token latency and E2E latency from delta outputs."""

    def __init__(self, metrics: ServerMetrics | None, arrival: float | None = None):
        self.metrics = metrics
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.last: float | None = None
        self.num_tokens = 0

    def on_delta(self, num_new_tokens: int) -> bool:
        """Record a delta carrying num_new_tokens tokens; True on the first tokens of the request."""
        if num_new_tokens <= 0:
            return False
        now = time.perf_counter()
        first = self.last is None
        if self.metrics is not None:
            if first:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                gap = (now - self.last) / num_new_tokens
                for _ in range(min(num_new_tokens, 64)):
                    self.metrics.itl.observe(gap)
        self.last = now
        self.num_tokens += num_new_tokens
        return first

    def on_finish(self, prompt_tokens: int, reasons: list[str | None]) -> None:
        if self.metrics is None:
            return
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.prompt_tokens.observe(prompt_tokens)
        self.metrics.generation_tokens.observe(self.num_tokens)
        for r in reasons:
            self.metrics.request_finished(r)
