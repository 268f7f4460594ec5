"""layer_ops 'fused' (the decoder stack as one C++ call, engine/models/fused_layers.py) against 'cpu' (one C++ op per
call from the Python layer loop): two engines on SmolLM2 in one interpreter, the same requests in both, their steps
timed in alternation. Rows: the decode batches of bench/vs_vllm.py (running sequences x KV slots) and a 2048-token
prefill step; each thread count in its own interpreter (OpenMP reads its wait policy when torch loads).

    python -m bench.fused_layers                       # threads 1,2
    python -m bench.fused_layers --threads 1 --steps 10 --no-write
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# (name, running sequences, KV slots each; 0 new tokens: a prefill step of `batch` prompts of `slots` tokens)
WORKLOADS = [("decode, offline 64 x 256/256", 64, 384), ("decode, offline 32 x 128/128", 32, 192),
             ("decode, serving 16 at once", 16, 192), ("decode, 1 sequence", 1, 256),
             ("prefill, 16 x 128 tokens", 16, 128)]
OPS = ("fused", "cpu")


def child(spec: dict) -> dict:
    from engine.threads import configure_threads

    configure_threads(spec["threads"])
    from bench.common import median, text_prompts
    from engine import Engine, SamplingParams

    engines = {ops: Engine(model="smollm2", dtype="float32", device="cpu", max_num_seqs=64,
                           max_num_batched_tokens=2048, max_model_len=1024, kv_cache_memory="2GiB", seed=0,
                           enable_prefix_caching=False, layer_ops=ops) for ops in OPS}
    rows = []
    for name, batch, slots in WORKLOADS:
        prefill = name.startswith("prefill")
        walls = {ops: [] for ops in OPS}
        tokens = {ops: [] for ops in OPS}
        for rep in range(spec["steps"] if prefill else 1):
            params = SamplingParams(temperature=0, max_tokens=1 if prefill else spec["steps"] + 8, ignore_eos=True)
            prompts = text_prompts(engines["fused"].tokenizer, batch, slots, seed=batch + rep)
            for ops, eng in engines.items():
                for i, p in enumerate(prompts):
                    eng.add_request(p, params, f"{name}-{rep}-{i}")
            if prefill:  # the whole batch in one step: time that step, alternating the engines
                for ops, eng in engines.items():
                    t0 = time.perf_counter()
                    outs = eng.step()
                    walls[ops].append(time.perf_counter() - t0)
                    tokens[ops] += [o.outputs[0].token_ids for o in sorted(outs, key=lambda o: o.request_id)]
                continue
            for eng in engines.values():  # prefill, then the first step with every sequence decoding
                prefilled = eng.stats().prompt_tokens_total + batch * slots
                while eng.stats().prompt_tokens_total < prefilled:
                    eng.step()
                eng.step()
            for _ in range(spec["steps"]):
                for ops, eng in engines.items():
                    t0 = time.perf_counter()
                    eng.step()
                    walls[ops].append(time.perf_counter() - t0)
            for ops, eng in engines.items():
                for i in range(batch):
                    eng.abort(f"{name}-{rep}-{i}")
        for eng in engines.values():
            eng.check_invariants()
        rows.append({"workload": name, "batch": batch, "slots": slots,
                     **{ops: median(walls[ops]) for ops in OPS},
                     "ratios": sorted(c / f for f, c in zip(walls["fused"], walls["cpu"])),
                     "same_tokens": tokens["fused"] == tokens["cpu"] if prefill else None})
    return {"rows": rows}


def run_child(threads: int, steps: int) -> dict:
    spec = json.dumps({"threads": threads, "steps": steps})
    proc = subprocess.run([sys.executable, "-m", "bench.fused_layers", "--child", spec], capture_output=True,
                          text=True)
    if proc.returncode:
        raise RuntimeError(f"child at {threads} threads failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: dict[int, dict]) -> str:
    from bench.common import median

    lines = ["| threads | step | fused | cpu (per-layer ops) | cpu / fused (median of pairs) |",
             "|---:|---|---:|---:|---:|"]
    for threads, res in results.items():
        for row in res["rows"]:
            lines.append(f"| {threads} | {row['workload']}: {row['batch']} x {row['slots']} | "
                         f"{1e3 * row['fused']:.1f} ms | {1e3 * row['cpu']:.1f} ms | {median(row['ratios']):.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per engine and row (prefill: repeats)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from bench.common import write_section

    t0 = time.time()
    results = {int(t): run_child(int(t), args.steps) for t in args.threads.split(",")}
    same = all(r["same_tokens"] is not False for res in results.values() for r in res["rows"])
    body = (table(results) + "\n\nSmolLM2-135M-Instruct, float32, gemm_backend auto (the GGUF blocks), two engines "
            "in one interpreter with the same requests, layer_ops 'fused' and 'cpu', their steps timed in alternation "
            "(decode rows: every sequence running, greedy; the prefill row: one step of 16 prompts, its first tokens "
            f"{'equal' if same else 'DIFFERENT'} on both). {time.time() - t0:.0f} s.")
    print(body)
    if not args.no_write:
        cmd = "python -m bench.fused_layers" + ("" if args.threads == "1,2" else f" --threads {args.threads}")
        write_section("Decoder stack in one C++ call (layer_ops fused vs cpu)", cmd, body)


if __name__ == "__main__":
    main()
