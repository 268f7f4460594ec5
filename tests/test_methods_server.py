"""Per-request selection of every registered compression method over HTTP (a real uvicorn server, the tiny Llama with
the SmolLM2 tokenizer): one completion per method and policy compresses with it, a bad value of each method's
parameters is a 400 naming ``kv_compression.<param>``, and /metrics reports the per-method counters."""
from __future__ import annotations

import httpx
import pytest

from compression import registry
from server_fixtures import *  # noqa: F401,F403

PROMPT = "The quick brown fox jumps over the lazy dog because"
PERIODIC = {"window": 16, "buffer": 4, "ratio": 0.3, "compression_period": 12}
THRESHOLD = {"policy": "threshold", "threshold_max": 40, "threshold_target": 24, "observation_window": 4}
EXTRA = {"chunk_max": 4, "chunk_budget": 2, "segment_mass": 0.2, "min_seg_len": 2, "max_seg_len": 6,
         "min_keep_per_segment": 1, "n_sink": 1, "keep_last": 2, "chunk_size": 4}
RUNS = [(m, p) for m in registry.names() if m != "none" for p in registry.get(m).policies]


def body(model: str, kv_compression, max_tokens: int = 48) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "kv_compression": kv_compression}


def setting(method: str, policy: str) -> dict:
    names = registry.get(method).param_names()
    return {"method": method, **(PERIODIC if policy == "periodic" else THRESHOLD),
            **{k: v for k, v in EXTRA.items() if k in names}}


def scrape(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, val = line.rsplit(" ", 1)
            values[key] = float(val)
    return values


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("method,policy", RUNS)
def test_every_method_is_selectable_per_request(tiny_engine, http, drained, method, policy):
    before = getattr(tiny_engine.stats().compression.by_method.get(method), "rounds", 0)
    r = http.post("/v1/completions", json=body(tiny_engine.model_name, setting(method, policy)))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 48 and out["choices"][0]["finish_reason"] == "length"
    assert tiny_engine.stats().compression.by_method[method].rounds > before  # it ran with this method


@pytest.mark.parametrize("method", [m for m in registry.names() if m != "none"])
def test_a_bad_parameter_of_every_method_is_a_400_naming_it(tiny_engine, http, drained, method):
    names = registry.get(method).param_names()
    cases = [(n, "x") for n in names] or [("no_such_param", 1)]  # parameterless methods: an unknown key
    for name, value in cases:
        r = http.post("/v1/completions", json=body(tiny_engine.model_name, {"method": method, name: value}, 4))
        assert r.status_code == 400, (method, name, r.text)
        err = r.json()["error"]
        assert err["param"] == f"kv_compression.{name}" and name in err["message"], err


def test_a_rule_between_fields_is_a_400_naming_the_parameter(tiny_engine, http, drained):
    # the engine default is off, so the request's own setting is complete: 4 recent slots of 3 kept
    r = http.post("/v1/completions", json=body(tiny_engine.model_name, {"method": "h2o", "num_recent": 4,
                                                                          **PERIODIC, "ratio": 0.25}, 4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_compression.num_recent", r.text


def test_metrics_report_each_method(tiny_server, tiny_engine, http, drained):
    for m in ("rkv", "centroid"):
        assert http.post("/v1/completions", json=body(tiny_engine.model_name, setting(m, "periodic"))).status_code == 200
    values = scrape(tiny_server.base_url)
    model = tiny_engine.model_name
    st = tiny_engine.stats()
    for key in ("rounds", "tokens_seen", "tokens_evicted", "tokens_merged", "blocks_freed", "seconds"):
        series = {k: v for k, v in values.items() if k.startswith(f"kvllm:compression_method_{key}_total{{")}
        for m in ("rkv", "centroid"):
            label = f'kvllm:compression_method_{key}_total{{method="{m}",model_name="{model}"}}'
            assert label in series, (label, sorted(series)[:3])
        if key != "rounds":  # tokens, blocks and seconds add up to the totals
            total = values[f'kvllm:compression_{key}_total{{model_name="{model}"}}']
            assert sum(series.values()) == pytest.approx(total, rel=1e-6), key
    assert values[f'kvllm:compression_method_tokens_merged_total{{method="centroid",model_name="{model}"}}'] > 0
    assert values[f'kvllm:compression_method_tokens_merged_total{{method="rkv",model_name="{model}"}}'] == 0
    assert st.compression.by_method["centroid"].tokens_merged > 0
