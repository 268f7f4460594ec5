"""`RoundStats`: what the compression stage counts, in total and per method (one memory accounting for every
method: ``tokens_evicted`` counts every region slot removed from the cache, merged ones included). Each field says
what it counts; the engine's statistics nest this record and /metrics exports every field of it."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields


def _count(help: str, default=0):
    return field(default=default, metadata={"help": help})


@dataclass
class RoundStats:
    rounds: int = _count("KV-compression rounds run (per method: rounds that compressed sequences of it).")
    on_demand_rounds: int = _count("Compression rounds run on demand before a preemption, whatever the period.")
    queries_cached: int = _count("Window tokens whose queries came from the query cache.")
    queries_recomputed: int = _count("Window tokens whose queries were recomputed.")
    blocks_freed: int = _count("KV blocks freed by compression.")
    tokens_evicted: int = _count("KV tokens removed by compression (merged ones included).")
    tokens_merged: int = _count("KV tokens folded into a kept slot by merging compression.")
    tokens_seen: int = _count("KV tokens scored by compression (retention = 1 - evicted / seen).")
    seconds: float = _count("Wall time spent compressing (seconds; a round's shared work split by tokens).", 0.0)
    #: method name -> that method's share (totals only in the engine-wide record)
    by_method: dict[str, "RoundStats"] = field(default_factory=dict)

    def method(self, name: str) -> "RoundStats":
        return self.by_method.setdefault(name, RoundStats())

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in counted_fields()}

    def snapshot(self) -> "RoundStats":
        """A copy another thread may read while the loop goes on counting."""
        return copy.deepcopy(self)

    @property
    def retention(self) -> float | None:
        return None if not self.tokens_seen else 1.0 - self.tokens_evicted / self.tokens_seen


def counted_fields():
    return [f for f in fields(RoundStats) if f.name != "by_method"]
