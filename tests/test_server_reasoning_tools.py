"""Reasoning parsers and tool calls through the real server: scripted tiny Llamas (tests/helpers_scripted.py,
checked against HF transformers' greedy generate) whose output contains think markers and hermes tool calls,
served by uvicorn on loopback and driven with the official openai SDK, streamed and not."""
from __future__ import annotations

import json

import httpx
import pytest
from helpers_scripted import (
    R1_PIECES,
    THINK_PIECES,
    TOOL_PIECES,
    TOOLS,
    check_with_transformers,
    write_scripted_llama,
)
from server_fixtures import build_engine, openai_client, serve, wait_drained

from engine.sampling_params import SamplingParams

USER = [{"role": "user", "content": "What is 2+2? And the weather in Paris?"}]
NAMED_PIECES = ['{"city": ', '"Paris"}']
REQUIRED_PIECES = ['[{"name": "get_weather", ', '"parameters": {"city": "Paris"}}, ', '{"name": "get_time", ',
                   '"parameters": {"timezone": "UTC"}}]']
SCRIPTS = {"think": (THINK_PIECES, False), "r1": (R1_PIECES, True), "tool": (TOOL_PIECES, False),
           "named": (NAMED_PIECES, False), "required": (REQUIRED_PIECES, False)}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return {k: write_scripted_llama(tmp_path_factory.mktemp(f"scripted-{k}"), pieces, open_think=open_think)
            for k, (pieces, open_think) in SCRIPTS.items()}


@pytest.fixture(scope="module")
def engines(scripted):
    engs = {k: build_engine(m.path, max_model_len=2048, num_kv_blocks=320) for k, m in scripted.items()}
    for e in engs.values():
        e.start()
    yield engs
    try:
        for e in engs.values():
            wait_drained(e)
    finally:
        for e in engs.values():
            e.shutdown()


@pytest.fixture(autouse=True)
def _drained(request):
    yield
    if "engines" in request.fixturenames:
        for e in request.getfixturevalue("engines").values():
            wait_drained(e)


def _chat(client, engine, stream=False, **kw):
    kw.setdefault("messages", USER)
    out = client.chat.completions.create(model=engine.model_name, temperature=0, stream=stream, **kw)
    return list(out) if stream else out


