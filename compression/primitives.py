"""Primitives every compression method shares: layer grouping that bounds peak memory, the common top-k (ties ->
lower index, NaN -> -inf) and the integer test of the validators. No method lives here."""
from __future__ import annotations

from typing import Any

import torch

# Above this many float32 elements in one [layers, ...] intermediate, work on groups of layers (the layers of a
# group are still batched). On a GPU 1 << 27 floats = 512 MiB; on a CPU a group is kept near the last-level cache
# (16 MiB), since a softmax and sum over logits that spill to DRAM run several times slower there.
MAX_ELEMS = 1 << 27
MAX_ELEMS_CPU = 1 << 22


def logit_cap(cap: int, device: torch.device | None) -> int:
    """``cap`` elements per layer group, at most MAX_ELEMS_CPU on a CPU device."""
    return cap if device is None or device.type != "cpu" else min(cap, MAX_ELEMS_CPU)


def layer_groups(L: int, per_layer_elems: int, device: torch.device | None = None) -> list[tuple[int, int]]:
    """[l0, l1) ranges covering [0, L) with at most MAX_ELEMS // per_layer_elems layers each (at least one)."""
    step = max(1, min(L, logit_cap(MAX_ELEMS, device) // max(1, per_layer_elems)))
    return [(s, min(L, s + step)) for s in range(0, L, step)]


def finite_scores(scores: torch.Tensor) -> torch.Tensor:
    """float32 copy with NaN -> -inf (NaN scores rank last)."""
    return torch.nan_to_num(scores.to(torch.float32), nan=float("-inf"))


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best positions along the last axis (ties -> lower index, NaN counts as -inf), ascending."""
    order = torch.sort(finite_scores(scores), dim=-1, descending=True, stable=True).indices
    return order[..., :min(k, scores.shape[-1])].sort(dim=-1).values


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON true must not pass as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


__all__ = ["MAX_ELEMS", "MAX_ELEMS_CPU", "logit_cap", "layer_groups", "finite_scores", "topk_sorted",
           "is_int"]
