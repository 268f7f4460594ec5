"""Hostile requests over HTTP: unbounded compression settings, invalid Unicode anywhere in a body, a fault inside one
request's compression round. Each is a 4xx in the OpenAI error shape (or a 500 for that request alone), never a dead
server: /health stays 200 and the next request is served."""
from __future__ import annotations

import json

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import TINY_MAX_MODEL_LEN, openai_error, post_json, wait_drained

SURROGATE = "\\ud800"  # a lone surrogate as a JSON escape: valid JSON, not valid text


_post, _error = post_json, openai_error


def _still_serving(srv):
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    ok = _post(srv, {"prompt": "hello there", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("setting,param", [
    ({"method": "kara", "compression_period": 4611686018427387904}, "kv_compression.compression_period"),
    ({"method": "threshold", "threshold_max": 4611686018427387904}, "kv_compression.threshold_max"),
    ({"method": "kara", "window": 2**40, "buffer": 8, "compression_period": 2**41}, "kv_compression.window"),
    ({"method": "random", "seed": 2**70}, "kv_compression.seed"),
    ({"method": "centroid", "chunk_size": 100000}, "kv_compression.chunk_size"),
    ({"method": "none", "ratio": 0.5}, "kv_compression.ratio"),
])
def test_unbounded_compression_settings_are_400s_and_the_server_lives(tiny_server, setting, param):
    resp = _post(tiny_server, {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "kv_compression": setting})
    err = _error(resp, 400, param)
    if param != "kv_compression.ratio":
        assert "max_model_len" in err["message"] or "9223372036854775807" in err["message"], err
    _still_serving(tiny_server)


def test_the_largest_allowed_period_is_served(tiny_server):
    setting = {"method": "kara", "window": 16, "buffer": 4, "compression_period": TINY_MAX_MODEL_LEN}
    resp = _post(tiny_server, {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
                               "kv_compression": setting})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("raw,status,param", [
    ('{"model": "%s", "prompt": "hi"}', 400, "model"),
    ('{"prompt": "hi", "kv_compression": {"%s": 1}}', 400, "kv_compression.\\ud800"),
    ('{"prompt": "hi", "kv_compression": {"method": "%s"}}', 400, "kv_compression.method"),
    ('{"prompt": "hi", "stop": ["%s"]}', 400, "stop.0"),
    ('{"prompt": "%s"}', 400, "prompt"),
    ('{"prompt": ["ok", "a%sb"]}', 400, "prompt.1"),
    ('{"prompt": "hi", "user": "%s"}', 400, "user"),
    ('{"prompt": "hi", "unknown_field_%s": 1}', 400, "unknown_field_\\ud800"),
])
def test_a_lone_surrogate_anywhere_in_a_completion_body_is_a_400(tiny_server, raw, status, param):
    _error(_post(tiny_server, raw % SURROGATE), status, param)
    _still_serving(tiny_server)


@pytest.mark.parametrize("raw,param", [
    ('{"messages": [{"role": "user", "content": "hi", "name": "%s"}]}', "messages.0.name"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}', "messages.0.content.0.text"),
    ('{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "%s"}}',
     "chat_template_kwargs.x"),
])
def test_a_lone_surrogate_in_a_chat_body_is_a_400(tiny_server, raw, param):
    _error(_post(tiny_server, raw % SURROGATE, "/v1/chat/completions"), 400, param)
    _still_serving(tiny_server)


def test_an_unknown_model_in_a_path_with_odd_text_is_a_404(tiny_server):
    resp = httpx.get(tiny_server.base_url + "/v1/models/%ED%A0%80", timeout=10)
    _error(resp, 404, "model")


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/ping"])
def test_head_probes_answer_200(tiny_server, path):
    resp = httpx.head(tiny_server.base_url + path, timeout=10)
    assert resp.status_code == 200 and resp.content == b""
    assert httpx.get(tiny_server.base_url + path, timeout=10).status_code == 200


def test_a_fault_in_one_requests_compression_round_is_a_500_for_it_alone(tiny_server, tiny_engine, monkeypatch):
    """The victim (its own kv_compression seed) gets a 500 naming the cause; requests in flight beside it, streamed
    and not, finish normally; /health stays 200; every block comes back."""
    setting = {"method": "random", "window": 16, "buffer": 4, "ratio": 0.5, "compression_period": 12}
    comp = tiny_engine.core.stage.compressor(tiny_engine.core.stage.resolve(setting))
    real = type(comp).select_windows

    def select(self, batch):
        if any(g.initial_seed() == 4242 for g in batch.generators):
            raise RuntimeError("injected fault")
        return real(self, batch)

    monkeypatch.setattr(type(comp), "select_windows", select)
    body = {"prompt": "one two three", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    import concurrent.futures as cf

    def good(i):
        return _post(tiny_server, dict(body, kv_compression=dict(setting, seed=i)))

    def stream():
        with httpx.stream("POST", tiny_server.base_url + "/v1/completions", timeout=60,
                          json=dict(body, stream=True, kv_compression=dict(setting, seed=4242))) as r:
            return r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")]

    with cf.ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(good, i) for i in range(4)]
        bad = pool.submit(_post, tiny_server, dict(body, kv_compression=dict(setting, seed=4242)))
        streamed = pool.submit(stream)
        bad_resp = bad.result()
        status, events = streamed.result()
        for f in goods:
            assert f.result().status_code == 200 and f.result().json()["usage"]["completion_tokens"] == 60
    err = _error(bad_resp, 500)
    assert "compression round" in err["message"] and "injected fault" in err["message"]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert "compression round" in json.loads(events[-2][6:])["error"]["message"]
    wait_drained(tiny_engine)
    _still_serving(tiny_server)
