"""The OpenAI-compatible server driven with the official `openai` client against a real uvicorn server and a
real Engine (tiny random Llama with the SmolLM2 tokenizer)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from engine.sampling_params import SamplingParams
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import openai_client, wait_healthy

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai_client(tiny_server.base_url)


def _greedy(engine, prompt, max_tokens, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return engine.generate([prompt], params, use_tqdm=False)[0]


# ------------------------------------------------------------------------------------------- basics
def test_models_health_version(tiny_server, tiny_engine, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_engine.model_name]
    raw = httpx.get(tiny_server.base_url + "/v1/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == tiny_engine.max_model_len
    assert card["owned_by"] == "kvllm" and card["permission"] == []
    one = httpx.get(f"{tiny_server.base_url}/v1/models/{tiny_engine.model_name}")
    assert one.status_code == 200 and one.json()["id"] == tiny_engine.model_name
    h = httpx.get(tiny_server.base_url + "/health")
    assert h.status_code == 200 and h.content == b""
    assert httpx.get(tiny_server.base_url + "/version").json()["version"]


def test_completion_greedy_equals_engine_generate(tiny_engine, client, drained):
    resp = client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = _greedy(tiny_engine, PROMPT, 12)
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(tiny_engine.encode_prompt(PROMPT))
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_greedy_equals_engine_generate(tiny_engine, client, drained):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(model=tiny_engine.model_name, messages=messages, max_tokens=10,
                                          temperature=0)
    tok = tiny_engine.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    ref = _greedy(tiny_engine, ids, 10)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # the engine's own chat() agrees
    assert tiny_engine.chat(messages, SamplingParams(temperature=0, max_tokens=10),
                            use_tqdm=False)[0].outputs[0].text == ref.outputs[0].text
    # content as a list of text parts is the same conversation
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    resp2 = client.chat.completions.create(model=tiny_engine.model_name, messages=parts, max_completion_tokens=10,
                                           temperature=0)
    assert resp2.choices[0].message.content == ref.outputs[0].text


def test_token_id_prompt_and_batch_of_prompts(tiny_engine, client, drained):
    ids = tiny_engine.encode_prompt(PROMPT)
    by_ids = client.completions.create(model=tiny_engine.model_name, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    prompts = ["Hello world", "Once upon a time"]
    batch = client.completions.create(model=tiny_engine.model_name, prompt=prompts, n=2, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        ref = _greedy(tiny_engine, p, 5, ignore_eos=True).outputs[0].text
        assert batch.choices[2 * i].text == ref and batch.choices[2 * i + 1].text == ref
    assert batch.usage.completion_tokens == 4 * 5
    assert batch.usage.prompt_tokens == sum(len(tiny_engine.encode_prompt(p)) for p in prompts)


def test_echo(tiny_engine, client, drained):
    resp = client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                     echo=True)
    ref = _greedy(tiny_engine, PROMPT, 4).outputs[0].text
    assert resp.choices[0].text == PROMPT + ref


# --------------------------------------------------------------------------------------------- streaming
def test_stream_completion_with_usage(tiny_engine, client, drained):
    ref = client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    content = [c for c in chunks if c.choices]
    assert len(content) >= 2
    assert "".join(c.choices[0].text for c in content) == ref.choices[0].text
    assert [c.choices[0].finish_reason for c in content[:-1]] == [None] * (len(content) - 1)
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == ref.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage_and_continuous_usage(tiny_engine, client, drained):
    chunks = list(client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=5,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    chunks = list(client.completions.create(
        model=tiny_engine.model_name, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5


def test_stream_chat_with_usage(tiny_engine, client, drained):
    messages = [{"role": "user", "content": "Tell me a story."}]
    ref = client.chat.completions.create(model=tiny_engine.model_name, messages=messages, max_tokens=8,
                                         temperature=0)
    chunks = list(client.chat.completions.create(model=tiny_engine.model_name, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in content) == ref.choices[0].message.content
    assert content[-1].choices[0].finish_reason == ref.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens


def test_raw_sse_framing(tiny_server, tiny_engine, drained):
    body = {"model": tiny_engine.model_name, "prompt": PROMPT, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        json.loads(ev[len("data: "):])


def test_stream_n_choices(tiny_engine, client, drained):
    chunks = list(client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, n=3, max_tokens=4,
                                            temperature=1.0, seed=7, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 12


# ----------------------------------------------------------------------------------- sampling behaviour
def test_n_and_seed(tiny_engine, client, drained):
    kw = dict(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, seed=1234, **kw)
    b = client.completions.create(n=3, seed=1234, **kw)
    c = client.completions.create(n=3, seed=4321, **kw)
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert a.usage.completion_tokens == 24
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.text for x in a.choices] != [x.text for x in c.choices]
    assert len({x.text for x in a.choices}) > 1  # the n samples differ from each other
    # the same seed through the engine directly gives the same samples
    ref = tiny_engine.generate([PROMPT], SamplingParams(n=3, seed=1234, temperature=1.0, max_tokens=8,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [o.text for o in ref.outputs] == [x.text for x in a.choices]


def test_max_tokens_and_stop(tiny_engine, client, drained):
    name = tiny_engine.model_name
    full = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
    short = client.completions.create(model=name, prompt=PROMPT, max_tokens=5, temperature=0)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    assert text.startswith(short.choices[0].text)
    # a stop string from the middle of the greedy text: output ends right before it
    stop = None
    for start in range(len(text) // 3, len(text) - 3):
        cand = text[start:start + 3]
        if cand.strip() and text.find(cand) == start:
            stop = cand
            break
    assert stop is not None
    cut = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra.get("stop_reason") == stop
    kept = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]
    # a stop token id
    ids = _greedy(tiny_engine, PROMPT, 16, ignore_eos=True).outputs[0].token_ids
    k = next(i for i in range(3, 16) if ids[i] not in ids[:i])
    tok_stop = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]})
    assert tok_stop.choices[0].finish_reason == "stop"
    assert tok_stop.choices[0].model_extra.get("stop_reason") == ids[k]
    assert tok_stop.usage.completion_tokens == k + 1
    # min_tokens masks the stop token id until that many tokens exist (min_tokens < max_tokens)
    late = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]], "min_tokens": k + 3})
    assert late.usage.completion_tokens >= k + 3
    late_ids = _greedy(tiny_engine, PROMPT, 16, ignore_eos=True, stop_token_ids=[ids[k]],
                       min_tokens=k + 3).outputs[0].token_ids
    assert ids[k] not in late_ids[:k + 3] and late.usage.completion_tokens == len(late_ids)
    # top_k/top_p extras are accepted
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0.7, top_p=0.9, seed=3,
                                  extra_body={"top_k": 20, "min_tokens": 2})
    assert r.usage.completion_tokens == 6


def test_logprobs(tiny_engine, client, drained):
    name = tiny_engine.model_name
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the top token
    assert lp.text_offset == sorted(lp.text_offset)
    c = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_kv_compression_field(tiny_engine, client, drained):
    name = tiny_engine.model_name
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"kv_compression": "none", "ignore_eos": True})
    ref = _greedy(tiny_engine, PROMPT, 6, ignore_eos=True)
    assert r.choices[0].text == ref.outputs[0].text
    cfg = {"method": "kara", "ratio": 0.5, "window": 32, "buffer": 8, "chunk_max": 4, "chunk_budget": 4,
           "compression_period": 24}
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=64, temperature=0,
                                  extra_body={"kv_compression": cfg, "ignore_eos": True})
    assert r.usage.completion_tokens == 64 and r.choices[0].finish_reason == "length"


def test_metrics(tiny_server, tiny_engine, client, drained):
    client.completions.create(model=tiny_engine.model_name, prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(tiny_server.base_url + "/metrics").text
    for name in ("kvllm:num_requests_running", "kvllm:num_requests_waiting", "kvllm:kv_cache_usage_perc",
                 "kvllm:time_to_first_token_seconds_bucket", "kvllm:inter_token_latency_seconds_bucket",
                 "kvllm:e2e_request_latency_seconds_count", "kvllm:prompt_tokens_total",
                 "kvllm:generation_tokens_total", "kvllm:num_preemptions_total",
                 "kvllm:compression_rounds_total", "kvllm:compression_blocks_freed_total",
                 "kvllm:compression_tokens_evicted_total", "kvllm:compression_seconds_total",
                 'kvllm:request_success_total{finished_reason="length"'):
        assert name in text, name
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, val = line.rsplit(" ", 1)
            values[key] = float(val)
    label = f'{{model_name="{tiny_engine.model_name}"}}'
    assert values["kvllm:generation_tokens_total" + label] >= 3
    assert values["kvllm:time_to_first_token_seconds_count" + label] >= 1
    assert 0.0 <= values["kvllm:kv_cache_usage_perc" + label] <= 1.0


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_parsing():
    from server.cli import build_parser, engine_kwargs_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "mymodel", "--port", "9000", "--num-kv-blocks", "64", "--max-model-len",
                              "512", "--kv-compression", "kara", "--kara-ratio", "0.4", "--kara-window", "256",
                              "--kara-buffer", "32", "--compression-period", "256", "--max-queued-requests", "8"])
    kw = engine_kwargs_from_args(args)
    assert args.model == "mymodel" and args.port == 9000 and args.max_queued_requests == 8
    assert kw["num_kv_blocks"] == 64 and kw["max_model_len"] == 512
    assert kw["kv_compression"] == {"method": "kara", "ratio": 0.4, "window": 256, "buffer": 32,
                                    "compression_period": 256}
    assert "dtype" not in kw  # engine defaults are kept
    assert "kv_compression" not in engine_kwargs_from_args(parser.parse_args(["serve"]))
    from engine.config import EngineConfig

    def config(*argv):  # what `kvllm serve` checks before loading anything (a usage error on failure)
        return EngineConfig(**engine_kwargs_from_args(parser.parse_args(["serve", *argv])))

    with pytest.raises(ValueError, match="not both"):
        config("--num-kv-blocks", "4", "--kv-cache-memory", "1GiB")
    with pytest.raises(ValueError, match="kv_compression.buffer"):
        config("--kara-window", "16", "--kara-buffer", "32")
    # the engine-wide default as one JSON value (like vLLM's --speculative-config), flags merged over it
    js = parser.parse_args(["serve", "--kv-compression", '{"method": "streaming", "ratio": 0.5}', "--kara-window",
                            "128", "--no-enable-prefix-caching"])
    kw = engine_kwargs_from_args(js)
    assert kw["kv_compression"] == {"method": "streaming", "ratio": 0.5, "window": 128}
    assert kw["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match="kv_compression.chunk_max"):
        config("--kv-compression", '{"method": "random", "chunk_max": 2}')
    with pytest.raises(SystemExit):  # invalid JSON: an argparse error
        parser.parse_args(["serve", "--kv-compression", "{oops"])
    b = parser.parse_args(["bench", "serve", "--num-prompts", "5", "--request-rate", "2.5", "--extra-body",
                           '{"kv_compression": "none"}', "--save-result", "--plot", "x.png"])
    assert b.num_prompts == 5 and b.request_rate == 2.5 and b.extra_body == {"kv_compression": "none"}
    assert b.save_result == "" and b.plot == "x.png"


@pytest.mark.slow
def test_cli_serve_real_smollm2_end_to_end(tmp_path):
    """`kvllm serve` (the CLI, in a subprocess) on the real SmolLM2 weights, queried with the openai client."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "smollm2", "--port", str(port),
                             "--num-kv-blocks", "128", "--max-model-len", "1024", "--dtype", "float32",
                             "--device", "cpu", "--disable-uvicorn-access-log"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, tmp_path / "serve.log", timeout=240)
        client = openai_client(base, timeout=120)
        resp = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=12,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in resp.choices[0].message.content
        logged = (tmp_path / "serve.log").read_text()
        assert "KV cache:" in logged
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_request_to_sampling_params_mapping():
    """The protocol → SamplingParams mapping, including per-request kv_compression over the server's setting."""
    from api.protocol import ChatCompletionRequest, CompletionRequest, RequestError
    from api.sampling import to_sampling_params
    from compression import KVCompressionConfig

    p = to_sampling_params(CompletionRequest(prompt="x", n=2, temperature=0, top_k=-1, stop="###", seed=5,
                                             logprobs=2, ignore_eos=True, min_tokens=1))
    assert (p.n, p.temperature, p.top_k, p.stop_strings, p.seed, p.logprobs, p.max_tokens) == \
        (2, 0.0, 0, ["###"], 5, 2, 16)
    assert p.ignore_eos and p.min_tokens == 1 and p.kv_compression is None
    assert to_sampling_params(CompletionRequest(prompt="x", temperature=1e-9)).temperature == pytest.approx(1e-2)
    assert to_sampling_params(CompletionRequest(prompt="x", top_k=10**6), vocab_size=100).top_k == 0
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=7, logprobs=True,
                                 top_logprobs=3)
    p = to_sampling_params(chat)
    assert p.max_tokens == 7 and p.logprobs == 3
    p = to_sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    assert p.max_tokens is None and p.logprobs is None  # chat: up to the context limit
    # per-request kv_compression is passed through as given and merged with the server's setting by the engine,
    # in one converter (compression.config.coerce); its errors still name the field
    assert to_sampling_params(CompletionRequest(prompt="x", kv_compression={"ratio": 0.25})).kv_compression == \
        {"ratio": 0.25}
    with pytest.raises(RequestError) as e:
        to_sampling_params(CompletionRequest(prompt="x", kv_compression={"buffer": 0}))
    assert e.value.param == "kv_compression.buffer" and e.value.status_code == 400
    from compression.stage import CompressionStage

    server = CompressionStage(KVCompressionConfig(method="kara", ratio=0.5, window=128, buffer=32,
                                                  compression_period=96))
    cfg = server.resolve({"ratio": 0.25})
    assert (cfg.method, cfg.ratio, cfg.window, cfg.buffer, cfg.compression_period) == ("kara", 0.25, 128, 32, 96)
    cfg = server.resolve("kara_no_chunk")
    assert (cfg.method, cfg.window, cfg.token2chunk) == ("kara_no_chunk", 128, False)
    assert server.resolve("none") is None and server.resolve(None).ratio == 0.5
    cfg = CompressionStage(None).resolve({"window": 64, "buffer": 8, "compression_period": 56})
    assert (cfg.method, cfg.window) == ("kara", 64)  # no server setting: the config defaults
    with pytest.raises(ValueError, match=r"kv_compression\.buffer"):
        server.resolve({"buffer": 500})
