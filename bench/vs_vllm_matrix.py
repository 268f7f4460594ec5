"""The serving matrix of bench/vs_vllm.py (`--parts matrix`): every cell of bench/vs_vllm_cells.py under vLLM's
client (`vllm bench serve`) against `kvllm serve` and `vllm serve`, side by side in one run.

    python -m bench.vs_vllm --parts matrix [--cells GLOBS] [--quick] [--no-write] [--skip-check]

Server configurations, each launched once for all its cells (vLLM takes 45-90 s to start here):
  defaults  each server's launch line with only the model, host, port and served name (`vllm serve DIR`,
            `kvllm serve smollm2`); VLLM_CPU_KVCACHE_SPACE=2 for both, vLLM's OpenMP threads bound to 2 cores,
            kvllm given `--threads 2` only where it would not pick 2 itself (one thread per core).
  explicit  both given the same dtype, batch limits, max_model_len, prefix caching (off) and KV memory.
  memory    12 chat requests of ~200 + 1,024 tokens sent at once to a KV pool for 3 uncompressed sequences,
            both servers at their defaults but for the pool size: vLLM, kvllm, `kvllm --kv-compression kara`.
Then kvllm's decode step at the batch of the chat cell at concurrency 32 (bench/step_floor.py), against its floor.

Before a launch's cells, one unmeasured burst of chat requests warms the server; the cells themselves send no
test request nor warm-ups (the server is up and warm), so each cell's numbers are its requests only.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from bench import step_floor
from bench.common import commit, write_section
from bench.vs_vllm_cells import (CONFIGS, ENDPOINTS, MEMORY, MEMORY_CONFIG, REPRO, cell_named, cell_seed,
                                 plan, reference_prompts, select, sizes)
from bench.vs_vllm_matrix_report import render, section
from bench.vs_vllm_serving import Workload, display, kvllm_server, run_client, vllm_server
from engine.threads import available_cores

THREADS, KV_GIB = 2, 2  # the setting: 2 threads, VLLM_CPU_KVCACHE_SPACE=2 for both servers
# equal explicit settings: the dtype both pick by default on an AVX512-BF16 CPU, kvllm's default batch limits
EXPLICIT = ["--dtype", "bfloat16", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--max-model-len",
            "2048", "--no-enable-prefix-caching"]
EXPLICIT_KVLLM = EXPLICIT + ["--kv-cache-memory", f"{KV_GIB}GiB"]  # and --threads 2 (vLLM: the binding env)
BLOCKS = {"vllm": 128, "kvllm": 16}  # each server's default KV block on CPU (tokens)
WARMUP = (16, 256, 16)  # requests, prompt tokens, output tokens of the burst before a launch's cells


def server_for(engine: str, config: str, args, log: Path, extra: list[str] = ()):
    """A server launched as `config` says, with `extra` flags after its own."""
    if engine == "vllm":
        flags = (EXPLICIT if config == "explicit" else []) + list(extra)
        return vllm_server(args.model_dir, args.port, THREADS, log, kv_gib=KV_GIB, flags=flags, bare=True)
    flags = (EXPLICIT_KVLLM if config == "explicit" else []) + list(extra)
    # kvllm serve runs one thread per core unless told: at its defaults --threads only where that is not THREADS
    threads = THREADS if config == "explicit" or available_cores() != THREADS else None
    server = kvllm_server(args.kvllm_model, args.port, threads, log, flags=flags, bare=True)
    server.env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_GIB)  # kvllm's default pool reads it too (2 GiB unset)
    return server


def launch_line(server) -> str:
    """The launch line with the environment variables a user would set (the others are this bench's plumbing)."""
    keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND") if server.name == "vllm" else ()
    env = " ".join(f"{k}={server.env[k]}" for k in keys if k in server.env)
    return (env + " " if env else "") + display(server.cmd)


def write_prompts(tok, path: Path, n: int, length: int, seed: int) -> Path:
    with open(path, "w") as f:
        for text in reference_prompts(tok, n, length, seed):
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def cell_workload(cell, args, tok, out: Path) -> Workload:
    n, ilen, olen = sizes(cell, args.quick)
    data = write_prompts(tok, out / f"prompts_{cell.name}.jsonl", n, ilen, cell_seed(cell.name))
    return Workload(data, n, olen, cell.concurrency, request_rate=cell.rate, num_warmups=0, test_request=False,
                    endpoint=ENDPOINTS[cell.endpoint])


def run_launch(engine: str, config: str, names: list[str], args, tok, out: Path, data: dict) -> None:
    """One server launch: warm it, then its cells in order. A cell that fails is recorded and the next one runs."""
    server = server_for(engine, config, args, out / f"server_{config}_{engine}.log")

    def started() -> None:
        data["launches"].append({"config": config, "server": engine, "startup_s": server.startup_s,
                                 "idle_cores": server.idle_cores, "command": launch_line(server)})
        print(f"matrix: {config} {engine} up in {server.startup_s:.0f} s", flush=True)

    serve_cells(server, f"{config}_{engine}", names, args, tok, out, data["errors"],
                lambda name: data["rows"].append(run_cell(server, config, cell_named(name), args, tok, out, data)),
                started)


def serve_cells(server, tag: str, names: list[str], args, tok, out: Path, errors: list[str], run_one,
                started=None) -> None:
    """Start `server`, warm it with a chat burst, then `run_one(name)` for each cell name; the server stops however
    this ends (it runs in its own process group). A launch that fails is recorded in `errors` with `tag`."""
    n, ilen, olen = (4, 32, 8) if args.quick else WARMUP
    warm = Workload(write_prompts(tok, out / "prompts_warmup.jsonl", n, ilen, seed=1), n, olen, n, num_warmups=0,
                    test_request=False, endpoint=ENDPOINTS["chat"])
    try:
        try:
            server.start()
            if started is not None:
                started()
            run_client("vllm", server, warm, args.model_dir, out / f"warmup_{tag}.json", out / f"warmup_{tag}.log")
        except RuntimeError as err:  # recorded; the next launch runs
            errors.append(f"{tag}: {err}")
            print(f"{tag} failed: {err}", flush=True)
            return
        for name in names:
            run_one(name)
    finally:
        server.stop()


def run_cell(server, config: str, cell, args, tok, out: Path, data: dict) -> dict:
    res = out / f"{config}_{cell.name}_{server.name}.json"
    row = {"config": config, "cell": cell.name, "server": server.name, "result_path": str(res)}
    try:
        row["result"] = run_client("vllm", server, cell_workload(cell, args, tok, out), args.model_dir, res,
                                   out / f"{res.stem}.log")
    except RuntimeError as err:  # recorded; the next cell runs
        row["error"] = str(err)
        data["errors"].append(f"{config} {cell.name} {server.name}: {err}")
    r = row.get("result")
    print(f"  {config} {cell.name} {server.name}: " + (f"{r['completed']} ok / {r['failed']} failed, "
                                                       f"{r['output_throughput']:.1f} tok/s" if r else "FAILED"),
          flush=True)
    return row


KARA_W64 = {"method": "kara", "window": 64, "buffer": 8, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 8,
            "compression_period": 56}  # bench/vs_vllm.py's KARA (bench/compression_throughput.py's settings)


def memory_flags(args, tok, out: Path) -> tuple[Workload, dict[str, list[str]], dict[str, int]]:
    """The memory cell's workload, each server's pool flags and its pool in tokens: `pool_seqs` sequences of the
    longest chat prompt (as the server templates it) plus the output, in each server's own block size."""
    n, ilen, olen = sizes(MEMORY, args.quick)
    data = write_prompts(tok, out / f"prompts_{MEMORY.name}.jsonl", n, ilen, cell_seed(MEMORY.name))
    prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
    templated = max(len(tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False)).input_ids) for p in prompts)
    seq = templated + olen + 1  # +1: a re-tokenized prompt may come out a token longer
    per_seq = {k: math.ceil(seq / b) for k, b in BLOCKS.items()}
    max_len = ["--max-model-len", str(seq + 32)]
    # vLLM's block pool keeps one of its blocks as the null block: one more makes the usable pools equal
    flags = {"vllm": max_len + ["--block-size", str(BLOCKS["vllm"]), "--num-gpu-blocks-override",
                                str(MEMORY.pool_seqs * per_seq["vllm"] + 1)],
             "kvllm": max_len + ["--block-size", str(BLOCKS["kvllm"]), "--num-kv-blocks",
                                 str(MEMORY.pool_seqs * per_seq["kvllm"])]}
    flags["kvllm+kara"] = flags["kvllm"] + ["--kv-compression", "kara"]
    # the throughput benches' tuned Kara (a round every 56 tokens): why it is faster than the default and what it costs
    flags["kvllm+kara-w64"] = flags["kvllm"] + ["--kv-compression", json.dumps(KARA_W64, separators=(",", ":"))]
    pools = {k: MEMORY.pool_seqs * per_seq[k.split("+")[0]] * BLOCKS[k.split("+")[0]] for k in flags}
    w = Workload(data, n, olen, None, num_warmups=0, test_request=False, endpoint=ENDPOINTS[MEMORY.endpoint])
    return w, flags, pools


