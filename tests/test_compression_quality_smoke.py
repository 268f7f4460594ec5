"""bench/compression_quality.py's core on the tiny random Llama (fast), and the partial-tail query recomputation
the periodic policy relies on."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from bench.compression_quality import (LABELS, METHODS, passage_stats, diagnose, evaluate,  # noqa: E402
                                       passage_kept_fraction, synthetic_trials, tables)
from engine import SamplingParams  # noqa: E402

WINDOW = dict(window=16, buffer=4, chunk_max=4, chunk_budget=2, compression_period=12)


@pytest.fixture
def one_thread():
    """Tiny matmuls: OpenMP with 2 threads on a busy 2-core machine is many times slower than 1 thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_core_returns_finite_nlls_and_none_matches_engine_score(make_engine, one_thread):
    eng = make_engine(num_kv_blocks=256)
    vocab = eng.model_config.vocab_size
    trials = synthetic_trials(2, vocab=vocab, filler_len=40, lead_len=4, passage_len=6, context_len=5)
    results = evaluate(eng, trials, METHODS, ratios=(0.3,), window=WINDOW, chunk_size=4)
    assert [r.method for r in results] == list(METHODS)
    n = WINDOW["window"] - WINDOW["buffer"]
    for res in results:
        for value in (res.text_nll, res.late_nll, res.recall_nll, res.first_copy_nll):
            assert math.isfinite(value) and value > 0, (res.method, value)
        assert all(len(lp) == len(t.continuation) for lp, t in zip(res.logprobs, trials))
        if res.method == "none":
            assert res.kv_len == res.logical_len and res.tokens_seen == 0
        else:  # every window method ends at the same KV length: ceil(0.3 * 12) + 2 = 6 of every 12 kept
            assert res.tokens_seen > 0 and res.tokens_seen % n == 0
            assert res.tokens_evicted == res.tokens_seen // n * (n - 6)
            assert res.kv_len == res.logical_len - res.tokens_evicted
            assert res.late_from < len(trials[0].continuation)

    none = results[0]
    ref_text = []
    for t, lps in zip(trials, none.logprobs):
        ref = eng.score(t.context, t.continuation, chunk_size=4).prompt_logprobs
        assert len(ref) == len(lps)
        assert max(abs(a - b) for a, b in zip(ref, lps)) < 1e-4
        ref_text += [-x for i, x in enumerate(ref) if not t.recall[0] <= i < t.recall[1]]
    assert abs(sum(ref_text) / len(ref_text) - none.text_nll) < 1e-4
    # compression changed something after the first round (the tiny model's NLLs are not all identical)
    assert any(r.logprobs != none.logprobs for r in results[1:])

    kept = passage_kept_fraction(eng, trials, METHODS, (0.3,), WINDOW)
    assert set(kept) == {(m, 0.3) for m in METHODS if m != "none"}
    assert all(0.0 <= v <= 1.0 for v in kept.values())
    assert kept[("streaming", 0.3)] == 4 / 6  # passage = region slots 4..9 of 12; streaming keeps the newest 6
    assert "passage slots kept" in tables(results, trials, kept)
    assert "Keep rate by region position" in diagnose(eng, trials, ("kara", "random"), (0.3,), WINDOW)


def test_passage_stats():
    sel = torch.tensor([[[0, 2, 3, 7], [1, 2, 5, 6]]])  # L=1, 2 KV heads, passage = slots 2..5
    share, union = passage_stats(sel, (2, 6))
    assert share == 4 / 8  # head 0 keeps 2, 3; head 1 keeps 2, 5
    assert union == 3 / 4  # 2, 3, 5 kept by some head, 4 by none


def test_recompute_queries_of_a_tail_prefix_equal_the_full_tail(make_engine, one_thread):
    """The policy recomputes only the windows' part of the uncompressed tail; the queries of that prefix must be
    the same as when the whole tail is recomputed (also after earlier rounds shrank kv_len)."""
    small = dict(method="kara", ratio=0.25, **WINDOW)
    eng = make_engine(num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_compression=small)
    req = eng.core.make_request(list(range(10, 80)), params, "a", score=(6, 4))
    eng.add_request(req)
    checked = 0
    while not req.done.is_set():
        eng.step()
        seq = req.seqs[0]
        st = seq.compression
        if seq.is_finished or st.tail(seq.num_computed_tokens) < 12:
            continue
        tail = st.tail(seq.num_computed_tokens)
        full = eng.core.runner.recompute_queries([(seq, st.compressed_tokens, tail)])
        part = eng.core.runner.recompute_queries([(seq, st.compressed_tokens, tail - 5)])
        torch.testing.assert_close(part, full[:, :tail - 5], rtol=1e-5, atol=1e-5)
        checked += seq.kv_len < seq.num_computed_tokens
    assert checked > 0  # some checks ran on an already-compressed sequence


def test_every_method_keeps_the_same_slots_at_each_budget():
    from bench.compression_quality import DEFAULT_WINDOW, method_config

    n = DEFAULT_WINDOW["window"] - DEFAULT_WINDOW["buffer"]
    for r in (0.2, 0.3, 0.5):
        kept = {m: method_config(m, r, DEFAULT_WINDOW).kept_per_window for m in METHODS if m != "none"}
        assert set(kept.values()) == {math.ceil(r * n) + DEFAULT_WINDOW["chunk_budget"]}, kept


def test_token_entropies_equal_what_the_engine_records_when_sampling(make_engine, one_thread):
    from bench.compression_quality import token_entropies

    eng = make_engine()
    prompt = list(range(5, 25))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            kv_compression={"method": "infokv", "window": 64, "buffer": 8, "compression_period": 64})
    req = eng.new_request(prompt, params, "e")
    eng.add_request(req)
    while not req.done.is_set():
        eng.step()
    seq = req.seqs[0]
    recorded = seq.compression.entropy.get(0, seq.num_tokens)
    ours = token_entropies(eng, seq.all_token_ids(), 10, chunk=7)  # chunks of 7: the paged forward across chunks
    assert torch.isnan(ours[0]) and torch.isnan(recorded[:len(prompt)]).all()
    torch.testing.assert_close(ours[len(prompt):], recorded[len(prompt):], rtol=1e-4, atol=1e-5)


def test_reading_and_plot(make_engine, one_thread, tmp_path):
    from bench.compression_quality import plot, reading

    eng = make_engine(num_kv_blocks=256)
    trials = synthetic_trials(2, vocab=eng.model_config.vocab_size, filler_len=40, lead_len=4, passage_len=6,
                              context_len=5)
    methods = ("none", "kara", "streaming", "infokv", "centroid")
    results = evaluate(eng, trials, methods, ratios=(0.2, 0.5), window=WINDOW, chunk_size=4, batch_seqs=4)
    assert [(r.method, r.ratio) for r in results] == [("none", None)] + [(m, r) for r in (0.2, 0.5)
                                                                         for m in methods[1:]]
    for res in results[1:]:
        assert res.compressed_tokens > 0 and res.compression_seconds > 0 and math.isfinite(res.ms_per_token)
        assert res.kept_per_window == {0.2: 5, 0.5: 8}[res.ratio] and res.region_len == 12
    lines = reading(results)
    assert len(lines) == 4 and all("trials" in line for line in lines)
    # the named best has the lowest mean of its budget
    best = min((r for r in results if r.ratio == 0.2), key=lambda r: r.recall_nll)
    assert lines[0].startswith("r=0.2") and f"best recall NLL {LABELS[best.method]} " in lines[0]
    path = tmp_path / "q.png"
    plot(results, path)
    assert path.stat().st_size > 1000
