"""Soak: many mixed requests against a live `kvllm serve` on 127.0.0.1, ending with every request answered, no 5xx, no
leaked KV block and a healthy engine.

The server runs SmolLM2 with a tiny KV pool (preemptions happen) and a short max_model_len (requests reach it). The
mix: completions and chat, streaming and not, n > 1, per-request compression (kara, threshold, streaming, random,
none), mid-stream disconnects, client-side aborts (timeouts), requests filling the context to max_model_len, and a bad
request of every kind the API rejects. Each request's outcome is checked against what it should be (2xx, a 400 in the
OpenAI error shape, or a disconnect by the client), then /metrics must show an idle engine with every block free.

    python -m bench.soak [--requests 1000] [--concurrency 16] [--num-kv-blocks 48] [--max-model-len 512]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx

from bench.common import write_section

KARA = {"method": "kara", "window": 24, "buffer": 4, "ratio": 0.3, "chunk_budget": 2, "compression_period": 20}
COMPRESSION = [None, "none", KARA, {"method": "threshold", "threshold_max": 96, "threshold_target": 64},
               {"method": "streaming", "window": 16, "buffer": 4, "compression_period": 12},
               {"method": "random", "window": 16, "buffer": 4, "compression_period": 12, "seed": 3}]
BAD = [  # (body changes, endpoint) that must give a 400
    ({"max_tokens": -1}, "c"), ({"temperature": "hot"}, "c"), ({"n": 0}, "c"), ({"top_p": 2}, "c"),
    ({"stop_token_ids": [10 ** 7]}, "c"), ({"min_tokens": 9, "max_tokens": 2}, "c"), ({"prompt": ""}, "c"),
    ({"prompt": [1, 2, 10 ** 9]}, "c"), ({"logprobs": 99}, "c"), ({"kv_compression": {"method": "zip"}}, "c"),
    ({"kv_compression": {"ratio": 3}}, "c"), ({"kv_compression": {"window": 8, "buffer": 16}}, "c"),
    ({"kv_compression": {"method": "kara", "bogus": 1}}, "c"), ({"seed": 2 ** 80}, "c"),
    ({"presence_penalty": 3.0}, "c"), ({"stream_options": {"include_usage": True}}, "c"),
    ({"messages": []}, "chat"), ({"top_logprobs": 3}, "chat"), ({"tools": [{"type": "function"}]}, "chat"),
    ({"max_tokens": 10 ** 6}, "c"),
]
WORDS = ("the river city report began early and the council met again after the long winter to discuss water "
         "rights trade roads and the school which had grown too small for the children of the valley").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(server: subprocess.Popen, base: str, timeout: float = 300.0) -> None:
    """Wait for a started `kvllm serve` to answer /health with 200 (bench/request_fuzz.py uses it too)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start; see soak-server.log")
        time.sleep(1)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def plan(rng: random.Random, i: int, max_model_len: int) -> dict:
    """One request: its kind, endpoint, body and the outcome it must have."""
    r = rng.random()
    comp = rng.choice(COMPRESSION)
    base = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7]), "seed": i}
    if comp is not None:
        base["kv_compression"] = comp
    if r < 0.12:
        body, ep = BAD[i % len(BAD)]
        req = {"model": "smollm2", **({"prompt": text(rng, 8)} if ep == "c" else
                                     {"messages": [{"role": "user", "content": text(rng, 8)}]}), "max_tokens": 8}
        req.update(body)
        return {"kind": "bad", "ep": ep, "body": req, "expect": 400}
    if r < 0.22:
        return {"kind": "disconnect", "ep": "c", "expect": "disconnect",
                "body": {"model": "smollm2", "prompt": text(rng, 40), "max_tokens": 200, "stream": True,
                         "ignore_eos": True}}
    if r < 0.30:
        return {"kind": "abort", "ep": rng.choice(["c", "chat"]), "expect": "abort",
                "body": {"model": "smollm2", "prompt": text(rng, 30), "max_tokens": 300, "ignore_eos": True,
                         "messages": [{"role": "user", "content": text(rng, 30)}]}}
    if r < 0.38:  # reaches max_model_len: a long prompt and max_tokens unset (up to the context limit)
        n = max_model_len - 40 - rng.randint(0, 20)  # token ids: an exact length
        return {"kind": "to_limit", "ep": "c", "expect": 200,
                "body": {"model": "smollm2", "prompt": [rng.randrange(100, 40000) for _ in range(n)],
                         "max_tokens": None, "ignore_eos": True, **({"kv_compression": comp} if comp else {})}}
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        body = {"model": "smollm2", "prompt": text(rng, rng.randint(4, 120)), "stream": stream,
                "n": rng.choice([1, 1, 2]), **base}
        return {"kind": "completion" + ("-stream" if stream else ""), "ep": "c", "body": body, "expect": 200}
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text(rng, rng.randint(4, 80))}],
            "stream": stream, **base}
    return {"kind": "chat" + ("-stream" if stream else ""), "ep": "chat", "body": body, "expect": 200}


