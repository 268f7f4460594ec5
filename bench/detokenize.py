"""Incremental detokenization, per output token: tokenizers' DecodeStream against the windowed decode (two
transformers decode calls a token) that engine/output_processor.py falls back on, through the engine's own output
processor, and the decode step of the default engine at the same batch beside it. The decode runs on the engine's
loop thread between steps, so its time adds to every step.

    python -m bench.detokenize [--threads 2] [--rounds 5] [--no-write]   # writes docs/results/serving_path.md

Each round feeds `batch` sequences (real text, SmolLM2's byte-level tokenizer) one token each in turn, as a step
hands them out, on each path in alternation; the step is the median decode step of `batch` sequences at 384 KV slots.
"""
from __future__ import annotations

import argparse
import time

from bench.common import RESULTS, cpu_name, median, text_prompts, write_section

SECTION = "Detokenization per output token"
BATCHES = (8, 32, 64)
TOKENS = 256  # output tokens per sequence and round


def feed(proc, prompts: list[list[int]], stream: bool) -> float:
    """Seconds to append every prompt's tokens as outputs of one sequence each, a token per sequence in turn."""
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

    backend, proc.backend = proc.backend, (proc.backend if stream else None)
    seqs = [Sequence(f"r{i}", [1], SamplingParams(max_tokens=TOKENS + 1, ignore_eos=True))
            for i in range(len(prompts))]
    t0 = time.perf_counter()
    for k in range(TOKENS):
        for seq, ids in zip(seqs, prompts):
            seq.output_token_ids.append(ids[k])
            proc.append_token(seq, ids[k])
    wall = time.perf_counter() - t0
    proc.backend = backend
    return wall


def run(threads: int, rounds: int) -> dict:
    from engine.threads import configure_threads

    configure_threads(threads)
    from engine import Engine, SamplingParams
    from engine.output_processor import OutputProcessor

    engine = Engine(model="smollm2", max_num_seqs=64, max_model_len=1024, seed=0)
    tok = engine.tokenizer
    proc = OutputProcessor(tok, set(), 10 ** 6)
    assert proc.backend is not None, "this tokenizer does not take tokenizers' DecodeStream"
    rows = []
    for batch in BATCHES:
        prompts = text_prompts(tok, batch, TOKENS, seed=batch)
        walls: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * rounds):
            stream = i % 2 == 0
            walls[stream].append(feed(proc, prompts, stream) / (batch * TOKENS))
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        ids = [f"s{batch}-{i}" for i in range(batch)]
        for rid, p in zip(ids, text_prompts(tok, batch, 384, seed=7)):
            engine.add_request(p, params, rid)
        for _ in range(8):
            engine.step()  # prefill, then every sequence decoding
        steps = []
        for _ in range(12):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        for rid in ids:
            engine.abort(rid)
        engine.check_invariants()
        rows.append({"batch": batch, "stream_s": median(walls[True]), "window_s": median(walls[False]),
                     "step_s": median(steps)})
    return {"threads": threads, "rounds": rounds, "rows": rows, "cpu": cpu_name()}


def render(res: dict) -> str:
    lines = ["| batch | DecodeStream us / token | windowed decode us / token | windowed / stream | decode step ms | "
             "detokenization's share of a step: stream / windowed |", "|--:|--:|--:|--:|--:|--:|"]
    for r in res["rows"]:
        share = [r["batch"] * r[k] / (r["step_s"]) for k in ("stream_s", "window_s")]
        lines.append(f"| {r['batch']} | {1e6 * r['stream_s']:.1f} | {1e6 * r['window_s']:.1f} | "
                     f"{r['window_s'] / r['stream_s']:.1f}x | {1e3 * r['step_s']:.1f} | "
                     f"{100 * share[0]:.1f}% / {100 * share[1]:.1f}% |")
    return ("\n".join(lines) + f"\n\n{res['cpu']}, {res['threads']} threads; SmolLM2-135M-Instruct's tokenizer, "
            f"the default engine (`Engine(model='smollm2')`); medians of {res['rounds']} alternating rounds of "
            f"{TOKENS} tokens a sequence; the step: the median decode step at 384 KV slots a sequence.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    res = run(args.threads, args.rounds)
    body = render(res)
    print(body)
    if not args.no_write:
        cmd = "python -m bench.detokenize" + (f" --threads {args.threads}" if args.threads != 2 else "") + \
            (f" --rounds {args.rounds}" if args.rounds != 5 else "")
        write_section(SECTION, cmd, body, RESULTS / "serving_path.md")


if __name__ == "__main__":
    main()
