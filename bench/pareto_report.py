"""Tables, plots and the written reading of the throughput/quality sweep (bench/pareto.py)."""
from __future__ import annotations

import math
from pathlib import Path

from bench.common import DOCS
from bench.pareto_front import Point, best_within, cost_bound, pareto_front
from bench.pareto_runs import LABELS, Setting, settings_for

#: Acceptance targets of issue 28 per pool: the best setting at <= 1% text-NLL cost vs none on the same pool.
TARGETS = {"2": 1.4, "4": 1.25, "ample": 0.98}


def pool_name(pool: str) -> str:
    return "ample pool" if pool == "ample" else f"pool for {pool}"


def by_pool(runs: list[dict]) -> dict[str, dict]:
    """pool -> {setting key: run} (compressed settings), plus pool -> none runs under the key None."""
    out: dict[str, dict] = {}
    for r in runs:
        d = out.setdefault(r["pool"], {})
        if r["setting"] is None:
            d.setdefault(None, {}).setdefault(r["output_len"], []).append(r)
        else:
            d[r["setting"].key] = r
    return out


def use_cpu_clock(runs: list[dict]) -> list[dict]:
    """Runs with their ratios recomputed from tokens per CPU second of the worker instead of per wall second (for
    a machine shared with other work, where wall time swings with the load; on an idle core the two agree)."""
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        if r["setting"] is None:
            groups.setdefault((r["pool"], r["output_len"]), []).append(r["num_requests"] * r["output_len"] / r["cpu"])
    out = []
    for r in runs:
        ref = groups[(r["pool"], r["output_len"])]
        tps = r["num_requests"] * r["output_len"] / r["cpu"]
        out.append({**r, "tok_s": tps, "ratio": tps / (sum(ref) / len(ref)), "none_drift": ref[-1] / ref[0] - 1})
    return out


def points(settings, quality: dict, pool_runs: dict, axis: str = "d_text") -> list[Point]:
    """One Point per setting measured on this pool and in quality: cost = the NLL increase on ``axis``, gain =
    the throughput ratio to none."""
    return [Point(s.name, quality[s.key][axis], pool_runs[s.key]["ratio"])
            for s in settings if s.key in pool_runs and s.key in quality]


def holdback(best: Point | None, pts: list[Point], target: float, bound: float, run: dict | None,
             none_batch: float | None, ample: bool = False) -> str:
    """What keeps the best setting within the quality bound under ``target`` (empty when it meets it): the
    quality cost of the settings that do reach it, the concurrency it won (on a short pool), and the compression
    and verification time it pays."""
    if best is None:
        return "no setting is within the quality bound"
    if best.gain >= target:
        return ""
    parts = []
    faster = [p for p in pts if p.gain >= target]
    if faster:
        cheapest = min(faster, key=lambda p: p.cost)
        parts.append(f"quality: the settings reaching {target:g}x cost at least Δ {cheapest.cost:+.4f} "
                     f"({cheapest.name}; the bound is {bound:.4f})")
    else:
        parts.append(f"no setting reaches {target:g}x at any quality (fastest {max(p.gain for p in pts):.2f}x)")
    if run is not None and ample:
        parts.append("every request runs at once at this pool with or without compression, so only the attention "
                     "the shorter cache saves can pay for the time compression takes")
    elif run is not None:
        cap = run["num_requests"]
        conc = f"mean running batch {run['mean_batch']:.1f} of {cap} requests"
        if none_batch is not None:
            conc += f" (none {none_batch:.1f})"
        if run["mean_batch"] >= 0.9 * cap:
            conc += ": every request already runs at once, so the request count caps the gain"
        parts.append(conc)
        parts.append(f"compression {100 * run['comp_share']:.1f}% and verification {100 * run['verify_share']:.1f}% "
                     f"of engine time")
    return "; ".join(parts)


def _fmt_ratio(r: dict | None) -> str:
    return "-" if r is None else f"{r['ratio']:.2f}x"


def _agreement(runs: dict, s) -> str:
    for pool in ("ample", *sorted(k for k in runs if k != "ample")):
        r = runs.get(pool, {}).get(s.key)
        if r is not None:
            return f"{r['agree_mean']:.0f}/{r['output_len']} ({100 * r['agree_identical']:.0f}% equal)"
    return "-"


