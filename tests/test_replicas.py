"""Data parallelism as independent replicas behind an existing router: two `kvllm serve` processes (tiny model, one
torch thread each) behind sglang-router on 127.0.0.1, driven with the official openai client and `kvllm bench
serve`. The router needs only `GET /health` and the OpenAI routes from each replica (docs/DISTRIBUTED.md).

Skipped, with the reason, when the sglang-router package is not installed (it is in the `dev` extra).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.distributed.parallel_state import free_port
from engine.sampling_params import SamplingParams
from helpers_models import die_with_parent, hard_timeout
from server_fixtures import build_engine, openai_client, tiny_server_model_dir  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent

try:
    import sglang_router  # noqa: F401

    ROUTER_MISSING = None
except ImportError as err:
    ROUTER_MISSING = f"sglang-router is not installed ({err}); pip install sglang-router (the dev extra has it)"

pytestmark = pytest.mark.skipif(ROUTER_MISSING is not None, reason=ROUTER_MISSING or "")


@pytest.fixture(autouse=True)
def _deadline():
    with hard_timeout(420):
        yield


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _wait(url: str, procs, logs, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p, log in zip(procs, logs):
            assert p.poll() is None, f"{p.args[:4]} exited:\n{Path(log).read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready after {timeout:.0f} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tiny_server_model_dir, tmp_path_factory):
    """Two replicas and the router; yields (router URL, replica URLs, served model name)."""
    logs_dir = tmp_path_factory.mktemp("replicas")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs, logs, urls = [], [], []
    try:
        for i in range(2):
            port = free_port()
            log = logs_dir / f"replica{i}.log"
            logs.append(log)
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "server.cli", "serve", str(tiny_server_model_dir), "--port", str(port),
                 "--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-kv-blocks", "256",
                 "--max-model-len", "256", "--disable-uvicorn-access-log"],
                stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, preexec_fn=die_with_parent))
        for url in urls:
            _wait(url + "/health", procs, logs)
        router_port = free_port()
        log = logs_dir / "router.log"
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(router_port),
             "--worker-urls", *urls, "--policy", "round_robin", "--worker-startup-check-interval", "1",
             "--log-level", "warn"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, preexec_fn=die_with_parent))
        router = f"http://127.0.0.1:{router_port}"
        _wait(router + "/health", procs, logs, timeout=120)
        # the router is up before it has registered its workers: wait for one request to go through
        deadline = time.monotonic() + 120
        while True:
            r = httpx.post(router + "/v1/completions", json={"model": tiny_server_model_dir.name, "prompt": "w1",
                                                             "max_tokens": 1}, timeout=30)
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, f"the router never routed a request: {r.status_code} {r.text}"
            time.sleep(1)
        yield router, urls, tiny_server_model_dir.name
    finally:
        _stop(procs[::-1])  # the router first


def served(url: str) -> int:
    """Requests a replica finished, from its Prometheus metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r'^kvllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', text, re.M)))


def test_openai_client_through_the_router(cluster, tiny_server_model_dir):
    router, urls, model = cluster
    prompts = [f"w{i} w{i + 7} the colour of" for i in range(8)]
    messages = [{"role": "user", "content": "Name three colours."}]
    ref = build_engine(tiny_server_model_dir, swap_space=0, lossless_host_memory=0)  # the reference: the same model in this process
    try:
        want = [o.outputs[0].text for o in ref.generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                                         use_tqdm=False)]
        want_chat = ref.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    finally:
        ref.shutdown()
    before = [served(u) for u in urls]
    client = openai_client(router, timeout=120)
    got = [client.completions.create(model=model, prompt=p, temperature=0, max_tokens=12).choices[0].text
           for p in prompts]
    chat = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
    stream = client.completions.create(model=model, prompt=prompts[0], temperature=0, max_tokens=12, stream=True)
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    after = [served(u) for u in urls]

    assert got == want
    assert chat.choices[0].message.content == want_chat
    assert streamed == want[0]
    per_replica = [a - b for a, b in zip(after, before)]
    print(f"requests per replica: {per_replica}")
    assert sum(per_replica) == len(prompts) + 2 and all(n >= 4 for n in per_replica)  # round robin: both served


def test_kvllm_bench_serve_through_the_router(cluster, tiny_server_model_dir, tmp_path):
    router, urls, model = cluster
    before = [served(u) for u in urls]
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", router, "--model", model,
                        "--tokenizer", str(tiny_server_model_dir), "--num-prompts", "40", "--max-concurrency", "8",
                        "--input-len", "32", "--output-len", "16", "--ignore-eos", "--disable-tqdm",
                        "--save-result", str(out)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=300, preexec_fn=die_with_parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout[r.stdout.find("============ Serving"):])
    result = json.loads(out.read_text())
    assert result["completed"] == 40 and result["failed"] == 0
    assert result["total_output_tokens"] == 40 * 16
    assert "============ Serving Benchmark Result ============" in r.stdout
    per_replica = [served(u) - b for u, b in zip(urls, before)]
    assert sum(per_replica) == 40 and all(n >= 10 for n in per_replica), per_replica
