"""One generated sequence: its tokens, its scheduling state and its place in the KV cache.

`block_table` and `kv_len` are owned by `paging.kv_cache_manager.KVCacheManager`: nothing else changes them.
State that only one stage needs lives in its own small record: `compression` (the compression stage's frontier,
see compression/state.py), `scoring` (teacher-forced scoring), `structured` (the grammar matcher of structured
outputs, engine/structured.py) and `detok` (the output processor's text state).
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from compression.state import CompressionState
    from engine.lossless import LosslessState
    from engine.structured import GrammarState

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ScoringState:
    """Teacher-forced scoring: log p(prompt[t] | prompt[:t]) is collected for t >= score_from. `Engine.score` feeds
    the prompt at most `max_chunk` tokens per step past score_from so compression acts on it as it would while
    decoding (`decode_like`); a request's `prompt_logprobs` scores the whole prompt in ordinary chunks and also keeps
    the `top_n` most probable tokens of each position."""
    score_from: int
    max_chunk: int
    decode_like: bool = True
    top_n: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    # with top_n, per position: ({token id: logprob} of the top_n, the prompt token's rank in the vocabulary)
    prompt_top: list[tuple[dict[int, float], int]] = field(default_factory=list)


@dataclass
class DetokState:
    """Detokenized text and how much of it (and of the tokens) was already streamed."""
    text: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    # tokenizers' DecodeStream (engine/output_processor.py) and how many output tokens it has been fed
    stream: Any = None
    fed: int = 0


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # position among the request's n completions
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens after the outputs that the model runs before they are outputs (a step component's: lossless mode's
    # drafts): counted in num_tokens and fed to the model, never output by the sequence itself.
    lookahead_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Logical tokens already run through the model; the next token's RoPE position.
    num_computed_tokens: int = 0
    # Owned by the KV cache manager: physical blocks in logical order, and KV slots in use (equal to
    # num_computed_tokens until compression shrinks it).
    block_table: list[int] = field(default_factory=list)
    kv_len: int = 0
    host_block_table: list[int] = field(default_factory=list)  # swapped out: its KV in host memory
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request seed: sampling independent of the batch
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # time.monotonic() of the first admission
    scoring: ScoringState | None = None
    compression: CompressionState | None = None
    lossless: LosslessState | None = None  # lossless mode's own record (engine/lossless.py)
    structured: GrammarState | None = None  # structured outputs: the grammar matcher (engine/structured.py)
    detok: DetokState = field(default_factory=DetokState)

    @property
    def cacheable_prompt_tokens(self) -> int:
        """Leading prompt tokens that compaction never rewrites: the only ones the prefix cache may share."""
        p = self.num_prompt_tokens
        return p if self.compression is None else min(p, self.compression.protected_tokens())

    @property
    def logits_from(self) -> int:
        """The first logical position whose logits the next forward must compute: the last token's (the next token),
        and for teacher-forced scoring every scored position's."""
        last = self.num_tokens - 1
        return last if self.scoring is None else min(last, self.scoring.score_from - 1)

    @property
    def num_tokens(self) -> int:
        """Logical length: prompt + generated (+ lookahead tokens)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.lookahead_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids + self.lookahead_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """Token ids of logical positions [start, start + n) without concatenating the whole sequence."""
        p = self.num_prompt_tokens
        if start >= p and not self.lookahead_token_ids:
            return self.output_token_ids[start - p:start - p + n]
        if start + n <= p:
            return self.prompt_token_ids[start:start + n]
        return self.all_token_ids()[start:start + n]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not computed yet: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def swapped(self) -> bool:
        return bool(self.host_block_table)

    @property
    def in_prefill(self) -> bool:
        return self.num_pending_tokens > 1

    @property
    def max_chunk(self) -> int | None:
        return self.scoring.max_chunk if self.scoring is not None else None
