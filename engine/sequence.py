"""One generated sequence: its tokens, its place in the KV cache and its finish state."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # position among the request's n completions
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Logical tokens already run through the model; the next token's RoPE position.
    num_computed_tokens: int = 0
    # KV slots in use. Equals num_computed_tokens until compression shrinks it.
    kv_len: int = 0
    # Compression frontier: KV slot where the not-yet-compressed tail starts, and the logical token
    # count at that point (tail length = num_computed_tokens - compressed_tokens).
    compressed_kv_len: int = 0
    compressed_tokens: int = 0
    # Teacher-forced scoring: log p(prompt[t] | prompt[:t]) is collected for t >= score_from, and the
    # prompt is fed at most `max_chunk` tokens per step so compression runs as it would while decoding.
    score_from: int | None = None
    max_chunk: int | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    # Prompt compression (off by default): the prompt's windows are compressed right after prefill.
    compress_prompt: bool = False
    compress_prompt_pending: bool = False
    generator: torch.Generator | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Detokenized text and how much of it was already streamed.
    text: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0

    def __post_init__(self) -> None:
        self.reset_compression_frontier()

    @property
    def num_tokens(self) -> int:
        """Logical length: prompt + generated."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not computed yet: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def compress_start(self) -> int:
        """First logical token compression may touch: the end of the prompt, or for a scored request the
        start of the scored continuation."""
        if self.score_from is not None:
            return self.score_from
        return 0 if self.compress_prompt else self.num_prompt_tokens

    def reset_compression_frontier(self) -> None:
        self.compressed_tokens = self.compress_start
        self.compressed_kv_len = self.compress_start
        self.compress_prompt_pending = self.compress_prompt

    @property
    def uncompressed_tail(self) -> int:
        return self.num_computed_tokens - self.compressed_tokens

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget the KV cache; the prompt and outputs stay. A sequence that had been
        compressed is compressed again right after its re-prefill (the prompt-compression path) rather than
        holding its whole uncompressed tail until the next periodic round."""
        was_compressed = self.compressed_tokens > self.compress_start
        self.block_table = []
        self.num_computed_tokens = 0
        self.kv_len = 0
        self.reset_compression_frontier()
        self.compress_prompt_pending = self.compress_prompt or was_compressed
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
