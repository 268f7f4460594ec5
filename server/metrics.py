"""Prometheus metrics with vLLM's names, exported under ``vllm:``, ``kvllm:`` or both (``metrics_prefix``).

Each app gets its own `CollectorRegistry`, so tests can build several apps in one process. The series are kept once,
without a prefix, and `PrefixedCollector` exports every one of them under each configured prefix with the same
suffixes and labels (``vllm:num_requests_waiting`` and ``kvllm:num_requests_waiting``), so vLLM dashboards and routers
work unchanged.

* Engine-wide gauges and counters are read from ``engine.stats()`` at scrape time: every field of
  `engine.outputs.EngineStats` under the name it declares (vLLM's ``num_requests_running``,
  ``num_requests_waiting``, ``kv_cache_usage_perc`` (0..1), ``prompt_tokens_total``, ``generation_tokens_total``,
  ``num_preemptions_total``, ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens), and kvllm's
  own), the compression record as ``compression_<field>_total`` and, per method (label ``method``),
  ``compression_method_<field>_total``: tokens, blocks and seconds of the methods add up to the totals (a round
  that compressed sequences of two methods counts once for each of them).
  ``cache_config_info`` (value 1; the KV cache's settings as labels, vLLM's ``block_size`` / ``num_gpu_blocks`` ...).
* Per-request histograms observed by the HTTP layer (seconds, vLLM's buckets): ``time_to_first_token_seconds``,
  ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``, ``request_prompt_tokens``,
  ``request_generation_tokens``, ``request_params_n``, ``request_params_max_tokens``, and, from the engine's
  timestamps (`engine.outputs.RequestMetrics`), vLLM's phases: ``request_queue_time_seconds`` (arrival to first
  scheduled), ``request_prefill_time_seconds`` (first scheduled to first token), ``request_decode_time_seconds``
  (first to last token), ``request_inference_time_seconds`` (first scheduled to last token) and
  ``request_time_per_output_token_seconds`` (decode time / (generated tokens - 1)); counters
  ``request_success_total{finished_reason}`` and ``admission_rejections_total``.
* Per engine step: ``iteration_tokens_total`` (prompt + generated tokens of the step), through the engine's step
  observers.
"""
from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from compression.stats import RoundStats, counted_fields
from engine.outputs import EngineStats

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
    """Reads ``engine.stats()`` when scraped and exports every field of `engine.outputs.EngineStats` by iterating
    them (each field declares its kind, name and help), the nested compression record as ``compression_<field>``
    totals and ``compression_method_<field>{method}`` series."""

    def __init__(self, engine: Any, model_name: str, prefix: str = ""):
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def describe(self):
        return []

    def _family(self, kind: str, name: str, doc: str, labels: tuple[str, ...] = ("model_name",)):
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        return cls(self.prefix + name, doc, labels=list(labels))

    def _compression(self, rs: RoundStats):
        for f in counted_fields():
            total = self._family("counter", "compression_" + f.name, f.metadata["help"])
            total.add_metric([self.model_name], float(getattr(rs, f.name)))
            yield total
            per = self._family("counter", "compression_method_" + f.name, f.metadata["help"] + " Per method.",
                               ("model_name", "method"))
            for method in sorted(rs.by_method):
                per.add_metric([self.model_name, method], float(getattr(rs.by_method[method], f.name)))
            yield per

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # a dead engine must not break /metrics
            stats = None
        for f in fields(EngineStats):
            kind = f.metadata["kind"]
            if kind == "nested":
                yield from self._compression(getattr(stats, f.name, None) or RoundStats())
                continue
            family = self._family(kind, f.metadata["metric"] or f.name, f.metadata["help"])
            family.add_metric([self.model_name], float(getattr(stats, f.name, 0) or 0))
            yield family
        healthy = GaugeMetricFamily(self.prefix + "engine_healthy", "1 while the engine loop runs.",
                                    labels=["model_name"])
        try:
            ok = bool(self.engine.is_healthy())
        except Exception:
            ok = False
        healthy.add_metric([self.model_name], 1.0 if ok else 0.0)
        yield healthy
        yield self._cache_config(stats)

    def _cache_config(self, stats: Any) -> GaugeMetricFamily:
        """vLLM's info gauge: value 1, the cache settings as labels (vLLM's label names where it has them)."""
        cfg = getattr(self.engine, "config", None)
        comp = getattr(self.engine, "kv_compression_config", None)
        labels = {
            "block_size": getattr(cfg, "block_size", None),
            "num_gpu_blocks": getattr(stats, "num_blocks", None),
            "cache_dtype": getattr(cfg, "kv_cache_dtype", None),  # the flag, as vLLM's label; resolved below
            "kv_cache_format": getattr(self.engine, "kv_cache_format", None),
            "kv_cache_bytes_per_token": getattr(stats, "kv_cache_bytes_per_token", None),
            "enable_prefix_caching": getattr(cfg, "enable_prefix_caching", None),
            "kv_compression": getattr(comp, "method", None),
        }
        info = GaugeMetricFamily(self.prefix + "cache_config_info", "Information of the KV cache configuration.",
                                 labels=["model_name", *labels])
        info.add_metric([self.model_name, *("" if v is None else str(v) for v in labels.values())], 1.0)
        return info


