"""Invalid requests get the documented status and the OpenAI error shape, and the server keeps serving."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import TINY_MAX_MODEL_LEN, build_engine, serve, wait_drained

LONG_PROMPT = " ".join(["word"] * (TINY_MAX_MODEL_LEN + 40))


def _post(srv, path, body=None, content=None, headers=None):
    kwargs = {"timeout": 30}
    if content is not None:
        kwargs["content"] = content
        kwargs["headers"] = headers or {"Content-Type": "application/json"}
    else:
        kwargs["json"] = body
    return httpx.post(srv.base_url + path, **kwargs)


def _assert_error(resp, status, param=None, contains=None, err_type=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert err["type"] == (err_type or {400: "BadRequestError", 404: "NotFoundError",
                                        503: "ServiceUnavailableError"}[status])
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err["message"]
    return err


def _still_serving(srv, model):
    r = _post(srv, "/v1/completions", {"model": model, "prompt": "still alive?", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def _cmpl(model, **kw):
    body = {"model": model, "prompt": "Hello", "max_tokens": 4}
    body.update(kw)
    return body


# (name, path, body builder(model) -> dict, status, param, message fragment)
CASES = [
    ("missing prompt", "/v1/completions", lambda m: {"model": m}, 400, "prompt", "Field required"),
    ("max_tokens string", "/v1/completions", lambda m: _cmpl(m, max_tokens="abc"), 400, "max_tokens", None),
    ("temperature string", "/v1/completions", lambda m: _cmpl(m, temperature="hot"), 400, "temperature", None),
    ("n list", "/v1/completions", lambda m: _cmpl(m, n=[1]), 400, "n", None),
    ("stream object", "/v1/completions", lambda m: _cmpl(m, stream={"a": 1}), 400, "stream", None),
    ("prompt number", "/v1/completions", lambda m: _cmpl(m, prompt=3.5), 400, None, None),
    ("max_tokens 0", "/v1/completions", lambda m: _cmpl(m, max_tokens=0), 400, "max_tokens", None),
    ("max_tokens negative", "/v1/completions", lambda m: _cmpl(m, max_tokens=-5), 400, "max_tokens", None),
    ("n 0", "/v1/completions", lambda m: _cmpl(m, n=0), 400, "n", None),
    ("n huge", "/v1/completions", lambda m: _cmpl(m, n=100000), 400, "n", None),
    ("temperature negative", "/v1/completions", lambda m: _cmpl(m, temperature=-0.5), 400, "temperature", None),
    ("top_p 0", "/v1/completions", lambda m: _cmpl(m, top_p=0), 400, "top_p", None),
    ("top_p > 1", "/v1/completions", lambda m: _cmpl(m, top_p=1.5), 400, "top_p", None),
    ("top_k -2", "/v1/completions", lambda m: _cmpl(m, top_k=-2), 400, "top_k", None),
    ("logprobs 21", "/v1/completions", lambda m: _cmpl(m, logprobs=21), 400, "logprobs", None),
    ("seed too big", "/v1/completions", lambda m: _cmpl(m, seed=2**70), 400, "seed", None),
    ("min_tokens > max_tokens", "/v1/completions", lambda m: _cmpl(m, min_tokens=9, max_tokens=4), 400,
     "min_tokens", None),
    ("logit_bias outside the vocabulary", "/v1/completions", lambda m: _cmpl(m, logit_bias={"999999999": 3}), 400,
     "logit_bias", "token ids"),
    ("presence_penalty out of range", "/v1/completions", lambda m: _cmpl(m, presence_penalty=3), 400,
     "presence_penalty", None),
    ("empty stop string", "/v1/completions", lambda m: _cmpl(m, stop=[""]), 400, "stop.0", "at least 1 character"),
    ("stream_options without stream", "/v1/completions",
     lambda m: _cmpl(m, stream_options={"include_usage": True}), 400, None, "stream_options"),
    ("empty prompt", "/v1/completions", lambda m: _cmpl(m, prompt=""), 400, "prompt", None),
    ("empty prompt list", "/v1/completions", lambda m: _cmpl(m, prompt=[]), 400, "prompt", None),
    ("token id out of vocab", "/v1/completions", lambda m: _cmpl(m, prompt=[1, 2, 10**9]), 400, "prompt", None),
    ("negative token id", "/v1/completions", lambda m: _cmpl(m, prompt=[5, -1]), 400, "prompt.1",
     "greater than or equal to 0"),
    ("prompt too long", "/v1/completions", lambda m: _cmpl(m, prompt=LONG_PROMPT), 400, None,
     f"maximum context length is {TINY_MAX_MODEL_LEN} tokens"),
    ("prompt + max_tokens too long", "/v1/completions",
     lambda m: _cmpl(m, prompt="hello " * 100, max_tokens=TINY_MAX_MODEL_LEN), 400, None,
     f"This model's maximum context length is {TINY_MAX_MODEL_LEN} tokens. However, you requested"),
    ("too long, streaming", "/v1/completions",
     lambda m: _cmpl(m, prompt=LONG_PROMPT, stream=True), 400, None, "maximum context length"),
    # kv_compression
    ("kv_compression unknown method", "/v1/completions",
     lambda m: _cmpl(m, kv_compression={"method": "zip"}), 400, "kv_compression.method", None),
    ("kv_compression unknown string", "/v1/completions", lambda m: _cmpl(m, kv_compression="zip"), 400,
     "kv_compression", None),
    ("kv_compression ratio > 1", "/v1/completions", lambda m: _cmpl(m, kv_compression={"ratio": 2.0}), 400,
     "kv_compression.ratio", None),
    ("kv_compression ratio string", "/v1/completions", lambda m: _cmpl(m, kv_compression={"ratio": "half"}),
     400, "kv_compression.ratio", None),
    ("kv_compression unknown key", "/v1/completions",
     lambda m: _cmpl(m, kv_compression={"method": "kara", "windw": 64}), 400, "kv_compression.windw", None),
    ("kv_compression wrong type", "/v1/completions", lambda m: _cmpl(m, kv_compression=5), 400, "kv_compression",
     None),
    ("kv_compression buffer >= window", "/v1/completions",
     lambda m: _cmpl(m, kv_compression={"method": "kara", "window": 16, "buffer": 32}), 400,
     "kv_compression.buffer", "kv_compression.buffer"),
    ("kv_compression period < window - buffer", "/v1/completions",
     lambda m: _cmpl(m, kv_compression={"method": "kara", "window": 64, "buffer": 8, "compression_period": 10}),
     400, "kv_compression.compression_period", None),
    # chat
    ("chat no messages", "/v1/chat/completions", lambda m: {"model": m, "messages": []}, 400, "messages", None),
    ("chat bad role", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None),
    ("chat image part", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                      "image_url": {"url": "x"}}]}]},
     400, None, None),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("chat max_completion_tokens too long", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": TINY_MAX_MODEL_LEN}, 400, None, "maximum context length"),
    ("chat tools without --enable-auto-tool-choice", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "requires --enable-auto-tool-choice"),
    ("chat tool_choice without tools", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice", "`tools` must be set"),
    ("chat tool without a name", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"description": "f"}}]}, 400, "tools.0.function.name",
     None),
    ("chat bad kv_compression", "/v1/chat/completions",
     lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}],
                "kv_compression": {"method": "kara", "ratio": 0}}, 400, "kv_compression.ratio", None),
]


@pytest.mark.parametrize("name,path,build,status,param,fragment", CASES, ids=[c[0] for c in CASES])
def test_invalid_request(tiny_server, tiny_engine, name, path, build, status, param, fragment):
    resp = _post(tiny_server, path, build(tiny_engine.model_name))
    _assert_error(resp, status, param, fragment)


def test_invalid_requests_leave_server_healthy(tiny_server, tiny_engine, drained):
    for _, path, build, _, _, _ in CASES[::5]:
        _post(tiny_server, path, build(tiny_engine.model_name))
        _still_serving(tiny_server, tiny_engine.model_name)
    assert httpx.get(tiny_server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("content", [b"{bad json", b'{"model": "x", "prompt": "a",}', b"", b"[1, 2, 3]", b'"text"',
                                     b"null", b"\xff\xfe\x00"])
def test_malformed_body(tiny_server, tiny_engine, content):
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = _assert_error(_post(tiny_server, path, content=content), 400)
        assert "422" not in err["message"]
    _still_serving(tiny_server, tiny_engine.model_name)


def test_malformed_json_message_and_content_types(tiny_server, tiny_engine):
    err = _assert_error(_post(tiny_server, "/v1/completions", content=b"{bad json"), 400)
    assert "JSON" in err["message"]
    # no content-type / text content-type: still a 400 in OpenAI shape
    r = httpx.post(tiny_server.base_url + "/v1/completions", content=b"prompt=hi",
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=30)
    _assert_error(r, 400)
    _still_serving(tiny_server, tiny_engine.model_name)


def test_unknown_model(tiny_server, tiny_engine, drained):
    for path, body in (("/v1/completions", {"model": "nope", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"model": "nope", "prompt": "hi", "stream": True})):
        err = _assert_error(_post(tiny_server, path, body), 404, "model")
        assert err["message"] == "The model `nope` does not exist."
    _assert_error(httpx.get(tiny_server.base_url + "/v1/models/nope"), 404, "model")
    # no model field: the served model is used
    r = _post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == tiny_engine.model_name
    _still_serving(tiny_server, tiny_engine.model_name)


def test_unknown_route_and_method(tiny_server):
    r = httpx.get(tiny_server.base_url + "/v1/nothing-here")
    _assert_error(r, 404)
    r = httpx.get(tiny_server.base_url + "/v1/completions")
    assert r.status_code == 405
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_fields_are_ignored(tiny_server, tiny_engine, drained):
    r = _post(tiny_server, "/v1/completions", _cmpl(tiny_engine.model_name, some_future_field={"x": 1}))
    assert r.status_code == 200
    r = _post(tiny_server, "/v1/completions", _cmpl(tiny_engine.model_name, repetition_penalty=1.0,
                                                     frequency_penalty=0, user="me", best_of=1))
    assert r.status_code == 200


def test_queue_full_503_with_retry_after(tiny_engine, drained):
    with serve(tiny_engine, max_queued_requests=0) as srv:
        r = _post(srv, "/v1/completions", _cmpl(tiny_engine.model_name))
        err = _assert_error(r, 503)
        assert r.headers["retry-after"] == "1"
        assert "max_queued_requests=0" in err["message"]
        metrics = httpx.get(srv.base_url + "/metrics").text
        assert f'kvllm:admission_rejections_total{{model_name="{tiny_engine.model_name}"}} 1.0' in metrics
        # invalid requests are still 400 (validation comes before admission)
        _assert_error(_post(srv, "/v1/completions", _cmpl(tiny_engine.model_name, n=0)), 400)


def test_engine_death_gives_error_event_then_503(tiny_server_model_dir):
    """The engine loop dies mid-stream: the stream carries an error event and [DONE]; /health and new requests
    get 503."""
    engine = build_engine(tiny_server_model_dir, num_kv_blocks=64)
    engine.start()
    try:
        with serve(engine) as srv:
            body = _cmpl(engine.model_name, max_tokens=200, stream=True, ignore_eos=True)
            events = []
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 3:
                        def boom(*a, **k):
                            raise RuntimeError("simulated device failure")

                        engine.core.runner.execute = boom
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == 503 and "simulated device failure" in err["message"]
            deadline = time.monotonic() + 10
            while engine.is_healthy() and time.monotonic() < deadline:
                time.sleep(0.01)
            h = httpx.get(srv.base_url + "/health")
            _assert_error(h, 503)
            _assert_error(_post(srv, "/v1/completions", _cmpl(engine.model_name)), 503)
            assert 'kvllm:engine_healthy{model_name="' in httpx.get(srv.base_url + "/metrics").text
    finally:
        engine.shutdown()


def test_stop_token_id_outside_vocab_is_400_and_server_stays_healthy(tiny_server, tiny_engine, drained):
    """Reliability repro 1: min_tokens masks the stop ids on the engine thread; an id past the vocabulary used to
    kill the engine loop (every later request 503)."""
    body = _cmpl(tiny_engine.model_name, max_tokens=8, min_tokens=2, stop_token_ids=[999_999])
    _assert_error(_post(tiny_server, "/v1/completions", body), 400, "stop_token_ids")
    chat = {"model": tiny_engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "min_tokens": 1, "stop_token_ids": [10 ** 7]}
    _assert_error(_post(tiny_server, "/v1/chat/completions", chat), 400, "stop_token_ids")
    assert httpx.get(tiny_server.base_url + "/health").status_code == 200
    _still_serving(tiny_server, tiny_engine.model_name)


def test_prompt_filling_the_pool_completes_and_a_small_request_behind_it_too(tiny_server_model_dir):
    """Reliability repro 2: a prompt that needs every KV block was never admitted (the admission watermark), and
    the FCFS queue made every later request wait behind it."""
    import concurrent.futures

    engine = build_engine(tiny_server_model_dir, num_kv_blocks=16, watermark=0.1)  # 16 x 16 = 256 slots
    assert engine.max_model_len == TINY_MAX_MODEL_LEN == 256
    engine.start()
    try:
        with serve(engine) as srv:
            big = _cmpl(engine.model_name, prompt=list(range(1000, 1250)), max_tokens=4, ignore_eos=True)
            small = _cmpl(engine.model_name, max_tokens=2, ignore_eos=True)
            with concurrent.futures.ThreadPoolExecutor(2) as ex:
                fb = ex.submit(_post, srv, "/v1/completions", big)
                time.sleep(0.2)
                fs = ex.submit(_post, srv, "/v1/completions", small)
                rb, rs = fb.result(timeout=60), fs.result(timeout=60)
            assert rb.status_code == 200 and rb.json()["usage"]["completion_tokens"] == 4, rb.text
            assert rs.status_code == 200 and rs.json()["usage"]["completion_tokens"] == 2, rs.text
            assert httpx.get(srv.base_url + "/health").status_code == 200
        wait_drained(engine)
    finally:
        engine.shutdown()
