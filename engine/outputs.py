"""Results returned to users (vLLM's RequestOutput / CompletionOutput fields)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    prompt_logprobs: list[float | None] | None = None  # teacher-forced scoring results
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    compression_rounds: int = 0
    compression_blocks_freed: int = 0
    compression_tokens_evicted: int = 0
    compression_tokens_seen: int = 0  # tokens scored by compression (retention = 1 - evicted / seen)
    compression_seconds: float = 0.0
    engine_seconds: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which were found there
    compression_on_demand_rounds: int = 0  # rounds run before a preemption, regardless of the period
    queries_cached: int = 0  # window tokens whose queries came from the query cache
    queries_recomputed: int = 0  # window tokens whose queries were recomputed
    query_cache_bytes: int = 0  # held now by the running sequences' query caches
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    recomputed_tokens: int = 0  # computed tokens thrown away by recompute preemptions
    compression_tokens_merged: int = 0  # of the evicted tokens, those folded into a kept slot (merging methods)
    # per method name: rounds, on_demand_rounds, tokens_seen, tokens_evicted, tokens_merged, blocks_freed, seconds,
    # queries_cached, queries_recomputed (tokens and seconds add up to the totals above)
    compression_by_method: dict[str, dict] = field(default_factory=dict)
    lossless_drafted: int = 0  # tokens drafted from compressed caches
    lossless_accepted: int = 0  # drafts the full cache agreed with
    lossless_verifications: int = 0
    lossless_verify_seconds: float = 0.0
    full_tier_bytes: int = 0  # host memory holding lossless sequences' full KV (and swapped blocks) now
    structured_fill_seconds: float = 0.0  # structured outputs: filling the grammar bitmasks
    structured_apply_seconds: float = 0.0  # applying them to the logits
    structured_accept_seconds: float = 0.0  # advancing the grammar matchers with the sampled tokens

    @property
    def lossless_mean_accepted(self) -> float | None:
        """Drafts accepted per verification step."""
        return self.lossless_accepted / self.lossless_verifications if self.lossless_verifications else None

    @property
    def compression_retention(self) -> float | None:
        if not self.compression_tokens_seen:
            return None
        return 1.0 - self.compression_tokens_evicted / self.compression_tokens_seen
