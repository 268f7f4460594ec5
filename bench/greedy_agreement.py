"""Free-running greedy agreement by KV page dtype: how many prompts' 64-token greedy continuations equal float32
pages' token for token, and where the others part.

    python -m bench.greedy_agreement [--kv-cache-dtype float32 bfloat16 int8 fp8_e4m3 fp8_e5m2] [--prompts 64]

One engine per KV dtype (SmolLM2, float32 compute). The prompt sets: tests/test_kv_8bit.py's 8 prompts,
`--prompts` licence-text windows (bench.common.text_prompts), and 8 questions through the chat template. A
continuation that parts from the reference's is split by the reference's own top-1 minus top-2 logprob at the first
differing position (its margin): a run of greedy decoding follows whichever of two near-equal tokens a rounding tips
it to, so a format is judged by whether it parts only at such near-ties, and the reference's margins say how often a
64-token run meets one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench.common import text_prompts, write_section

SECTION = "Free-running greedy agreement by KV page dtype (SmolLM2)"
TEST_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Here is a short poem about the sea:\n",
                "Question: What is 12 times 7?\nAnswer:", "Once upon a time, in a small village,",
                "The three laws of thermodynamics are", "import numpy as np\n", "Photosynthesis converts"]
# questions a chat user would ask, sent through the model's chat template (the server's chat path): the answers of
# an instruct model, not continuations of raw text, so a check that near-ties are not an artifact of the prompts
CHAT_QUESTIONS = ["Explain how photosynthesis works in plants.",
                  "Write a short story about a robot who learns to paint.",
                  "What were the main causes of the French Revolution?", "Describe the water cycle step by step.",
                  "Give me three tips for learning a new programming language.", "Why is the sky blue?",
                  "Write a Python function that reverses a string, and explain how it works.",
                  "What are the benefits of regular exercise?"]
NEAR_TIE = 0.25  # nats between the reference's top two tokens: the runner-up has >= 78% of the top's probability


def margin(top: dict[int, float]) -> float:
    """The reference's top-1 minus top-2 logprob at one position (its logprobs=2 dict)."""
    a, b = sorted(top.values(), reverse=True)[:2]
    return a - b


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def continuations(engine, prompts: list[list[int]], max_tokens: int):
    from engine import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = engine.generate(prompts, p, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def summarize(ref, got, max_tokens: int) -> dict:
    parts = []  # (position, reference margin there, took the reference's runner-up)
    for (r_ids, r_lp), (g_ids, _) in zip(ref, got):
        i = first_difference(r_ids, g_ids)
        if i is not None:
            top = r_lp[i]
            runner_up = sorted(top, key=top.get, reverse=True)[1]
            parts.append((i, margin(top), g_ids[i] == runner_up))
    return {"equal": len(ref) - len(parts), "n": len(ref), "parts": parts}


def fmt_parts(s: dict) -> str:
    if not s["parts"]:
        return "-"
    return ", ".join(f"{i} ({m:.3f}{'' if ru else ', not the runner-up'})" for i, m, ru in sorted(s["parts"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"],
                    help="KV page dtypes (the first is the reference)")
    ap.add_argument("--prompts", type=int, default=64, help="licence-text prompts beside the test's 8")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine import Engine

    t0 = time.perf_counter()
    runs, sets = {}, None
    for name in args.kv_cache_dtype:
        engine = Engine(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=2048, max_model_len=2048,
                        kv_cache_dtype=name)
        try:
            sets = sets or {"the test's 8 prompts": [engine.encode_prompt(x) for x in TEST_PROMPTS],
                            f"{args.prompts} licence-text prompts": text_prompts(engine.tokenizer, args.prompts,
                                                                                args.prompt_len, seed=1),
                            "8 chat questions (chat template)": [
                                engine.tokenizer(engine.apply_chat_template([{"role": "user", "content": q}]),
                                                 add_special_tokens=False).input_ids for q in CHAT_QUESTIONS]}
            runs[name] = {k: continuations(engine, v, args.max_tokens) for k, v in sets.items()}
        finally:
            engine.shutdown()
        engine.check_invariants()
        print(f"[{time.perf_counter() - t0:5.0f} s] {name}", file=sys.stderr, flush=True)
    ref_name = args.kv_cache_dtype[0]
    lines = [f"| KV pages | prompts | equal for {args.max_tokens} tokens | parted at a near-tie (< {NEAR_TIE} nats) "
             f"| widest reference margin where parted (nats) | first differing position (reference margin) |",
             "|---|---|---:|---:|---:|---|"]
    for name in args.kv_cache_dtype[1:]:
        for k in sets:
            s = summarize(runs[ref_name][k], runs[name][k], args.max_tokens)
            ties = sum(m < NEAR_TIE for _, m, _ in s["parts"])
            widest = max((m for _, m, _ in s["parts"]), default=None)
            lines.append(f"| {name} | {k} | {s['equal']} / {s['n']} | {ties} / {len(s['parts'])} | "
                         f"{'-' if widest is None else f'{widest:.3f}'} | "
                         f"{fmt_parts(s) if s['n'] <= 8 else '-'} |")
    # how often a reference run meets a near-tie: the chance that any rounding can tip it, per prompt set
    ties = []
    for k in sets:
        margins = [[margin(t) for t in lps] for _, lps in runs[ref_name][k]]
        flat = [m for ms in margins for m in ms]
        ties.append(f"{k}: {100 * sum(m < NEAR_TIE for m in flat) / len(flat):.1f}% of {len(flat)} positions, "
                    f"{sum(any(m < NEAR_TIE for m in ms) for ms in margins)} of {len(margins)} runs")
    body = "\n".join(lines) + "\n\n" + (
        f"SmolLM2-135M-Instruct, float32 compute, greedy, {args.max_tokens} new tokens, ignore_eos; the reference is "
        f"{ref_name} pages. Margin: the reference's top-1 minus top-2 logprob at a position. Near-ties (< {NEAR_TIE} "
        f"nats) among the reference's generated positions, and the runs that meet at least one, where any rounding "
        f"of K or V can tip the choice and the runs part from there on: {'; '.join(ties)}. "
        f"{time.perf_counter() - t0:.0f} s.")
    print(body)
    if not args.no_write:
        write_section(SECTION, "python -m bench.greedy_agreement " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
