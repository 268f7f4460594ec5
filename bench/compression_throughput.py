"""Throughput under KV-memory pressure: no compression vs the threshold baseline vs periodic Kara.

A KV pool far too small for the load (by default room for 8 uncompressed sequences of prompt + output
tokens); every request generates a long output with ignore_eos; the engine runs with max concurrency
C in --concurrency. For each policy and C it prints output tok/s, the mean running batch, peak blocks used,
preemptions and the share of engine time spent compressing (query recompute + scoring + compaction).

    .venv/bin/python -m bench.compression_throughput [--num-requests 32] [--output-len 512] ...
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import run_requests, text_prompts, write_section  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402


def run_load(engine: Engine, prompts, output_len: int, concurrency: int, kv_compression) -> dict:
    engine.reset_stats()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, kv_compression=kv_compression)
    running, peak_blocks = [], 0

    def sample(st):
        nonlocal peak_blocks
        running.append(st.num_running)
        peak_blocks = max(peak_blocks, st.num_blocks - st.num_free_blocks)

    outs, wall = run_requests(engine, prompts, params, concurrency, prefix=f"c{concurrency}", on_step=sample)
    engine.check_invariants()
    st = engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * output_len
    return {
        "tok_s": tokens / wall, "wall": wall, "mean_batch": sum(running) / max(1, len(running)),
        "peak_blocks": peak_blocks, "preemptions": st.num_preemptions, "rounds": st.compression_rounds,
        "compress_share": st.compression_seconds / max(st.engine_seconds, 1e-9),
        "retention": st.compression_retention,
        # cost of compressing one region token vs engine time per output token without compression: their ratio
        # is the compression time share once every output token gets compressed once (long outputs)
        "compress_ms_per_token": 1e3 * st.compression_seconds / st.compression_tokens_seen
        if st.compression_tokens_seen else None,
        "step_ms_per_token": 1e3 * (st.engine_seconds - st.compression_seconds) / tokens,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--pool-seqs", type=int, default=8, help="the pool holds this many uncompressed sequences")
    ap.add_argument("--concurrency", default="8,16,32")
    ap.add_argument("--policies", default="none,threshold,kara")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--buffer", type=int, default=32)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--chunk-max", type=int, default=8)
    ap.add_argument("--chunk-budget", type=int, default=16)
    ap.add_argument("--threshold-max", type=int, default=512)
    ap.add_argument("--threshold-target", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    seq_len = args.input_len + args.output_len
    num_blocks = args.pool_seqs * -(-seq_len // args.block_size)
    engine = Engine(model=args.model, dtype=args.dtype, device="cpu", block_size=args.block_size,
                    num_kv_blocks=num_blocks, max_model_len=seq_len + 1, max_num_batched_tokens=2048,
                    watermark=0.0)
    prompts = text_prompts(engine.tokenizer, args.num_requests, args.input_len)
    configs = {
        "none": "none",
        "threshold": {"method": "threshold", "threshold_max": args.threshold_max,
                      "threshold_target": args.threshold_target, "observation_window": 32},
        "kara": {"method": "kara", "window": args.window, "buffer": args.buffer, "ratio": args.ratio,
                 "chunk_max": args.chunk_max, "chunk_budget": args.chunk_budget,
                 "compression_period": args.window - args.buffer},
    }
    run_load(engine, prompts[:2], 8, 2, "none")  # warm-up
    results = {}
    for policy in args.policies.split(","):
        for c in [int(x) for x in args.concurrency.split(",")]:
            r = run_load(engine, prompts, args.output_len, c, configs[policy])
            results[(policy, c)] = r
            print(f"{policy:9s} C={c:3d} {r['tok_s']:7.1f} tok/s  batch {r['mean_batch']:5.1f}  peak blocks "
                  f"{r['peak_blocks']}/{num_blocks}  preempt {r['preemptions']}  rounds {r['rounds']}  "
                  f"compress {100 * r['compress_share']:.1f}%", flush=True)

    conc = [int(x) for x in args.concurrency.split(",")]
    lines = ["| policy | max concurrency | output tok/s | vs none | mean running batch | peak blocks | preemptions "
             "| compression rounds | compression time share | retention | compression ms per region token "
             "| other engine ms per output token |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (policy, c), r in results.items():
        base = results.get(("none", c))
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        ret = f"{r['retention']:.2f}" if r["retention"] is not None else "-"
        lines.append(f"| {policy} | {c} | {r['tok_s']:.1f} | {ratio} | {r['mean_batch']:.1f} | {r['peak_blocks']}/{num_blocks} "
                     f"| {r['preemptions']} | {r['rounds']} | {100 * r['compress_share']:.1f}% | {ret} "
                     f"| {_ms(r['compress_ms_per_token'])} | {_ms(r['step_ms_per_token'])} |")
    body = "\n".join(lines)
    body += (f"\n\n{args.model} ({engine.dtype}, {torch.get_num_threads()} CPU thread(s)), {args.num_requests} requests x {args.input_len}-token real-text prompts, "
             f"{args.output_len} new tokens (ignore_eos, greedy); KV pool {num_blocks} blocks x {args.block_size} = room for "
             f"{args.pool_seqs} uncompressed sequences. kara: periodic, |W|={args.window}, |U|={args.buffer}, r={args.ratio}, "
             f"γ={args.chunk_max}, α={args.chunk_budget}, period {args.window - args.buffer}; threshold: SnapKV, C_max={args.threshold_max} -> "
             f"N={args.threshold_target}. Retention = kept / scored tokens of the compressed regions. The last two "
             f"columns predict the compression time share once outputs are long enough that every output token is "
             f"compressed once: share ≈ a / (a + b) for compression cost a per region token and other engine time b "
             f"per output token (≤ 5% needs a ≤ b / 19).")
    kara = [results[("kara", c)]["tok_s"] for c in conc if ("kara", c) in results]
    if kara:
        body += f"\n\nperiodic Kara throughput across concurrency {conc}: " + ", ".join(f"{x:.1f}" for x in kara)
    print(body)
    if not args.no_write:
        write_section("Compression throughput under KV pressure", "python -m bench.compression_throughput " +
                      " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
