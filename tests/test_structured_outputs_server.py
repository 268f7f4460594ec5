"""Structured outputs over HTTP with the official openai client: `response_format`, vLLM's `structured_outputs` and
the older `guided_*` fields on chat and completions, streaming included; a rejected spec is a 400 naming the field
the user sent, and the server keeps serving (the shared engine drains and checks its invariants after each test)."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import openai_client

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extra")
pytest.importorskip("xgrammar", reason="xgrammar is installed by make install")

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "population": {"type": "integer", "minimum": 0},
                         "capital": {"type": "boolean"},
                         "kind": {"enum": ["town", "city", "village"]}},
          "required": ["city", "population", "capital", "kind"], "additionalProperties": False}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # options merge with a constraint sent elsewhere
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai_client(tiny_server.base_url)


def check(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_chat_response_format_json_schema(tiny_engine, client, drained):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        r = client.chat.completions.create(model=tiny_engine.model_name, messages=MESSAGES, max_tokens=120,
                                           temperature=1.0, seed=seed, response_format=fmt, extra_body=COMPACT)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        check(choice.message.content)


def test_completions_structured_outputs_json_streamed_with_n(tiny_engine, client, drained):
    texts, finish = {}, {}
    stream = client.completions.create(model=tiny_engine.model_name, prompt="City:", max_tokens=120, n=3, seed=3,
                                       temperature=1.0, stream=True,
                                       extra_body={"structured_outputs": {"json": SCHEMA,
                                                                          "disable_any_whitespace": True}})
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}
    for text in texts.values():
        check(text)


def test_chat_stream_with_guided_json(tiny_engine, client, drained):
    stream = client.chat.completions.create(model=tiny_engine.model_name, messages=MESSAGES, max_tokens=120,
                                            temperature=1.0, seed=11, stream=True,
                                            extra_body={"guided_json": SCHEMA, **COMPACT,
                                                        "guided_decoding_backend": "xgrammar"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check(text)


def test_guided_regex_choice_and_grammar_on_completions(tiny_engine, client, drained):
    regex = r"\d{3}-[A-Z]{2}"
    r = client.completions.create(model=tiny_engine.model_name, prompt="Code:", max_tokens=20, n=4, seed=1,
                                  temperature=1.0, extra_body={"guided_regex": regex})
    assert all(re.fullmatch(regex, c.text) for c in r.choices), [c.text for c in r.choices]
    choices = ["red", "green", "blue"]
    r = client.completions.create(model=tiny_engine.model_name, prompt="Color:", max_tokens=10, n=4, seed=2,
                                  temperature=1.0, extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=tiny_engine.model_name, prompt="Sum:", max_tokens=30, seed=3,
                                  temperature=1.0, extra_body={"structured_outputs": {
                                      "grammar": 'root ::= [1-9] " + " [1-9] " = " [0-9]+'}})
    assert re.fullmatch(r"[1-9] \+ [1-9] = [0-9]+", r.choices[0].text), r.choices[0].text


def test_json_object_and_text_response_formats(tiny_engine, client, drained):
    r = client.chat.completions.create(model=tiny_engine.model_name, messages=MESSAGES, max_tokens=8, seed=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model=tiny_engine.model_name, messages=MESSAGES, max_tokens=4, seed=0,
                                       temperature=0, response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"


def _post(srv, path, body):
    return httpx.post(srv.base_url + path, json=body, timeout=30)


@pytest.mark.parametrize("path,extra,param,fragment", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema", "bogus"),
    ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "parenthes"),
    ("/v1/completions", {"guided_grammar": 'root ::= "a" nothing'}, "guided_grammar", "nothing"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("/v1/chat/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "only one"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "schema"),
    ("/v1/completions", {"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs",
     "needs one of"),
    ("/v1/completions", {"guided_whitespace_pattern": r"\s*", "guided_json": SCHEMA}, "guided_whitespace_pattern",
     "not supported"),
    ("/v1/completions", {"structured_outputs": {"regx": "a"}}, "structured_outputs.regx", None),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty"),
])
def test_bad_specs_are_400s_naming_the_field(tiny_server, tiny_engine, drained, path, extra, param, fragment):
    body = {"model": tiny_engine.model_name, "max_tokens": 4, **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"})
    r = _post(tiny_server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError", err
    if fragment is not None:
        assert fragment in err["message"], err["message"]
    ok = _post(tiny_server, "/v1/completions", {"model": tiny_engine.model_name, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
