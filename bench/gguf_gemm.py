"""GGUF blocks in the GEMM (gemm_backend 'gguf', engine/models/gguf_linear.py) against packed float32 panels
(gemm_backend 'cpu') on SmolLM2's own weights: two engines over the same .gguf in one process, alternating.

    python -m bench.gguf_gemm                        # 1 thread; rows 1..2048; the step_floor decode batches
    python -m bench.gguf_gemm --rows 1,16,64 --no-write

Rows: every linear layer of the model (30 layers' q/k/v, o, gate/up, down and the tied LM head, distinct weights,
so they stream from memory as in a step) at `rows` input rows, the sum per forward; the LM head is left out above
256 rows, as a prefill computes logits for its last tokens only. Steps: the median decode step of `batch`
real-text sequences at `slots` KV slots each. Memory: the bytes of the linear layers' weights (buffers).
"""
from __future__ import annotations

import argparse
import sys
import time

from engine.threads import configure_threads

configure_threads(1)  # before torch loads: the engine's OpenMP waiting (engine/threads.py)

import torch  # noqa: E402

from bench.common import median, text_prompts, timed, write_section  # noqa: E402

STEPS = [(1, 256), (16, 192), (32, 192), (64, 384)]  # (batch, KV slots): batch 1 and bench/step_floor.py's rows
BACKENDS = ("cpu", "gguf")


def linears(model) -> list[torch.nn.Module]:
    """The model's linear layers in forward order, the LM head last."""
    mods = [m for name, m in model.named_modules() if hasattr(m, "in_features") and name != "packed_lm_head"]
    return mods + [model.packed_lm_head]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,12,16,24,32,64,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--max-isa", type=int, default=2, choices=[1, 2],
                    help="1: both backends' AVX2 tiles on an AVX-512 CPU (the kernels a CPU without AVX-512 runs)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from engine import Engine, SamplingParams

    t_start = time.perf_counter()
    engines = {b: Engine(model="smollm2", dtype="float32", device="cpu", max_num_seqs=64,
                         max_num_batched_tokens=2048, max_model_len=1024, kv_cache_memory="1500MiB", seed=0,
                         enable_prefix_caching=False, gemm_backend=b) for b in BACKENDS}
    layers = {b: linears(e.model) for b, e in engines.items()}
    for mod in layers["cpu"] + layers["gguf"]:
        mod.max_isa = args.max_isa
    nbytes = {b: sum(t.numel() * t.element_size() for m in layers[b] for t in m.buffers()) for b in BACKENDS}
    lines = ["| rows | packed float32 (cpu) | GGUF blocks (gguf) | cpu / gguf | outputs equal |",
             "|---:|---:|---:|---:|---|"]
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k) for k in {m.in_features for m in layers["cpu"]}}
        use = {b: [m for m in layers[b] if not (rows > 256 and m is layers[b][-1])] for b in BACKENDS}
        times = {b: [] for b in BACKENDS}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for b in BACKENDS:
                    times[b] += timed(lambda: [m(xs[m.in_features]) for m in use[b]], 1)
            equal = all(torch.equal(a(xs[a.in_features]), g(xs[g.in_features]))
                        for a, g in zip(use["cpu"], use["gguf"]))
        c, g = median(times["cpu"]), median(times["gguf"])
        lines.append(f"| {rows} | {1e3 * c:.1f} ms | {1e3 * g:.1f} ms | {c / g:.2f}x | {'yes' if equal else 'NO'} |")
        print(lines[-1], flush=True)
    if not args.skip_steps:
        lines += ["", "| decode step (running x KV slots) | cpu | gguf | cpu / gguf | greedy tokens equal |",
                  "|---|---:|---:|---:|---|"]
        for batch, slots in STEPS:
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            for b, e in engines.items():
                for i, p in enumerate(text_prompts(e.tokenizer, batch, slots, seed=batch)):
                    e.add_request(p, params, f"{batch}-{i}")
                done = e.stats().prompt_tokens_total + batch * slots
                while e.stats().prompt_tokens_total < done:
                    e.step()
                e.step()
            times = {b: [] for b in BACKENDS}
            for _ in range(8):
                for b, e in engines.items():
                    times[b] += timed(e.step, 2)
            tokens = {}
            for b, e in engines.items():
                outs = []
                while e.has_unfinished_requests():
                    outs += e.step()
                tokens[b] = sorted((o.request_id, tuple(o.outputs[0].token_ids)) for o in outs)
                e.check_invariants()
            c, g = median(times["cpu"]), median(times["gguf"])
            lines.append(f"| {batch} x {slots} | {1e3 * c:.1f} ms | {1e3 * g:.1f} ms | {c / g:.2f}x | "
                         f"{'yes' if tokens['cpu'] == tokens['gguf'] else 'NO'} |")
            print(lines[-1], flush=True)
    body = "\n".join(lines) + (
        f"\n\nSmolLM2-135M-Instruct from its Q4_1 GGUF (Q8_0 embedding / tied LM head), float32 activations, 1 thread, "
        f"{'AVX-512 tiles where the CPU has them' if args.max_isa == 2 else 'AVX2 tiles (max_isa 1)'}, "
        f"both engines in one process, alternating ({args.repeats} rounds for the rows, 8 x 2 steps per decode row); "
        f"medians. Weights of the linear layers: {nbytes['cpu'] / 2**20:.0f} MiB as float32 panels, "
        f"{nbytes['gguf'] / 2**20:.0f} MiB as blocks ({nbytes['cpu'] / nbytes['gguf']:.1f}x less). 'outputs equal': "
        f"every layer's output bit for bit; 'greedy tokens equal': all of each row's sequences run to their end. "
        f"{time.perf_counter() - t_start:.0f} s.")
    print(body)
    if not args.no_write:
        write_section("GGUF blocks in the GEMM (gemm_backend gguf vs cpu)",
                      "python -m bench.gguf_gemm " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