#: vLLM's buckets for tokens per engine step (its eager-mode list, with 8192 for its 8096 typo).
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class PrefixedCollector(Collector):
    """Every series of `inner` (kept without a prefix) under each of `prefixes`, samples and labels unchanged."""

    def __init__(self, inner: CollectorRegistry, prefixes: tuple[str, ...]):
        self.inner = inner
        self.prefixes = prefixes

    def describe(self):
        return []

    def collect(self):
        families = list(self.inner.collect())  # once: the engine's stats are read a single time per scrape
        for prefix in self.prefixes:
            for fam in families:
                out = Metric(prefix + fam.name, fam.documentation, fam.type, fam.unit)
                out.samples = [s._replace(name=prefix + s.name) for s in fam.samples]
                yield out


class ServerMetrics:
    """All metrics of one app, in a private registry; ``prefixes`` are the exported name prefixes."""

    def __init__(self, engine: Any, model_name: str, prefixes: tuple[str, ...] = ("vllm:", "kvllm:")):
        self.inner = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.max_model_len = int(getattr(engine, "max_model_len", 0) or 0) or 100000
        reg = self.inner

        def hist(name: str, doc: str, buckets: list) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=reg).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (seconds).", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency (seconds).", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency (seconds).", E2E_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Time from arrival to first being scheduled (seconds).", E2E_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Time from first being scheduled to the first token (seconds).", E2E_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "Time from the first to the last token (seconds).", E2E_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "Time from first being scheduled to the last token (seconds).", E2E_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: decode time / (generated tokens - 1) (seconds).", ITL_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.params_n = hist("request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens",
                                      "The max_tokens request parameter (the context left when not given).",
                                      buckets_1_2_5(self.max_model_len))
        self.iteration_tokens = hist("iteration_tokens_total", "Prompt + generated tokens per engine step.",
                                     ITERATION_TOKEN_BUCKETS)
        self._success = Counter("request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self.rejections = Counter("admission_rejections", "Requests rejected with 503 because the queue was full.",
                                  ["model_name"], registry=reg).labels(model_name)
        reg.register(EngineStatsCollector(engine, model_name))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PrefixedCollector(self.inner, tuple(prefixes)))
        if hasattr(engine, "add_step_observer"):  # held weakly by the engine: a dropped app stops being told
            engine.add_step_observer(self)

    def observe_step(self, num_tokens: int) -> None:
        """Called on the engine thread after each step that processed tokens."""
        self.iteration_tokens.observe(num_tokens)

    def request_finished(self, finished_reason: str | None) -> None:
        self._success.labels(self.model_name, finished_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per engine request: observes TTFT, inter-token latency and E2E latency from delta outputs, and at the end
    the request's sizes and vLLM's phase times (from the engine's timestamps)."""

    def __init__(self, metrics: ServerMetrics | None, arrival: float | None = None):
        self.metrics = metrics
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.last: float | None = None
        self.num_tokens = 0
        self.tokens_by_choice: dict[int, int] = {}

    def on_delta(self, num_new_tokens: int, by_choice: dict[int, int] | None = None) -> bool:
        """Record a delta carrying num_new_tokens tokens (the most any choice got; ``by_choice``: each choice's
        count); True on the first tokens of the request."""
        for index, k in (by_choice or {}).items():
            self.tokens_by_choice[index] = self.tokens_by_choice.get(index, 0) + k
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

    def on_finish(self, prompt_tokens: int, reasons: list[str | None], timing: Any = None,
                  params: Any = None) -> None:
        """``timing``: the engine's `RequestMetrics` of the finished request; ``params``: its SamplingParams."""
        m = self.metrics
        if m is None:
            return
        m.e2e.observe(time.perf_counter() - self.arrival)
        m.prompt_tokens.observe(prompt_tokens)
        m.generation_tokens.observe(self.num_tokens)
        for r in reasons:
            m.request_finished(r)
        if params is not None:
            m.params_n.observe(params.n)
            mt = params.max_tokens
            m.params_max_tokens.observe(mt if mt is not None else max(m.max_model_len - prompt_tokens, 0))
        if timing is not None and "abort" not in reasons:
            self._phases(m, timing)

    def _phases(self, m: ServerMetrics, t: Any) -> None:
        """vLLM's phase split. The finish time stands for the last token's (both fall in the same engine step)."""
        scheduled, first, last = t.first_scheduled_time, t.first_token_time, t.finished_time
        if scheduled is None or first is None or last is None:
            return
        decode = max(last - first, 0.0)
        m.queue_time.observe(max(scheduled - t.arrival_time, 0.0))
        m.prefill_time.observe(max(first - scheduled, 0.0))
        m.decode_time.observe(decode)
        m.inference_time.observe(max(last - scheduled, 0.0))
        longest = max(self.tokens_by_choice.values(), default=self.num_tokens)
        m.tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)
