"""A request as the engine tracks it, and the typed messages other threads send to the engine loop."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from compression.config import KVCompressionConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

#: Receives delta outputs (and, on failure, the exception) on the engine thread.
Sink = Callable[[RequestOutput | BaseException], None]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    sink: Sink | None = None
    done: threading.Event = field(default_factory=threading.Event)
    final: RequestOutput | None = None
    error: BaseException | None = None
    kv_compression: KVCompressionConfig | None = None  # resolved once, against the engine's setting (None: off)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class AddRequest:
    request: Request


@dataclass
class AbortRequest:
    request_id: str


InboxMessage = AddRequest | AbortRequest
