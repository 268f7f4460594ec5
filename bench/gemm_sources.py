"""The packed GEMM's weight sources side by side at a decode step's shapes, in one process.

    .venv/bin/python -m bench.gemm_sources [--rounds 5] [--repeats 10] [--threads 1,2] [--tile best|avx2] [--no-write]

One step's linear layers of the default model (SmolLM2: fused q/k/v, o, fused gate/up, down, x 30 layers, then the
tied LM head), in the order a step runs them, at 1-64 rows, on each weight source packed_linear / block_linear
(csrc/kvllm_cpu.cpp) reads:
- GGUF blocks: the layers `Engine(model="smollm2")` holds at the default settings on this CPU (its .gguf's Q4_1 /
  Q8_0 blocks, dequantized in the kernel);
- float32 panels of the same values (gemm_backend cpu's layers);
- bfloat16 and float16 panels of those values rounded to that dtype (a half-precision model's layers,
  engine/models/packed.py `widen_linears`, widened in the kernel).
The tile is the CPU's best unless `--tile avx2`. Per round, each (rows, threads) times every source in turn, the
order rotated round by round; per source the median over `--repeats` passes (after one warm-up). Reported: the
median over rounds per source and its ratio to the float32 panels (the median of the per-round ratios), in
docs/results/cpu_kernels.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

ROWS = [1, 4, 8, 16, 32, 64]
SOURCES = ["GGUF blocks", "float32 panels", "bfloat16 panels", "float16 panels"]
SECTION = "Half-precision panels"


def layers_of_each_source() -> dict:
    """{source: the step's linear layers in step order} (see the module docstring)."""
    import torch

    from engine import Engine
    from engine.models.gguf_linear import BlockLinear
    from engine.models.packed import PackedLinear

    eng = Engine(model="smollm2", num_kv_blocks=16, max_model_len=128)
    model = eng.core.model
    blocks = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    blocks.append(model.lm_head_layer)
    eng.shutdown()
    assert all(isinstance(b, BlockLinear) for b in blocks[:-1]), "the default engine here keeps the GGUF blocks"
    dense = []
    for b in blocks:
        lin = torch.nn.Linear(b.in_features, b.out_features, bias=b.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(b.weight)
            if b.bias is not None:
                lin.bias.copy_(b.bias)
        dense.append(lin)
    sources = {"GGUF blocks": blocks, "float32 panels": [PackedLinear(lin) for lin in dense]}
    for name, dtype in (("bfloat16 panels", torch.bfloat16), ("float16 panels", torch.float16)):
        layers = []
        for lin in dense:
            half = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
            with torch.no_grad():
                half.weight.copy_(lin.weight.to(dtype).float())
                if lin.bias is not None:
                    half.bias.copy_(lin.bias)
            layers.append(PackedLinear(half, dtype))
        sources[name] = layers
    return sources


def run(threads: list[int], rounds: int, repeats: int, tile: str) -> dict:
    """{(source, rows, threads): [median seconds of one pass, per round]}."""
    import torch

    from engine.attention import cpu_ext

    sources = layers_of_each_source()
    isa = 1 if tile == "avx2" else cpu_ext.load().isa_level()
    for layers in sources.values():
        for layer in layers:
            layer.max_isa = isa
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    names = list(sources)
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for m in ROWS:
            x = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
            for t in threads:
                torch.set_num_threads(t)
                for name in order:
                    times = []
                    for r in range(repeats + 1):
                        t0 = time.perf_counter()
                        for layer in sources[name]:
                            layer(x[layer.in_features])
                        if r:  # the first pass warms up
                            times.append(time.perf_counter() - t0)
                    out.setdefault((name, m, t), []).append(statistics.median(times))
        print(f"round {i + 1} done", file=sys.stderr)
    return out


def table(runs: dict) -> str:
    lines = ["| weight source | rows | threads | one step's linears | float32 panels / source |",
             "|---|---:|---:|---:|---:|"]
    for name in SOURCES:
        for (src, m, t), times in runs.items():
            if src != name:
                continue
            ratio = statistics.median(f / s for f, s in zip(runs[("float32 panels", m, t)], times))
            lines.append(f"| {name} | {m} | {t} | {statistics.median(times) * 1e3:.2f} ms | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tile", choices=["best", "avx2"], default="best")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    from engine.threads import configure_threads

    threads = [int(t) for t in args.threads.split(",")]
    configure_threads(max(threads), wait_policy="passive")
    from bench.common import RESULTS, commit, write_section

    started = time.time()
    runs = run(threads, args.rounds, args.repeats, args.tile)
    note = (f"kvllm {commit()}; one decode step's linear layers of SmolLM2 (30 layers + the tied LM head) in step "
            f"order, `--tile {args.tile}`; per round the median of {args.repeats} passes per source, the sources "
            f"in turn (order rotated by round); the median of {args.rounds} rounds. {time.time() - started:.0f} s.")
    body = table(runs) + "\n\n" + note
    print(body)
    if not args.no_write:
        cmd = f"python -m bench.gemm_sources --rounds {args.rounds}" + ("" if args.tile == "best" else " --tile avx2")
        write_section(SECTION, cmd, body, RESULTS / "cpu_kernels.md")


if __name__ == "__main__":
    main()