def _collect(chunks):
    """Concatenated reasoning / content, tool calls by index, finish reasons and the deltas of a chat stream."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish, deltas = [], []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        deltas.append(d)
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.id is not None:
                assert t.index not in calls and t.type == "function" and t.function.name
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
            calls[t.index]["arguments"] += t.function.arguments or ""
        if c.choices[0].finish_reason:
            finish.append(c.choices[0].finish_reason)
    return reasoning, content, calls, finish, deltas


# ------------------------------------------------------------------------------------------- the models
def test_scripted_models_follow_their_script(scripted, engines):
    """HF transformers and kvllm's engine both greedily emit each script, with or without tools in the prompt."""
    for key, model in scripted.items():
        for tools in (None, TOOLS):
            assert check_with_transformers(model, USER, tools=tools) == list(model.token_ids), key
        tok = engines[key].tokenizer
        ids = tok(tok.apply_chat_template(USER, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False).input_ids
        out = engines[key].generate([ids], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == list(model.token_ids) and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == model.text


# ------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_split(engines, scripted, parser):
    eng = engines["think"]
    with serve(eng) as plain, serve(eng, reasoning_parser=parser) as srv:
        raw = _chat(openai_client(plain.base_url), eng)
        client = openai_client(srv.base_url)
        r = _chat(client, eng)
        msg = r.choices[0].message
        assert raw.choices[0].message.content == scripted["think"].text  # no parser: the raw text
        assert msg.reasoning_content == "The user asks for 2+2." and msg.reasoning == msg.reasoning_content
        assert msg.content == "The answer is 4." and r.choices[0].finish_reason == "stop"
        # the think tokens count: the usage is the whole generation's, the same as without a parser
        assert r.usage.completion_tokens == len(scripted["think"].token_ids) == raw.usage.completion_tokens
        chunks = _chat(client, eng, stream=True, stream_options={"include_usage": True})
        reasoning, content, calls, finish, deltas = _collect(chunks)
        assert (reasoning, content, calls, finish) == ("The user asks for 2+2.", "The answer is 4.", {}, ["stop"])
        assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
        kinds = ["r" if getattr(d, "reasoning_content", None) else "c" for d in deltas if d.content or
                 getattr(d, "reasoning_content", None)]
        assert kinds == sorted(kinds, reverse=True)  # all reasoning before any content
        for d in deltas:  # no marker, whole or partial, leaks into a delta
            for text in (d.content or "", getattr(d, "reasoning_content", None) or ""):
                assert "<" not in text and "ink>" not in text, text
            assert getattr(d, "reasoning", None) == getattr(d, "reasoning_content", None)
        assert chunks[-1].usage.completion_tokens == len(scripted["think"].token_ids)


def test_include_reasoning_false(engines, scripted):
    eng = engines["think"]
    with serve(eng, reasoning_parser="deepseek_r1") as srv:
        client = openai_client(srv.base_url)
        r = _chat(client, eng, logprobs=True, extra_body={"include_reasoning": False})
        msg = r.choices[0].message
        assert msg.content == "The answer is 4." and msg.reasoning_content is None and msg.reasoning is None
        assert r.choices[0].logprobs is None  # they would show the reasoning's tokens
        assert r.usage.completion_tokens == len(scripted["think"].token_ids)
        reasoning, content, _, finish, deltas = _collect(_chat(client, eng, stream=True,
                                                               extra_body={"include_reasoning": False}))
        assert (reasoning, content, finish) == ("", "The answer is 4.", ["stop"])
        assert deltas[0].role == "assistant" and deltas[0].content == "The answer"


def test_reasoning_opened_in_the_prompt_and_the_thinking_switch(engines, scripted):
    """The R1-style script only closes the block (the template opened it). With enable_thinking false the
    template writes an empty block into the prompt, so nothing in the output is reasoning."""
    eng = engines["r1"]
    text = scripted["r1"].text
    for parser in ("deepseek_r1", "qwen3"):
        with serve(eng, reasoning_parser=parser) as srv:
            client = openai_client(srv.base_url)
            msg = _chat(client, eng).choices[0].message
            assert (msg.reasoning_content, msg.content) == ("Two plus two makes four.", "It is 4.")
            reasoning, content, _, _, _ = _collect(_chat(client, eng, stream=True))
            assert (reasoning, content) == ("Two plus two makes four.", "It is 4.")
            off = {"chat_template_kwargs": {"enable_thinking": False}, "return_prompt_text": True}
            r = _chat(client, eng, extra_body=off)
            assert r.model_extra["prompt_text"].endswith("<think>\n\n</think>\n\n")
            assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (None, text)
            reasoning, content, _, _, _ = _collect(_chat(client, eng, stream=True, extra_body=off))
            assert (reasoning, content) == ("", text)


# ------------------------------------------------------------------------------------------------ tools
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TIME_ARGS = '{"timezone": "Europe/Paris"}'


def _tool_server(eng, **kw):
    return serve(eng, enable_auto_tool_choice=True, tool_call_parser="hermes", **kw)


def test_tool_call_round_trip(engines, scripted):
    eng = engines["tool"]
    with _tool_server(eng, reasoning_parser="deepseek_r1") as srv:
        client = openai_client(srv.base_url)
        r = _chat(client, eng, tools=TOOLS)
        msg, choice = r.choices[0].message, r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert msg.reasoning_content == "I need the weather." and msg.content == "Let me check."
        assert [(t.type, t.function.name, t.function.arguments) for t in msg.tool_calls] == \
            [("function", "get_weather", WEATHER_ARGS), ("function", "get_time", TIME_ARGS)]
        ids = [t.id for t in msg.tool_calls]
        assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == 2
        assert r.usage.completion_tokens == len(scripted["tool"].token_ids)

        reasoning, content, calls, finish, deltas = _collect(_chat(client, eng, stream=True, tools=TOOLS))
        assert (reasoning, content, finish) == ("I need the weather.", "Let me check.", ["tool_calls"])
        assert {i: (c["name"], c["arguments"]) for i, c in calls.items()} == \
            {0: ("get_weather", WEATHER_ARGS), 1: ("get_time", TIME_ARGS)}  # the same text as not streamed
        assert sum(1 for d in deltas for t in d.tool_calls or [] if t.function.arguments) >= 3  # args stream
        assert not any("tool" in (d.content or "") for d in deltas)

        # the assistant's calls and the tool results go back through the chat template
        history = USER + [msg.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": ids[0], "content": '{"temperature": 21}'},
                          {"role": "tool", "tool_call_id": ids[1], "content": "14:05"}]
        r2 = _chat(client, eng, tools=TOOLS, messages=history, extra_body={"return_prompt_text": True})
        prompt = r2.model_extra["prompt_text"]
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n' \
               '</tool_call>' in prompt
        assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in prompt
        assert prompt.index("get_weather\", \"arguments\"") < prompt.index("temperature") < prompt.index("14:05")
        # an independent rendering: HF's template with the arguments as objects
        tok = eng.tokenizer
        ref_history = json.loads(json.dumps(history))
        for call in ref_history[1]["tool_calls"]:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        ref = tok.apply_chat_template(ref_history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert prompt == ref and r2.usage.prompt_tokens == len(tok(ref, add_special_tokens=False).input_ids)
        assert r2.choices[0].finish_reason == "tool_calls"
        chunks = _chat(client, eng, stream=True, tools=TOOLS, messages=history,
                       extra_body={"return_prompt_text": True})
        assert chunks[0].model_extra["prompt_text"] == ref and "prompt_text" not in chunks[1].model_extra


def test_tool_calls_without_reasoning_parser_and_with_one_call(engines):
    eng = engines["tool"]
    with _tool_server(eng) as srv:
        client = openai_client(srv.base_url)
        msg = _chat(client, eng, tools=TOOLS, tool_choice="auto").choices[0].message
        assert msg.content == "<think>I need the weather.</think>Let me check." and msg.reasoning_content is None
        assert len(msg.tool_calls) == 2
        one = _chat(client, eng, tools=TOOLS, parallel_tool_calls=False)
        assert [t.function.name for t in one.choices[0].message.tool_calls] == ["get_weather"]
        _, _, calls, finish, _ = _collect(_chat(client, eng, stream=True, tools=TOOLS, parallel_tool_calls=False))
        assert list(calls) == [0] and calls[0]["arguments"] == WEATHER_ARGS and finish == ["tool_calls"]


def test_tool_choice_none_leaves_the_output_alone(engines, scripted):
    eng = engines["tool"]
    for kw in ({"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}, {}):
        with serve(eng, reasoning_parser="qwen3", **kw) as srv:
            client = openai_client(srv.base_url)
            r = _chat(client, eng, tools=TOOLS, tool_choice="none", extra_body={"return_prompt_text": True})
            msg = r.choices[0].message
            assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
            assert msg.content == scripted["tool"].text.split("</think>")[1]  # the calls stay text
            assert msg.reasoning_content == "I need the weather."
            assert "<tools>" in r.model_extra["prompt_text"]  # the tools are still shown to the model
            reasoning, content, calls, finish, _ = _collect(_chat(client, eng, stream=True, tools=TOOLS,
                                                                  tool_choice="none"))
            assert (content, calls, finish) == (msg.content, {}, ["stop"])


def _error(client_call):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client_call()
    return e.value.body, e.value.status_code


def test_tool_choice_errors(engines):
    eng = engines["tool"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with serve(eng) as srv:
        client = openai_client(srv.base_url)
        for kw in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):  # auto is the default with tools
            body, status = _error(lambda: _chat(client, eng, **kw))
            assert status == 400 and body["code"] == 400 and body["param"] == "tool_choice"
            assert body["message"] == '"auto" tool choice requires --enable-auto-tool-choice and ' \
                                      '--tool-call-parser to be set'
        body, _ = _error(lambda: _chat(client, eng, tool_choice="required"))
        assert body["message"] == "When using `tool_choice`, `tools` must be set."
        body, _ = _error(lambda: _chat(client, eng, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}}))
        assert "does not match any of the specified `tools`" in body["message"]
        body, _ = _error(lambda: _chat(client, eng, tools=[]))
        assert body["param"] == "tools"
        assert httpx.get(srv.base_url + "/health").status_code == 200


@pytest.fixture
def structured_outputs_seen(monkeypatch):
    """Records the structured-outputs constraint of every request the server makes (the sampler applies it)."""
    from engine.engine import Engine

    seen = []
    real = Engine.new_request

    def new_request(self, prompt, params=None, request_id=None):
        seen.append(params.structured_outputs)
        return real(self, prompt, params, request_id)

    monkeypatch.setattr(Engine, "new_request", new_request)
    return seen


def test_forced_tool_calls_through_structured_outputs(engines, structured_outputs_seen):
    from server.tools.schema import tool_choice_schema

    named = {"type": "function", "function": {"name": "get_weather"}}
    for key, choice, want, finish in (
            ("named", named, [("get_weather", '{"city": "Paris"}')], "stop"),  # named: "stop", as in OpenAI
            ("required", "required", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "UTC"}')],
             "tool_calls")):
        eng = engines[key]
        with serve(eng) as srv:  # forced calls need no --enable-auto-tool-choice
            client = openai_client(srv.base_url)
            structured_outputs_seen.clear()
            r = _chat(client, eng, tools=TOOLS, tool_choice=choice)
            assert [c.json for c in structured_outputs_seen] == [tool_choice_schema(TOOLS, choice)]
            msg = r.choices[0].message
            assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == want
            assert msg.content == "" and r.choices[0].finish_reason == finish
            _, content, calls, fin, _ = _collect(_chat(client, eng, stream=True, tools=TOOLS, tool_choice=choice))
            assert [(c["name"], c["arguments"]) for c in calls.values()] == want and fin == [finish]


def test_tool_markers_are_kept_in_the_text_only_where_they_are_special_tokens():
    """vLLM's hermes parser decodes with skip_special_tokens off, for vocabularies where <tool_call> is special;
    kvllm does so only then (its text would otherwise end with the EOS token's text)."""
    from helpers_scripted import scripted_tokenizer

    from server.chat import markers_are_special
    from server.tools.hermes import HermesToolParser

    tok = scripted_tokenizer(["<tool_call>", "</tool_call>"], open_think=False)
    assert not markers_are_special(tok, HermesToolParser.markers)  # added as normal tokens, as in Qwen's vocabulary
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    assert markers_are_special(tok, HermesToolParser.markers) and not markers_are_special(tok, ())


# ---------------------------------------------------------------------------------------------- the CLI
def test_config_and_flags():
    from engine.argspec import given
    from server.cli import build_parser
    from server.config import ServerConfig

    args = build_parser().parse_args(["serve", "m", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"])
    cfg = ServerConfig(**given(args, ServerConfig))
    assert (cfg.reasoning_parser, cfg.enable_auto_tool_choice, cfg.tool_call_parser) == ("qwen3", True, "hermes")
    assert ServerConfig().reasoning_parser is None and not ServerConfig().enable_auto_tool_choice
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ServerConfig(tool_call_parser="mistral")
