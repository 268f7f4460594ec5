"""The engine in a process of its own (engine/process.py, `kvllm serve --engine-process`): the same outputs as the
engine in a thread, errors that cross the pipe with their parameter, aborts and unstarted requests cleaned up in
the child, and a child that dies failing every open request instead of hanging it."""
from __future__ import annotations

import gc
import os
import signal
import time

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import TINY_BLOCK_SIZE, TINY_MAX_MODEL_LEN, TINY_NUM_KV_BLOCKS, build_engine, serve, wait_drained

PROMPTS = ["The quick brown fox", "Once upon a time", "A B C D"]


def _process_engine(model_dir, **kwargs):
    from engine.process import ProcessEngine

    return ProcessEngine(model=str(model_dir), threads=1, dtype="float32", device="cpu", block_size=TINY_BLOCK_SIZE,
                         num_kv_blocks=TINY_NUM_KV_BLOCKS, max_model_len=TINY_MAX_MODEL_LEN, **kwargs)


@pytest.fixture(scope="module")
def proc_engine(tiny_server_model_dir):
    eng = _process_engine(tiny_server_model_dir)
    yield eng
    eng.shutdown()


def _complete(base: str, prompt: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, **body}, timeout=60)


def test_same_tokens_as_the_engine_in_a_thread(proc_engine, tiny_server_model_dir):
    thread_engine = build_engine(tiny_server_model_dir)
    thread_engine.start()
    try:
        with serve(thread_engine, served_model_name="m") as a, serve(proc_engine, served_model_name="m") as b:
            for prompt in PROMPTS:
                ra, rb = _complete(a.base_url, prompt, logprobs=2), _complete(b.base_url, prompt, logprobs=2)
                assert ra.status_code == rb.status_code == 200, (ra.text, rb.text)
                ca, cb = ra.json()["choices"][0], rb.json()["choices"][0]
                assert cb["text"] == ca["text"] and cb["logprobs"]["tokens"] == ca["logprobs"]["tokens"]
                assert rb.json()["usage"] == ra.json()["usage"]
            # streamed: the deltas join into the same text
            with httpx.stream("POST", b.base_url + "/v1/completions", timeout=60,
                              json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                    "stream": True}) as r:
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            import json

            text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks)
            assert text == _complete(a.base_url, PROMPTS[0]).json()["choices"][0]["text"]
            metrics = httpx.get(b.base_url + "/metrics", timeout=30).text
            assert "vllm:iteration_tokens_total_count" in metrics  # step observers are told across the pipe
            count = [line for line in metrics.splitlines()
                     if line.startswith("vllm:iteration_tokens_total_count")][0]
            assert float(count.split()[-1]) > 0
    finally:
        thread_engine.shutdown()
    wait_drained(proc_engine)


def test_invalid_request_is_a_400_naming_the_parameter(proc_engine):
    with serve(proc_engine, served_model_name="m") as srv:
        r = _complete(srv.base_url, "hello", max_tokens=TINY_MAX_MODEL_LEN + 10)
        assert r.status_code == 400, r.text
        r = _complete(srv.base_url, "hello", logprobs=10**9)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert _complete(srv.base_url, "still serving").status_code == 200
    wait_drained(proc_engine)
    assert proc_engine.pending_requests() == 0


def test_a_slow_grammar_holds_up_no_other_message_of_the_engine_process(tiny_server_model_dir):
    """The child makes a grammar request on a thread of its own: while one compiles past its 3 s budget, a plain
    request is made, run and answered within 2 s, and the slow one is a 400 naming its field."""
    import threading
    import time

    # compiles for seconds (as many properties as the raised limit allows)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1400)}}
    eng = _process_engine(tiny_server_model_dir, structured_outputs_max_properties=4096,
                          structured_outputs_compile_timeout=3.0)
    try:
        with serve(eng, served_model_name="m") as srv:
            slow: dict = {}
            thread = threading.Thread(target=lambda: slow.update(r=_complete(srv.base_url, "x", guided_json=schema)))
            thread.start()
            time.sleep(0.2)
            t0 = time.monotonic()
            assert _complete(srv.base_url, "hello", max_tokens=2).status_code == 200
            assert time.monotonic() - t0 < 2.0
            thread.join(timeout=60)
            assert slow["r"].status_code == 400 and slow["r"].json()["error"]["param"] == "guided_json", slow["r"].text
            assert "did not compile within" in slow["r"].json()["error"]["message"]
        wait_drained(eng)
    finally:
        eng.shutdown()


def test_abort_and_unstarted_requests_free_everything(proc_engine):
    from engine.sampling_params import SamplingParams

    # made, never started: dropped in the child once the parent forgets it
    req = proc_engine.new_request("never started", SamplingParams(max_tokens=4))
    assert proc_engine.pending_requests() == 1
    del req
    gc.collect()
    deadline = time.monotonic() + 10
    while proc_engine.pending_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc_engine.pending_requests() == 0
    # a client that goes away mid-stream aborts its request in the child
    with serve(proc_engine, served_model_name="m") as srv:
        with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                          json={"model": "m", "prompt": "abort me", "max_tokens": 200, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break
        wait_drained(proc_engine)
    s = proc_engine.stats()
    assert s.num_running == 0 and s.num_free_blocks == s.num_blocks


def test_a_dead_engine_process_fails_open_requests_and_reports_unhealthy(tiny_server_model_dir):
    eng = _process_engine(tiny_server_model_dir)
    try:
        with serve(eng, served_model_name="m") as srv:
            assert _complete(srv.base_url, "warm").status_code == 200
            with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                              json={"model": "m", "prompt": "long", "max_tokens": 240, "temperature": 0,
                                    "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                os.kill(eng._proc.pid, signal.SIGKILL)  # a crash of the engine (a segfault in a kernel, an OOM kill)
                rest = list(lines)  # the stream ends (with an error event), it does not hang
            assert any("error" in line for line in rest), rest
            assert not eng.is_healthy()
            assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 503
            r = _complete(srv.base_url, "after")
            assert r.status_code == 503, r.text
    finally:
        eng.shutdown()


def test_a_bad_setting_raises_in_the_parent(tiny_server_model_dir):
    from engine.process import ProcessEngine

    with pytest.raises(ValueError, match="attention_backend"):
        ProcessEngine(model=str(tiny_server_model_dir), threads=1, attention_backend="nope")


def test_kvllm_serve_engine_process_flag(tiny_server_model_dir, tmp_path):
    """`kvllm serve --engine-process`: the engine runs in a child of the server process, serves, and ends with it."""
    import socket
    import subprocess
    import sys

    from server_fixtures import wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", str(tiny_server_model_dir), "--port",
                             str(port), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                             "--threads", "1", "--engine-process", "--served-model-name", "m", "--disable-uvicorn-access-log"],
                            stdout=log, stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    children: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, tmp_path / "serve.log", timeout=180)
        children = [int(c) for c in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        names = [open(f"/proc/{c}/cmdline").read() for c in children]
        assert any("multiprocessing" in n for n in names), names  # the spawned engine process
        assert _complete(base, "hello").status_code == 200
        assert "KV cache:" in (tmp_path / "serve.log").read_text()  # the child logs its capacity lines
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{c}") for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{c}") for c in children), "the engine process outlived the server"
