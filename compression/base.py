"""The `Compressor` interface (pure logic: no model, engine or paging code).

A window compressor sees a `WindowBatch`: several trailing windows, possibly of several sequences, stacked on the
leading (layer) axis, and returns, for every row and KV head, the sorted indices of the region slots to keep. Every
(layer, head) keeps the same count K (positions may differ per head), which is what a paged cache with one block
table per sequence needs. A threshold compressor sees one sequence's whole cache and the queries of its last
``observation_window`` tokens.
"""
from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from compression.config import num_topk

if TYPE_CHECKING:
    from compression.config import KVCompressionConfig


@dataclass
class WindowBatch:
    """N windows stacked on the leading axis: rows [i*L, (i+1)*L) are window i (L = layers).

    keys [N*L, Hkv, W, D] and queries [N*L, Hq, W, D] (post-RoPE; None when the compressor does not need them);
    the first ``num_region`` slots of each window are its region, the rest its buffer. ``generators`` holds one
    torch.Generator per window (its sequence's own, so randomised methods do not depend on other traffic).
    """
    keys: torch.Tensor
    queries: torch.Tensor | None
    num_region: int
    layers: int
    generators: list[torch.Generator] = field(default_factory=list)

    @property
    def num_windows(self) -> int:
        return self.keys.shape[0] // self.layers


class Compressor(ABC):
    #: False for selectors that ignore the queries (random, recency): the stage then skips recomputing them.
    needs_queries: bool = True

    def __init__(self, config: "KVCompressionConfig"):
        self.config = config

    def num_kept(self, num_region: int) -> int:
        """Region slots kept per (layer, head) from a region of ``num_region`` slots."""
        return num_topk(self.config.ratio, num_region)

    # periodic policy
    def select_windows(self, batch: WindowBatch) -> torch.Tensor:
        """LongTensor [N*L, Hkv, K] of kept region indices, ascending per row, K = num_kept(num_region)."""
        return self.select(batch.queries, batch.keys, batch.num_region)

    def select(self, queries: torch.Tensor | None, keys: torch.Tensor, num_region: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not run under the periodic policy")

    # threshold policy
    def select_prefix(self, queries_obs: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
        """queries_obs [L, Hq, w, D] of the last w tokens, keys [L, Hkv, T, D] of all T cached slots -> kept
        indices [L, Hkv, min(budget, T - w)] into the prefix [0, T - w), ascending."""
        raise NotImplementedError(f"{type(self).__name__} does not run under the threshold policy")


def check_window_inputs(queries: torch.Tensor, keys: torch.Tensor, num_region: int) -> None:
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries/keys must be [L, H, W, D], got {tuple(queries.shape)} and {tuple(keys.shape)}")
    L, hq, w, d = queries.shape
    lk, hkv, wk, dk = keys.shape
    if (L, w, d) != (lk, wk, dk):
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} disagree on L, W or D")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if not (0 < num_region <= w):
        raise ValueError(f"num_region must be in (0, {w}], got {num_region}")


def num_kept(ratio: float, n: int, chunk_budget: int) -> int:
    """Slots Kara keeps per (layer, head) from a region of n slots: ⌈r·n⌉ + α, capped at n."""
    return min(n, num_topk(ratio, n) + chunk_budget)


__all__ = ["Compressor", "WindowBatch", "check_window_inputs", "num_kept", "num_topk"]
