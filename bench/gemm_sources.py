"""The packed GEMM's weight sources at a decode step's shapes, this build against an earlier commit's, build against
build, in one run.

    .venv/bin/python -m bench.gemm_sources --base <rev> [--rounds 3] [--repeats 10] [--no-write]

One step's linear layers of the default model (SmolLM2: fused q/k/v, o, fused gate/up, down, x 30 layers, then the
tied LM head), in the order a step runs them, at 1-64 rows, on each weight source packed_linear / block_linear
(csrc/kvllm_cpu.cpp) reads:
- GGUF blocks: the layers `Engine(model="smollm2")` holds at the default settings on this CPU (its .gguf's Q4_1 /
  Q8_0 blocks, dequantized in the kernel);
- float32 panels of the same values (gemm_backend cpu's layers);
- bfloat16 and float16 panels of those values rounded to that dtype (a half-precision model's layers, widened in
  the kernel), where the side has them.
The tile is the CPU's best unless `--tile avx2`. A kernel change cannot be timed against its predecessor in one
process (one library per source hash), so `<rev>` is checked out into a git worktree under build/gemm_sources/
(sharing this checkout's .venv, building its own kernels) and the same probe (this file, `--probe`, run from this
checkout) imports each side's own engine package, the sides alternating `--rounds` times. Per run: the median over
`--repeats` passes (after one warm-up), each side first in every other round; reported: the median over runs, per
side, and the ratio; on this checkout
also each source's time against the float32 panels'. The float32 panels are a control where the base has the same
panel kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = [1, 4, 8, 16, 32, 64]
SOURCES = ["GGUF blocks", "float32 panels", "bfloat16 panels", "float16 panels"]
SECTION = "Half-precision panels"


def probe(threads: list[int], repeats: int, tile: str) -> dict:
    """Runs with a side's checkout first on sys.path: {"source|rows|threads": median seconds of one pass}."""
    sys.path.insert(0, os.getcwd())
    from engine.threads import configure_threads

    configure_threads(max(threads), wait_policy="passive")
    import torch

    from engine import Engine
    from engine.attention import cpu_ext
    from engine.models.gguf_linear import BlockLinear
    from engine.models.packed import PackedLinear

    eng = Engine(model="smollm2", num_kv_blocks=16, max_model_len=128)
    model = eng.core.model
    blocks = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    blocks.append(model.lm_head_layer)
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
        try:
            layers = []
            for lin in dense:
                with torch.no_grad():
                    lin.weight.copy_(lin.weight.to(dtype).float())
                layers.append(PackedLinear(lin, dtype))
            sources[name] = layers
        except TypeError:  # a build before half panels
            pass
    isa = 1 if tile == "avx2" else cpu_ext.load().isa_level()
    for layers in sources.values():
        for layer in layers:
            layer.max_isa = isa
    g = torch.Generator().manual_seed(0)
    out = {}
    for m in ROWS:
        x = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        for t in threads:
            torch.set_num_threads(t)
            for name, layers in sources.items():
                times = []
                for r in range(repeats + 1):
                    t0 = time.perf_counter()
                    for layer in layers:
                        layer(x[layer.in_features])
                    if r:  # the first pass warms up
                        times.append(time.perf_counter() - t0)
                out[f"{name}|{m}|{t}"] = statistics.median(times)
    eng.shutdown()
    return out


def worktree(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = ROOT / "build" / "gemm_sources" / sha
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    if not (path / ".venv").exists():
        (path / ".venv").symlink_to(ROOT / ".venv")
    return path


def run_side(repo: Path, threads: str, repeats: int, tile: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), str(Path(__file__).resolve()), "--probe",
                          "--threads", threads, "--repeats", str(repeats), "--tile", tile], cwd=repo, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| weight source | rows | threads | base | this checkout | base / this | this: float32 panels / source |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    head = {k: statistics.median(r[k] for r in runs["head"]) for k in runs["head"][0]}
    for name in SOURCES:
        for key in [k for k in head if k.startswith(name + "|")]:
            _, m, t = key.split("|")
            h = head[key]
            base = [r[key] for r in runs["base"] if key in r]
            b = statistics.median(base) if base else None
            f32 = head[f"float32 panels|{m}|{t}"]
            lines.append(f"| {name} | {m} | {t} | {'-' if b is None else f'{b * 1e3:.2f} ms'} | {h * 1e3:.2f} ms "
                         f"| {'-' if b is None else f'{b / h:.2f}x'} | {f32 / h:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="commit whose kernels are the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tile", choices=["best", "avx2"], default="best")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe([int(t) for t in args.threads.split(",")], args.repeats, args.tile)))
        return
    if not args.base:
        ap.error("--base is required")
    base = worktree(args.base)
    started = time.time()
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    for i in range(args.rounds):
        sides = (("base", base), ("head", ROOT))
        for side, repo in sides if i % 2 == 0 else sides[::-1]:  # each side first in every other round
            runs[side].append(run_side(repo, args.threads, args.repeats, args.tile))
            print(f"round {i + 1}: {side} done", file=sys.stderr)
    sys.path.insert(0, str(ROOT))
    from bench.common import commit, write_section

    note = (f"Base {args.base} ({base.name}) vs this checkout ({commit()}); one decode step's linear layers of "
            f"SmolLM2 (30 layers + the tied LM head) in step order, `--tile {args.tile}`; per run the median of "
            f"{args.repeats} passes, then the median of {args.rounds} runs per side, the sides alternating (each first in "
            f"every other round). "
            f"{time.time() - started:.0f} s.")
    body = table(runs) + "\n\n" + note
    print(body)
    if not args.no_write:
        tile = "" if args.tile == "best" else f" --tile {args.tile}"
        write_section(SECTION, f"python -m bench.gemm_sources --base {args.base} --rounds {args.rounds}{tile}", body)


if __name__ == "__main__":
    main()
