"""Chelsea / CentroidKV (arXiv 2506.11418): merge instead of drop. The region's KV slots are clustered by key
similarity with Chunked Soft Matching and each cluster is replaced by its centroid (mean key, mean value), written
into one slot per cluster; every (layer, KV head) keeps exactly k slots. Pure torch, float32 matching.

Only the abstract is public: key states are similar along the sequence; the sequence is split into chunks; inside
each chunk an alternating partition splits the tokens into two sets and clusters are found by similarity; each
cluster's KV is merged into a single centroid; cost O(n c d) instead of O(n^2 d). What follows fills the gaps in
the manner of ToMe's bipartite soft matching (the method the abstract adapts); these are our choices:
  * chunks are fixed ranges of ``chunk_size`` c region slots (default 16; raised to ceil(n / k) when n / k is
    larger, so that there are at most k chunks and k is reachable). Clusters never cross a chunk, which bounds
    how far apart (in positions) merged post-RoPE keys can be.
  * one round: inside each chunk, the live clusters in slot order alternate between set A (1st, 3rd, ...) and
    set B (2nd, 4th, ...). Each A cluster's edge is its most cosine-similar B cluster of the same chunk (ties ->
    lower slot); the r edges with the highest similarity over the whole region (ties -> lower slot) merge their A
    cluster into their B cluster (several A may join one B). r = min(still to merge, the fewest A clusters with an
    edge over all (layer, head) rows), so every row merges the same number and the kept count stays uniform.
  * rounds repeat on the merged clusters (their keys are the centroids) until n - k merges are done. Each round
    at least halves what is left to merge (each row has >= (live - chunks) / 2 >= remaining / 2 edges), so there
    are O(log n) rounds.
  * a centroid is the plain mean of all the original keys (values) merged into it, i.e. size-weighted across
    rounds. No log(size) attention bias (not expressible in a standard paged-attention kernel).
  * the cluster's slot is its B representative (the surviving slot); kept slots are returned ascending.
Cost: O(L Hkv n c D) per round (the c x c similarities of every chunk).

Registered as ``centroid`` (bottom of this module), periodic policy only (the threshold policy would re-merge
centroids at every event, averaging ever more distant post-RoPE keys). It keeps k = ⌈r·n⌉ slots per window (no
α); the stage gathers the window's values too and the compaction writes the centroids into the kept slots
(`paging.compaction.CompactionJob.new_keys` / ``new_values``). All n - k removed slots count as merged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compression import registry
from compression.base import Compressor, Selection, WindowBatch
from compression.method_utils import check_int, check_window
from compression.primitives import layer_groups

CENTROID_CHUNK_SIZE = 16


def _check(keys: torch.Tensor, num_region: int, k: int, chunk_size: int) -> None:
    check_window("centroid", None, keys, num_region, needs_queries=False)
    check_int("k", k, 1, num_region, method="centroid")
    check_int("chunk_size", chunk_size, 2, method="centroid")


def _centroids(x: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """Mean of x [R, n, D] over the members of each owner slot: [R, n, D] (rows of non-owners are 0)."""
    R, n, d = x.shape
    sums = torch.zeros_like(x).scatter_add_(1, owner[..., None].expand(R, n, d), x)
    ones = torch.ones_like(owner, dtype=x.dtype)
    cnt = torch.zeros(R, n, dtype=x.dtype, device=x.device).scatter_add_(1, owner, ones)
    return sums / cnt.clamp(min=1)[..., None]


def centroid_clusters(keys: torch.Tensor, num_region: int, k: int, *,
                      chunk_size: int = CENTROID_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked soft matching of the region's keys (module docstring). keys [L, Hkv, W, D] (the first num_region
    slots are clustered). Returns (kept LongTensor [L, Hkv, k], ascending: the slot of each cluster;
    owner LongTensor [L, Hkv, n]: the kept slot each region slot was merged into, owner[j] == j for kept slots)."""
    _check(keys, num_region, k, chunk_size)
    L, hkv, _, d = keys.shape
    n = num_region
    R = L * hkv
    dev = keys.device
    x = keys[:, :, :n].to(torch.float32).reshape(R, n, d)
    # a chunk longer than the region matches the same pairs as one of the region's length: clamp, so memory never
    # follows a requested chunk_size past the region
    c = min(max(chunk_size, math.ceil(n / k)), n)
    nch = math.ceil(n / c)
    pad = nch * c - n
    pos = torch.arange(n, device=dev)
    chunk_first = (pos // c) * c  # first slot of each slot's chunk
    owner = pos.expand(R, n).clone()
    alive = torch.ones(R, n, dtype=torch.bool, device=dev)
    cent = x
    need = n - k
    while need > 0:
        # Rank of each live cluster inside its chunk (slot order): even -> set A, odd -> set B.
        cs = alive.to(torch.long).cumsum(dim=-1)
        before = torch.where(chunk_first > 0, cs[:, (chunk_first - 1).clamp(min=0)], 0)
        rank = cs - before - 1
        is_a = alive & (rank % 2 == 0)
        is_b = alive & (rank % 2 == 1)
        kh = F.pad(F.normalize(cent, dim=-1), (0, 0, 0, pad)).reshape(R, nch, c, d)
        a_ch = F.pad(is_a, (0, pad)).reshape(R, nch, c)
        b_ch = F.pad(is_b, (0, pad)).reshape(R, nch, c)
        best, arg = kh.new_empty(R, nch, c), torch.empty(R, nch, c, dtype=torch.long, device=dev)
        for r0, r1 in layer_groups(R, nch * c * c):  # rows of (layer, head): bounded [rows, nch, c, c] similarities
            sim = torch.matmul(kh[r0:r1], kh[r0:r1].transpose(-1, -2))
            sim = sim.masked_fill(~(a_ch[r0:r1, :, :, None] & b_ch[r0:r1, :, None, :]), float("-inf"))
            best[r0:r1], arg[r0:r1] = sim.max(dim=-1)  # ties -> first (lower) B slot
        edge = best.reshape(R, nch * c)[:, :n]
        dest = arg.reshape(R, nch * c)[:, :n] + chunk_first
        edge = torch.where(torch.isnan(edge), -2.0, edge)  # NaN keys: valid edges, below any cosine
        num_edges = (edge > float("-inf")).sum(dim=-1)
        r = min(need, int(num_edges.min()))
        chosen = torch.sort(edge, dim=-1, descending=True, stable=True).indices[:, :r]
        step = pos.expand(R, n).clone()
        step.scatter_(1, chosen, dest.gather(1, chosen))
        owner = step.gather(1, owner)  # members of merged A clusters follow them into B
        alive.scatter_(1, chosen, False)
        need -= r
        cent = _centroids(x, owner)
    kept = torch.where(alive, pos, n).sort(dim=-1).values[:, :k]
    return kept.reshape(L, hkv, k), owner.reshape(L, hkv, n)


def centroid_merge(keys: torch.Tensor, values: torch.Tensor, num_region: int, k: int, *,
                   chunk_size: int = CENTROID_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the region of each (layer, KV head) into k clusters. keys / values [L, Hkv, W, D]. Returns
    (kept [L, Hkv, k] ascending region slots, new_keys [L, Hkv, k, D], new_values [L, Hkv, k, D]): the K/V to
    write into kept slot t is the mean of the original K/V of every region slot merged into it (computed in
    float32, returned in keys' / values' dtype). Compaction writes them with
    `paging.compaction.CompactionJob` (its ``new_keys`` / ``new_values``)."""
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"centroid.values {tuple(values.shape)} must match keys {tuple(keys.shape)} on [L, Hkv, W]")
    kept, owner = centroid_clusters(keys, num_region, k, chunk_size=chunk_size)
    L, hkv, _, d = keys.shape
    n = num_region
    R = L * hkv
    own = owner.reshape(R, n)
    idx = kept.reshape(R, k)

    def merged(t: torch.Tensor) -> torch.Tensor:
        dt = t.shape[-1]
        c = _centroids(t[:, :, :n].to(torch.float32).reshape(R, n, dt), own)
        return c.gather(1, idx[..., None].expand(R, k, dt)).reshape(L, hkv, k, dt).to(t.dtype)

    return kept, merged(keys), merged(values)


@dataclass
class CentroidParams:
    """chunk_size c (16): region slots per matching chunk (clusters never cross a chunk; raised to ⌈n / k⌉ when
    that is larger)."""
    chunk_size: int = CENTROID_CHUNK_SIZE

    def validate(self) -> None:
        check_int("chunk_size", self.chunk_size, 2)


class CentroidCompressor(Compressor):
    """Merges each window's region into ⌈r·n⌉ centroids per (layer, KV head)."""

    needs_queries = False
    needs_values = True

    def select_windows(self, batch: WindowBatch) -> Selection:
        if batch.values is None:
            raise ValueError("centroid needs the window values")
        n = batch.num_region
        kept, new_keys, new_values = centroid_merge(batch.keys, batch.values, n, self.num_kept(n),
                                                    chunk_size=self.config.chunk_size)
        return Selection(kept, new_keys, new_values)


registry.register("centroid", CentroidCompressor, CentroidParams,
                  description="Chelsea/CentroidKV: merge each window's keys/values into ⌈r·n⌉ centroids")


__all__ = ["CENTROID_CHUNK_SIZE", "centroid_clusters", "centroid_merge", "CentroidParams", "CentroidCompressor"]
