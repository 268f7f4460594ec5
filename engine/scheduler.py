"""Continuous batching: which sequences run this step, with how many tokens, and in which KV blocks.

One token budget per step covers decodes and (chunked) prefills together, vLLM-v1 style: running sequences
first, in admission order, then waiting ones. A running sequence that needs a block when none is free
preempts the most recently admitted running sequence (possibly itself): its blocks are freed and it goes back
to the front of the waiting queue to be recomputed from prompt + generated tokens.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.sequence import Sequence, SequenceStatus
from paging.block_pool import BlockPool


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    watermark_blocks: int = 1  # free blocks kept back when admitting new sequences

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
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
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
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
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []

    # -- scheduling -------------------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        need = math.ceil((seq.kv_len + num_new_tokens) / self.config.block_size)
        return max(0, need - len(seq.block_table))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_pending_tokens, budget)
        if seq.max_chunk is not None:  # teacher-forced scoring: small chunks past score_from
            start = seq.score_from or 0
            if seq.num_computed_tokens < start:
                n = min(n, start - seq.num_computed_tokens)
            else:
                n = min(n, seq.max_chunk)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            need = self.blocks_needed(seq, n)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            seq.block_table.extend(self.pool.allocate(need))
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                n = self._chunk(seq, budget)
                need = self.blocks_needed(seq, n)
                # The watermark keeps headroom for running sequences to grow; with none running it would only
                # stop a request that needs (nearly) the whole pool from ever starting.
                watermark = self.config.watermark_blocks if self.running else 0
                if need + watermark > self.pool.num_free:
                    break
                self.waiting.popleft()
                seq.block_table.extend(self.pool.allocate(need))
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, scheduled: list[ScheduledSeq]) -> None:
        """Record that the scheduled tokens' K/V are now in the cache."""
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            item.seq.kv_len += item.num_tokens
