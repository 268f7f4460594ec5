"""Throughput under KV-memory pressure in the paper's regime (arXiv 2607.01237 §3.3): long outputs, pools sized for a
few uncompressed sequences, no compression vs the threshold baseline vs periodic Kara under each scheduling policy.

For each pool (room for 2, 4, 8 uncompressed sequences of prompt + output tokens) and each setting it runs the same
requests (short real-text prompts, long greedy outputs with ignore_eos, every request admitted as soon as the
engine takes it) and reports output tok/s, the mean running batch, preemptions, recomputed tokens, on-demand
rounds and the compression share of engine time. The last rows run on an ample pool (room for every request
uncompressed): none there is what full concurrency is worth, so Kara's gain reads as a fraction of it, and Kara there
shows what compression costs when memory is not short. Public API only.

    python -m bench.compression_throughput [--num-requests 12] [--output-len 768] [--pools 2,4,8] ...
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from bench.common import DOCS, run_requests, text_prompts, write_section
from engine import Engine, SamplingParams

SETTINGS = {  # name -> (engine kwargs, per-request kv_compression key)
    "none": ({"compress_before_preempt": False}, "none"),
    "threshold": ({"compress_before_preempt": False}, "threshold"),
    "kara-preempt-only": ({"compress_before_preempt": False}, "kara"),  # fcfs, no compress-before-preempt
    "kara-fcfs": ({}, "kara"),
    "kara-aware": ({"scheduling_policy": "compression-aware"}, "kara"),
}


def run(args, pool_seqs: int | None, setting: str, compression: dict, concurrency: int, tokenizer_cache: dict):
    seq_len = args.input_len + args.output_len
    per_seq = -(-seq_len // args.block_size)
    num_blocks = pool_seqs * per_seq if pool_seqs else args.num_requests * per_seq
    kwargs, comp_key = SETTINGS[setting]
    engine = Engine(model=args.model, dtype=args.dtype, device="cpu", block_size=args.block_size,
                    num_kv_blocks=num_blocks, max_model_len=seq_len + 1, max_num_batched_tokens=2048,
                    max_num_seqs=args.num_requests, watermark=0.0, preemption_mode=args.preemption_mode, **kwargs)
    if "prompts" not in tokenizer_cache:
        tokenizer_cache["prompts"] = text_prompts(engine.tokenizer, args.num_requests, args.input_len)
    prompts = tokenizer_cache["prompts"]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    run_requests(engine, prompts[:2], warm, 2, prefix="warm")
    engine.reset_stats()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            kv_compression=compression[comp_key])
    running = []
    outs, wall = run_requests(engine, prompts, params, concurrency, prefix="r",
                              on_step=lambda st: running.append(st.num_running))
    engine.check_invariants()
    st = engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * args.output_len
    result = {
        "pool": pool_seqs, "setting": setting, "blocks": num_blocks, "tok_s": tokens / wall, "wall": wall,
        "mean_batch": sum(running) / max(1, len(running)), "preemptions": st.num_preemptions,
        "recomputed": st.recomputed_tokens, "swapped": st.swapped_out_blocks, "rounds": st.compression.rounds,
        "on_demand": st.compression.on_demand_rounds,
        "share": st.compression.seconds / max(st.engine_seconds, 1e-9),
    }
    del engine
    gc.collect()
    return result


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setting in SETTINGS:
        pts = sorted((r["pool"], r["tok_s"]) for r in results if r["setting"] == setting and r["pool"])
        if pts:
            ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=setting)
    for r in results:
        if r["pool"] is None:
            ax.axhline(r["tok_s"], ls=":", color="gray" if r["setting"] == "none" else "black",
                       label=f"{r['setting']}, ample pool")
    ax.set_xlabel("KV pool (room for N uncompressed sequences)")
    ax.set_ylabel("output tok/s")
    ax.set_xticks(sorted({r["pool"] for r in results if r["pool"]}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=768)
    ap.add_argument("--pools", default="2,4,8", help="pool sizes in uncompressed sequences")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--ample-settings", default="none,kara-fcfs", help="settings run on a pool for every request")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--buffer", type=int, default=8)
    ap.add_argument("--period", type=int, default=0, help="compression period (0: window - buffer)")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--chunk-max", type=int, default=4)
    ap.add_argument("--chunk-budget", type=int, default=8)
    ap.add_argument("--threshold-max", type=int, default=0, help="0: match Kara's mean KV per sequence")
    ap.add_argument("--threshold-target", type=int, default=0)
    ap.add_argument("--query-source", default="auto")
    ap.add_argument("--preemption-mode", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    period = args.period or args.window - args.buffer
    kara = {"method": "kara", "window": args.window, "buffer": args.buffer, "ratio": args.ratio,
            "chunk_max": args.chunk_max, "chunk_budget": args.chunk_budget, "compression_period": period,
            "query_source": args.query_source}
    # The threshold baseline gets the same KV budget: it compresses to N = what Kara holds on average over an
    # output (compressed part + half a period of tail) and triggers at C_max = N + one period.
    n = args.window - args.buffer
    kept = min(n, -(-int(args.ratio * n * 1e9) // int(1e9)) + args.chunk_budget)
    mean_kara = args.input_len + int(kept / n * args.output_len / 2) + args.window
    target = args.threshold_target or max(args.window, mean_kara)
    cmax = args.threshold_max or target + period
    compression = {"none": "none", "kara": kara,
                   "threshold": {"method": "threshold", "threshold_max": cmax, "threshold_target": target,
                                 "observation_window": 32}}
    results = []
    cache: dict = {}
    for pool in [int(x) for x in args.pools.split(",")]:
        for setting in args.settings.split(","):
            r = run(args, pool, setting, compression, args.num_requests, cache)
            results.append(r)
            print(f"pool {pool} {setting:26s} {r['tok_s']:6.1f} tok/s  batch {r['mean_batch']:4.1f}  preempt "
                  f"{r['preemptions']:3d} (recomputed {r['recomputed']}, swapped {r['swapped']} blocks)  rounds "
                  f"{r['rounds']} (on demand {r['on_demand']})  compression {100 * r['share']:.1f}%", flush=True)
    # The ample pool holds every request uncompressed: none there is what full concurrency is worth, and Kara there
    # shows what compression costs when memory is not short.
    for setting in args.ample_settings.split(","):
        r = run(args, None, setting, compression, args.num_requests, cache)
        results.append(r)
        print(f"ample pool {setting:26s} {r['tok_s']:6.1f} tok/s  batch {r['mean_batch']:4.1f}  compression "
              f"{100 * r['share']:.1f}%", flush=True)

    lines = ["| pool (uncompressed seqs) | setting | output tok/s | vs none | mean running batch | preemptions "
             "| recomputed tokens | swapped blocks | rounds (on demand) | compression share |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        base = next((x for x in results if x["pool"] == r["pool"] and x["setting"] == "none"), r)
        pool = r["pool"] or f"ample ({args.num_requests})"
        lines.append(f"| {pool} | {r['setting']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x "
                     f"| {r['mean_batch']:.1f} | {r['preemptions']} | {r['recomputed']} | {r['swapped']} "
                     f"| {r['rounds']} ({r['on_demand']}) | {100 * r['share']:.1f}% |")
    body = "\n".join(lines)
    body += (f"\n\n{args.model} ({torch.get_num_threads()} CPU thread(s)), {args.num_requests} requests x "
             f"{args.input_len}-token real-text prompts, {args.output_len} new tokens (greedy, ignore_eos), all "
             f"submitted at once; block size {args.block_size}. kara: |W|={args.window}, |U|={args.buffer}, "
             f"r={args.ratio}, γ={args.chunk_max}, α={args.chunk_budget}, period {period}, query source "
             f"{args.query_source}. threshold: SnapKV, C_max={cmax} -> N={target}. Preemption mode "
             f"{args.preemption_mode}. kara-preempt-only: first-come admission, no compress-before-preempt (the "
             f"old loop); kara-fcfs adds compress-before-preempt; kara-aware also admits by projected peak footprint. The ample rows have a pool for every "
             f"request uncompressed: none there is the throughput full concurrency is worth on this machine.")
    # --no-write leaves docs/ alone: the plot of a trial run goes to build/
    png = (DOCS.parent if not args.no_write else DOCS.parent.parent / "build") / "compression_throughput.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(results, png)
    body += f"\n\n![throughput vs pool size]({png.name})"
    print(body)
    if not args.no_write:
        write_section("Compression throughput under KV pressure (paper's regime)",
                      "python -m bench.compression_throughput " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
