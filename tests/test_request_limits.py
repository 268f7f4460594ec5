"""Hostile per-request settings: every integer a request can carry is bounded by what the engine holds (its
max_model_len, KV pool and vocabulary) and checked when the request is made, with an `InvalidRequestError` naming
the field, never inside the step loop, where one request used to kill the engine for everyone."""
from __future__ import annotations

import dataclasses

import pytest

from compression import registry
from compression.config import COMMON_FIELDS, KVCompressionConfig, check_limits, Limits
from engine import SamplingParams
from engine.errors import InvalidRequestError

MAX_MODEL_LEN = 128
PROMPT = [5, 6, 7, 8] * 4
SMALL = {"window": 16, "buffer": 4, "compression_period": 12, "threshold_max": 40, "threshold_target": 24,
         "observation_window": 4}


def _greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _rejected(eng, max_tokens, **kw) -> InvalidRequestError:
    """The error of a request made with these settings (SamplingParams itself or the engine may refuse it)."""
    with pytest.raises(InvalidRequestError) as info:
        eng.new_request(PROMPT, _greedy(max_tokens, **kw))
    return info.value


def _run(eng, params, rid):
    req = eng.new_request(PROMPT, params, rid)
    eng.add_request(req)
    while eng.has_unfinished_requests():
        eng.step()
    assert req.error is None, req.error
    return req.final.outputs[0].token_ids


@pytest.fixture
def eng(make_engine):
    return make_engine(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)


def test_a_huge_compression_period_is_a_clear_error_not_a_dead_engine(eng):
    """The reproduction: period 2**62 once sized the query cache inside the step loop (storage overflow)."""
    err = _rejected(eng, 40, kv_compression={"method": "kara", "compression_period": 2**62})
    assert err.param == "kv_compression.compression_period" and str(MAX_MODEL_LEN) in str(err)
    # the largest allowed period is served, and its query cache is sized by the sequence, not the period
    out = _run(eng, _greedy(40, kv_compression=dict(SMALL, method="kara", compression_period=MAX_MODEL_LEN)), "ok")
    assert len(out) == 40 and eng.is_healthy()


def test_a_huge_compression_seed_is_rejected(eng):
    for seed in (2**63, 2**70):
        err = _rejected(eng, 8, kv_compression={"method": "random", "seed": seed})
        assert err.param == "kv_compression.seed"
    _run(eng, _greedy(30, kv_compression=dict(SMALL, method="random", seed=2**63 - 1)), "max-seed")


@pytest.mark.parametrize("field,value", [("seed", 2**64), ("n", 10**9), ("logprobs", 10**6), ("min_tokens", 10**6)])
def test_sampling_numbers_are_bounded(eng, field, value):
    if field == "seed":
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(seed=value)
    else:
        kw = {field: value}
        if field == "min_tokens":
            kw["max_tokens"] = None
        with pytest.raises(InvalidRequestError) as info:
            eng.new_request(PROMPT, SamplingParams(**kw))
    assert info.value.param == field


def _int_fields(method: str) -> list[str]:
    spec = registry.get(method)
    defaults = {**{f.name: f.default for f in dataclasses.fields(spec.params)}, **spec.defaults}
    own = [f.name for f in dataclasses.fields(spec.params)
           if isinstance(defaults.get(f.name), int) and not isinstance(defaults.get(f.name), bool)
           or defaults.get(f.name) is None]
    common = [f for f in COMMON_FIELDS if f not in ("ratio", "policy", "query_source", "compress_prompt", "lossless")]
    return common + own


def test_every_integer_setting_of_every_method_is_bounded_before_the_step_loop(eng):
    """Each registered method and policy, each integer setting at max_model_len + 1, 2**62 and 2**70: the request is
    refused when made, naming a kv_compression field (the same sweep crashed the step loop for the query cache,
    seeds, AMS segment lengths and CentroidKV's chunk size before)."""
    checked = 0
    for method in registry.names():
        if method == "none":
            continue
        spec = registry.get(method)
        for policy in spec.policies:
            reference = KVCompressionConfig(method, policy=policy).to_dict()
            for field in _int_fields(method):
                bound = (eng.model_config.vocab_size if getattr(spec.params, "LIMITS", {}).get(field) == "vocab_size"
                         else MAX_MODEL_LEN)
                just_over = max(bound, reference[field] or 0) + 1  # the engine's own default is always allowed
                for value in (just_over, 2**62, 2**70):
                    if field == "seed" and value < 2**63:
                        continue
                    setting = dict(SMALL, method=method, policy=policy, **{field: value})
                    if field.startswith("horizon"):
                        setting["lossless"] = True
                    err = _rejected(eng, 40, kv_compression=setting)
                    assert err.param.startswith("kv_compression."), (method, field, err)
                    checked += 1
    assert checked > 300
    assert eng.is_healthy()


def test_limits_allow_what_the_engine_itself_is_configured_with():
    """An operator's default above max_model_len (window 512 on a 128-token model) never fails a request that only
    names the method; a request may not go past it either."""
    ref = KVCompressionConfig("kara")
    limits = Limits(max_model_len=128, vocab_size=100)
    check_limits(ref, ref, limits)
    with pytest.raises(ValueError, match="window"):
        check_limits(KVCompressionConfig("kara", window=1024, compression_period=1024), ref, limits)
    infokv = KVCompressionConfig("infokv")
    check_limits(KVCompressionConfig("infokv", entropy_top_k=100), infokv, limits)  # the vocabulary bounds it
    with pytest.raises(ValueError, match="entropy_top_k"):
        check_limits(KVCompressionConfig("infokv", entropy_top_k=101), infokv, limits)


def test_method_none_rejects_other_keys_like_every_method(eng):
    for extra in ({"bogus": 1}, {"ratio": "anything"}, {"window": 2**70}):
        err = _rejected(eng, 4, kv_compression={"method": "none", **extra})
        assert err.param == f"kv_compression.{next(iter(extra))}"
    _run(eng, _greedy(4, kv_compression={"method": "none"}), "none-ok")


def test_ams_base_follows_its_documented_rule(eng):
    """compression/ams.py AMSParams: under the periodic policy any window scorer (Kara included); under the
    threshold policy only scorers with a threshold form (Kara has none)."""
    _run(eng, _greedy(30, kv_compression=dict(SMALL, method="ams", base="kara")), "ams-periodic-kara")
    err = _rejected(eng, 30, kv_compression=dict(SMALL, method="ams", policy="threshold", base="kara"))
    assert err.param == "kv_compression.base" and "threshold" in str(err)
    _run(eng, _greedy(30, kv_compression=dict(SMALL, method="ams", policy="threshold", base="snapkv")), "ams-thr")
