"""SnapKV scoring/selection for the threshold-triggered baseline (eqs. 1–2 of the Kara paper; SnapKV arXiv
2404.14469). Pure torch, batched over layers and heads.

The threshold policy: once a sequence's KV length C_t reaches C_max (``threshold_max``), the last w
(``observation_window``) slots are kept and the top N − w (``threshold_target`` − w) older slots by SnapKV score
are kept; everything else is dropped (compaction region = [0, C_t − w), tail = the observation window).
GQA: scores are averaged over the g query heads of a KV group (kvpress convention) and one selection is made
per KV head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compression import registry
from compression.base import ScoreMethod, Span
from compression.method_utils import check_int
from compression.primitives import layer_groups, topk_sorted


def snapkv_scores(queries_obs: torch.Tensor, keys: torch.Tensor, kernel: int) -> torch.Tensor:
    """queries_obs [L, Hq, w, D]: post-RoPE queries of the last w tokens; keys [L, Hkv, T, D]: all T keys (the
    window's keys are the last w). Window query i (position T − w + i) attends keys [0, T − w + i] (causal), the
    softmax runs over that whole row, probabilities are summed over the w queries, averaged over the g query
    heads of each KV group, then avg-pooled along the key axis (kernel k, stride 1, padding k // 2, zero padding
    counted, as F.avg_pool1d). Returns float32 [L, Hkv, T − w]: scores of the prefix before the window."""
    if queries_obs.dim() != 4 or keys.dim() != 4:
        raise ValueError("queries_obs and keys must be [L, H, *, D]")
    L, hq, w, d = queries_obs.shape
    lk, hkv, T, dk = keys.shape
    if (L, d) != (lk, dk) or hq % hkv != 0:
        raise ValueError(f"shape mismatch: queries_obs {tuple(queries_obs.shape)}, keys {tuple(keys.shape)}")
    if T - w < 1:
        raise ValueError(f"need more keys ({T}) than observation-window queries ({w})")
    if kernel < 1:
        raise ValueError(f"kernel must be >= 1, got {kernel}")
    g = hq // hkv
    n = T - w
    dev = keys.device
    # Causal mask in slot space: row i may see key j iff j <= n + i.
    masked = torch.arange(T, device=dev)[None, :] > (n + torch.arange(w, device=dev))[:, None]  # [w, T]
    masked = masked.repeat(g, 1)  # rows ordered (group member, query)
    scale = 1.0 / math.sqrt(d)
    summed = torch.empty(L, hkv, n, dtype=torch.float32, device=dev)
    for l0, l1 in layer_groups(L, hq * w * T, dev):
        q = queries_obs[l0:l1].to(torch.float32).reshape(l1 - l0, hkv, g * w, d) * scale
        k = keys[l0:l1].to(torch.float32)
        logits = torch.matmul(q, k.transpose(-1, -2)).masked_fill(masked, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [l, Hkv, g*w, T]
        summed[l0:l1] = probs[..., :n].reshape(l1 - l0, hkv, g, w, n).sum(dim=3).mean(dim=2)
    pooled = F.avg_pool1d(summed.reshape(L * hkv, 1, n), kernel_size=kernel, stride=1, padding=kernel // 2)
    return pooled[..., :n].reshape(L, hkv, n)


def snapkv_select(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Top-`budget` positions per (layer, head) by score (ties -> lower index), ascending:
    LongTensor [L, Hkv, min(budget, n)]."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return topk_sorted(scores, budget)


@dataclass
class SnapKVParams:
    """snapkv_kernel: the odd average-pooling kernel over the key axis."""
    snapkv_kernel: int = 5

    def validate(self) -> None:
        check_int("snapkv_kernel", self.snapkv_kernel, 1, odd=True)


class SnapKVCompressor(ScoreMethod):
    """Threshold-triggered SnapKV (method "threshold"): ``select_prefix(queries_obs, keys, budget)`` takes the
    queries of the last w slots and the keys of all T = kv_len slots and returns kept indices
    [L, Hkv, min(budget, T − w)] into the prefix [0, T − w); the caller keeps the w window slots after them."""

    params, policies = SnapKVParams, ("threshold",)

    def score(self, span: Span) -> torch.Tensor:
        return snapkv_scores(span.queries, span.keys, self.config.snapkv_kernel)


registry.register("threshold", SnapKVCompressor,
                  description="SnapKV threshold baseline: compress the whole cache to N once it reaches C_max")

__all__ = ["snapkv_scores", "snapkv_select", "SnapKVCompressor", "SnapKVParams"]
