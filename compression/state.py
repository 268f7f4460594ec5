"""Per-sequence compression state: the frontier between the compressed part of the cache and its uncompressed
tail, and when the sequence's next round is due. It depends only on the sequence itself (its own length and its
request's settings), so a greedy or seeded request compresses the same windows at the same points whatever else
runs beside it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from compression.config import KVCompressionConfig


@dataclass
class CompressionState:
    config: KVCompressionConfig
    start: int  # first logical token compression may touch (end of the prompt, 0 with compress_prompt)
    compressed_tokens: int = 0  # logical tokens before the uncompressed tail
    compressed_kv_len: int = 0  # KV slot where the uncompressed tail starts
    last_round_at: int = 0  # the sequence's logical length at its last periodic round (or `start`)
    pending: bool = False  # compress every complete window as soon as the (re-)prefill is done
    ever_compressed: bool = False
    generator: torch.Generator | None = None  # randomised selectors draw from the sequence's own stream
    rounds: int = 0

    def __post_init__(self) -> None:
        self.reset()
        self.pending = self.config.compress_prompt

    @property
    def protected_tokens(self) -> int:
        """Leading tokens compaction never rewrites (the prefix cache may share their blocks)."""
        return 0 if self.config.policy == "threshold" else self.start

    def tail(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - self.compressed_tokens

    def rng(self) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.config.seed)
        return self.generator

    def reset(self) -> None:
        self.compressed_tokens = self.compressed_kv_len = self.last_round_at = self.start

    def on_preempt(self) -> None:
        """The KV cache is gone (recompute preemption). A sequence that was ever compressed is compressed again right
        after its re-prefill rather than holding its whole uncompressed tail until its next round; `ever_compressed`
        is sticky so a second preemption keeps that."""
        self.reset()
        self.pending = self.config.compress_prompt or self.ever_compressed

    def advance(self, region: int, kept: int) -> None:
        self.compressed_tokens += region
        self.compressed_kv_len += kept
        self.ever_compressed = True
