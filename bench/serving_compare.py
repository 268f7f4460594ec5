"""Serving benchmark: `kvllm serve` SmolLM2 with a small KV pool, Kara on vs off, driven by `kvllm bench serve`.

Starts the server as a subprocess on a loopback port for each setting, runs the load-test client against
it, reads the Prometheus counters, and writes the table to docs/benchmarks.md.

    .venv/bin/python -m bench.serving_compare [--num-prompts 16] [--output-len 192]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import write_section  # noqa: E402

PY = sys.executable


def serve(port: int, flags: list[str]) -> subprocess.Popen:
    cmd = [PY, "-m", "server.cli", "serve", "smollm2", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    out = {}
    for name in ("compression_rounds_total", "compression_blocks_freed_total", "compression_seconds_total",
                 "num_preemptions_total", "generation_tokens_total"):
        m = re.search(rf"^kvllm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--port", type=int, default=8771)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    base = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-num-seqs", str(args.concurrency),
            "--max-model-len", "1024"]
    settings = {
        "none": ["--kv-compression", "none"],
        "kara": ["--kv-compression", "kara", "--kara-window", "64", "--kara-buffer", "16", "--kara-ratio", "0.3",
                 "--kara-chunk-budget", "4", "--compression-period", "48"],
    }
    client = ["--model", "smollm2", "--num-prompts", str(args.num_prompts), "--max-concurrency",
              str(args.concurrency), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
              "--ignore-eos", "--disable-tqdm"]
    rows, commands = [], []
    tmp = Path(tempfile.mkdtemp())
    for name, flags in settings.items():
        proc = serve(args.port, base + flags)
        try:
            result = tmp / f"{name}.json"
            bench = [PY, "-m", "server.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}",
                     *client, "--save-result", str(result)]
            subprocess.run(bench, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
            r = json.loads(result.read_text())
            m = metrics(args.port)
        finally:
            proc.terminate()
            proc.wait(30)
        commands.append("kvllm serve smollm2 " + " ".join(base + flags))
        rows.append((name, r, m))
    commands.append("kvllm bench serve --base-url http://127.0.0.1:PORT " + " ".join(client))
    lines = ["| kv compression | ok / failed | output tok/s | median TTFT (s) | median TPOT (ms) | p99 TPOT (ms) | "
             "median E2EL (s) | preemptions | compression rounds | blocks freed | compression s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r, m in rows:
        lines.append(f"| {name} | {r['completed']} / {r['failed']} | {r['output_throughput']:.2f} | "
                     f"{r['median_ttft_ms'] / 1e3:.1f} | {r['median_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} | "
                     f"{r['median_e2el_ms'] / 1e3:.1f} | {m['num_preemptions_total']:.0f} | "
                     f"{m['compression_rounds_total']:.0f} | {m['compression_blocks_freed_total']:.0f} | "
                     f"{m['compression_seconds_total']:.1f} |")
    ratio = rows[1][1]["output_throughput"] / rows[0][1]["output_throughput"]
    body = "\n".join(lines) + f"\n\nKara / none output throughput: {ratio:.2f}x.\n\nCommands:\n\n```\n" + \
        "\n".join(commands) + "\n```"
    print(body)
    if not args.no_write:
        write_section("Serving (kvllm bench serve, SmolLM2 on CPU, small KV pool)",
                      "python -m bench.serving_compare " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
