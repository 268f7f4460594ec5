"""Grammars off the serving path: a constraint is bounded before it compiles, compiles on the engine's worker pool
(never on the event loop or the step loop), and one that no output satisfies is a 400 naming its field. Each hostile
request below froze the whole server (/health included) for 8-129 s, or was accepted and then failed with a 500,
before the compile pool and the limits; here each is a quick 400 while /health keeps answering within 2 s."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.structured_params import GrammarLimits, StructuredOutputsParams
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import running_engine, serve, wait_drained

pytest.importorskip("xgrammar", reason="xgrammar is installed by make install")

HEALTH_BOUND_S = 2.0


def _nested_items(levels: int) -> dict:
    schema: dict = {"type": "array"}
    cur = schema
    for _ in range(levels):
        cur["items"] = {"type": "array"}
        cur = cur["items"]
    return schema


def _nested_objects(levels: int) -> dict:
    schema: dict = {"type": "object"}
    cur = schema
    for _ in range(levels):
        nxt: dict = {"type": "object"}
        cur["properties"], cur["required"] = {"a": nxt}, ["a"]
        cur = nxt
    return schema


def _properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


class HealthWatch:
    """Polls /health on its own connection while a test runs; the slowest answer is what a health checker saw."""

    def __init__(self, base_url: str):
        self.base_url, self.worst, self.count = base_url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while True:  # at least once, however quick the request under watch
                t0 = time.monotonic()
                assert client.get(self.base_url + "/health").status_code == 200
                self.worst = max(self.worst, time.monotonic() - t0)
                self.count += 1
                if self._stop.wait(0.05):
                    return

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def _post(srv, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=120)


def _assert_400(resp: httpx.Response, param: str, words: str) -> None:
    """A 400 in the OpenAI shape naming the field (or a path inside it, for a body nested past the server's bound)."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert err["param"] == param or err["param"].startswith(param + "."), err
    assert words in err["message"], err


# (body fields, the field the 400 names, words of its message): the issue's reproductions
OVERSIZED = [
    ({"guided_json": _nested_items(900)}, "guided_json", "deeper"),
    ({"guided_json": json.dumps(_nested_items(200))}, "guided_json", "max-depth"),  # a string: the body is shallow
    ({"guided_json": {"enum": [f"value-{i}" for i in range(100_000)]}}, "guided_json", "max-enum"),
    ({"guided_regex": "q" * 2**19}, "guided_regex", "max-length"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_objects(450)}}},
     "response_format.json_schema", "deeper"),
    ({"guided_json": _properties(10_000)}, "guided_json", "max-properties"),
    ({"guided_regex": "|".join(f"w{i}" for i in range(50_000))}, "guided_regex", "max-length"),
    ({"guided_choice": ["a" * 100_000, "b" * 100_000]}, "guided_choice", "max-length"),
    ({"guided_grammar": "\n".join(["root ::= r0"] + [f"r{i} ::= \"x\" r{i + 1} | \"y\"" for i in range(2000)]
                                  + ['r2000 ::= "z"'])}, "guided_grammar", "max-rules"),
]

UNSATISFIABLE = [
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ({"guided_grammar": "root ::= [^\\x00-\\U0010FFFF]"}, "guided_grammar"),
    ({"guided_json": {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}}, "guided_json"),
]

DEEP_TEXT = [
    ({"guided_json": "[" * 2000 + "]" * 2000}, "guided_json"),
    ({"structured_outputs": {"json": '{"a":' * 3000}}, "structured_outputs.json"),
]


@pytest.mark.parametrize("fields,param,words", OVERSIZED, ids=[f"{p}-{w}" for _, p, w in OVERSIZED])
def test_an_oversized_constraint_is_a_quick_400_and_health_keeps_answering(tiny_server, fields, param, words):
    with HealthWatch(tiny_server.base_url) as watch:
        t0 = time.monotonic()
        resp = _post(tiny_server, {"prompt": "hello", "max_tokens": 4, **fields})
        took = time.monotonic() - t0
    _assert_400(resp, param, words)
    assert took < HEALTH_BOUND_S, f"the limit check took {took:.1f} s"
    assert watch.worst < HEALTH_BOUND_S and watch.count >= 1, watch.worst


def test_a_named_tool_with_too_many_parameters_is_a_400_naming_the_tool(tiny_server):
    tool = {"type": "function", "function": {"name": "f", "parameters": _properties(10_000)}}
    with HealthWatch(tiny_server.base_url) as watch:
        resp = _post(tiny_server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                   "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
                     "/v1/chat/completions")
    assert resp.status_code == 400, resp.text
    assert "max-properties" in resp.json()["error"]["message"]
    assert watch.worst < HEALTH_BOUND_S


