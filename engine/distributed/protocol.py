"""The messages rank 0 sends to the tensor-parallel workers, in order, over the CPU (gloo) control group.

Every message travels as ``(Sync, op)`` in one `broadcast_object`. `Sync` carries what happened on rank 0 since
the previous message and must be applied first: sequences the workers have not seen yet, sequences that are gone,
KV block copies of swap preemption (in the order rank 0 made them), and rank 0's compactions since the previous
message, which each worker checks against its own (same sequences, same new KV lengths, same freed blocks).

The ops (a worker runs them in the order received; ``Step`` and ``Round`` run collectives, so every rank must run
exactly the same ones):

- ``Init``: where to read the checkpoint and the engine settings a rank sizes its KV cache with; each worker loads
  its shard and answers (gather to rank 0) with its error or its KV block capacity.
- ``Allocate``: the block count every rank uses (the minimum of the capacities) and the swap-space block count;
  each worker allocates its KV shard and answers.
- ``Step``: one forward (`engine.model_runner.ForwardPlan`: ids, positions, block tables, q/kv lengths, the rows
  whose logits are gathered to rank 0, the rows whose queries are kept).
- ``Round``: one compression round ("window" or "threshold") over the listed sequences, with rank 0's block tables,
  lengths and compression frontiers; every rank runs the same `CompressionStage` round on its own KV heads (query
  recomputation is a sharded forward like any other).
- ``Inspect``: each worker answers (gather) with a snapshot of its state (tests, diagnostics).
- ``Shutdown``: leave the loop and exit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

@dataclass
class NewSequence:
    seq_id: int
    request_id: str
    compression: dict[str, Any] | None  # `CompressionState.spec()`: how the worker rebuilds the state


@dataclass
class Sync:
    new: list[NewSequence] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # seq ids rank 0 no longer holds
    # ("out", device blocks, host blocks) / ("in", host blocks, device blocks), in rank 0's order
    copies: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    # rank 0's compactions since the previous message: (seq id, new KV length, freed block ids)
    compactions: list[tuple[int, int, list[int]]] = field(default_factory=list)


@dataclass
class Init:
    source: Any  # engine.loader.ShardSource
    config: Any  # engine.config.EngineConfig (kv_compression dropped: workers get it per sequence)
    dtype: Any  # torch.dtype


@dataclass
class Allocate:
    num_blocks: int
    host_blocks: int


@dataclass
class Step:
    plan: Any  # engine.model_runner.ForwardPlan


@dataclass
class RoundSequence:
    seq_id: int
    num_computed_tokens: int
    kv_len: int
    block_table: list[int]
    state: dict[str, Any]  # its `CompressionState.frontier()`


@dataclass
class Round:
    kind: str  # "window" | "threshold"
    seqs: list[RoundSequence]


@dataclass
class Inspect:
    pass


@dataclass
class Shutdown:
    pass
