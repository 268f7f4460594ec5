"""Lossless mode on a memory-limited pool: no compression vs lossy Kara vs lossless Kara (VeriCache-style drafting from
the compressed cache, verification against the full KV kept in host memory), same requests, same engine.

Reports output tok/s, the mean running batch, the acceptance rate (accepted / drafted), drafts accepted per
verification, the verification share of engine time, peak host memory of the full tier, and whether the lossless
outputs equal the uncompressed ones. Public API only.

    python -m bench.lossless [--num-requests 8] [--output-len 384] [--pool-seqs 2] [--methods kara rkv] ...
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import RESULTS, run_requests, text_prompts, write_section
from engine import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=384)
    ap.add_argument("--pool-seqs", type=int, default=2, help="the device pool holds this many uncompressed sequences")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--buffer", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--horizon-max", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=["kara", "rkv"], help="compressed settings to run (kara, rkv)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seq_len = args.input_len + args.output_len
    blocks = args.pool_seqs * -(-seq_len // args.block_size)
    engine = Engine(model=args.model, dtype="float32", device="cpu", block_size=args.block_size, num_kv_blocks=blocks,
                    max_model_len=min(seq_len + 1, blocks * args.block_size), max_num_seqs=args.num_requests, watermark=0.0,
                    lossless_host_memory="4GiB")
    prompts = text_prompts(engine.tokenizer, args.num_requests, args.input_len)
    kara = {"method": "kara", "window": args.window, "buffer": args.buffer, "ratio": args.ratio, "chunk_max": 4,
            "chunk_budget": 8, "compression_period": args.window - args.buffer}
    rkv = {"method": "rkv", "window": args.window, "buffer": args.buffer, "ratio": args.ratio,
           "compression_period": args.window - args.buffer}
    lossless = {"lossless": True, "horizon_max": args.horizon_max}
    settings = {"none": "none", "kara (lossy)": kara, "kara lossless": {**kara, **lossless},
                "rkv lossless": {**rkv, **lossless}}
    settings = {k: v for k, v in settings.items() if k == "none" or k.split()[0] in args.methods}
    run_requests(engine, prompts[:2], SamplingParams(temperature=0, max_tokens=4), 2, prefix="warm")
    rows, outputs = [], {}
    for name, comp in settings.items():
        engine.reset_stats()
        running, host = [], [0]

        def sample(st):
            running.append(st.num_running)
            host[0] = max(host[0], st.full_tier_bytes)

        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, kv_compression=comp)
        outs, wall = run_requests(engine, prompts, params, args.num_requests, prefix=name.replace(" ", "_"), on_step=sample)
        engine.check_invariants()
        st = engine.stats()
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        tokens = sum(len(t) for t in outputs[name])
        rows.append((name, tokens / wall, sum(running) / max(1, len(running)), st))
        print(f"{name:14s} {tokens / wall:6.1f} tok/s  batch {rows[-1][2]:.1f}  preemptions {st.num_preemptions}  "
              f"drafted {st.lossless_drafted} accepted {st.lossless_accepted} verifications "
              f"{st.lossless_verifications}  host {host[0] / 2**20:.0f} MiB", flush=True)
        rows[-1] += (host[0],)
    base = rows[0][1]
    lines = ["| setting | output tok/s | vs none | mean running batch | preemptions | acceptance rate | "
             "accepted per verification | verification share | peak full-tier host memory | output = none |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, tps, batch, st, host in rows:
        rate = f"{st.lossless_accepted / st.lossless_drafted:.2f}" if st.lossless_drafted else "-"
        per = f"{st.lossless_mean_accepted:.1f}" if st.lossless_mean_accepted is not None else "-"
        share = f"{100 * st.lossless_verify_seconds / st.engine_seconds:.0f}%" if st.lossless_verifications else "-"
        same = "yes" if outputs[name] == outputs["none"] else \
            f"no ({sum(a == b for a, b in zip(outputs[name], outputs['none']))}/{len(prompts)} equal)"
        lines.append(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {batch:.1f} | {st.num_preemptions} | {rate} | {per} "
                     f"| {share} | {host / 2**20:.0f} MiB | {same} |")
    body = "\n".join(lines)
    body += (f"\n\n{args.model} fp32, {torch.get_num_threads()} thread(s); {args.num_requests} requests x "
             f"{args.input_len}-token real-text prompts, {args.output_len} greedy tokens (ignore_eos), all at once; "
             f"device pool {blocks} blocks x {args.block_size} = room for {args.pool_seqs} uncompressed sequences. "
             f"Kara: |W|={args.window}, |U|={args.buffer}, r={args.ratio}, γ=4, α=8, period "
             f"{args.window - args.buffer}; R-KV: same window, buffer, r and period (keeps ⌈r·n⌉, no α); lossless "
             f"horizon 2..{args.horizon_max}. \"output = none\": every request's tokens equal the uncompressed run's.")
    print(body)
    if not args.no_write:
        write_section("Lossless mode (draft from the compressed cache, verify against the full cache)",
                      "python -m bench.lossless " + " ".join(sys.argv[1:]), body, RESULTS / "lossless.md")


if __name__ == "__main__":
    main()
