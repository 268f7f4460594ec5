"""Hostile requests over HTTP, against a server with the qwen3 reasoning parser and hermes tool calls: JSON nested
past any parser's recursion (tool-call arguments, chat-template inputs, whole bodies), request ids that cannot be
headers, /tokenize's tools, marker tokens SmolLM2's vocabulary lacks, bad tool schemas under a forced tool_choice.
Each is a 400 in the OpenAI error shape naming the field (or a correct answer), and the server keeps serving; the
shared engine's blocks and invariants are checked after each test (server_fixtures)."""
from __future__ import annotations

import json

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import openai_error, post_json, serve
from server import chat, tools
from server.tools.forced import RequiredToolParser

HERMES = tools.get("hermes")
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def srv(tiny_engine):
    with serve(tiny_engine, reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield s


def _post(srv, body, path="/v1/chat/completions", headers=None):
    return post_json(srv, body, path, headers)


_error = openai_error


def _still_serving(srv):
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    ok = _post(srv, {"messages": HI, "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200, ok.text


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ------------------------------------------------------------------------------------------ deep nesting
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_deep_tool_call_arguments_are_a_400_naming_them(srv, path):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _nested(5000)}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "x", "tool_call_id": "c1"}]
    _error(_post(srv, {"messages": messages, "max_tokens": 2}, path), 400,
           "messages[1].tool_calls[0].function.arguments")
    _still_serving(srv)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("depth", [80, 900])  # past the field bound; past the body bound (jinja recursed there)
@pytest.mark.parametrize("where,param", [
    ("kwargs", "chat_template_kwargs.x"),
    ("tools", "tools[0].function.parameters"),
    ("message", "messages[0].extra"),
])
def test_deep_chat_template_inputs_are_a_400_naming_the_field(srv, path, depth, where, param):
    deep = json.loads(_nested(depth))
    body = {"messages": [dict(HI[0])], "max_tokens": 2}
    if where == "kwargs":
        body["chat_template_kwargs"] = {"x": deep}
    elif where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                       "x": deep}}}]
    else:
        body["messages"][0]["extra"] = deep
    err = _error(_post(srv, body, path), 400)
    if depth == 900:  # the whole body's bound names the field and its first key or index
        assert err["param"] == {"tools": "tools[0]", "message": "messages[0]"}.get(where, param), err
    else:
        assert err["param"] == param, err
    assert "nested deeper than" in err["message"]
    _still_serving(srv)


@pytest.mark.parametrize("raw", [
    "[" * 100000,
    '{"messages": ' + "[" * 100000,
    '{"messages": [{"role": "user", "content": "hi"}], "x": ' + "[" * 3000 + "]" * 3000 + "}",
])
def test_a_body_nested_past_the_json_decoder_is_a_400(srv, raw):
    err = _error(_post(srv, raw), 400)
    assert "nested too deeply" in err["message"], err
    _still_serving(srv)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/tokenize", {"prompt": "hi"}),
])
def test_a_deep_unknown_field_is_a_400_not_a_walk_of_it(srv, path, body):
    _error(_post(srv, dict(body, x=json.loads(_nested(500))), path), 400, "x[0]")
    _still_serving(srv)


# ------------------------------------------------------------------------------------------- request ids
@pytest.mark.parametrize("rid", ["job-日本-€", "a\r\nX-Injected: 1", "a\u0000b", "x" * 100000, "a b"])
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
])
def test_a_body_request_id_that_is_no_header_value_is_a_400(srv, rid, path, body):
    resp = _post(srv, dict(body, request_id=rid), path)
    _error(resp, 400, "request_id")
    echoed = resp.headers["X-Request-Id"]
    assert echoed.isascii() and len(echoed) <= 256 and "X-Injected" not in resp.headers
    _still_serving(srv)


@pytest.mark.parametrize("header", ["x" * 300, "caf\xe9".encode("latin-1"), b"a\x7fb"])
def test_an_x_request_id_header_that_cannot_be_echoed_is_a_400(srv, header):
    resp = _post(srv, {"messages": HI, "max_tokens": 2}, headers={"X-Request-Id": header})
    _error(resp, 400, "X-Request-Id")
    assert resp.headers["X-Request-Id"].isascii() and len(resp.headers["X-Request-Id"]) <= 256
    _still_serving(srv)


def test_uuid_and_job_ids_are_echoed_unchanged(srv):
    for rid in ("3f0c6a9e-5c1b-4a8e-9d2e-0b7f1c2d3e4f", "job-42:step/7_a.b", "y" * 256):
        resp = _post(srv, {"messages": HI, "max_tokens": 2, "request_id": rid})
        assert resp.status_code == 200 and resp.json()["id"] == f"chatcmpl-{rid}", resp.text
        assert resp.headers["X-Request-Id"] == rid
        resp = _post(srv, {"prompt": "hi", "max_tokens": 2}, "/v1/completions", headers={"X-Request-Id": rid})
        assert resp.status_code == 200 and resp.json()["id"] == f"cmpl-{rid}" and resp.headers["X-Request-Id"] == rid


