"""Kara (arXiv 2607.01237 §3.2): sliding-window bidirectional attention scoring (eqs. 3–4) + Token2Chunk (eqs. 5–7),
its ablations, and the random / recency window baselines. Pure torch, batched over layers and heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compression import registry
from compression.base import ScoreMethod, Span, WindowBatch, num_kept, num_topk
from compression.method_utils import check_bool, check_int, check_window_inputs
from compression.primitives import layer_groups, topk_sorted


def kara_scores(queries: torch.Tensor, keys: torch.Tensor, num_region: int, *, query_start: int = 0) -> torch.Tensor:
    """Eq. 3: A_j = Σ_{i∈W} softmax_{j'∈W\\U}(⟨Q_i, K_j'⟩/√d)[j] for j in the region [0, num_region).

    queries [L, Hq, W, D], keys [L, Hkv, W, D] (post-RoPE). Every window query attends every region key (no causal
    mask: bidirectional), the softmax runs over the region keys only, and the probabilities are summed over the
    queries and over the g = Hq/Hkv query heads of each KV group. ``query_start`` > 0 uses only the queries
    [query_start, W) (the "w/o Bi-Attention" ablation passes query_start = num_region: buffer queries only).
    Returns float32 [L, Hkv, num_region]. Computed in float32.
    """
    check_window_inputs(queries, keys, num_region)
    L, hq, w, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    if not (0 <= query_start < w):
        raise ValueError(f"query_start must be in [0, {w}), got {query_start}")
    wq = w - query_start
    scale = 1.0 / math.sqrt(d)
    out = torch.empty(L, hkv, num_region, dtype=torch.float32, device=keys.device)
    for l0, l1 in layer_groups(L, hq * wq * num_region, keys.device):
        # Query head h = kv * g + j, so [Hq, Wq] -> [Hkv, g * Wq] keeps each group's queries together.
        q = queries[l0:l1, :, query_start:].to(torch.float32).reshape(l1 - l0, hkv, g * wq, d) * scale
        k = keys[l0:l1, :, :num_region].to(torch.float32)
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)  # [l, Hkv, g*Wq, n]
        out[l0:l1] = probs.sum(dim=-2)
    return out


def token2chunk(scores: torch.Tensor, num_topk: int, chunk_max: int, chunk_budget: int) -> torch.Tensor:
    """Token2Chunk (eqs. 4–7 + the budget fill of §3.2 "Implementation Details"), batched over leading dims.

    scores [..., n] (A over the region). Returns LongTensor [..., min(num_topk + α, n)], ascending:
      1. I = TopK(A, num_topk) (eq. 4), sorted ascending.
      2. Candidate chunk k spans the interior of consecutive kept indices I[k] < I[k+1]: g_k = I[k+1] − I[k] − 1
         slots. Eligible iff g_k ≥ 1 (an empty interior adds nothing) and I[k+1] − I[k] ≤ γ (eq. 6), i.e.
         1 ≤ g_k ≤ γ − 1. Score R_k = (A_I[k] + A_I[k+1]) · g_k (eq. 5).
      3. Keep the interiors of the top ⌊α/γ⌋ eligible chunks by R_k (eq. 7; fewer if fewer are eligible).
         Each adds ≤ γ − 1 slots, so together they add ≤ ⌊α/γ⌋(γ − 1) ≤ α − ⌊α/γ⌋ ≤ α: the budget can never
         be exceeded, and chunks are disjoint (they are interiors of distinct consecutive pairs).
      4. Fill the rest of the α budget with the best not-yet-kept positions by A, so every row keeps exactly
         num_topk + α (all n positions if num_topk + α ≥ n).
    Ties (in A and in R) go to the lower index. NaN scores count as -inf. γ = chunk_max ≥ 1, α = chunk_budget ≥ 0.
    """
    if chunk_max < 1 or chunk_budget < 0 or num_topk < 0:
        raise ValueError(f"token2chunk: need num_topk >= 0, chunk_max >= 1, chunk_budget >= 0; got "
                         f"{num_topk}, {chunk_max}, {chunk_budget}")
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    dev = scores.device
    total = num_topk + chunk_budget
    if total >= n:
        return torch.arange(n, device=dev).expand(*lead, n).clone()
    s = torch.nan_to_num(scores.to(torch.float32), nan=float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # [..., n]
    idx_I = order[..., :num_topk].sort(dim=-1).values  # eq. 4, ascending
    keep = torch.zeros(s.shape, dtype=torch.bool, device=dev)
    keep.scatter_(-1, idx_I, True)

    num_chunks = min(chunk_budget // chunk_max, max(0, num_topk - 1))
    if num_chunks > 0:
        a_I = s.gather(-1, idx_I)
        gaps = idx_I[..., 1:] - idx_I[..., :-1] - 1  # [..., m-1]
        eligible = (gaps >= 1) & (gaps + 1 <= chunk_max)  # eq. 6: I[k+1] - I[k] <= gamma
        r = (a_I[..., :-1] + a_I[..., 1:]) * gaps.to(torch.float32)  # eq. 5
        r = r.masked_fill(~eligible, float("-inf"))
        picks = torch.sort(r, dim=-1, descending=True, stable=True).indices[..., :num_chunks]  # eq. 6 TopK
        picked = eligible.gather(-1, picks).to(torch.int32)  # fewer eligible than picks -> masked out
        starts = idx_I.gather(-1, picks) + 1  # first interior slot
        ends = idx_I.gather(-1, picks + 1)  # one past the last interior slot
        diff = torch.zeros(*lead, n + 1, dtype=torch.int32, device=dev)
        diff.scatter_add_(-1, starts, picked)
        diff.scatter_add_(-1, ends, -picked)
        keep |= diff.cumsum(dim=-1)[..., :n] > 0  # eq. 7

    # Budget fill: the best unkept positions by A, as many as each row still needs.
    need = total - keep.sum(dim=-1, keepdim=True)  # >= 0 (see 3.)
    unkept = ~keep.gather(-1, order)
    take = unkept & (unkept.cumsum(dim=-1) <= need)
    fill = torch.zeros_like(keep)
    fill.scatter_(-1, order, take)
    keep |= fill

    pos = torch.arange(n, device=dev).expand_as(keep)
    return torch.where(keep, pos, n).sort(dim=-1).values[..., :total]


@dataclass
class KaraParams:
    """chunk_max γ ≥ 1 (largest gap Token2Chunk fills), chunk_budget α ≥ 0 (slots it adds per window);
    token2chunk=False is the "w/o Token2Chunk" ablation (top ⌈r·n⌉ + α by score); buffer_queries=True is the
    "w/o Bi-Attention" ablation (scores from the buffer U's queries only)."""
    chunk_max: int = 8
    chunk_budget: int = 16
    token2chunk: bool = True
    buffer_queries: bool = False

    def validate(self) -> None:
        check_int("chunk_max", self.chunk_max, 1)
        check_int("chunk_budget", self.chunk_budget, 0)
        check_bool("token2chunk", self.token2chunk)
        check_bool("buffer_queries", self.buffer_queries)


class Kara(ScoreMethod):
    """Kara window compressor (its ablations through `KaraParams`): scores by eq. 3, keeps by Token2Chunk."""

    params = KaraParams
    policies = ("periodic",)

    def __init__(self, config, *, token2chunk: bool | None = None, buffer_queries_only: bool | None = None):
        super().__init__(config)
        self.use_token2chunk = config.token2chunk if token2chunk is None else token2chunk
        self.buffer_queries_only = config.buffer_queries if buffer_queries_only is None else buffer_queries_only

    def num_kept(self, num_region: int) -> int:
        return num_kept(self.config.ratio, num_region, self.config.chunk_budget)

    def score(self, span: Span) -> torch.Tensor:
        q, k, n = span.queries, span.keys, span.num_scored
        check_window_inputs(q, k, n)
        if self.buffer_queries_only:
            if n >= q.shape[2]:
                raise ValueError("kara_buffer_queries needs a non-empty buffer (num_region < window length)")
            return kara_scores(q, k, n, query_start=n)
        return kara_scores(q, k, n)

    def keep(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        c = self.config
        if self.use_token2chunk:
            return token2chunk(scores, num_topk(c.ratio, scores.shape[-1]), c.chunk_max, c.chunk_budget)
        return topk_sorted(scores, k)


@dataclass
class BudgetParams:
    """chunk_budget: slots kept beyond ⌈r·n⌉ per window, Kara's α, so the ablations compare at one KV length."""
    chunk_budget: int = 16

    def validate(self) -> None:
        check_int("chunk_budget", self.chunk_budget, 0)


class RandomCompressor(ScoreMethod):
    """Keeps ⌈r·n⌉ + α uniformly random region positions per (layer, head). Each window draws from its own
    sequence's generator (seeded with ``config.seed``), so a run is reproducible whatever else is batched with it;
    `select` (no batch) uses a generator of its own, seeded at construction."""

    params, policies, needs_queries = BudgetParams, ("periodic",), False

    def __init__(self, config):
        super().__init__(config)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)

    def select(self, queries, keys: torch.Tensor, num_region: int) -> torch.Tensor:
        return self.select_windows(WindowBatch(keys, queries, num_region, keys.shape[0], [self.generator]))

    def num_kept(self, num_region: int) -> int:
        return num_kept(self.config.ratio, num_region, self.config.chunk_budget)

    def score(self, span: Span) -> torch.Tensor:
        hkv = span.keys.shape[1]
        noise = [torch.rand(span.layers, hkv, span.num_scored, generator=g) for g in span.generators]
        return torch.cat(noise).to(span.keys.device)

    def keep(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        return scores.topk(k, dim=-1).indices.sort(dim=-1).values


class RecentCompressor(RandomCompressor):
    """StreamingLLM-style recency inside the window: keep the newest ⌈r·n⌉ + α region positions (those next to
    the buffer), the same for every layer and head. StreamingLLM's attention sinks are the sequence's first
    tokens, i.e. in the prompt, which is kept intact unless ``compress_prompt`` is set."""

    def score(self, span: Span) -> torch.Tensor:
        n = span.num_scored
        return torch.arange(n, dtype=torch.float32, device=span.keys.device).expand(*span.keys.shape[:2], n)

    keep = ScoreMethod.keep


registry.register("kara", Kara, description="Kara: bidirectional window scores + Token2Chunk")
registry.register("kara_no_chunk", Kara, defaults={"token2chunk": False},
                  description="Kara ablation: top ⌈r·n⌉ + α by score, no Token2Chunk")
registry.register("kara_buffer_queries", Kara, defaults={"buffer_queries": True},
                  description="Kara ablation: scores from the buffer's queries only")
registry.register("random", RandomCompressor, description="⌈r·n⌉ + α random region slots")
registry.register("streaming", RecentCompressor, description="the newest ⌈r·n⌉ + α region slots")


__all__ = ["kara_scores", "token2chunk", "Kara", "KaraParams", "RandomCompressor", "RecentCompressor", "BudgetParams",
           "num_kept"]
