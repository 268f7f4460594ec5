"""Ops features a vLLM deployment relies on, against a real uvicorn server and a real engine: the API key (401 in the
OpenAI shape, open probe routes), CORS, X-Request-Id (used as the response id, echoed, safe when duplicated), the
request-body limit (413), /ping, /tokenize and /detokenize (checked against the tokenizer itself), and the flags."""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import openai_client, serve, wait_healthy

PROMPT = "The quick brown fox jumps over the lazy dog because"
KEYS = ["secret-one", "secret-two"]


def _complete(base: str, headers: dict | None = None, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(base + "/v1/completions", json=body, headers=headers or {}, timeout=60)


def _error(resp: httpx.Response, status: int, err_type: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == err_type and err["message"]
    return err


def _greedy(engine, prompt, max_tokens):
    return engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text


# ------------------------------------------------------------------------------------------------ API key
def test_api_key_matrix(tiny_engine, drained):
    with serve(tiny_engine, api_key=KEYS) as srv:
        base = srv.base_url
        err = _error(_complete(base), 401, "AuthenticationError")
        assert err["param"] is None
        assert _complete(base).headers["www-authenticate"] == "Bearer"
        for bad in ("Bearer secret-three", "Bearer secret-on", "Bearer secret-one2", "Basic secret-one",
                    "secret-one", "Bearer", "Bearer  secret-one x"):
            _error(_complete(base, {"Authorization": bad}), 401, "AuthenticationError")
        for key in KEYS:
            ok = _complete(base, {"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert _complete(base, {"Authorization": f"bearer {KEYS[0]}"}).status_code == 200  # scheme: any case
        # every route but the probes needs the key, unknown paths included (fail closed)
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                             ("POST", "/detokenize"), ("GET", "/nope"), ("GET", "/healthz"),
                             ("GET", "/metricsx")):
            _error(httpx.request(method, base + path, json={}), 401, "AuthenticationError")
        assert httpx.get(base + "/nope", headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 404
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"),
                             ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs")):
            assert httpx.request(method, base + path).status_code == 200, path
        # the official client: the right key works, a wrong one is the SDK's AuthenticationError
        good = openai_client(base).with_options(api_key=KEYS[1])
        assert good.models.list().data[0].id == tiny_engine.model_name
        with pytest.raises(openai.AuthenticationError):
            openai_client(base).completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=2)


def test_api_key_from_the_environment(tiny_engine, drained, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    with serve(tiny_engine) as srv:
        assert _complete(srv.base_url).status_code == 401
        assert _complete(srv.base_url, {"Authorization": "Bearer from-env"}).status_code == 200
    with serve(tiny_engine, api_key=["from-flag"]) as srv:  # the flag wins over the variable, as in vLLM
        assert _complete(srv.base_url, {"Authorization": "Bearer from-env"}).status_code == 401
        assert _complete(srv.base_url, {"Authorization": "Bearer from-flag"}).status_code == 200
    monkeypatch.delenv("VLLM_API_KEY")
    with serve(tiny_engine) as srv:
        assert _complete(srv.base_url).status_code == 200


# ---------------------------------------------------------------------------------------------------- CORS
def test_cors(tiny_engine, tiny_server, drained):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    # default: any origin, as vLLM's default '["*"]'
    r = httpx.options(tiny_server.base_url + "/v1/completions", headers={"Origin": "https://a.example", **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    origin = "https://app.example"
    with serve(tiny_engine, api_key=KEYS, allowed_origins=[origin], allowed_methods=["POST"],
               allowed_headers=["authorization", "content-type"], allow_credentials=True) as srv:
        url = srv.base_url + "/v1/completions"
        r = httpx.options(url, headers={"Origin": origin, **pre})  # a preflight carries no key: not a 401
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "POST" in r.headers["access-control-allow-methods"]
        bad = httpx.options(url, headers={"Origin": "https://evil.example", **pre})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        put = httpx.options(url, headers={"Origin": origin, **pre, "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400
        # a 401 still carries the CORS headers, so a browser page can read why
        r = httpx.post(url, json={"prompt": "x"}, headers={"Origin": origin})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
        r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2},
                       headers={"Origin": origin, "Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


# ---------------------------------------------------------------------------------------------- request id
def test_request_id_used_and_echoed(tiny_server, drained):
    base = tiny_server.base_url
    r = _complete(base, {"X-Request-Id": "client-42"})
    assert r.json()["id"] == "cmpl-client-42" and r.headers["x-request-id"] == "client-42"
    r = httpx.post(base + "/v1/chat/completions", headers={"X-Request-Id": "client-43"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-client-43" and r.headers["x-request-id"] == "client-43"
    r = _complete(base)  # none sent: the generated id is echoed
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"] and len(r.headers["x-request-id"]) == 32
    r = _complete(base, request_id="from-body")  # vLLM's body field, when no header is sent
    assert r.json()["id"] == "cmpl-from-body" and r.headers["x-request-id"] == "from-body"
    r = _complete(base, {"X-Request-Id": "hdr"}, request_id="from-body")  # the header wins
    assert r.json()["id"] == "cmpl-hdr" and r.headers["x-request-id"] == "hdr"
    with httpx.stream("POST", base + "/v1/completions", headers={"X-Request-Id": "streamed"}, timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as s:
        assert s.headers["x-request-id"] == "streamed"
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
    assert ids == {"cmpl-streamed"}
    assert httpx.get(base + "/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"
    assert len(httpx.get(base + "/health").headers["x-request-id"]) == 32


def test_duplicate_request_ids_run_side_by_side(tiny_engine, tiny_server, drained):
    """Two requests with the same X-Request-Id while the first is still in the engine: both complete, with the
    same output as alone (the engine rejects a running id, so the server must not reuse the client's id there)."""
    base, rid = tiny_server.base_url, "dup-id"
    long_ref, short_ref = _greedy(tiny_engine, PROMPT, 160), _greedy(tiny_engine, "Once upon a time", 6)
    with httpx.stream("POST", base + "/v1/completions", headers={"X-Request-Id": rid}, timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 160, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        running = [k for k in list(tiny_engine.core.requests) if k.startswith(f"cmpl-{rid}-")]
        assert running, "the first request should still be running"
        second = _complete(base, {"X-Request-Id": rid}, prompt=["Once upon a time"] * 2, n=2, max_tokens=6,
                           ignore_eos=True)
        texts = [json.loads(first[6:])["choices"][0]["text"]]
        texts += [json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {")]
    assert second.status_code == 200, second.text
    assert second.json()["id"] == f"cmpl-{rid}" and second.headers["x-request-id"] == rid
    assert [c["text"] for c in second.json()["choices"]] == [short_ref] * 4
    assert "".join(texts) == long_ref


def test_concurrent_duplicate_ids(tiny_engine, tiny_server, drained):
    async def run():
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as c:
            reqs = [c.post("/v1/completions", headers={"X-Request-Id": "same"},
                           json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                    for _ in range(6)]
            return await asyncio.gather(*reqs)

    ref = _greedy(tiny_engine, PROMPT, 8)
    for r in asyncio.run(run()):
        assert r.status_code == 200 and r.json()["id"] == "cmpl-same" and r.json()["choices"][0]["text"] == ref


def test_engine_ids_are_unique_per_http_request():
    from server.request_ids import engine_ids

    a, b = engine_ids("cmpl-x", 2), engine_ids("cmpl-x", 2)
    assert len(set(a + b)) == 4
    # the trailing serial and index are digits, so a client id that mimics a suffix cannot collide
    seen = {eid for rid in ("cmpl-x", "cmpl-x-1", "cmpl-x-1-0") for _ in range(30) for eid in engine_ids(rid, 3)}
    assert len(seen) == 3 * 30 * 3
    assert all(eid.rsplit("-", 2)[1].isdigit() and eid.rsplit("-", 2)[2].isdigit() for eid in seen)


# ------------------------------------------------------------------------------------------ body size
def test_body_size_limit(tiny_engine, drained):
    limit = 2048
    with serve(tiny_engine, max_request_body_size=limit) as srv:
        url = srv.base_url + "/v1/completions"
        big = json.dumps({"prompt": "x" * (2 * limit), "max_tokens": 1}).encode()
        r = httpx.post(url, content=big, headers={"Content-Type": "application/json"})
        err = _error(r, 413, "RequestEntityTooLargeError")
        assert str(limit) in err["message"]

        def chunks(data: bytes, size: int = 512):
            for i in range(0, len(data), size):
                yield data[i:i + size]

        r = httpx.post(url, content=chunks(big), headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers  # chunked transfer encoding
        _error(r, 413, "RequestEntityTooLargeError")
        small = json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0}).encode()
        r = httpx.post(url, content=chunks(small, 7), headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # replayed body
        at_limit = json.dumps({"prompt": PROMPT, "max_tokens": 2, "user": "u" * limit}).encode()[:limit]
        assert httpx.post(url, content=at_limit).status_code == 400  # truncated JSON, but not refused for size
        assert _complete(srv.base_url).status_code == 200  # still serving


# ------------------------------------------------------------------------------------- tokenize
def test_tokenize_matches_the_tokenizer(tiny_engine, tiny_server, drained):
    base, tok = tiny_server.base_url, tiny_engine.tokenizer
    r = httpx.post(base + "/tokenize", json={"model": tiny_engine.model_name, "prompt": PROMPT})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == list(tok(PROMPT).input_ids)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == tiny_engine.max_model_len
    assert body["token_strs"] is None
    assert body["count"] == _complete(base).json()["usage"]["prompt_tokens"]
    r = httpx.post(base + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False,
                                             "return_token_strs": True}).json()
    assert r["tokens"] == list(tok(PROMPT, add_special_tokens=False).input_ids)
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = httpx.post(base + "/tokenize", json={"messages": messages}).json()
    expect = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    assert chat["tokens"] == list(expect) and chat["count"] == len(expect)
    usage = httpx.post(base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    no_gen = httpx.post(base + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == list(tok(tok.apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=False),
                                        add_special_tokens=False).input_ids)
    assert no_gen["count"] < chat["count"]


def test_detokenize_round_trip(tiny_engine, tiny_server, drained):
    base, tok = tiny_server.base_url, tiny_engine.tokenizer
    for text in (PROMPT, "Ünïcödé — 東京 🚀", "  spaces\tand\nlines  "):
        ids = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        out = httpx.post(base + "/detokenize", json={"model": tiny_engine.model_name, "tokens": ids})
        assert out.status_code == 200 and out.json() == {"prompt": tok.decode(ids)}
        assert out.json()["prompt"] == text


def test_tokenize_bad_input(tiny_engine, tiny_server, drained):
    base = tiny_server.base_url
    vocab = tiny_engine.model_config.vocab_size
    cases = [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
             ("/tokenize", {"messages": []}, "messages"),
             ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
              "continue_final_message"),
             ("/detokenize", {"tokens": [vocab]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens.0"),
             ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens")]
    for path, body, param in cases:
        err = _error(httpx.post(base + path, json=body), 400, "BadRequestError")
        assert err["param"] == param, (path, body, err)
    for path, body in (("/tokenize", {"model": "nope", "prompt": "x"}), ("/detokenize", {"model": "nope",
                                                                                         "tokens": [1]})):
        assert _error(httpx.post(base + path, json=body), 404, "NotFoundError")["param"] == "model"
    for method in ("GET", "POST"):
        r = httpx.request(method, base + "/ping")
        assert r.status_code == 200 and r.content == b""


# ------------------------------------------------------------------------------------------ request logs
def test_request_log_lines(tiny_engine, drained, caplog):
    caplog.set_level(logging.INFO, logger="kvllm.server")
    with serve(tiny_engine, enable_log_requests=True, max_log_len=5) as srv:
        _complete(srv.base_url, {"X-Request-Id": "logged"})
    lines = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
    assert len(lines) == 1 and "cmpl-logged-" in lines[0] and repr(PROMPT[:5]) + "," in lines[0]
    caplog.clear()
    with serve(tiny_engine, enable_log_requests=True, disable_log_requests=True) as srv:
        _complete(srv.base_url)
    with serve(tiny_engine) as srv:  # off by default, as in current vLLM
        _complete(srv.base_url)
    assert not [r for r in caplog.records if "Received request" in r.getMessage()]


# ------------------------------------------------------------------------------------------------- flags
def test_ops_flags_parse():
    from engine.argspec import given
    from server.cli import build_parser
    from server.config import ServerConfig

    parser = build_parser()
    args = parser.parse_args([
        "serve", "m", "--api-key", "k1", "k2", "--allowed-origins", '["https://a.example"]',
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]', "--allow-credentials",
        "--max-request-body-size", "1MiB", "--enable-log-requests", "--max-log-len", "20",
        "--metrics-prefix", "vllm", "--no-enable-request-id-headers", "--disable-log-requests"])
    cfg = ServerConfig(**given(args, ServerConfig))
    assert cfg.api_key == ["k1", "k2"] and cfg.api_keys == ["k1", "k2"]
    assert (cfg.allowed_origins, cfg.allowed_methods, cfg.allowed_headers) == (["https://a.example"],
                                                                               ["GET", "POST"], ["authorization"])
    assert cfg.allow_credentials and cfg.max_request_body_size == 2**20 and cfg.max_log_len == 20
    assert cfg.metric_prefixes == ("vllm:",) and not cfg.enable_request_id_headers
    assert cfg.enable_log_requests and cfg.disable_log_requests and not cfg.log_requests
    assert ServerConfig(**given(parser.parse_args(["serve", "--max-request-body-size", "4096"]),
                                ServerConfig)).max_request_body_size == 4096
    default = ServerConfig(**given(parser.parse_args(["serve"]), ServerConfig))
    assert default == ServerConfig()
    assert default.allowed_origins == ["*"] and default.metric_prefixes == ("vllm:", "kvllm:")
    assert not default.log_requests and default.enable_request_id_headers and default.api_key is None
    for bad in (["--allowed-origins", "*"], ["--allowed-origins", '{"a": 1}'], ["--metrics-prefix", "sglang"],
                ["--max-request-body-size", "0"], ["--max-request-body-size", "lots"], ["--api-key"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key=[""])
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerConfig(metrics_prefix="x")


def test_readme_lists_the_server_and_engine_flags():
    from pathlib import Path

    from engine.argspec import markdown_table
    from engine.config import EngineConfig
    from server.config import ServerConfig

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown_table(ServerConfig) in readme, "regenerate the README's server-flag table"
    assert markdown_table(EngineConfig) in readme, "regenerate the README's engine-flag table"
    vllm_users = readme.split("## vLLM users", 1)[1].split("\n## ", 1)[0]
    for flag in ("--gpu-memory-utilization", "--swap-space", "--enforce-eager", "--api-key", "--reasoning-parser",
                 "--tool-call-parser", "--chat-template", "--generation-config", "--max-logprobs"):
        assert flag in vllm_users, flag


def test_kvllm_serve_applies_the_ops_flags(tiny_server_model_dir, tmp_path):
    """`kvllm serve` in a subprocess: the flags reach the app (key, metrics prefix, body limit)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", str(tiny_server_model_dir), "--port",
                             str(port), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                             "--threads", "1", "--api-key", "cli-key", "--metrics-prefix", "vllm",
                             "--max-request-body-size", "1KiB", "--disable-uvicorn-access-log"],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, tmp_path / "serve.log", timeout=180)
        auth = {"Authorization": "Bearer cli-key"}
        assert _complete(base).status_code == 401
        assert _complete(base, auth).status_code == 200
        _error(httpx.post(base + "/v1/completions", headers=auth, json={"prompt": "x" * 2000}), 413,
               "RequestEntityTooLargeError")
        text = httpx.get(base + "/metrics").text
        assert "vllm:num_requests_waiting{" in text and "kvllm:" not in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
