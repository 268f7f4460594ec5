"""Results returned to users (vLLM's RequestOutput / CompletionOutput fields)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `import engine` stays free of torch (engine/threads.py configures it first)
    from compression.stats import RoundStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when the scheduler first admitted one of its sequences


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Engine.score: log p of every scored token; a request's prompt_logprobs: per prompt position None (the first) or
    # ({token id: logprob}, the prompt token's rank): the prompt token first, then the top ones
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache


def _gauge(help: str, metric: str | None = None, default=0):
    return field(default=default, metadata={"kind": "gauge", "help": help, "metric": metric})


def _counter(help: str, metric: str | None = None, default=0):
    return field(default=default, metadata={"kind": "counter", "help": help, "metric": metric})


@dataclass
class EngineStats:
    """The engine's statistics, each counted in one place: the owners of a step add to the engine's one record
    (scheduler, lossless controller, output processor, structured outputs); the compression stage keeps its own
    `RoundStats`, nested here; gauges are read when a snapshot is taken. Every field declares its Prometheus kind
    and name (server/metrics.py exports them all by iterating the fields)."""
    num_running: int = _gauge("Number of sequences running in the engine.", "num_requests_running")
    num_waiting: int = _gauge("Number of sequences waiting to be scheduled.", "num_requests_waiting")
    num_blocks: int = _gauge("Total KV blocks in the pool.", "num_kv_blocks")
    num_free_blocks: int = _gauge("Free KV blocks in the pool.", "num_free_kv_blocks")
    kv_cache_usage: float = _gauge("KV-cache usage: fraction of KV blocks in use (0..1).", "kv_cache_usage_perc", 0.0)
    kv_cache_bytes_per_token: int = _gauge("KV-cache bytes one cached token takes over all layers, 8-bit pages' "
                                           "scales included (this rank's KV heads under tensor parallelism).")
    query_cache_bytes: int = _gauge("Bytes held now by the running sequences' query caches.")
    full_tier_bytes: int = _gauge("Host memory holding lossless full caches and swapped blocks now.")
    num_steps: int = _counter("Engine steps that ran a batch.")
    engine_seconds: float = _counter("Wall time spent in engine steps (seconds).", default=0.0)
    prompt_tokens_total: int = _counter("Prefill tokens processed.", "prompt_tokens")
    generation_tokens_total: int = _counter("Generation tokens produced.", "generation_tokens")
    num_preemptions: int = _counter("Cumulative number of preemptions.")
    swapped_out_blocks: int = _counter("KV blocks swapped out to host memory by preemptions.")
    swapped_in_blocks: int = _counter("KV blocks swapped back in from host memory.")
    recomputed_tokens: int = _counter("Computed tokens thrown away by recompute preemptions.")
    prefix_cache_queries: int = _counter("Prefix cache queries, in terms of prompt tokens looked up.")
    prefix_cache_hits: int = _counter("Prefix cache hits, in terms of prompt tokens found cached.")
    lossless_drafted: int = _counter("Lossless mode: tokens drafted from compressed caches.", "lossless_drafted_tokens")
    lossless_accepted: int = _counter("Lossless mode: drafts the full cache agreed with.", "lossless_accepted_tokens")
    lossless_verifications: int = _counter("Lossless mode: verification steps.")
    lossless_verify_seconds: float = _counter("Lossless mode: time spent verifying (seconds).", default=0.0)
    structured_fill_seconds: float = _counter("Structured outputs: filling grammar bitmasks (seconds).", default=0.0)
    structured_apply_seconds: float = _counter("Structured outputs: applying them to logits (seconds).", default=0.0)
    structured_accept_seconds: float = _counter("Structured outputs: advancing grammar matchers (seconds).",
                                                default=0.0)
    # the compression stage's own record: totals (compression_<field>) and per method (compression_method_<field>)
    compression: RoundStats = field(default_factory=lambda: _round_stats(), metadata={"kind": "nested"})

    @property
    def lossless_mean_accepted(self) -> float | None:
        """Drafts accepted per verification step."""
        return self.lossless_accepted / self.lossless_verifications if self.lossless_verifications else None

    def reset(self) -> None:
        """Zero every count in place (the owners keep counting into this same record)."""
        for f in fields(self):
            if f.name != "compression":
                setattr(self, f.name, type(getattr(self, f.name))())


def _round_stats() -> "RoundStats":
    from compression.stats import RoundStats

    return RoundStats()
