"""`kvllm serve` with the engine in a process of its own (`--engine-process`, the default) against one process
(`--no-engine-process`: the engine loop in a thread beside the HTTP event loop), same model, threads and workload.

    python -m bench.engine_process [--threads 1,2] [--repeats 2] [--client vllm|kvllm] [--no-write]

The workload is the serving part of bench/vs_vllm.py (32 real-text prompts of 128 tokens, 128 new tokens, greedy,
ignore_eos, request rate inf, max concurrency 16) on SmolLM2 as a float32 Hugging Face directory (bench/vllm_env.py).
The client is `vllm bench serve` when build/vllm-venv exists (else `kvllm bench serve`). The two modes alternate,
`--repeats` times each, at every thread count; the table gives medians and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.common import write_section
from bench.vllm_env import ROOT, ensure_model_dir, venv_python
from bench.vs_vllm import SIZES, common_flags, write_prompts
from bench.vs_vllm_serving import Workload, display, kvllm_server, run_client

TITLE = "Serving: the engine in its own process vs one process"
MODES = {"engine process": ["--engine-process"], "one process": ["--no-engine-process"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--client", choices=["vllm", "kvllm"], default=None)
    ap.add_argument("--port", type=int, default=8792)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    client = args.client or ("vllm" if venv_python().exists() else "kvllm")
    out = ROOT / "build" / "engine_process" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    n, ilen, olen, conc = SIZES["serving"][False]
    w = Workload(write_prompts(tok, out / "serving.jsonl", n, ilen, seed=5), n, olen, conc)
    t0 = time.perf_counter()
    runs: list[dict] = []
    cmds: dict[str, str] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        for rep in range(args.repeats):
            for mode, flags in MODES.items():
                server = kvllm_server(model_dir, args.port, threads, out / f"{mode[:3]}_t{threads}_{rep}.log",
                                      flags=common_flags("kvllm") + flags)
                with server:
                    res = out / f"{mode[:3]}_t{threads}_{rep}.json"
                    r = run_client(client, server, w, model_dir, res, out / (res.stem + ".client.log"))
                cmds[mode] = display(server.cmd)
                cmds["client"] = display(r["_command"].split())
                runs.append({"threads": threads, "mode": mode, "ok": r["completed"], "failed": r["failed"],
                             "tok_s": r["output_throughput"], "ttft": r["median_ttft_ms"],
                             "tpot": r["median_tpot_ms"], "cores": r["_server_cpu_s"] / r["duration"]})
                print(json.dumps(runs[-1]), flush=True)
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    body = render(runs, client, cmds, time.perf_counter() - t0)
    print(body)
    if not args.no_write:
        write_section(TITLE, f"python -m bench.engine_process --threads {args.threads} --repeats {args.repeats}",
                      body)


def render(runs: list[dict], client: str, cmds: dict[str, str], seconds: float) -> str:
    lines = ["| threads | server | runs | ok / failed | output tok/s (median) | vs one process | median TTFT ms | "
             "median TPOT ms | server cores busy |", "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for threads in sorted({r["threads"] for r in runs}):
        med = {}
        for mode in MODES:
            rs = [r for r in runs if r["threads"] == threads and r["mode"] == mode]
            med[mode] = {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "ttft", "tpot", "cores")}
            med[mode]["n"], med[mode]["ok"] = len(rs), (sum(r["ok"] for r in rs), sum(r["failed"] for r in rs))
        for mode, m in med.items():
            ratio = f"{m['tok_s'] / med['one process']['tok_s']:.2f}x"
            lines.append(f"| {threads} | {mode} | {m['n']} | {m['ok'][0]} / {m['ok'][1]} | {m['tok_s']:.1f} | "
                         f"{ratio} | {m['ttft']:.0f} | {m['tpot']:.1f} | {m['cores']:.2f} |")
    notes = (f"\nClient: {'`vllm bench serve` (vLLM 0.32 CPU build, its own venv)' if client == 'vllm' else 'kvllm bench serve'}"
             f"; workload as the serving part of bench/vs_vllm.py (32 x 128-token real-text prompts, 128 new tokens, "
             f"greedy, ignore_eos, rate inf, max concurrency 16); the modes alternate. 'server cores busy': CPU "
             f"seconds of the server's process tree over the client's measured window / its duration. "
             f"{seconds:.0f} s.\n\n```\n" + "\n".join(f"{k}: {v}" for k, v in cmds.items()) + "\n```\n")
    return "\n".join(lines) + "\n" + notes


if __name__ == "__main__":
    main()
