"""Compression quality: teacher-forced NLL on SmolLM2 through the engine's own (compressed) KV cache.

Every trial is one sequence: a short context (never compressed) and a continuation of real text fed through the
normal scheduler 16 tokens per step (`Engine.score`'s path), so the periodic policy compresses the continuation's
windows exactly as it would while decoding. The continuation is

    lead-in (real text) | passage | filler (>= 2.8k tokens of real text) | the same passage again

The passage is a distinctive piece of prose (a Python standard-library module docstring) planted early, so its KV
sits in the first compressed window; the repetition at the end can only be predicted well if the compressed cache
kept enough of it (long-range recall). The filler is license text from /usr/share/common-licenses, taken at a
different offset in every trial.

Reported per method, averaged over the trials: mean NLL per token of the text (every continuation token except
the repeated passage), the same over the tokens scored after the first compression round only, the NLL of the
repeated passage (recall), and the final KV length. All window methods keep exactly ceil(r*n) + alpha slots of
every compressed window, so they end at the same KV length. All sequences of a run are scored in one batch, in
lockstep, so every method sees the same compression rounds.

`--diagnose` runs only a cheap selection diagnostic (each trial's first window; which share of the passage's slots
every method keeps, and Kara's keep rate by position in the window) and writes it to its own section.

    .venv/bin/python -m bench.compression_quality [--ratio 0.3 ...] [--trials 3] [--max-tokens N] [--no-write]
    .venv/bin/python -m bench.compression_quality --diagnose --trials 10 --ratio 0.2 0.3 0.5

The defaults take ~14 min on a busy 2-core AVX2 CPU (1 thread); `--trials 1 --max-tokens 1200` takes ~2 min.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from bench.common import real_text, write_section  # noqa: E402
from compression import KVCompressionConfig  # noqa: E402

METHODS = ("none", "kara", "kara_no_chunk", "kara_buffer_queries", "random", "streaming")
LABELS = {
    "none": "full cache (none)",
    "kara": "Kara",
    "kara_no_chunk": "Kara w/o Token2Chunk",
    "kara_buffer_queries": "Kara w/o Bi-Attention (buffer queries)",
    "random": "random in window",
    "streaming": "StreamingLLM (recency)",
}
#: Standard-library modules whose docstrings serve as planted passages (distinctive prose, not license text).
PASSAGE_MODULES = ("sched", "colorsys", "difflib", "tabnanny", "wave", "heapq", "statistics", "pydoc", "argparse",
                   "pickletools", "imaplib", "ftplib")
#: The paper's defaults (|W| = 512, |U| = 64, gamma = 8, alpha = 16); period = |W| - |U|.
DEFAULT_WINDOW = dict(window=512, buffer=64, chunk_max=8, chunk_budget=16, compression_period=448)


@dataclass
class Trial:
    context: list[int]
    continuation: list[int]
    passage: tuple[int, int]  # [start, end) of the planted passage in the continuation
    recall: tuple[int, int]  # [start, end) of its repetition (the recall span)
    name: str = ""


@dataclass
class MethodResult:
    method: str
    ratio: float | None
    logprobs: list[list[float]]  # per trial, log p of every continuation token
    kv_len: float  # final KV slots per sequence (context + continuation − evicted)
    logical_len: int  # context + continuation tokens per sequence
    tokens_seen: float = 0.0  # per sequence
    tokens_evicted: float = 0.0
    late_from: int = 0  # first continuation index scored after the first compression round
    trials: list[Trial] = field(default_factory=list)

    def _mean(self, spans: Sequence[Sequence[int]]) -> float:
        vals = [-lp[i] for lp, idx in zip(self.logprobs, spans) for i in idx]
        return sum(vals) / len(vals) if vals else float("nan")

    @property
    def text_nll(self) -> float:
        """Mean NLL over every continuation token except the repeated passage."""
        return self._mean([[i for i in range(len(lp)) if not t.recall[0] <= i < t.recall[1]]
                           for lp, t in zip(self.logprobs, self.trials)])

    @property
    def late_nll(self) -> float:
        """Mean NLL over the text tokens scored after the first compression round (same tokens for every method)."""
        return self._mean([[i for i in range(self.late_from, len(lp)) if not t.recall[0] <= i < t.recall[1]]
                           for lp, t in zip(self.logprobs, self.trials)])

    def recall_per_trial(self) -> list[float]:
        return [sum(-lp[i] for i in range(*t.recall)) / (t.recall[1] - t.recall[0])
                for lp, t in zip(self.logprobs, self.trials)]

    @property
    def recall_nll(self) -> float:
        return self._mean([range(*t.recall) for t in self.trials])

    @property
    def first_copy_nll(self) -> float:
        """NLL of the planted passage itself (scored before any compression: the no-recall reference)."""
        return self._mean([range(*t.passage) for t in self.trials])


# ----------------------------------------------------------------------------------------------- inputs
def passages(tokenizer, count: int, length: int) -> list[tuple[str, list[int]]]:
    """`count` passages of exactly `length` tokens from standard-library module docstrings."""
    out = []
    for name in PASSAGE_MODULES:
        doc = (importlib.import_module(name).__doc__ or "").strip()
        ids = tokenizer("\n\n" + doc + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= length:
            out.append((name, ids[:length]))
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} standard-library docstrings have >= {length} tokens; use fewer trials")


def spread_leads(num_trials: int, region: int, passage_len: int) -> list[int]:
    """Lead-in lengths that put trial k's passage at evenly spread offsets of the first window's compressible
    region [0, region): the first trial at its start, the last ending at its end. Scores have a position bias
    inside the window, so a passage at one fixed offset measures that bias as much as the scorer."""
    last = region - passage_len
    if last < 0:
        raise ValueError(f"a {passage_len}-token passage does not fit a {region}-slot region")
    if num_trials == 1:
        return [last // 2]
    return [round(k * last / (num_trials - 1)) for k in range(num_trials)]


def make_trials(tokenizer, num_trials: int, *, filler_len: int = 2880, lead_len: int | Sequence[int] = 96,
                passage_len: int = 80, context_len: int = 32) -> list[Trial]:
    """Trials over license text at spread-out offsets; each plants a different passage. ``lead_len`` is one
    lead-in length for every trial or one per trial; the filler shrinks by the extra lead so every continuation
    has the same length (lockstep scoring needs that)."""
    leads = [lead_len] * num_trials if isinstance(lead_len, int) else list(lead_len)
    if len(leads) != num_trials:
        raise ValueError(f"need {num_trials} lead-in lengths, got {len(leads)}")
    body = max(leads) + filler_len  # lead + filler, the same in every trial
    text = tokenizer(real_text(), add_special_tokens=False).input_ids
    span = context_len + body
    if span > len(text):
        raise ValueError(f"need {span} tokens of real text, have {len(text)}")
    step = (len(text) - span) // max(1, num_trials)
    trials = []
    for k, (lead, (name, p)) in enumerate(zip(leads, passages(tokenizer, num_trials, passage_len))):
        s = k * step
        ids = text[s:s + span]
        ctx, rest = ids[:context_len], ids[context_len:]
        cont = rest[:lead] + p + rest[lead:] + p
        trials.append(Trial(ctx, cont, (lead, lead + passage_len), (len(cont) - passage_len, len(cont)),
                            name=f"{name} @ license token {s}, passage at {lead}"))
    return trials


def synthetic_trials(num_trials: int, *, vocab: int, filler_len: int, lead_len: int, passage_len: int,
                     context_len: int, seed: int = 0) -> list[Trial]:
    """Random-token trials of the same shape (for tiny test models without a real tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    trials = []
    for _ in range(num_trials):
        r = torch.randint(0, vocab, (context_len + lead_len + filler_len + passage_len,), generator=g).tolist()
        ctx, lead = r[:context_len], r[context_len:context_len + lead_len]
        filler = r[context_len + lead_len:context_len + lead_len + filler_len]
        p = r[context_len + lead_len + filler_len:]
        cont = lead + p + filler + p
        trials.append(Trial(ctx, cont, (lead_len, lead_len + passage_len), (len(cont) - passage_len, len(cont))))
    return trials


# ----------------------------------------------------------------------------------------------- scoring
def score_many(engine, items: list[tuple[list[int], list[int], Any]], chunk_size: int = 16) -> list[list[float]]:
    """`Engine.score` for several (context, continuation, kv_compression) at once: every request is submitted
    before the first step, so all are scored in the same batches, in lockstep (same compression rounds)."""
    by_cfg: dict[Any, list[int]] = {}
    for k, (_, _, kvc) in enumerate(items):
        by_cfg.setdefault(kvc, []).append(k)
    reqs = []
    for kvc, idx in by_cfg.items():  # Engine.score takes one kv_compression per call: submit without waiting
        from engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_compression=kvc)
        for k in idx:
            ctx, cont, _ = items[k]
            if not ctx or not cont:
                raise ValueError("score: context and continuation must be non-empty")
            req = engine.core.make_request(list(ctx) + list(cont), params, f"q{k}", score=(len(ctx), chunk_size))
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


