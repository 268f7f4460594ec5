"""Compression quality: teacher-forced NLL on SmolLM2 through the engine's own (compressed) KV cache, for every
registered window method at several budgets.

Every trial is one sequence: a short context (never compressed) and a continuation of real text fed through the
normal scheduler 16 tokens per step (`Engine.score`'s path), so the periodic policy compresses the continuation's
windows exactly as it would while decoding. The continuation is

    lead-in (real text) | passage | filler (real text) | the same passage again

The passage is a distinctive piece of prose (a Python standard-library module docstring) planted in the first
compressed window, at an offset spread over that window's compressible region from trial to trial (scores have a
position bias inside the window); the repetition at the end can only be predicted well if the compressed cache kept
enough of it (long-range recall). The filler is license text from /usr/share/common-licenses, taken at a different
offset in every trial.

Equal KV length: every method keeps the same number of slots of every compressed window. Kara and the methods that
share its α parameter (its ablations, random, streaming) keep ⌈r·n⌉ + α; the others (which keep ⌈r·n⌉) run at the
ratio r' = (⌈r·n⌉ + α) / n, which keeps exactly as many. The table's r is the nominal budget.

InfoKV scores tokens by the entropy of the distribution they were sampled from, recorded by the engine when it
samples. Teacher-forced scoring samples nothing, so this script supplies those entropies: the top-k entropy of the
full-cache model's distribution at each continuation token (one extra forward per trial, `token_entropies`), put
into each InfoKV sequence's store before its first step. In serving, tokens after the first compression would be
sampled from the compressed cache's distribution instead.

Reported per (method, r), averaged over the trials: mean NLL per token of the text (every continuation token except
the repeated passage), the same over the tokens scored after the first compression round only, the NLL of the
repeated passage (recall), the share of the passage's slots the method keeps (a re-run of each trial's first
window, selection only) and the compression time per compressed token (the engine's per-method statistics: the
method's own selection time plus its share of each round's common work). A PNG plots recall NLL against the kept
fraction, one line per method.

`--diagnose` runs only a cheap selection diagnostic (each trial's first window; which share of the passage's slots
every method keeps, and each method's keep rate by position in the window) and writes it to its own section.

    .venv/bin/python -m bench.compression_quality [--ratio 0.2 0.3 0.5] [--trials 8] [--max-tokens N] [--no-write]
    .venv/bin/python -m bench.compression_quality --diagnose --trials 10 --ratio 0.2 0.3 0.5

The defaults (every method, r in {0.2, 0.3, 0.5}, 8 trials, 1184-token continuations: 344 sequences of 1216
tokens) take about an hour on one thread of a shared 2-core AVX2 CPU, almost all of it in the forward passes
(compression is ~2-10% of the time); `--trials 2 --ratio 0.3` takes ~7 min.

The trials and each method's settings are in bench/quality_cases.py, the tables, reading and plot in
bench/quality_report.py; this file scores and runs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Sequence

import torch

from bench.common import DOCS, RESULTS, write_section
from compression import KVCompressionConfig
from bench.quality_cases import (DEFAULT_WINDOW, METHODS, PASSAGE_MODULES, Trial, case_layout,  # noqa: F401
                                 equal_kv_ratio, make_trials, method_config, passages, spread_leads,
                                 synthetic_trials)
from bench.quality_report import LABELS, MethodResult, plot, reading, tables  # noqa: F401
from compression.base import WindowBatch, as_selection

PLOT = DOCS.parent / "compression_quality.png"
SECTIONS = RESULTS / "compression_quality.md"  # where both sections live (the plot stays beside benchmarks.md)


# ----------------------------------------------------------------------------------------------- scoring
@torch.inference_mode()
def token_entropies(engine, ids: list[int], k: int, chunk: int = 512) -> torch.Tensor:
    """float32 [len(ids)]: entry t is the top-k renormalised entropy (compression/infokv.py `topk_entropy`) of the
    model's distribution for token t given tokens [0, t) (NaN for t = 0): what the engine records when it samples
    token t. One dense forward of the engine's model over a private paged cache (full cache, no compression)."""
    from engine.attention.base import build_metadata
    from compression.infokv import topk_entropy
    from paging.kv_cache import KVCache

    core = engine.core
    c = core.model_config
    bs = 16
    cache = KVCache(c.num_layers, -(-len(ids) // bs), bs, c.num_kv_heads, c.head_dim, core.dtype, core.device)
    table = list(range(cache.num_blocks))
    out = torch.full((len(ids),), float("nan"))
    for s in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - s)
        meta = build_metadata([table], [n], [s + n], bs, core.device)
        core.attn.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, core.dtype)
        hidden = core.model(torch.tensor(ids[s:s + n], device=core.device),
                            torch.arange(s, s + n, device=core.device), cache.layers, core.attn, meta)
        ent = topk_entropy(core.model.compute_logits(hidden), k).cpu()
        out[s + 1:s + n + 1] = ent[:len(ids) - s - 1]
    return out


