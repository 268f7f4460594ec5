"""CPU fast path on SmolLM2 shapes: the C++ paged-attention kernel vs the torch backend, the whole decode step
against its bare-GEMM floor (fp32 and weight-only int8), the int8 GEMM options, int8 greedy agreement, and the
OpenMP wait policy at 1 and 2 threads. Both sides of every comparison run in one process, alternating; medians.

    .venv/bin/python bench/cpu_attention.py [--threads 1 2] [--slots 256 512] [--skip-model] [--skip-int8]
        [--skip-policy] [--no-write]

Layer calls: 64 decode sequences x ~256 / ~512 KV slots (9 query / 3 KV heads, head_dim 64, fp32,
block_size 16, shuffled block tables), cycling over 8 layers' pages so K/V come from memory as in a real step.
Decode step: SmolLM2's DecoderLM (loaded through Engine) + LM head on 64 decode tokens over its own paged cache
(no scheduler, no sampling), against the bare GEMMs of that step (every linear layer + LM head at batch 64, as
bench/offline_throughput.py measures its floor). Public API only (engine.attention, engine.models.quant, Engine).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.threads import configure_threads  # noqa: E402

# before torch loads: the engine's OpenMP waiting unless the environment says otherwise; the policy sweep's children
# take exactly the environment their parent gives them
THREADS = configure_threads(1, wait_policy=None if "--policy-probe" in sys.argv else "passive")

import torch  # noqa: E402

from bench.common import median, timed, write_section  # noqa: E402
from engine.attention import build_metadata, get_backend  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Here is a short poem about the sea:\n",
           "Question: What is 12 times 7?\nAnswer:", "The three laws of thermodynamics are",
           "Once upon a time, in a small village,"]


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


# ---- attention per layer call ------------------------------------------------------------------------------
def layer_rows(threads, slots_list, layers: int, repeats: int) -> list[str]:
    """The torch backend and the C++ kernel on pages in plain tensors (4 KiB pages), and the C++ kernel on the same
    values in the engine's KVCache (transparent huge pages, paging/kv_cache.py)."""
    from paging.kv_cache import KVCache

    backends = {"torch": get_backend("torch", "cpu"), "cpu": get_backend("cpu", "cpu")}
    rows = []
    for slots in slots_list:
        num_seqs = 64
        num_blocks = num_seqs * (-(-(slots + 8) // BS)) + 8
        meta = decode_meta(num_seqs, slots, num_blocks)
        caches = [torch.randn(num_blocks, 2, BS, HKV, D) for _ in range(layers)]
        huge = KVCache(layers, num_blocks, BS, HKV, D, torch.float32)
        for c, h in zip(caches, huge.layers):
            h.copy_(c)
        sides = {"torch": (backends["torch"], caches), "cpu": (backends["cpu"], caches),
                 "cpu, huge pages": (backends["cpu"], huge.layers)}
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(num_seqs, h, D, generator=g) for h in (HQ, HKV, HKV))
        for b in backends.values():
            b.plan(meta, HQ, HKV, D, torch.float32)
        diff = (backends["torch"].forward(q, k, v, caches[0], meta, D ** -0.5)
                - backends["cpu"].forward(q, k, v, caches[0], meta, D ** -0.5)).abs().max().item()
        for n in threads:
            torch.set_num_threads(n)
            t = {name: [] for name in sides}
            for _ in range(3):  # alternate the sides
                for name, (b, pages) in sides.items():
                    def call(b=b, pages=pages):
                        for c in pages:
                            b.forward(q, k, v, c, meta, D ** -0.5)
                    t[name] += [x / layers for x in timed(call, repeats)]
            tt, tc, th = (median(t[name]) for name in sides)
            rows.append(f"| 64 x ~{slots} | {n} | {tt * 1e3:.2f} ms | {tc * 1e3:.2f} ms | {tt / tc:.2f}x "
                        f"| {th * 1e3:.2f} ms | {tc / th:.2f}x | {diff:.1e} |")
    return rows


# ---- torch's flex_attention (evaluation) ------------------------------------------------------------------
def flex_rows(slots: int, repeats: int) -> list[str]:
    """flex_attention compiled for CPU on the decode shape with K/V already contiguous per sequence (no paging, no
    mask: its best case), against the paged kernel on the same values."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.set_num_threads(1)
    num_seqs = 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(num_seqs, HQ, 1, D, generator=g)
    k, v = (torch.randn(num_seqs, HKV, slots, D, generator=g) for _ in range(2))
    t0 = time.perf_counter()
    fa = torch.compile(flex_attention, dynamic=False)
    fa(q, k, v, enable_gqa=True)
    compile_s = time.perf_counter() - t0
    flex_t = median(timed(lambda: fa(q, k, v, enable_gqa=True), repeats))
    k2, v2 = (torch.randn(num_seqs, HKV, slots + 16, D, generator=g) for _ in range(2))
    t0 = time.perf_counter()
    fa(q, k2, v2, enable_gqa=True)
    recompile_s = time.perf_counter() - t0
    # the same K/V in pages of 16 (sequence s owns blocks s*P .. s*P+P-1), attended by the C++ kernel
    pages = slots // BS
    cache = torch.empty(num_seqs * pages, 2, BS, HKV, D)
    cache[:, 0] = k.permute(0, 2, 1, 3).reshape(num_seqs * pages, BS, HKV, D)
    cache[:, 1] = v.permute(0, 2, 1, 3).reshape(num_seqs * pages, BS, HKV, D)
    meta = build_metadata([list(range(s * pages, (s + 1) * pages)) for s in range(num_seqs)], [1] * num_seqs,
                          [slots] * num_seqs, BS, write=False)
    be = get_backend("cpu", "cpu")
    be.plan(meta, HQ, HKV, D, torch.float32)
    qk = q[:, :, 0].contiguous()
    kern_t = median(timed(lambda: be.forward(qk, None, None, cache, meta, D ** -0.5), repeats))
    diff = (be.forward(qk, None, None, cache, meta, D ** -0.5) - fa(q, k, v, enable_gqa=True)[:, :, 0]).abs().max()
    return [f"| 64 x {slots}, 1 thread | {compile_s:.1f} s | {recompile_s:.1f} s | {flex_t * 1e3:.2f} ms | "
            f"{kern_t * 1e3:.2f} ms | {diff.item():.1e} |"]


# ---- whole decode step -------------------------------------------------------------------------------------
def load_smollm2():
    from engine import Engine

    eng = Engine(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=2048,
                 gemm_backend="torch")  # dense nn.Linear weights: the GEMM floor reads them
    model, cfg = eng.model, eng.model_config
    eng.shutdown()
    return model, cfg


def gemm_floor(model, batch: int, repeats: int, warmup: bool = True) -> list[float]:
    """Bare GEMMs of one decode step at `batch` with the float32 weights: every nn.Linear + the (tied) LM head."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.lm_head is None:
        weights.append(model.embed_tokens.weight)
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}

    def once():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    with torch.inference_mode():
        return timed(once, repeats, warmup)