def method_config(method: str, ratio: float, window: dict) -> KVCompressionConfig:
    """The method at this ratio with the window settings it takes (Kara's γ/α only where the method has them)."""
    if method == "none":
        return KVCompressionConfig("none")
    from compression import COMMON_FIELDS, registry

    allowed = set(COMMON_FIELDS) | set(registry.get(method).param_names())
    return KVCompressionConfig(method, ratio=ratio, **{k: v for k, v in window.items() if k in allowed})


def evaluate(engine, trials: list[Trial], methods: Sequence[str] = METHODS, ratios: Sequence[float] = (0.3,),
             window: dict | None = None, chunk_size: int = 16) -> list[MethodResult]:
    """Score every trial under every (method, ratio) in one batch; "none" is run once. Returns one MethodResult per
    (method, ratio) with per-sequence KV accounting derived from the engine's compression stats."""
    window = dict(DEFAULT_WINDOW if window is None else window)
    lengths = {len(t.context) + len(t.continuation) for t in trials}
    lens_cont = {len(t.continuation) for t in trials}
    if len(lens_cont) != 1:
        raise ValueError("all trials must have the same continuation length (lockstep accounting)")
    runs: list[tuple[str, float | None, KVCompressionConfig]] = []
    for m in methods:
        if m == "none":
            runs.append((m, None, method_config(m, 1.0, window)))
        else:
            runs.extend((m, r, method_config(m, r, window)) for r in ratios)
    before = engine.stats()
    items = [(t.context, t.continuation, cfg) for _, _, cfg in runs for t in trials]
    logprobs = score_many(engine, items, chunk_size)
    after = engine.stats()
    engine.check_invariants()

    # Per-sequence accounting: all window sequences run in lockstep with the same n, so they compress the same
    # number of windows; each keeps its config's kept_per_window of every window.
    seen = after.compression_tokens_seen - before.compression_tokens_seen
    evicted = after.compression_tokens_evicted - before.compression_tokens_evicted
    window_runs = [cfg for _, _, cfg in runs if cfg.enabled]
    n = window["window"] - window["buffer"]
    num_seqs = len(window_runs) * len(trials)
    windows_per_seq = seen / (n * num_seqs) if num_seqs else 0
    if num_seqs:
        assert windows_per_seq == int(windows_per_seq), f"sequences compressed unequal window counts ({seen})"
        expected = sum(int(windows_per_seq) * (n - cfg.kept_per_window) for cfg in window_runs) * len(trials)
        assert evicted == expected, f"evicted {evicted} != expected {expected}"
    windows_per_seq = int(windows_per_seq)

    # The first round that compresses anything runs once a sequence's uncompressed tail holds |W| tokens and the
    # decode counter reaches a round; tokens before the first window is compressed are scored identically by all.
    late_from = _first_compressed_step(len(trials[0].continuation), window, chunk_size) if num_seqs else 0

    # Sanity check: before the first compression every method's cache equals the full one.
    none_lps = [logprobs[k * len(trials):(k + 1) * len(trials)] for k, (m, _, _) in enumerate(runs) if m == "none"]
    if none_lps:
        for k in range(len(runs)):
            for a, b in zip(logprobs[k * len(trials):(k + 1) * len(trials)], none_lps[0]):
                diff = max((abs(x - y) for x, y in zip(a[:late_from], b[:late_from])), default=0.0)
                assert diff < 1e-3, f"{runs[k][0]} differs from the full cache by {diff} before any compression"

    results = []
    logical = lengths.pop() if len(lengths) == 1 else max(lengths)
    for k, (m, r, cfg) in enumerate(runs):
        lps = logprobs[k * len(trials):(k + 1) * len(trials)]
        ev = windows_per_seq * (n - cfg.kept_per_window) if cfg.enabled else 0
        results.append(MethodResult(m, r, lps, kv_len=logical - ev, logical_len=logical,
                                    tokens_seen=windows_per_seq * n if cfg.enabled else 0, tokens_evicted=ev,
                                    late_from=late_from, trials=trials))
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
    lies in the continuation's first window [0, |W|); the window's queries and keys do not depend on anything after
    it, so running each trial's context + first window and selecting on it reproduces the selection the periodic
    policy makes in its first effective round (for "random": one draw of the same law)."""
    from engine.sampling_params import SamplingParams

    window = dict(DEFAULT_WINDOW if window is None else window)
    w, n = window["window"], window["window"] - window["buffer"]
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
        engine.abort(req.request_id)
        engine.step()
        for m in methods:
            if m == "none":
                continue
            for r in ratios:
                out.setdefault((m, r), []).append(method_config(m, r, window).make_compressor().select(q, k, n).cpu())
    engine.check_invariants()
    return out


def passage_kept_fraction(engine, trials: list[Trial], methods: Sequence[str], ratios: Sequence[float],
                          window: dict | None = None) -> dict[tuple[str, float], float]:
    """Diagnostic: the share of the planted passage's KV slots each window method keeps when the passage's window
    is compressed, averaged over layers, KV heads and trials (see `first_window_selections`)."""
    sels = first_window_selections(engine, trials, methods, ratios, window)
    return {key: sum(_passage_stats(sel, t.passage)[0] for sel, t in zip(v, trials)) / len(trials)
            for key, v in sels.items()}


def _passage_stats(sel: torch.Tensor, passage: tuple[int, int]) -> tuple[float, float]:
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
        stats = [_passage_stats(sel, t.passage) for sel, t in zip(v, trials)]
        shares = [a for a, _ in stats]
        lines.append(f"| {LABELS[m]} | {r:g} | {v[0].shape[-1]}/{n} ({v[0].shape[-1] / n:.1%}) "
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
        lines.append(f"| {LABELS[m]} | {r:g} | " + " | ".join(f"{rate[a:b].mean().item():.1%}" for a, b in bands)
                     + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- output
def tables(results: list[MethodResult], trials: list[Trial], kept: dict | None = None) -> str:
    none = next((r for r in results if r.method == "none"), None)
    kept = kept or {}
    head = ("| method | r | final KV slots / tokens | text NLL | Δ vs full | NLL after 1st round | Δ vs full "
            "| recall NLL | Δ vs full | passage slots kept |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        d = (lambda a, b: f"{a - b:+.4f}") if none is not None else (lambda a, b: "-")
        ratio = "-" if res.ratio is None else f"{res.ratio:g}"
        lines.append(
            f"| {LABELS.get(res.method, res.method)} | {ratio} | {res.kv_len:.0f} / {res.logical_len} "
            f"({res.kv_len / res.logical_len:.1%}) | {res.text_nll:.4f} | {d(res.text_nll, none.text_nll)} "
            f"| {res.late_nll:.4f} | {d(res.late_nll, none.late_nll)} | {res.recall_nll:.3f} "
            f"| {d(res.recall_nll, none.recall_nll)} "
            f"| {'100%' if res.method == 'none' else format(kept[(res.method, res.ratio)], '.1%') if (res.method, res.ratio) in kept else '-'} |")
    lines += ["", "Recall NLL per trial (passage):", "",
              "| method | r | " + " | ".join(t.name.split(" @")[0] or f"trial {i}" for i, t in enumerate(trials))
              + " |", "|---|---:|" + "---:|" * len(trials)]
    for res in results:
        ratio = "-" if res.ratio is None else f"{res.ratio:g}"
        lines.append(f"| {LABELS.get(res.method, res.method)} | {ratio} | "
                     + " | ".join(f"{v:.3f}" for v in res.recall_per_trial()) + " |")
    if none is not None:
        lines.append("| first occurrence (no recall possible) | - | "
                     + " | ".join(f"{sum(-lp[i] for i in range(*t.passage)) / (t.passage[1] - t.passage[0]):.3f}"
                                  for lp, t in zip(none.logprobs, trials)) + " |")
    return "\n".join(lines)


def verdict(results: list[MethodResult]) -> list[str]:
    out = []
    for r in sorted({x.ratio for x in results if x.ratio is not None}):
        by = {x.method: x for x in results if x.ratio == r}
        if "kara" not in by:
            continue
        k = by["kara"]
        for other in ("random", "kara_buffer_queries", "streaming", "kara_no_chunk"):
            if other in by:
                o = by[other]
                wins = sum(a < b for a, b in zip(k.recall_per_trial(), o.recall_per_trial()))
                out.append(f"r={r:g}: Kara recall NLL {k.recall_nll:.3f} vs {LABELS[other]} {o.recall_nll:.3f} "
                           f"({'lower' if k.recall_nll < o.recall_nll else 'NOT lower'}; lower in {wins}/"
                           f"{len(k.trials)} trials); text NLL {k.text_nll:.4f} vs {o.text_nll:.4f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratio", type=float, nargs="+", default=[0.3], help="retention ratio(s) r (default 0.3)")
    ap.add_argument("--trials", type=int, default=3, help="passage/filler pairs (default 3)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cap the continuation length (shrinks the filler; default: 2880-token filler, 3136 total)")
    ap.add_argument("--passage-len", type=int, default=80)
    ap.add_argument("--lead", default="spread",
                    help="lead-in tokens before the passage: an int for every trial, or 'spread' (default): trial k's "
                         "passage at evenly spread offsets of its window's compressible region")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine 2 OpenMP threads are far slower)")
    ap.add_argument("--diagnose", action="store_true",
                    help="only the cheap selection diagnostic (first window of each trial; no NLL runs)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine import Engine

    t_start = time.perf_counter()
    ctx_len, body_len = 32, 96 + 2880  # continuation = lead-in + filler (body_len tokens) + the passage twice
    if args.max_tokens is not None:
        body_len = args.max_tokens - 2 * args.passage_len
    region = DEFAULT_WINDOW["window"] - DEFAULT_WINDOW["buffer"]
    leads = (spread_leads(args.trials, region, args.passage_len) if args.lead == "spread"
             else [int(args.lead)] * args.trials)
    filler = body_len - max(leads)
    if filler < 1:
        raise SystemExit(f"--max-tokens must exceed {max(leads) + 2 * args.passage_len}")
    cont_len = body_len + 2 * args.passage_len
    seqs = args.trials * (1 + (len(METHODS) - 1) * len(args.ratio))
    blocks = seqs * math.ceil((ctx_len + cont_len + 16) / 16) + 16
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
    if args.diagnose:
        body = diagnose(engine, trials, METHODS, args.ratio, DEFAULT_WINDOW)
        body += (f"\n\n{args.trials} trials (passages: {', '.join(t.name for t in trials)}); the selection each method "
                 f"makes on the window holding the planted passage (|W|={DEFAULT_WINDOW['window']}, "
                 f"|U|={DEFAULT_WINDOW['buffer']}, γ={DEFAULT_WINDOW['chunk_max']}, α={DEFAULT_WINDOW['chunk_budget']}), "
                 f"computed from the engine's recomputed queries and cached keys. {time.perf_counter() - t0:.0f} s.")
        print(body)
        if not args.no_write:
            cmd = "python -m bench.compression_quality " + " ".join(sys.argv[1:])
            write_section("Compression quality: which slots each method keeps (SmolLM2)", cmd.strip(), body)
        return
    results = evaluate(engine, trials, METHODS, args.ratio, DEFAULT_WINDOW)
    elapsed = time.perf_counter() - t0
    st = engine.stats()
    kept = passage_kept_fraction(engine, trials, METHODS, args.ratio, DEFAULT_WINDOW)
    body = tables(results, trials, kept)
    w = DEFAULT_WINDOW
    notes = [
        "",
        f"SmolLM2-135M-Instruct (GGUF dequantized, float32, CPU, {args.threads} thread). {args.trials} trials, each "
        f"one sequence: {ctx_len}-token context (never compressed) + {cont_len}-token continuation = {lead_text}, "
        f"{args.passage_len}-token passage (a stdlib module docstring), license text (lead-in + filler = {body_len} "
        f"tokens from /usr/share/common-licenses, a different offset per trial), the passage again. Teacher-forced through the "
        f"engine's own paged cache, 16 tokens per step, compression by the periodic policy as while decoding: "
        f"|W|={w['window']}, |U|={w['buffer']}, γ={w['chunk_max']}, α={w['chunk_budget']}, compression_period="
        f"{w['compression_period']} decode steps; every window method keeps ⌈r·448⌉+16 slots of each compressed "
        f"window (same KV length for all of them). All {seqs} sequences are scored in one batch, in lockstep.",
        "",
        f"text NLL: mean over the {args.trials}×{cont_len - args.passage_len} continuation tokens except the repeated "
        f"passage; NLL after 1st round: the same over tokens from continuation index {results[0].late_from} on "
        f"(earlier tokens are scored before any compression, identically by every method); recall NLL: mean over "
        f"the repeated passage's tokens (the first occurrence's NLL is the no-recall reference); passage slots kept: "
        f"share of the planted passage's KV slots (over layers, KV heads, trials) the method keeps when its window "
        f"is compressed (diagnostic: re-run of each trial's first window, selection only).",
        "",
        *[f"- {v}" for v in verdict(results)],
        "",
        f"Runtime {elapsed:.0f} s for the scoring ({st.num_steps} engine steps, {st.compression_rounds} compression "
        f"rounds taking {st.compression_seconds:.0f} s).",
    ]
    body += "\n" + "\n".join(notes)
    print(body)
    print(f"total wall time {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    if not args.no_write:
        cmd = "python -m bench.compression_quality " + " ".join(sys.argv[1:])
        write_section("Compression quality (teacher-forced NLL, SmolLM2)", cmd.strip(), body)


if __name__ == "__main__":
    main()
