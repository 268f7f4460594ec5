"""The plain data one engine step passes between its owners (engine/core.py): the scheduler's decision
(`SchedulerOutput` of `ScheduledSeq` items, and `Shortage` when its running sequences do not fit), the model
runner's `StepResult`, and the `Failures` every owner returns for the requests whose own part raised. Both sides
import this module, never each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.errors import InvalidRequestError, RequestFailedError
from engine.sequence import Sequence

#: (sequence, error) of sequences whose own part of a step failed: their requests end alone
Failures = list[tuple[Sequence, BaseException]]


def tagged(failed: Failures, where: str) -> Failures:
    """Each error as the request's own failure in `where` (a RequestFailedError, a 500), except errors that are
    already one and a request's own invalid setting (an InvalidRequestError, a 400)."""
    return [(seq, err if isinstance(err, (RequestFailedError, InvalidRequestError)) else RequestFailedError(where, err))
            for seq, err in failed]


@dataclass
class Shortage:
    """The scheduler's decision before a step: its running sequences need `blocks` more KV blocks than are free
    for this step's tokens. The compression stage may compress `candidates` now (an on-demand round) before the
    scheduler falls back to preempting."""
    blocks: int
    candidates: list[Sequence]


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens run this step, starting at seq.num_computed_tokens
    external: bool = False  # run by a step component outside the pool (lossless verification), not by the forward

    @property
    def completes_prefill(self) -> bool:
        """After this step every known token is computed, so the step yields the next token's logits."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)  # retired: their own part raised
    swapped_out: int = 0  # blocks copied to host memory
    swapped_in: int = 0
    seconds: float = 0.0  # the schedule's wall time (block copies dominate one that swapped)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def forward(self) -> list[ScheduledSeq]:
        """Items the model runs over the pool (everything but external items)."""
        return [x for x in self.scheduled if not x.external and not x.seq.is_finished]

    @property
    def external(self) -> list[Sequence]:
        """Sequences whose item a step component runs outside the pool."""
        return [x.seq for x in self.scheduled if x.external and not x.seq.is_finished]

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class StepResult:
    num_tokens: int = 0  # tokens the forward ran
    seconds: float = 0.0  # its wall time
    sample_seqs: list[Sequence] = field(default_factory=list)
    logits: torch.Tensor | None = None  # float32 [len(sample_seqs), V]: next-token logits
    # Teacher-forced scoring: per sequence, log p(token[t] | tokens[:t]) for the positions this step covered, and
    # (prompt_logprobs) the top_n most probable tokens of each of them
    scored: list[tuple[Sequence, list[float], list[dict[int, float]]]] = field(default_factory=list)
    # query_source="cache": (sequence, first logical position, post-RoPE queries [L, n, Hq, D]) of its new tokens
    captured: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
    # filled by engine/executor.py after sampling: (sequence, token, logprob entry or None), and the failures of
    # the step's own parts of requests so far (scheduling, the components' after_forward hooks, sampling)
    sampled: list[tuple[Sequence, int, tuple | None]] = field(default_factory=list)
    failed: Failures = field(default_factory=list)


class StepComponent(Protocol):
    """An optional stage of every step (lossless mode, KV compression), built with the owners it needs and run by
    `EngineCore.step` in order: before the schedule, after the forward (before sampling, where it may take rows
    out of `result`), and after the step. Each returns the sequences whose own part failed."""

    def before_schedule(self) -> Failures: ...

    def after_forward(self, sched: SchedulerOutput, result: StepResult) -> Failures: ...

    def after_step(self, sched: SchedulerOutput) -> Failures: ...
