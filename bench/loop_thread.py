"""Where the engine is built against where it steps: tokens/s of one workload with the engine built and stepped on
the main thread, built there and stepped on its loop thread (`start()`), and built on its loop thread
(`Engine.on_loop_thread`, what `kvllm serve` does), each under passive OpenMP waiting with and without the short
spin (engine/threads.py).

    python -m bench.loop_thread [--max-tokens 1024] [--threads 2]

The workload is the memory-limited rows' (bench/vs_vllm.py): 8 real-text prompts of 32 tokens, greedy, int8 KV
pages, 376 blocks of 16, the default `--kv-compression kara`. Each setting runs in its own interpreter (libgomp reads
its wait policy when torch is imported); the settings alternate over --repeats rounds, and medians are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import write_section

SECTION = "Engine loop thread"
MODES = {"main": "built and stepped on the main thread", "thread": "built on the main thread, stepped on start()'s "
         "thread", "own": "built and stepped on its loop thread (Engine.on_loop_thread)"}


def child(mode: str, max_tokens: int, threads: int) -> None:
    from engine.threads import configure_threads

    configure_threads(threads)
    from bench.common import text_prompts
    from engine import Engine, SamplingParams

    kw = dict(max_model_len=1601, max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False,
              block_size=16, kv_cache_dtype="int8", num_kv_blocks=376)
    if mode == "own":
        engine = Engine.on_loop_thread(**kw)
    else:
        engine = Engine(**kw)
        if mode == "thread":
            engine.start()
    prompts = text_prompts(engine.tokenizer, 8, 32, seed=6)
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_compression="kara")
    t = time.perf_counter()
    outs = engine.generate(prompts, p, use_tqdm=False)
    dt = time.perf_counter() - t
    engine.shutdown()
    engine.check_invariants()
    print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.max_tokens, args.threads)
    t0 = time.perf_counter()
    spins = {"passive, spin 1500 (engine/threads.py's default)": "1500", "passive, no spin": "0"}
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for spin_name, spin in spins.items():
            for mode in MODES:
                env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": spin}
                out = subprocess.run([sys.executable, "-m", "bench.loop_thread", "--child", mode, "--max-tokens",
                                      str(args.max_tokens), "--threads", str(args.threads)], env=env, check=True,
                                     capture_output=True, text=True).stdout
                got.setdefault((spin_name, mode), []).append(json.loads(out.strip().splitlines()[-1])["tok_s"])
                print(f"[{time.perf_counter() - t0:5.0f} s] {spin_name} / {mode}: {got[spin_name, mode][-1]:.1f}",
                      file=sys.stderr, flush=True)
    lines = ["| OpenMP waiting | engine | output tok/s (median) | vs built and stepped on the main thread |",
             "|---|---|---:|---:|"]
    for spin_name in spins:
        base = statistics.median(got[spin_name, "main"])
        for mode, text in MODES.items():
            m = statistics.median(got[spin_name, mode])
            lines.append(f"| {spin_name} | {text} | {m:.1f} | {m / base:.2f}x |")
    body = "\n".join(lines) + "\n\n" + (
        f"SmolLM2 (the default dtype), {args.threads} threads, 8 prompts of 32 real-text tokens, {args.max_tokens} new "
        f"tokens each, greedy, int8 KV pages in 376 blocks of 16, the default `--kv-compression kara`; "
        f"{args.repeats} rounds, settings alternating, each in its own interpreter. GNU OpenMP keeps a worker pool "
        f"per thread that opens parallel regions: an engine built on one thread and stepped on another has two, and "
        f"with more pool threads than cores libgomp cuts its spin to a short throttled one, so every parallel region "
        f"wakes its worker through the kernel. {time.perf_counter() - t0:.0f} s.")
    print(body)
    if not args.no_write:
        write_section(SECTION, "python -m bench.loop_thread " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
