"""SmolLM2's linears on the three kernels the row split can run them on, side by side in one run, by row count: the
GGUF file's blocks in float32 (csrc/kvllm_cpu.cpp block_linear, 1.25 bytes a weight), the quantized panels
(csrc/quant_panels.cpp: bf16 dot products on the exact weights, 0.625 bytes a weight for 4-bit blocks, 1.06 for
8-bit) and the bfloat16 panels (csrc/bf16_linear.cpp, 2 bytes a weight).

    python -m bench.quant_panels [--runs 7] [--threads 2] [--rows 1,2,4,...] [--no-write]

Two groups, as SmolLM2-135M-Instruct's GGUF holds them and the engine loads them (gemm_backend 'gguf'): the 120
decoder linears (30 layers x qkv, o, gate/up, down; Q4_1 blocks, 4-bit panels) and the LM head (the tied
embedding's Q8_0 blocks, 8-bit panels). Per row count: one forward's calls of the group, float32 rows in and out;
the median over runs, the kernels alternating. Picks engine/models/row_split.py's PANEL_ROWS: the most rows at
which the quantized panels still beat the bf16 panels. Writes "Quantized panels" in docs/benchmarks.md.
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
ap.add_argument("--rows", default="1,2,4,6,8,10,12,14,16,24,32")
ap.add_argument("--no-write", action="store_true")

SECTION = "Quantized panels"
KERNELS = ("blocks", "quantized panels", "bf16 panels")


def main() -> None:
    a = ap.parse_args()
    configure_threads(a.threads)
    import torch

    from bench.common import write_section
    from engine.config import EngineConfig
    from engine.loader import load_model
    from engine.models import quant_panels
    from engine.models.bf16_panels import Bf16PanelLinear
    from engine.models.gguf_linear import BlockLinear, block_linears
    from engine.models.quant_panels import QuantPanelLinear
    from engine.models.row_split import PANEL_ROWS

    why = quant_panels.available()
    if why is not None:
        sys.exit(f"the quantized panels do not run here: {why}")
    t0 = time.time()
    model = block_linears(load_model(EngineConfig(model="smollm2").model_source(), torch.float32,
                                     torch.device("cpu"))[0])
    groups = {"decoder linears": [m for layer in model.layers for m in layer.modules() if isinstance(m, BlockLinear)],
              "LM head": [model.lm_head_layer]}
    ops = torch.ops.kvllm_cpu
    run = {"blocks": lambda lin, x, out: ops.block_linear(x, lin.q_packed, lin.d, lin.m, None, out, lin.max_isa),
           "quantized panels": lambda lin, x, out: ops.quant_panel_linear(x, lin.w_panels, None, out),
           "bf16 panels": lambda lin, x, out: ops.bf16_linear(x, lin.w_panels, None, out)}
    rows_list = [int(r) for r in a.rows.split(",")]
    tables = []
    for group, layers in groups.items():
        kernels = {"blocks": layers, "quantized panels": [QuantPanelLinear.of(m) for m in layers],
                   "bf16 panels": [Bf16PanelLinear(m) for m in layers]}
        assert all(k is not None for k in kernels["quantized panels"]), group
        bits = {k.bits for k in kernels["quantized panels"]}.pop()
        mib = {name: sum(b.numel() * b.element_size() for lin in lins for b in lin.buffers()) / 2 ** 20
               for name, lins in kernels.items()}
        results = []
        for rows in rows_list:
            gen = torch.Generator().manual_seed(rows)
            xs = {k: torch.randn(rows, k, generator=gen) for k in {m.in_features for m in layers}}
            outs = {n: torch.empty(rows, n) for n in {m.out_features for m in layers}}

            def forward(name: str) -> float:
                t = time.perf_counter()
                for lin in kernels[name]:
                    run[name](lin, xs[lin.in_features], outs[lin.out_features])
                return time.perf_counter() - t

            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            for name in KERNELS:
                forward(name)  # warm
            for _ in range(a.runs):
                for name in KERNELS:
                    times[name].append(forward(name))
            med = {name: statistics.median(t) for name, t in times.items()}
            results.append((rows, med))
            print(f"{group}, {rows} rows: " + ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in med.items()),
                  file=sys.stderr)
        best = max((r for r, med in results if med["quantized panels"] < med["bf16 panels"]), default=0)
        lines = [f"**{group}** ({len(layers)} {'layers' if len(layers) > 1 else 'layer'}, {bits}-bit panels; weights "
                 f"read per call: blocks {mib['blocks']:.0f} MiB, {bits}-bit panels {mib['quantized panels']:.0f} "
                 f"MiB, bf16 panels {mib['bf16 panels']:.0f} MiB; the {bits}-bit panels beat the bf16 panels up to "
                 f"{best} rows here, the row split keeps them up to {PANEL_ROWS[bits]}):", "",
                 f"| rows | blocks (float32) | {bits}-bit panels | bf16 panels | blocks / {bits}-bit | "
                 f"bf16 / {bits}-bit |", "|---:|---:|---:|---:|---:|---:|"]
        for rows, med in results:
            qp = med["quantized panels"]
            lines.append(f"| {rows} | {1e3 * med['blocks']:.2f} ms | {1e3 * qp:.2f} ms | "
                         f"{1e3 * med['bf16 panels']:.2f} ms | {med['blocks'] / qp:.2f}x | "
                         f"{med['bf16 panels'] / qp:.2f}x |")
        tables.append("\n".join(lines))
    body = "\n\n".join(tables) + (
        f"\n\nSmolLM2-135M-Instruct's GGUF (Q4_1 decoder linears, Q8_0 tied LM head), one forward's calls of each "
        f"group per row count, float32 rows in and out, {a.threads} threads; median of {a.runs} runs per kernel, the "
        f"kernels alternating. {time.time() - t0:.0f} s.")
    print(body)
    if not a.no_write:
        write_section(SECTION, "python -m bench.quant_panels " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
