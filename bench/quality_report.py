"""The quality bench's record of one (method, r) run and its report: tables, the hand-checkable reading, the plot."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from bench.quality_cases import Trial

LABELS = {
    "none": "full cache (none)",
    "kara": "Kara",
    "kara_recompute": "Kara, recomputed queries",
    "kara_no_chunk": "Kara w/o Token2Chunk",
    "kara_buffer_queries": "Kara w/o Bi-Attention (buffer queries)",
    "random": "random in window",
    "streaming": "StreamingLLM (recency)",
    "snapkv": "SnapKV (window)",
    "tova": "TOVA",
    "h2o": "H2O (window queries)",
    "keydiff": "KeyDiff",
    "knorm": "K-norm",
    "rkv": "R-KV",
    "ams": "AMS (base Kara)",
    "infokv": "InfoKV-style (Kara + entropy)",
    "centroid": "CentroidKV (merging)",
}
#: Standard-library modules whose docstrings serve as planted passages (distinctive prose, not license text).


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
    kept_per_window: int = 0  # region slots kept of every compressed window (n for "none")
    region_len: int = 0  # n
    compression_seconds: float = 0.0  # this run's share of the engine's compression time (all its trials)
    compressed_tokens: int = 0  # region tokens this run scored (all its trials)

    @property
    def kept_fraction(self) -> float:
        return self.kept_per_window / self.region_len if self.region_len else 1.0

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.compression_seconds / self.compressed_tokens if self.compressed_tokens else float("nan")

    def text_per_trial(self) -> list[float]:
        """NLL after the first round per trial (the text tokens every method scores under compression)."""
        out = []
        for lp, t in zip(self.logprobs, self.trials):
            idx = [i for i in range(self.late_from, len(lp)) if not t.recall[0] <= i < t.recall[1]]
            out.append(sum(-lp[i] for i in idx) / len(idx) if idx else float("nan"))
        return out

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


def _label(res: MethodResult) -> str:
    return LABELS.get(res.method, res.method)


def tables(results: list[MethodResult], trials: list[Trial], kept: dict | None = None) -> str:
    none = next((r for r in results if r.method == "none"), None)
    kept = kept or {}
    d = (lambda a, b: f"{a - b:+.4f}") if none is not None else (lambda a, b: "-")
    head = ("| method | r | kept / window | final KV slots / tokens | text NLL | Δ vs full | NLL after 1st round "
            "| Δ vs full | recall NLL | Δ vs full | passage slots kept | compression ms / token |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        ratio = "-" if res.ratio is None else f"{res.ratio:g}"
        passage = ("100%" if res.method == "none" else
                   format(kept[(res.method, res.ratio)], ".1%") if (res.method, res.ratio) in kept else "-")
        ms = "-" if res.method == "none" else f"{res.ms_per_token:.2f}"
        lines.append(
            f"| {_label(res)} | {ratio} | {res.kept_per_window}/{res.region_len} | {res.kv_len:.0f} / "
            f"{res.logical_len} ({res.kv_len / res.logical_len:.1%}) | {res.text_nll:.4f} "
            f"| {d(res.text_nll, none.text_nll) if none else '-'} | {res.late_nll:.4f} "
            f"| {d(res.late_nll, none.late_nll) if none else '-'} | {res.recall_nll:.3f} "
            f"| {d(res.recall_nll, none.recall_nll) if none else '-'} | {passage} | {ms} |")
    lines += ["", "Recall NLL per trial (passage):", "",
              "| method | r | " + " | ".join(t.name.split(" @")[0] or f"trial {i}" for i, t in enumerate(trials))
              + " |", "|---|---:|" + "---:|" * len(trials)]
    for res in results:
        ratio = "-" if res.ratio is None else f"{res.ratio:g}"
        lines.append(f"| {_label(res)} | {ratio} | " + " | ".join(f"{v:.3f}" for v in res.recall_per_trial()) + " |")
    if none is not None:
        lines.append("| first occurrence (no recall possible) | - | "
                     + " | ".join(f"{sum(-lp[i] for i in range(*t.passage)) / (t.passage[1] - t.passage[0]):.3f}"
                                  for lp, t in zip(none.logprobs, trials)) + " |")
    return "\n".join(lines)


def _wins(group: list[MethodResult], per_trial) -> dict[str, int]:
    """Trials in which each method has the lowest value of `per_trial` among `group` (ties: each tied one wins)."""
    vals = [per_trial(r) for r in group]
    wins = {r.method: 0 for r in group}
    for t in range(len(vals[0])):
        best = min(v[t] for v in vals)
        for r, v in zip(group, vals):
            wins[r.method] += v[t] == best
    return wins


def reading(results: list[MethodResult]) -> list[str]:
    """Per budget: the best method by mean recall NLL and by mean NLL after the first round, each with the number of
    trials in which it is the best of all methods at that budget, and the runner-up."""
    out = []
    for r in sorted({x.ratio for x in results if x.ratio is not None}):
        group = [x for x in results if x.ratio == r]
        if len(group) < 2:
            continue
        n_trials = len(group[0].trials)
        kept = f"{group[0].kept_per_window}/{group[0].region_len}"
        for what, mean, per_trial in (("recall NLL", lambda x: x.recall_nll, MethodResult.recall_per_trial),
                                      ("NLL after the 1st round", lambda x: x.late_nll, MethodResult.text_per_trial)):
            ranked = sorted(group, key=mean)
            wins = _wins(group, per_trial)
            best, second = ranked[0], ranked[1]
            most = max(wins.values())
            out.append(f"r={r:g} ({kept} slots per window): best {what} {_label(best)} {mean(best):.4f} (best in "
                       f"{wins[best.method]}/{n_trials} trials), then {_label(second)} {mean(second):.4f} "
                       f"({wins[second.method]}/{n_trials}); most trials won: "
                       + ", ".join(f"{LABELS.get(m, m)} {w}" for m, w in wins.items() if w == most and w > 0))
    return out


def plot(results: list[MethodResult], path: Path) -> None:
    """Recall NLL against the kept fraction of each window, one line per method; the full cache and the
    no-recall level (the passage's first occurrence) as horizontal references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    methods = [m for m in dict.fromkeys(r.method for r in results) if m != "none"]
    styles = ["-o", "-s", "-^", "-v", "-D", "-P", "-X", "-*", "-<", "->", "-h", "-p", "-d", "-8"]
    for i, m in enumerate(methods):
        pts = sorted((r.kept_fraction, r.recall_nll) for r in results if r.method == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % len(styles)], label=LABELS.get(m, m),
                linewidth=2.2 if m == "kara" else 1.2, markersize=5)
    none = next((r for r in results if r.method == "none"), None)
    if none is not None:
        ax.axhline(none.recall_nll, color="k", linestyle="--", linewidth=1, label="full cache")
        ax.axhline(none.first_copy_nll, color="gray", linestyle=":", linewidth=1, label="no recall (1st occurrence)")
    ax.set_xlabel("kept fraction of each compressed window ((⌈r·n⌉ + α) / n)")
    ax.set_ylabel("recall NLL of the repeated passage (nats/token, lower is better)")
    ax.set_title("Long-range recall vs KV budget, SmolLM2-135M, equal KV length per budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kv_dtype_table(rows: list[tuple[str, int, list[MethodResult]]], bound: dict[str, float]) -> str:
    """One line per (KV dtype, method): NLLs as the increase over the full-precision full cache (the first row's
    "none"). `rows`: (KV dtype, bytes per cached token, its results); `bound`: the allowed text-NLL increase (%) by
    row label, marked meets / misses."""
    ref = next(r for r in rows[0][2] if r.method == "none")
    pct = lambda a, b: f"{100 * (a / b - 1):+.2f}%"  # noqa: E731
    lines = ["| KV dtype | bytes / token | compression | kept KV slots | text NLL | Δ text NLL | NLL after 1st round "
             "| Δ | recall NLL | Δ recall NLL | bound |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, bpt, results in rows:
        for res in results:
            label = "none" if res.method == "none" else f"{_label(res)} r={res.ratio:g}"
            key = f"{name} + {res.method}"
            verdict = "-"
            if key in bound:
                ok = 100 * (res.text_nll / ref.text_nll - 1) <= bound[key]
                verdict = f"<= {bound[key]:g}%: {'meets' if ok else 'misses'}"
            lines.append(f"| {name} | {bpt} | {label} | {res.kv_len / res.logical_len:.1%} | {res.text_nll:.4f} "
                         f"| {pct(res.text_nll, ref.text_nll)} | {res.late_nll:.4f} | {pct(res.late_nll, ref.late_nll)} "
                         f"| {res.recall_nll:.3f} | {pct(res.recall_nll, ref.recall_nll)} | {verdict} |")
    return "\n".join(lines)
