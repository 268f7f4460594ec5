"""A CPU kernel of this checkout against the same kernel of another commit, build against build: the paged
attention (default) or the packed float32 linear.

    .venv/bin/python -m bench.kernel_ab --base <rev> [--kernel attention|linear] [--rounds 3] [--no-write]

A kernel change cannot be timed against its predecessor in one process (one library per source hash), so this
checks `<rev>` out into a git worktree under build/kernel_ab/ (sharing this checkout's .venv; its kernel builds
into its own build/) and runs the same probe (this file, `--probe`) against each side's own engine package,
alternating the sides `--rounds` times. The probe times one attention layer call of decode tokens through the
public backend API (engine.attention.get_backend('cpu'), build_metadata, paging.kv_cache.KVCache, so K/V sit in
the engine's huge-page pool), K/V write included, cycling over 8 layers' pages so K/V come from memory as in a
real step; the median over repeats per run, then the median over runs per side. Shapes: SmolLM2's attention
(9 query / 3 KV heads, head_dim 64, float32, block size 16, shuffled block tables); 64 sequences at ~256 / ~512
slots (the offline workloads) and a few long sequences (the memory-limited workload's batch).

`--kernel linear` times one decode step's linear layers in order through the side's PackedLinear
(engine/models/packed.py) at SmolLM2's shapes (fused q/k/v, o, fused gate/up, down, x 30 layers, then the tied
49152-row LM head; random float32 weights, ~540 MB, so each pass streams them from DRAM as a step does), at 1, 6,
16 and 64 rows, with each tile the CPU has (max_isa 1: AVX2, 2: AVX-512).
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
SHAPES = [(64, 256), (64, 512), (6, 1024), (3, 1536)]  # (decode sequences, ~KV slots each)
LAYERS = 8  # distinct layers' pages cycled, so K/V come from memory
# SmolLM2-135M's linears, [out, in] x count: q/k/v fused, o, gate/up fused, down; the tied LM head last
LINEARS = [((576 + 2 * 192, 576), 30), ((576, 576), 30), ((2 * 1536, 576), 30), ((576, 1536), 30), ((49152, 576), 1)]
ROWS = [1, 6, 16, 64]


def probe_linear(threads: list[int], repeats: int) -> dict:
    """Runs inside one side's checkout: {"rows, tile|threads": median seconds of one step's linears}."""
    sys.path.insert(0, os.getcwd())
    from engine.threads import configure_threads

    configure_threads(1, wait_policy="passive")
    import torch

    from engine.attention import cpu_ext
    from engine.models.packed import PackedLinear

    g = torch.Generator().manual_seed(0)
    layers = []
    for (n, k), count in LINEARS[:-1]:
        for _ in range(count):
            lin = torch.nn.Linear(k, n, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
            layers.append(PackedLinear(lin))
    order = [layers[i + 30 * j] for i in range(30) for j in range(4)]  # layer by layer, as a step runs them
    (n, k), _ = LINEARS[-1]
    head = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
    order.append(PackedLinear(head))
    tiles = {1: "AVX2"} | ({2: "AVX-512"} if cpu_ext.load().isa_level() >= 2 else {})
    out = {}
    for isa, tile in tiles.items():
        for layer in order:
            layer.max_isa = isa
        for m in ROWS:
            x = {576: torch.randn(m, 576, generator=g), 1536: torch.randn(m, 1536, generator=g)}
            for t in threads:
                torch.set_num_threads(t)
                times = []
                for r in range(repeats + 1):
                    t0 = time.perf_counter()
                    for layer in order:
                        layer(x[layer.in_features])
                    if r:  # the first pass warms up
                        times.append(time.perf_counter() - t0)
                out[f"{m} rows, {tile}|{t}"] = statistics.median(times)
    return out


def probe(threads: list[int], repeats: int) -> dict:
    """Runs inside one side's checkout (cwd, PYTHONPATH): {"batch x slots|threads": median seconds per call}."""
    sys.path.insert(0, os.getcwd())
    from engine.threads import configure_threads

    configure_threads(1, wait_policy="passive")
    import torch

    # the side's own SmolLM2 attention shape and decode tables (kv_len in slots +- 8, shuffled blocks)
    from bench.cpu_attention import BS, D, HKV, HQ, decode_meta
    from engine.attention import get_backend
    from paging.kv_cache import KVCache

    backend = get_backend("cpu", "cpu")
    out = {}
    for num_seqs, slots in SHAPES:
        num_blocks = num_seqs * (-(-(slots + 8) // BS)) + 8
        meta = decode_meta(num_seqs, slots, num_blocks)
        cache = KVCache(LAYERS, num_blocks, BS, HKV, D, torch.float32)
        g = torch.Generator().manual_seed(0)
        for layer in cache.layers:
            layer.copy_(torch.randn(layer.shape, generator=g))
        q, k, v = (torch.randn(num_seqs, h, D, generator=g) for h in (HQ, HKV, HKV))
        backend.plan(meta, HQ, HKV, D, torch.float32)
        for n in threads:
            torch.set_num_threads(n)
            times = []
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                for layer in cache.layers:
                    backend.forward(q, k, v, layer, meta, D ** -0.5)
                if r:  # the first pass warms up
                    times.append((time.perf_counter() - t0) / LAYERS)
            out[f"{num_seqs} x ~{slots}|{n}"] = statistics.median(times)
    return out


def worktree(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = ROOT / "build" / "kernel_ab" / sha
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    if not (path / ".venv").exists():
        (path / ".venv").symlink_to(ROOT / ".venv")
    return path


def run_side(repo: Path, kernel: str, threads: str, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), str(Path(__file__).resolve()), "--probe",
                          "--kernel", kernel, "--threads", threads, "--repeats", str(repeats)], cwd=repo, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="commit whose kernel is the baseline")
    ap.add_argument("--kernel", choices=["attention", "linear"], default="attention")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        fn = probe if args.kernel == "attention" else probe_linear
        print(json.dumps(fn([int(t) for t in args.threads.split(",")], args.repeats)))
        return
    if not args.base:
        ap.error("--base is required")
    base = worktree(args.base)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    for i in range(args.rounds):
        for side, repo in (("base", base), ("head", ROOT)):
            runs[side].append(run_side(repo, args.kernel, args.threads, args.repeats))
            print(f"round {i + 1}: {side} done", file=sys.stderr)
    what = "decode sequences x KV slots" if args.kernel == "attention" else "rows (batch), tile"
    lines = [f"| {what} | threads | base | this checkout | speed-up | runs (base / this) |",
             "|---|---:|---:|---:|---:|---|"]
    for key in runs["head"][0]:
        b = [r[key] * 1e3 for r in runs["base"]]
        h = [r[key] * 1e3 for r in runs["head"]]
        shape, n = key.split("|")
        lines.append(f"| {shape} | {n} | {statistics.median(b):.2f} ms | {statistics.median(h):.2f} ms "
                     f"| {statistics.median(b) / statistics.median(h):.2f}x "
                     f"| {' '.join(f'{x:.2f}' for x in b)} / {' '.join(f'{x:.2f}' for x in h)} |")
    if args.kernel == "attention":
        timed_what = (f"one attention layer call (decode, K/V write included), median of {args.repeats} passes over "
                      f"{LAYERS} layers' pages per run")
        section = "Attention kernel: this build against an earlier one"
    else:
        timed_what = (f"one decode step's linear layers (SmolLM2 shapes, 30 layers + LM head, ~540 MB of float32 "
                      f"weights streamed from memory), median of {args.repeats} passes per run")
        section = "Packed GEMM kernel: this build against an earlier one"
    note = (f"Base {args.base} ({base.name}) vs this checkout ({head}); {timed_what}, then the median of "
            f"{args.rounds} runs per side, the sides alternating run by run.")
    table = "\n".join(lines) + "\n\n" + note
    print(table)
    if not args.no_write:
        sys.path.insert(0, str(ROOT))
        from bench.common import write_section

        kernel = "" if args.kernel == "attention" else f" --kernel {args.kernel}"
        write_section(section, f"python -m bench.kernel_ab --base {args.base}{kernel} --rounds {args.rounds}", table)


if __name__ == "__main__":
    main()
