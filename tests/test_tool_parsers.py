"""Tool calling, without a model: the hermes parser and the forced-call parsers (hand-worked outputs; any chunking
of an output streams to exactly the non-streamed calls), the JSON schemas that force calls (hand-written expected
schemas; jsonschema accepts the outputs they are meant to allow and rejects others), the tool_choice rules
(vLLM's messages) and the request/response models."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.protocol import ChatCompletionRequest, RequestError
from api.sampling import to_sampling_params
from api.tools import ChatCompletionTool, NamedToolChoice, ToolError, resolve_tool_choice
from server import tools
from server.tools.base import ParsedToolCall
from server.tools.forced import NamedToolParser, RequiredToolParser
from server.tools.jsonscan import object_members, value_end
from server.tools.schema import tool_choice_schema

HERMES = tools.get("hermes")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name":"get_time","arguments":{"tz":"Europe/Paris","opts":[1,{"a":"}"}]}}'


def test_registry():
    assert tools.names() == ["hermes"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; available: hermes"):
        tools.get("mistral")


@pytest.mark.parametrize("text,content,calls", [
    ("no tools here", "no tools here", []),
    ("", None, []),
    (f"Let me check.<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>\n{TIME}</tool_call>\n", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"tz":"Europe/Paris","opts":[1,{"a":"}"}]}')]),
    (f"<tool_call>{WEATHER}", None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),  # stopped on </tool_call>
    ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),  # no arguments: an empty object
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", '"{\\"x\\": 1}"')]),
    # a malformed call makes the whole output content (as in vLLM)
    ('ok <tool_call>{"name": "f", "arguments": {</tool_call>', 'ok <tool_call>{"name": "f", "arguments": {</tool_call>',
     []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
])
def test_hermes_extract(text, content, calls):
    got_content, got_calls = HERMES().extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c.arguments)  # valid JSON text


def _stream(parser, chunks):
    """(content, {index: name}, {index: arguments}, order of (index, kind)) streamed over ``chunks``."""
    content, names, args, order, text = "", {}, {}, [], ""
    for i, chunk in enumerate(chunks):
        c, deltas = parser.delta(text, text + chunk, chunk, final=i == len(chunks) - 1)
        text += chunk
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.index not in names, "a call's name is sent once"
                assert d.index == len(names), "calls are streamed in order"
                names[d.index] = d.name
                order.append((d.index, "name"))
            if d.arguments:
                assert d.index in names, "arguments only after the name"
                args[d.index] = args.get(d.index, "") + d.arguments
                order.append((d.index, "args"))
    return content, names, args, order


@st.composite
def chunking(draw, text):
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    bounds = [0, *[c for c in cuts if 0 < c < len(text)], len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]


HERMES_OUTPUTS = [
    f"Let me check.<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>",
    f"<tool_call>{TIME}",
    "just text with a <tool_ca",
    'a<tool_call>{"name": "f", "arguments": {"s": "</tool_call> inside"}}</tool_call>',
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(HERMES_OUTPUTS).flatmap(lambda t: st.tuples(st.just(t), chunking(t))))
def test_hermes_stream_adds_up_to_extract(case):
    text, chunks = case
    content, names, args, _ = _stream(HERMES(), chunks)
    want_content, calls = HERMES().extract(text)
    assert content == (want_content or "")
    assert names == {i: c.name for i, c in enumerate(calls)}
    assert args == {i: c.arguments for i, c in enumerate(calls) if c.arguments}


REQUIRED_OUTPUTS = [
    ' [{"name": "a", "parameters": {"x": [1, {"y": "]"}]}}, {"parameters": {}, "name": "b"}]',
    '[{"name": "a"}]',
    '[{"name": "a", "parameters": {"s": "x\\"]}"}} ,  {"name":"c","parameters":{}}]',
    '[{"name": "a", "parameters": {"x": 1}}, {"nam',  # cut off
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(REQUIRED_OUTPUTS).flatmap(lambda t: st.tuples(st.just(t), chunking(t))))
def test_required_stream_adds_up_to_extract(case):
    text, chunks = case
    content, names, args, _ = _stream(RequiredToolParser(), chunks)
    _, calls = RequiredToolParser().extract(text)
    if calls:  # a cut-off output streams what it had, and is no call at the end
        assert names == {i: c.name for i, c in enumerate(calls)}
        assert args == {i: c.arguments for i, c in enumerate(calls) if c.arguments}
    assert content == ""


MALFORMED = ['<tool_call>{"name": "f", "arguments": {</tool_call><tool_call>{"name": "g"}</tool_call>',
             '<tool_call>not json</tool_call>x<tool_call>{"name": "g", "arguments": {}}</tool_call>',
             '<tool_call>{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', '[{"name": 3}, {"name": "x"}]']


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(HERMES_OUTPUTS + REQUIRED_OUTPUTS + MALFORMED).flatmap(
    lambda t: st.tuples(st.just(t), chunking(t))), st.booleans())
def test_resumed_reading_equals_reading_from_scratch(case, required):
    """A stream's reading resumes where the previous step stopped; at every step it says what reading the whole
    text from scratch says."""
    text, chunks = case
    parser = RequiredToolParser() if required else HERMES()
    state, so_far = parser.new_state(), ""
    for i, chunk in enumerate(chunks):
        so_far += chunk
        final = i == len(chunks) - 1
        assert parser.scan(so_far, final, state) == parser.scan(so_far, final)


def test_hermes_stream_holds_partial_markers_and_streams_arguments():
    parser = HERMES()
    content, names, args, order = _stream(parser, ["Hi <tool", "_call>\n{\"na", "me\": \"f\", \"arguments\": {\"a",
                                                   "\": 1}}\n</tool", "_call>"])
    assert content == "Hi " and names == {0: "f"} and args == {0: '{"a": 1}'}
    assert order == [(0, "name"), (0, "args"), (0, "args")]  # arguments as they grow, not all at the end
    # the content before a call never shows a partial marker
    assert parser.delta("", "Hi <too", "Hi <too") == ("Hi ", [])
    assert parser.delta("Hi <too", "Hi <tooth", "th") == ("<tooth", [])


def test_forced_parsers():
    named = NamedToolParser("get_weather")
    assert named.extract(' {"city": "Paris"}') == (None, [ParsedToolCall("get_weather", '{"city": "Paris"}')])
    content, names, args, _ = _stream(NamedToolParser("f"), [" ", '{"x"', ": [1, 2]}"])
    assert (content, names, args) == ("", {0: "f"}, {0: '{"x": [1, 2]}'})
    required = RequiredToolParser()
    out = ' [{"name": "a", "parameters": {"x": [1, {"y": "]"}]}}, {"parameters": {}, "name": "b"}]'
    assert required.extract(out) == (None, [ParsedToolCall("a", '{"x": [1, {"y": "]"}]}'), ParsedToolCall("b", "{}")])
    for bad in ("[]", '{"name": "a"}', '[{"parameters": {}}]', "[{"):
        assert required.extract(bad) == (bad, [])
    for chunks in ([out], [out[:9], out[9:30], out[30:]], list(out)):
        content, names, args, _ = _stream(RequiredToolParser(), chunks)
        assert (content, names, args) == ("", {0: "a", 1: "b"}, {0: '{"x": [1, {"y": "]"}]}', 1: "{}"})


def test_json_scanning():
    s = '{"a": "x\\"}", "b": [1, {"c": 2}], "d": 12'
    members = object_members(s)
    assert [(m.key, s[m.start:m.end] if m.end else None) for m in members] == \
        [("a", '"x\\"}"'), ("b", '[1, {"c": 2}]'), ("d", None)]  # a number at the end may still grow
    assert value_end('{"a": [1, "]"]} tail', 0) == 15
    assert value_end('"abc', 0) is None and value_end("tru", 0) is None and value_end("true,", 0) == 4


# --------------------------------------------------------------------------------------------------- schemas
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
        "required": ["city"], "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "ping"}},
]


def test_schema_named():
    schema = tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert schema == TOOLS[0]["function"]["parameters"]
    jsonschema.validate({"city": "Paris", "unit": "celsius"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "celsius"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "unit": "kelvin"}, schema)
    assert tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "ping"}}) == \
        {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="Tool 'nope' has not been passed"):
        tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "nope"}})
    for choice in ("none", "auto", None):
        assert tool_choice_schema(TOOLS, choice) is None


def test_schema_required():
    expected = {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": {"type": "object",
                                           "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                                           "required": ["city"]}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["ping"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]},
        "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    }
    schema = tool_choice_schema(TOOLS, "required")
    assert schema == expected
    assert "$defs" in TOOLS[0]["function"]["parameters"]  # the tools themselves are not changed
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"unit": "celsius"}}],
                [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
                [{"name": "nope", "parameters": {}}], [{"name": "ping"}], {"name": "ping", "parameters": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # what the required parser reads back from a valid output
    assert RequiredToolParser().extract(json.dumps(ok))[1] == [
        ParsedToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), ParsedToolCall("ping", "{}")]
    one = tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)
    assert one["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)
    clash = [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "$defs": {"unit": {"type": "integer"}}}}}]
    with pytest.raises(ValueError, match="'unit' has multiple schemas"):
        tool_choice_schema(clash, "required")


# ----------------------------------------------------------------------------------------------- tool_choice
def _tools(*names):
    return [ChatCompletionTool.model_validate({"type": "function", "function": {"name": n}}) for n in names]


def test_resolve_tool_choice_defaults_and_errors():
    assert resolve_tool_choice(None, None, given=False) == "none"
    assert resolve_tool_choice(_tools("f"), None, given=False) == "auto"  # tools without tool_choice: auto
    assert resolve_tool_choice(_tools("f"), "none", given=True) == "none"
    assert resolve_tool_choice(None, "none", given=True) == "none"
    assert resolve_tool_choice(_tools("f"), "required", given=True) == "required"
    named = resolve_tool_choice(_tools("f", "g"), {"type": "function", "function": {"name": "g"}}, given=True)
    assert named == NamedToolChoice.model_validate({"function": {"name": "g"}})
    cases = [
        ([], "auto", "`tools` must not be an empty array", "tools"),
        (None, "auto", "When using `tool_choice`, `tools` must be set.", "tool_choice"),
        (_tools("f"), "sometimes", "Invalid value for `tool_choice`: sometimes!", "tool_choice"),
        (_tools("f"), {"type": "function"}, "Invalid value for `function`", "tool_choice.function"),
        (_tools("f"), {"type": "function", "function": {"name": ""}}, "Invalid `name`", "tool_choice.function.name"),
        (_tools("f"), {"type": "function", "function": {"name": "g"}}, "does not match any of the specified",
         "tool_choice"),
    ]
    for tools_, choice, message, param in cases:
        with pytest.raises(ToolError, match=message.replace("`", ".").replace("(", ".").replace(")", ".")) as e:
            resolve_tool_choice(tools_, choice, given=True)
        assert e.value.param == param


def test_request_models():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}},
                         {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert req.effective_tool_choice() == "auto" and req.parallel_tool_calls is True and req.include_reasoning
    history = [m.to_template_dict() for m in req.messages]
    assert history[1]["content"] == ""
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {"a": [1]}  # an object for the template
    assert history[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert history[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    to_sampling_params(req)  # tools no longer rejected
    bad = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"})
    with pytest.raises(RequestError) as e:
        to_sampling_params(bad)
    assert e.value.param == "tool_choice" and e.value.status_code == 400
