"""The `Compressor` interface (pure logic: no model, engine or paging code), and `ScoreMethod`, the base of every
method that only scores slots: it implements `score` (and `keep` when its selection is more than a top-k).

A window compressor sees a `WindowBatch`: several trailing windows, possibly of several sequences, stacked on the
leading (layer) axis, and returns, for every row and KV head, the sorted indices of the region slots to keep. Every
(layer, head) keeps the same count K (positions may differ per head), which is what a paged cache with one block
table per sequence needs. A threshold compressor sees one sequence's whole cache and the queries of its last
``observation_window`` tokens (a `PrefixBatch`).

What a compressor asks the stage for (class attributes): ``needs_queries`` (post-RoPE window / observation
queries), ``needs_values`` (the V of the same slots, e.g. to merge them), ``needs_entropy`` (the top-k entropy of
the distribution each token was sampled from, recorded at sampling time, compression/state.py `EntropyStore`).
What it may return: the kept indices alone, or a `Selection` that also carries computed K/V for the kept slots
(merging: compaction writes them instead of moving the old K/V) and, under the threshold policy, per-slot state
of its own already in post-compaction order (AMS's EMA credit), which the stage stores with the sequence and
hands back at its next event.
"""
from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from compression.config import num_topk
from compression.method_utils import check_int, check_window
from compression.primitives import topk_sorted
from compression.registry import NoParams

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
    #: [N*L, Hkv, W, D] when the compressor `needs_values`.
    values: torch.Tensor | None = None
    #: float32 [N*L, W] when the compressor `needs_entropy`: the entropy recorded for each window token (its row
    #: repeated over the window's L layers; NaN where none was recorded, e.g. prompt tokens).
    entropy: torch.Tensor | None = None

    @property
    def num_windows(self) -> int:
        return self.keys.shape[0] // self.layers


@dataclass
class PrefixBatch:
    """One sequence's whole cache for the threshold policy: keys [L, Hkv, T, D] of all T = kv_len slots, the
    queries [L, Hq, w, D] of its last w = ``obs_window`` tokens (None when the compressor does not need them) and
    ``budget`` prefix slots to keep out of [0, T - w) (the w observation slots are kept after them).

    ``entropy`` (when the compressor `needs_entropy`): float32 [L, Hkv, T], per slot (compaction moves each KV
    head's slots differently, so after the first event it differs per head). ``slot_state``: what the compressor
    returned as `Selection.slot_state` at this sequence's previous event ({} before the first one or after a
    recompute preemption), laid out [L, Hkv, T'] over the slots that existed right after that event (T' <= T:
    slots appended since then are the newest ones)."""
    queries_obs: torch.Tensor | None
    keys: torch.Tensor
    budget: int
    obs_window: int
    values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    slot_state: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Selection:
    """What a selector returns when indices alone do not say it all.

    kept [R, Hkv, K]: as `select_windows` / `select_prefix` return them. new_keys / new_values [R, Hkv, K, D]: the
    K/V to write into the kept slots (merging), both or neither. slot_state (threshold policy): per-slot state
    [L, Hkv, K + w] in post-compaction order (the kept prefix slots, then the w observation slots)."""
    kept: torch.Tensor
    new_keys: torch.Tensor | None = None
    new_values: torch.Tensor | None = None
    slot_state: dict[str, torch.Tensor] | None = None

    @property
    def merges(self) -> bool:
        return self.new_keys is not None


def as_selection(result: "torch.Tensor | Selection") -> Selection:
    return result if isinstance(result, Selection) else Selection(result)


