"""The HTTP side of `kvllm bench serve`: payloads, one streamed request and its timings, the arrival process and
the run that sends them all."""
from __future__ import annotations


import argparse
import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from bench.serve_client.dataset import SampleRequest

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


async def run_load(args: argparse.Namespace, base_url: str, samples_fn) -> tuple[list[RequestResult], float, str, Any]:
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
