"""Schemathesis over the app's own OpenAPI schema against the live server: no request may produce a 5xx
(positive and negative examples, bounded per operation). Generation sizes are kept small by tightening the
schema's bounds for the fuzzer only (max_tokens, n, list lengths), and by a small max_model_len."""
from __future__ import annotations

import copy
from collections import Counter, defaultdict

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import build_engine, serve, wait_drained

FUZZ_MAX_MODEL_LEN = 64
MAX_EXAMPLES = 30
MESSAGES: Counter = Counter()
STATUSES: dict[tuple[str, str], Counter] = defaultdict(Counter)


def _tighten(schema: dict) -> dict:
    s = copy.deepcopy(schema)
    comps = s["components"]["schemas"]

    def bound(node, **limits):
        for option in node.get("anyOf", [node]):
            t = option.get("type")
            if t in ("integer", "number") and "maximum" in limits:
                option["maximum"] = limits["maximum"]
            if t == "string" and "maxLength" in limits:
                option["maxLength"] = limits["maxLength"]
            if t == "array":
                option["maxItems"] = limits.get("maxItems", 3)
                if "items" in option:
                    bound(option["items"], **limits)

    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps[name]["properties"]
        # structured outputs have their own tests (tests/test_structured_outputs_server.py); random grammars would
        # only measure the grammar compiler here
        for key in ("logit_bias", "suffix", "best_of", "tools", "response_format", "structured_outputs",
                    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern"):
            props.pop(key, None)
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if key in props:
                bound(props[key], maximum=8)
        bound(props["n"], maximum=3)
        for key in ("stop", "stop_token_ids", "prompt", "messages"):
            if key in props:
                bound(props[key], maxItems=3, maxLength=200)
    bound(comps["ChatMessage"]["properties"]["content"], maxItems=3, maxLength=200)
    return s


@pytest.fixture(scope="module")
def fuzz_server(tiny_server_model_dir):
    engine = build_engine(tiny_server_model_dir, max_model_len=FUZZ_MAX_MODEL_LEN, num_kv_blocks=256)
    engine.start()
    try:
        with serve(engine) as srv:
            srv.engine = engine
            yield srv
        wait_drained(engine, timeout=60)
    finally:
        engine.shutdown()


def _app_schema() -> dict:
    """The app's OpenAPI schema (it does not depend on the engine, so a stub stands in at collection time)."""
    import types

    from server.app import build_app

    stub = types.SimpleNamespace(model_name="stub", max_model_len=FUZZ_MAX_MODEL_LEN, tokenizer=None,
                                 model_config=types.SimpleNamespace(vocab_size=49152))
    return build_app(stub).openapi()


schema = schemathesis.openapi.from_dict(_tighten(_app_schema()))


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_server):
    response = case.call(base_url=fuzz_server.base_url, timeout=60)
    STATUSES[(case.method, case.path)][response.status_code] += 1
    if response.status_code == 400:
        MESSAGES[response.json()["error"]["message"][:60]] += 1
    assert response.status_code < 500, (f"{case.method} {case.path} -> {response.status_code}\n"
                                        f"body: {case.body!r}\nresponse: {response.text[:2000]}")
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == response.status_code
    ctype = response.headers.get("content-type") or [""]
    ctype = ctype[0] if isinstance(ctype, list) else ctype
    if ctype.startswith("text/event-stream"):
        text = response.text
        assert text.rstrip().endswith("data: [DONE]"), text[-500:]
        assert '"error"' not in text, text[-2000:]
    wait_drained(fuzz_server.engine, timeout=30)  # no request left behind, every block free, invariants hold


def test_fuzzing_left_the_engine_healthy(fuzz_server):
    """Runs after the fuzzing: it reached the engine (some generations succeeded, some requests were
    rejected) and left it healthy with every KV block free."""
    print(dict(STATUSES))
    print("most frequent 400s:", MESSAGES.most_common(10))
    for path in ("/v1/completions", "/v1/chat/completions"):
        seen = STATUSES[("POST", path)]
        if seen:  # absent when the fuzz test was deselected
            assert seen[200] > 0 and seen[400] > 0, seen
    engine = fuzz_server.engine
    assert engine.is_healthy()
    wait_drained(engine, timeout=60)
