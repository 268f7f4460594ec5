"""Packed float32 GEMM (engine/models/packed.py) vs torch's F.linear (MKL) on SmolLM2's linear shapes.

    .venv/bin/python -m bench.packed_gemm [--threads 1,2] [--batches 1,32,64,256,2048]

Per batch (rows) and thread count: the sum over one forward's linear layers (each shape x its count, + the tied
LM head at decode batch sizes) through F.linear on the dense weight and through PackedLinear on the same weight
with each micro-kernel the CPU has (the AVX2 6 x 16 tile; the AVX-512 8 x 48 tile where AVX-512F exists),
alternating in one process; medians. Also the max abs difference against a float64 reference.
"""
from __future__ import annotations

import argparse
import sys
import time

from engine.threads import configure_threads

configure_threads(1)  # before torch loads: the engine's OpenMP waiting (engine/threads.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import median, timed, write_section  # noqa: E402

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, 30 layers, tied 49152-row LM head
SHAPES = {"qkv": ((576 + 2 * 192, 576), 30), "o": ((576, 576), 30), "gate_up": ((2 * 1536, 576), 30),
          "down": ((576, 1536), 30), "lm_head": ((49152, 576), 1)}


def main() -> None:
    from engine.attention import cpu_ext
    from engine.models.packed import PackedLinear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,32,64,256,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = {}
    for name, ((n, k), count) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False)
        layers[name] = (lin, PackedLinear(lin), count)
    levels = [lv for lv in (1, 2) if lv <= cpu_ext.load().isa_level()]
    names = {1: "packed, AVX2 tile", 2: "packed, AVX-512 tile"}
    rows = ["| rows (batch) | threads | F.linear (MKL) | " + " | ".join(names[lv] for lv in levels)
            + " | speed-up (default packed vs MKL) | max abs diff vs float64 |",
            "|---:|---:|---:|" + "---:|" * len(levels) + "---:|---:|"]
    t_start = time.perf_counter()
    for threads in [int(t) for t in args.threads.split(",")]:
        configure_threads(threads)
        for m in [int(b) for b in args.batches.split(",")]:
            tot_t, tot_p, err = 0.0, {lv: 0.0 for lv in levels}, 0.0
            for name, (lin, packed, count) in layers.items():
                if name == "lm_head" and m > 256:  # prefill computes logits only for its last tokens
                    continue
                x = torch.randn(m, lin.in_features)
                with torch.inference_mode():
                    ref = x.double() @ lin.weight.double().T
                    ts, ps = [], {lv: [] for lv in levels}
                    for _ in range(3):  # alternate the sides
                        ts += timed(lambda: F.linear(x, lin.weight), args.repeats)
                        for lv in levels:
                            packed.max_isa = lv
                            err = max(err, (packed(x).double() - ref).abs().max().item())
                            ps[lv] += timed(lambda: packed(x), args.repeats)
                tot_t += median(ts) * count
                for lv in levels:
                    tot_p[lv] += median(ps[lv]) * count
            best = tot_p[levels[-1]]  # what PackedLinear runs by default: the best level present
            rows.append(f"| {m} | {threads} | {tot_t * 1e3:.1f} ms | "
                        + " | ".join(f"{tot_p[lv] * 1e3:.1f} ms" for lv in levels)
                        + f" | {tot_t / best:.2f}x | {err:.1e} |")
            print(rows[-1], flush=True)
    body = "\n".join(rows) + (
        "\n\nSmolLM2-135M-Instruct's linear shapes (q/k/v fused, o, gate/up fused, down: x 30 layers; + the tied "
        "49152 x 576 LM head for up to 256 rows), float32, random weights and inputs; per layer the median of "
        f"{3 * args.repeats} calls per side, the sides alternating. OpenMP waits as the engine does "
        "(engine/threads.py). "
        f"{time.perf_counter() - t_start:.0f} s.")
    print(body)
    if not args.no_write:
        write_section("Packed float32 GEMM vs torch (MKL)", "python -m bench.packed_gemm " + " ".join(sys.argv[1:]),
                      body)


if __name__ == "__main__":
    main()
