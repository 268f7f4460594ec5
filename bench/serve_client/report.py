"""The printed "Serving Benchmark Result" table and the optional plot."""
from __future__ import annotations


import argparse
import math
from typing import Any

import numpy as np

from bench.serve_client.stats import MS, percentile_word

def format_table(m: dict[str, Any], args: argparse.Namespace, percentile_metrics: list[str],
                 percentiles: list[float]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10}"):
        lines.append(("{:<40} " + fmt).format(label, value))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency)
    if not math.isinf(args.request_rate):
        row("Request rate configured (RPS):", args.request_rate, "{:<10.2f}")
    row("Benchmark duration (s):", m["duration"], "{:<10.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", m["output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], "{:<10.2f}")
    row("Peak concurrent requests:", m["max_concurrent_requests"], "{:<10.2f}")
    row("Total token throughput (tok/s):", m["total_token_throughput"], "{:<10.2f}")
    sections = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))
    for key, name, header in sections:
        if key not in percentile_metrics:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"], "{:<10.2f}")
        row(f"Median {name} (ms):", m[f"median_{key}_ms"], "{:<10.2f}")
        for p in percentiles:
            row(f"P{percentile_word(p)} {name} (ms):", m[f"p{percentile_word(p)}_{key}_ms"], "{:<10.2f}")
    lines.append("=" * 50)
    if m["failure_reasons"]:
        lines.append("Failed requests by reason:")
        for reason, count in sorted(m["failure_reasons"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {count:>6}  {reason}")
    return "\n".join(lines)


# =============================================================================================== plot
def plot_results(result: dict[str, Any], path: str) -> None:
    """PNG: TTFT / ITL / E2EL histograms and output throughput + requests in flight over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [i for i, e in enumerate(result["errors"]) if not e]
    ttfts = [result["ttfts"][i] * MS for i in ok]
    itls = [x * MS for i in ok for x in result["itls"][i]]
    e2els = [result["latencies"][i] * MS for i in ok]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, values, title in ((axes[0][0], ttfts, "Time to first token"), (axes[0][1], itls, "Inter-token latency"),
                              (axes[1][0], e2els, "End-to-end latency")):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
            p50, p99 = np.percentile(values, 50), np.percentile(values, 99)
            ax.axvline(p50, color="tab:green", ls="--", label=f"median {p50:.1f} ms")
            ax.axvline(p99, color="tab:red", ls="--", label=f"p99 {p99:.1f} ms")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    ax = axes[1][1]
    duration = max(result["duration"], 1e-6)
    bin_s = 1.0 if duration >= 20 else max(duration / 20, 0.05)
    nbins = int(math.ceil(duration / bin_s)) + 1
    tokens = np.zeros(nbins)
    inflight = np.zeros(nbins)
    for i in ok:
        times = result["chunk_times"][i]
        n = result["output_lens"][i]
        if times:
            for t in times:
                b = int(t / bin_s)
                if b < nbins:
                    tokens[b] += n / len(times)
        s, e = result["start_times"][i], result["start_times"][i] + result["latencies"][i]
        inflight[int(s / bin_s):min(nbins, int(math.ceil(e / bin_s)))] += 1
    xs = np.arange(nbins) * bin_s
    ax.plot(xs, tokens / bin_s, color="tab:blue", label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, inflight, color="tab:orange", label="requests active")
    ax2.set_ylabel(f"requests active (per {bin_s:.2g} s bin)", color="tab:orange")
    ax.set_title("Throughput over time")
    rate = result.get("request_rate")
    fig.suptitle(f"{result.get('model_id')}: {result['completed']} ok / {result['failed']} failed, "
                 f"rate={rate}, concurrency={result.get('max_concurrency')}, "
                 f"{result['output_throughput']:.1f} out tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
