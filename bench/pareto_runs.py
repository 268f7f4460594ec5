"""The two measurements of the throughput/quality sweep (bench/pareto.py) for a list of settings on one engine:
serving throughput on the engine's pool, and teacher-forced quality on the quality bench's cases. Each takes a
built engine, so tests/test_pareto.py runs both on the tiny model."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

from bench.common import run_requests
from bench.compression_quality import evaluate, method_config
from engine import SamplingParams

LABELS = {"none": "none", "kara": "Kara", "rkv": "R-KV", "keydiff": "KeyDiff", "h2o": "H2O", "snapkv": "SnapKV",
          "streaming": "StreamingLLM", "kara_lossless": "Kara lossless", "kara_default": "Kara (engine default)"}
METHODS = ("kara", "rkv", "keydiff", "h2o", "snapkv", "streaming", "kara_lossless")


def window_settings(window: int) -> dict:
    """The window fields at |W|: |U| = |W|/8, period = |W| − |U| (the quality bench's), Kara's α = |W|/32 and
    γ = 8 (4 below |W| = 256): at |W| = 512 exactly the quality bench's paper defaults."""
    buffer = max(1, window // 8)
    return dict(window=window, buffer=buffer, chunk_max=8 if window >= 256 else 4, chunk_budget=window // 32,
                compression_period=window - buffer)


@dataclass(frozen=True)
class Setting:
    """One point of the sweep. ``kara_lossless`` is Kara with ``lossless: true``; ``kara_default`` is what
    ``--kv-compression kara`` runs today (every field at the engine's default; ``window``/``ratio`` are only its
    coordinates)."""
    method: str
    window: int
    ratio: float

    @property
    def name(self) -> str:
        # no "|" in it: names go into markdown table cells (W stands for |W|)
        return f"{LABELS.get(self.method, self.method)} W={self.window} r={self.ratio:g}"

    @property
    def key(self) -> tuple:
        return (self.method, self.window, self.ratio)

    def window_fields(self) -> dict:
        if self.method == "kara_default":
            from compression import KVCompressionConfig

            d = KVCompressionConfig("kara").to_dict()
            return {k: d[k] for k in ("window", "buffer", "chunk_max", "chunk_budget", "compression_period")}
        return window_settings(self.window)

    def engine_method(self) -> str:
        return "kara" if self.method in ("kara_lossless", "kara_default") else self.method

    def config(self):
        """The KVCompressionConfig: equal KV length per window across methods (compression_quality's rule)."""
        if self.method == "kara_default":
            from compression import KVCompressionConfig

            return KVCompressionConfig("kara")
        cfg = method_config(self.engine_method(), self.ratio, self.window_fields())
        return cfg.replace(lossless=True) if self.method == "kara_lossless" else cfg

    def kv(self) -> dict:
        return self.config().to_dict()


def default_setting() -> Setting:
    from compression import KVCompressionConfig

    cfg = KVCompressionConfig("kara")
    return Setting("kara_default", cfg.window, cfg.ratio)


def settings_for(args) -> list[Setting]:
    """The sweep's grid (method x |W| x r, then the engine default with --with-default). Here rather than in the
    runner (bench/pareto.py) because the report needs it too, and the runner imports the report."""
    out = [Setting(m, w, r) for w in args.windows for r in args.ratios for m in args.methods]
    if args.with_default:
        out.append(default_setting())
    return out


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens the two outputs share before they first differ (the common length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def triggered_requests(windows: int, num_requests: int, max_windows: int) -> int:
    """A lower bound on the requests whose compression triggered: each request compresses at most ``max_windows``
    windows (the periodic policy's cap for its output), so ``windows`` compressed windows in all came from at least
    ⌈windows / max_windows⌉ requests. Exact (= all) when every request compressed the cap."""
    if windows <= 0 or max_windows <= 0:
        return 0
    return min(num_requests, math.ceil(windows / max_windows))


def max_windows(output_len: int, fields: dict) -> int:
    """Complete windows one request's output can fill: a round takes n = |W| − |U| tokens off an uncompressed tail
    of at least |W| (prompts are not compressed)."""
    n = fields["window"] - fields["buffer"]
    return max(0, (output_len - fields["buffer"]) // n)


def _one_run(engine, prompts, kv, output_len: int, prefix: str) -> tuple[list[list[int]], dict]:
    engine.reset_stats()
    running: list[int] = []
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, kv_compression=kv)
    cpu = time.process_time()
    outs, wall = run_requests(engine, prompts, params, len(prompts), prefix=prefix,
                              on_step=lambda st: running.append(st.num_running))
    cpu = time.process_time() - cpu
    engine.check_invariants()
    st = engine.stats()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert sum(map(len, tokens)) == len(prompts) * output_len
    return tokens, {
        "tok_s": len(prompts) * output_len / wall, "wall": wall, "cpu": cpu,
        "mean_batch": sum(running) / max(1, len(running)),
        "preemptions": st.num_preemptions, "swapped": st.swapped_out_blocks, "recomputed": st.recomputed_tokens,
        "comp_share": st.compression.seconds / max(st.engine_seconds, 1e-9),
        "verify_share": st.lossless_verify_seconds / max(st.engine_seconds, 1e-9),
        "tokens_seen": st.compression.tokens_seen,
    }


def throughput_runs(engine, prompts: list[list[int]], settings: Sequence[Setting], output_len: int, pool: str,
                    bracket: bool = True, progress=None, repeats: int = 1) -> list[dict]:
    """All ``prompts`` submitted at once under none, then each setting, then none again (``bracket``: the ratio's
    reference is the mean of the two none runs, and their spread is the drift of the machine over the group).
    Greedy, ignore_eos, ``output_len`` new tokens each; the engine's continuous batching (add_request + step).
    With ``repeats`` > 1 each setting runs that many times in a row and its record is the median run by tok/s.
    Returns one record per run: tok/s, its ratio to none, mean running batch, preemptions, compression and
    verification shares, requests that compressed, and greedy agreement with none's outputs."""
    say = progress or (lambda msg: None)
    ref, base = _one_run(engine, prompts, "none", output_len, "none0")
    say(f"pool {pool} none {base['tok_s']:.1f} tok/s ({base['wall']:.0f} s)")
    runs = [dict(base, setting=None, pool=pool, which="none (first)")]
    for s in settings:
        t0 = time.perf_counter()
        tries = sorted((_one_run(engine, prompts, s.kv(), output_len, f"{s.method}{k}") for k in range(repeats)),
                       key=lambda x: x[1]["tok_s"])
        out, r = tries[(len(tries) - 1) // 2]
        r["tok_s_runs"] = [t[1]["tok_s"] for t in tries]
        fields = s.window_fields()
        windows = r.pop("tokens_seen") // (fields["window"] - fields["buffer"])
        div = [first_divergence(a, b) for a, b in zip(out, ref)]
        r.update(setting=s, pool=pool, windows_per_request=windows / len(prompts),
                 triggered=(triggered_requests(windows, len(prompts), max_windows(output_len, fields))
                            if r["recomputed"] == 0 else None),
                 agree_mean=sum(div) / len(div), agree_identical=sum(a == b for a, b in zip(out, ref)) / len(out))
        runs.append(r)
        say(f"pool {pool} {s.name}: {r['tok_s']:.1f} tok/s, batch {r['mean_batch']:.1f}, compression "
            f"{100 * r['comp_share']:.1f}%, agreement {r['agree_mean']:.0f}/{output_len} "
            f"({time.perf_counter() - t0:.0f} s)")
    if bracket:
        _, end = _one_run(engine, prompts, "none", output_len, "none1")
        runs.append(dict(end, setting=None, pool=pool, which="none (last)"))
        say(f"pool {pool} none again {end['tok_s']:.1f} tok/s")
    nones = [r["tok_s"] for r in runs if r["setting"] is None]
    ref_tps = sum(nones) / len(nones)
    for r in runs:
        r["ratio"] = r["tok_s"] / ref_tps
        r["none_drift"] = nones[-1] / nones[0] - 1.0
        r.setdefault("num_requests", len(prompts))
        r["output_len"] = output_len
    return runs


def quality_runs(engine, trials, settings: Sequence[Setting], batch_seqs: int = 56, progress=None) -> dict:
    """Teacher-forced NLL of ``trials`` (compression_quality's cases) for every setting, through the engine's own
    compressed cache, one `evaluate` call per set of window fields. Returns {"none": {...}, setting.key: {...}}:
    text NLL, recall NLL, NLL after the setting's first round, and their Δ against the full cache on the same
    tokens. Lossless Kara is exact by construction (each token's distribution is the full cache's,
    engine/lossless.py), so its Δ is 0; the throughput runs' greedy agreement checks that."""
    from dataclasses import replace

    groups: dict[tuple, dict[str, set[float]]] = {}  # window fields -> engine method -> ratios
    for s in settings:
        if s.method != "kara_lossless":
            fields = tuple(sorted(s.window_fields().items()))
            groups.setdefault(fields, {}).setdefault(s.engine_method(), set()).add(s.ratio)
    none = None
    found = {}
    for fields, methods in groups.items():
        window = dict(fields)
        t0 = time.perf_counter()
        ratios = sorted(set().union(*methods.values()))
        res = evaluate(engine, trials, (["none"] if none is None else []) + list(methods), ratios, window,
                       batch_seqs=batch_seqs)
        if progress:
            progress(f"quality |W|={window['window']} period {window['compression_period']}: {len(res)} runs "
                     f"({time.perf_counter() - t0:.0f} s)")
        for r in res:
            if r.method == "none":
                none = r
            else:
                found[(r.method, fields, r.ratio)] = r
    if none is None:  # only lossless settings: the full cache's NLL is still the reference
        none = evaluate(engine, trials, ["none"], (), window_settings(64), batch_seqs=batch_seqs)[0]
    result = {"none": {"text": none.text_nll, "recall": none.recall_nll}}
    for s in settings:
        if s.method == "kara_lossless":
            r, exact = none, True
        else:
            r, exact = found[(s.engine_method(), tuple(sorted(s.window_fields().items())), s.ratio)], False
        full_late = replace(none, late_from=r.late_from).late_nll  # the same tokens as the setting's late NLL
        result[s.key] = {"text": r.text_nll, "recall": r.recall_nll, "late": r.late_nll, "exact": exact,
                         "d_text": r.text_nll - none.text_nll, "d_recall": r.recall_nll - none.recall_nll,
                         "d_late": r.late_nll - full_late}
    return result