async def send(client: httpx.AsyncClient, base: str, p: dict) -> dict:
    path = "/v1/completions" if p["ep"] == "c" else "/v1/chat/completions"
    body = dict(p["body"])
    if p["ep"] == "c":
        body.pop("messages", None)
    else:
        body.pop("prompt", None)
    t0 = time.perf_counter()
    out = {"kind": p["kind"], "expect": p["expect"]}
    try:
        if p["kind"] == "disconnect":
            async with client.stream("POST", base + path, json=body, timeout=120) as resp:
                out["status"] = resp.status_code
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first chunk arrived: hang up mid-stream
            out["outcome"] = "disconnect"
        elif p["kind"] == "abort":
            try:
                resp = await client.post(base + path, json=body, timeout=0.3)
                out["status"] = resp.status_code
                out["outcome"] = "answered"
            except httpx.TimeoutException:
                out["outcome"] = "abort"
        elif body.get("stream"):
            async with client.stream("POST", base + path, json=body, timeout=300) as resp:
                out["status"] = resp.status_code
                lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
            out["outcome"] = "answered"
            out["done"] = bool(lines) and lines[-1] == "data: [DONE]"
            out["error_event"] = any('"error"' in line for line in lines)
        else:
            resp = await client.post(base + path, json=body, timeout=300)
            out["status"] = resp.status_code
            out["outcome"] = "answered"
            if resp.status_code == 400:
                err = resp.json().get("error", {})
                out["error_shape"] = set(err) == {"message", "type", "param", "code"}
            elif resp.status_code == 200 and p["kind"] == "to_limit":
                out["finish"] = resp.json()["choices"][0]["finish_reason"]
    except Exception as err:  # noqa: BLE001 (reported as a failure)
        out["outcome"] = f"client error {type(err).__name__}"
    out["latency"] = time.perf_counter() - t0
    return out


def ok(o: dict) -> bool:
    if o["expect"] == "disconnect":
        return o["outcome"] == "disconnect" and o.get("status") == 200
    if o["expect"] == "abort":
        return o["outcome"] in ("abort", "answered") and o.get("status", 200) == 200
    if o["outcome"] != "answered" or o.get("status") != o["expect"]:
        return False
    if o["expect"] == 400:
        return o.get("error_shape", True)
    if "done" in o:
        return o["done"] and not o["error_event"]
    if o["kind"] == "to_limit":
        return o.get("finish") == "length"
    return True


def metrics(base: str) -> dict[str, float]:
    vals = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvllm:") and "{" in line:
            name, val = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            vals[name] = vals.get(name, 0.0) + float(val)
    return vals


async def drive(base: str, plans: list[dict], concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(p):
            async with sem:
                return await send(client, base, p)

        return await asyncio.gather(*(one(p) for p in plans))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(os.path.join(os.path.dirname(__file__), "..", "soak-server.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "smollm2", "--host", "127.0.0.1",
                               "--port", str(port), "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
                               str(args.max_model_len), "--max-num-seqs", "16", "--dtype", "float32",
                               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_health(server, base)
        rng = random.Random(args.seed)
        plans = [plan(rng, i, args.max_model_len) for i in range(args.requests)]
        t0 = time.perf_counter()
        outs = asyncio.run(drive(base, plans, args.concurrency))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 120  # aborted and disconnected requests are freed at the next step
        while True:
            m = metrics(base)
            if (m.get("kvllm:num_requests_running", 1) == 0 and m.get("kvllm:num_requests_waiting", 1) == 0
                    and m.get("kvllm:num_free_kv_blocks") == m.get("kvllm:num_kv_blocks")) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        healthy = httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    by_kind = Counter((o["kind"], ok(o)) for o in outs)
    five_xx = sum(1 for o in outs if isinstance(o.get("status"), int) and o["status"] >= 500)
    failed = [o for o in outs if not ok(o)]
    leaked = int(m.get("kvllm:num_kv_blocks", 0) - m.get("kvllm:num_free_kv_blocks", 0))
    lat = sorted(o["latency"] for o in outs if o["outcome"] == "answered" and o.get("status") == 200)
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else float("nan")
    kinds = sorted({k for k, _ in by_kind})
    lines = ["| request kind | sent | as expected | not as expected |", "|---|---:|---:|---:|"]
    for k in kinds:
        good, bad = by_kind[(k, True)], by_kind[(k, False)]
        lines.append(f"| {k} | {good + bad} | {good} | {bad} |")
    lines += ["", "| total requests | as expected | 5xx | leaked blocks | engine healthy after | p99 latency (2xx) "
                  "| preemptions | compression rounds | wall |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
              f"| {len(outs)} | {len(outs) - len(failed)} | {five_xx} | {leaked} | {'yes' if healthy else 'NO'} "
              f"| {p99:.2f} s | {int(m.get('kvllm:num_preemptions_total', 0))} "
              f"| {int(m.get('kvllm:compression_rounds_total', 0))} | {wall:.0f} s |"]
    body = "\n".join(lines)
    body += (f"\n\nSmolLM2 (fp32, 1 thread) behind `kvllm serve` on 127.0.0.1 with {args.num_kv_blocks} KV blocks "
             f"of 16 and max_model_len {args.max_model_len}; {args.requests} requests, {args.concurrency} at a "
             f"time. 'abort' requests time out on the client after 0.3 s (the server aborts them; a fast one may be "
             f"answered first); 'disconnect' requests hang up after the first streamed chunk; 'bad' requests must "
             f"get a 400 in the OpenAI error shape; 'to_limit' requests must end with finish_reason 'length' at "
             f"max_model_len; streams must end with [DONE] and carry no error event.")
    print(body)
    for o in failed[:20]:
        print("NOT AS EXPECTED:", json.dumps(o, default=str))
    if not args.no_write:
        write_section("Soak: mixed requests against a live server", "python -m bench.soak " + " ".join(sys.argv[1:]),
                      body)
    sys.exit(0 if not failed and not five_xx and not leaked and healthy else 1)


if __name__ == "__main__":
    main()