# ------------------------------------------------------------------------------------------ /tokenize tools
@pytest.mark.parametrize("bad", ["x", [1, 2], [], [{"type": "function", "function": {}}], {"a": 1}])
def test_tokenize_checks_tools_as_chat_does(srv, bad):
    body = {"messages": HI, "tools": bad}
    chat = _post(srv, dict(body, max_tokens=2))
    err = _error(_post(srv, body, "/tokenize"), 400, chat.json()["error"]["param"])
    assert chat.status_code == 400 and err["message"] == chat.json()["error"]["message"]
    _still_serving(srv)


def test_tokenize_takes_tools_and_counts_as_chat_does(srv):
    tool = {"type": "function", "function": {"name": "get_weather_in_paris"}}
    with_tools = _post(srv, {"messages": HI, "tools": [tool]}, "/tokenize")
    assert with_tools.status_code == 200, with_tools.text
    chat = _post(srv, {"messages": HI, "tools": [tool], "tool_choice": "none", "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == with_tools.json()["count"]


# -------------------------------------------------------------------------------- markers the vocab lacks
def _chat_both(srv, body):
    """(message, streamed content, streamed calls {index: (name, arguments)}) of one request."""
    whole = _post(srv, body)
    assert whole.status_code == 200, whole.text
    content, calls = "", {}
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=dict(body, stream=True),
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                for t in delta.get("tool_calls") or ():
                    name, args = calls.get(t["index"], ("", ""))
                    fn = t.get("function") or {}
                    calls[t["index"]] = (name + (fn.get("name") or ""), args + (fn.get("arguments") or ""))
    return whole.json()["choices"][0]["message"], content, calls


def test_markers_missing_from_the_vocabulary_are_text_and_leave_special_tokens_skipped(srv):
    body = {"messages": HI, "tools": [TOOL], "guided_choice": ["hello"], "chat_template_kwargs": NO_THINKING,
            "max_tokens": 8, "temperature": 0}
    message, streamed, calls = _chat_both(srv, body)
    assert message["content"] == "hello" == streamed and not calls and not message.get("tool_calls")
    _still_serving(srv)


def test_a_forced_tool_call_text_parses_the_same_streamed_and_not(srv):
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    body = {"messages": HI, "tools": [TOOL], "guided_choice": [text], "chat_template_kwargs": NO_THINKING,
            "max_tokens": 40, "temperature": 0}
    message, streamed, calls = _chat_both(srv, body)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert whole == [("f", '{"a": 1}')] and calls == {0: ("f", '{"a": 1}')}
    assert (message["content"] or "") == streamed == ""


def test_smollm2_has_no_hermes_marker_tokens(tiny_engine):
    tok = tiny_engine.tokenizer
    assert not chat.markers_are_special(tok, HERMES.markers)  # the unknown token, <|endoftext|>, is special
    assert chat.special_marker(tok, "<|im_end|>") and not chat.special_marker(tok, "<tool_call>")


# ------------------------------------------------------------------------------------ tool schema errors
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "g"}}])
@pytest.mark.parametrize("parameters", [{"type": "bogus"}, {"type": "object", "properties": {"a": {"type": 5}}},
                                        {"type": "object", "properties": [1]}])
def test_a_forced_tools_bad_parameters_name_the_tool(srv, choice, parameters):
    bad = {"type": "function", "function": {"name": "g", "parameters": parameters}}
    resp = _post(srv, {"messages": HI, "tools": [TOOL, bad], "tool_choice": choice, "max_tokens": 4})
    err = _error(resp, 400, "tools[1].function.parameters")
    assert "structured_outputs" not in err["message"]
    _still_serving(srv)


# -------------------------------------------------------------------------------------- parsers, no server
def _stream(parser, text, size):
    content, calls, so_far = "", {}, ""
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    for i, chunk in enumerate(chunks):
        c, deltas = parser.delta(so_far, so_far + chunk, chunk, final=i == len(chunks) - 1)
        so_far += chunk
        content += c
        for d in deltas:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.name or ""), args + d.arguments)
    return content, calls


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"a": 1}}<|im_end|>',
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    'x<tool_call>{"name": "f", "arguments": {}}\n\n</tool_call><tool_call>{"name": "g"} junk',
])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_hermes_blocks_with_text_after_the_object_parse_the_same_streamed_and_not(text, size):
    content, calls = HERMES().extract(text)
    assert calls, "the object of each block is the call; what follows it in the block is dropped"
    streamed_content, streamed = _stream(HERMES(), text, size)
    assert streamed_content == (content or "")
    assert streamed == {i: (c.name, c.arguments) for i, c in enumerate(calls)}


def test_deep_model_output_is_content_not_a_recursion_error():
    deep = '<tool_call>{"name": "f", "arguments": ' + _nested(5000) + "}</tool_call>"
    assert HERMES().extract(deep) == (deep, [])
    required = '[{"name": "f", "parameters": {"a": ' + _nested(5000) + "}}]"
    assert RequiredToolParser().extract(required) == (required, [])
