"""KV compression as a step component (engine/core.py): before the schedule, compress before preempting when the
scheduler is short of blocks (an on-demand round over the candidates it names); after the forward, keep the
captured queries; after the step, run the rounds that are due (compression/stage.py decides which)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from compression.stage import CompressionStage
from engine.step_types import Failures, SchedulerOutput, StepResult, tagged

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from paging.kv_cache_manager import KVCacheManager


class CompressionStep:
    def __init__(self, stage: CompressionStage, scheduler: Scheduler, kv: KVCacheManager, runner: ModelRunner,
                 compress_before_preempt: bool = True):
        self.stage, self.scheduler, self.kv, self.runner = stage, scheduler, kv, runner
        self.compress_before_preempt = compress_before_preempt

    def before_schedule(self) -> Failures:
        shortage = self.scheduler.shortage() if self.compress_before_preempt else None
        if shortage is not None:
            self.stage.reclaim(shortage.candidates, self.kv, self.runner.recompute_queries, shortage.blocks)
        return tagged(self.stage.take_failed(), "its compression round")

    def after_forward(self, sched: SchedulerOutput, result: StepResult) -> Failures:
        return tagged(self.stage.update_from_output(result.captured), "storing its queries")

    def after_step(self, sched: SchedulerOutput) -> Failures:
        return tagged(self.stage.after_step(self.scheduler.running, self.kv, self.runner.recompute_queries),
                      "its compression round")
