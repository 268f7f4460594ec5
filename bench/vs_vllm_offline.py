"""Offline-throughput worker of bench/vs_vllm.py: one engine, one thread count, every workload, one JSON result.

    build/vllm-venv/bin/python bench/vs_vllm_offline.py vllm  --spec SPEC.json --out OUT.json   (vLLM's venv)
    .venv/bin/python -m bench.vs_vllm_offline kvllm --spec SPEC.json --out OUT.json             (the project's)

SPEC holds the model directory, threads, engine limits and the workloads (token-id prompts + output length). Each
engine gets every prompt at once (vLLM's `LLM.generate`; kvllm's public add_request/step loop with no client-side
cap), greedy, ignore_eos, after an untimed warm-up on other prompts. Only the standard library is imported at the
top: the vLLM side runs in a venv without this project's packages.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def tree_cpu(pid: int | None = None) -> dict[str, float]:
    """User + system CPU seconds so far of every thread of a process and its descendants (vLLM's engine core and
    worker are child processes), keyed 'process name/thread name/thread id'. On a shared machine wall time also
    measures the neighbours; CPU time much less so, and the busiest thread bounds the run's time on idle cores."""
    import psutil

    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            name, threads = proc.name(), proc.threads()
        except psutil.NoSuchProcess:
            continue
        for t in threads:
            try:
                with open(f"/proc/{proc.pid}/task/{t.id}/comm") as f:
                    tname = f.read().strip()
            except OSError:
                tname = "?"
            out[f"{name}/{tname}/{t.id}"] = t.user_time + t.system_time
    return out


def tree_cpu_seconds(pid: int | None = None) -> float:
    return sum(tree_cpu(pid).values())


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-thread CPU seconds between two tree_cpu() readings (threads that used under 10 ms dropped)."""
    d = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    return {k: v for k, v in d.items() if v >= 0.01}


def cpu_summary(threads: dict[str, float]) -> dict:
    """Total CPU seconds, per process name, and the busiest thread's."""
    by_process: dict[str, float] = {}
    for key, v in threads.items():
        name = key.split("/", 1)[0]
        by_process[name] = round(by_process.get(name, 0.0) + v, 2)
    busiest = max(threads.items(), key=lambda kv: kv[1], default=("-", 0.0))
    return {"total": round(sum(threads.values()), 2), "by_process": by_process, "busiest_thread": busiest[0],
            "busiest_s": busiest[1]}


def _timed(fn):
    """(fn's result, wall seconds, CPU seconds of this process tree by process name)."""
    c0, t0 = tree_cpu(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, cpu_delta(c0, tree_cpu())


def _result(name: str, runs: list[tuple[float, dict]], outs: list[list[int]], output_len: int) -> dict:
    """Output tok/s of the repeat with the median wall time (runs: (wall s, CPU s by process) of each repeat)."""
    tokens = sum(len(o) for o in outs)
    if tokens != len(outs) * output_len:
        raise RuntimeError(f"{name}: {tokens} output tokens, expected {len(outs)} x {output_len}")
    wall, cpu = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    summary = cpu_summary(cpu)
    return {"name": name, "wall_s": wall, "cpu_s": summary["total"], "cpu": summary, "cpu_threads": cpu,
            "runs": [r[0] for r in runs], "output_tokens": tokens, "tok_s": tokens / wall,
            "tok_per_cpu_s": tokens / max(summary["total"], 1e-9),
            "tok_per_busiest_s": tokens / max(summary["busiest_s"], 1e-9), "first_ids": [o[:64] for o in outs[:8]]}


def run_vllm(spec: dict) -> dict:
    threads = int(spec["threads"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gib"]))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "float32"), max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_model_len"], seed=0,
              **spec.get("vllm_kwargs", {}))
    startup = time.perf_counter() - t0

    def generate(prompts, output_len):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    t0 = time.perf_counter()
    generate(spec["warmup_prompts"], 8)
    warmup = time.perf_counter() - t0
    results = []
    for w in spec["workloads"]:
        runs = []
        for _ in range(spec.get("repeats", 1)):
            outs, wall, cpu = _timed(lambda: generate(w["prompts"], w["output_len"]))
            runs.append((wall, cpu))
        results.append(_result(w["name"], runs, outs, w["output_len"]))
    return {"engine": "vllm", "threads": threads, "startup_s": startup, "warmup_s": warmup, "workloads": results}


def run_kvllm(spec: dict) -> dict:
    from engine.threads import configure_threads

    threads = int(spec["threads"])
    configure_threads(threads)
    t0 = time.perf_counter()
    from bench.common import run_requests
    from engine import Engine, SamplingParams

    engine = Engine(model=spec.get("kvllm_model", spec["model_dir"]), dtype=spec.get("dtype", "float32"),
                    device="cpu",
                    max_num_seqs=spec["max_num_seqs"],
                    max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_model_len"],
                    kv_cache_memory=f"{spec['kv_cache_gib']}GiB", seed=0, **spec.get("kvllm_kwargs", {}))
    startup = time.perf_counter() - t0

    def generate(prompts, output_len, prefix):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        outs, _ = run_requests(engine, prompts, params, len(prompts), prefix=prefix)
        engine.check_invariants()
        return [list(o.outputs[0].token_ids) for o in outs]

    t0 = time.perf_counter()
    generate(spec["warmup_prompts"], 8, "warm")
    warmup = time.perf_counter() - t0
    results = []
    for w in spec["workloads"]:
        runs = []
        for i in range(spec.get("repeats", 1)):
            outs, wall, cpu = _timed(lambda: generate(w["prompts"], w["output_len"], f"{w['name']}-{i}"))
            runs.append((wall, cpu))
        results.append(_result(w["name"], runs, outs, w["output_len"]))
    return {"engine": "kvllm", "threads": threads, "startup_s": startup, "warmup_s": warmup, "workloads": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["vllm", "kvllm"])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    result = (run_vllm if args.engine == "vllm" else run_kvllm)(spec)
    with open(args.out, "w") as f:
        json.dump(result, f)
    for w in result["workloads"]:
        print(f"{args.engine} threads={result['threads']} {w['name']}: {w['tok_s']:.1f} output tok/s "
              f"({w['wall_s']:.1f} s; startup {result['startup_s']:.1f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
