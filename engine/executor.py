"""The middle of a step (engine/core.py): run what the scheduler decided and draw the next tokens. The forward over
the KV pool, the scheduled tokens committed to the cache, the step components' `after_forward` hooks (captured
queries kept, lossless drafts taken out of sampling), then one batched sampling of the remaining rows."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.step_types import SchedulerOutput, StepComponent, StepResult, tagged

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.sampler import Sampler
    from engine.scheduler import Scheduler


class StepExecutor:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler,
                 components: list[StepComponent]):
        self.runner, self.scheduler, self.sampler, self.components = runner, scheduler, sampler, components

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """The step's result: logits, scores and captured queries, the sampled tokens, and every failure of a
        request's own part so far (scheduling, the components, sampling)."""
        result = self.runner.execute(sched.forward)
        self.scheduler.update_from_output(sched, result)
        failed = tagged(sched.failed, "scheduling")
        for component in self.components:
            failed += component.after_forward(sched, result)
        sampled = self.sampler.sample(result.sample_seqs, result.logits)
        result.sampled, result.failed = sampled.tokens, failed + tagged(sampled.failed, "sampling")
        return result
