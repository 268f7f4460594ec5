"""A vLLM deployment moved to kvllm unchanged: `kvllm serve` started with a vLLM launch line that uses every flag of
the drop-in list, driven by the official openai SDK as a vLLM user's client code drives vLLM: reasoning split out,
tool calls (streamed and not, and back through the template), JSON-schema, regex and choice constraints on seeded
samples, logit_bias, vLLM's metric names, and the API key."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import httpx
import jsonschema
import pytest
from helpers_scripted import _TEMPLATE, TOOL_PIECES, TOOLS, write_scripted_llama
from server_fixtures import openai_client, wait_healthy

USER = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_scripted_llama(tmp_path_factory.mktemp("launch-line"), TOOL_PIECES)
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(_TEMPLATE.replace("OPEN_THINK", "false"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("log") / "serve.log"
    log = open(log_path, "w")
    launch = [  # a vLLM launch line: each flag means what it means in vLLM (or is accepted with a warning)
        "serve", str(model.path), "--served-model-name", "scripted", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.85",
        "--api-key", "secret", "--chat-template", str(template), "--enforce-eager", "--disable-log-requests",
        "--trust-remote-code", "--tokenizer", str(model.path), "--generation-config", "vllm", "--max-logprobs", "5",
        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--swap-space", "1", "--seed", "0", "--max-num-seqs", "16", "--block-size", "16", "--enable-prefix-caching",
        "--threads", "1", "--disable-uvicorn-access-log"]
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", *launch], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path, timeout=180)
        yield base, model, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_the_launch_line_is_accepted_and_meaningless_flags_are_said_once(server):
    base, _, log_path = server
    text = log_path.read_text()
    for flag in ("enforce_eager", "gpu_memory_utilization"):
        assert text.count(f"ignored setting {flag}") == 1, text[-3000:]


def test_the_api_key_guards_the_api_and_leaves_probes_and_metrics_open(server):
    base, _, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(base + "/health").status_code == 200
    metrics = httpx.get(base + "/metrics").text
    assert "vllm:num_requests_waiting" in metrics and "vllm:kv_cache_usage_perc" in metrics


def _collect(stream):
    reasoning, content, calls = "", "", {}
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for t in d.tool_calls or []:
                call = calls.setdefault(t.index, {"name": "", "arguments": ""})
                call["name"] += (t.function.name or "") if t.function else ""
                call["arguments"] += (t.function.arguments or "") if t.function else ""
    return reasoning, content, [(c["name"], c["arguments"]) for c in calls.values()]


def test_reasoning_and_a_tool_call_round_trip_streamed_and_not(server):
    base, _, _ = server
    client = openai_client(base, api_key="secret")
    kw = dict(model="scripted", messages=USER, tools=TOOLS, temperature=0)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.reasoning_content == "I need the weather." and msg.content == "Let me check."
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]
    assert r.choices[0].finish_reason == "tool_calls"
    reasoning, content, streamed = _collect(client.chat.completions.create(stream=True, **kw))
    assert (reasoning, content) == ("I need the weather.", "Let me check.")
    assert [(n, json.loads(a)) for n, a in streamed] == calls
    history = USER + [msg.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in msg.tool_calls]
    again = client.chat.completions.create(**{**kw, "messages": history}, extra_body={"return_prompt_text": True})
    prompt = again.model_extra["prompt_text"]
    assert prompt.count("<tool_response>\nsunny\n</tool_response>") == 2 and '"name": "get_time"' in prompt


def test_json_schema_regex_and_choice_hold_on_seeded_samples_at_temperature_1(server):
    base, _, _ = server
    client = openai_client(base, api_key="secret")
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    for seed in range(20):
        r = client.chat.completions.create(model="scripted", messages=USER, temperature=1.0, seed=seed,
                                           max_tokens=64, response_format=fmt,
                                           extra_body={"structured_outputs": {"disable_any_whitespace": True}})
        msg = r.choices[0].message  # it thinks freely, then the schema holds from the end of its think block
        assert msg.reasoning_content, msg
        jsonschema.validate(json.loads(msg.content), SCHEMA)
    for seed in range(5):
        r = client.completions.create(model="scripted", prompt="code:", temperature=1.0, seed=seed, max_tokens=16,
                                      extra_body={"structured_outputs": {"regex": r"[ab]{3}-[0-9]"}})
        assert re.fullmatch(r"[ab]{3}-[0-9]", r.choices[0].text), r.choices[0].text
        r = client.completions.create(model="scripted", prompt="pick:", temperature=1.0, seed=seed, max_tokens=16,
                                      extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
        assert r.choices[0].text in ("alpha", "beta", "gamma")


def test_logit_bias_and_the_servers_logprob_bound(server):
    from transformers import AutoTokenizer

    base, model, _ = server
    client = openai_client(base, api_key="secret")
    z = AutoTokenizer.from_pretrained(model.path).convert_tokens_to_ids("Z")
    r = client.completions.create(model="scripted", prompt="hello", temperature=0, max_tokens=5,
                                  logit_bias={str(z): 100})
    assert r.choices[0].text == "ZZZZZ"
    import openai

    with pytest.raises(openai.BadRequestError) as err:  # --max-logprobs 5
        client.completions.create(model="scripted", prompt="hello", max_tokens=2, logprobs=6)
    assert err.value.body["param"] == "logprobs"