def _triggered(runs: dict, s) -> str:
    vals = [r for p in runs.values() for k, r in p.items() if k == s.key]
    if not vals:
        return "-"
    if any(r["triggered"] is None for r in vals):
        return "?"
    low = min(r["triggered"] / r["num_requests"] for r in vals)  # over the pools it ran on
    return "all" if low == 1 else f">= {100 * low:.0f}%"


def main_table(settings, quality: dict, runs: dict, pools: list[str]) -> str:
    full = quality["none"]
    head = ("| setting | text NLL Δ | Δ / full | recall NLL Δ | Δ after 1st round | greedy agreement "
            "| requests compressed | " + " | ".join(f"x none, {pool_name(p)} (batch)" for p in pools)
            + " | compression share* | verification share* |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(pools) + "---:|---:|"]
    none_cells = []
    for p in pools:  # per output length: tok/s of the runs before / after the group, and the mean batch
        groups = sorted(runs.get(p, {}).get(None, {}).items())
        none_cells.append("; ".join(f"{n} tokens: " + " / ".join(f"{r['tok_s']:.1f}" for r in rs)
                                    + f" tok/s ({rs[0]['mean_batch']:.1f})" for n, rs in groups) or "-")
    lines.append(f"| none (full cache: text NLL {full['text']:.4f}, recall {full['recall']:.3f}) | 0 | 0 | 0 | 0 "
                 f"| - | - | " + " | ".join(none_cells) + " | - | - |")
    for s in settings:
        q = quality.get(s.key)
        if q is None:
            continue
        cells = []
        for p in pools:
            r = runs.get(p, {}).get(s.key)
            cells.append("-" if r is None else f"{r['ratio']:.2f}x ({r['mean_batch']:.1f})")
        share = [r for p in pools for k, r in runs.get(p, {}).items() if k == s.key]
        ref = next((r for r in share if r["pool"] == "ample"), share[0] if share else None)
        exact = " (exact)" if q["exact"] else ""
        shares = (f"{100 * ref['comp_share']:.1f}% | {100 * ref['verify_share']:.1f}%" if ref else "- | -")
        lines.append(f"| {s.name} | {q['d_text']:+.4f}{exact} | {100 * q['d_text'] / full['text']:+.2f}% "
                     f"| {q['d_recall']:+.3f} | {q['d_late']:+.4f} | {_agreement(runs, s)} | {_triggered(runs, s)} | "
                     + " | ".join(cells) + f" | {shares} |")
    lines += ["", "\\* of engine time, on the ample pool where it ran, else on the first pool."]
    return "\n".join(lines)


def front_table(settings, quality: dict, pool_runs: dict, pool: str, bound: float) -> tuple[str, Point | None]:
    pts = points(settings, quality, pool_runs)
    front = pareto_front(pts)
    best = best_within(pts, bound)
    by_name = {s.name: s for s in settings}
    full = quality["none"]["text"]
    lines = [f"Pareto front, {pool_name(pool)} (throughput ratio vs text-NLL Δ; {len(front)} of {len(pts)} settings):",
             "", "| setting | text NLL Δ | Δ / full | recall NLL Δ | x none | mean batch | preemptions "
             "| compression share | within 1% |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in front:
        s = by_name[p.name]
        r = pool_runs[s.key]
        mark = ("**best**" if best is not None and p.name == best.name else "yes") if p.cost <= bound else "no"
        lines.append(f"| {p.name} | {p.cost:+.4f} | {100 * p.cost / full:+.2f}% | {quality[s.key]['d_recall']:+.3f} "
                     f"| {p.gain:.2f}x | {r['mean_batch']:.1f} | {r['preemptions']} | {100 * r['comp_share']:.1f}% "
                     f"| {mark} |")
    return "\n".join(lines), best


def plot_pool(settings, quality: dict, pool_runs: dict, pool: str, bound: float, path: Path) -> None:
    """Two panels: throughput ratio vs text-NLL Δ and vs recall-NLL Δ, one point per setting, the front drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(s.method for s in settings))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    markers = {w: mk for w, mk in zip(sorted({s.window for s in settings}), "os^Dvp")}
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, axis, label in ((axes[0], "d_text", "text NLL Δ vs full cache (nats/token)"),
                            (axes[1], "d_recall", "recall NLL Δ vs full cache (nats/token)")):
        for s in settings:
            if s.key in pool_runs and s.key in quality:
                ax.scatter(quality[s.key][axis], pool_runs[s.key]["ratio"], color=colors[s.method],
                           marker=markers.get(s.window, "o"), s=20 + 60 * s.ratio, alpha=0.85)
        front = pareto_front(points(settings, quality, pool_runs, axis))
        if front:
            ax.step([p.cost for p in front], [p.gain for p in front], where="post", color="k", lw=1, label="front")
            for p in front:
                ax.annotate(p.name.replace("W=", "W").replace(" r=", " r"), (p.cost, p.gain), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        if axis == "d_text":
            ax.axvline(bound, color="tab:red", ls="--", lw=1, label="1% of the full cache's text NLL")
        ax.set_xlabel(label)
        ax.set_ylabel(f"output tok/s / none's, {pool_name(pool)}")
        ax.grid(alpha=0.3)
    for m in methods:
        axes[0].scatter([], [], color=colors[m], label=LABELS.get(m, m))
    for w, mk in markers.items():
        axes[0].scatter([], [], color="gray", marker=mk, label=f"|W|={w}")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Throughput vs quality cost, {pool_name(pool)} (marker size: r)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ranked_within(settings, quality: dict, runs: dict, bound: float, pools: list[str]) -> list[tuple[float, object]]:
    """(score, setting) for the settings within the text-NLL bound and measured on every pressured pool, best
    first; score = the geometric mean of the ratios on the pressured pools. A setting measured on the ample pool
    must reach TARGETS['ample'] there (no regression where memory is plenty)."""
    pressured = [p for p in pools if p != "ample"]
    out = []
    for s in settings:
        rs = [runs.get(p, {}).get(s.key) for p in pressured]
        if quality.get(s.key) is None or quality[s.key]["d_text"] > bound or any(r is None for r in rs):
            continue
        amp = runs.get("ample", {}).get(s.key)
        if amp is not None and amp["ratio"] < TARGETS["ample"]:
            continue
        out.append((math.exp(sum(math.log(r["ratio"]) for r in rs) / max(1, len(rs))), s))
    return sorted(out, key=lambda x: (-x[0], x[1].name))


def recommend(settings, quality: dict, runs: dict, bound: float, pools: list[str]):
    """The best setting by `ranked_within`, and the best Kara one: ((score, setting), (score, setting))."""
    ranked = ranked_within(settings, quality, runs, bound, pools)
    kara = [x for x in ranked if x[1].method in ("kara", "kara_default")]
    return (ranked[0] if ranked else (None, None)), (kara[0] if kara else (None, None))


def ample_candidates(settings, quality: dict, runs: list[dict], pressured: list[str]) -> list:
    """The settings worth the ample pool's time once the pressured pools are measured: every point on a front
    (text or recall NLL, each pressured pool), the best within the bound per pool, the three best and the best
    Kara one by `ranked_within`, and the engine default."""
    per_pool = by_pool(runs)
    bound = cost_bound(quality["none"]["text"])
    names = {s.name for s in settings if s.method == "kara_default"}
    for pool in pressured:
        pr = {k: v for k, v in per_pool.get(pool, {}).items() if k is not None}
        for axis in ("d_text", "d_recall"):
            names |= {p.name for p in pareto_front(points(settings, quality, pr, axis))}
        best = best_within(points(settings, quality, pr), bound)
        names |= {best.name} if best else set()
    ranked = ranked_within(settings, quality, per_pool, bound, pressured)
    names |= {s.name for _, s in ranked[:3]}
    names |= {s.name for _, s in [x for x in ranked if x[1].method in ("kara", "kara_default")][:1]}
    return [s for s in settings if s.name in names]


def _none_batch(per_pool: dict, pool: str, output_len: int) -> float | None:
    rs = per_pool.get(pool, {}).get(None, {}).get(output_len, [])
    return sum(r["mean_batch"] for r in rs) / len(rs) if rs else None


def targets_table(settings, quality: dict, per_pool: dict, pools: list[str], bound: float) -> str:
    """Per pool, the best setting within the quality bound against the issue's target, and what holds it back
    where it misses; then the recommended setting (and the best Kara one, and the engine default) on every pool."""
    full = quality["none"]["text"]
    lines = [f"Best setting at a text-NLL cost <= 1% of the full cache's (Δ <= {bound:.4f}):", "",
             "| pool | target | best within the bound | x none | text NLL Δ | met | what holds it back |",
             "|---|---:|---|---:|---:|---|---|"]
    for pool in pools:
        pr = {k: v for k, v in per_pool.get(pool, {}).items() if k is not None}
        pts = points(settings, quality, pr)
        best = best_within(pts, bound)
        target = TARGETS.get(pool, 1.0)
        run = next((pr[s.key] for s in settings if best is not None and s.name == best.name), None)
        held = holdback(best, pts, target, bound, run,
                        None if run is None else _none_batch(per_pool, pool, run["output_len"]), pool == "ample")
        cells = ("-", "-", "-") if best is None else (best.name, f"{best.gain:.2f}x",
                                                     f"{best.cost:+.4f} ({100 * best.cost / full:+.2f}%)")
        ok = best is not None and best.gain >= target
        lines.append(f"| {pool_name(pool)} | {target:g}x | {' | '.join(cells)} | {'yes' if ok else 'no'} "
                     f"| {held or '-'} |")
    (bv, bs), (kv, ks) = recommend(settings, quality, per_pool, bound, pools)
    dflt = next((s for s in settings if s.method == "kara_default"), None)
    lines += ["", "One setting for every pool (within the bound, best geometric mean of its ratios on the pressured "
              "pools, not below 0.98x on the ample pool where measured):", "",
              "| | setting | " + " | ".join(f"x none, {pool_name(p)}" for p in pools) + " | text NLL Δ |",
              "|---|---|" + "---:|" * len(pools) + "---:|"]
    for label, s in (("recommended", bs), ("best Kara", ks), ("today's `--kv-compression kara`", dflt)):
        if s is None:
            why = "not in this sweep" if label.startswith("today") else "none qualifies"
            lines.append(f"| {label} | {why} |" + " |" * (len(pools) + 1))
            continue
        q = quality.get(s.key)
        lines.append(f"| {label} | {s.name} | " + " | ".join(_fmt_ratio(per_pool.get(p, {}).get(s.key)) for p in pools)
                     + f" | {'-' if q is None else format(q['d_text'], '+.4f')} |")
    lines += ["", reading_line(bs, bv, ks, kv, dflt, settings, quality, per_pool, bound, pools)]
    return "\n".join(lines)


def reading_line(bs, bv, ks, kv, dflt, settings, quality, per_pool, bound, pools) -> str:
    """One sentence naming the recommended setting and comparing the best Kara one with today's default."""
    if bs is None:
        return ("Reading: no setting is within the 1% text-NLL bound on every pressured pool without a regression "
                "at the ample pool.")
    out = (f"Reading: within a text-NLL cost of 1% of the full cache's, {bs.name} has the best geometric mean of "
           f"its ratios on the pressured pools ({bv:.2f}).")
    if ks is not None and dflt is not None and ks != dflt:
        ranked = dict((s.name, v) for v, s in ranked_within(settings, quality, per_pool, bound, pools))
        d = ranked.get(dflt.name)
        out += (f" The best Kara setting, {ks.name} ({kv:.2f}), beats today's `--kv-compression kara` default "
                + (f"({d:.2f})" if d is not None else "(not within the bound or not measured on every pool)")
                + ": a candidate for the default.")
    elif ks is not None and ks == dflt:
        out += " Today's `--kv-compression kara` default is the best Kara setting."
    return out


def notes(args, runs: list[dict]) -> str:
    drift = [f"{pool_name(r['pool'])} at {r['output_len']} tokens {100 * r['none_drift']:+.1f}%"
             for r in runs if r["setting"] is None and r.get("which") == "none (first)"]
    ample = ("every setting" if args.ample_for == "all" else
             "only the settings on a front of the pressured pools, the best within the bound, the three best by the "
             "recommendation rule, the best Kara one and the engine default: the ample pool can only show a cost, "
             "and these are the settings one would pick")
    clock = ("wall clock" if getattr(args, "clock", "wall") == "wall" else
             "CPU seconds of each worker (--clock cpu: the machine was shared)")
    return (f"{args.model} ({args.dtype}, CPU, {args.threads} thread(s) per worker, {args.workers} workers; tok/s "
            f"and ratios by {clock}). "
            f"Throughput: {args.oversubscription:g} x N requests per run on the pool for N uncompressed sequences "
            f"(of the 32-token prompt + output), {args.ample_requests} on the ample pool ({ample}), all submitted at "
            f"once, {args.output_per_window} x |W| new tokens each (greedy, ignore_eos), "
            + (f"each setting {args.repeats} times (the median run by tok/s), " if getattr(args, "repeats", 1) > 1
               else "") + f"the offline engine's "
            f"continuous batching (add_request + step); none runs before and after each (|W|, pool) group and the "
            f"ratio's reference is their mean (its drift over the group: " + ", ".join(drift) + "). Settings (named "
            f"'method W=|W| r=r'): "
            f"|U| = |W|/8, period |W| - |U|, Kara α = |W|/32, γ = 8 (4 at |W| < 256); every method keeps Kara's "
            f"⌈r·n⌉+α slots per window (compression_quality's equal-KV rule); query source auto; lossless: Kara "
            f"with `lossless: true`. Quality: {args.trials} compression_quality cases ({args.quality_tokens}-token "
            f"continuation, {args.passage_len}-token passage in the first window of the smallest |W|, repeated at "
            f"the end), the same tokens for every setting, teacher-forced through the engine's compressed cache; "
            f"text NLL: every continuation token but the repeat; recall: the repeat; after 1st round: the text tokens "
            f"scored after the setting's first round. Lossless Kara's Δ is 0 by construction (marked exact); its "
            f"greedy agreement checks it. Greedy agreement: mean tokens to the first divergence from none's output "
            f"of the same prompt (ample pool run where measured), and the share of identical outputs. Requests "
            f"compressed: a lower bound from the windows compressed and the most one output can fill ('?' after a "
            f"recompute preemption).")


def report(args, quality: dict, runs: list[dict], seconds: dict, total: float, write_plots: bool = True):
    """The section's body (tables, plot links, reading, notes, timings) and the plot paths."""
    settings = settings_for(args)
    pools = [str(p) for p in args.pools]
    if getattr(args, "clock", "wall") == "cpu":
        runs = use_cpu_clock(runs)
    per_pool = by_pool(runs)
    bound = cost_bound(quality["none"]["text"])
    parts = [targets_table(settings, quality, per_pool, pools, bound), "",
             main_table(settings, quality, per_pool, pools), ""]
    plots = []
    for pool in pools:
        pr = {k: v for k, v in per_pool.get(pool, {}).items() if k is not None}
        table, _ = front_table(settings, quality, pr, pool, bound)
        png = DOCS.parent / f"pareto_{'ample' if pool == 'ample' else 'pool' + pool}.png"
        if write_plots:
            plot_pool(settings, quality, pr, pool, bound, png)
        plots.append(png)
        parts += [table, "", f"![throughput vs quality, {pool_name(pool)}]({png.name})", ""]
    timing = ", ".join(f"{'quality' if k[0] == 'quality' else f'|W|={k[1]} {pool_name(k[2])}'} {v[0]:.0f} s "
                       f"(CPU {v[1]:.0f} s)" for k, v in seconds.items())
    parts += [notes(args, runs), "",
              f"Wall time {total:.0f} s; per unit, wall (CPU of its process, engine load included): {timing}."]
    return "\n".join(parts), plots


def records_json(quality: dict, runs: list[dict], seconds: dict) -> dict:
    """The raw records as JSON (settings as [method, |W|, r]); `records_from_json` reads them back."""
    return {"quality": {("none" if k == "none" else "|".join(map(str, k))): v for k, v in quality.items()},
            "runs": [{**{k: v for k, v in r.items() if k != "setting"},
                      "setting": None if r["setting"] is None else list(r["setting"].key)} for r in runs],
            "seconds": {"|".join(map(str, k)): v for k, v in seconds.items()}}


def records_from_json(d: dict) -> tuple[dict, list[dict], dict]:
    def key(text: str) -> tuple:
        m, w, r = text.split("|")
        return (m, int(w), float(r))

    quality = {("none" if k == "none" else key(k)): v for k, v in d["quality"].items()}
    runs = [{**r, "setting": None if r["setting"] is None else Setting(r["setting"][0], int(r["setting"][1]),
                                                                      float(r["setting"][2]))} for r in d["runs"]]
    seconds = {tuple(k.split("|")): tuple(v) for k, v in d["seconds"].items()}
    return quality, runs, seconds
