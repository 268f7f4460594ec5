"""vLLM's serving defaults: `--generation-config auto|vllm|FOLDER` (the model's generation_config.json as default
sampling parameters), `--chat-template FILE|TEMPLATE` and `--max-logprobs`. References: hand-written
generation_config.json files (and transformers' own reading of them), Jinja2 rendering the template independently,
the SamplingParams the engine receives, and seeded sampling with the same parameters given explicitly."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from api.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from api.sampling import to_sampling_params
from engine.chat_template import load_chat_template
from engine.generation_config import sampling_defaults
from server.config import ServerConfig
from server_fixtures import build_engine, running_engine, serve, wait_drained

GEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 6, "bos_token_id": 1,
       "eos_token_id": 2, "min_p": None}
GEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 6}
# whitespace-separated words of the tiny word-level tokenizer, so the rendered prompt has no unknown tokens
TEMPLATE = ("{% for m in messages %}w{{ 10 + loop.index }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w99{% endif %}")
MESSAGES = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]


def _with_generation_config(src: Path, dst: Path, gen: dict) -> Path:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


@pytest.fixture(scope="module")
def gen_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return _with_generation_config(tiny_llama_dir, tmp_path_factory.mktemp("gen") / "model", GEN)


@pytest.fixture(scope="module")
def gen_engine(gen_model_dir):
    eng = build_engine(gen_model_dir, block_size=4, num_kv_blocks=128, max_model_len=128)
    eng.start()
    seen = []
    new_request = eng.new_request

    def recording(prompt, params=None, request_id=None):  # the SamplingParams the engine receives
        seen.append(params)
        return new_request(prompt, params, request_id)

    eng.new_request = recording
    eng.seen_params = seen
    yield eng
    try:
        wait_drained(eng)
    finally:
        eng.shutdown()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=60)


# ------------------------------------------------------------------------------------------ generation config
def test_sampling_defaults_read_the_file_as_transformers_does(tmp_path):
    from transformers import GenerationConfig

    (tmp_path / "generation_config.json").write_text(json.dumps(GEN))
    assert sampling_defaults("auto", tmp_path) == GEN_DEFAULTS
    assert sampling_defaults(str(tmp_path), None) == GEN_DEFAULTS  # a folder instead of the model's
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults("auto", tmp_path / "no-such-model") == {} and sampling_defaults("auto", None) == {}
    # vLLM keeps the non-default fields of transformers' GenerationConfig (all of its defaults are None in v5)
    diff = GenerationConfig.from_pretrained(tmp_path, local_files_only=True).to_diff_dict()
    names = {"max_new_tokens": "max_tokens"}
    expected = {names.get(k, k): v for k, v in diff.items()
                if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")}
    assert sampling_defaults("auto", tmp_path) == expected


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_k", 2.5), ("max_new_tokens", 0),
                                         ("repetition_penalty", 0), ("min_p", 1.5), ("temperature", "hot")])
def test_sampling_defaults_reject_bad_values_by_name(tmp_path, field, value):
    (tmp_path / "generation_config.json").write_text(json.dumps({field: value}))
    with pytest.raises(ValueError, match=field):
        sampling_defaults("auto", tmp_path)


def test_generation_config_folder_must_hold_the_file(tmp_path):
    with pytest.raises(ValueError, match="generation_config.json"):
        ServerConfig(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="max_logprobs"):
        ServerConfig(max_logprobs=-2)


def test_to_sampling_params_order_request_then_default_then_builtin():
    plain = to_sampling_params(CompletionRequest(prompt="x"), defaults=GEN_DEFAULTS)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (0.7, 0.8, 20, 6)
    own = to_sampling_params(CompletionRequest(prompt="x", temperature=0, top_p=0.5, top_k=3, max_tokens=4),
                             defaults=GEN_DEFAULTS)
    assert (own.temperature, own.top_p, own.top_k, own.max_tokens) == (0, 0.5, 3, 4)
    # max_new_tokens caps every request, as in vLLM; a chat request without max_tokens gets the cap
    assert to_sampling_params(CompletionRequest(prompt="x", max_tokens=50), defaults=GEN_DEFAULTS).max_tokens == 6
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert to_sampling_params(chat, defaults=GEN_DEFAULTS).max_tokens == 6
    assert to_sampling_params(chat).max_tokens is None
    builtin = to_sampling_params(CompletionRequest(prompt="x"), defaults={})
    assert (builtin.temperature, builtin.top_p, builtin.top_k, builtin.max_tokens) == (1.0, 1.0, 0, 16)
    with pytest.raises(RequestError) as err:  # min_tokens is checked against the capped max_tokens
        to_sampling_params(CompletionRequest(prompt="x", min_tokens=10), defaults=GEN_DEFAULTS)
    assert err.value.param == "min_tokens"


def test_min_p_and_repetition_penalty_defaults_reach_the_sampler():
    """The generation config's min_p and repetition_penalty are defaults like the others: a request's own value
    wins, then the default, then the built-in neutral value."""
    defaults = {**GEN_DEFAULTS, "min_p": 0.05, "repetition_penalty": 1.1}
    p = to_sampling_params(CompletionRequest(prompt="x"), defaults=defaults)
    assert (p.min_p, p.repetition_penalty) == (0.05, 1.1)
    p = to_sampling_params(CompletionRequest(prompt="x", min_p=0.2, repetition_penalty=1.3), defaults=defaults)
    assert (p.min_p, p.repetition_penalty) == (0.2, 1.3)
    p = to_sampling_params(CompletionRequest(prompt="x"))
    assert (p.min_p, p.repetition_penalty) == (0.0, 1.0)


def test_penalty_defaults_are_logged_at_startup(caplog, gen_engine, tmp_path):
    folder = tmp_path / "penalties"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1, "min_p": 0.0}))
    from server.app import build_app

    with caplog.at_level(logging.INFO, logger="kvllm.server"):
        state = build_app(gen_engine, generation_config=str(folder)).state.kvllm
    assert state.sampling_defaults == {"repetition_penalty": 1.1, "min_p": 0.0}
    assert "Default sampling parameters have been overridden" in caplog.text
    assert "'repetition_penalty': 1.1" in caplog.text


def test_server_applies_the_models_generation_config(gen_engine, caplog):
    with caplog.at_level(logging.INFO, logger="kvllm.server"), serve(gen_engine) as srv:
        gen_engine.seen_params.clear()
        r = _post(srv, "/v1/completions", {"prompt": [5, 6, 7], "seed": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        p = gen_engine.seen_params[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.8, 20, 6)
        # seeded sampling: the defaults give what the same parameters give when sent explicitly
        explicit = _post(srv, "/v1/completions", {"prompt": [5, 6, 7], "seed": 3, "ignore_eos": True,
                                                  "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 6})
        assert explicit.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        r = _post(srv, "/v1/completions", {"prompt": [5, 6, 7], "temperature": 0, "top_p": 0.5, "top_k": 2,
                                           "max_tokens": 50})
        p = gen_engine.seen_params[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0, 0.5, 2, 6)
    assert "Using default chat and completion sampling params from model: " \
           "{'temperature': 0.7, 'top_p': 0.8, 'top_k': 20, 'max_tokens': 6}" in caplog.text
    with serve(gen_engine, chat_template=TEMPLATE) as srv:  # chat: no max_tokens means the cap
        r = _post(srv, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        p = gen_engine.seen_params[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.8, 20, 6)


def test_generation_config_vllm_ignores_it(gen_engine, tmp_path):
    with serve(gen_engine, generation_config="vllm") as srv:
        gen_engine.seen_params.clear()
        r = _post(srv, "/v1/completions", {"prompt": [5, 6, 7], "seed": 3, "ignore_eos": True})
        p = gen_engine.seen_params[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 16)
        explicit = _post(srv, "/v1/completions", {"prompt": [5, 6, 7], "seed": 3, "ignore_eos": True,
                                                  "temperature": 1.0, "max_tokens": 16})
        assert r.json()["choices"][0]["text"] == explicit.json()["choices"][0]["text"]
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5}))
    with serve(gen_engine, generation_config=str(folder)) as srv:
        _post(srv, "/v1/completions", {"prompt": [5, 6, 7]})
        p = gen_engine.seen_params[-1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 1.0, 5, 16)


# -------------------------------------------------------------------------------------------- chat template
def _render(template: str, messages: list[dict]) -> str:
    import jinja2

    return jinja2.Template(template).render(messages=messages, add_generation_prompt=True)


def test_load_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(path)
    assert load_chat_template(TEMPLATE) == TEMPLATE  # does not open, has Jinja characters: the template itself
    assert load_chat_template("line one\nline two") == "line one\nline two"
    assert load_chat_template(None) is None
    for missing in (str(tmp_path / "missing.jinja"), tmp_path / "missing.jinja", "templates/chatml.jinja"):
        with pytest.raises(ValueError, match="looks like a file path"):
            load_chat_template(missing)
    with pytest.raises(ValueError, match="looks like a file path"):
        ServerConfig(chat_template="no/such/template.jinja")  # at startup, before the model loads


@pytest.fixture(scope="module")
def word_engine(tiny_llama_dir):
    """The tiny model with its word-level tokenizer, which has no chat template of its own."""
    with running_engine(tiny_llama_dir, block_size=4, num_kv_blocks=128, max_model_len=128) as eng:
        yield eng


def test_engine_chat_with_a_chat_template(word_engine, tmp_path):
    from engine.sampling_params import SamplingParams

    expected = _render(TEMPLATE, MESSAGES)
    assert expected == "w11 w5 w6 w12 w7 w8 w9 w99"
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    with pytest.raises(ValueError, match="no chat template"):
        word_engine.apply_chat_template(MESSAGES)
    assert word_engine.apply_chat_template(MESSAGES, chat_template=TEMPLATE) == expected
    assert word_engine.apply_chat_template(MESSAGES, chat_template=str(path)) == expected
    out = word_engine.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False,
                           chat_template=str(path))[0]
    assert out.prompt_token_ids == [11, 5, 6, 12, 7, 8, 9, 99]


@pytest.mark.parametrize("form", ["file", "inline"])
def test_server_chat_template_file_or_inline(word_engine, tmp_path, form):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    ids = [11, 5, 6, 12, 7, 8, 9, 99]  # _render(TEMPLATE, MESSAGES), word by word
    chat = {"messages": MESSAGES, "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    with serve(word_engine) as srv:
        assert _post(srv, "/v1/chat/completions", chat).status_code == 400  # no template without the flag
    with serve(word_engine, chat_template=str(path) if form == "file" else TEMPLATE) as srv:
        r = _post(srv, "/v1/chat/completions", chat)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        same = _post(srv, "/v1/completions", {"prompt": ids, "temperature": 0, "max_tokens": 5, "ignore_eos": True})
        assert r.json()["choices"][0]["message"]["content"] == same.json()["choices"][0]["text"]


# --------------------------------------------------------------------------------------------- max_logprobs
def test_max_logprobs_bounds_requests(word_engine):
    with serve(word_engine, max_logprobs=3) as srv:
        ok = _post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 3})
        tops = ok.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert ok.status_code == 200 and all(len(t) in (3, 4) for t in tops)  # 4: the sampled token is not in them
        for path, body, param in [
                ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 4}, "logprobs"),
                ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}, "top_logprobs")]:
            r = _post(srv, path, body)
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == param and "at most 3" in err["message"] and err["code"] == 400
    with serve(word_engine) as srv:  # vLLM's default: 20
        assert _post(srv, "/v1/completions", {"prompt": [5], "max_tokens": 1, "logprobs": 20}).status_code == 200
        assert _post(srv, "/v1/completions", {"prompt": [5], "max_tokens": 1, "logprobs": 21}).status_code == 400
