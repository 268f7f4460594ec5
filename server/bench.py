"""`kvllm bench serve`: a load-test client for any OpenAI-compatible server, modelled on `vllm bench serve`.

    kvllm bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate inf \
        --max-concurrency 32 --dataset random --input-len 256 --output-len 64 --ignore-eos \
        --save-result result.json --plot result.png

* Requests stream (SSE) over httpx with ``stream_options.include_usage``; arrivals are a Poisson process at
  ``--request-rate`` (gamma with ``--burstiness`` ≠ 1; ``inf`` sends everything at t=0); a client-side
  semaphore bounds requests in flight (``--max-concurrency``).
* Datasets: ``random`` (vLLM's: token ids decoded to text and re-encoded to the target length, with
  ``--random-range-ratio`` and ``--random-prefix-len``) and ``text:FILE`` (a ``.jsonl`` file of
  ``{"prompt": ...}`` lines, or a plain text file cut into windows of ``--input-len`` tokens).
* Metrics as vLLM defines them, client side: TTFT (send → first streamed chunk), ITL (every gap between chunks,
  pooled), TPOT per request ((E2E − TTFT)/(output tokens − 1)), E2EL; output token counts come from the
  stream's usage block.
* Output: vLLM's "Serving Benchmark Result" table, failed requests counted by reason, ``--save-result`` JSON
  (vLLM's keys), ``--plot`` PNG (latency distributions and throughput over time).

`run_benchmark(args)` runs it in-process and returns the result dict (args: an argparse Namespace, a dict of
option values, or a list of command-line strings).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import numpy as np

MS = 1000.0
_DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
                    "errors", "usage_prompt_tokens", "finish_reasons", "prompts")

# Words for prompts when no tokenizer is available (roughly one token each for BPE vocabularies).
_WORDS = ("the of and to in is was for on that with as by at from his her are be this an which or had it not "
          "were but have one their has been they more also its first new other after who all two when there "
          "time year can would into only most some made over may such these many where like three world "
          "city state part early under used both during later called between great well known including "
          "people since being while same around before second work number life small large different").split()


# ================================================================================================ dataset
@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens by the client's tokenizer (an estimate when it has none)
    expected_output_len: int


def load_tokenizer(name: Any):
    """A tokenizer from 'smollm2', a .gguf file, a local directory, or a locally cached HF id; an object is
    returned as is; None/'none' → None."""
    if name is None or (isinstance(name, str) and name.lower() == "none"):
        return None
    if not isinstance(name, (str, os.PathLike)):
        return name
    from transformers import AutoTokenizer

    name = str(name)
    if name == "smollm2":
        from engine.loader import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return AutoTokenizer.from_pretrained(str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=ggufs[0].name)
    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def _decode_to_target_len(tokenizer, token_ids: list[int], target: int, rng: np.random.Generator,
                          max_retry: int = 10) -> tuple[str, int]:
    """Decode, re-encode and trim/extend until the prompt re-encodes to `target` tokens (vLLM's procedure)."""
    tokens = list(token_ids)
    prompt = ""
    for attempt in range(max_retry + 1):
        prompt = tokenizer.decode(tokens)
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
        if len(tokens) == target or attempt == max_retry:
            break
        if len(tokens) < target:
            tokens.extend(rng.integers(0, tokenizer.vocab_size, size=target - len(tokens)).tolist())
        else:
            tokens = tokens[:target]
    return prompt, len(tokens)


def _lengths(rng: np.random.Generator, n: int, input_len: int, output_len: int, ratio: float,
             num_special: int = 0) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    real = max(0, input_len - num_special)
    in_lo, in_hi = math.floor(real * (1 - ratio)), math.ceil(real * (1 + ratio))
    out_lo, out_hi = max(1, math.floor(output_len * (1 - ratio))), max(1, math.ceil(output_len * (1 + ratio)))
    return rng.integers(in_lo, in_hi + 1, size=n), rng.integers(out_lo, out_hi + 1, size=n)


def sample_random(tokenizer, num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        in_lens, out_lens = _lengths(rng, num_requests, input_len, output_len, range_ratio)
        prefix = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=prefix_len)]
        reqs = []
        for i in range(num_requests):
            words = prefix + [_WORDS[j] for j in rng.integers(0, len(_WORDS), size=max(1, int(in_lens[i])))]
            reqs.append(SampleRequest(" ".join(words), len(words), int(out_lens[i])))
        return reqs
    num_special = int(tokenizer.num_special_tokens_to_add()) if hasattr(tokenizer, "num_special_tokens_to_add") \
        else 0
    in_lens, out_lens = _lengths(rng, num_requests, input_len, output_len, range_ratio, num_special)
    vocab = int(tokenizer.vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([t for t in range(vocab) if t not in special])
    offsets = rng.integers(0, vocab, size=num_requests)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    reqs = []
    for i in range(num_requests):
        n = max(1, int(in_lens[i]))
        inner = allowed[(int(offsets[i]) + i + np.arange(n)) % len(allowed)].tolist()
        prompt, length = _decode_to_target_len(tokenizer, prefix + inner, prefix_len + n, rng)
        reqs.append(SampleRequest(prompt, length + num_special, int(out_lens[i])))
    return reqs


def sample_text_file(tokenizer, path: str, num_requests: int, input_len: int, output_len: int,
                     range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dataset text:{path}: no such file")
    if p.suffix == ".jsonl":
        rows = []
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                prompt = obj.get("prompt") if isinstance(obj, dict) else None
                if not isinstance(prompt, str) or not prompt:
                    raise ValueError(f"{path}: every line needs a non-empty 'prompt' string")
                out = obj.get("output_len") or obj.get("max_tokens") or output_len
                rows.append((prompt, int(out)))
        if not rows:
            raise ValueError(f"{path}: no prompts")
        reqs = []
        for i in range(num_requests):  # cycle (oversample) when the file has fewer prompts
            prompt, out = rows[i % len(rows)]
            n = len(tokenizer.encode(prompt)) if tokenizer is not None else len(prompt.split())
            reqs.append(SampleRequest(prompt, n, out))
        return reqs
    text = p.read_text(encoding="utf-8", errors="replace")
    _, out_lens = _lengths(rng, num_requests, input_len, output_len, range_ratio)
    in_lens, _ = _lengths(rng, num_requests, input_len, output_len, range_ratio)
    if tokenizer is None:
        words = text.split()
        if not words:
            raise ValueError(f"{path}: empty")
        reqs = []
        for i in range(num_requests):
            n = max(1, min(int(in_lens[i]), len(words)))
            start = int(rng.integers(0, len(words) - n + 1))
            reqs.append(SampleRequest(" ".join(words[start:start + n]), n, int(out_lens[i])))
        return reqs
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"{path}: empty")
    reqs = []
    for i in range(num_requests):
        n = max(1, min(int(in_lens[i]), len(ids)))
        start = int(rng.integers(0, len(ids) - n + 1))
        prompt, length = _decode_to_target_len(tokenizer, ids[start:start + n], n, rng)
        reqs.append(SampleRequest(prompt, length, int(out_lens[i])))
    return reqs


def get_samples(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    dataset = args.dataset
    if dataset == "random":
        return sample_random(tokenizer, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio,
                             args.random_prefix_len, args.seed)
    if dataset.startswith("text:"):
        return sample_text_file(tokenizer, dataset[5:], args.num_prompts, args.input_len, args.output_len,
                                args.random_range_ratio, args.seed)
    raise ValueError(f"--dataset must be 'random' or 'text:FILE', got {dataset!r}")


# =========================================================================================== requests
@dataclass
class RequestResult:
    prompt_len: int = 0
    expected_output_len: int = 0
    success: bool = False
    error: str = ""
    status: Optional[int] = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # seconds since the benchmark started
    chunk_times: list[float] = field(default_factory=list)  # seconds since the benchmark started
    generated_text: str = ""
    output_tokens: Optional[int] = None  # usage.completion_tokens
    usage_prompt_tokens: Optional[int] = None  # usage.prompt_tokens
    finish_reason: Optional[str] = None


def _error_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            if isinstance(err, dict):
                return str(err.get("message") or err)
            return str(err)
    except Exception:
        pass
    return body.decode("utf-8", errors="replace")[:300]


def build_payload(args: argparse.Namespace, model: str, chat: bool, req: SampleRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    payload["temperature"] = 0.0 if args.temperature is None else args.temperature
    if args.top_p is not None:
        payload["top_p"] = args.top_p
    if args.top_k is not None:
        payload["top_k"] = args.top_k
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if args.extra_body:
        payload.update(args.extra_body)
    return payload


async def send_request(client, url: str, payload: dict[str, Any], headers: dict[str, str], chat: bool,
                       result: RequestResult, t0: float) -> RequestResult:
    """Stream one request; fills `result` (timings relative to t0 = benchmark start)."""
    import httpx

    st = time.perf_counter()
    result.start_time = st - t0
    last = st
    text_parts: list[str] = []
    done = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                body = await resp.aread()
                result.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if isinstance(obj, dict) and "error" in obj:
                    err = obj["error"]
                    msg = err.get("message") if isinstance(err, dict) else err
                    code = err.get("code") if isinstance(err, dict) else None
                    result.error = f"stream error{f' {code}' if code else ''}: {msg}"
                    continue
                now = time.perf_counter()
                choices = obj.get("choices") or []
                if choices:
                    c = choices[0]
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if not result.chunk_times:
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunk_times.append(now - t0)
                    text_parts.append(text or "")
                    if c.get("finish_reason") is not None:
                        result.finish_reason = c["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens")
                    result.usage_prompt_tokens = usage.get("prompt_tokens")
        result.latency = time.perf_counter() - st
        result.generated_text = "".join(text_parts)
        if not result.error:
            if not result.chunk_times:
                result.error = "no chunk received (cannot compute TTFT)"
            elif not done:
                result.error = "stream ended without [DONE]"
            else:
                result.success = True
    except httpx.TimeoutException as err:
        result.error = f"timeout: {type(err).__name__}"
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    except json.JSONDecodeError as err:
        result.error = f"bad SSE data: {err}"
    except asyncio.CancelledError:
        raise
    except Exception as err:  # never let one request crash the benchmark
        result.error = f"{type(err).__name__}: {err}"
    if not result.latency:
        result.latency = time.perf_counter() - st
    return result


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Cumulative send times (s) of n requests: all 0 at rate inf, else gamma(shape=burstiness) gaps (Poisson at
    burstiness 1) rescaled so the last one is at n / rate, as vLLM does."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError("--request-rate must be > 0 or inf")
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times = times * ((n / request_rate) / times[-1])
    return times.tolist()


async def _wait_ready(client, base_url: str, headers: dict[str, str], timeout: float) -> None:
    import httpx

    deadline = time.perf_counter() + timeout
    while True:
        try:
            r = await client.get(base_url + "/v1/models", headers=headers)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.perf_counter() > deadline:
            raise RuntimeError(f"server at {base_url} not ready after {timeout:.0f}s")
        await asyncio.sleep(0.5)


async def _first_model(client, base_url: str, headers: dict[str, str]) -> str:
    r = await client.get(base_url + "/v1/models", headers=headers)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"no models listed at {base_url}/v1/models")
    return data[0]["id"]


async def _run(args: argparse.Namespace, base_url: str, samples_fn) -> tuple[list[RequestResult], float, str, Any]:
    import httpx

    headers = dict(args.headers)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    limits = httpx.Limits(max_connections=args.max_concurrency or None,
                          max_keepalive_connections=args.max_concurrency or None)
    timeout = httpx.Timeout(args.request_timeout, connect=min(30.0, args.request_timeout))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if args.ready_check_timeout > 0:
            await _wait_ready(client, base_url, headers, args.ready_check_timeout)
        model = args.model or await _first_model(client, base_url, headers)
        tokenizer, samples = samples_fn(model)
        url = base_url + args.endpoint
        chat = "chat" in args.endpoint if args.backend == "auto" else args.backend == "openai-chat"

        if args.num_warmups > 0:
            warm = [send_request(client, url, build_payload(args, model, chat, samples[0]), headers, chat,
                                 RequestResult(), time.perf_counter()) for _ in range(args.num_warmups)]
            await asyncio.gather(*warm)

        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples), disable=args.disable_tqdm, desc="bench serve", dynamic_ncols=True)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
        arrivals = arrival_times(len(samples), args.request_rate, args.burstiness, args.seed)
        results = [RequestResult(prompt_len=s.prompt_len, expected_output_len=s.expected_output_len)
                   for s in samples]

        async def one(i: int) -> None:
            async with sem:
                await send_request(client, url, build_payload(args, model, chat, samples[i]), headers, chat,
                                   results[i], t0)
            bar.update(1)

        t0 = time.perf_counter()
        tasks = []
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        return results, duration, model, (tokenizer, samples, chat)


