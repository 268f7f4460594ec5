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
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Protocol

import torch

from compression.base import PrefixBatch, WindowBatch, as_selection
from compression.config import KVCompressionConfig, Limits, check_limits, coerce
from compression.state import CompressionState, EntropyStore


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
    def compact(self, jobs: list["CompactionRequest"]) -> list[int]: ...


@dataclass
class CompactionRequest:
    """Keep `kept` [L, Hkv, K] (indices into the region) of the region [region_start, region_start + region_len).
    ``new_keys`` / ``new_values`` [L, Hkv, K, D] (merging, both or neither): written into the K kept slots instead
    of the old K/V of the kept indices."""
    seq: Any
    region_start: int
    region_len: int
    kept: torch.Tensor
    new_keys: torch.Tensor | None = None
    new_values: torch.Tensor | None = None


@dataclass
class RoundStats:
    rounds: int = 0
    on_demand_rounds: int = 0  # run before a preemption, regardless of the period
    queries_cached: int = 0  # window tokens whose queries came from the query cache
    queries_recomputed: int = 0
    blocks_freed: int = 0
    tokens_evicted: int = 0  # region slots removed from the cache (merged ones included)
    tokens_merged: int = 0  # of which folded into a kept slot by a merging method
    tokens_seen: int = 0
    seconds: float = 0.0
    #: method name -> that method's share (totals only in the engine-wide record)
    by_method: dict[str, "RoundStats"] = field(default_factory=dict)

    def method(self, name: str) -> "RoundStats":
        return self.by_method.setdefault(name, RoundStats())

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "by_method"}