def model_rows(model, cfg, int8_model, threads, slots_list, repeats: int) -> list[str]:
    from paging.kv_cache import KVCache

    backends = {"torch": get_backend("torch", "cpu"), "cpu": get_backend("cpu", "cpu")}
    rows = []
    for num_seqs, slots in [(64, s) for s in slots_list] + [(1, slots_list[0])]:
        num_blocks = num_seqs * (-(-(slots + 8) // BS)) + 8
        kv = KVCache(cfg.num_layers, num_blocks, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        kv.data.normal_()
        meta = decode_meta(num_seqs, slots, num_blocks)
        ids = torch.randint(0, cfg.vocab_size, (num_seqs,))
        pos = torch.tensor(meta.kv_lens) - 1

        def step(b, m=model):
            b.plan(meta, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32)
            m.compute_logits(m(ids, pos, kv.layers, b, meta))

        for n in threads:
            torch.set_num_threads(n)
            t = {"torch": [], "cpu": [], "int8": []}
            floors = []
            sides = [("torch", lambda: step(backends["torch"])), ("cpu", lambda: step(backends["cpu"]))]
            if int8_model is not None:
                sides.append(("int8", lambda: step(backends["cpu"], int8_model)))
            with torch.inference_mode():
                gemm_floor(model, num_seqs, 1)
                for _, fn in sides:
                    fn()  # warm-up
                # one call of each side per round, so a change in the machine's load hits all sides alike
                for _ in range(3 * repeats if num_seqs > 1 else 12 * repeats):
                    floors += gemm_floor(model, num_seqs, 1, warmup=False)
                    for name, fn in sides:
                        t[name] += timed(fn, 1, warmup=False)
            fl = median(floors)
            cells = [f"{median(t[k]) * 1e3:.1f} ms ({median(t[k]) / fl:.2f}x)" if t[k] else "-"
                     for k in ("torch", "cpu", "int8")]
            rows.append(f"| {num_seqs} x ~{slots} | {n} | {fl * 1e3:.1f} ms | " + " | ".join(cells) + " |")
    return rows


# ---- int8 GEMM options -------------------------------------------------------------------------------------
def int8_gemm_rows(model, repeats: int) -> list[str]:
    from engine.models.quant import Int8Linear, quantize_weight

    torch.set_num_threads(1)
    shapes = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    shapes[tuple(model.embed_tokens.weight.shape)] = 1  # tied LM head
    rows = []
    for batch in (1, 32, 64):
        tot = {"fp32": 0.0, "int8pack": 0.0, "dequant": 0.0, "kvllm": 0.0}
        for (n, k), count in shapes.items():
            lin = torch.nn.Linear(k, n, bias=False)
            q, scale = quantize_weight(lin.weight, None)  # torch's int8 ops take one scale per channel
            scale = scale[:, 0].contiguous()
            layer = Int8Linear(lin)  # groups of 32
            x = torch.randn(batch, k)
            fns = {"fp32": lambda: torch.nn.functional.linear(x, lin.weight),
                   "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale),
                   "dequant": lambda: torch.nn.functional.linear(x, q.float() * scale[:, None]),
                   "kvllm": lambda: layer(x)}
            with torch.inference_mode():
                for name, fn in fns.items():
                    reps = repeats if name != "int8pack" or batch == 1 else 1  # int8pack is very slow here
                    tot[name] += median(timed(fn, reps)) * count
        rows.append(f"| {batch} | {tot['fp32'] * 1e3:.1f} ms | {tot['int8pack'] * 1e3:.1f} ms "
                    f"({tot['fp32'] / tot['int8pack']:.2f}x) | {tot['dequant'] * 1e3:.1f} ms "
                    f"({tot['fp32'] / tot['dequant']:.2f}x) | {tot['kvllm'] * 1e3:.1f} ms "
                    f"({tot['fp32'] / tot['kvllm']:.2f}x) |")
    return rows


def agreement_rows(max_tokens: int) -> list[str]:
    """Greedy tokens of SmolLM2 fp32 vs the same engine after quantize_int8, prompt by prompt."""
    from engine import Engine, SamplingParams
    from engine.models.quant import quantize_int8

    torch.set_num_threads(1)
    eng = Engine(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=2048,
                 gemm_backend="torch")  # quantize_int8 swaps nn.Linear layers
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.encode_prompt(p) for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in eng.generate(ids, params, use_tqdm=False)]
    quantize_int8(eng.model)
    got = [o.outputs[0].token_ids for o in eng.generate(ids, params, use_tqdm=False)]
    eng.shutdown()
    rows, same_total, prefix_total = [], 0, 0
    for p, a, b in zip(PROMPTS, ref, got):
        same = sum(x == y for x, y in zip(a, b))
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same_total, prefix_total = same_total + same, prefix_total + prefix
        rows.append(f"| {p!r} | {prefix} / {len(a)} | {same / len(a):.0%} |")
    n = len(PROMPTS) * max_tokens
    rows.append(f"| all {len(PROMPTS)} prompts | {prefix_total} / {n} | {same_total / n:.0%} |")
    return rows


# ---- OpenMP wait policy ------------------------------------------------------------------------------------
def policy_probe(batches, slots: int, repeats: int) -> dict:
    """Run in a child process (the policy must be in the environment before torch loads)."""
    from paging.kv_cache import KVCache

    model, cfg = load_smollm2()
    be = get_backend("cpu", "cpu")
    out = {}
    for num_seqs in batches:
        num_blocks = num_seqs * (-(-(slots + 8) // BS)) + 8
        kv = KVCache(cfg.num_layers, num_blocks, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        kv.data.normal_()
        meta = decode_meta(num_seqs, slots, num_blocks)
        ids, pos = torch.randint(0, cfg.vocab_size, (num_seqs,)), torch.tensor(meta.kv_lens) - 1

        def step():
            be.plan(meta, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32)
            model.compute_logits(model(ids, pos, kv.layers, be, meta))

        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                ts = timed(step, repeats if num_seqs > 1 else 4 * repeats)
            out[f"{num_seqs} {n}"] = median(ts)
    return out


POLICIES = {"passive, no spin": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
            "passive after 1500 spins (engine.threads default)": {"OMP_WAIT_POLICY": "PASSIVE",
                                                                  "GOMP_SPINCOUNT": "1500"},
            "libgomp default (spin ~300k, then sleep)": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""},
            "GOMP_SPINCOUNT=1000": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "1000"},
            "active": {"OMP_WAIT_POLICY": "ACTIVE"}}


def policy_rows(batches, slots: int, repeats: int) -> list[str]:
    rows = []
    for policy, settings in POLICIES.items():
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update({k: v for k, v in settings.items() if v})
        cmd = [sys.executable, __file__, "--policy-probe", json.dumps([batches, slots, repeats])]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        for b in batches:
            one, two = r[f"{b} 1"], r[f"{b} 2"]
            rows.append(f"| {policy} | {b} x ~{slots} | {one * 1e3:.0f} ms | {two * 1e3:.0f} ms | "
                        f"{one / two:.2f}x |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--slots", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--layers", type=int, default=8, help="distinct layer page tensors cycled in the layer test")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--agreement-tokens", type=int, default=32)
    ap.add_argument("--skip-model", action="store_true", help="skip the whole-model decode step")
    ap.add_argument("--skip-int8", action="store_true", help="skip the int8 rows, GEMM options and agreement")
    ap.add_argument("--skip-policy", action="store_true", help="skip the OpenMP wait-policy runs")
    ap.add_argument("--skip-flex", action="store_true", help="skip the flex_attention evaluation (compiles ~1 min)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--policy-probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.policy_probe:
        print(json.dumps(policy_probe(*json.loads(args.policy_probe))))
        return
    t_start, load = time.time(), os.getloadavg()[0]
    out = ["| decode batch x KV slots | threads | torch backend | cpu kernel | speed-up | cpu kernel, KV cache in huge "
           "pages | huge vs 4 KiB pages | max abs diff |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    out += layer_rows(args.threads, args.slots, args.layers, args.repeats)
    if not args.skip_flex:
        out += ["", "| torch.compile(flex_attention), decode | compile + first call | recompile for a new KV length "
                    "| flex per call (contiguous K/V) | paged kernel per call (same values, in pages) | max abs diff |",
                "|---|---:|---:|---:|---:|---:|"]
        out += flex_rows(args.slots[0], args.repeats)
    if not args.skip_model or not args.skip_int8:
        model, cfg = load_smollm2()
    if not args.skip_model:
        int8_model = None
        if not args.skip_int8:
            import copy

            from engine.models.quant import quantize_int8

            int8_model = quantize_int8(copy.deepcopy(model))
        out += ["", "| SmolLM2 decode step, batch x KV slots | threads | bare fp32 GEMM floor | torch backend "
                    "(vs floor) | cpu kernel (vs floor) | cpu kernel + int8 weights (vs fp32 floor) |",
                "|---|---:|---:|---:|---:|---:|"]
        out += model_rows(model, cfg, int8_model, args.threads, args.slots, args.repeats)
    if not args.skip_int8:
        out += ["", "| batch | fp32 F.linear | aten._weight_int8pack_mm | dequantize + F.linear "
                    "| kvllm int8_linear (groups of 32) |", "|---:|---:|---:|---:|---:|"]
        out += int8_gemm_rows(model, args.repeats)
        out += ["", "| prompt | int8 greedy tokens equal to fp32 before the first difference | equal at the same "
                    "position |", "|---|---:|---:|"]
        out += agreement_rows(args.agreement_tokens)
    if not args.skip_policy:
        out += ["", "| OMP_WAIT_POLICY | decode step, batch x KV slots | 1 thread | 2 threads | 2-thread speed-up |",
                "|---|---|---:|---:|---:|"]
        out += policy_rows([1, 64], args.slots[0], args.repeats)
    layer_only = args.skip_model and args.skip_int8 and args.skip_policy and args.skip_flex
    notes = [f"Layer call: attention of 64 decode tokens (K/V write included) per layer, medians over {args.layers} "
             f"layers' pages x {args.repeats} repeats x 3 alternations; the huge-page column runs the same values in "
             f"a KVCache (paging/kv_cache.py: madvise(MADV_HUGEPAGE))."]
    if not layer_only:
        notes.append(f"Decode step: model forward + LM head. GEMM options: the sum over SmolLM2's linear shapes x "
                     f"their counts (+ tied LM head), 1 thread. Agreement: Engine.generate, greedy, ignore_eos, "
                     f"{args.agreement_tokens} tokens, 1 thread. Wait policy: one child process per setting (in the "
                     f"environment before torch loads).")
    notes.append(f"Rows run with {THREADS.wait_policy or 'the default'} waiting. 1-minute load average at start "
                 f"{load:.2f} on {os.cpu_count()} cores; {time.time() - t_start:.0f} s.")
    body = "\n".join(out) + "\n\n" + " ".join(notes)
    print(body)
    if not args.no_write:
        cmd = "python bench/cpu_attention.py " + " ".join(sys.argv[1:])
        title = ("Attention layer call: C++ kernel vs torch, KV pages in huge pages" if layer_only
                 else "CPU fast path: paged-attention kernel, int8 weights, threads (SmolLM2)")
        write_section(title, cmd.strip(), body)


if __name__ == "__main__":
    main()