def run_memory(args, tok, out: Path, data: dict) -> None:
    w, flags, pools = memory_flags(args, tok, out)
    kvllm = ["kvllm", "kvllm+kara", "kvllm+kara-w64"]
    order = ["vllm", *kvllm] if args.engine_order[0] == "vllm" else [*kvllm, "vllm"]
    for name in [s for s in order if s.split("+")[0] in args.engine_order]:
        server = server_for(name.split("+")[0], MEMORY_CONFIG, args, out / f"server_memory_{name}.log", flags[name])
        res = out / f"memory_{name}.json"
        row = {"config": MEMORY_CONFIG, "cell": MEMORY.name, "server": name, "pool_tokens": pools[name],
               "result_path": str(res)}
        try:
            with server:
                data["launches"].append({"config": MEMORY_CONFIG, "server": name, "startup_s": server.startup_s,
                                         "idle_cores": server.idle_cores, "command": launch_line(server)})
                row["result"] = run_client("vllm", server, w, args.model_dir, res, out / f"{res.stem}.log")
        except RuntimeError as err:
            row["error"] = str(err)
            data["errors"].append(f"memory {name}: {err}")
        data["rows"].append(row)
        r = row.get("result")
        print(f"  memory {name}: " + (f"{r['completed']} ok / {r['failed']} failed, {r['output_throughput']:.1f} "
                                      f"tok/s, preemptions {r['_counters'].get('num_preemptions')}" if r else
                                      "FAILED"), flush=True)


