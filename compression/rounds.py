"""What a compression round reads and decides, before anything changes: per sequence a compaction job (the kept
slots of its windows, or of its whole cache under the threshold policy) and the bookkeeping to apply once the KV
manager has compacted (compression/stage.py runs these, isolates failures and applies the jobs)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compression.base import PrefixBatch, WindowBatch, as_selection
from compression.config import KVCompressionConfig
from compression.state import CompressionState
from paging.compaction import CompactionJob, compact_slot_state


@dataclass
class PreparedRound:
    """A prepared round: nothing in the cache has changed yet. ``done[i]``: job i's bookkeeping once the KV manager
    has compacted it."""
    jobs: list[CompactionJob] = field(default_factory=list)
    done: list[Callable[[], None]] = field(default_factory=list)
    own_time: dict[str, float] = field(default_factory=dict)  # each method's selection seconds
    queries: list[tuple[str, int, int]] = field(default_factory=list)  # (method, cached, recomputed) tokens
    device: torch.device | None = None

    def extend(self, other: "PreparedRound") -> None:
        self.jobs += other.jobs
        self.done += other.done
        self.queries += other.queries
        for name, t in other.own_time.items():
            self.own_time[name] = self.own_time.get(name, 0.0) + t
        self.device = self.device or other.device


def window_jobs(candidates: list, kv: Any, queries: Callable, compressor: Callable) -> PreparedRound:
    """Every complete window of each candidate's uncompressed tail: one query recomputation for the spans that need
    it, one `select_windows` call per config (every window stacked on the layer axis), a compaction job each."""
    out = PreparedRound()
    picked = []
    for seq in candidates:
        st, cfg = seq.compression, seq.compression.config
        st.pending = False
        st.last_round_at = seq.num_computed_tokens
        tail = st.tail(seq.num_computed_tokens)
        num_windows = (tail - cfg.buffer) // cfg.region_len if tail >= cfg.window else 0
        if num_windows > 0:
            # the tail is uncompressed, so its slots are the newest in the cache
            assert seq.kv_len - st.compressed_kv_len == tail, "stale compression frontier"
            picked.append((seq, num_windows))
    if not picked:
        return out
    # Only the tail's first (num_windows - 1) * n + |W| tokens are in a window: the rest is neither scored nor
    # needs its queries recomputed.
    spans = [(s, s.compression.compressed_tokens, (k - 1) * s.compression.config.region_len
              + s.compression.config.window) for s, k in picked]
    needs = [compressor(s.compression.config).needs_queries for s, _ in picked]
    cached = [s.compression.queries.get(start, n) if nq and s.compression.caches_queries() else None
              for (s, start, n), nq in zip(spans, needs)]
    recompute = [sp for sp, nq, c in zip(spans, needs, cached) if nq and c is None]
    q_all = queries(recompute) if recompute else None
    by_cfg: dict[KVCompressionConfig, list] = {}
    offset = 0
    for (seq, num_windows), (_, _, length), nq, c in zip(picked, spans, needs, cached):
        q = None
        if c is not None:
            q = c.transpose(1, 2)  # [L, Hq, length, D]
        elif nq:
            q = q_all[:, offset:offset + length].transpose(1, 2)
            offset += length
        by_cfg.setdefault(seq.compression.config, []).append((seq, num_windows, q, length))
        out.queries.append((seq.compression.config.method, length if c is not None else 0,
                            length if nq and c is None else 0))
    for cfg, group in by_cfg.items():
        t_cfg = time.perf_counter()
        comp = compressor(cfg)
        n, w = cfg.region_len, cfg.window
        qs, ks, vs, es, gens = [], [], [], [], []
        for seq, num_windows, q, length in group:  # every window of every sequence stacked on the layer axis
            st = seq.compression
            keys = kv.gather_keys(seq, st.compressed_kv_len, length)  # [L, Hkv, length, D]
            values = kv.gather_values(seq, st.compressed_kv_len, length) if comp.needs_values else None
            # the tail is uncompressed: slot compressed_kv_len + i is logical position compressed_tokens + i
            ent = st.entropy.get(st.compressed_tokens, length) if comp.needs_entropy else None
            L = keys.shape[0]
            for j in range(num_windows):
                ks.append(keys[:, :, j * n:j * n + w])
                if values is not None:
                    vs.append(values[:, :, j * n:j * n + w])
                if q is not None:
                    qs.append(q[:, :, j * n:j * n + w])
                if ent is not None:
                    es.append(ent[j * n:j * n + w].expand(L, w))
                gens.append(st.rng())
        out.device = ks[0].device
        batch = WindowBatch(torch.cat(ks), torch.cat(qs) if qs else None, n, L, gens,
                            values=torch.cat(vs) if vs else None,
                            entropy=torch.cat(es).to(out.device) if es else None)
        sel = as_selection(comp.select_windows(batch))  # kept [Nw*L, Hkv, K]
        kept = sel.kept
        K = kept.shape[-1]
        if K != comp.num_kept(n):  # the frontier bookkeeping and footprint projections rely on it
            raise RuntimeError(f"{cfg.method} kept {K} slots of a {n}-slot region, expected {comp.num_kept(n)}")
        start = 0
        for seq, num_windows, _, _ in group:
            rows = slice(start * L, (start + num_windows) * L)
            start += num_windows
            part = kept[rows].view(num_windows, L, kept.shape[1], K)  # explicit Hkv: no -1 to infer
            shift = (torch.arange(num_windows, device=part.device) * n).view(-1, 1, 1, 1)
            rel = (part + shift).permute(1, 2, 0, 3).reshape(L, part.shape[2], num_windows * K)
            job = CompactionJob.of(seq, seq.compression.compressed_kv_len, num_windows * n, rel)
            if sel.merges:  # window-major within each (layer, head), like `rel`
                job.new_keys, job.new_values = (
                    t[rows].view(num_windows, L, t.shape[1], K, -1).permute(1, 2, 0, 3, 4)
                    .reshape(L, t.shape[1], num_windows * K, -1) for t in (sel.new_keys, sel.new_values))
            out.jobs.append(job)
            out.done.append(lambda st=seq.compression, r=job.region_len, k=num_windows * K: st.advance(r, k))
        out.own_time[cfg.method] = out.own_time.get(cfg.method, 0.0) + time.perf_counter() - t_cfg
    return out


def threshold_jobs(seqs: list, kv: Any, queries: Callable, compressor: Callable) -> PreparedRound:
    """The threshold baseline: each sequence's whole cache scored against its observation window."""
    out = PreparedRound()
    comps = [compressor(s.compression.config) for s in seqs]
    spans = [(s, s.num_computed_tokens - s.compression.config.observation_window,
              s.compression.config.observation_window) for s, c in zip(seqs, comps) if c.needs_queries]
    q_all = queries(spans) if spans else None  # query-free methods (KeyDiff, K-norm) skip the forward
    offset = 0
    for seq, comp in zip(seqs, comps):
        t_seq = time.perf_counter()
        st, cfg = seq.compression, seq.compression.config
        w = cfg.observation_window
        T = seq.kv_len
        keys = kv.gather_keys(seq, 0, T)
        out.device = keys.device
        q = None
        if comp.needs_queries:
            q = q_all[:, offset:offset + w].transpose(1, 2)
            offset += w
        ent = st.slot_entropies(T, keys.shape[0], keys.shape[1]) if comp.needs_entropy else None
        batch = PrefixBatch(q, keys, cfg.threshold_target - w, w,
                            values=kv.gather_values(seq, 0, T) if comp.needs_values else None,
                            entropy=ent.to(out.device) if ent is not None else None, slot_state=st.slot_state)
        sel = as_selection(comp.select_threshold(batch))
        out.jobs.append(CompactionJob.of(seq, 0, T - w, sel.kept, sel.new_keys, sel.new_values))
        # per-slot state follows the kept slots (applied once the compaction is done)
        new_ent = compact_slot_state(ent, 0, T - w, sel.kept.cpu()) if ent is not None else None
        out.done.append(lambda st=st, sel=sel, new_ent=new_ent, seq=seq: _after_threshold(st, sel, new_ent, seq))
        out.own_time[cfg.method] = out.own_time.get(cfg.method, 0.0) + time.perf_counter() - t_seq
    return out


def _after_threshold(st: CompressionState, sel: Any, new_ent: torch.Tensor | None, seq: Any) -> None:
    """The threshold baseline keeps no frontier: the cache is compressed, and per-slot state follows the kept slots."""
    st.ever_compressed = True
    st.exact = False
    st.slot_state = dict(sel.slot_state or {})
    if new_ent is not None:
        st.slot_entropy, st.slot_entropy_pos = new_ent, seq.num_computed_tokens
