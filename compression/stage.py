"""The compression stage of the serving loop: when and on what compression runs.

`Engine.step` calls `CompressionStage.after_step` after every model step with explicit inputs: the running
sequences, the KV cache manager (gathers keys, applies compactions, frees blocks) and a callable that recomputes
post-RoPE queries. Nothing here holds or imports the engine.

Periodic policy (KvLLM, arXiv 2607.01237 §3.3): a sequence is due when it has run `compression_period` tokens since
its last round and its uncompressed tail holds at least one window |W|; every complete window of its tail is then
compressed. The trigger depends only on the sequence, and all sequences due in the same step are compressed in one
batched round (one query recomputation, one `select_windows` call per config, one compaction).
Threshold policy (the baseline the paper argues against, eqs. 1-2): a sequence whose KV length reaches C_max is
compressed to N.

Compression never changes a sequence's logical position: RoPE for new tokens keeps using `num_computed_tokens`,
while `kv_len` shrinks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from compression.base import WindowBatch
from compression.config import KVCompressionConfig, coerce
from compression.state import CompressionState


class Sequence(Protocol):
    """What the stage reads of a sequence (engine/sequence.py has it; compression does not import the engine)."""
    request_id: str
    num_computed_tokens: int
    kv_len: int
    compression: CompressionState | None
    scoring: Any

    @property
    def num_pending_tokens(self) -> int: ...

#: (sequence, first logical token, count) -> post-RoPE queries [L, T, Hq, D] of the spans, concatenated.
QueryFn = Callable[[list[tuple[Any, int, int]]], torch.Tensor]


class KVManager(Protocol):
    def gather_keys(self, seq: Sequence, start: int, length: int) -> torch.Tensor: ...
    def compact(self, jobs: list["CompactionRequest"]) -> list[int]: ...


@dataclass
class CompactionRequest:
    """Keep `kept` [L, Hkv, K] (indices into the region) of the region [region_start, region_start + region_len)."""
    seq: Any
    region_start: int
    region_len: int
    kept: torch.Tensor


@dataclass
class RoundStats:
    rounds: int = 0
    on_demand_rounds: int = 0  # run before a preemption, regardless of the period
    queries_cached: int = 0  # window tokens whose queries came from the query cache
    queries_recomputed: int = 0
    blocks_freed: int = 0
    tokens_evicted: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0


class CompressionStage:
    def __init__(self, default: Any = None, device_type: str = "cpu"):
        self.default: KVCompressionConfig = coerce(default) or KVCompressionConfig("none")
        self.device_type = device_type  # resolves query_source="auto"
        self._compressors: dict[KVCompressionConfig, Any] = {}
        self.stats = RoundStats()
        # Tensor parallelism sets this (engine/distributed/driver.py): called with ("window" | "threshold", the
        # sequences) before a round touches the KV cache, so that every rank runs this same round on its KV heads.
        self.round_hook: Callable[[str, list], None] | None = None

    # -- per-request settings -----------------------------------------------------------------------------
    def resolve(self, value: Any) -> KVCompressionConfig | None:
        """A request's setting (None: the engine default) as a config, or None when compression is off."""
        cfg = coerce(value, self.default if self.default.enabled else None) if value is not None else self.default
        return cfg if cfg.enabled else None

    def new_state(self, value: Any, num_prompt_tokens: int, score_from: int | None) -> CompressionState | None:
        cfg = self.resolve(value)
        if cfg is None:
            return None
        start = score_from if score_from is not None else (0 if cfg.compress_prompt else num_prompt_tokens)
        source = cfg.query_source
        if source == "auto":  # on CPU a second forward costs as much compute as it saves; a GPU has it to spare
            source = "recompute" if self.device_type == "cuda" else "cache"
        if cfg.policy != "periodic" or not self.compressor(cfg).needs_queries:
            source = "recompute"  # the threshold policy reads only its observation window: nothing to keep
        kept = self.compressor(cfg).num_kept(cfg.region_len) if cfg.policy == "periodic" else 0
        return CompressionState(cfg, start, query_source=source, kept_per_window=kept)

    def compressor(self, cfg: KVCompressionConfig):
        comp = self._compressors.get(cfg)
        if comp is None:
            comp = self._compressors[cfg] = cfg.make_compressor()
        return comp

    def capacity_lines(self, kv_tokens: int, max_model_len: int) -> list[str]:
        c = self.default
        if not c.enabled:
            return ["KV compression: off (requests may enable it with kv_compression)"]
        if c.periodic:
            kept, n = c.kept_per_window, c.region_len
            factor = n / kept
            return [f"KV compression: {c.method}, periodic every {c.compression_period} decode steps of each sequence "
                    f"(|W|={c.window}, |U|={c.buffer}, r={c.ratio}): keeps {kept}/{n} generated tokens per window; "
                    f"effective capacity up to {int(kv_tokens * factor)} generated tokens ({factor:.2f}x, max "
                    f"concurrency for {max_model_len}-token requests: {kv_tokens * factor / max_model_len:.2f}x)"]
        return [f"KV compression: {c.method}, threshold C_max={c.threshold_max} -> N={c.threshold_target}; each "
                f"sequence holds at most {c.threshold_max} KV slots"]

    # -- the hook -----------------------------------------------------------------------------------------
    def after_step(self, running: list[Sequence], kv: KVManager, queries: QueryFn) -> None:
        """Run whatever compression is due after a model step."""
        window, threshold = [], []
        for seq in running:
            st = seq.compression
            if st is None or st.hold or (seq.num_pending_tokens > 1 and seq.scoring is None):
                continue  # off, unverified drafts in the cache, or mid-prefill
            if st.config.policy == "threshold":
                if seq.kv_len >= st.config.threshold_max:
                    threshold.append(seq)
            elif st.pending or (seq.num_computed_tokens - st.last_round_at >= st.config.compression_period
                                and st.tail(seq.num_computed_tokens) >= st.config.window):
                window.append(seq)
        if window:
            self.run_window_round(window, kv, queries)
        if threshold:
            self.run_threshold(threshold, kv, queries)

    def reclaim(self, running: list[Sequence], kv: KVManager, queries: QueryFn, blocks_wanted: int) -> int:
        """Compress before preempting: an on-demand round over the running sequences whose uncompressed tail holds a
        complete window, whatever their period, the largest expected savings first, until about `blocks_wanted`
        blocks would be freed. Returns the blocks actually freed."""
        cands = []
        for seq in running:
            st = seq.compression
            if st is None or st.hold or not st.config.periodic or (seq.num_pending_tokens > 1 and seq.scoring is None):
                continue
            c = st.config
            tail = st.tail(seq.num_computed_tokens)
            if tail >= c.window:
                saved = (tail - c.buffer) // c.region_len * (c.region_len - st.kept_per_window)
                cands.append((saved, seq))
        if not cands:
            return 0
        cands.sort(key=lambda x: -x[0])
        picked, expected = [], 0
        block_size = getattr(kv, "block_size", 1)
        for saved, seq in cands:
            picked.append(seq)
            expected += saved / block_size
            if expected >= blocks_wanted:
                break
        freed = self.run_window_round(picked, kv, queries)
        self.stats.on_demand_rounds += 1
        return freed

    # -- periodic window compression ----------------------------------------------------------------------
    def run_window_round(self, candidates: list[Sequence], kv: KVManager, queries: QueryFn) -> int:
        """Compress every complete window of each candidate's tail; returns the blocks freed."""
        if self.round_hook is not None:
            self.round_hook("window", candidates)
        t0 = time.perf_counter()
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
            return 0
        # Only the tail's first (num_windows - 1) * n + |W| tokens are in a window: the rest is neither scored nor
        # needs its queries recomputed.
        spans = [(s, s.compression.compressed_tokens, (k - 1) * s.compression.config.region_len
                  + s.compression.config.window) for s, k in picked]
        needs = [self.compressor(s.compression.config).needs_queries for s, _ in picked]
        cached = [s.compression.queries.get(start, n) if nq and s.compression.caches_queries else None
                  for (s, start, n), nq in zip(spans, needs)]
        recompute = [sp for sp, nq, c in zip(spans, needs, cached) if nq and c is None]
        q_all = queries(recompute) if recompute else None
        self.stats.queries_cached += sum(sp[2] for sp, c in zip(spans, cached) if c is not None)
        self.stats.queries_recomputed += sum(sp[2] for sp in recompute)
        by_cfg: dict[KVCompressionConfig, list] = {}
        offset = 0
        for (seq, num_windows), (_, _, length), nq, c in zip(picked, spans, needs, cached):
            keys = kv.gather_keys(seq, seq.compression.compressed_kv_len, length)  # [L, Hkv, length, D]
            q = None
            if c is not None:
                q = c.transpose(1, 2)  # [L, Hq, length, D]
            elif nq:
                q = q_all[:, offset:offset + length].transpose(1, 2)
                offset += length
            by_cfg.setdefault(seq.compression.config, []).append((seq, num_windows, q, keys))
        jobs = []
        for cfg, group in by_cfg.items():
            n, w = cfg.region_len, cfg.window
            L = group[0][3].shape[0]
            qs, ks, gens = [], [], []
            for seq, num_windows, q, keys in group:  # every window of every sequence stacked on the layer axis
                for j in range(num_windows):
                    ks.append(keys[:, :, j * n:j * n + w])
                    if q is not None:
                        qs.append(q[:, :, j * n:j * n + w])
                    gens.append(seq.compression.rng())
            batch = WindowBatch(torch.cat(ks), torch.cat(qs) if qs else None, n, L, gens)
            kept = self.compressor(cfg).select_windows(batch)  # [Nw*L, Hkv, K]
            K = kept.shape[-1]
            start = 0
            for seq, num_windows, _, _ in group:
                part = kept[start * L:(start + num_windows) * L].view(num_windows, L, -1, K)
                start += num_windows
                shift = (torch.arange(num_windows, device=part.device) * n).view(-1, 1, 1, 1)
                rel = (part + shift).permute(1, 2, 0, 3).reshape(L, part.shape[2], num_windows * K)
                jobs.append((CompactionRequest(seq, seq.compression.compressed_kv_len, num_windows * n, rel),
                             num_windows * K))
        freed = kv.compact([job for job, _ in jobs])
        for (job, kept_slots), f in zip(jobs, freed):
            job.seq.compression.advance(job.region_len, kept_slots)
            self._count(job, kept_slots, f)
        self._finish_round(t0, kept.device)
        return sum(freed)

    # -- threshold baseline -------------------------------------------------------------------------------
    def run_threshold(self, seqs: list[Sequence], kv: KVManager, queries: QueryFn) -> int:
        if self.round_hook is not None:
            self.round_hook("threshold", seqs)
        t0 = time.perf_counter()
        q_all = queries([(s, s.num_computed_tokens - s.compression.config.observation_window,
                          s.compression.config.observation_window) for s in seqs])
        jobs, offset = [], 0
        for seq in seqs:
            cfg = seq.compression.config
            w = cfg.observation_window
            keys = kv.gather_keys(seq, 0, seq.kv_len)
            q = q_all[:, offset:offset + w].transpose(1, 2)
            offset += w
            kept = self.compressor(cfg).select_prefix(q, keys, cfg.threshold_target - w)
            jobs.append(CompactionRequest(seq, 0, seq.kv_len - w, kept))
        freed = kv.compact(jobs)
        for job, f in zip(jobs, freed):  # the threshold baseline re-scores the whole cache and keeps no frontier
            job.seq.compression.ever_compressed = True
            job.seq.compression.exact = False
            self._count(job, int(job.kept.shape[-1]), f)
        self._finish_round(t0, q_all.device)
        return sum(freed)

    def _count(self, job: CompactionRequest, kept: int, freed: int) -> None:
        job.seq.compression.rounds += 1
        s = self.stats
        s.blocks_freed += freed
        s.tokens_evicted += job.region_len - kept
        s.tokens_seen += job.region_len

    def _finish_round(self, t0: float, device: torch.device) -> None:
        if device.type == "cuda":  # count the queued kernels in the round's time
            torch.cuda.synchronize(device)
        self.stats.rounds += 1
        self.stats.seconds += time.perf_counter() - t0