def score_many(engine, items: list[tuple[list[int], list[int], Any]], chunk_size: int = 16,
               entropies: Sequence[torch.Tensor | None] | None = None) -> list[list[float]]:
    """`Engine.score` for several (context, continuation, kv_compression) at once: every request is submitted
    before the first step, so all are scored in the same batches, in lockstep. ``entropies[k]`` (per item, over
    context + continuation, see `token_entropies`) go into the item's compression state when its method records
    entropy (the continuation's tokens, as if they had been sampled)."""
    from engine.sampling_params import SamplingParams

    by_cfg: dict[Any, list[int]] = {}
    for k, (_, _, kvc) in enumerate(items):
        by_cfg.setdefault(kvc, []).append(k)
    reqs = []
    for kvc, idx in by_cfg.items():  # Engine.score takes one kv_compression per call: submit without waiting
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_compression=kvc)
        for k in idx:
            ctx, cont, _ = items[k]
            if not ctx or not cont:
                raise ValueError("score: context and continuation must be non-empty")
            req = engine.core.make_request(list(ctx) + list(cont), params, f"q{k}", score=(len(ctx), chunk_size))
            st = req.seqs[0].compression
            if st is not None and st.entropy is not None:
                if entropies is None or entropies[k] is None:
                    raise ValueError(f"{kvc.method} needs token entropies")
                st.entropy.put(len(ctx), entropies[k][len(ctx):])
            engine.add_request(req)
            reqs.append((k, req))
    while engine.has_unfinished_requests():
        engine.step()
    out: list[list[float]] = [[] for _ in items]
    for k, req in reqs:
        if req.error is not None:
            raise req.error
        out[k] = list(req.final.prompt_logprobs)
    return out


def _needs_entropy(cfgs) -> int | None:
    """The entropy top-k the configs' methods record (None if none records any)."""
    ks = {cfg.make_compressor().entropy_top_k for cfg in cfgs
          if cfg.enabled and cfg.make_compressor().needs_entropy}
    if len(ks) > 1:
        raise ValueError(f"one entropy_top_k per run, got {sorted(ks)}")
    return ks.pop() if ks else None


