"""The KV dtype axis of the quality bench: compression_quality's cases scored with the KV pages in each dtype, with
and without the engine's default Kara, as increases over the first dtype's full cache.

    python -m bench.quality_kv --kv-cache-dtype float32 int8 fp8_e4m3 fp8_e5m2 [--trials 8] [--no-write]

One engine per KV dtype (SmolLM2, float32 compute), the same trials for all: the scoring is compression_quality's
(`evaluate`: teacher-forced through the engine's own paged cache, Kara's rounds as while decoding). Kara runs at
|W| 512, r = 0.3 (the engine default's window and budget). The table marks the issue's bounds for int8 pages.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.common import write_section
from bench.compression_quality import evaluate
from bench.quality_cases import DEFAULT_WINDOW, case_layout, make_trials
from bench.quality_report import kv_dtype_table

SECTION = "KV dtype and compression quality (teacher-forced NLL, SmolLM2)"
# the quality bounds for 8-bit pages: text-NLL increase over the float32 full cache, % (Kara: the default's)
BOUNDS = {"int8 + none": 0.5, "int8 + kara": 1.5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["float32", "int8", "fp8_e4m3", "fp8_e5m2"],
                    help="KV page dtypes (the first is the reference)")
    ap.add_argument("--kara", nargs="+", default=["default"],
                    help="Kara settings scored beside none: 'default' (the engine's window at r=0.3) or JSON objects "
                         "of window fields and ratio, e.g. the throughput benches' '{\"window\": 64, \"buffer\": 8, "
                         "\"ratio\": 0.25, \"chunk_max\": 4, \"chunk_budget\": 8, \"compression_period\": 56}'")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1184, help="continuation length")
    ap.add_argument("--passage-len", type=int, default=80)
    ap.add_argument("--batch-seqs", type=int, default=56)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine import Engine

    t0 = time.perf_counter()
    lay = case_layout(args.trials, args.max_tokens, args.passage_len, "spread", 2, args.batch_seqs)
    rows, trials = [], None
    for name in args.kv_cache_dtype:
        engine = Engine(model="smollm2", dtype="float32", device="cpu", max_model_len=8192, num_kv_blocks=lay.blocks,
                        max_num_seqs=max(64, lay.seqs), max_num_batched_tokens=max(2048, lay.seqs * 48),
                        kv_cache_dtype=name)
        trials = trials or make_trials(engine.tokenizer, args.trials, filler_len=lay.filler, lead_len=lay.leads,
                                       passage_len=args.passage_len, context_len=32)
        results = []
        for k, setting in enumerate(args.kara):
            kara = {"ratio": 0.3} if setting == "default" else json.loads(setting)
            window = {**DEFAULT_WINDOW, **{f: v for f, v in kara.items() if f != "ratio"}}
            got = evaluate(engine, trials, ["none", "kara"] if k == 0 else ["kara"], [kara["ratio"]], window,
                           batch_seqs=args.batch_seqs)
            if setting != "default":  # named by its window in the table
                got[-1].method = f"Kara W={window['window']}"
            results += got
        rows.append((engine.kv_cache_format, engine.stats().kv_cache_bytes_per_token, results))
        print(f"[{time.perf_counter() - t0:6.0f} s] {name}: " + ", ".join(
            f"{r.method} text NLL {r.text_nll:.4f}" for r in results), file=sys.stderr, flush=True)
        engine.shutdown()
    w = DEFAULT_WINDOW
    body = kv_dtype_table(rows, BOUNDS) + "\n\n" + (
        f"SmolLM2-135M-Instruct (float32 compute), {args.trials} trials of compression_quality's cases (a 32-token "
        f"context, a {lay.cont_len}-token continuation of licence text with a planted passage and its repetition), "
        f"teacher-forced through the engine's paged cache with the KV pages in each dtype: its bytes per cached token "
        f"over all layers (8-bit rows carry a float32 scale per token and KV head), Kara at |W|={w['window']}, "
        f"|U|={w['buffer']}, r=0.3, γ={w['chunk_max']}, α={w['chunk_budget']} (the engine default's window and "
        f"budget). Δ: increase over the {rows[0][0]} full cache. {time.perf_counter() - t0:.0f} s.")
    print(body)
    if not args.no_write:
        write_section(SECTION, "python -m bench.quality_kv " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
