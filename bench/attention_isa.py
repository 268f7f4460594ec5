"""The paged-attention kernel at its two AVX-512 levels, side by side in one run, on bfloat16 and on int8 pages:
level 2 widens each K/V row to float32 and multiplies in float32; level 3 (the default where the CPU has
AVX512-BF16) multiplies the rows as stored: bfloat16 pages with vdpbf16ps, q and the probabilities rounded to bf16
(csrc/kvllm_cpu.cpp, Avx512Bf16), int8 pages with vpdpwssd where the CPU also has AVX512-VNNI, q and the
probabilities as int16 (Avx512I8).

    python -m bench.attention_isa [--runs 7] [--no-write]

Per row: one decode step's (or prefill chunk's) attention calls over 30 layers' pages (SmolLM2's shapes: 9 query
heads, 3 KV heads, head_dim 64, 16-slot blocks in shuffled order, as a served pool holds them), through
CpuPagedBackend (engine/attention/cpu_paged.py) with max_isa 2 or 3; the median over runs, the sides alternating.
int8 pages are written by the format's own quantizer (paging/kv_format.py: K rows rotated, a scale per row). The
quality cost of bf16 rounding is the text-NLL table of bench/quality_kv.py (bfloat16 pages, run on a CPU with
AVX512-BF16); the int16 rounding's is bounded by tests/test_kv_8bit.py.
Writes "Attention on the stored values' dot products (bf16, int8)" in docs/results/cpu_kernels.md.
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
from paging.kv_format import kv_format  # noqa: E402

SECTION = "Attention on the stored values' dot products (bf16, int8)"
HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
# (name, sequences, cached slots each, query tokens each): the matrix's decode batches and a prefill chunk
ROWS = [("decode, chat-mid-p6-c32", 32, 414, 1), ("decode, chat-short-inf-c64", 64, 250, 1),
        ("decode, c8", 8, 300, 1), ("prefill chunk", 4, 512, 512)]


def page(x: torch.Tensor, kv: str) -> torch.Tensor:
    """One layer's float pages [blocks, 2, BS, HKV, D] in the `kv` format's storage."""
    fmt = kv_format(kv, torch.float32)
    return torch.stack([fmt.quantize(x[:, 0], keys=True), fmt.quantize(x[:, 1])], dim=1)


def pages(seqs: int, slots: int, q_len: int, seed: int, kv: str = "bfloat16"):
    """30 layers' pages, the step's metadata (queries are the last q_len slots) and float32 queries."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-slots // BS)
    order = torch.randperm(seqs * per, generator=gen).tolist()
    tables = [order[i * per:(i + 1) * per] for i in range(seqs)]
    meta = build_metadata(tables, [q_len] * seqs, [slots] * seqs, BS, write=False)
    caches = [page(torch.randn(seqs * per, 2, BS, HKV, D, generator=gen), kv) for _ in range(LAYERS)]
    q = torch.randn(seqs * q_len, HQ, D, generator=gen)
    return meta, caches, q


def step(backend: CpuPagedBackend, meta, caches, q) -> float:
    t0 = time.perf_counter()
    for cache in caches:
        backend.forward(q, None, None, cache, meta, D ** -0.5)
    return time.perf_counter() - t0


def measure(threads: int, runs: int, kv: str) -> list[dict]:
    torch.set_num_threads(threads)
    out = []
    for name, seqs, slots, q_len in ROWS:
        meta, caches, q = pages(seqs, slots, q_len, seed=seqs, kv=kv)
        sides = {isa: CpuPagedBackend(max_isa=isa) for isa in (2, 3)}
        for b in sides.values():
            b.plan(meta, HQ, HKV, D, torch.float32, caches[0].dtype)
            step(b, meta, caches, q)  # warm
        times = {isa: [] for isa in sides}
        for _ in range(runs):
            for isa, b in sides.items():
                times[isa].append(step(b, meta, caches, q))
        med = {isa: statistics.median(t) for isa, t in times.items()}
        out.append({"row": name, "shape": f"{seqs} x {slots}" + (f", {q_len} new" if q_len > 1 else ""),
                    "threads": threads, "kv": kv, "l2": med[2], "l3": med[3]})
        print(f"{threads} thread(s) {kv} {name}: level 2 {1e3 * med[2]:.2f} ms, level 3 {1e3 * med[3]:.2f} ms",
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
    kinds = ["bfloat16"] + (["int8"] if cpu_ext.load().int8_dot_attention() else [])
    rows = [r for kv in kinds for r in measure(1, a.runs, kv) + measure(2, a.runs, kv)]
    lines = ["| pages | threads | step | sequences x cached slots | level 2 (float32 math) | level 3 (dot products "
             "of the stored values) | level 2 / level 3 |", "|---|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kv']} | {r['threads']} | {r['row']} | {r['shape']} | {1e3 * r['l2']:.2f} ms | "
                     f"{1e3 * r['l3']:.2f} ms | {r['l2'] / r['l3']:.2f}x |")
    body = "\n".join(lines) + (
        f"\n\nOne step's attention calls over {LAYERS} layers' pages (SmolLM2's shapes: {HQ} query heads, "
        f"{HKV} KV heads, head_dim {D}, {BS}-slot blocks in shuffled order), float32 queries, through "
        f"CpuPagedBackend(max_isa=2 or 3); median of {a.runs} runs per side, the sides alternating. int8 pages: "
        f"the format's own rows (K rotated, a float32 scale per row). Level 3 rounds q and the probabilities to bf16 "
        f"on bfloat16 pages (its quality: the bfloat16 rows of \"KV dtype and compression quality\" in "
        f"docs/benchmarks.md, run on an AVX512-BF16 CPU) and to int16 on int8 pages (vpdpwssd; "
        f"{'run' if 'int8' in kinds else 'not run: no AVX512-VNNI'} here). {time.time() - t0:.0f} s.")
    print(body)
    if not a.no_write:
        write_section(SECTION, "python -m bench.attention_isa " + " ".join(sys.argv[1:]), body,
                      RESULTS / "cpu_kernels.md")


if __name__ == "__main__":
    main()
