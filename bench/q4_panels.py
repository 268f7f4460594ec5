"""SmolLM2's decoder linears on the three kernels the row split can run them on, side by side in one run, by row
count: the GGUF file's blocks in float32 (csrc/kvllm_cpu.cpp block_linear, 1.25 bytes a weight), the 4-bit panels
(csrc/q4_linear.cpp, 0.625 bytes a weight, bf16 dot products on the exact weights) and the bfloat16 panels
(csrc/bf16_linear.cpp, 2 bytes a weight).

    python -m bench.q4_panels [--runs 7] [--threads 2] [--no-write]

Per row count: one forward's 120 linear calls (30 layers x qkv, o, gate/up, down; SmolLM2-135M-Instruct's Q4_1
blocks as the engine loads them, gemm_backend 'gguf'), float32 rows in and out; the median over runs, the kernels
alternating. Picks engine/models/row_split.py's Q4_ROWS: the most rows at which the 4-bit panels still beat the
bf16 panels. Writes "4-bit panels" in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from engine.threads import configure_threads

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--runs", type=int, default=7)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rows", default="1,2,4,8,10,12,14,16,24,32")
ap.add_argument("--no-write", action="store_true")

SECTION = "4-bit panels"


def main() -> None:
    a = ap.parse_args()
    configure_threads(a.threads)
    import torch

    from bench.common import write_section
    from engine.config import EngineConfig
    from engine.models import q4_panels
    from engine.models.bf16_panels import Bf16PanelLinear
    from engine.loader import load_model
    from engine.models.gguf_linear import BlockLinear, block_linears
    from engine.models.q4_panels import Q4PanelLinear
    from engine.models.row_split import Q4_ROWS

    why = q4_panels.available()
    if why is not None:
        sys.exit(f"the 4-bit panels do not run here: {why}")
    t0 = time.time()
    model = block_linears(load_model(EngineConfig(model="smollm2").model_source(), torch.float32,
                                     torch.device("cpu"))[0])
    layers = [m for layer in model.layers for m in layer.modules() if isinstance(m, BlockLinear)]
    kernels = {"blocks": layers, "4-bit panels": [Q4PanelLinear.of(m) for m in layers],
               "bf16 panels": [Bf16PanelLinear(m) for m in layers]}
    assert all(k is not None for k in kernels["4-bit panels"])
    runs_of = {"blocks": lambda lin, x, out: torch.ops.kvllm_cpu.block_linear(x, lin.q_packed, lin.d, lin.m, None,
                                                                               out, lin.max_isa),
               "4-bit panels": lambda lin, x, out: torch.ops.kvllm_cpu.q4_linear(x, lin.w_q4, None, out),
               "bf16 panels": lambda lin, x, out: torch.ops.kvllm_cpu.bf16_linear(x, lin.w_panels, None, out)}
    weight_bytes = {name: sum(b.numel() * b.element_size() for lin in lins for b in lin.buffers())
                    for name, lins in kernels.items()}
    rows_list = [int(r) for r in a.rows.split(",")]
    results = []
    for rows in rows_list:
        gen = torch.Generator().manual_seed(rows)
        xs = {k: torch.randn(rows, k, generator=gen) for k in {m.in_features for m in layers}}
        outs = {n: torch.empty(rows, n) for n in {m.out_features for m in layers}}

        def forward(name: str) -> float:
            run = runs_of[name]
            t = time.perf_counter()
            for lin in kernels[name]:
                run(lin, xs[lin.in_features], outs[lin.out_features])
            return time.perf_counter() - t

        times: dict[str, list[float]] = {name: [] for name in kernels}
        for name in kernels:
            forward(name)  # warm
        for _ in range(a.runs):
            for name in kernels:
                times[name].append(forward(name))
        med = {name: statistics.median(t) for name, t in times.items()}
        results.append((rows, med))
        print(f"{rows} rows: " + ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in med.items()), file=sys.stderr)
    best = max((r for r, med in results if med["4-bit panels"] < med["bf16 panels"]), default=0)
    lines = ["| rows | blocks (float32) | 4-bit panels | bf16 panels | blocks / 4-bit | bf16 / 4-bit |",
             "|---:|---:|---:|---:|---:|---:|"]
    for rows, med in results:
        q4 = med["4-bit panels"]
        lines.append(f"| {rows} | {1e3 * med['blocks']:.2f} ms | {1e3 * q4:.2f} ms | {1e3 * med['bf16 panels']:.2f} ms"
                     f" | {med['blocks'] / q4:.2f}x | {med['bf16 panels'] / q4:.2f}x |")
    mib = {n: b / 2 ** 20 for n, b in weight_bytes.items()}
    body = "\n".join(lines) + (
        f"\n\nSmolLM2-135M-Instruct's 120 decoder linears (Q4_1 blocks), one forward's calls per row count, float32 "
        f"rows in and out, {a.threads} threads; median of {a.runs} runs per kernel, the kernels alternating. Weights "
        f"read per forward: blocks {mib['blocks']:.0f} MiB, 4-bit panels {mib['4-bit panels']:.0f} MiB, bf16 panels "
        f"{mib['bf16 panels']:.0f} MiB. The 4-bit panels beat the bf16 panels up to {best} rows here "
        f"(engine/models/row_split.py Q4_ROWS = {Q4_ROWS}). {time.time() - t0:.0f} s.")
    print(body)
    if not a.no_write:
        write_section(SECTION, "python -m bench.q4_panels " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
