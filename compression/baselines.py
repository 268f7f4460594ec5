"""Uniform-budget baselines as window methods (and threshold methods): SnapKV-window, TOVA, H2O, KeyDiff, K-norm.
Pure torch, batched over a leading layer-like axis and KV heads; scores in float32; selection keeps exactly k per
(layer, KV head), ascending, ties -> lower index, NaN scores -> -inf. StreamingLLM is
`compression.kara.RecentCompressor` (the newest region slots).

Registered methods (bottom of this module): ``snapkv``, ``tova``, ``h2o``, ``keydiff``, ``knorm``, each under the
periodic policy (one trailing window at a time, kept count ⌈r·n⌉ per window: none of them has Kara's α; the
comparison bench gives them the ratio that keeps as many slots as Kara's ⌈r·n⌉ + α) and under the threshold policy
(the whole cache to ``threshold_target`` once it reaches ``threshold_max``). ``threshold`` (compression/snapkv.py)
stays the name of the original SnapKV threshold baseline; ``snapkv`` with ``policy="threshold"`` selects the same
slots (avg pooling) and adds the window form.

Sources (conventions carried over, code written here):
  * SnapKV, arXiv 2404.14469: the last ``obs`` queries attend causally, probabilities summed over them, pooled
    (avg or max, kernel 5), averaged over the GQA group (kvpress convention; same as compression/snapkv.py).
  * TOVA, arXiv 2401.06104: the attention of the LAST query, averaged over ALL query heads of the layer (TOVA and
    kvpress ``TOVAPress``), so every KV head of a layer gets the same scores and the same kept set.
  * H2O, arXiv 2306.14048: accumulated attention; here restricted to the window's (recomputed) queries, causal
    inside the window, summed over the GQA group, plus the newest ``num_recent`` region slots always kept.
  * KeyDiff, arXiv 2504.15364: score = -cos(k_j, anchor), anchor = mean of the L2-normalised keys (kvpress
    ``KeyDiffPress``). Query-free.
  * K-norm, arXiv 2406.11430: score = -||k_j||_2 (kvpress ``KnormPress``). Query-free.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compression import registry
from compression.base import ScoreMethod, Span
from compression.config import field_error, num_topk
from compression.method_utils import (
    causal_probs,
    check_int,
    check_obs_window,
    check_threshold,
    check_window,
    group_queries,
    obs_window_len,
    pool1d,
    select_topk,
    threshold_budget,
)
from compression.primitives import layer_groups
from compression.snapkv import snapkv_scores

SNAPKV_KERNEL = 5


# ----------------------------------------------------------------------------- SnapKV (window)
def snapkv_window_scores(queries: torch.Tensor, keys: torch.Tensor, num_region: int, *, obs_window: int | None = None,
                         kernel: int = SNAPKV_KERNEL, pooling: str = "avg") -> torch.Tensor:
    """SnapKV inside one window: the last ``obs_window`` window queries (default: the whole buffer, W - n) attend
    causally to the window keys (query at slot s sees slots [0, s]); probabilities are summed over those queries,
    averaged over the g query heads of each KV group, then pooled along the keys before the observation queries
    ([0, W - obs), avg counting zero padding or max with -inf padding, kernel ``kernel``), and sliced to the region.
    Returns float32 [L, Hkv, n]."""
    check_window("snapkv", queries, keys, num_region)
    check_int("kernel", kernel, 1, odd=True, method="snapkv")
    if pooling not in ("avg", "max"):
        raise ValueError(f"snapkv.pooling must be 'avg' or 'max', got {pooling!r}")
    w = keys.shape[2]
    obs = obs_window_len("snapkv", obs_window, w, num_region)
    q_obs = queries[:, :, w - obs:]
    if pooling == "avg":
        s = snapkv_scores(q_obs, keys, kernel)
    else:  # unpooled sums (kernel 1 is the identity), then max-pool
        s = pool1d(snapkv_scores(q_obs, keys, 1), kernel, "max")
    return s[..., :num_region].contiguous()


def snapkv_window_select(queries: torch.Tensor, keys: torch.Tensor, num_region: int, k: int, *,
                         obs_window: int | None = None, kernel: int = SNAPKV_KERNEL, pooling: str = "avg"
                         ) -> torch.Tensor:
    check_int("k", k, 0, num_region, method="snapkv")
    return select_topk(snapkv_window_scores(queries, keys, num_region, obs_window=obs_window, kernel=kernel,
                                            pooling=pooling), k)


# ----------------------------------------------------------------------------- TOVA
def _last_query_mean_attention(q_last: torch.Tensor, keys: torch.Tensor, num_scored: int) -> torch.Tensor:
    """q_last [L, Hq, 1, D] (the newest token's query; it sees every key), keys [L, Hkv, T, D]. Softmax over all T
    keys per query head, averaged over all Hq heads, columns [0, num_scored), repeated over Hkv."""
    L, hq, _, d = q_last.shape
    hkv, T = keys.shape[1], keys.shape[2]
    out = torch.empty(L, num_scored, dtype=torch.float32, device=keys.device)
    for l0, l1 in layer_groups(L, hq * T):
        q = group_queries(q_last[l0:l1], hkv)  # [l, Hkv, g, 1, D]
        k = keys[l0:l1].to(torch.float32).unsqueeze(2)  # [l, Hkv, 1, T, D]
        probs = causal_probs(q, k, T - 1)  # the last slot sees all keys: no mask
        out[l0:l1] = probs[..., 0, :num_scored].reshape(l1 - l0, hq, num_scored).mean(dim=1)
    return out[:, None, :].expand(L, hkv, num_scored).contiguous()


def tova_scores(queries: torch.Tensor, keys: torch.Tensor, num_region: int) -> torch.Tensor:
    """TOVA in a window: the last window query's attention over the W window keys (softmax over all of them),
    averaged over all query heads, region columns. Identical rows for every KV head. float32 [L, Hkv, n]."""
    check_window("tova", queries, keys, num_region)
    return _last_query_mean_attention(queries[:, :, -1:], keys, num_region)


def tova_select(queries: torch.Tensor, keys: torch.Tensor, num_region: int, k: int) -> torch.Tensor:
    check_int("k", k, 0, num_region, method="tova")
    return select_topk(tova_scores(queries, keys, num_region), k)


def tova_threshold_scores(queries_obs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """TOVA over the whole cache: the last observation query (the newest token) over all T keys; scores of the
    prefix [0, T - w). float32 [L, Hkv, T - w]."""
    w = check_threshold("tova", queries_obs, keys)
    return _last_query_mean_attention(queries_obs[:, :, -1:], keys, keys.shape[2] - w)


def tova_threshold_select(queries_obs: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
    check_int("budget", budget, 0, method="tova")
    return select_topk(tova_threshold_scores(queries_obs, keys), budget)


# ----------------------------------------------------------------------------- H2O
def _accumulated_attention(queries: torch.Tensor, keys: torch.Tensor, num_scored: int) -> torch.Tensor:
    """queries [L, Hq, w, D] of the LAST w slots of keys [L, Hkv, T, D]; query i (slot T - w + i) attends keys
    [0, T - w + i]. Probabilities summed over the w queries and the g heads of each group, columns
    [0, num_scored). float32 [L, Hkv, num_scored]."""
    L, hq, w, _ = queries.shape
    hkv, T = keys.shape[1], keys.shape[2]
    out = torch.empty(L, hkv, num_scored, dtype=torch.float32, device=keys.device)
    for l0, l1 in layer_groups(L, hq * w * T):
        q = group_queries(queries[l0:l1], hkv)  # [l, Hkv, g, w, D]
        k = keys[l0:l1].to(torch.float32).unsqueeze(2)  # [l, Hkv, 1, T, D]
        probs = causal_probs(q, k, T - w)  # [l, Hkv, g, w, T]
        out[l0:l1] = probs[..., :num_scored].sum(dim=(2, 3))
    return out


def h2o_scores(queries: torch.Tensor, keys: torch.Tensor, num_region: int) -> torch.Tensor:
    """H2O's accumulated attention restricted to the window: every window query i attends the window keys
    [0, i] (causal), probabilities summed over all W queries and the g heads of each KV group; region columns.
    float32 [L, Hkv, n]."""
    check_window("h2o", queries, keys, num_region)
    return _accumulated_attention(queries, keys, num_region)


def _recent_plus_heavy(scores: torch.Tensor, k: int, num_recent: int) -> torch.Tensor:
    """Keep the last num_recent positions and the top (k - num_recent) of the others by score; ascending."""
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    heavy = select_topk(scores[..., : n - num_recent], k - num_recent)
    recent = torch.arange(n - num_recent, n, device=scores.device).expand(*lead, num_recent)
    return torch.cat([heavy, recent], dim=-1)


def _num_recent(method: str, num_recent: int | None, k: int) -> int:
    # H2O's default split is heavy_ratio = recent_ratio (0.1 / 0.1): half of the kept slots are recent.
    r = k // 2 if num_recent is None else num_recent
    check_int("num_recent", r, 0, k, method=method)
    return r


def h2o_select(queries: torch.Tensor, keys: torch.Tensor, num_region: int, k: int, *,
               num_recent: int | None = None) -> torch.Tensor:
    """The newest ``num_recent`` region slots (default k // 2, H2O's equal heavy/recent split) plus the top
    k - num_recent older region slots by `h2o_scores`. LongTensor [L, Hkv, k], ascending."""
    check_int("k", k, 0, num_region, method="h2o")
    r = _num_recent("h2o", num_recent, k)
    return _recent_plus_heavy(h2o_scores(queries, keys, num_region), k, r)


def h2o_threshold_scores(queries_obs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Whole-cache H2O approximated with the observation queries (the only recomputed ones): accumulated causal
    attention of the last w queries over the prefix [0, T - w). float32 [L, Hkv, T - w]."""
    w = check_threshold("h2o", queries_obs, keys)
    return _accumulated_attention(queries_obs, keys, keys.shape[2] - w)


def h2o_threshold_select(queries_obs: torch.Tensor, keys: torch.Tensor, budget: int, *,
                         num_recent: int | None = None) -> torch.Tensor:
    """`h2o_threshold_scores` top slots plus the newest ``num_recent`` prefix slots (default kb // 2, kb =
    min(budget, T - w)). LongTensor [L, Hkv, kb], ascending."""
    check_int("budget", budget, 0, method="h2o")
    s = h2o_threshold_scores(queries_obs, keys)
    kb = min(budget, s.shape[-1])
    return _recent_plus_heavy(s, kb, _num_recent("h2o", num_recent, kb))


# ----------------------------------------------------------------------------- KeyDiff
def _keydiff(keys: torch.Tensor, anchor_len: int, num_scored: int) -> torch.Tensor:
    k = keys.to(torch.float32)
    anchor = F.normalize(k[:, :, :anchor_len], p=2, dim=-1).mean(dim=2, keepdim=True)
    return -F.cosine_similarity(k[:, :, :num_scored], anchor, dim=-1)


def keydiff_scores(keys: torch.Tensor, num_region: int) -> torch.Tensor:
    """KeyDiff on the region: score_j = -cos(k_j, anchor), anchor = mean over the region of the L2-normalised keys
    (the candidates; buffer keys are kept anyway). float32 [L, Hkv, n]. Query-free."""
    check_window("keydiff", None, keys, num_region, needs_queries=False)
    return _keydiff(keys, num_region, num_region)


def keydiff_select(queries: torch.Tensor | None, keys: torch.Tensor, num_region: int, k: int) -> torch.Tensor:
    check_int("k", k, 0, num_region, method="keydiff")
    return select_topk(keydiff_scores(keys, num_region), k)


def keydiff_threshold_scores(queries_obs: torch.Tensor | None, keys: torch.Tensor, *,
                             obs_window: int | None = None) -> torch.Tensor:
    """Whole cache: anchor over all T keys (kvpress scores the whole cache); scores of the prefix [0, T - w).
    queries_obs may be None when obs_window (w) is given. float32 [L, Hkv, T - w]."""
    w = check_threshold("keydiff", queries_obs, keys, obs_window)
    T = keys.shape[2]
    return _keydiff(keys, T, T - w)


def keydiff_threshold_select(queries_obs: torch.Tensor | None, keys: torch.Tensor, budget: int, *,
                             obs_window: int | None = None) -> torch.Tensor:
    check_int("budget", budget, 0, method="keydiff")
    return select_topk(keydiff_threshold_scores(queries_obs, keys, obs_window=obs_window), budget)


# ----------------------------------------------------------------------------- K-norm
def knorm_scores(keys: torch.Tensor, num_region: int) -> torch.Tensor:
    """score_j = -||k_j||_2 (low-norm keys draw more attention, arXiv 2406.11430). float32 [L, Hkv, n]."""
    check_window("knorm", None, keys, num_region, needs_queries=False)
    return -torch.linalg.vector_norm(keys[:, :, :num_region].to(torch.float32), dim=-1)


def knorm_select(queries: torch.Tensor | None, keys: torch.Tensor, num_region: int, k: int) -> torch.Tensor:
    check_int("k", k, 0, num_region, method="knorm")
    return select_topk(knorm_scores(keys, num_region), k)


def knorm_threshold_select(queries_obs: torch.Tensor | None, keys: torch.Tensor, budget: int, *,
                           obs_window: int | None = None) -> torch.Tensor:
    """The lowest-norm keys of the prefix [0, T - w): LongTensor [L, Hkv, min(budget, T - w)], ascending."""
    check_int("budget", budget, 0, method="knorm")
    w = check_threshold("knorm", queries_obs, keys, obs_window)
    return select_topk(knorm_scores(keys, keys.shape[2] - w), budget)


# ----------------------------------------------------------------------------- registration
@dataclass
class SnapKVWindowParams:
    """obs_window: trailing window queries observing the region (periodic policy; null: the whole buffer U);
    kernel: odd pooling width along the keys (5, as SnapKV); pooling: "avg" (zero padding counted, kvpress) or
    "max"."""
    obs_window: int | None = None
    kernel: int = SNAPKV_KERNEL
    pooling: str = "avg"

    def validate(self) -> None:
        check_int("obs_window", self.obs_window, 1, none_ok=True)
        check_int("kernel", self.kernel, 1, odd=True)
        if self.pooling not in ("avg", "max"):
            raise field_error("pooling", "must be 'avg' or 'max'", self.pooling)

    def check_common(self, common) -> None:
        check_obs_window(self.obs_window, common)


class SnapKVWindowCompressor(ScoreMethod):
    """SnapKV (arXiv 2404.14469) as a window method and as a threshold method; keeps ⌈r·n⌉ per window."""

    params = SnapKVWindowParams

    def score(self, span: Span) -> torch.Tensor:
        c = self.config
        if span.policy == "periodic":
            return snapkv_window_scores(span.queries, span.keys, span.num_scored, obs_window=c.obs_window,
                                        kernel=c.kernel, pooling=c.pooling)
        if c.pooling == "avg":
            return snapkv_scores(span.queries, span.keys, c.kernel)
        return pool1d(snapkv_scores(span.queries, span.keys, 1), c.kernel, "max")


class TOVACompressor(ScoreMethod):
    """TOVA (arXiv 2401.06104); keeps ⌈r·n⌉ per window (one kept set per layer, shared by its KV heads)."""

    def score(self, span: Span) -> torch.Tensor:
        if span.policy == "periodic":
            return tova_scores(span.queries, span.keys, span.num_scored)
        return tova_threshold_scores(span.queries, span.keys)


@dataclass
class H2OParams:
    """num_recent: the newest kept slots of every selection (null: half of them, H2O's equal heavy/recent split);
    the rest are the heavy hitters by accumulated attention. Must fit the kept count."""
    num_recent: int | None = None

    def validate(self) -> None:
        check_int("num_recent", self.num_recent, 0, none_ok=True)

    def check_common(self, common) -> None:
        if self.num_recent is None:
            return
        kept = (num_topk(common.ratio, common.window - common.buffer) if common.policy == "periodic"
                else threshold_budget(common))
        if self.num_recent > kept:
            raise field_error("num_recent", f"must be <= the slots kept per selection ({kept})", self.num_recent)


class H2OCompressor(ScoreMethod):
    """H2O (arXiv 2306.14048) restricted to the window's queries; keeps ⌈r·n⌉ per window."""

    params = H2OParams

    def score(self, span: Span) -> torch.Tensor:
        if span.policy == "periodic":
            return h2o_scores(span.queries, span.keys, span.num_scored)
        return h2o_threshold_scores(span.queries, span.keys)

    def keep(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        return _recent_plus_heavy(scores, k, _num_recent("h2o", self.config.num_recent, k))


class KeyDiffCompressor(ScoreMethod):
    """KeyDiff (arXiv 2504.15364); query-free; keeps ⌈r·n⌉ per window."""

    needs_queries = False

    def score(self, span: Span) -> torch.Tensor:
        if span.policy == "periodic":
            return keydiff_scores(span.keys, span.num_scored)
        return keydiff_threshold_scores(None, span.keys, obs_window=span.keys.shape[2] - span.num_scored)


class KnormCompressor(ScoreMethod):
    """K-norm (arXiv 2406.11430); query-free; keeps ⌈r·n⌉ per window."""

    needs_queries = False

    def score(self, span: Span) -> torch.Tensor:
        return knorm_scores(span.keys, span.num_scored)


registry.register("snapkv", SnapKVWindowCompressor,
                  description="SnapKV: observation-window attention, pooled; ⌈r·n⌉ per window")
registry.register("tova", TOVACompressor,
                  description="TOVA: the newest token's head-averaged attention; ⌈r·n⌉ per window")
registry.register("h2o", H2OCompressor,
                  description="H2O: accumulated attention + the newest slots; ⌈r·n⌉ per window")
registry.register("keydiff", KeyDiffCompressor,
                  description="KeyDiff: keys least similar to the mean key (query-free); ⌈r·n⌉ per window")
registry.register("knorm", KnormCompressor,
                  description="K-norm: the lowest-norm keys (query-free); ⌈r·n⌉ per window")


__all__ = [
    "snapkv_window_scores", "snapkv_window_select",
    "tova_scores", "tova_select", "tova_threshold_scores", "tova_threshold_select",
    "h2o_scores", "h2o_select", "h2o_threshold_scores", "h2o_threshold_select",
    "keydiff_scores", "keydiff_select", "keydiff_threshold_scores", "keydiff_threshold_select",
    "knorm_scores", "knorm_select", "knorm_threshold_select",
    "SnapKVWindowParams", "SnapKVWindowCompressor", "TOVACompressor", "H2OParams", "H2OCompressor",
    "KeyDiffCompressor", "KnormCompressor",
]
