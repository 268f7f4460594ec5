"""Tensor parallelism and replicas on this CPU, through the public API only.

1. Offline throughput, TP=1 vs TP=2 (`Engine(..., tensor_parallel_size=2)`): a random Llama of SmolLM2-135M's size
   with heads that split in two (SmolLM2's own 9 query heads do not), the same requests at TP=1 (1 and all
   threads) and TP=2 (one thread per rank); and the real SmolLM2 at TP=1 vs TP=3 (`--smollm2-tp3`).
2. Data parallelism: `kvllm serve` replicas behind sglang-router, load-tested with `kvllm bench serve`, against
   one replica alone (`--replicas`).

On a 2-core machine tensor parallelism cannot be faster: each rank has one core and the ranks synchronise twice per
layer (gloo all-reduce over loopback); the point is that it runs, gives TP=1's tokens, and what it costs.

    .venv/bin/python -m bench.tp_throughput [--num-prompts 16] [--input-len 128] [--output-len 64] \
        [--smollm2-tp3] [--replicas] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, text_prompts, write_section
from engine import Engine, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def smollm2_shaped_llama(path: Path) -> Path:
    """Random weights, SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, vocabulary 49152, tied embeddings)
    with 8 query / 4 KV heads of 72 so that two ranks split them; SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.loader import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=72, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def offline(model: str, tp: int, threads: int, prompts, output_len: int, **engine_kwargs) -> dict:
    """One engine, one batch of greedy requests: output tokens/s, start-up time, the tokens."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    engine = Engine(model=model, dtype="float32", device="cpu", tensor_parallel_size=tp, **engine_kwargs)
    t1 = time.perf_counter()
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        t2 = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t2
        steps = engine.stats().num_steps
    finally:
        engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(len(t) for t in tokens)
    return {"tp": tp, "threads": threads, "startup_s": t1 - t0, "seconds": elapsed, "tok_s": n / elapsed,
            "ms_per_step": 1e3 * elapsed / max(1, steps), "tokens": tokens, "load": os.getloadavg()[0]}


def offline_table(runs: list[dict], ref: dict) -> str:
    rows = ["| engine | torch threads per rank | start-up | output tok/s | ms per step | vs TP=1 (1 thread) | "
            "greedy tokens equal to TP=1 | host load average |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = next(r for r in runs if r["tp"] == 1 and r["threads"] == 1)["tok_s"]
    for r in runs:
        same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"]))
        rows.append(f"| TP={r['tp']} | {r['threads']} | {r['startup_s']:.1f} s | {r['tok_s']:.1f} | "
                    f"{r['ms_per_step']:.1f} | {r['tok_s'] / base:.2f}x | {same}/{len(ref['tokens'])} | "
                    f"{r['load']:.1f} |")
    return "\n".join(rows)


# ---- replicas behind the router -------------------------------------------------------------------------------
def _free_port() -> int:
    from engine.distributed.parallel_state import free_port

    return free_port()


def _wait_ok(url: str, procs, timeout: float, post: dict | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, p.args[:6]))} exited with {p.returncode}")
        try:
            r = httpx.post(url, json=post, timeout=60) if post is not None else httpx.get(url, timeout=5)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout:.0f} s")
        time.sleep(1)


def _serve(model: str, port: int, threads: int, log: Path, extra=()) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", model, "--port", str(port), "--dtype",
                             "float32", "--device", "cpu", "--max-model-len", "1024", "--num-kv-blocks", "256",
                             "--disable-uvicorn-access-log", *extra],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _bench(base_url: str, model_name: str, tokenizer: str, args, out: Path) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", base_url, "--model", model_name,
           "--tokenizer", tokenizer, "--num-prompts", str(args.serve_prompts), "--max-concurrency",
           str(args.serve_concurrency), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--disable-tqdm", "--save-result", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-2000:])
    return json.loads(out.read_text()), r.stdout[r.stdout.find("============ Serving"):].strip()


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def replicas(args, work: Path) -> tuple[str, str]:
    """One replica with every core vs two replicas with one thread each behind sglang-router; same load."""
    cores = os.cpu_count() or 1
    results, tables = [], {}
    setups = [("1 replica, direct", 1, 1), ("2 replicas + sglang-router", 2, max(1, cores // 2))]
    if cores > 1:
        setups.insert(1, ("1 replica, direct", 1, cores))
    for label, n_rep, threads in setups:
        procs, urls = [], []
        try:
            for i in range(n_rep):
                port = _free_port()
                urls.append(f"http://127.0.0.1:{port}")
                procs.append(_serve("smollm2", port, threads, work / f"{n_rep}-replica{i}.log"))
            for u in urls:
                _wait_ok(u + "/health", procs, 600)
            base = urls[0]
            if n_rep > 1:
                rport = _free_port()
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                     str(rport), "--worker-urls", *urls, "--policy", args.policy, "--log-level", "warn"],
                    stdout=open(work / "router.log", "w"), stderr=subprocess.STDOUT))
                base = f"http://127.0.0.1:{rport}"
                _wait_ok(base + "/v1/completions", procs, 300, {"model": "smollm2", "prompt": "Hi", "max_tokens": 1})
            res, table = _bench(base, "smollm2", "smollm2", args, work / f"{n_rep}.json")
            results.append((label, threads, res, os.getloadavg()[0]))
            tables[label] = table
        finally:
            _stop(procs[::-1])
    rows = ["| setup | torch threads per replica | req/s | output tok/s | median TTFT (ms) | median TPOT (ms) | "
            "P99 E2EL (ms) | failed | host load average |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, threads, r, load in results:
        rows.append(f"| {label} | {threads} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                    f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {r['p99_e2el_ms']:.0f} | "
                    f"{r['failed']} | {load:.1f} |")
    return "\n".join(rows), tables["2 replicas + sglang-router"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--smollm2-tp3", action="store_true", help="also the real SmolLM2 at TP=1 vs TP=3")
    ap.add_argument("--replicas", action="store_true", help="also replicas behind sglang-router (kvllm bench serve)")
    ap.add_argument("--serve-prompts", type=int, default=64)
    ap.add_argument("--serve-concurrency", type=int, default=16)
    ap.add_argument("--policy", default="round_robin", help="sglang-router policy")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/results/parallelism.md")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    cmd = "python -m bench.tp_throughput " + " ".join(sys.argv[1:])
    kw = dict(num_kv_blocks=512, max_model_len=1024, max_num_seqs=args.num_prompts, swap_space=0)
    with tempfile.TemporaryDirectory(prefix="kvllm-tp-bench-") as tmp:
        work = Path(tmp)
        model = str(smollm2_shaped_llama(work / "llama-8q4kv"))
        from transformers import AutoTokenizer

        prompts = text_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts, args.input_len)
        runs = [offline(model, 1, 1, prompts, args.output_len, **kw)]
        if cores > 1:
            runs.append(offline(model, 1, cores, prompts, args.output_len, **kw))
        runs.append(offline(model, 2, max(1, cores // 2), prompts, args.output_len, **kw))
        body = offline_table(runs, runs[0])
        body += (f"\n\nA random Llama of SmolLM2-135M's size (30 layers, hidden 576, 8 query / 4 KV heads of 72, "
                 f"fp32), {args.num_prompts} requests x {args.input_len}-token real-text prompts, "
                 f"{args.output_len} new tokens, greedy, all requests in one batch. 'ms per step' is the batch's "
                 f"wall time over its engine steps (prefill and decode). {cores} CPU cores shared by all ranks, and "
                 f"with whatever else runs on the host (its 1-minute load average at the end of each run is in the "
                 f"last column: above {cores} the ranks wait for cores, and OpenMP threads that spin-wait for a busy "
                 f"core collapse).")
        if args.smollm2_tp3:
            smol = [offline("smollm2", 1, 1, prompts, args.output_len, **kw),
                    offline("smollm2", 3, 1, prompts, args.output_len, **kw)]
            body += "\n\nThe real SmolLM2-135M-Instruct (9 query / 3 KV heads: one KV head per rank at TP=3, three " \
                    f"processes on {cores} cores):\n\n" + offline_table(smol, smol[0])
        print(body)
        if not args.no_write:
            write_section("Tensor parallelism on CPU: TP=1 vs TP=2 offline throughput", cmd, body, RESULTS / "parallelism.md")
        if args.replicas:
            table, bench_out = replicas(args, work)
            rbody = (f"{table}\n\n`kvllm bench serve --num-prompts {args.serve_prompts} --max-concurrency "
                     f"{args.serve_concurrency} --input-len {args.input_len} --output-len {args.output_len} "
                     f"--ignore-eos` against one `kvllm serve smollm2` (1 and {cores} torch threads) and against "
                     f"sglang-router (`--policy {args.policy}`) in front of two replicas with {max(1, cores // 2)} "
                     f"thread(s) each, everything (clients, router, replicas) on this {cores}-core machine. The "
                     f"router run's full table:\n\n```\n{bench_out}\n```")
            print(rbody)
            if not args.no_write:
                write_section("Replicas behind sglang-router (kvllm bench serve)", cmd, rbody, RESULTS / "parallelism.md")


if __name__ == "__main__":
    main()
