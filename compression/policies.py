"""When and on what compression runs inside the serving loop.

`PeriodicPolicy` (KvLLM, seed §3.3): a global decode-step counter; every `compression_period` steps the running
sequences whose uncompressed tail holds at least one full window |W| are compressed, every complete window of
each tail, and whole blocks past the new KV end go back to the pool. `ThresholdPolicy` is the baseline the
paper argues against (eq. 1-2): a sequence whose KV length reaches C_max is compressed to N with SnapKV scores.

A policy is called by the engine after every step (`after_step`), between two model steps. It only touches
sequences whose KV it owns (no prefix sharing), and it never changes a sequence's logical position: RoPE for
new tokens keeps using `num_computed_tokens`, while `kv_len` shrinks.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from compression.base import KVCompressionConfig, make_compressor
from compression.snapkv import SnapKVCompressor
from paging.compaction import CompactionJob, blocks_to_free, compact_batch


def resolve_config(value: Any) -> KVCompressionConfig:
    """Engine-wide setting (None / method name / dict / config) → config; None means "none"."""
    if value is None:
        return KVCompressionConfig(method="none")
    if isinstance(value, str):
        return KVCompressionConfig(method=value)
    if isinstance(value, dict):
        return KVCompressionConfig.from_dict(value)
    if isinstance(value, KVCompressionConfig):
        return value
    raise ValueError(f"kv_compression must be None, a method name, a dict or a KVCompressionConfig, got {value!r}")


def make_policy(value: Any, engine) -> "CompressionPolicy":
    return CompressionPolicy(resolve_config(value), engine)


class CompressionPolicy:
    """Runs compression over the running sequences. Each sequence follows its request's setting, or the
    engine's: window methods (Kara and its ablations) are compressed in periodic rounds, "threshold" ones
    whenever they reach C_max. The round counter is global, as in KvLLM."""

    def __init__(self, config: KVCompressionConfig, engine):
        self.config = config
        self.engine = engine
        self.decode_steps = 0
        self._next_round = config.compression_period if config.enabled else 0
        self._compressors: dict[tuple, Any] = {}

    # -- per-sequence settings ----------------------------------------------------------------------------
    def config_for(self, seq) -> KVCompressionConfig | None:
        cfg = seq.params.kv_compression
        cfg = self.config if cfg is None else cfg
        return cfg if cfg.enabled else None

    def compresses_prompt(self, params) -> bool:
        cfg = params.kv_compression if params.kv_compression is not None else self.config
        return cfg.enabled and cfg.is_window_method and cfg.compress_prompt

    def _compressor(self, cfg: KVCompressionConfig):
        key = tuple(sorted(cfg.to_dict().items()))
        if key not in self._compressors:
            self._compressors[key] = make_compressor(cfg) if cfg.is_window_method else SnapKVCompressor(cfg)
        return self._compressors[key]

    def capacity_lines(self, kv_tokens: int, max_model_len: int) -> list[str]:
        c = self.config
        if not c.enabled:
            return ["KV compression: off (requests may enable it with kv_compression)"]
        if c.is_window_method:
            kept, n = c.kept_per_window, c.region_len
            factor = n / kept
            return [f"KV compression: {c.method}, periodic every {c.compression_period} decode steps "
                    f"(|W|={c.window}, |U|={c.buffer}, r={c.ratio}, γ={c.chunk_max}, α={c.chunk_budget}): keeps "
                    f"{kept}/{n} generated tokens per window; effective capacity up to {int(kv_tokens * factor)} "
                    f"generated tokens ({factor:.2f}x, max concurrency for {max_model_len}-token requests: "
                    f"{kv_tokens * factor / max_model_len:.2f}x)"]
        return [f"KV compression: threshold (SnapKV) C_max={c.threshold_max} -> N={c.threshold_target}; each "
                f"sequence holds at most {c.threshold_max} KV slots"]

    # -- the hook -----------------------------------------------------------------------------------------
    def after_step(self, scheduled, stats) -> None:
        """Called once after each model step with the step's ScheduledSeq list."""
        advanced = [item.num_tokens for item in scheduled
                    if item.seq.num_computed_tokens > item.seq.compress_start and not item.seq.is_finished]
        if advanced:
            self.decode_steps += max(advanced)
        running = [s for s in self.engine.scheduler.running if s.num_pending_tokens <= 1 or s.max_chunk]
        window, threshold, prompt_due = [], [], []
        for seq in running:
            cfg = self.config_for(seq)
            if cfg is None:
                continue
            if cfg.is_window_method:
                (prompt_due if seq.compress_prompt_pending else window).append(seq)
            else:
                threshold.append(seq)
        if window and self.decode_steps >= self._next_round:
            self._next_round = self.decode_steps + self._period(window)
            prompt_due += window
        if prompt_due:
            self._run_window_round(prompt_due, stats)
        if threshold:
            self._run_threshold(threshold, stats)

    def _period(self, window_seqs) -> int:
        """The engine's period; with compression off engine-wide, the shortest period any request asked for."""
        if self.config.enabled or not window_seqs:
            return self.config.compression_period
        return min(self.config_for(s).compression_period for s in window_seqs)

    # -- periodic window compression ----------------------------------------------------------------------
    def _run_window_round(self, candidates, stats) -> None:
        t0 = time.perf_counter()
        picked = []
        for seq in candidates:
            cfg = self.config_for(seq)
            seq.compress_prompt_pending = False
            num_windows = (seq.uncompressed_tail - cfg.buffer) // cfg.region_len if seq.uncompressed_tail >= cfg.window else 0
            if num_windows > 0:
                picked.append((seq, cfg, num_windows))
        picked.sort(key=lambda p: -p[0].uncompressed_tail)
        picked = picked[: self.config.max_seqs_per_round]
        if not picked:
            return
        engine = self.engine
        kv = engine.kv_cache
        for seq, _, _ in picked:  # the tail must be uncompressed: its slots are the newest in the cache
            assert seq.kv_len - seq.compressed_kv_len == seq.uncompressed_tail, "stale compression frontier"
        # Only the tail's first (num_windows - 1) * n + |W| tokens are in a window: the rest (up to a period's
        # worth with compression_period = |W| - |U|) is neither scored nor needs its queries recomputed.
        spans = [(s, s.compressed_tokens, (k - 1) * c.region_len + c.window) for s, c, k in picked]
        needs = [self._compressor(c).needs_queries for _, c, _ in picked]
        need_spans = [sp for sp, nq in zip(spans, needs) if nq]
        queries = engine.runner.recompute_queries(need_spans) if need_spans else None
        mc = engine.model_config
        L, hq, d = mc.num_layers, mc.num_q_heads, mc.head_dim
        jobs, offsets = [], 0
        by_cfg: dict[int, list] = {}
        for (seq, cfg, num_windows), (_, _, tail), nq in zip(picked, spans, needs):
            keys = gather_keys(kv, seq.block_table, seq.compressed_kv_len, tail)  # [L, Hkv, tail, D]
            if nq:
                q = queries[:, offsets:offsets + tail].transpose(1, 2)  # [L, Hq, tail, D]
                offsets += tail
            else:  # the selector ignores queries: a zero-stride placeholder of the right shape
                q = keys.new_zeros(()).expand(L, hq, tail, d)
            by_cfg.setdefault(id(cfg), []).append((seq, cfg, num_windows, q, keys))
        for group in by_cfg.values():
            cfg = group[0][1]
            n, w = cfg.region_len, cfg.window
            # every window of every sequence in one select call: windows are stacked on the layer axis
            qs, ks, owners = [], [], []
            for seq, _, num_windows, q, keys in group:
                for j in range(num_windows):
                    qs.append(q[:, :, j * n:j * n + w])
                    ks.append(keys[:, :, j * n:j * n + w])
                owners.append((seq, num_windows))
            kept = self._compressor(cfg).select(torch.cat(qs, 0), torch.cat(ks, 0), n)  # [Nw*L, Hkv, K]
            K = kept.shape[-1]
            start = 0
            for seq, num_windows in owners:
                part = kept[start * L:(start + num_windows) * L].view(num_windows, L, -1, K)
                start += num_windows
                shift = (torch.arange(num_windows, device=part.device) * n).view(-1, 1, 1, 1)
                rel = (part + shift).permute(1, 2, 0, 3).reshape(L, part.shape[2], num_windows * K)
                jobs.append((seq, CompactionJob(seq.block_table, seq.compressed_kv_len, num_windows * n, rel,
                                                seq.kv_len), num_windows * n, num_windows * K))
        self._apply(jobs, stats, t0)

    # -- threshold baseline -------------------------------------------------------------------------------
    def _run_threshold(self, running, stats) -> None:
        t0 = time.perf_counter()
        picked = []
        for seq in running:
            cfg = self.config_for(seq)
            if seq.kv_len >= cfg.threshold_max:
                picked.append((seq, cfg))
        if not picked:
            return
        engine = self.engine
        queries = engine.runner.recompute_queries(
            [(s, s.num_computed_tokens - c.observation_window, c.observation_window) for s, c in picked])
        jobs, offset = [], 0
        for seq, cfg in picked:
            w = cfg.observation_window
            keys = gather_keys(engine.kv_cache, seq.block_table, 0, seq.kv_len)
            q = queries[:, offset:offset + w].transpose(1, 2)
            offset += w
            kept = self._compressor(cfg).select(q, keys)
            region = seq.kv_len - w
            jobs.append((seq, CompactionJob(seq.block_table, 0, region, kept, seq.kv_len), region, kept.shape[-1]))
        self._apply(jobs, stats, t0, threshold=True)

    # -- shared: compaction and bookkeeping ---------------------------------------------------------------
    def _apply(self, jobs, stats, t0: float, threshold: bool = False) -> None:
        engine = self.engine
        new_lens = compact_batch(engine.kv_cache.data, [job for _, job, _, _ in jobs], check_indices=False)
        block_size = engine.kv_cache.block_size
        for (seq, job, region, kept), new_len in zip(jobs, new_lens):
            freed = blocks_to_free(seq.block_table, new_len, block_size)
            if freed:
                engine.pool.free(freed)
                del seq.block_table[len(seq.block_table) - len(freed):]
            seq.kv_len = new_len
            if not threshold:  # the threshold baseline re-scores the whole cache and keeps no frontier
                seq.compressed_kv_len += kept
                seq.compressed_tokens += region
            stats.compression_blocks_freed += len(freed)
            stats.compression_tokens_evicted += region - kept
            stats.compression_tokens_seen += region
        stats.compression_rounds += 1
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        stats.compression_seconds += time.perf_counter() - t0


def gather_keys(kv, block_table: list[int], start: int, length: int) -> torch.Tensor:
    """Keys of KV slots [start, start + length) of one sequence, all layers: [L, Hkv, length, D]."""
    bs = kv.block_size
    slots = torch.arange(start, start + length)
    table = torch.tensor(block_table, dtype=torch.long)
    blocks = table[slots // bs].to(kv.data.device)
    offsets = (slots % bs).to(kv.data.device)
    return kv.data[:, blocks, 0, offsets].transpose(1, 2)