def run_floor(args, data: dict) -> None:
    """kvllm's decode step at the batch of the REPRO cell's kvllm run (its concurrency, its mean prompt as the
    server counted it plus half the output) and that step's floors (bench/step_floor.py), no server running; at the
    defaults' run where there is one, else the explicit one's, at that configuration's dtype."""
    ran = [r for r in data["rows"] if r["cell"] == REPRO and r["server"] == "kvllm" and "result" in r]
    row = next((r for r in ran if r["config"] == "defaults"), ran[0] if ran else None)
    if row is None:
        return
    dtype = EXPLICIT[EXPLICIT.index("--dtype") + 1] if row["config"] == "explicit" else "auto"
    r = row["result"]
    batch = min(cell_named(REPRO).concurrency, r["completed"])
    prompt = round(r["total_input_tokens"] / max(r["completed"], 1))
    output = sizes(cell_named(REPRO), args.quick)[2]
    slots = prompt + output // 2
    try:
        res = step_floor.run_child(THREADS, 4 if args.quick else 12, dtype=dtype,
                                   workloads=[(REPRO, batch, slots)], offline=[], prefills=[(REPRO, prompt)])
    except RuntimeError as err:
        data["errors"].append(f"floor: {err}")
        return
    gemm, kv = step_floor.floors(res["rates"], res["rows"][0])
    # the prefills a request's TPOT carries: with `batch` requests held running, each one finishing lets one in,
    # so over one request's output tokens about `batch` other prompts are prefilled on the same cores
    data["floor"] = {"cell": REPRO, "config": row["config"], "batch": batch, "slots": slots, "dtype": res["dtype"],
                     "rates": res["rates"],
                     "step_s": res["rows"][0]["step"], "gemm_s": gemm, "kv_s": kv, "threads": THREADS,
                     "prompt": prompt, "output": output, "prefill_s": res["prefills"][0]["wall"],
                     "prefill_floor_s": step_floor.prefill_floor(res["model"], res["rates"], prompt),
                     "kvllm": commit()}
    print(f"  floor {batch} x {slots}: step {1e3 * data['floor']['step_s']:.1f} ms, floor "
          f"{1e3 * (gemm + kv):.1f} ms; a {prompt}-token prefill {1e3 * data['floor']['prefill_s']:.0f} ms",
          flush=True)


