"""/metrics as vLLM dashboards and routers read it: every vLLM V1 series name under ``vllm:`` and ``kvllm:``
(``--metrics-prefix``), histogram counts and sums moved by one request by the amounts vLLM's own metrics test
expects, and the per-request phase times computed from hand-worked engine timestamps."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import TINY_BLOCK_SIZE, TINY_NUM_KV_BLOCKS, serve

# vLLM's EXPECTED_METRICS_V1 (tests/entrypoints/instrumentator/test_metrics.py), without the prefix.
VLLM_V1_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "iteration_tokens_total", "cache_config_info", "request_success_total",
    *(f"{h}_{s}" for h in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                           "request_params_max_tokens", "time_to_first_token_seconds",
                           "inter_token_latency_seconds", "e2e_request_latency_seconds",
                           "request_queue_time_seconds", "request_inference_time_seconds",
                           "request_prefill_time_seconds", "request_decode_time_seconds",
                           "request_time_per_output_token_seconds")
      for s in ("sum", "bucket", "count")),
]
HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
              "request_params_n", "request_params_max_tokens")


def _samples(base_url: str) -> dict[tuple, float]:
    """(sample name, sorted labels) → value, parsed by prometheus_client's own text parser."""
    text = httpx.get(base_url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    hits = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab)]
    assert len(hits) == 1, (name, labels, len(hits))
    return hits[0]


def test_every_vllm_name_under_both_prefixes(tiny_engine, tiny_server, drained):
    httpx.post(tiny_server.base_url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 3},
               timeout=60)
    samples = _samples(tiny_server.base_url)
    names = {n for n, _ in samples}
    for prefix in ("vllm:", "kvllm:"):
        for name in VLLM_V1_NAMES:
            assert any(n == prefix + name or n.startswith(prefix + name) for n in names), prefix + name
    # the two prefixes carry the same series: same suffixes, labels and (the engine idle) values
    strip = {(n.split(":", 1)[1], lab): v for (n, lab), v in samples.items() if n.startswith("vllm:")}
    other = {(n.split(":", 1)[1], lab): v for (n, lab), v in samples.items() if n.startswith("kvllm:")}
    assert strip == other
    model = tiny_engine.model_name
    assert _value(samples, "vllm:num_requests_waiting", model_name=model) == 0
    assert _value(samples, "vllm:kv_cache_usage_perc", model_name=model) == 0
    info = [lab for (n, lab), v in samples.items() if n == "vllm:cache_config_info" and v == 1.0]
    assert len(info) == 1
    info = dict(info[0])
    assert info["block_size"] == str(TINY_BLOCK_SIZE) and info["num_gpu_blocks"] == str(TINY_NUM_KV_BLOCKS)
    assert info["enable_prefix_caching"] == "True" and info["model_name"] == model


@pytest.mark.parametrize("prefix", ["vllm", "kvllm"])
def test_one_prefix_only(tiny_engine, drained, prefix):
    with serve(tiny_engine, metrics_prefix=prefix) as srv:
        names = {n for n, _ in _samples(srv.base_url)}
    assert names and all(n.startswith(prefix + ":") for n in names)
    assert f"{prefix}:num_requests_waiting" in names and f"{prefix}:request_queue_time_seconds_count" in names


