"""Where each engine's CPU time goes on one offline workload of bench/vs_vllm.py: py-spy (with native frames)
attached to each engine's whole process tree for the timed run only, samples sorted into categories.

    python -m bench.vs_vllm_profile [--workload 64x256/256] [--threads 1] [--rate 50]
    python -m bench.vs_vllm_profile --analyze DIR        # re-read the raw files of an earlier run

py-spy (PyPI) runs from build/vllm-venv (installed there on first use). A sample is put in the first category whose
pattern occurs anywhere in its stack, in the order of CATEGORIES (a GEMM called from the attention module counts
as GEMM). Each share of samples is turned into CPU seconds with the run's measured CPU time of the process tree,
so the two engines compare in seconds per category. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench.vllm_env import ROOT, ensure_model_dir, ensure_venv, venv_python
from bench.vs_vllm_serving import vllm_env

CATEGORIES = [  # (name, patterns; lower-case substrings of a frame)
    ("GEMM (linear layers, LM head)", ("packedlinear", "packed_linear", "_packed_compute_logits", "onednn", "dnnl",
                                       "weight_packed_linear", "sgemm", "mkl_", "addmm", "linear (functional")),
    ("attention kernel", ("cpupagedbackend", "paged_attention", "cpu_attn", "cpu_attention", "attention_impl",
                          "flash_attn", "scaled_dot_product")),
    ("norms, RoPE, SiLU, K/V writes", ("cpulayerops", "rmsnorm", "rms_norm", "rotary", "rope", "silu",
                                       "reshape_and_cache", "write_kv", "cpp_fused")),
    ("compiled-graph glue (inductor / dynamo)", ("torchinductor", "_dynamo", "inductor", "aot_autograd",
                                                 "compiled_fn", "torch/_functorch")),
    ("sampler", ("sampler.py", "/sample/", "sample (")),
    ("scheduler + KV block bookkeeping", ("scheduler.py", "kv_cache_manager", "block_pool", "/core/sched",
                                          "paging/", "single_type_kv")),
    ("detokenize + outputs", ("detokeniz", "output_processor", "tokenization", "tokenizers", "decode (")),
    ("IPC, polling, waiting", ("shm_broadcast", "zmq", "msgspec", "epoll", "select (", "poll (", "futex",
                               "sched_yield", "queue.py", "threading.py")),
    ("model forward, rest", ("forward (", "model_runner", "execute_model")),
]


def classify(stack: str) -> str:
    low = stack.lower()
    for name, patterns in CATEGORIES:
        if any(p in low for p in patterns):
            return name
    return "other"


def read_raw(path: Path) -> Counter:
    """Samples per category from a py-spy raw file ('frame;frame;... count' lines)."""
    counts: Counter = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit() and stack:
            counts[classify(stack)] += int(n)
    return counts


def ensure_py_spy() -> Path:
    exe = venv_python().parent / "py-spy"
    if not exe.exists():
        subprocess.run([str(venv_python()), "-m", "pip", "install", "-q", "py-spy"], check=True)
    return exe


def run(args, out: Path) -> dict:
    from transformers import AutoTokenizer

    from bench.common import text_prompts

    n, rest = args.workload.split("x")
    ilen, olen = (int(x) for x in rest.split("/"))
    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    spec = {"model_dir": str(args.model_dir), "threads": args.threads, "max_num_seqs": 64,
            "max_num_batched_tokens": 2048, "max_model_len": 2048, "kv_cache_gib": 2,
            "warmup_prompts": text_prompts(tok, 2, 16, seed=99),
            "workloads": [{"name": args.workload, "prompts": text_prompts(tok, int(n), ilen), "output_len": olen}],
            "vllm_kwargs": {"enable_prefix_caching": False}, "kvllm_kwargs": {"enable_prefix_caching": False},
            "profile": {"py_spy": str(ensure_py_spy()), "out": str(out), "native": True, "rate": args.rate}}
    (out / "spec.json").write_text(json.dumps(spec))
    results = {}
    for engine in ("kvllm", "vllm"):
        cmd = ([str(venv_python()), str(ROOT / "bench" / "vs_vllm_offline.py"), "vllm"] if engine == "vllm"
               else [sys.executable, "-m", "bench.vs_vllm_offline", "kvllm"])
        cmd += ["--spec", str(out / "spec.json"), "--out", str(out / f"{engine}.json")]
        with open(out / f"{engine}.log", "w") as f:
            subprocess.run(cmd, env=vllm_env(args.threads) if engine == "vllm" else None, cwd=ROOT, stdout=f,
                           stderr=subprocess.STDOUT, check=True)
        results[engine] = json.loads((out / f"{engine}.json").read_text())
    return results


def table(out: Path) -> str:
    rows, cpu = {}, {}
    for engine in ("kvllm", "vllm"):
        raw = next(out.glob(f"{engine}_t*.txt"))
        rows[engine] = read_raw(raw)
        w = json.loads((out / f"{engine}.json").read_text())["workloads"][0]
        cpu[engine] = (w["cpu_s"], w["wall_s"], w["output_tokens"])
    names = [c for c, _ in CATEGORIES] + ["other"]
    lines = ["| category | kvllm share | kvllm CPU s | vLLM share | vLLM CPU s |", "|---|---:|---:|---:|---:|"]
    for name in names:
        cells = []
        for engine in ("kvllm", "vllm"):
            total = sum(rows[engine].values()) or 1
            share = rows[engine][name] / total
            cells += [f"{100 * share:.1f}%", f"{share * cpu[engine][0]:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **total (measured CPU s of the process tree; wall s)** | | "
                 f"{cpu['kvllm'][0]:.2f} ({cpu['kvllm'][1]:.2f}) | | {cpu['vllm'][0]:.2f} ({cpu['vllm'][1]:.2f}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="64x256/256", help="NxIN/OUT")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--analyze", default=None, help="only tabulate the raw files in this folder")
    args = ap.parse_args()
    if args.analyze:
        print(table(Path(args.analyze)))
        return
    ensure_venv()
    args.model_dir = ensure_model_dir()
    out = ROOT / "build" / "vs_vllm" / ("profile-" + time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    run(args, out)
    print(f"raw samples in {out}")
    print(table(out))


if __name__ == "__main__":
    main()
