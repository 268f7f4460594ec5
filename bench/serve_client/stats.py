"""vLLM's serving metrics from the per-request results, client side: TTFT, TPOT, ITL, E2EL, throughputs, failures
by reason."""
from __future__ import annotations


import math
from collections import Counter
from typing import Any

import numpy as np

from bench.serve_client.client import RequestResult

MS = 1000.0  # seconds -> the milliseconds vLLM's tables report

# ============================================================================================ metrics
def _stats(values: list[float], percentiles: list[float]) -> dict[str, Any]:
    arr = np.asarray(values if values else [0.0], dtype=float) * MS
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.percentile(arr, p))
    return out


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def failure_reason(error: str) -> str:
    """Group errors: the HTTP status or error kind plus the first words of the message."""
    return error if len(error) <= 120 else error[:117] + "..."


def calculate_metrics(results: list[RequestResult], duration: float, tokenizer, percentiles: list[float]
                      ) -> dict[str, Any]:
    output_lens, ttfts, itls, tpots, e2els = [], [], [], [], []
    total_input = 0
    completed = 0
    for r in results:
        if not r.success:
            output_lens.append(0)
            continue
        n = r.output_tokens
        if n is None:
            if tokenizer is not None:
                n = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
            else:
                n = len(r.chunk_times)
        output_lens.append(int(n))
        total_input += r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_len
        if n > 1:
            tpots.append((r.latency - r.ttft) / (n - 1))
        itls.extend(r.itl)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        completed += 1
    total_output = sum(output_lens)
    failed = len(results) - completed

    # output tokens per 1-s bucket and peak concurrency (half-open intervals), as vLLM computes them
    max_tok_s, peak_conc = 0.0, 0
    ok = [r for r in results if r.success]
    if ok:
        start = min(r.start_time for r in ok)
        end = max(r.start_time + r.latency for r in ok)
        buckets = np.zeros(int(math.ceil(end - start)) + 1)
        for r, n in zip(results, output_lens):
            if not r.success or not r.chunk_times:
                continue
            per_chunk = n / len(r.chunk_times)
            for t in r.chunk_times:
                b = int(t - start)
                if 0 <= b < len(buckets):
                    buckets[b] += per_chunk
        max_tok_s = float(buckets.max())
        events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
        cur = 0
        for _, d in events:
            cur += d
            peak_conc = max(peak_conc, cur)

    m: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": failed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": peak_conc,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        st = _stats(values, percentiles)
        m[f"mean_{name}_ms"] = st["mean"]
        m[f"median_{name}_ms"] = st["median"]
        m[f"std_{name}_ms"] = st["std"]
        for p in percentiles:
            m[f"p{percentile_word(p)}_{name}_ms"] = st[f"p{percentile_word(p)}"]
    m["output_lens"] = output_lens
    m["failure_reasons"] = dict(Counter(failure_reason(r.error) for r in results if not r.success))
    return m