def test_one_request_moves_the_histograms(tiny_engine, tiny_server, drained):
    """The amounts vLLM's own metrics test expects for sequential requests (prompt P, max_tokens M, ignore_eos):
    one observation per request, generation and max_tokens sums M, iteration tokens sum P + M over M steps."""
    model, m_tokens = tiny_engine.model_name, 6
    prompt = "Seven violet herons"  # shorter than a KV block: no prefix-cache hit can shorten its prefill
    p_tokens = len(tiny_engine.encode_prompt(prompt))
    assert p_tokens < TINY_BLOCK_SIZE
    before = _samples(tiny_server.base_url)
    r = httpx.post(tiny_server.base_url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": m_tokens, "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == m_tokens
    after = _samples(tiny_server.base_url)

    def delta(name):
        return _value(after, "vllm:" + name, model_name=model) - _value(before, "vllm:" + name, model_name=model)

    for h in HISTOGRAMS:
        assert delta(h + "_count") == 1, h
    assert delta("request_prompt_tokens_sum") == p_tokens
    assert delta("request_generation_tokens_sum") == m_tokens
    assert delta("request_params_max_tokens_sum") == m_tokens
    assert delta("request_params_n_sum") == 1
    assert delta("iteration_tokens_total_count") == m_tokens
    assert delta("iteration_tokens_total_sum") == p_tokens + m_tokens
    assert delta("inter_token_latency_seconds_count") == m_tokens - 1
    # the phases fit together: inference = prefill + decode, TPOT = decode / (M - 1), all within e2e
    prefill, decode = delta("request_prefill_time_seconds_sum"), delta("request_decode_time_seconds_sum")
    assert delta("request_inference_time_seconds_sum") == pytest.approx(prefill + decode, abs=1e-6)
    assert delta("request_time_per_output_token_seconds_sum") == pytest.approx(decode / (m_tokens - 1), abs=1e-6)
    assert decode > 0 and prefill > 0
    assert delta("request_queue_time_seconds_sum") + prefill + decode <= delta("e2e_request_latency_seconds_sum")
    # n and the default max_tokens (chat: the context left)
    before = _samples(tiny_server.base_url)
    httpx.post(tiny_server.base_url + "/v1/completions", timeout=60,
               json={"prompt": prompt, "max_tokens": 2, "n": 3, "temperature": 0, "ignore_eos": True})
    chat = httpx.post(tiny_server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": None,
                            "stop": ["\n", "."]}).json()
    after = _samples(tiny_server.base_url)
    assert delta("request_params_n_count") == 2 and delta("request_params_n_sum") == 3 + 1
    assert delta("request_params_max_tokens_sum") == 2 + tiny_engine.max_model_len - chat["usage"]["prompt_tokens"]


class _FakeEngine:
    max_model_len = 1000

    def stats(self):
        return None

    def is_healthy(self):
        return True


def _timed(timing: RequestMetrics, tokens_by_choice: dict[int, int], reasons=("length",)):
    from server.metrics import RequestTimer, ServerMetrics

    m = ServerMetrics(_FakeEngine(), "m", ("vllm:",))
    timer = RequestTimer(m)
    for index, k in tokens_by_choice.items():
        timer.on_delta(k, {index: k})
    timer.on_finish(5, list(reasons), timing, SamplingParams(n=len(tokens_by_choice), max_tokens=50))

    def total(name):
        return m.inner.get_sample_value(name + "_sum", {"model_name": "m"}), \
            m.inner.get_sample_value(name + "_count", {"model_name": "m"})
    return total


def test_phase_times_from_hand_worked_timestamps():
    # arrival 10.0, first scheduled 11.5, first token 13.0, finished 20.0, 8 tokens
    total = _timed(RequestMetrics(10.0, 13.0, 20.0, 0, 11.5), {0: 8})
    assert total("request_queue_time_seconds") == (1.5, 1.0)
    assert total("request_prefill_time_seconds") == (1.5, 1.0)
    assert total("request_decode_time_seconds") == (7.0, 1.0)
    assert total("request_inference_time_seconds") == (8.5, 1.0)
    assert total("request_time_per_output_token_seconds") == (1.0, 1.0)  # 7 s over the 7 tokens after the first
    assert total("request_params_max_tokens") == (50.0, 1.0) and total("request_params_n") == (1.0, 1.0)
    # n = 2: choices decode side by side, so TPOT divides by the longer one's tokens after the first
    total = _timed(RequestMetrics(0.0, 1.0, 5.0, 0, 0.5), {0: 5, 1: 3})
    assert total("request_time_per_output_token_seconds") == (1.0, 1.0) and total("request_params_n") == (2.0, 1.0)
    # one token: TPOT 0 (vLLM's rule); an aborted request or one never scheduled has no phase times
    assert _timed(RequestMetrics(0.0, 1.0, 1.0, 0, 0.5), {0: 1})("request_time_per_output_token_seconds") == \
        (0.0, 1.0)
    assert _timed(RequestMetrics(0.0, 1.0, 2.0, 0, 0.5), {0: 2}, ("abort",))("request_queue_time_seconds") == \
        (0.0, 0.0)
    assert _timed(RequestMetrics(0.0, None, 2.0, 0, None), {0: 0})("request_decode_time_seconds") == (0.0, 0.0)


def test_engine_timestamps_are_ordered(tiny_engine, drained):
    outs = tiny_engine.generate(["a b c", "d e f g"], SamplingParams(max_tokens=4, ignore_eos=True, n=2),
                                use_tqdm=False)
    for out in outs:
        t = out.metrics
        assert t.arrival_time <= t.first_scheduled_time <= t.first_token_time <= t.finished_time