@pytest.mark.parametrize("fields,param", UNSATISFIABLE, ids=[p + str(i) for i, (_, p) in enumerate(UNSATISFIABLE)])
def test_a_constraint_no_output_satisfies_is_a_400(tiny_server, fields, param):
    resp = _post(tiny_server, {"prompt": "hello", "max_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    stream = _post(tiny_server, {"prompt": "hello", "max_tokens": 4, "stream": True, **fields})
    assert stream.status_code == 400, stream.text


@pytest.mark.parametrize("fields,param", DEEP_TEXT, ids=[p for _, p in DEEP_TEXT])
def test_a_deeply_nested_schema_text_is_a_400(tiny_server, fields, param):
    resp = _post(tiny_server, {"prompt": "hello", "max_tokens": 4, **fields})
    _assert_400(resp, param, "deeper")


def test_a_constraint_that_dead_ends_later_ends_its_request_with_a_400(tiny_engine):
    """'a' then nothing: the first mask allows 'a' (so it compiles), the second allows no token at all."""
    so = StructuredOutputsParams(grammar='root ::= "a" [^\\x00-\\U0010FFFF]')
    with pytest.raises(InvalidRequestError, match="allows no next token") as err:
        tiny_engine.generate(["hello"], SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False)
    assert err.value.param == "structured_outputs.grammar"
    out = tiny_engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    wait_drained(tiny_engine)


@pytest.fixture(scope="module")
def slow_engine(tiny_server_model_dir):
    """Limits raised so that a constraint within them compiles for seconds, and a 1 s budget."""
    with running_engine(tiny_server_model_dir, structured_outputs_max_properties=4096,
                        structured_outputs_compile_timeout=1.0, structured_outputs_compile_threads=1) as eng:
        yield eng


def test_a_slow_compile_times_out_alone_while_everything_else_is_served(slow_engine):
    """A constraint within the (raised) limits that compiles for several seconds: its request is a 400 at the
    budget; meanwhile /health, plain requests and a constraint already compiled are served without waiting."""
    cached = {"prompt": "hello", "max_tokens": 4, "guided_choice": ["yes", "no"]}
    with serve(slow_engine) as srv:
        assert _post(srv, cached).status_code == 200  # compiled once, now in the cache
        slow: dict = {}
        thread = threading.Thread(target=lambda: slow.update(
            resp=_post(srv, {"prompt": "hello", "max_tokens": 4, "guided_json": _properties(1400)})))
        with HealthWatch(srv.base_url) as watch:
            thread.start()
            time.sleep(0.2)
            for body in ({"prompt": "hello", "max_tokens": 4}, cached):
                t0 = time.monotonic()
                assert _post(srv, body).status_code == 200
                assert time.monotonic() - t0 < HEALTH_BOUND_S
            thread.join(timeout=60)
        _assert_400(slow["resp"], "guided_json", "did not compile within 1 s")
        assert watch.worst < HEALTH_BOUND_S, watch.worst


def test_limits_are_checked_without_recursion_and_name_the_flag():
    limits = GrammarLimits(max_depth=8, max_properties=3, max_enum=2, max_length=100, max_rules=2)
    cases = [
        (StructuredOutputsParams(json=_nested_items(8), param="guided_json"), "max-depth"),
        (StructuredOutputsParams(json=_properties(4)), "max-properties"),
        (StructuredOutputsParams(json={"anyOf": [{"const": 1}, {"enum": [2, 3]}]}), "max-enum"),
        (StructuredOutputsParams(regex="a" * 101), "max-length"),
        (StructuredOutputsParams(choice=["a", "b", "c"]), "max-enum"),
        (StructuredOutputsParams(choice=["a" * 60, "b" * 41]), "max-length"),
        (StructuredOutputsParams(grammar='root ::= a\na ::= b\nb ::= "x"'), "max-rules"),
    ]
    for so, flag in cases:
        with pytest.raises(InvalidRequestError, match=f"--structured-outputs-{flag}") as err:
            limits.check(so)
        assert err.value.param == so.field
    # at each limit: accepted
    for so in (StructuredOutputsParams(json=_nested_items(3)), StructuredOutputsParams(json=_properties(3)),
               StructuredOutputsParams(regex="a" * 100), StructuredOutputsParams(choice=["a", "b"]),
               StructuredOutputsParams(grammar='root ::= a\na ::= "x"')):
        limits.check(so)
    with pytest.raises(ValueError, match="structured_outputs_max_depth"):
        GrammarLimits(max_depth=10_000)


def test_one_compile_serves_every_request_with_that_constraint(tiny_engine):
    structured = tiny_engine.core.structured
    spec = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    a = structured.compile(StructuredOutputsParams(json=spec))
    b = structured.compile(StructuredOutputsParams(json=dict(reversed(list(spec.items()))), param="guided_json"))
    assert a is b
