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

Beyond keys and queries, a method may ask for (compression/base.py): values (gathered like the keys), the sampling
entropy of each token (recorded by the engine through `record_entropy` when it samples, stored by logical position
in the sequence's `CompressionState`; a periodic window is uncompressed tail, so position = slot there; under the
threshold policy the stage keeps a per-slot copy compacted with the K/V), and its own per-slot state across
threshold events (`Selection.slot_state`, e.g. AMS's credit). A merging method returns K/V for its kept slots,
which the compaction writes instead of moving the old ones.

Statistics: `RoundStats` totals plus one `RoundStats` per method name (`RoundStats.by_method`). Token counts and
seconds of the methods add up to the totals (a round's shared work, query fetching and the batched compaction, is
shared out by tokens scored); a round that compressed sequences of two methods counts once in the totals and once
for each method. ``tokens_evicted`` counts every region slot removed from the cache, merged ones included (the
same memory accounting for every method); ``tokens_merged`` counts those of them folded into a kept slot.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch

from compression.config import KVCompressionConfig, Limits, check_limits, coerce
from compression.rounds import PreparedRound, threshold_jobs, window_jobs
from compression.state import CompressionState, EntropyStore
from compression.stats import RoundStats
from paging.compaction import CompactionJob


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
    def gather_values(self, seq: Sequence, start: int, length: int) -> torch.Tensor: ...
    def compact(self, jobs: list[CompactionJob]) -> list[int]: ...


class CompressionStage:
    def __init__(self, default: Any = None, device_type: str = "cpu", limits: Limits | None = None,
                 round_hook: Callable[[str, list], None] | None = None):
        self.default: KVCompressionConfig = coerce(default) or KVCompressionConfig("none")
        self.device_type = device_type  # resolves query_source="auto"
        self.limits = limits  # bounds of the integer settings a request may carry (None: unchecked)
        self._compressors: dict[KVCompressionConfig, Any] = {}
        self._references: dict[str, KVCompressionConfig | None] = {}
        # (sequence, error) of sequences whose own part of a round or of a side signal failed; the engine drains
        # it and fails their requests alone
        self.failed: list[tuple[Any, BaseException]] = []
        self.stats = RoundStats()
        # Tensor parallelism (engine/distributed/driver.py): called with ("window" | "threshold", the sequences)
        # before a round touches the KV cache, so that every rank runs this same round on its KV heads.
        self.round_hook = round_hook

    # -- per-request settings -----------------------------------------------------------------------------
    def resolve(self, value: Any) -> KVCompressionConfig | None:
        """A request's setting (None: the engine default) as a config, or None when compression is off. Its integer
        settings are checked against the engine's limits (compression/config.py `check_limits`)."""
        base = self.default if self.default.enabled else None
        cfg = coerce(value, base) if value is not None else self.default
        if not cfg.enabled:
            return None
        if self.limits is not None and value is not None:
            if cfg.method not in self._references:  # what naming just the method would give
                self._references[cfg.method] = coerce({"method": cfg.method}, base)
            check_limits(cfg, self._references[cfg.method], self.limits)
        return cfg

    def new_state(self, cfg: KVCompressionConfig | None, num_prompt_tokens: int,
                  score_from: int | None) -> CompressionState | None:
        """A sequence's state under its request's resolved config (`resolve`; None: compression off)."""
        if cfg is None:
            return None
        start = score_from if score_from is not None else (0 if cfg.compress_prompt else num_prompt_tokens)
        source = cfg.query_source
        if source == "auto":  # on CPU a second forward costs as much compute as it saves; a GPU has it to spare
            source = "recompute" if self.device_type == "cuda" else "cache"
        comp = self.compressor(cfg)
        if cfg.policy != "periodic" or not comp.needs_queries:
            source = "recompute"  # the threshold policy reads only its observation window: nothing to keep
        kept = comp.num_kept(cfg.region_len) if cfg.policy == "periodic" else 0
        st = CompressionState(cfg, start, query_source=source, kept_per_window=kept,
                              max_tail=self.limits.max_model_len if self.limits is not None else None)
        if comp.needs_entropy:
            st.entropy, st.entropy_top_k, st.entropy_fn = EntropyStore(), comp.entropy_top_k, comp.token_entropy
        return st

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

    # -- what the engine hands over after a forward -------------------------------------------------------
    def take_failed(self) -> list[tuple[Any, BaseException]]:
        """(sequence, error) of the sequences whose own part of the stage's work failed since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def update_from_output(self, captured: list[tuple[Any, int, torch.Tensor]]) -> list[tuple[Any, BaseException]]:
        """Keep each sequence's post-RoPE queries of the step's tokens (query_source="cache"); returns failures."""
        for seq, first, q in captured:
            try:
                seq.compression.store_queries(first, q)
            except Exception as err:  # its own buffer: only that request ends
                self.failed.append((seq, err))
        return self.take_failed()

    def record_entropy(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Any, BaseException]]:
        """Called by the engine with the logits each of `seqs` samples its next token from (rows in order): for
        the sequences whose method needs it, the method's `token_entropy` of them (InfoKV: the top-k renormalised
        entropy) is stored at the logical position the sampled token will take. Others cost nothing.
        Returns the sequences whose part failed."""
        groups: dict[tuple, list[int]] = {}
        for row, seq in enumerate(seqs):
            st = seq.compression
            if st is not None and st.entropy is not None:
                groups.setdefault((st.entropy_fn, st.entropy_top_k), []).append(row)
        for (_, k), rows in groups.items():
            try:
                _record_entropy(seqs, logits, k, rows)
            except Exception:  # find whose part failed: only that request ends (re-storing a position is harmless)
                for row in rows:
                    try:
                        _record_entropy(seqs, logits, k, [row])
                    except Exception as err:
                        self.failed.append((seqs[row], err))
        return self.take_failed()

    # -- the hook -----------------------------------------------------------------------------------------
    @staticmethod
    def _ready(seq: Sequence) -> bool:
        """Compression on and not paused (unverified lossless drafts in its cache), not in the middle of its prefill."""
        return (seq.compression is not None and not seq.compression.paused
                and (seq.num_pending_tokens <= 1 or (seq.scoring is not None and seq.scoring.decode_like)))

    def after_step(self, running: list[Sequence], kv: KVManager, queries: QueryFn) -> list[tuple[Any, BaseException]]:
        """Run whatever compression is due after a model step; returns the sequences whose own part failed."""
        window, threshold = [], []
        for seq in running:
            if not self._ready(seq):
                continue
            st = seq.compression
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
        return self.take_failed()

    def reclaim(self, running: list[Sequence], kv: KVManager, queries: QueryFn, blocks_wanted: int) -> int:
        """Compress before preempting: an on-demand round over the running sequences whose uncompressed tail holds a
        complete window, whatever their period, the largest expected savings first, until about `blocks_wanted`
        blocks would be freed. Returns the blocks actually freed (failures wait in `take_failed`)."""
        cands = [(seq.compression.savings(seq.num_computed_tokens), seq) for seq in running
                 if self._ready(seq) and seq.compression.config.periodic
                 and seq.compression.windows(seq.compression.tail(seq.num_computed_tokens)) > 0]
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
        return self.run_window_round(picked, kv, queries, on_demand=True)

    # -- failure isolation ---------------------------------------------------------------------------------
    def _isolated(self, prepare: Callable[[list], PreparedRound], seqs: list, *args: Any) -> PreparedRound:
        """Prepare a batched round (read-only: keys, queries, selections, the compaction jobs). If that raises,
        prepare each sequence alone, so that only the sequences whose own part fails are left out, reported in
        `failed` for the engine to fail their requests, and the rest is compressed as usual. Under tensor
        parallelism a round is a collective (the query recomputation runs on every rank): a failure stops the loop."""
        try:
            return prepare(seqs, *args)
        except Exception as err:
            if self.round_hook is not None:
                raise
            if len(seqs) == 1:
                self.failed.append((seqs[0], err))
                return PreparedRound()
        out = PreparedRound()
        for seq in seqs:
            try:
                out.extend(prepare([seq], *args))
            except Exception as err:
                self.failed.append((seq, err))
        return out

    def _apply(self, prep: PreparedRound, kv: KVManager, t0: float, on_demand: bool = False) -> int:
        """The only part of a round that changes anything: one batched compaction, then each job's bookkeeping."""
        if not prep.jobs:
            return 0
        for method, cached, recomputed in prep.queries:
            for rec in (self.stats, self.stats.method(method)):
                rec.queries_cached += cached
                rec.queries_recomputed += recomputed
        freed = kv.compact(prep.jobs)
        for job, done, f in zip(prep.jobs, prep.done, freed):
            done()
            self._count(job, f)
        self._finish_round(t0, prep.device, prep.own_time, prep.jobs, on_demand)
        return sum(freed)

    # -- periodic window compression ----------------------------------------------------------------------
    def run_window_round(self, candidates: list[Sequence], kv: KVManager, queries: QueryFn,
                         on_demand: bool = False) -> int:
        """Compress every complete window of each candidate's tail; returns the blocks freed."""
        if self.round_hook is not None:
            self.round_hook("window", candidates)
        t0 = time.perf_counter()
        return self._apply(self._isolated(self._window_jobs, candidates, kv, queries), kv, t0, on_demand)

    def _window_jobs(self, candidates: list[Sequence], kv: KVManager, queries: QueryFn) -> PreparedRound:
        return window_jobs(candidates, kv, queries, self.compressor)

    # -- threshold baseline -------------------------------------------------------------------------------
    def run_threshold(self, seqs: list[Sequence], kv: KVManager, queries: QueryFn) -> int:
        if self.round_hook is not None:
            self.round_hook("threshold", seqs)
        t0 = time.perf_counter()
        return self._apply(self._isolated(self._threshold_jobs, seqs, kv, queries), kv, t0)

    def _threshold_jobs(self, seqs: list[Sequence], kv: KVManager, queries: QueryFn) -> PreparedRound:
        return threshold_jobs(seqs, kv, queries, self.compressor)

    def _count(self, job: CompactionJob, freed: int) -> None:
        kept, merged = int(job.kept.shape[-1]), job.new_keys is not None
        job.seq.compression.rounds += 1
        m = self.stats.method(job.seq.compression.config.method)
        for s in (self.stats, m):
            s.blocks_freed += freed
            s.tokens_evicted += job.region_len - kept
            s.tokens_merged += job.region_len - kept if merged else 0
            s.tokens_seen += job.region_len

    def _finish_round(self, t0: float, device: torch.device | None, own_time: dict[str, float],
                      jobs: list[CompactionJob], on_demand: bool = False) -> None:
        if device is not None and device.type == "cuda":  # count the queued kernels in the round's time
            torch.cuda.synchronize(device)
        total = time.perf_counter() - t0
        self.stats.rounds += 1
        self.stats.on_demand_rounds += on_demand
        self.stats.seconds += total
        # Each method's own selection time, plus a share of the round's common work (queries, compaction) by the
        # tokens it scored in this round, so the methods' seconds add up to the total.
        tokens = dict.fromkeys(own_time, 0)
        for job in jobs:
            tokens[job.seq.compression.config.method] += job.region_len
        common = max(0.0, total - sum(own_time.values()))
        all_tokens = sum(tokens.values()) or 1
        for name, own in own_time.items():
            m = self.stats.method(name)
            m.rounds += 1
            m.on_demand_rounds += on_demand
            m.seconds += own + common * tokens[name] / all_tokens


def _record_entropy(seqs: list, logits: torch.Tensor, k: int, rows: list[int]) -> None:
    """The rows share one method's signal function (`record_entropy` groups them by it)."""
    idx = torch.tensor(rows, device=logits.device)
    ent = seqs[rows[0]].compression.entropy_fn(logits.index_select(0, idx), k).cpu()
    for i, row in enumerate(rows):
        seq = seqs[row]
        seq.compression.entropy.put(seq.num_tokens, ent[i:i + 1])
