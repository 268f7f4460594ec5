"""The inputs and settings of the quality bench (bench/compression_quality.py): the trials (real text with a planted
passage and its repetition, or random tokens for tiny test models) and each method's configuration at a nominal
budget with the equal-KV rule."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Sequence

import torch

from bench.common import real_text
from compression import KVCompressionConfig
from compression.config import num_topk

METHODS = ("none", "kara", "kara_recompute", "kara_no_chunk", "kara_buffer_queries", "random", "streaming", "snapkv", "tova", "h2o",
           "keydiff", "knorm", "rkv", "ams", "infokv", "centroid")
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


@dataclass
class Layout:
    """How the trials of one run are sized: lead-ins, filler, continuation, and the KV blocks and batch of the
    engine that scores them."""
    leads: list[int]
    filler: int
    cont_len: int
    seqs: int
    blocks: int


def case_layout(trials: int, max_tokens: int, passage_len: int, lead: str, runs: int, batch_seqs: int,
                ctx_len: int = 32) -> Layout:
    """Continuations of `max_tokens` (lead-in + passage + filler + passage again), the passages spread over the first
    window's region ('spread') or at a fixed lead; `runs` configs of `trials` sequences, at most `batch_seqs` at once."""
    body_len = max_tokens - 2 * passage_len  # lead-in + filler
    region = DEFAULT_WINDOW["window"] - DEFAULT_WINDOW["buffer"]
    leads = spread_leads(trials, region, passage_len) if lead == "spread" else [int(lead)] * trials
    filler = body_len - max(leads)
    if filler < 1:
        raise SystemExit(f"--max-tokens must exceed {max(leads) + 2 * passage_len}")
    seqs = min(batch_seqs, trials * runs)
    return Layout(leads, filler, body_len + 2 * passage_len, seqs, seqs * -(-(ctx_len + max_tokens + 16) // 16) + 16)


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


def equal_kv_ratio(ratio: float, n: int, alpha: int) -> float:
    """The ratio r' at which a method keeping ⌈r'·n⌉ keeps as many slots as Kara's ⌈r·n⌉ + α."""
    return min(1.0, (num_topk(ratio, n) + alpha) / n)


def method_config(method: str, ratio: float, window: dict) -> KVCompressionConfig:
    """The method at nominal budget r with the window settings it takes, keeping ⌈r·n⌉ + α slots per window:
    methods with Kara's α (``chunk_budget``) at r, the others at `equal_kv_ratio`."""
    if method == "none":
        return KVCompressionConfig("none")
    from compression import COMMON_FIELDS, registry

    extra = {}
    if method == "kara_recompute":  # Kara with its window queries from a second forward instead of the query cache
        method, extra = "kara", {"query_source": "recompute"}
    names = set(registry.get(method).param_names())
    n, alpha = window["window"] - window["buffer"], window.get("chunk_budget", 0)
    values = {k: v for k, v in window.items() if k in set(COMMON_FIELDS) | names}
    want = min(n, num_topk(ratio, n) + alpha)
    cfg = KVCompressionConfig(method, ratio=ratio if "chunk_budget" in names else equal_kv_ratio(ratio, n, alpha),
                              **values, **extra)
    assert cfg.kept_per_window == want, (method, cfg.kept_per_window, want)
    return cfg
