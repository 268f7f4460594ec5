"""CPU attention: the torch backend vs the C++ paged kernel (engine/attention/cpu_paged.py), per layer call and
in SmolLM2's whole decode step against the bare-GEMM floor, at 1 and 2 threads, in one process.

Layer calls: 64 decode sequences x ~256 / ~512 KV slots (SmolLM2: 9 query / 3 KV heads, head_dim 64, fp32,
block_size 16, shuffled block tables), cycling over several layers' pages so K/V come from memory as they do
in a real step. Decode step: SmolLM2's DecoderLM (loaded through Engine) + the LM head on 64 sequences' decode
tokens over its own paged cache, against the bare GEMMs of that step (every linear layer + LM head at batch 64,
as bench/offline_throughput.py measures its floor). Medians; both sides alternate in the same run.

    .venv/bin/python bench/cpu_attention.py [--threads 1 2] [--slots 256 512] [--no-model] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import median, write_section  # noqa: E402
from engine.attention import build_metadata, get_backend  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def decode_meta(num_seqs: int, slots: int, num_blocks: int, seed: int = 0):
    """Decode metadata for num_seqs sequences with kv_len in [slots - 8, slots + 8] over shuffled blocks."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, kv_lens = [], []
    for _ in range(num_seqs):
        n = slots + rng.randint(-8, 8)
        tables.append([free.pop() for _ in range(-(-n // BS))])
        kv_lens.append(n)
    return build_metadata(tables, [1] * num_seqs, kv_lens, BS)


def time_calls(fn, layers: int, repeats: int) -> float:
    """Median seconds of one call, each repeat running the call once per layer."""
    fn(0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        times.append((time.perf_counter() - t0) / layers)
    return median(times)


def layer_rows(threads: list[int], slots_list: list[int], layers: int, repeats: int) -> list[str]:
    backends = {"torch": get_backend("torch", "cpu"), "cpu": get_backend("cpu", "cpu")}
    rows = []
    for slots in slots_list:
        num_seqs = 64
        num_blocks = num_seqs * (-(-(slots + 8) // BS)) + 8
        meta = decode_meta(num_seqs, slots, num_blocks)
        caches = [torch.randn(num_blocks, 2, BS, HKV, D) for _ in range(layers)]
        g = torch.Generator().manual_seed(0)
        q = torch.randn(num_seqs, HQ, D, generator=g)
        k = torch.randn(num_seqs, HKV, D, generator=g)
        v = torch.randn(num_seqs, HKV, D, generator=g)
        for b in backends.values():
            b.plan(meta, HQ, HKV, D, torch.float32)
        diff = (backends["torch"].forward(q, k, v, caches[0], meta, D ** -0.5)
                - backends["cpu"].forward(q, k, v, caches[0], meta, D ** -0.5)).abs().max().item()
        for n in threads:
            torch.set_num_threads(n)
            t = {name: [] for name in backends}
            for _ in range(3):  # alternate the two sides
                for name, b in backends.items():
                    t[name].append(time_calls(lambda i: b.forward(q, k, v, caches[i], meta, D ** -0.5),
                                              layers, repeats))
            tt, tc = median(t["torch"]), median(t["cpu"])
            rows.append(f"| {num_seqs} x ~{slots} | {n} | {tt * 1e3:.2f} ms | {tc * 1e3:.2f} ms | {tt / tc:.2f}x "
                        f"| {diff:.1e} |")
        del caches
    return rows


def gemm_floor(model, batch: int, repeats: int) -> float:
    """Bare GEMMs of one decode step at `batch`: every nn.Linear + the (tied) LM head."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.lm_head is None:
        weights.append(model.embed_tokens.weight)
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}

    def once():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    with torch.inference_mode():
        once()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    return median(times)


def model_rows(threads: list[int], slots_list: list[int], repeats: int) -> list[str]:
    from engine import Engine
    from paging.kv_cache import KVCache

    eng = Engine(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=2048)
    model, c = eng.model, eng.model_config
    eng.shutdown()
    num_seqs = 64
    backends = {"torch": get_backend("torch", "cpu"), "cpu": get_backend("cpu", "cpu")}
    rows = []
    for slots in slots_list:
        num_blocks = num_seqs * (-(-(slots + 8) // BS)) + 8
        kv = KVCache(c.num_layers, num_blocks, BS, c.num_kv_heads, c.head_dim, torch.float32)
        kv.data.normal_()
        meta = decode_meta(num_seqs, slots, num_blocks)
        ids = torch.randint(0, c.vocab_size, (num_seqs,))
        pos = torch.tensor(meta.kv_lens) - 1

        def step(b):
            b.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, torch.float32)
            model.compute_logits(model(ids, pos, kv.layers, b, meta))

        for n in threads:
            torch.set_num_threads(n)
            t = {name: [] for name in backends}
            floors = []
            with torch.inference_mode():
                for _ in range(2):
                    floors.append(gemm_floor(model, num_seqs, repeats))
                    for name, b in backends.items():
                        step(b)
                        for _ in range(repeats):
                            t0 = time.perf_counter()
                            step(b)
                            t[name].append(time.perf_counter() - t0)
            fl, tt, tc = median(floors), median(t["torch"]), median(t["cpu"])
            rows.append(f"| {num_seqs} x ~{slots} | {n} | {fl * 1e3:.0f} ms | {tt * 1e3:.0f} ms ({tt / fl:.2f}x) "
                        f"| {tc * 1e3:.0f} ms ({tc / fl:.2f}x) |")
        del kv
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--slots", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--layers", type=int, default=8, help="distinct layer page tensors cycled in the layer test")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-model", action="store_true", help="skip the whole-model decode step")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    table = ["| decode batch x KV slots | threads | torch backend | cpu kernel | speed-up | max abs diff |",
             "|---|---:|---:|---:|---:|---:|"]
    table += layer_rows(args.threads, args.slots, args.layers, args.repeats)
    if not args.no_model:
        table += ["", "| SmolLM2 decode step, batch x KV slots | threads | bare GEMM floor | torch backend "
                      "(vs floor) | cpu kernel (vs floor) |", "|---|---:|---:|---:|---:|"]
        table += model_rows(args.threads, args.slots, args.repeats)
    body = "\n".join(table)
    body += (f"\n\nPer layer call: attention of 64 decode tokens (K/V write included), medians over {args.layers} "
             f"layers' pages x {args.repeats} repeats x 3 alternations. Decode step: model forward + LM head (no "
             f"scheduler, no sampling). 1-minute load average at start {load:.2f} (2 cores).")
    print(body)
    if not args.no_write:
        cmd = "python bench/cpu_attention.py " + " ".join(sys.argv[1:])
        write_section("CPU attention kernel vs torch backend (SmolLM2 shapes)", cmd.strip(), body)


if __name__ == "__main__":
    main()
