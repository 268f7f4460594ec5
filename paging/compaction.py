"""In-place compaction of a sequence's paged KV after compression (pure torch, no model code).

The KV tensor is `[L, num_blocks, 2, block_size, Hkv, W]` (see paging/kv_cache.py; an 8-bit row carries its scale
in its last 4 elements, so moving a row moves its scale). A sequence's KV slot s lives at
block ``block_table[s // block_size]``, offset ``s % block_size``. Compacting a region [start, start + len) with
per-(layer, head) kept indices `kept [L, Hkv, K]` (relative to start, sorted) rewrites, for every layer and head:

    slots [start, start + K)             <- the kept slots of the region, in order
    slots [start + K, kv_len − len + K)  <- the old slots [start + len, kv_len) (buffer and anything after it)

Slots before ``start`` are untouched. The new KV length is kv_len − len + K; whole blocks past it can be returned
to the pool by the caller (`blocks_to_free`). All sources are gathered before anything is written, with one
batched gather/scatter over all layers and heads (and, in `compact_batch`, all sequences).

The caller must own the blocks holding slots >= start exclusively (reference count 1): compaction writes into
them in place, which would corrupt any other sequence sharing them.

Merging compressors (compression/centroid.py) replace the kept slots' K/V by computed rows: a job with
``new_keys`` / ``new_values`` ([L, Hkv, K, D]) writes those into slots [start, start + K) instead of the old K/V of
the kept slots; everything else (tail move, new length, freed blocks) is unchanged. Per-slot side state that must
follow the kept tokens (AMS credit, InfoKV entropy) is compacted the same way by `compact_slot_state`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from paging.kv_format import format_of


@dataclass
class CompactionJob:
    """One sequence's compaction: keep `kept` [L, Hkv, K] (indices into the region, strictly increasing per
    (layer, head)) of its region [region_start, region_start + region_len) of a cache of ``kv_len`` slots laid out
    by ``block_table``. ``new_keys`` / ``new_values`` [L, Hkv, K, D] (merging, both or neither) are written into the
    K kept slots instead of their old K/V. ``seq``: the sequence it compacts when the KV manager is to keep its
    books too (`of`); a bare job (no seq) only moves data (`compact_batch`)."""
    block_table: Sequence[int]
    region_start: int
    region_len: int
    kept: torch.Tensor
    kv_len: int
    new_keys: torch.Tensor | None = None
    new_values: torch.Tensor | None = None
    seq: Any = None

    @classmethod
    def of(cls, seq: Any, region_start: int, region_len: int, kept: torch.Tensor,
           new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None) -> "CompactionJob":
        """A job on ``seq``'s cache as it is now (its block table and KV length)."""
        return cls(seq.block_table, region_start, region_len, kept, seq.kv_len, new_keys, new_values, seq)

    @property
    def new_kv_len(self) -> int:
        return self.kv_len - self.region_len + int(self.kept.shape[-1])


