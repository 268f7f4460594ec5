"""A client that goes away mid-request: the engine request is aborted and every KV block returns to the pool."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import TINY_MAX_MODEL_LEN, wait_drained

PROMPT = "Once upon a time, in a land far away,"
LONG = TINY_MAX_MODEL_LEN - 64  # far more tokens than the test waits for (chat template included)


def _aborts(srv, model: str) -> float:
    key = f'kvllm:request_success_total{{finished_reason="abort",model_name="{model}"}}'
    for line in httpx.get(srv.base_url + "/metrics").text.splitlines():
        if line.startswith(key):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _read_then_close(srv, path: str, body: dict, num_events: int) -> int:
    got = 0
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", srv.base_url + path, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == num_events:
                        break
    return got  # leaving both blocks closes the connection mid-stream


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_disconnect_aborts_request(tiny_server, tiny_engine, path):
    model = tiny_engine.model_name
    body = {"model": model, "max_tokens": LONG, "stream": True, "ignore_eos": True, "temperature": 0}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    aborts = _aborts(tiny_server, model)
    generated = tiny_engine.stats().generation_tokens_total
    assert _read_then_close(tiny_server, path, body, 3) == 3
    wait_drained(tiny_engine, timeout=15)
    assert tiny_engine.stats().generation_tokens_total - generated < LONG
    assert _aborts(tiny_server, model) == aborts + 1
    assert tiny_server.pending == 0


def test_non_streaming_disconnect_aborts_request(tiny_server, tiny_engine):
    model = tiny_engine.model_name
    aborts = _aborts(tiny_server, model)
    generated = tiny_engine.stats().generation_tokens_total
    body = {"model": model, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_drained(tiny_engine, timeout=15)
    assert tiny_engine.stats().generation_tokens_total - generated < 2 * LONG
    assert _aborts(tiny_server, model) == aborts + 1


def test_many_concurrent_disconnects(tiny_server, tiny_engine):
    """Several streams (some with n=2) dropped at different points, some before their first token."""
    model = tiny_engine.model_name

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = {"model": model, "prompt": f"{PROMPT} {i}", "max_tokens": LONG, "stream": True,
                "ignore_eos": True, "n": 1 + i % 2}
        async with client.stream("POST", tiny_server.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            if i % 4 == 0:
                return  # gone before reading anything (usually before the first token)
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= i % 4:
                        break

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(one(i, client) for i in range(12)))

    asyncio.run(main())
    wait_drained(tiny_engine, timeout=30)
    # and the server still answers normally afterwards
    r = httpx.post(tiny_server.base_url + "/v1/completions",
                   json={"model": model, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_drained(tiny_engine)
    assert tiny_server.pending == 0  # every admission was released
