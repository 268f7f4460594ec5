"""R-KV (arXiv 2505.24133): redundancy-aware scoring, as a window method and as a threshold (whole-cache) method.
Pure torch, batched over a leading layer-like axis and KV heads, float32.

Per (layer, KV head), with observation queries q_1..q_w (the newest w tokens) and keys k_0..k_{T-1}, the last w
of which belong to the observation tokens (the "past" is the prefix [0, T - w)):
  * importance: logits q_i.k_j / sqrt(d) are max-pooled over the g query heads of the GQA group BEFORE the
    softmax; softmax over the past keys j in [0, T - w); mean over the w queries; then a stride-1 max-pool of
    width ``kernel`` (7; -inf padding) along j.
  * redundancy: C = Khat Khat^T over ALL T keys (Khat_j = k_j / (||k_j|| + 1e-8)), diagonal zeroed. For each row
    i the newest near-duplicate, the largest j with C[i, j] > ``sim_threshold`` (0.5), is exempted: C[i, j] = 0.
    As in the reference code (``rkv/utils.py::cal_similarity``, reproduced bit-for-bit by its FlashInfer/SGLang
    ports), a row with no near-duplicate zeroes C[i, 0] instead (its "largest masked index" falls back to 0); we
    keep that so selections match R-KV's. r = softmax_j(mean_i C[i, j]), sliced to the past.
  * score_j = lambda * importance_j - (1 - lambda) * r_j, lambda = 0.1 (paper and README; the reference class
    default is 0.07). The top-budget past tokens are kept; the w observation tokens are kept by the caller.

Window method: the window is treated as the whole cache. The observation queries are the last ``obs_window``
window queries (default: the whole buffer U, i.e. all W - n buffer queries: they are the newest tokens, all
after the region, and are kept uncompressed, like R-KV's observation window; R-KV itself uses 8, pass
obs_window=8 for that). Importance runs over keys [0, W - obs) and redundancy over all W window keys, then both
are sliced to the region [0, n).

Cost: the redundancy term forms a T x T (window: W x W) cosine matrix per (layer, KV head): O(L Hkv T^2 D) time
and L Hkv T^2 floats (layers are processed in groups to bound memory); importance is O(L Hq w T D).
R-KV's own schedule (compress to N once N + 128 slots are reached) is the threshold policy's, set by the caller.

Registered as ``rkv`` (bottom of this module), periodic (kept count ⌈r·n⌉ per window, no α) and threshold. R-KV's
own schedule and observation window as a request setting: ``{"method": "rkv", "policy": "threshold",
"threshold_target": N, "threshold_max": N + 128, "observation_window": 8}``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compression import registry
from compression.base import ScoreMethod, Span
from compression.method_utils import (
    check_int,
    check_number,
    check_obs_window,
    check_threshold,
    check_window,
    group_queries,
    obs_window_len,
    select_topk,
)
from compression.primitives import layer_groups

RKV_LAMBDA = 0.1
RKV_KERNEL = 7
RKV_SIM_THRESHOLD = 0.5
#: R-KV's own observation window (alpha); the window method defaults to the whole buffer instead.
RKV_OBS_WINDOW = 8


def _group_reduce(logits: torch.Tensor) -> torch.Tensor:
    """GQA: [..., g, w, n] -> [..., w, n], max over the g query heads of a group (R-KV's pooling="max")."""
    return logits.amax(dim=-3)


def rkv_importance(queries_obs: torch.Tensor, keys: torch.Tensor, *, kernel: int = RKV_KERNEL) -> torch.Tensor:
    """Importance of the past tokens [0, T - w): float32 [L, Hkv, T - w] (see the module docstring)."""
    w = check_threshold("rkv", queries_obs, keys)
    check_int("kernel", kernel, 1, odd=True, method="rkv")
    L, hq, _, d = queries_obs.shape
    hkv, T = keys.shape[1], keys.shape[2]
    n = T - w
    out = torch.empty(L, hkv, n, dtype=torch.float32, device=keys.device)
    for l0, l1 in layer_groups(L, hq * w * n, keys.device):
        q = group_queries(queries_obs[l0:l1], hkv) * (1.0 / math.sqrt(d))  # [l, Hkv, g, w, D]
        k = keys[l0:l1, :, :n].to(torch.float32).unsqueeze(2)  # [l, Hkv, 1, n, D]
        logits = _group_reduce(torch.matmul(q, k.transpose(-1, -2)))  # [l, Hkv, w, n]
        out[l0:l1] = torch.softmax(logits, dim=-1).mean(dim=-2)
    if kernel > 1:
        out = F.max_pool1d(out.reshape(L * hkv, 1, n), kernel_size=kernel, stride=1,
                           padding=kernel // 2).reshape(L, hkv, n)
    return out


def _exempt_newest_duplicate(c: torch.Tensor, sim_threshold: float) -> None:
    """In place on the cosine matrix c [..., T, T] (diagonal already 0): zero each row's newest near-duplicate
    (the largest j with c[i, j] > sim_threshold), or c[i, 0] when the row has none (reference behaviour)."""
    cols = torch.arange(c.shape[-1], device=c.device, dtype=torch.int32)
    newest = torch.where(c > sim_threshold, cols, 0).amax(dim=-1, keepdim=True)
    c.scatter_(-1, newest.long(), 0.0)


def rkv_redundancy(keys: torch.Tensor, *, sim_threshold: float = RKV_SIM_THRESHOLD) -> torch.Tensor:
    """Redundancy of every key: float32 [L, Hkv, T], each row a softmax (sums to 1). See the module docstring."""
    if keys.dim() != 4:
        raise ValueError(f"rkv.keys must be [L, Hkv, T, D], got {tuple(keys.shape)}")
    if isinstance(sim_threshold, bool) or not isinstance(sim_threshold, (int, float)) or math.isnan(sim_threshold):
        raise ValueError(f"rkv.sim_threshold must be a number, got {sim_threshold!r}")
    L, hkv, T, _ = keys.shape
    out = torch.empty(L, hkv, T, dtype=torch.float32, device=keys.device)
    # Per layer: the float32 T x T matrix, its int32 masked-index copy and the bool mask.
    for l0, l1 in layer_groups(L, hkv * T * T * 3, keys.device):
        k = keys[l0:l1].to(torch.float32)
        kh = k / (torch.linalg.vector_norm(k, dim=-1, keepdim=True) + 1e-8)
        c = torch.matmul(kh, kh.transpose(-1, -2))  # [l, Hkv, T, T]
        c.diagonal(dim1=-2, dim2=-1).zero_()
        _exempt_newest_duplicate(c, sim_threshold)
        out[l0:l1] = torch.softmax(c.mean(dim=-2), dim=-1)
    return out


def _mix(importance: torch.Tensor, redundancy: torch.Tensor, lam: float) -> torch.Tensor:
    return importance * lam - redundancy * (1.0 - lam)


def rkv_scores(queries_obs: torch.Tensor, keys: torch.Tensor, *, lam: float = RKV_LAMBDA, kernel: int = RKV_KERNEL,
               sim_threshold: float = RKV_SIM_THRESHOLD) -> torch.Tensor:
    """Threshold form: scores of the past tokens [0, T - w), float32 [L, Hkv, T - w]. queries_obs [L, Hq, w, D] are
    the queries of the last w tokens (R-KV: w = 8), keys [L, Hkv, T, D] all cached keys."""
    lam = check_number("lambda", lam, 0, 1, method="rkv")
    w = check_threshold("rkv", queries_obs, keys)
    n = keys.shape[2] - w
    return _mix(rkv_importance(queries_obs, keys, kernel=kernel),
                rkv_redundancy(keys, sim_threshold=sim_threshold)[..., :n], lam)


def rkv_threshold_select(queries_obs: torch.Tensor, keys: torch.Tensor, budget: int, *, lam: float = RKV_LAMBDA,
                         kernel: int = RKV_KERNEL, sim_threshold: float = RKV_SIM_THRESHOLD) -> torch.Tensor:
    """Top-budget past tokens by `rkv_scores`: LongTensor [L, Hkv, min(budget, T - w)], ascending."""
    check_int("budget", budget, 0, method="rkv")
    return select_topk(rkv_scores(queries_obs, keys, lam=lam, kernel=kernel, sim_threshold=sim_threshold), budget)


def rkv_window_scores(queries: torch.Tensor, keys: torch.Tensor, num_region: int, *, obs_window: int | None = None,
                      lam: float = RKV_LAMBDA, kernel: int = RKV_KERNEL,
                      sim_threshold: float = RKV_SIM_THRESHOLD) -> torch.Tensor:
    """Window form: R-KV on the window as if it were the whole cache, observation queries = the last
    ``obs_window`` window queries (default the whole buffer, W - n; must lie in the buffer). float32 [L, Hkv, n]."""
    check_window("rkv", queries, keys, num_region)
    w = keys.shape[2]
    obs = obs_window_len("rkv", obs_window, w, num_region)
    s = rkv_scores(queries[:, :, w - obs:], keys, lam=lam, kernel=kernel, sim_threshold=sim_threshold)
    return s[..., :num_region].contiguous()


def rkv_select(queries: torch.Tensor, keys: torch.Tensor, num_region: int, k: int, *, obs_window: int | None = None,
               lam: float = RKV_LAMBDA, kernel: int = RKV_KERNEL,
               sim_threshold: float = RKV_SIM_THRESHOLD) -> torch.Tensor:
    """Top-k region slots by `rkv_window_scores`: LongTensor [L, Hkv, k], ascending."""
    check_int("k", k, 0, num_region, method="rkv")
    return select_topk(rkv_window_scores(queries, keys, num_region, obs_window=obs_window, lam=lam, kernel=kernel,
                                         sim_threshold=sim_threshold), k)


@dataclass
class RKVParams:
    """lam λ (0.1, the paper's; its reference class uses 0.07): weight of importance against redundancy;
    kernel: odd max-pool width of the importance (7); sim_threshold: cosine above which a key counts as a
    near-duplicate (0.5); obs_window: trailing window queries used as R-KV's observation window under the periodic
    policy (null: the whole buffer U; R-KV uses 8). Under the threshold policy the common observation_window is
    R-KV's window."""
    lam: float = RKV_LAMBDA
    kernel: int = RKV_KERNEL
    sim_threshold: float = RKV_SIM_THRESHOLD
    obs_window: int | None = None

    def validate(self) -> None:
        check_number("lam", self.lam, 0.0, 1.0)
        check_number("sim_threshold", self.sim_threshold, -1.0, 1.0)
        check_int("kernel", self.kernel, 1, odd=True)
        check_int("obs_window", self.obs_window, 1, none_ok=True)

    def check_common(self, common) -> None:
        check_obs_window(self.obs_window, common)


class RKVCompressor(ScoreMethod):
    """R-KV: λ·importance − (1 − λ)·redundancy, top ⌈r·n⌉ per window (or the threshold budget)."""

    params = RKVParams

    def score(self, span: Span) -> torch.Tensor:
        c = self.config
        kw = dict(lam=c.lam, kernel=c.kernel, sim_threshold=c.sim_threshold)
        if span.policy == "periodic":
            return rkv_window_scores(span.queries, span.keys, span.num_scored, obs_window=c.obs_window, **kw)
        return rkv_scores(span.queries, span.keys, **kw)


registry.register("rkv", RKVCompressor,
                  description="R-KV: attention importance minus key redundancy; ⌈r·n⌉ per window")


__all__ = ["RKV_LAMBDA", "RKV_KERNEL", "RKV_SIM_THRESHOLD", "RKV_OBS_WINDOW", "rkv_importance", "rkv_redundancy",
           "rkv_scores", "rkv_threshold_select", "rkv_window_scores", "rkv_select", "RKVParams", "RKVCompressor"]