# ============================================================================================ metrics
def _stats(values: list[float], percentiles: list[float]) -> dict[str, Any]:
    arr = np.asarray(values if values else [0.0], dtype=float) * MS
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{_pword(p)}"] = float(np.percentile(arr, p))
    return out


def _pword(p: float) -> str:
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
            m[f"p{_pword(p)}_{name}_ms"] = st[f"p{_pword(p)}"]
    m["output_lens"] = output_lens
    m["failure_reasons"] = dict(Counter(failure_reason(r.error) for r in results if not r.success))
    return m


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
            row(f"P{_pword(p)} {name} (ms):", m[f"p{_pword(p)}_{key}_ms"], "{:<10.2f}")
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


# ========================================================================================== arguments
def _extra_body(text: str) -> dict:
    if isinstance(text, dict):
        return text
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object: {err}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return obj


def _rate(text: str) -> float:
    v = float(text)
    if not (v > 0):
        raise argparse.ArgumentTypeError("--request-rate must be > 0 or inf")
    return v


def add_cli_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    t.add_argument("--backend", default="auto", choices=["auto", "openai", "openai-chat"],
                   help="request format; auto: chat when the endpoint contains 'chat'")
    t.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    t.add_argument("--tokenizer", default=None,
                   help="tokenizer for the dataset: 'smollm2', a .gguf, a local directory, or 'none' "
                        "(default: the model name if it resolves locally)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token")
    t.add_argument("--header", action="append", default=[], metavar="KEY=VALUE", help="extra HTTP header")
    t.add_argument("--request-timeout", type=float, default=3600.0, help="per-request timeout (s)")
    t.add_argument("--ready-check-timeout", type=float, default=60.0,
                   help="wait up to this long for GET /v1/models to answer (0: skip)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", help="random | text:FILE")
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024)
    d.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--seed", type=int, default=0)
    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=_rate, default=float("inf"),
                    help="requests/s (Poisson arrivals); inf sends all at once")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    lo.add_argument("--max-concurrency", type=int, default=None, help="client-side cap on requests in flight")
    lo.add_argument("--num-warmups", type=int, default=0)
    s = p.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true", help="force exactly --output-len tokens")
    s.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--extra-body", type=_extra_body, default=None,
                   help='JSON merged into every request, e.g. \'{"kv_compression": {"method": "kara"}}\'')
    o = p.add_argument_group("output")
    o.add_argument("--save-result", nargs="?", const="", default=None, metavar="FILE",
                   help="write the JSON result (no FILE: an automatic name in --result-dir)")
    o.add_argument("--result-dir", default=None)
    o.add_argument("--save-detailed", action="store_true", help="keep per-request arrays in the JSON")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="latency distributions and throughput PNG")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="99")
    o.add_argument("--disable-tqdm", action="store_true")
    o.add_argument("--label", default=None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvllm bench serve", description=__doc__.split("\n\n")[0])
    add_cli_args(p)
    return p


def normalize_args(args: Any) -> argparse.Namespace:
    """Namespace from a Namespace, a dict of option values (missing ones take the defaults) or argv strings."""
    parser = build_parser()
    if isinstance(args, argparse.Namespace):
        base = vars(parser.parse_args([]))
        base.update({k: v for k, v in vars(args).items()})
        ns = argparse.Namespace(**base)
    elif isinstance(args, dict):
        ns = parser.parse_args([])
        for k, v in args.items():
            k = k.replace("-", "_")
            if not hasattr(ns, k):
                raise ValueError(f"unknown bench option {k!r}")
            setattr(ns, k, v)
    else:
        ns = parser.parse_args(list(args))
    if isinstance(ns.extra_body, str):
        ns.extra_body = _extra_body(ns.extra_body)
    if isinstance(ns.request_rate, str):
        ns.request_rate = _rate(ns.request_rate)
    ns.request_rate = float(ns.request_rate)
    headers = {}
    for h in ns.header or []:
        if isinstance(h, str):
            if "=" not in h:
                raise ValueError(f"--header must be KEY=VALUE, got {h!r}")
            k, v = h.split("=", 1)
            headers[k.strip()] = v.strip()
    ns.headers = headers
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    return ns


# ============================================================================================== entry
def run_benchmark(args: Any) -> dict[str, Any]:
    """Run the load test and return the result dict (vLLM's keys plus per-request arrays, the failure
    reasons and the prompts). Prints the table; writes --save-result / --plot when given."""
    args = normalize_args(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    percentile_metrics = [m.strip() for m in str(args.percentile_metrics).split(",") if m.strip()]

    def samples_for(model: str):
        name = args.tokenizer if args.tokenizer is not None else model
        try:
            tokenizer = load_tokenizer(name)
        except Exception as err:
            if args.tokenizer is not None:
                raise
            print(f"note: no local tokenizer for {name!r} ({type(err).__name__}); prompts are random words and "
                  "token counts come from the server's usage")
            tokenizer = None
        return tokenizer, get_samples(args, tokenizer)

    results, duration, model, (tokenizer, samples, chat) = asyncio.run(_run(args, base_url, samples_for))
    m = calculate_metrics(results, duration, tokenizer, percentiles)
    print(format_table(m, args, percentile_metrics, percentiles), flush=True)

    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "label": args.label,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer if isinstance(args.tokenizer, str) else (model if tokenizer else None),
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "extra_body": args.extra_body,
        **m,
        "input_lens": [r.prompt_len for r in results],
        "usage_prompt_tokens": [r.usage_prompt_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "chunk_times": [r.chunk_times for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "prompts": [s.prompt for s in samples],
    }
    if args.save_result is not None:
        path = args.save_result
        if not path:
            conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
            path = f"{args.label or result['backend']}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-" \
                   f"{result['date']}.json"
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            path = os.path.join(args.result_dir, path)
        saved = {k: v for k, v in result.items() if k != "chunk_times"}
        if not args.save_detailed:
            for k in _DETAILED_FIELDS:
                saved.pop(k, None)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=2)
        print(f"saved result to {path}")
        result["result_file"] = path
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_results(result, args.plot)
        print(f"saved plot to {args.plot}")
    return result


def main(args: Any = None) -> int:
    import sys

    try:
        result = run_benchmark(args if args is not None else sys.argv[1:])
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
