"""InfoKV-style entropy-aware scoring (arXiv 2606.26875). Only the abstract is public: it combines an attention
score with an "entropy score" built from (i) the predictive entropy of each token, computed over the top-k most
probable tokens and renormalised, and (ii) a layer-wise representation-evolution signal. The exact formulas,
k and the weights are not published, so everything below the level of the abstract is our choice, stated here.

Score of region slot j, per (layer, KV head), from three non-negative signals each turned into a share of its
total over the scored slots (x_j / sum x, uniform when the total is 0), so they live on one scale:
    a_j  attention: Kara's window score (eq. 3, `compression.kara.kara_scores`) for the window policy, the SnapKV
         observation-window score (`compression.snapkv.snapkv_scores`) for the threshold policy;
    e_j  top-k renormalised entropy of the sampling distribution token j was drawn from (`topk_entropy`);
    r_j  representation change of token j at this layer, e.g. 1 - cos(h_in, h_out) of the layer
         (`representation_change`); optional.
    score_j = (1 - lam) * a_j + lam * ((1 - rho) * e_j + rho * r_j)        (rho term dropped when r is None)

Defaults and why:
  * lam = 0.5: the abstract presents the two as complementary (attention-selected tokens matter for nearby text,
    high-uncertainty tokens for distant text), so neither dominates. Attention shares are peaked and entropy
    shares flat, so heavy hitters still survive while the entropy term decides among the rest.
  * rho = 0.25: entropy is the method's primary signal ("entropy-aware"); the representation-change form is our
    guess, so it gets the smaller part of the entropy score.
  * topk_entropy k = 10: a small top-k gives the "more stable than full-vocabulary" entropy the abstract reports;
    10 covers nearly all of the probability mass of a sampling step, and bounds the entropy by ln 10.
  * temperature 1: the model's distribution; pass the request's temperature to score the actual sampling
    distribution (greedy decoding has none, so use 1 there).

Side signals from the engine. Entropy: recorded when a token is sampled, for the distribution it was sampled
from, and stored with the token's KV slot (slot t gets the entropy of the step that produced token t). Unknown
values (prompt tokens, whose logits are never computed) are NaN and count as the row's mean (neutral). Shapes:
window policy ``[L, W]`` or ``[L, n]`` (one row per leading row, repeated over layers by the caller; a window
was never compacted, so one value per token); threshold policy ``[L, T]`` before any compaction, and
``[L, Hkv, T]`` after one, since compaction moves each KV head's slots differently (see
`paging.compaction.compact_slot_state`). Representation change: the same shapes (its values differ per layer).
Cost: the attention scorer's, plus O(L Hkv n).

In the serving loop (registered as ``infokv``, bottom of this module; periodic, kept count ⌈r·n⌉ per window, no α,
and threshold): the engine computes `topk_entropy` (k = ``entropy_top_k``) of the logits each token is sampled from,
only for sequences using this method, and stores it at the token's logical position
(compression/state.py `EntropyStore`). A periodic window is always the uncompressed tail, so position = slot and the
stage passes the window's entropies as [N*L, W]. Under the threshold policy the stage keeps the entropies per slot
([L, Hkv, T]) and compacts them with the K/V (`paging.compaction.compact_slot_state`). Teacher-forced scoring
samples nothing, so a scorer supplies the entropies itself (bench/compression_quality.py does). The
representation-change signal is not wired into the engine (rep_change=None there, so ``rho`` has no effect): it
needs each layer's input and output hidden states of every scored token, which neither the query cache
(queries captured during the step) nor query recomputation (engine/models/llama.py returns only queries) provides
without a change to the model code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from compression import registry
from compression.base import ScoreMethod, Span
from compression.kara import kara_scores
from compression.method_utils import check_int, check_number, check_threshold, check_window, select_topk
from compression.snapkv import snapkv_scores

INFOKV_LAMBDA = 0.5
INFOKV_RHO = 0.25
INFOKV_TOPK = 10
INFOKV_KERNEL = 5


def topk_entropy(logits: torch.Tensor, k: int = INFOKV_TOPK, temperature: float = 1.0) -> torch.Tensor:
    """Top-k renormalised entropy of each row's distribution softmax(logits / temperature): keep the k largest
    logits, renormalise their probabilities, return -sum p log p (nats). logits [B, V] (any float dtype; -inf
    entries are masked tokens) -> float32 [B] in [0, ln min(k, V)]. A row with fewer than k finite logits uses
    only the finite ones."""
    if logits.dim() != 2:
        raise ValueError(f"infokv.logits must be [B, V], got {tuple(logits.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"infokv.topk must be an integer >= 1, got {k!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"infokv.temperature must be > 0, got {temperature!r}")
    top = torch.topk(logits.to(torch.float32) / float(temperature), min(k, logits.shape[-1]), dim=-1).values
    logp = torch.log_softmax(top, dim=-1)
    p = logp.exp()
    # 0 * log 0 = 0 for masked (-inf) entries; a fully masked row (no distribution) gets 0.
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)
    return torch.nan_to_num(ent, nan=0.0)


def representation_change(h_before: torch.Tensor, h_after: torch.Tensor) -> torch.Tensor:
    """1 - cos(h_before, h_after) along the last axis, float32, in [0, 2]: how much a layer changed each token's
    hidden state (e.g. the layer's input and output residual stream)."""
    if h_before.shape != h_after.shape:
        raise ValueError(f"infokv: hidden states {tuple(h_before.shape)} and {tuple(h_after.shape)} differ")
    return 1.0 - torch.nn.functional.cosine_similarity(h_before.to(torch.float32), h_after.to(torch.float32), dim=-1)


def _share(x: torch.Tensor) -> torch.Tensor:
    """x / sum along the last axis (uniform when the sum is 0); non-finite -> the row mean of the finite values
    (0 when there are none); negatives (rounding) -> 0."""
    x = x.to(torch.float32)
    finite = torch.isfinite(x)
    cnt = finite.sum(dim=-1, keepdim=True)
    mean = torch.where(finite, x, 0.0).sum(dim=-1, keepdim=True) / cnt.clamp(min=1)
    x = torch.where(finite, x, mean).clamp(min=0)
    tot = x.sum(dim=-1, keepdim=True)
    return torch.where(tot > 0, x / torch.where(tot > 0, tot, 1.0), torch.full_like(x, 1.0 / x.shape[-1]))


def _signal(name: str, x: torch.Tensor, L: int, hkv: int, n: int, lengths: tuple[int, ...]) -> torch.Tensor:
    """[L, N] or [L, Hkv, N] with N in lengths -> float32 [L, Hkv, n] (first n slots)."""
    if x.dim() == 2 and x.shape[0] == L and x.shape[1] in lengths:
        x = x[:, None, :]
    elif not (x.dim() == 3 and tuple(x.shape[:2]) in ((L, hkv), (L, 1)) and x.shape[2] in lengths):
        raise ValueError(f"infokv.{name} must be [L={L}, N] or [L, Hkv={hkv}, N] with N in {sorted(set(lengths))}, "
                         f"got {tuple(x.shape)}")
    return x[..., :n].to(torch.float32).expand(L, hkv, n)


def infokv_combine(attention: torch.Tensor, entropy: torch.Tensor, rep_change: torch.Tensor | None = None, *,
                   lam: float = INFOKV_LAMBDA, rho: float = INFOKV_RHO) -> torch.Tensor:
    """score = (1 - lam) * share(attention) + lam * ((1 - rho) * share(entropy) + rho * share(rep_change)).
    attention [L, Hkv, n]; entropy / rep_change [L, n] or [L, Hkv, n] (see the module docstring).
    float32 [L, Hkv, n]."""
    lam = check_number("lambda", lam, 0, 1, method="infokv")
    rho = check_number("rho", rho, 0, 1, method="infokv")
    if attention.dim() != 3:
        raise ValueError(f"infokv.attention must be [L, Hkv, n], got {tuple(attention.shape)}")
    L, hkv, n = attention.shape
    info = _share(_signal("entropy", entropy, L, hkv, n, (n,)))
    if rep_change is not None:
        info = (1.0 - rho) * info + rho * _share(_signal("rep_change", rep_change, L, hkv, n, (n,)))
    return (1.0 - lam) * _share(attention) + lam * info


def infokv_window_scores(queries: torch.Tensor, keys: torch.Tensor, num_region: int, entropy: torch.Tensor,
                         rep_change: torch.Tensor | None = None, *, lam: float = INFOKV_LAMBDA,
                         rho: float = INFOKV_RHO) -> torch.Tensor:
    """Window policy: attention = Kara's window score over the region; entropy / rep_change [L, W] or [L, n]
    (or [L, Hkv, W | n]), the first n entries are the region's. float32 [L, Hkv, n]."""
    check_window("infokv", queries, keys, num_region)
    L, hkv, w = keys.shape[:3]
    n = num_region
    ent = _signal("entropy", entropy, L, hkv, n, (w, n))
    rep = None if rep_change is None else _signal("rep_change", rep_change, L, hkv, n, (w, n))
    return infokv_combine(kara_scores(queries, keys, n), ent, rep, lam=lam, rho=rho)


def infokv_select(queries: torch.Tensor, keys: torch.Tensor, num_region: int, k: int, entropy: torch.Tensor,
                  rep_change: torch.Tensor | None = None, *, lam: float = INFOKV_LAMBDA,
                  rho: float = INFOKV_RHO) -> torch.Tensor:
    """Top-k region slots by `infokv_window_scores`: LongTensor [L, Hkv, k], ascending."""
    check_int("k", k, 0, num_region, method="infokv")
    return select_topk(infokv_window_scores(queries, keys, num_region, entropy, rep_change, lam=lam, rho=rho), k)


def infokv_threshold_scores(queries_obs: torch.Tensor, keys: torch.Tensor, entropy: torch.Tensor,
                            rep_change: torch.Tensor | None = None, *, lam: float = INFOKV_LAMBDA,
                            rho: float = INFOKV_RHO, kernel: int = INFOKV_KERNEL) -> torch.Tensor:
    """Threshold policy: attention = SnapKV observation-window score of the prefix (pooling ``kernel``);
    entropy / rep_change [L, T] or [L, Hkv, T] (per cache slot; [L, T - w] also accepted). float32
    [L, Hkv, T - w]."""
    w = check_threshold("infokv", queries_obs, keys)
    check_int("kernel", kernel, 1, odd=True, method="infokv")
    L, hkv, T = keys.shape[:3]
    n = T - w
    ent = _signal("entropy", entropy, L, hkv, n, (T, n))
    rep = None if rep_change is None else _signal("rep_change", rep_change, L, hkv, n, (T, n))
    return infokv_combine(snapkv_scores(queries_obs, keys, kernel), ent, rep, lam=lam, rho=rho)


def infokv_threshold_select(queries_obs: torch.Tensor, keys: torch.Tensor, budget: int, entropy: torch.Tensor,
                            rep_change: torch.Tensor | None = None, *, lam: float = INFOKV_LAMBDA,
                            rho: float = INFOKV_RHO, kernel: int = INFOKV_KERNEL) -> torch.Tensor:
    check_int("budget", budget, 0, method="infokv")
    return select_topk(infokv_threshold_scores(queries_obs, keys, entropy, rep_change, lam=lam, rho=rho,
                                               kernel=kernel), budget)


@dataclass
class InfoKVParams:
    """lam (0.5): weight of the entropy score against attention; rho (0.25): the representation-change part of the
    entropy score (no effect in the engine, which supplies no such signal); entropy_top_k (10): k of the top-k
    renormalised entropy recorded at sampling; kernel (5): odd pooling width of the threshold policy's SnapKV
    attention score. Why these defaults: the module docstring."""
    LIMITS: ClassVar[dict[str, str]] = {"entropy_top_k": "vocab_size"}  # a top-k over the vocabulary
    lam: float = INFOKV_LAMBDA
    rho: float = INFOKV_RHO
    entropy_top_k: int = INFOKV_TOPK
    kernel: int = INFOKV_KERNEL

    def validate(self) -> None:
        check_number("lam", self.lam, 0.0, 1.0)
        check_number("rho", self.rho, 0.0, 1.0)
        check_int("entropy_top_k", self.entropy_top_k, 1)
        check_int("kernel", self.kernel, 1, odd=True)


class InfoKVCompressor(ScoreMethod):
    """InfoKV-style: attention share mixed with the sampling-entropy share; ⌈r·n⌉ per window."""

    params = InfoKVParams
    needs_entropy = True
    #: what the engine records per sampled token (compression/stage.py `record_entropy`)
    token_entropy = staticmethod(topk_entropy)

    def __init__(self, config):
        super().__init__(config)
        self.entropy_top_k = config.entropy_top_k

    def score(self, span: Span) -> torch.Tensor:
        c = self.config
        if span.policy == "periodic":
            return infokv_window_scores(span.queries, span.keys, span.num_scored, span.entropy, lam=c.lam, rho=c.rho)
        return infokv_threshold_scores(span.queries, span.keys, span.entropy, lam=c.lam, rho=c.rho, kernel=c.kernel)


registry.register("infokv", InfoKVCompressor,
                  description="InfoKV-style: attention + top-k sampling entropy per token; ⌈r·n⌉ per window")


__all__ = ["INFOKV_LAMBDA", "INFOKV_RHO", "INFOKV_TOPK", "INFOKV_KERNEL", "topk_entropy", "representation_change",
           "infokv_combine", "infokv_window_scores", "infokv_select", "infokv_threshold_scores",
           "infokv_threshold_select", "InfoKVParams", "InfoKVCompressor"]