def evaluate(engine, trials: list[Trial], methods: Sequence[str] = METHODS, ratios: Sequence[float] = (0.3,),
             window: dict | None = None, chunk_size: int = 16, batch_seqs: int | None = None,
             progress=None) -> list[MethodResult]:
    """Score every trial under every (method, ratio); "none" is run once. Runs go to the engine in batches (one
    ratio at a time, at most ``batch_seqs`` sequences each; results do not depend on the batching, since each
    sequence's compression trigger depends only on itself). Returns one MethodResult per (method, ratio) with
    per-sequence KV accounting and compression time from the engine's per-method statistics."""
    window = dict(DEFAULT_WINDOW if window is None else window)
    lengths = {len(t.context) + len(t.continuation) for t in trials}
    if len({len(t.continuation) for t in trials}) != 1:
        raise ValueError("all trials must have the same continuation length (equal accounting)")
    n = window["window"] - window["buffer"]
    runs: list[tuple[str, float | None, KVCompressionConfig]] = []
    if "none" in methods:
        runs.append(("none", None, method_config("none", 1.0, window)))
    for r in ratios:
        runs.extend((m, r, method_config(m, r, window)) for m in methods if m != "none")
    k_ent = _needs_entropy([cfg for _, _, cfg in runs])
    ents = ([token_entropies(engine, t.context + t.continuation, k_ent) for t in trials] if k_ent is not None
            else [None] * len(trials))
    # batches: one ratio each (a method appears once per batch, so its statistics diff belongs to one run)
    per_batch = max(1, (batch_seqs or 10 ** 9) // len(trials))
    batches: list[list[int]] = []
    for r in [None, *ratios]:
        idx = [i for i, run in enumerate(runs) if run[1] == r]
        # two configs of one engine method (kara with cached vs recomputed queries) go to separate batches
        seen_methods: set[str] = set()
        later = [i for i in idx if runs[i][2].method in seen_methods or seen_methods.add(runs[i][2].method)]
        idx = [i for i in idx if i not in later]
        batches += [idx[i:i + per_batch] for i in range(0, len(idx), per_batch)]
        batches += [later[i:i + per_batch] for i in range(0, len(later), per_batch)]
    logprobs: list[list[list[float]]] = [[] for _ in runs]
    usage: list[dict[str, float]] = [{} for _ in runs]
    for b in batches:
        if not b:
            continue
        t0 = time.perf_counter()
        before = {name: r.as_dict() for name, r in engine.stats().compression.by_method.items()}
        items = [(t.context, t.continuation, runs[i][2]) for i in b for t in trials]
        lps = score_many(engine, items, chunk_size, [e for _ in b for e in ents])
        after = {name: r.as_dict() for name, r in engine.stats().compression.by_method.items()}
        engine.check_invariants()
        for j, i in enumerate(b):
            logprobs[i] = lps[j * len(trials):(j + 1) * len(trials)]
            m = runs[i][2].method
            usage[i] = {key: after.get(m, {}).get(key, 0) - before.get(m, {}).get(key, 0)
                        for key in ("tokens_seen", "tokens_evicted", "tokens_merged", "seconds")}
        if progress is not None:
            progress(f"batch of {len(items)} sequences ({', '.join(runs[i][0] for i in b)} at r="
                     f"{runs[b[0]][1]}) scored in {time.perf_counter() - t0:.0f} s")

    # Per-sequence accounting: every sequence has the same continuation and n, so it compresses the same number of
    # windows; each keeps its config's kept_per_window of every window.
    compressed = [i for i, (_, _, cfg) in enumerate(runs) if cfg.enabled]
    windows_per_seq = 0
    if compressed:
        seen = {usage[i]["tokens_seen"] for i in compressed}
        assert len(seen) == 1, f"runs compressed unequal token counts: {seen}"
        windows_per_seq = seen.pop() / (n * len(trials))
        assert windows_per_seq == int(windows_per_seq), f"partial windows ({windows_per_seq})"
        windows_per_seq = int(windows_per_seq)
        for i in compressed:
            cfg = runs[i][2]
            expected = windows_per_seq * (n - cfg.kept_per_window) * len(trials)
            assert usage[i]["tokens_evicted"] == expected, (runs[i][0], usage[i], expected)

    # The first round that compresses anything runs once a sequence's uncompressed tail holds |W| tokens and the
    # decode counter reaches a round; tokens before the first window is compressed are scored identically by all.
    late_from = _first_compressed_step(len(trials[0].continuation), window, chunk_size) if compressed else 0

    # Sanity check: before the first compression every method's cache equals the full one.
    none_lps = [logprobs[i] for i, (m, _, _) in enumerate(runs) if m == "none"]
    if none_lps:
        for i in range(len(runs)):
            for a, b in zip(logprobs[i], none_lps[0]):
                diff = max((abs(x - y) for x, y in zip(a[:late_from], b[:late_from])), default=0.0)
                assert diff < 1e-3, f"{runs[i][0]} differs from the full cache by {diff} before any compression"

    results = []
    logical = max(lengths)
    for i, (m, r, cfg) in enumerate(runs):
        kept = cfg.kept_per_window if cfg.enabled else n
        ev = windows_per_seq * (n - kept) if cfg.enabled else 0
        results.append(MethodResult(m, r, logprobs[i], kv_len=logical - ev, logical_len=logical,
                                    tokens_seen=windows_per_seq * n if cfg.enabled else 0, tokens_evicted=ev,
                                    late_from=late_from, trials=trials, kept_per_window=kept, region_len=n,
                                    compression_seconds=usage[i].get("seconds", 0.0),
                                    compressed_tokens=int(usage[i].get("tokens_seen", 0))))
    return results


def _first_compressed_step(cont_len: int, window: dict, chunk_size: int) -> int:
    """Continuation index of the first token scored with a compressed cache. Mirrors the periodic policy's
    per-sequence trigger: after a step that fed the continuation up to `fed` tokens, a round runs once `fed` is
    at least `compression_period` past the last round (0) and the uncompressed tail holds >= |W| tokens. The step
    after the round that fed tokens [s, s + chunk) scores continuation tokens s + 1 ... s + chunk."""
    period, w = window["compression_period"], window["window"]
    fed = 0
    while fed < cont_len:
        fed = min(fed + chunk_size, cont_len)
        if fed >= period and fed >= w and fed < cont_len:
            return fed + 1
    return cont_len


def first_window_selections(engine, trials: list[Trial], methods: Sequence[str], ratios: Sequence[float],
                            window: dict | None = None) -> dict[tuple[str, float], list[torch.Tensor]]:
    """Kept region indices [L, Hkv, K] of each trial's first window, per (window method, ratio). The planted passage
    lies in the continuation's first window [0, |W|); the window's queries, keys, values and entropies do not depend
    on anything after it, so running each trial's context + first window and selecting on it reproduces the
    selection the periodic policy makes in its first effective round (for "random": one draw of the same law; for
    the merging method: the slots its centroids are written to)."""
    from engine.sampling_params import SamplingParams

    window = dict(DEFAULT_WINDOW if window is None else window)
    w, n = window["window"], window["window"] - window["buffer"]
    cfgs = {(m, r): method_config(m, r, window) for m in methods if m != "none" for r in ratios}
    k_ent = _needs_entropy(cfgs.values())
    out: dict[tuple[str, float], list[torch.Tensor]] = {}
    for t in trials:
        if not t.passage[1] <= n:
            raise ValueError("the passage must lie in the first window's compressible region")
        ids = t.context + t.continuation[:w]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        req = engine.core.make_request(ids, params, f"diag-{id(t)}", score=(len(t.context), w))
        engine.add_request(req)
        seq = req.seqs[0]
        while seq.num_computed_tokens < len(ids) and not seq.is_finished:
            engine.step()
        assert seq.num_computed_tokens == seq.kv_len == len(ids), "diagnostic sequence was compressed or preempted"
        q = engine.core.runner.recompute_queries([(seq, len(t.context), w)]).transpose(1, 2)  # [L, Hq, W, D]
        k = engine.core.kv.gather_keys(seq, len(t.context), w)  # [L, Hkv, W, D]
        v = engine.core.kv.gather_values(seq, len(t.context), w)
        engine.abort(req.request_id)
        engine.step()
        L = k.shape[0]
        ent = None
        if k_ent is not None:
            ent = token_entropies(engine, ids, k_ent)[len(t.context):].expand(L, w).to(k.device)
        for (m, r), cfg in cfgs.items():
            comp = cfg.make_compressor()
            batch = WindowBatch(k, q if comp.needs_queries else None, n, L, [torch.Generator().manual_seed(cfg.seed)],
                                values=v if comp.needs_values else None, entropy=ent if comp.needs_entropy else None)
            out.setdefault((m, r), []).append(as_selection(comp.select_windows(batch)).kept.cpu())
    engine.check_invariants()
    return out


def passage_kept_fraction(engine, trials: list[Trial], methods: Sequence[str], ratios: Sequence[float],
                          window: dict | None = None) -> dict[tuple[str, float], float]:
    """Diagnostic: the share of the planted passage's KV slots each window method keeps when the passage's window
    is compressed, averaged over layers, KV heads and trials (see `first_window_selections`)."""
    sels = first_window_selections(engine, trials, methods, ratios, window)
    return {key: sum(passage_stats(sel, t.passage)[0] for sel, t in zip(v, trials)) / len(trials)
            for key, v in sels.items()}


def passage_stats(sel: torch.Tensor, passage: tuple[int, int]) -> tuple[float, float]:
    """(share of passage slots kept over all layers and KV heads, share of passage tokens kept by at least one
    KV head of a layer, averaged over layers)."""
    L, hkv, _ = sel.shape
    size = passage[1] - passage[0]
    inside = (sel >= passage[0]) & (sel < passage[1])
    share = inside.sum().item() / (L * hkv * size)
    hits = torch.zeros(L, hkv, size, dtype=torch.int64)
    hits.scatter_add_(-1, (sel - passage[0]).clamp(0, size - 1), inside.long())
    union = (hits > 0).any(dim=1).float().mean().item()
    return share, union


def diagnose(engine, trials: list[Trial], methods: Sequence[str], ratios: Sequence[float],
             window: dict | None = None) -> str:
    """Selection-only diagnostic over many trials (cheap: one window each): how much of the planted passage each
    method keeps, and where in the window Kara's kept slots lie."""
    window = dict(DEFAULT_WINDOW if window is None else window)
    n = window["window"] - window["buffer"]
    sels = first_window_selections(engine, trials, methods, ratios, window)
    lines = ["| method | r | kept per window | passage slots kept (mean) | min..max over trials "
             "| passage tokens kept by >= 1 KV head of a layer |", "|---|---:|---:|---:|---:|---:|"]
    for (m, r), v in sels.items():
        stats = [passage_stats(sel, t.passage) for sel, t in zip(v, trials)]
        shares = [a for a, _ in stats]
        lines.append(f"| {LABELS.get(m, m)} | {r:g} | {v[0].shape[-1]}/{n} ({v[0].shape[-1] / n:.1%}) "
                     f"| {sum(shares) / len(shares):.1%} | {min(shares):.1%}..{max(shares):.1%} "
                     f"| {sum(b for _, b in stats) / len(stats):.1%} |")
    # where Kara's kept slots lie in the window: keep rate per band of region positions, passage band marked
    bands = [(0, 32), (32, 64), (64, 96), (96, 176), (176, 256), (256, 352), (352, n)]
    bands = [(a, min(b, n)) for a, b in bands if a < n]
    lines += ["", "Keep rate by region position (all layers, KV heads, trials; region slots 0.." + str(n - 1)
              + ", passages start at " + ", ".join(str(t.passage[0]) for t in trials) + "):", "",
              "| method | r | " + " | ".join(f"{a}-{b - 1}" for a, b in bands) + " |",
              "|---|---:|" + "---:|" * len(bands)]
    for (m, r), v in sels.items():
        counts = torch.zeros(n)
        for sel in v:
            counts += torch.bincount(sel.flatten(), minlength=n).float()
        rate = counts / (len(v) * v[0].shape[0] * v[0].shape[1])
        lines.append(f"| {LABELS.get(m, m)} | {r:g} | " + " | ".join(f"{rate[a:b].mean().item():.1%}" for a, b in bands)
                     + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratio", type=float, nargs="+", default=[0.2, 0.3, 0.5],
                    help="nominal retention ratios r (default 0.2 0.3 0.5)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help="methods (default: all, and none)")
    ap.add_argument("--trials", type=int, default=8, help="passage/filler pairs (default 8)")
    ap.add_argument("--max-tokens", type=int, default=1184,
                    help="continuation length (default 1184: the passage's window and one more are compressed, "
                         "the repeated passage is in the uncompressed tail)")
    ap.add_argument("--passage-len", type=int, default=80)
    ap.add_argument("--lead", default="spread",
                    help="lead-in tokens before the passage: an int for every trial, or 'spread' (default): trial k's "
                         "passage at evenly spread offsets of its window's compressible region")
    ap.add_argument("--batch-seqs", type=int, default=56,
                    help="at most this many sequences in the engine at once (bounds memory: ~8 GB at 56 with the "
                         "default sizes, KV pool plus each sequence's query cache; default 56)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine 2 OpenMP threads are far slower)")
    ap.add_argument("--diagnose", action="store_true",
                    help="only the cheap selection diagnostic (first window of each trial; no NLL runs)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/results/compression_quality.md and the plot")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine import Engine

    t_start = time.perf_counter()
    methods = list(dict.fromkeys(args.methods))
    ctx_len = 32
    body_len = args.max_tokens - 2 * args.passage_len  # lead-in + filler
    region = DEFAULT_WINDOW["window"] - DEFAULT_WINDOW["buffer"]
    runs = 1 + (len([m for m in methods if m != "none"])) * len(args.ratio)
    lay = case_layout(args.trials, args.max_tokens, args.passage_len, args.lead, runs, args.batch_seqs, ctx_len)
    leads, filler, cont_len, seqs, blocks = lay.leads, lay.filler, lay.cont_len, lay.seqs, lay.blocks
    if args.diagnose:  # one sequence of context + first window at a time
        seqs, blocks = 1, math.ceil((ctx_len + DEFAULT_WINDOW["window"] + 16) / 16) + 16
    engine = Engine(model="smollm2", dtype="float32", device="cpu", max_model_len=8192, num_kv_blocks=blocks,
                    max_num_seqs=max(64, seqs), max_num_batched_tokens=max(2048, seqs * 16 + ctx_len * seqs))
    trials = make_trials(engine.tokenizer, args.trials, filler_len=filler, lead_len=leads,
                         passage_len=args.passage_len, context_len=ctx_len)
    lead_text = (f"{leads[0]}-token lead-in" if len(set(leads)) == 1 else
                 f"lead-in of {', '.join(map(str, leads))} tokens (the passage at evenly spread offsets of the "
                 f"first window's {region}-slot compressible region)")
    t0 = time.perf_counter()
    w = DEFAULT_WINDOW
    if args.diagnose:
        body = diagnose(engine, trials, methods, args.ratio, DEFAULT_WINDOW)
        body += (f"\n\n{args.trials} trials (passages: {', '.join(t.name for t in trials)}); the selection each method "
                 f"makes on the window holding the planted passage (|W|={w['window']}, |U|={w['buffer']}, "
                 f"γ={w['chunk_max']}, α={w['chunk_budget']}; methods without α at the ratio keeping as many slots), "
                 f"computed from the engine's recomputed queries and cached keys. {time.perf_counter() - t0:.0f} s.")
        print(body)
        if not args.no_write:
            cmd = "python -m bench.compression_quality " + " ".join(sys.argv[1:])
            write_section("Compression quality: which slots each method keeps (SmolLM2)", cmd.strip(), body, SECTIONS)
        return
    say = lambda msg: print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa
    results = evaluate(engine, trials, methods, args.ratio, DEFAULT_WINDOW, batch_seqs=args.batch_seqs,
                       progress=say)
    elapsed = time.perf_counter() - t0
    st = engine.stats()
    say("scoring done; passage diagnostic")
    kept = passage_kept_fraction(engine, trials, methods, args.ratio, DEFAULT_WINDOW)
    body = tables(results, trials, kept)
    total = time.perf_counter() - t_start
    notes = [
        "",
        f"![recall NLL vs kept fraction](../{PLOT.name})",
        "",
        f"SmolLM2-135M-Instruct (GGUF dequantized, float32, CPU, {args.threads} thread). {args.trials} trials, each "
        f"one sequence: {ctx_len}-token context (never compressed) + {cont_len}-token continuation = {lead_text}, "
        f"{args.passage_len}-token passage (a stdlib module docstring), license text (lead-in + filler = {body_len} "
        f"tokens from /usr/share/common-licenses, a different offset per trial), the passage again. Teacher-forced "
        f"through the engine's own paged cache, 16 tokens per step, compression by the periodic policy as while "
        f"decoding: |W|={w['window']}, |U|={w['buffer']}, compression_period={w['compression_period']} decode steps "
        f"(n = {region}); Kara γ={w['chunk_max']}, α={w['chunk_budget']}. Equal KV length at each budget r: every "
        f"method keeps ⌈r·{region}⌉+{w['chunk_budget']} slots of each compressed window (Kara, its ablations, "
        f"random and streaming through α; the methods that keep ⌈r'·n⌉ at r' = (⌈r·n⌉+α)/n); every method ran with "
        f"its registered defaults otherwise (AMS: base Kara; R-KV, SnapKV: the whole buffer as observation window; "
        f"H2O: half recent; CentroidKV: chunk 16; InfoKV: λ=0.5, top-10 entropy of the full-cache distribution of "
        f"each continuation token, no representation-change term). {len(results)} runs x {args.trials} trials = "
        f"{len(results) * args.trials} sequences, at most {args.batch_seqs} in the engine at once.",
        "",
        f"text NLL: mean over the {args.trials}×{cont_len - args.passage_len} continuation tokens except the repeated "
        f"passage; NLL after 1st round: the same over tokens from continuation index {results[0].late_from} on "
        f"(earlier tokens are scored before any compression, identically by every method); recall NLL: mean over "
        f"the repeated passage's tokens (the first occurrence's NLL is the no-recall reference); passage slots kept: "
        f"share of the planted passage's KV slots (over layers, KV heads, trials) the method keeps when its window "
        f"is compressed (diagnostic: re-run of each trial's first window, selection only; CentroidKV: the slots its "
        f"centroids are written to); compression ms / token: the method's compression seconds (its selection, plus "
        f"its share of each round's query fetch and compaction) per region token it scored.",
        "",
        "Best per budget (wins: trials in which the method is the best of all methods at that budget):",
        "",
        *[f"- {v}" for v in reading(results)],
        "",
        f"Runtime {elapsed:.0f} s for the scoring ({st.num_steps} engine steps, {st.compression.rounds} compression "
        f"rounds taking {st.compression.seconds:.0f} s), {total:.0f} s in all; sized to finish in about an hour on "
        f"one thread of this shared 2-core CPU (the previous 6-method, one-ratio, 8-trial, 3136-token run took 34 "
        f"min).",
    ]
    body += "\n" + "\n".join(notes)
    print(body)
    say(f"total wall time {total:.0f} s")
    if not args.no_write:
        plot(results, PLOT)
        cmd = "python -m bench.compression_quality " + " ".join(sys.argv[1:])
        write_section("Compression quality (teacher-forced NLL, SmolLM2)", cmd.strip(), body, SECTIONS)


if __name__ == "__main__":
    main()