class CompressionStage:
    def __init__(self, default: Any = None, device_type: str = "cpu", limits: Limits | None = None):
        self.default: KVCompressionConfig = coerce(default) or KVCompressionConfig("none")
        self.device_type = device_type  # resolves query_source="auto"
        self.limits = limits  # bounds of the integer settings a request may carry (None: unchecked)
        self._compressors: dict[KVCompressionConfig, Any] = {}
        self._references: dict[str, KVCompressionConfig | None] = {}
        # (sequence, error) of sequences whose own part of a round or of a side signal failed; the engine drains
        # it and fails their requests alone
        self.failed: list[tuple[Any, BaseException]] = []
        self.stats = RoundStats()
        # Tensor parallelism sets this (engine/distributed/driver.py): called with ("window" | "threshold", the
        # sequences) before a round touches the KV cache, so that every rank runs this same round on its KV heads.
        self.round_hook: Callable[[str, list], None] | None = None

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
        comp = self.compressor(cfg)
        kept = comp.num_kept(cfg.region_len) if cfg.policy == "periodic" else 0
        st = CompressionState(cfg, start, query_source=source, kept_per_window=kept,
                              max_tail=self.limits.max_model_len if self.limits is not None else None)
        if comp.needs_entropy:
            st.entropy, st.entropy_top_k = EntropyStore(), comp.entropy_top_k
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

    # -- side signals -------------------------------------------------------------------------------------
    def record_entropy(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Called by the engine with the logits each of `seqs` samples its next token from (rows in order): for
        the sequences whose method needs it, the top-k renormalised entropy (compression/infokv.py
        `topk_entropy`) is stored at the logical position the sampled token will take. Others cost nothing."""
        groups: dict[int, list[int]] = {}
        for row, seq in enumerate(seqs):
            st = seq.compression
            if st is not None and st.entropy is not None:
                groups.setdefault(st.entropy_top_k, []).append(row)
        if not groups:
            return
        for k, rows in groups.items():
            try:
                _record_entropy(seqs, logits, k, rows)
            except Exception:  # find whose part failed: only that request ends (re-storing a position is harmless)
                for row in rows:
                    try:
                        _record_entropy(seqs, logits, k, [row])
                    except Exception as err:
                        self.failed.append((seqs[row], err))

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
        return self.run_window_round(picked, kv, queries, on_demand=True)

    # -- failure isolation ---------------------------------------------------------------------------------
    def _isolated(self, prepare: Callable[[list], "_Round"], seqs: list, *args: Any) -> "_Round":
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
                return _Round()
        out = _Round()
        for seq in seqs:
            try:
                out.extend(prepare([seq], *args))
            except Exception as err:
                self.failed.append((seq, err))
        return out

    def _apply(self, prep: "_Round", kv: KVManager, t0: float, on_demand: bool = False) -> int:
        """The only part of a round that changes anything: one batched compaction, then each job's bookkeeping."""
        if not prep.jobs:
            return 0
        for method, cached, recomputed in prep.queries:
            for rec in (self.stats, self.stats.method(method)):
                rec.queries_cached += cached
                rec.queries_recomputed += recomputed
        freed = kv.compact([job.request for job in prep.jobs])
        for job, f in zip(prep.jobs, freed):
            job.done()
            self._count(job.request, job.kept, f, job.merged)
        self._finish_round(t0, prep.device, prep.own_time, [job.request for job in prep.jobs], on_demand)
        return sum(freed)

    # -- periodic window compression ----------------------------------------------------------------------
    def run_window_round(self, candidates: list[Sequence], kv: KVManager, queries: QueryFn,
                         on_demand: bool = False) -> int:
        """Compress every complete window of each candidate's tail; returns the blocks freed."""
        if self.round_hook is not None:
            self.round_hook("window", candidates)
        t0 = time.perf_counter()
        return self._apply(self._isolated(self._window_jobs, candidates, kv, queries), kv, t0, on_demand)

    def _window_jobs(self, candidates: list[Sequence], kv: KVManager, queries: QueryFn) -> "_Round":
        out = _Round()
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
        needs = [self.compressor(s.compression.config).needs_queries for s, _ in picked]
        cached = [s.compression.queries.get(start, n) if nq and s.compression.caches_queries else None
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
            comp = self.compressor(cfg)
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
                part = kept[rows].view(num_windows, L, -1, K)
                shift = (torch.arange(num_windows, device=part.device) * n).view(-1, 1, 1, 1)
                rel = (part + shift).permute(1, 2, 0, 3).reshape(L, part.shape[2], num_windows * K)
                req = CompactionRequest(seq, seq.compression.compressed_kv_len, num_windows * n, rel)
                if sel.merges:  # window-major within each (layer, head), like `rel`
                    req.new_keys, req.new_values = (
                        t[rows].view(num_windows, L, t.shape[1], K, -1).permute(1, 2, 0, 3, 4)
                        .reshape(L, t.shape[1], num_windows * K, -1) for t in (sel.new_keys, sel.new_values))
                slots = num_windows * K
                out.jobs.append(_Job(req, slots, sel.merges,
                                     lambda st=seq.compression, r=req.region_len, k=slots: st.advance(r, k)))
            out.own_time[cfg.method] = out.own_time.get(cfg.method, 0.0) + time.perf_counter() - t_cfg
        return out

    # -- threshold baseline -------------------------------------------------------------------------------
    def run_threshold(self, seqs: list[Sequence], kv: KVManager, queries: QueryFn) -> int:
        if self.round_hook is not None:
            self.round_hook("threshold", seqs)
        t0 = time.perf_counter()
        return self._apply(self._isolated(self._threshold_jobs, seqs, kv, queries), kv, t0)

    def _threshold_jobs(self, seqs: list[Sequence], kv: KVManager, queries: QueryFn) -> "_Round":
        from paging.compaction import compact_slot_state

        out = _Round()
        comps = [self.compressor(s.compression.config) for s in seqs]
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
            req = CompactionRequest(seq, 0, T - w, sel.kept, sel.new_keys, sel.new_values)
            # per-slot state follows the kept slots (applied once the compaction is done)
            new_ent = compact_slot_state(ent, 0, T - w, sel.kept.cpu()) if ent is not None else None
            out.jobs.append(_Job(req, int(sel.kept.shape[-1]), sel.merges,
                                 lambda st=st, sel=sel, new_ent=new_ent, seq=seq: _after_threshold(st, sel, new_ent,
                                                                                                   seq)))
            out.own_time[cfg.method] = out.own_time.get(cfg.method, 0.0) + time.perf_counter() - t_seq
        return out

    def _count(self, job: CompactionRequest, kept: int, freed: int, merged: bool = False) -> None:
        job.seq.compression.rounds += 1
        m = self.stats.method(job.seq.compression.config.method)
        for s in (self.stats, m):
            s.blocks_freed += freed
            s.tokens_evicted += job.region_len - kept
            s.tokens_merged += job.region_len - kept if merged else 0
            s.tokens_seen += job.region_len

    def _finish_round(self, t0: float, device: torch.device | None, own_time: dict[str, float],
                      jobs: list[CompactionRequest], on_demand: bool = False) -> None:
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


@dataclass
class _Job:
    """One sequence's part of a prepared round: its compaction, the region slots it keeps, and its bookkeeping once
    the compaction is done."""
    request: CompactionRequest
    kept: int
    merged: bool
    done: Callable[[], None]


@dataclass
class _Round:
    """A prepared round: nothing in the cache has changed yet."""
    jobs: list[_Job] = field(default_factory=list)
    own_time: dict[str, float] = field(default_factory=dict)  # each method's selection seconds
    queries: list[tuple[str, int, int]] = field(default_factory=list)  # (method, cached, recomputed) tokens
    device: torch.device | None = None

    def extend(self, other: "_Round") -> None:
        self.jobs += other.jobs
        self.queries += other.queries
        for name, t in other.own_time.items():
            self.own_time[name] = self.own_time.get(name, 0.0) + t
        self.device = self.device or other.device


def _record_entropy(seqs: list, logits: torch.Tensor, k: int, rows: list[int]) -> None:
    from compression.infokv import topk_entropy

    idx = torch.tensor(rows, device=logits.device)
    ent = topk_entropy(logits.index_select(0, idx), k).cpu()
    for i, row in enumerate(rows):
        seq = seqs[row]
        seq.compression.entropy.put(seq.num_tokens, ent[i:i + 1])


def _after_threshold(st: CompressionState, sel: Any, new_ent: torch.Tensor | None, seq: Any) -> None:
    """The threshold baseline keeps no frontier: the cache is compressed, and per-slot state follows the kept slots."""
    st.ever_compressed = True
    st.exact = False
    st.slot_state = dict(sel.slot_state or {})
    if new_ent is not None:
        st.slot_entropy, st.slot_entropy_pos = new_ent, seq.num_computed_tokens
