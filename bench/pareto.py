"""Throughput at a measured quality cost (issue 28): for none and each compression setting (method x |W| x r) it
measures, on the same settings, serving output tok/s on KV pools for 2 and 4 uncompressed sequences and on an
ample pool, and the teacher-forced quality cost on the quality bench's cases; then draws the Pareto front of
throughput ratio vs NLL increase per pool and names the best setting at <= 1% text-NLL cost.

Throughput: the offline Engine's continuous batching (add_request + step, every request submitted at once,
bench/common.py run_requests), 32-token real-text prompts, greedy outputs with ignore_eos of --output-per-window x
|W| new tokens (2,048 at |W| = 512 by default, about four rounds at every |W|). On the pool for N uncompressed
sequences a run has --oversubscription x N requests (the same pressure on each pool); one engine per (|W|, pool)
runs none, every setting, then none again (the ratio's reference is their mean, their spread the drift). Quality:
compression_quality's cases (real text, a planted passage in the first window, its repetition at the end),
teacher-forced through the engine's compressed cache, the same tokens for every setting: text NLL, recall NLL and
the NLL after the first round, each as the increase over the full cache; greedy agreement: tokens to the first
divergence from none's output of the same prompt.

Budget: compression lets every request of a pressured pool run at once, so a run costs about |W|-proportional
decode steps whatever its request count; the grid's two pressured pools are therefore the bulk of the time. The
ample pool can only show what compression costs, so by default (--ample-for front) it runs after the pressured
pools, for the settings on their fronts, the best within the bound, the best by the recommendation rule and the
engine default, with --ample-requests requests; --ample-for all measures it for every setting. Work units run in
--workers processes (one engine each, one CPU thread each by default), longest first. Public API only for the
throughput runs (the quality runs reuse bench/compression_quality.py).

    python -m bench.pareto                # the whole sweep (tables, plots, reading -> docs/benchmarks.md)
    python -m bench.pareto --quick        # a ~10-minute subset (|W| = 128, r = 0.2 / 0.5, three methods)
    python -m bench.pareto --json runs.json --no-write ...; python -m bench.pareto --from-json runs.json ...
    python -m bench.pareto --clock cpu    # ratios by each worker's CPU seconds, on a machine shared with others
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from bench.pareto_report import ample_candidates, records_from_json, records_json, report, use_cpu_clock
from bench.pareto_runs import METHODS, settings_for

SECTION = "Throughput vs quality: the Pareto front of compression settings"
QUICK = dict(windows=[128], ratios=[0.2, 0.5], methods=["kara", "keydiff", "kara_lossless"], trials=1,
             with_default=False, ample_for="front")


def output_len(args, window: int) -> int:
    return args.output_per_window * window


def num_requests(args, pool: str) -> int:
    """Requests per run: --oversubscription x the pool's uncompressed sequences (the same pressure on every pool),
    --ample-requests on the ample pool."""
    return args.ample_requests if pool == "ample" else max(int(pool) + 1, round(args.oversubscription * int(pool)))


def _groups(settings, pools) -> list[tuple]:
    out = []
    for w in sorted({s.window for s in settings}, reverse=True):  # longest outputs first: a longest-first schedule
        group = [s for s in settings if s.window == w]
        out += [("throughput", w, str(pool), group) for pool in pools]
    return out


def units(args) -> list[tuple]:
    """Phase 1: quality (one unit), then one throughput unit per (|W|, pool). The ample pool joins phase 1 with
    --ample-for all; with --ample-for front it is phase 2 (`ample_units`)."""
    settings = settings_for(args)
    pools = [p for p in args.pools if p != "ample" or args.ample_for == "all"]
    return [("quality", settings)] + _groups(settings, pools)


def ample_units(args, quality: dict, runs: list[dict]) -> list[tuple]:
    """Phase 2 with --ample-for front: the ample pool for the settings a user would pick (report.ample_candidates:
    the fronts of the pressured pools, the best within the quality bound, the engine default)."""
    if "ample" not in args.pools or args.ample_for == "all":
        return []
    runs = use_cpu_clock(runs) if args.clock == "cpu" else runs  # pick by the ratios the report will show
    return _groups(ample_candidates(settings_for(args), quality, runs, [p for p in args.pools if p != "ample"]),
                   ["ample"])


def kv_pool_scale(args) -> float:
    """Blocks of --kv-cache-dtype pages in the bytes of one block of model-dtype pages: a pool 'for N uncompressed
    sequences' is N sequences' bytes at the model dtype whatever the KV dtype (scales counted)."""
    import torch

    from paging.kv_format import kv_format

    fmt, base = kv_format(args.kv_cache_dtype, getattr(torch, args.dtype)), kv_format("auto", getattr(torch, args.dtype))
    return base.row_bytes(64) / fmt.row_bytes(64)  # head_dim of SmolLM2; the ratio barely depends on it


def _engine(args, blocks: int, max_len: int, num_seqs: int, pool: bool = False):
    from engine import Engine

    if pool and getattr(args, "kv_cache_dtype", "auto") != "auto":  # a pressured pool: the same bytes at any KV dtype
        blocks = int(blocks * kv_pool_scale(args))
    return Engine(model=args.model, dtype=args.dtype, device="cpu", block_size=16, num_kv_blocks=blocks,
                  max_model_len=max_len, max_num_batched_tokens=2048, max_num_seqs=num_seqs, watermark=0.0,
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def run_unit(args, unit) -> tuple[tuple, object, tuple[float, float]]:
    """Runs in a worker process: builds its engine, returns (unit id, records, (wall, CPU) seconds)."""
    from engine.threads import configure_threads

    configure_threads(args.threads)  # the wait policy came with the environment (main sets it before spawning)
    t0, c0 = time.perf_counter(), time.process_time()
    tag = unit[0] if unit[0] == "quality" else f"|W|={unit[1]} pool {unit[2]}"
    say = lambda msg: print(f"[{time.perf_counter() - t0:6.0f} s] {tag}: {msg}", file=sys.stderr, flush=True)  # noqa
    if unit[0] == "quality":
        uid, res = ("quality",), _quality_unit(args, unit[1], say)
    else:
        _, window, pool, settings = unit
        uid, res = ("throughput", window, str(pool)), _throughput_unit(args, window, str(pool), settings, say)
    return uid, res, (time.perf_counter() - t0, time.process_time() - c0)


def _quality_unit(args, settings, say) -> dict:
    from bench.compression_quality import make_trials, spread_leads
    from bench.pareto_runs import quality_runs

    region = min(s.window_fields()["window"] - s.window_fields()["buffer"] for s in settings)
    cont = args.quality_tokens
    seqs = min(args.batch_seqs, args.trials * (1 + len(settings)))
    eng = _engine(args, seqs * -(-(32 + cont + 16) // 16) + 16, 32 + cont + 16, max(64, seqs))
    # one set of cases for every |W|: the passage inside the first window of the smallest |W|, so every setting
    # is scored on the same tokens and the full cache's NLL is one number
    leads = spread_leads(args.trials, region, args.passage_len)
    trials = make_trials(eng.tokenizer, args.trials, filler_len=cont - 2 * args.passage_len - max(leads),
                         lead_len=leads, passage_len=args.passage_len, context_len=32)
    return quality_runs(eng, trials, settings, batch_seqs=args.batch_seqs, progress=say)


def _throughput_unit(args, window: int, pool: str, settings, say) -> list[dict]:
    from bench.common import run_requests, text_prompts
    from bench.pareto_runs import throughput_runs
    from engine import SamplingParams

    out_len = output_len(args, window)
    per_seq = -(-(32 + out_len) // 16)
    num = num_requests(args, pool)
    eng = _engine(args, per_seq * (num if pool == "ample" else int(pool)), 32 + out_len + 1, num,
                  pool=pool != "ample")
    prompts = text_prompts(eng.tokenizer, num, 32)
    run_requests(eng, prompts[:2], SamplingParams(temperature=0, max_tokens=4), 2, prefix="warm")
    return throughput_runs(eng, prompts, settings, out_len, pool, bracket=not args.no_bracket, progress=say,
                           repeats=args.repeats)


def sweep(args) -> tuple[dict, list[dict], dict]:
    """Runs every unit over the workers (phase 2 after phase 1); returns (quality, throughput records, (wall, CPU)
    seconds per unit)."""
    quality, runs, seconds = {}, [], {}

    def collect(results):
        nonlocal quality
        for uid, res, secs in results:
            seconds[uid] = secs
            if uid[0] == "quality":
                quality = res
            else:
                runs.extend(res)

    if args.workers <= 1:
        collect([run_unit(args, u) for u in units(args)])
        collect([run_unit(args, u) for u in ample_units(args, quality, runs)])
        return quality, runs, seconds
    # a fresh process per unit: its engine's memory is returned before the next unit starts
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), max_tasks_per_child=1) as ex:
        collect([f.result() for f in [ex.submit(run_unit, args, u) for u in units(args)]])
        collect([f.result() for f in [ex.submit(run_unit, args, u) for u in ample_units(args, quality, runs)]])
    return quality, runs, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV pages of every run (e.g. int8): the KV dtype axis; the pressured pools keep the bytes of "
                         "N model-dtype sequences, so an 8-bit run holds more tokens; its section is its own")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help=f"default: {' '.join(METHODS)}")
    ap.add_argument("--windows", type=int, nargs="+", default=[128, 256, 512], help="|W| values")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.3, 0.5])
    ap.add_argument("--pools", nargs="+", default=["2", "4", "ample"],
                    help="pools in uncompressed sequences of prompt + output, and/or 'ample' (room for every request)")
    ap.add_argument("--oversubscription", type=float, default=2.0,
                    help="requests per run on the pool for N uncompressed sequences = this x N (at least N + 1)")
    ap.add_argument("--ample-requests", type=int, default=2, help="requests per run on the ample pool")
    ap.add_argument("--ample-for", choices=("front", "all"), default="front",
                    help="settings measured on the ample pool: every one, or (after the pressured pools) those on "
                         "their fronts, the best within the quality bound and the engine default")
    ap.add_argument("--output-per-window", type=int, default=4, help="new tokens per request = this x |W|")
    ap.add_argument("--trials", type=int, default=3, help="quality cases (passage/filler pairs)")
    ap.add_argument("--quality-tokens", type=int, default=1184, help="continuation length of a quality case")
    ap.add_argument("--passage-len", type=int, default=80)
    ap.add_argument("--batch-seqs", type=int, default=32, help="quality sequences in the engine at once")
    ap.add_argument("--no-default", dest="with_default", action="store_false",
                    help="leave out the point of today's `--kv-compression kara` (engine defaults)")
    ap.add_argument("--no-bracket", action="store_true", help="measure none once per group, not before and after")
    ap.add_argument("--repeats", type=int, default=1, help="runs per setting and pool; the median by tok/s is kept")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one engine each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--quick", action="store_true", help="a ~10-minute subset: " + json.dumps(QUICK))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="tok/s by wall clock (serving throughput, default) or by each worker's CPU seconds (a "
                         "machine shared with other work, where wall time swings with the load)")
    ap.add_argument("--json", help="also write the raw records here")
    ap.add_argument("--from-json", help="no runs: rebuild the report from records saved by --json (same flags)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the workers, whose OpenMP starts fresh

    t0 = time.perf_counter()
    # the command that reproduces the numbers: the sweep's own flags, without the output-only ones
    command = "python -m bench.pareto " + " ".join(_sweep_argv(sys.argv[1:]))
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        quality, runs, seconds = records_from_json(saved)
        total = saved.get("total", float("nan"))
        command = saved.get("command", command)
        if args.clock != "wall":
            command += f" --clock {args.clock}"
    else:
        quality, runs, seconds = sweep(args)
        total = time.perf_counter() - t0
    body, _ = report(args, quality, runs, seconds, total, write_plots=not args.no_write)
    print(body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**records_json(quality, runs, seconds), "total": total, "command": command}, f, indent=1)
    if not args.no_write:
        from bench.common import write_section

        write_section(SECTION if args.kv_cache_dtype == "auto" else f"{SECTION}, KV pages {args.kv_cache_dtype}",
                      command.strip(), body)


def _sweep_argv(argv: list[str]) -> list[str]:
    """argv without --json/--from-json PATH and --no-write (they change where results go, not the results)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--from-json"):
            skip = True
        elif a != "--no-write" and not a.startswith(("--json=", "--from-json=")):
            out.append(a)
    return out

if __name__ == "__main__":
    main()