def refloor(args, out: Path) -> dict:
    """The floor of a finished run in `out` measured again (its matrix.json kept, its section rewritten with both
    command lines): for a run whose floor was taken with a step_floor that measured another path."""
    data = json.loads((out / "matrix.json").read_text())
    data.pop("floor", None)
    run_floor(args, data)
    (out / "matrix.json").write_text(json.dumps(data, indent=1))
    return data


def client_commands(rows: list[dict], folder: Path) -> dict[str, str]:
    """One vLLM client command per kind of run (the cells differ only in dataset, rate, concurrency and sizes),
    the run's folder written <out>."""
    out: dict[str, str] = {}
    for r in rows:
        if "result" in r:
            kind = MEMORY_CONFIG if r["config"] == MEMORY_CONFIG else f"{cell_named(r['cell']).endpoint} cells"
            out.setdefault(kind, display(r["result"]["_command"].replace(str(folder), "<out>").split()))
    return out


def run(args, tok, out: Path, versions: str) -> dict:
    """The cells args.cells selects, under the servers of args.engine_order (`--engine-order kvllm`: kvllm alone);
    writes matrix.json and matrix_section.md into `out`, and the docs section unless --quick or --no-write."""
    t0 = time.perf_counter()
    chosen = select(plan(), args.cells)
    data = {"versions": versions, "kvllm": commit(), "quick": args.quick, "threads": THREADS, "rows": [],
            "launches": [], "errors": [], "cells": [f"{c}/{n}" for c, n in chosen],
            "command": "python -m bench.vs_vllm " + " ".join(sys.argv[1:])}
    print(f"matrix: {len(chosen)} cells x servers {', '.join(args.engine_order)}", flush=True)
    for config in CONFIGS:
        names = [n for c, n in chosen if c == config]
        for engine in args.engine_order if names else []:
            run_launch(engine, config, names, args, tok, out, data)
            (out / "matrix.json").write_text(json.dumps(data, indent=1))
    if (MEMORY_CONFIG, MEMORY.name) in chosen:
        run_memory(args, tok, out, data)
    run_floor(args, data)
    data["seconds"] = time.perf_counter() - t0
    data["client_commands"] = client_commands(data["rows"], out)
    (out / "matrix.json").write_text(json.dumps(data, indent=1))
    body = render(data)
    print(body)
    (out / "matrix_section.md").write_text(body)
    if not (args.quick or args.no_write):
        write_section(section(data["cells"]), data["command"], body)
    return data