def _check_job(kv: torch.Tensor, job: CompactionJob, check_indices: bool) -> None:
    if kv.dim() != 6:
        raise ValueError(f"kv must be [L, num_blocks, 2, block_size, Hkv, D], got {tuple(kv.shape)}")
    L, num_blocks, two, bs, hkv, _ = kv.shape
    kept = job.kept
    if kept.dim() != 3 or tuple(kept.shape[:2]) != (L, hkv):
        raise ValueError(f"kept must be [L={L}, Hkv={hkv}, K], got {tuple(kept.shape)}")
    if kept.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"kept must be an integer tensor, got {kept.dtype}")
    K = kept.shape[-1]
    if job.region_start < 0 or job.region_len < 0 or job.region_start + job.region_len > job.kv_len:
        raise ValueError(f"region [{job.region_start}, {job.region_start + job.region_len}) is not inside "
                         f"[0, kv_len={job.kv_len})")
    if K > job.region_len:
        raise ValueError(f"kept {K} slots from a region of {job.region_len}")
    if len(job.block_table) * bs < job.kv_len:
        raise ValueError(f"block table of {len(job.block_table)} blocks cannot hold kv_len={job.kv_len}")
    if check_indices and K > 0:
        bad = (kept < 0) | (kept >= job.region_len)
        if K > 1:
            bad_order = (kept[..., 1:] <= kept[..., :-1]).any()
            bad = bad.any() | bad_order
        else:
            bad = bad.any()
        if bool(bad):
            raise ValueError("kept indices must be strictly increasing per (layer, head) and inside the region")
    if (job.new_keys is None) != (job.new_values is None):
        raise ValueError("new_keys and new_values must be given together")
    if job.new_keys is not None:
        d = job.new_keys.shape[-1]  # head_dim: an 8-bit page row is head_dim values and its scale
        want = (L, hkv, K, d if format_of(kv, d).width(d) == kv.shape[-1] else kv.shape[-1])
        for name, t in (("new_keys", job.new_keys), ("new_values", job.new_values)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be [L, Hkv, K, D] = {list(want)}, got {tuple(t.shape)}")


def compact_batch(kv: torch.Tensor, jobs: Sequence[CompactionJob], check_indices: bool = True) -> list[int]:
    """Compact several sequences (disjoint blocks) with one gather and one scatter. Returns the new kv_lens."""
    if not jobs:
        return []
    for job in jobs:
        _check_job(kv, job, check_indices)
    L, _, _, bs, hkv, _ = kv.shape
    dev = kv.device
    k_sb, k_so, k_db, k_do, t_sb, t_so, t_db, t_do = ([] for _ in range(8))
    for job in jobs:
        table = torch.as_tensor(list(job.block_table), dtype=torch.long, device=dev)
        K = job.kept.shape[-1]
        start = job.region_start
        src = job.kept.to(device=dev, dtype=torch.long) + start  # [L, Hkv, K]
        dst = (torch.arange(K, device=dev) + start).expand(L, hkv, K)
        k_sb.append(table[src // bs]); k_so.append(src % bs)
        k_db.append(table[dst // bs]); k_do.append(dst % bs)
        tail_src = torch.arange(start + job.region_len, job.kv_len, device=dev)
        tail_dst = tail_src - job.region_len + K
        t_sb.append(table[tail_src // bs]); t_so.append(tail_src % bs)
        t_db.append(table[tail_dst // bs]); t_do.append(tail_dst % bs)
    k_sb, k_so, k_db, k_do = (torch.cat(x, dim=-1) for x in (k_sb, k_so, k_db, k_do))  # [L, Hkv, sum K]
    t_sb, t_so, t_db, t_do = (torch.cat(x) for x in (t_sb, t_so, t_db, t_do))  # [sum tail]
    li = torch.arange(L, device=dev)[:, None, None]
    hi = torch.arange(hkv, device=dev)[None, :, None]
    # Gather every source first (advanced indexing copies), then write.
    kept_vals = kv[li, k_sb, :, k_so, hi]  # [L, Hkv, sum K, 2, D]
    tail_vals = kv[:, t_sb, :, t_so]  # [sum tail, L, 2, Hkv, D]
    off = 0
    for job in jobs:  # merging jobs: their computed rows replace the gathered ones
        K = job.kept.shape[-1]
        if job.new_keys is not None:  # quantized to the pages' format (with their own scales)
            fmt = format_of(kv, job.new_keys.shape[-1])
            kept_vals[:, :, off:off + K, 0] = fmt.quantize(job.new_keys.to(dev), keys=True)
            kept_vals[:, :, off:off + K, 1] = fmt.quantize(job.new_values.to(dev))
        off += K
    kv[li, k_db, :, k_do, hi] = kept_vals
    kv[:, t_db, :, t_do] = tail_vals
    return [job.new_kv_len for job in jobs]


def compact_sequence(kv: torch.Tensor, block_table: Sequence[int], region_start: int, region_len: int,
                     kept: torch.Tensor, kv_len: int, check_indices: bool = True, *,
                     new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None) -> int:
    """Compact one sequence in place (see the module docstring) and return its new kv_len = kv_len − region_len + K.

    kv [L, num_blocks, 2, block_size, Hkv, D]; kept [L, Hkv, K] indices relative to region_start, strictly
    increasing per (layer, head). ``check_indices`` validates kept's values (one host sync). ``new_keys`` /
    ``new_values`` [L, Hkv, K, D]: computed K/V written into the kept slots instead of their old K/V (merging)."""
    job = CompactionJob(block_table, region_start, region_len, kept, kv_len, new_keys=new_keys, new_values=new_values)
    return compact_batch(kv, [job], check_indices)[0]


def compact_slot_state(state: torch.Tensor, region_start: int, region_len: int, kept: torch.Tensor) -> torch.Tensor:
    """Per-slot side state compacted like the KV (pure, returns a new tensor): state [L, Hkv, T, ...] (e.g. the AMS
    EMA credit or InfoKV's per-slot entropy, one value per (layer, KV head, slot)); kept [L, Hkv, K] as for
    `compact_batch`. Result [L, Hkv, T - region_len + K, ...]: slots before region_start, then the kept region
    slots in order, then the old slots [region_start + region_len, T)."""
    if state.dim() < 3 or kept.dim() != 3 or tuple(kept.shape[:2]) != tuple(state.shape[:2]):
        raise ValueError(f"state must be [L, Hkv, T, ...] and kept [L, Hkv, K]; got {tuple(state.shape)} and "
                         f"{tuple(kept.shape)}")
    T = state.shape[2]
    if region_start < 0 or region_len < 0 or region_start + region_len > T or kept.shape[-1] > region_len:
        raise ValueError(f"region [{region_start}, {region_start + region_len}) with {kept.shape[-1]} kept does not "
                         f"fit a state of {T} slots")
    idx = kept.to(device=state.device, dtype=torch.long) + region_start
    idx = idx.reshape(*idx.shape, *([1] * (state.dim() - 3))).expand(*idx.shape, *state.shape[3:])
    return torch.cat([state[:, :, :region_start], state.gather(2, idx),
                      state[:, :, region_start + region_len:]], dim=2)


def blocks_to_free(block_table: Sequence[int], new_kv_len: int, block_size: int) -> list[int]:
    """Every block of the table past the one holding the last slot of the new length (all whole blocks past the
    new end), in table order. The caller frees them and truncates the table to the rest."""
    if new_kv_len < 0 or block_size < 1:
        raise ValueError(f"bad new_kv_len={new_kv_len} or block_size={block_size}")
    needed = -(-new_kv_len // block_size)
    return list(block_table[needed:])


__all__ = ["CompactionJob", "compact_batch", "compact_sequence", "compact_slot_state", "blocks_to_free"]
