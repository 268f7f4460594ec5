"""Compression settings at the edges of their ranges: what the validator accepts is what the engine runs.

A setting the validator accepts must never be rejected first by a round (a request accepted, then failed with a
500): the issue's reproduction (a ratio in (0, 1] whose ⌈r·n⌉ rounded to 0, every method's round failing) per
method at engine level, a hypothesis property per method over valid settings drawn at the edges of every range
(bench/compression_edges.py: every request finishes normally, the KV manager's invariants hold after every step and no
block is left once idle), and the other side: a setting just past a bound is a ValueError naming its field."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from compression import ConfigError, KVCompressionConfig, coerce, registry
from bench.compression_edges import PARAM_RANGES, just_outside, valid_edge_requests, valid_edge_settings
from engine import SamplingParams
from engine.errors import InvalidRequestError

MAX_LEN = 48  # the shared engine's max_model_len: bounds every token count a request may carry
METHODS = [m for m in registry.names() if m != "none"]
PERIODIC = [m for m in METHODS if "periodic" in registry.get(m).policies]
THRESHOLD = [m for m in METHODS if "threshold" in registry.get(m).policies]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from conftest import check_every_step
    from engine.engine import Engine

    eng = check_every_step(Engine(model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4,
                                  num_kv_blocks=256, max_model_len=MAX_LEN))
    yield eng
    eng.shutdown()
    eng.check_invariants()


def run(eng, kv: dict, prompt_len: int, max_tokens: int, rid: str = "edge"):
    """One greedy request through the engine to its end; returns it (its `error` set if the engine failed it)."""
    req = eng.new_request([4 + (7 * i) % 120 for i in range(prompt_len)],
                          SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_compression=kv),
                          rid)
    eng.add_request(req)
    while not req.done.is_set():
        eng.step()
    return req


def assert_served(eng, req, max_tokens: int) -> None:
    assert req.error is None, repr(req.error)
    out = req.final.outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
    assert not eng.has_unfinished_requests()
    eng.check_invariants()
    s = eng.stats()
    assert s.num_free_blocks == s.num_blocks, "KV blocks left once idle"


# ----------------------------------------------------------------------------- the reproductions
@pytest.mark.parametrize("method", PERIODIC)
def test_ratio_keeping_zero_slots_by_rounding_is_served(engine, method):
    # ⌈1e-11 · 12⌉ rounded to 0 before: every method's round failed on a 0-slot selection (a reshape of 0
    # elements; centroid.k = 0), after the request had been accepted
    kv = {"method": method, "window": 16, "buffer": 4, "compression_period": 12, "ratio": 1e-11}
    if "chunk_budget" in registry.get(method).param_names():
        kv["chunk_budget"] = 0
    rounds = engine.stats().compression.rounds
    req = run(engine, kv, 16, 28, f"repro-{method}")
    assert_served(engine, req, 28)
    assert engine.stats().compression.rounds > rounds
    assert req.kv_compression.kept_per_window == 1


@pytest.mark.parametrize("method", PERIODIC)
def test_one_slot_region_every_step(engine, method):
    # window = buffer + 1 and period 1: a one-slot region compressed after every step, kept whole
    kv = {"method": method, "window": 5, "buffer": 4, "compression_period": 1, "ratio": 1e-11}
    req = run(engine, kv, 3, 20, f"one-{method}")
    assert_served(engine, req, 20)


@pytest.mark.parametrize("method", THRESHOLD)
def test_threshold_budget_of_one_slot(engine, method):
    # threshold_target = observation_window + 1 keeps one prefix slot; threshold_max = threshold_target + 1 fires
    # an event every other step
    kv = {"method": method, "policy": "threshold", "observation_window": 1, "threshold_target": 2,
          "threshold_max": 3}
    req = run(engine, kv, 2, 20, f"thr-{method}")
    assert_served(engine, req, 20)


def test_ams_segment_mass_near_zero_segments_every_slot():
    # 1 / segment_mass targets were enumerated per row (5e-324: an OverflowError; 1e-9: ~8 GB per row); counted per
    # slot now, every slot starts a segment once the targets are finer than any slot's mass
    import torch

    from compression.ams import ams_segments

    mass = torch.rand(3, 2, 10, generator=torch.Generator().manual_seed(0))
    for sm in (5e-324, 1e-300, 1e-11):
        seg = ams_segments(mass, segment_mass=sm, min_seg_len=1, max_seg_len=100)
        assert seg.tolist() == [[list(range(10))] * 2] * 3


# ----------------------------------------------------------------------------- the property, per method
@pytest.mark.parametrize("method", METHODS)
def test_valid_edge_settings_are_served(engine, method):
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(valid_edge_requests(method, max_len=MAX_LEN))
    def check(case):
        kv, prompt_len, max_tokens = case
        req = run(engine, kv, prompt_len, max_tokens, f"fuzz-{method}")
        assert_served(engine, req, max_tokens)

    check()
    assert engine.stats().compression.by_method[method].rounds > 0  # the edges reached rounds, not just requests


@pytest.fixture(scope="module")
def small_pool(tiny_llama_dir):
    from conftest import check_every_step
    from engine.engine import Engine

    # room for one full-length sequence and a third of another: every batch of the examples below preempts
    eng = check_every_step(Engine(model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4,
                                  num_kv_blocks=16, max_model_len=MAX_LEN, watermark=0, max_num_seqs=8))
    yield eng
    eng.shutdown()
    eng.check_invariants()


def test_valid_edge_settings_batched_with_preemptions(small_pool):
    # several methods' edges in one batch: rounds mixing configs, on-demand rounds and preemptions of a small pool
    from hypothesis import strategies as st

    cases = st.lists(st.sampled_from(METHODS).flatmap(lambda m: valid_edge_requests(m, max_len=MAX_LEN)),
                     min_size=2, max_size=5)

    @settings(max_examples=20, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(cases)
    def check(batch):
        eng = small_pool
        reqs = []
        for i, (kv, prompt_len, max_tokens) in enumerate(batch):
            req = eng.new_request([4 + (7 * j) % 120 for j in range(prompt_len)],
                                  SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                 kv_compression=kv), f"batch{i}")
            eng.add_request(req)
            reqs.append(req)
        while eng.has_unfinished_requests():
            eng.step()
        for req, (_, _, max_tokens) in zip(reqs, batch):
            assert req.error is None, repr(req.error)
            assert req.final.outputs[0].finish_reason == "length"
            assert len(req.final.outputs[0].token_ids) == max_tokens
        s = eng.stats()
        assert s.num_free_blocks == s.num_blocks, "KV blocks left once idle"

    check()
    assert small_pool.stats().num_preemptions > 0 and small_pool.stats().compression.rounds > 0


# ----------------------------------------------------------------------------- the validator's side
def test_every_method_parameter_has_a_range():
    for m in METHODS:
        for name in registry.get(m).param_names():
            assert name in PARAM_RANGES, (m, name)


@pytest.mark.parametrize("method", METHODS)
def test_valid_edges_pass_and_just_outside_is_rejected_naming_the_field(method):
    @settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @given(valid_edge_settings(method, max_len=MAX_LEN))
    def check(kv):
        cfg = coerce(kv)
        assert {k: cfg.to_dict()[k] for k in kv} == {k: float(v) if k == "ratio" else v for k, v in kv.items()}
        assert cfg.make_compressor().num_kept(cfg.region_len) >= 1
        for name, bad in just_outside(method, kv):
            with pytest.raises(ConfigError) as err:
                KVCompressionConfig(**bad)
            assert err.value.param == f"kv_compression.{name}", (name, bad[name], str(err.value))

    check()


def test_just_outside_at_engine_level(engine):
    # a request past a bound is rejected before it runs, naming the field; the engine's own bounds (max_model_len,
    # the vocabulary) count too
    base = {"method": "kara", "window": 5, "buffer": 4, "compression_period": 1, "ratio": 1e-11, "chunk_budget": 0}
    for kv, field in ((dict(base, ratio=0.0), "ratio"), (dict(base, buffer=5), "buffer"),
                      (dict(base, compression_period=0), "compression_period"), (dict(base, chunk_max=0), "chunk_max"),
                      # above max_model_len and the engine's own default for the method (512: always allowed)
                      (dict(base, window=513, compression_period=513), "window"),
                      ({"method": "centroid", "chunk_size": 1}, "chunk_size"),
                      ({"method": "infokv", "entropy_top_k": 129}, "entropy_top_k"),
                      ({"method": "snapkv", "buffer": 4, "obs_window": 5}, "obs_window"),
                      ({"method": "h2o", "window": 16, "buffer": 4, "compression_period": 12, "ratio": 0.25,
                        "num_recent": 4}, "num_recent")):
        with pytest.raises(InvalidRequestError) as err:
            engine.new_request([5, 6, 7], SamplingParams(max_tokens=4, kv_compression=kv), "bad")
        assert err.value.param == f"kv_compression.{field}", (kv, err.value.param, str(err.value))
    assert not engine.has_unfinished_requests()
