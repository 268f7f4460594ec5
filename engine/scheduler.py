"""Continuous batching: which sequences run this step, with how many tokens.

One token budget per step covers decodes and (chunked) prefills together, vLLM-v1 style: running sequences
first, in admission order, then waiting ones. KV slots come from the KV cache manager (paging/kv_cache_manager.py):
a running sequence that cannot get its slots preempts the most recently admitted running sequence (possibly
itself): its blocks are freed and it goes back to the front of the waiting queue to be recomputed from prompt +
generated tokens. A waiting sequence starts from the longest cached prefix of its prompt.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.sequence import Sequence, SequenceStatus
from paging.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    watermark_blocks: int = 1  # free blocks kept back when admitting new sequences

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens run this step, starting at seq.num_computed_tokens

    @property
    def completes_prefill(self) -> bool:
        """After this step every known token is computed, so the step yields the next token's logits."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence and return its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    # -- scheduling -------------------------------------------------------------------------------------
    @staticmethod
    def _chunk(seq: Sequence, budget: int, computed: int) -> int:
        """Tokens to run this step for a sequence with `computed` tokens in its cache."""
        n = min(seq.num_tokens - computed, budget)
        if seq.scoring is not None:  # teacher-forced scoring: small chunks past score_from
            start = seq.scoring.score_from
            n = min(n, start - computed) if computed < start else min(n, seq.scoring.max_chunk)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget, seq.num_computed_tokens)
            while not self.kv.allocate_slots(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                cached = self.kv.find_cached_prefix(seq)
                cached_tokens = len(cached) * self.kv.block_size
                n = self._chunk(seq, budget, cached_tokens)
                # The watermark keeps headroom for running sequences to grow; with none running it would only
                # stop a request that needs (nearly) the whole pool from ever starting.
                watermark = self.config.watermark_blocks if self.running else 0
                if not self.kv.allocate_slots(seq, n, cached, watermark):
                    break
                self.waiting.popleft()
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached_tokens
                seq.num_computed_tokens = cached_tokens
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return out

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free the KV cache; the prompt and outputs stay."""
        self.running.remove(seq)
        self.kv.free(seq, finished=False)
        seq.num_computed_tokens = 0
        if seq.compression is not None:
            seq.compression.on_preempt()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def commit(self, scheduled: list[ScheduledSeq]) -> None:
        """Record that the scheduled tokens' K/V are now in the cache."""
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.commit(item.seq, item.num_tokens)
