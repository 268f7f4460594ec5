"""Continuous batching: which sequences run this step, with how many tokens.

One token budget per step covers decodes and (chunked) prefills together, vLLM-v1 style: running sequences
first, in admission order, then waiting ones. KV slots come from the KV cache manager (paging/kv_cache_manager.py).

Memory pressure, cheapest remedy first:
1. Compress before preempting: if the running sequences' slots for this step do not fit, `shortage` says by how
   many blocks, and the engine's compression stage compresses the complete windows of their uncompressed tails now,
   whatever their period (the scheduler decides; it never runs a forward or a round itself).
2. Preemption: the victim is the not-yet-scheduled running sequence whose eviction costs least (``"cheapest"``:
   recomputing its tokens, or copying its blocks to host memory and back, by the measured costs) or the newest
   (``"newest"``, vLLM's LIFO). A recomputed sequence goes back to the front of the waiting queue with its prompt
   and outputs; a swapped one keeps its KV in host memory and resumes where it was.
Admission: ``"fcfs"`` admits whenever the first chunk fits (and a watermark stays free while others run);
``"compression-aware"`` also requires the projected peak footprint of all running sequences plus the new one, each
under its own compression setting and up to its remaining `max_tokens`, to fit the pool times `admission_optimism`.
A waiting sequence starts from the longest cached prefix of its prompt.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from engine.outputs import EngineStats
from engine.sequence import Sequence, SequenceStatus
from engine.step_types import ScheduledSeq, SchedulerOutput, Shortage, StepResult
from paging.kv_cache_manager import KVCacheManager
from util import cdiv

__all__ = ["Scheduler", "SchedulerConfig", "ScheduledSeq", "SchedulerOutput", "Shortage", "PreemptionCosts"]

SCHEDULING_POLICIES = ("fcfs", "compression-aware")
PREEMPTION_MODES = ("recompute", "swap", "auto")
PREEMPTION_VICTIMS = ("cheapest", "newest")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    watermark_blocks: int = 1  # free blocks kept back when admitting new sequences
    scheduling_policy: str = "fcfs"
    admission_optimism: float = 1.0  # compression-aware: admit while projected blocks <= pool * this
    projected_output_len: int | None = None  # compression-aware: expected outputs when max_tokens is larger
    max_model_len: int = 1 << 30
    preemption_mode: str = "auto"
    preemption_victim: str = "cheapest"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")
        for name, allowed in (("scheduling_policy", SCHEDULING_POLICIES), ("preemption_mode", PREEMPTION_MODES),
                              ("preemption_victim", PREEMPTION_VICTIMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not self.admission_optimism > 0:
            raise ValueError(f"admission_optimism must be > 0, got {self.admission_optimism!r}")
        if self.projected_output_len is not None and self.projected_output_len < 1:
            raise ValueError(f"projected_output_len must be >= 1, got {self.projected_output_len!r}")


@dataclass
class PreemptionCosts:
    """Seconds to recompute one token and to copy one block one way; the engine measures both as it runs."""
    seconds_per_token: float = 1e-3
    seconds_per_block: float = 1e-5

    def recompute(self, seq: Sequence) -> float:
        return seq.num_computed_tokens * self.seconds_per_token

    def swap(self, seq: Sequence) -> float:
        return 2 * len(seq.block_table) * self.seconds_per_block  # out now, in later


class ExternalWork(Protocol):
    """A step component that runs some sequences' next tokens outside the KV pool (lossless mode's verification:
    engine/lossless.py). The scheduler gives such a sequence an `external` item when one is due, reserves nothing
    in the pool for it, and knows nothing else of it."""
    def due(self, seq: Sequence) -> int: ...  # tokens of the external item due now (0: none)
    def reserve(self, seq: Sequence, num_tokens: int) -> bool: ...  # its room outside the pool (False: restart it)
    def admissible(self, seq: Sequence, busy: bool) -> bool: ...  # may it start now (others running: busy)
    def swappable(self, seq: Sequence) -> bool: ...
    def on_preempt(self, seq: Sequence) -> None: ...  # its KV is gone: drop what depended on it


class _NoExternalWork:
    def due(self, seq): return 0
    def reserve(self, seq, num_tokens): return True
    def admissible(self, seq, busy): return True
    def swappable(self, seq): return True
    def on_preempt(self, seq): pass


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, external: ExternalWork | None = None,
                 stats: EngineStats | None = None):
        self.config = config
        self.kv = kv
        # the engine's counters it adds to: preemptions, swapped blocks, recomputed and prompt tokens
        self.stats = stats if stats is not None else EngineStats()
        self.external = external or _NoExternalWork()
        self.costs = PreemptionCosts()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
        if seq.scoring is not None and seq.scoring.decode_like:  # Engine.score: small chunks past score_from
            start = seq.scoring.score_from
            n = min(n, start - computed) if computed < start else min(n, seq.scoring.max_chunk)
        return n

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            try:
                item = self._schedule_running(seq, i, budget, out)
            except Exception as err:  # this sequence's own part failed: it alone is retired
                self._drop(seq, err, out)
                continue
            if item is None:
                continue  # preempted (itself); the next sequence now sits at index i
            out.scheduled.append(item)
            budget -= item.num_tokens
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                try:
                    n = self._admit(seq, budget, out) if self._admissible(seq) else 0
                except Exception as err:
                    self._drop(seq, err, out)
                    continue
                if n == 0:
                    break
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        out.seconds = time.perf_counter() - t0
        return out

    def _schedule_running(self, seq: Sequence, i: int, budget: int, out: SchedulerOutput) -> ScheduledSeq | None:
        """This step's item of the running sequence at index i (None: it was preempted)."""
        n = self.external.due(seq)
        if n:  # its tokens run outside the pool
            if not self.external.reserve(seq, n):
                self.preempt(seq, out, swap=False)  # no room there: start over from the prompt
                return None
            return ScheduledSeq(seq, n, external=True)
        n = self._chunk(seq, budget, seq.num_computed_tokens)
        while not self.kv.allocate_slots(seq, n):
            victim = self._victim(i)
            self.preempt(victim, out)
            if victim is seq:
                return None
        return ScheduledSeq(seq, n)

    def _drop(self, seq: Sequence, err: BaseException, out: SchedulerOutput) -> None:
        """Retire a sequence whose own scheduling raised (its blocks go back); the engine fails its request."""
        self.finish(seq)
        out.failed.append((seq, err))

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Give a waiting sequence its blocks and its first chunk (0: it does not fit now)."""
        # The watermark keeps headroom for running sequences to grow; with none running it would only stop a
        # request that needs (nearly) the whole pool from ever starting.
        watermark = self.config.watermark_blocks if self.running else 0
        if seq.swapped:
            n = self._chunk(seq, budget, seq.num_computed_tokens)
            need = -(-(seq.kv_len + n) // self.kv.block_size)
            if need + watermark > self.kv.num_free_blocks:
                return 0
            out.swapped_in += self.kv.swap_in(seq)
            assert self.kv.allocate_slots(seq, n)
        else:
            cached = self.kv.find_cached_prefix(seq)
            cached_tokens = len(cached) * self.kv.block_size
            n = self._chunk(seq, budget, cached_tokens)
            if not self.kv.allocate_slots(seq, n, cached, watermark):
                return 0
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached_tokens
            seq.num_computed_tokens = cached_tokens
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:  # the end of its queue time (vLLM's SCHEDULED event)
            seq.first_scheduled_time = time.monotonic()
        self.running.append(seq)
        return n

    # -- memory pressure ---------------------------------------------------------------------------------
    def shortage(self) -> Shortage | None:
        """Before `schedule`: the blocks this step's running sequences need beyond the free ones (None: they fit).
        The engine may compress them now (compress before preempting); `schedule` preempts for what is still short."""
        if not self.running:
            return None
        need, budget = 0, self.config.max_num_batched_tokens
        for seq in self.running:
            if budget <= 0:
                break
            n = self._chunk(seq, budget, seq.num_computed_tokens)
            need += self.kv.blocks_needed(seq, n)
            budget -= n
        short = need - self.kv.num_free_blocks
        return Shortage(short, list(self.running)) if short > 0 else None

    def _victim(self, i: int) -> Sequence:
        """Among the running sequences not yet scheduled this step (index >= i, the asking one included)."""
        if self.config.preemption_victim == "newest":
            return self.running[-1]
        return min(reversed(self.running[i:]), key=self._eviction_cost)  # ties: the newest

    def _swaps(self, seq: Sequence) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.external.swappable(seq) or not self.kv.can_swap_out(seq):
            return False
        return mode == "swap" or self.costs.swap(seq) < self.costs.recompute(seq)

    def _eviction_cost(self, seq: Sequence) -> float:
        return self.costs.swap(seq) if self._swaps(seq) else self.costs.recompute(seq)

    def preempt(self, seq: Sequence, out: SchedulerOutput | None = None, swap: bool | None = None) -> None:
        """Swap the sequence's KV to host memory (it resumes where it was) or free it for a recompute from its
        prompt and outputs, whichever the mode and the costs say (or `swap`, when given)."""
        swap = self._swaps(seq) if swap is None else swap
        self.running.remove(seq)
        if swap:
            moved = self.kv.swap_out(seq)
            if out is not None:
                out.swapped_out += moved
        else:
            self.stats.recomputed_tokens += seq.num_computed_tokens
            self.kv.free(seq, finished=False)
            seq.num_computed_tokens = 0
            if seq.compression is not None:
                seq.compression.on_preempt()
            self.external.on_preempt(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1
        if out is not None:
            out.preempted.append(seq)

    # -- compression-aware admission --------------------------------------------------------------------
    def projected_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence will hold at its peak: up to its remaining max_tokens (or the projected output
        length), under its compression setting."""
        p = seq.params
        limit = p.max_tokens if p.max_tokens is not None else self.config.max_model_len - seq.num_prompt_tokens
        if self.config.projected_output_len is not None:
            limit = min(limit, self.config.projected_output_len)
        final = seq.num_prompt_tokens + max(limit, seq.num_outputs)
        peak = final if seq.compression is None else seq.compression.peak_kv_len(final)
        return cdiv(peak, self.kv.block_size)

    def _admissible(self, seq: Sequence) -> bool:
        if not self.external.admissible(seq, busy=bool(self.running)):
            return False
        if self.config.scheduling_policy == "fcfs" or not self.running:
            return True
        total = sum(self.projected_blocks(s) for s in self.running) + self.projected_blocks(seq)
        return total <= self.kv.pool.num_blocks * self.config.admission_optimism

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> None:
        """After the forward: the scheduled tokens' K/V are in the cache (verification items: engine/lossless.py);
        the step's counters and the preemption costs it measured."""
        for item in out.forward:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            self.kv.commit(seq, item.num_tokens)
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.stats.prompt_tokens_total += item.num_tokens
        self.stats.swapped_out_blocks += out.swapped_out
        self.stats.swapped_in_blocks += out.swapped_in
        if out.swapped_out or out.swapped_in:  # block copies dominate a schedule that swapped
            self.costs.seconds_per_block = (0.7 * self.costs.seconds_per_block
                                            + 0.3 * out.seconds / (out.swapped_out + out.swapped_in))
        if result.num_tokens >= 64:  # prefill-heavy steps say what recomputing a token costs
            self.costs.seconds_per_token = (0.7 * self.costs.seconds_per_token
                                            + 0.3 * result.seconds / result.num_tokens)
