"""Property-based hostile requests against a live `kvllm serve`: hypothesis generates completion and chat bodies
with extreme numbers (huge, negative, int64-overflowing), per-request `kv_compression` objects of every registered
method with any of their keys (and bogus ones), invalid Unicode and malformed values. Every response must be below
500 (a 4xx in the OpenAI error shape, or a full answer), /health must answer 200 after every request, and once the
run ends the engine must be idle with every KV block free.

    python -m bench.request_fuzz [--requests 2000] [--budget 3600] [--model smollm2]

tests/test_request_fuzz.py runs the same property (`check_server`) against a tiny model with fewer requests.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from compression import registry
from compression.config import COMMON_FIELDS

EXTREME_INTS = [0, 1, -1, 2, 3, 7, 16, 63, 64, 255, 256, 257, 4096, 2**31, 2**62, 4611686018427387904, 2**63 - 1,
                2**63, 2**64, 10**30, -(2**63), -(2**70)]
SURROGATE = "\ud800"


def _ints():
    return st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-5, 300))


def _numbers():
    return st.one_of(_ints(), st.floats(allow_nan=False, allow_infinity=False, min_value=-1e30, max_value=1e30),
                     st.sampled_from([0.0, 0.3, 1e-9, 1.0, 2.5, -0.5]))


def _text():
    return st.one_of(st.text(max_size=40), st.sampled_from(["hello", "", SURROGATE, "a" + SURROGATE + "b", "é😀"]))


def _value():
    return st.one_of(_numbers(), _text(), st.booleans(), st.none(), st.lists(_ints(), max_size=3),
                     st.dictionaries(st.text(max_size=5), _ints(), max_size=2))


def _kv_compression():
    methods = registry.names()
    keys = sorted(set(COMMON_FIELDS) | {p for m in methods for p in registry.get(m).param_names()}
                  | {"bogus", SURROGATE})
    settings_ = st.dictionaries(st.sampled_from(keys), st.one_of(_ints(), _value()), max_size=5)
    obj = st.builds(lambda method, rest: {"method": method, **rest} if method is not None else rest,
                    st.one_of(st.sampled_from(methods), st.none(), _text()), settings_)
    return st.one_of(st.none(), st.sampled_from(methods + ["zip", SURROGATE]), obj, _value())


def _common_fields():
    return {
        "max_tokens": st.one_of(st.integers(1, 12), _ints(), st.none()),
        "n": st.one_of(st.integers(1, 3), st.sampled_from([0, -1, 129, 10**6])),
        "temperature": st.one_of(st.sampled_from([0, 0.7, 1.0]), _numbers()),
        "top_p": _numbers(), "top_k": _ints(), "seed": _ints(), "min_tokens": st.one_of(st.integers(0, 4), _ints()),
        "stop": st.one_of(st.none(), _text(), st.lists(_text(), max_size=3)),
        "stop_token_ids": st.lists(_ints(), max_size=3), "ignore_eos": st.booleans(), "stream": st.booleans(),
        "kv_compression": _kv_compression(), "user": _text(), "bogus_field": _value(),
    }


def _body(required: dict):
    optional = st.fixed_dictionaries({}, optional=_common_fields())
    return st.builds(lambda r, o: {**r, **o}, st.fixed_dictionaries(required), optional)


def request_bodies():
    """(path, JSON body) pairs, completions and chat."""
    prompt = st.one_of(_text(), st.lists(_text(), min_size=1, max_size=2), st.lists(_ints(), min_size=1, max_size=6),
                       st.lists(st.integers(0, 2000), min_size=1, max_size=20))
    completion = _body({"prompt": prompt, "logprobs": st.one_of(st.none(), st.integers(0, 3), _ints())})
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                     "content": _text()}, optional={"name": _text()})
    chat = _body({"messages": st.lists(message, min_size=1, max_size=3)})
    return st.one_of(st.tuples(st.just("/v1/completions"), completion),
                     st.tuples(st.just("/v1/chat/completions"), chat))


@dataclass
class Report:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    unhealthy_after: int = 0
    bad: list = field(default_factory=list)  # (path, body, status, text) of every violation


def _send(client: httpx.Client, base: str, path: str, body: dict) -> tuple[int, str]:
    content = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as JSON escapes
    headers = {"Content-Type": "application/json"}
    if body.get("stream") is True:
        with client.stream("POST", base + path, content=content, headers=headers) as r:
            return r.status_code, "".join(r.iter_text())
    r = client.post(base + path, content=content, headers=headers)
    return r.status_code, r.text


def check_server(base: str, requests: int, seed: int = 0, budget_s: float = 3600.0) -> Report:
    """Send `requests` generated bodies (fewer if the time budget runs out); records every violation."""
    report = Report()
    deadline = time.monotonic() + budget_s
    client = httpx.Client(timeout=120)

    @settings(max_examples=requests, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(request_bodies())
    def one(case):
        if time.monotonic() > deadline:
            return
        path, body = case
        status, text = _send(client, base, path, body)
        report.sent += 1
        report.statuses[status] += 1
        ok = status < 500
        if ok and status >= 400:
            try:
                err = json.loads(text)["error"]
                ok = set(err) == {"message", "type", "param", "code"} and err["code"] == status
            except (ValueError, KeyError, TypeError):
                ok = False
        health = client.get(base + "/health").status_code
        if health != 200:
            report.unhealthy_after += 1
            ok = False
        if not ok:
            report.bad.append((path, body, status, text[:500]))

    try:
        hypothesis_seed(seed)(one)()
    finally:
        client.close()
    return report


def blocks_in_use(base: str, timeout: float = 120.0) -> int:
    """KV blocks still held once the engine is idle (waits for aborted requests to be freed)."""
    deadline = time.monotonic() + timeout
    while True:
        vals = {}
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvllm:") and "{" in line:
                vals[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
        in_use = int(vals["kvllm:num_kv_blocks"] - vals["kvllm:num_free_kv_blocks"])
        idle = vals["kvllm:num_requests_running"] == 0 and vals["kvllm:num_requests_waiting"] == 0
        if (idle and in_use == 0) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.5)


def main() -> None:
    from bench.common import write_section
    from bench.soak import free_port, wait_for_health

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds; stop sending after this")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(os.path.dirname(__file__), "..", "soak-server.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", args.model, "--host", "127.0.0.1",
                               "--port", str(port), "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
                               str(args.max_model_len), "--dtype", "float32", "--threads", "1",
                               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_health(server, base)
        t0 = time.perf_counter()
        report = check_server(base, args.requests, args.seed, args.budget)
        wall = time.perf_counter() - t0
        leaked = blocks_in_use(base)
        healthy = httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    five_xx = sum(n for s, n in report.statuses.items() if s >= 500)
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(report.statuses.items()))
    body = ("| requests sent | 5xx | /health not 200 after a request | KV blocks in use when idle | healthy at the end "
            "| status counts | wall |\n|---:|---:|---:|---:|---|---|---:|\n"
            f"| {report.sent} | {five_xx} | {report.unhealthy_after} | {leaked} | {'yes' if healthy else 'NO'} "
            f"| {statuses} | {wall:.0f} s |\n\n"
            f"{args.model} (fp32, 1 thread) behind `kvllm serve` on 127.0.0.1, max_model_len {args.max_model_len}, "
            f"{args.num_kv_blocks} KV blocks; hypothesis seed {args.seed}, one request at a time, each followed by "
            f"GET /health. Bodies: completions and chat with extreme integers (up to 10^30 and below -2^63), any "
            f"float, invalid Unicode (lone surrogates) in values and keys, and `kv_compression` objects of every "
            f"registered method with any of their keys, bogus keys and values of every JSON type.")
    print(body)
    for bad in report.bad[:20]:
        print("VIOLATION:", json.dumps(bad, default=str)[:1500])
    if not args.no_write:
        write_section("Soak: property-based hostile requests", "python -m bench.request_fuzz "
                      + " ".join(sys.argv[1:]), body)
    sys.exit(0 if not report.bad and not leaked and healthy else 1)


if __name__ == "__main__":
    main()
