"""`--dtype bfloat16` / `float16` on this CPU: what `auto` runs them on against F.linear in that dtype, side by side
in one run.

    python -m bench.bf16_widen [--repeats 3] [--no-write]

A vLLM user's launch line may carry `--dtype bfloat16` or `--dtype half`. On a CPU without bf16 arithmetic (no
AVX512-BF16, no AMX) torch's and oneDNN's bf16 GEMMs emulate it, and torch's float16 GEMMs on the CPU are as slow;
kvllm's `auto` then keeps the weights in that dtype as packed panels its GEMM widens exactly to float32 in the tile
(engine/linear_path.py `widen_applies`; bfloat16 on a CPU with AVX512-BF16 runs on bfloat16 panels instead,
`panels_apply`). Engines, all through the public `Engine` API, alive together and run in turn each repeat: for
each of bfloat16 and float16, `dtype=...` (what `auto` picks here, named by its startup line) and
`dtype=..., gemm_backend="torch"` (F.linear in that dtype, the earlier pick); and `dtype="float32"` (the default
here). Workloads, real-text prompts, greedy, ignore_eos: one sequence decoding (1 x 128/128), a batch
(32 x 128/128, all at once), prefill (4 x 1024 prompt tokens, one output token each).
Reported: output (prefill: prompt) tokens/s, the median over repeats, and the ratio to F.linear in the row's dtype
(float32: to F.linear in bfloat16); and of 8 prompts, how many 64-token greedy continuations equal float32's.
"""
from __future__ import annotations

import argparse
import sys
import time

from engine.threads import configure_threads

configure_threads(2)

from bench.common import commit, median, text_prompts, write_section  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402

SECTION = "--dtype bfloat16 / float16 on a CPU without their arithmetic"
ENGINES = [("bfloat16 (auto's pick)", {"dtype": "bfloat16"}),
           ("bfloat16, F.linear (gemm_backend torch)", {"dtype": "bfloat16", "gemm_backend": "torch"}),
           ("float16 (auto's pick)", {"dtype": "float16"}),
           ("float16, F.linear (gemm_backend torch)", {"dtype": "float16", "gemm_backend": "torch"}),
           ("float32", {"dtype": "float32"})]
# (name, prompts, prompt tokens, output tokens, counted tokens: "output" or "prompt")
WORKLOADS = [("decode, 1 x 128/128", 1, 128, 128, "output"), ("batch, 32 x 128/128", 32, 128, 128, "output"),
             ("prefill, 4 x 1024/1", 4, 1024, 1, "prompt")]


def base_of(name: str) -> str:
    """The F.linear engine a row's ratio is taken to: its own dtype's (float32's: bfloat16's)."""
    dtype = "float16" if name.startswith("float16") else "bfloat16"
    return f"{dtype}, F.linear (gemm_backend torch)"


def run(engine: Engine, prompts: list[list[int]], out_len: int, counted: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs) if counted == "output" else sum(map(len, prompts))
    return tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    engines = {name: Engine(model="smollm2", kv_cache_memory="2GiB", max_model_len=2048, max_num_seqs=64,
                            max_num_batched_tokens=2048, enable_prefix_caching=False, **kw) for name, kw in ENGINES}
    picked = {name: e.capacity_log_lines()[0] for name, e in engines.items()}
    tok = next(iter(engines.values())).tokenizer
    inputs = {w[0]: text_prompts(tok, w[1], w[2], seed=11) for w in WORKLOADS}
    for e in engines.values():  # warm each engine's kernels once
        run(e, inputs[WORKLOADS[0][0]], 8, "output")
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for wname, _n, _p, out_len, counted in WORKLOADS:
            for name, e in engines.items():
                rates.setdefault((name, wname), []).append(run(e, inputs[wname], out_len, counted))
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = text_prompts(tok, 8, 32, seed=5)
    ids = {name: [o.outputs[0].token_ids for o in e.generate(prompts, greedy, use_tqdm=False)]
           for name, e in engines.items()}
    for e in engines.values():
        e.check_invariants()
        e.shutdown()

    lines = ["| engine | " + " | ".join(f"{w[0]} ({w[4]} tok/s)" for w in WORKLOADS) + " | greedy equal to float32's |",
             "|---|" + "--:|" * len(WORKLOADS) + "--:|"]
    for name, _ in ENGINES:
        cells = []
        for w in WORKLOADS:
            m, base = median(rates[(name, w[0])]), median(rates[(base_of(name), w[0])])
            cells.append(f"{m:.1f} ({m / base:.2f}x)")
        same = sum(a == b for a, b in zip(ids[name], ids["float32"]))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {same} / {len(prompts)} |")
    body = "\n".join(lines) + (
        f"\n\nkvllm {commit()}, SmolLM2-135M-Instruct (the .gguf, `Engine(model=\"smollm2\")`), 2 threads, KV pool "
        "2 GiB, prefix caching off, max_num_seqs 64, max_num_batched_tokens 2048. In brackets: the ratio to F.linear "
        f"in the row's dtype (float32's: to F.linear in bfloat16). Median of {args.repeats} runs, the engines alive "
        "together and run in turn. What each engine ran, from its startup line:\n\n"
        + "\n".join(f"- {name}: {line}" for name, line in picked.items())
        + f"\n\nGreedy: 8 real-text prompts of 32 tokens, 64 new tokens each. {time.time() - t0:.0f} s.")
    print(body)
    if not args.no_write:
        write_section(SECTION, " ".join(["python -m bench.bf16_widen", *sys.argv[1:]]), body)


if __name__ == "__main__":
    main()