class Compressor(ABC):
    #: False for selectors that ignore the queries (random, recency): the stage then skips recomputing them.
    needs_queries: bool = True
    #: True for selectors that read the values (merging): the stage gathers them into `WindowBatch.values`.
    needs_values: bool = False
    #: True for selectors that read the sampling entropy of each token (InfoKV): the engine records it when it
    #: samples a token of a sequence using this compressor (top-k renormalised, k = `entropy_top_k`).
    needs_entropy: bool = False
    entropy_top_k: int = 10
    #: (logits [B, V], k) -> float32 [B]: the signal recorded for each sampled token when `needs_entropy`
    token_entropy: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def __init__(self, config: "KVCompressionConfig"):
        self.config = config

    def num_kept(self, num_region: int) -> int:
        """Region slots kept per (layer, head) from a region of ``num_region`` slots."""
        return num_topk(self.config.ratio, num_region)

    # periodic policy
    def select_windows(self, batch: WindowBatch) -> "torch.Tensor | Selection":
        """LongTensor [N*L, Hkv, K] of kept region indices, ascending per row, K = num_kept(num_region) (or a
        `Selection` carrying them)."""
        return self.select(batch.queries, batch.keys, batch.num_region)

    def select(self, queries: torch.Tensor | None, keys: torch.Tensor, num_region: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not run under the periodic policy")

    # threshold policy
    def select_prefix(self, queries_obs: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
        """queries_obs [L, Hq, w, D] of the last w tokens, keys [L, Hkv, T, D] of all T cached slots -> kept
        indices [L, Hkv, min(budget, T - w)] into the prefix [0, T - w), ascending."""
        raise NotImplementedError(f"{type(self).__name__} does not run under the threshold policy")

    def select_threshold(self, batch: PrefixBatch) -> "torch.Tensor | Selection":
        """The threshold policy's entry point: `select_prefix` unless a method needs more than queries and keys."""
        return self.select_prefix(batch.queries_obs, batch.keys, batch.budget)


@dataclass
class Span:
    """What a score-based method scores: keys [R, Hkv, T, D] of T consecutive slots whose first ``num_scored`` are
    the candidates; the slots after them (a window's buffer U, or the threshold policy's observation window) are
    kept whatever the scores. ``policy`` "periodic": R = windows x ``layers`` (one window per ``layers`` rows,
    `WindowBatch`), queries [R, Hq, T, D] of every window slot; "threshold": the whole cache (R = layers), queries
    [L, Hq, w, D] of its last w = T - num_scored slots. queries is None for query-free methods; values, entropy
    and generators as in `WindowBatch` / `PrefixBatch`."""
    policy: str
    keys: torch.Tensor
    queries: torch.Tensor | None
    num_scored: int
    layers: int
    generators: list[torch.Generator] = field(default_factory=list)
    values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class ScoreMethod(Compressor):
    """A method that only scores (kvpress's ScorerPress shape): a subclass implements `score` and declares its
    parameter record (`params`) and `policies`; `compression.registry.register` takes both from the class. This
    base selects for both policies: the top `num_kept` candidates of each window (periodic), the top ``budget``
    of the prefix (threshold), ties -> lower index, NaN last; `keep` is the hook a method overrides when its
    selection is more than a top-k of its scores (Kara's Token2Chunk, H2O's recent slots)."""

    params: ClassVar[type] = NoParams
    policies: ClassVar[tuple[str, ...]] = ("periodic", "threshold")

    def score(self, span: Span) -> torch.Tensor:
        """float32 [R, Hkv, span.num_scored]: higher is kept first."""
        raise NotImplementedError

    def keep(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Kept indices [R, Hkv, k], ascending, from scores [R, Hkv, n] (k <= n)."""
        return topk_sorted(scores, k)

    def _runs(self, policy: str) -> None:
        if policy not in self.policies:
            raise NotImplementedError(f"{type(self).__name__} does not run under the {policy} policy")

    def select_windows(self, batch: WindowBatch) -> torch.Tensor:
        self._runs("periodic")
        n = batch.num_region
        check_window(self.config.method, batch.queries, batch.keys, n, needs_queries=self.needs_queries)
        span = Span("periodic", batch.keys, batch.queries, n, batch.layers, batch.generators, batch.values,
                    batch.entropy)
        return self.keep(self.score(span), self.num_kept(n))

    def select(self, queries: torch.Tensor | None, keys: torch.Tensor, num_region: int) -> torch.Tensor:
        return self.select_windows(WindowBatch(keys, queries, num_region, keys.shape[0]))

    def select_prefix(self, queries_obs: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
        return self._select_prefix(PrefixBatch(queries_obs, keys, budget, queries_obs.shape[2]))

    def select_threshold(self, batch: PrefixBatch) -> torch.Tensor:
        if batch.queries_obs is not None and batch.entropy is None:  # queries and keys say it all
            return self.select_prefix(batch.queries_obs, batch.keys, batch.budget)
        return self._select_prefix(batch)

    def _select_prefix(self, batch: PrefixBatch) -> torch.Tensor:
        self._runs("threshold")
        check_int("budget", batch.budget, 0, method=self.config.method)
        keys = batch.keys
        span = Span("threshold", keys, batch.queries_obs, keys.shape[2] - batch.obs_window, keys.shape[0],
                    values=batch.values, entropy=batch.entropy)
        scores = self.score(span)
        return self.keep(scores, min(batch.budget, scores.shape[-1]))


def num_kept(ratio: float, n: int, chunk_budget: int) -> int:
    """Slots Kara keeps per (layer, head) from a region of n slots: ⌈r·n⌉ + α, capped at n."""
    return min(n, num_topk(ratio, n) + chunk_budget)


__all__ = ["Compressor", "ScoreMethod", "Span", "WindowBatch", "PrefixBatch", "Selection", "as_selection", "num_kept",
           "num_topk"]
