"""The paged-attention kernel on a bfloat16 cache at its two AVX-512 levels, side by side in one run: level 2 widens
each K/V row to float32 and multiplies in float32, level 3 (the default where the CPU has AVX512-BF16) multiplies
the rows as stored with vdpbf16ps, q and the probabilities rounded to bf16 (csrc/kvllm_cpu.cpp, Avx512Bf16).

    python -m bench.attention_isa [--runs 7] [--no-write]

Per row: one decode step's (or prefill chunk's) attention calls over 30 layers' pages (SmolLM2's shapes: 9 query
heads, 3 KV heads, head_dim 64, 16-slot blocks in shuffled order, as a served pool holds them), through
CpuPagedBackend (engine/attention/cpu_paged.py) with max_isa 2 or 3; the median over runs, the sides alternating.
The quality cost is the text-NLL table of bench/quality_kv.py (bfloat16 pages, run on a CPU with AVX512-BF16).
Writes "Attention with AVX512-BF16 dot products" in docs/results/cpu_kernels.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from engine.threads import configure_threads

configure_threads(2)

import torch  # noqa: E402

from bench.common import RESULTS, write_section  # noqa: E402
from engine.attention import cpu_ext  # noqa: E402
from engine.attention.base import build_metadata  # noqa: E402
from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402

SECTION = "Attention with AVX512-BF16 dot products"
HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
# (name, sequences, cached slots each, query tokens each): the matrix's decode batches and a prefill chunk
ROWS = [("decode, chat-mid-p6-c32", 32, 414, 1), ("decode, chat-short-inf-c64", 64, 250, 1),
        ("decode, c8", 8, 300, 1), ("prefill chunk", 4, 512, 512)]


def pages(seqs: int, slots: int, q_len: int, seed: int):
    """30 layers' bf16 pages, the step's metadata (queries are the last q_len slots) and float32 queries."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-slots // BS)
    order = torch.randperm(seqs * per, generator=gen).tolist()
    tables = [order[i * per:(i + 1) * per] for i in range(seqs)]
    meta = build_metadata(tables, [q_len] * seqs, [slots] * seqs, BS, write=False)
    caches = [torch.randn(seqs * per, 2, BS, HKV, D, generator=gen).bfloat16() for _ in range(LAYERS)]
    q = torch.randn(seqs * q_len, HQ, D, generator=gen)
    return meta, caches, q


def step(backend: CpuPagedBackend, meta, caches, q) -> float:
    t0 = time.perf_counter()
    for cache in caches:
        backend.forward(q, None, None, cache, meta, D ** -0.5)
    return time.perf_counter() - t0


def measure(threads: int, runs: int) -> list[dict]:
    torch.set_num_threads(threads)
    out = []
    for name, seqs, slots, q_len in ROWS:
        meta, caches, q = pages(seqs, slots, q_len, seed=seqs)
        sides = {isa: CpuPagedBackend(max_isa=isa) for isa in (2, 3)}
        for b in sides.values():
            b.plan(meta, HQ, HKV, D, torch.float32, torch.bfloat16)
            step(b, meta, caches, q)  # warm
        times = {isa: [] for isa in sides}
        for _ in range(runs):
            for isa, b in sides.items():
                times[isa].append(step(b, meta, caches, q))
        med = {isa: statistics.median(t) for isa, t in times.items()}
        out.append({"row": name, "shape": f"{seqs} x {slots}" + (f", {q_len} new" if q_len > 1 else ""),
                    "threads": threads, "l2": med[2], "l3": med[3]})
        print(f"{threads} thread(s) {name}: level 2 {1e3 * med[2]:.2f} ms, level 3 {1e3 * med[3]:.2f} ms",
              file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if cpu_ext.load().attention_isa_level() < 3:
        sys.exit("this CPU has no AVX512-BF16: only level 2 runs here")
    t0 = time.time()
    rows = measure(1, a.runs) + measure(2, a.runs)
    lines = ["| threads | step | sequences x cached slots | level 2 (float32 math) | level 3 (bf16 dot products) | "
             "level 2 / level 3 |", "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['row']} | {r['shape']} | {1e3 * r['l2']:.2f} ms | {1e3 * r['l3']:.2f} ms | "
                     f"{r['l2'] / r['l3']:.2f}x |")
    body = "\n".join(lines) + (
        f"\n\nOne step's attention calls over {LAYERS} layers' bfloat16 pages (SmolLM2's shapes: {HQ} query heads, "
        f"{HKV} KV heads, head_dim {D}, {BS}-slot blocks in shuffled order), float32 queries, through "
        f"CpuPagedBackend(max_isa=2 or 3); median of {a.runs} runs per side, the sides alternating. Level 3 rounds q "
        f"and the probabilities to bf16 (its quality: the bfloat16 rows of \"KV dtype and compression quality\" in "
        f"docs/benchmarks.md, run on an AVX512-BF16 CPU). {time.time() - t0:.0f} s.")
    print(body)
    if not a.no_write:
        write_section(SECTION, "python -m bench.attention_isa " + " ".join(sys.argv[1:]), body,
                      RESULTS / "cpu_kernels.md")


if __name__ == "__main__":
    main()
