"""Lossless mode: drafts from the compressed cache, verification against the full tier, acceptance, rollback."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import SamplingParams
from engine.lossless import accept

KARA = {"method": "kara", "window": 16, "buffer": 4, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 2,
        "compression_period": 12, "lossless": True}
PROMPTS = [list(range(10, 30)), [5, 17, 33, 9, 41, 12, 7], list(range(60, 73)), [100, 4, 8, 15, 16, 23, 42]]


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("comp", [KARA, {**KARA, "ratio": 0.1, "horizon_max": 4},
                                  {"method": "streaming", "window": 16, "buffer": 4, "ratio": 0.25,
                                   "chunk_budget": 0, "compression_period": 12, "lossless": True}],
                         ids=["kara", "kara-aggressive", "streaming"])
def test_greedy_lossless_output_equals_uncompressed_output(make_engine, comp):
    ref = make_engine().generate(PROMPTS, greedy(90), use_tqdm=False)
    lossy = make_engine().generate(PROMPTS, greedy(90, kv_compression={**comp, "lossless": False}), use_tqdm=False)
    eng = make_engine()
    outs = eng.generate(PROMPTS, greedy(90, kv_compression=comp), use_tqdm=False)
    st = eng.stats()
    assert tokens(outs) == tokens(ref)
    assert tokens(lossy) != tokens(ref)  # the compression really changes the output when it is lossy
    assert st.compression.rounds > 0 and st.lossless_verifications > 0 and st.lossless_drafted > 0
    assert 0 < st.lossless_accepted < st.lossless_drafted  # some drafts were rejected and rolled back


def test_lossless_with_a_forced_preemption_and_logprobs(make_engine):
    ref = make_engine().generate(PROMPTS[:2], greedy(80, logprobs=1), use_tqdm=False)
    eng = make_engine()
    reqs = [eng.new_request(p, greedy(80, logprobs=1, kv_compression=KARA), f"r{i}") for i, p in enumerate(PROMPTS[:2])]
    for r in reqs:
        eng.add_request(r)
    seq = reqs[0].seqs[0]
    while not seq.lookahead_token_ids:  # mid-draft
        eng.step()
    eng.core.scheduler.preempt(seq, swap=False)
    assert eng.core.kv.full_tier(seq).block_table == [] and seq.lookahead_token_ids == []
    while eng.has_unfinished_requests():
        eng.step()
    assert [r.final.outputs[0].token_ids for r in reqs] == tokens(ref)
    for r, o in zip(reqs, ref):  # committed tokens carry the full cache's log-probs
        got = [lp[t] for lp, t in zip(r.final.outputs[0].logprobs, r.final.outputs[0].token_ids)]
        want = [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert got == pytest.approx(want, abs=1e-4)


def test_lossless_admits_more_sequences_than_the_pool_holds_uncompressed(make_engine):
    # 4 sequences of 20 + 100 tokens need 4 x 30 = 120 blocks uncompressed; the pool has 64: lossless Kara keeps
    # the device cache compressed while the host tier holds every full cache
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    ref = make_engine().generate(prompts, greedy(100), use_tqdm=False)
    eng = make_engine(num_kv_blocks=64, watermark=0, max_model_len=128)
    peak_running, peak_host = 0, 0
    reqs = [eng.new_request(p, greedy(100, kv_compression=KARA), f"r{i}") for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished_requests():
        eng.step()
        st = eng.stats()
        peak_running = max(peak_running, st.num_running)
        peak_host = max(peak_host, sum(eng.core.kv.full_tier(s).length for r in reqs for s in r.seqs))
    assert [r.final.outputs[0].token_ids for r in reqs] == tokens(ref)
    assert peak_running == 4 and peak_host > 64 * 4  # more full KV than the device pool could hold


def test_acceptance_rule_hand_worked():
    one_hot = torch.eye(5)
    # greedy: the longest agreeing prefix, then the full cache's token
    assert accept([1, 2, 3], one_hot[[1, 2, 4, 0]], None, None) == [1, 2, 4]
    assert accept([1, 2], one_hot[[1, 2, 3]], None, None) == [1, 2, 3]  # all agree: bonus token
    assert accept([], one_hot[[3]], None, None) == [3]
    # sampling: p(d) >= q(d) always accepts; p(d) = 0 always rejects and resamples where p > q
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    q = [torch.tensor([0.25, 0.25, 0.5])]
    g = torch.Generator().manual_seed(0)
    assert accept([0], p, q, g) == [0, 2]
    assert all(accept([2], p, q, g)[0] in (0, 1) for _ in range(20))


def _chi_square_p(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom (rare tokens pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest_a = na - sum(a[k] for k in keys)
    rest_b = nb - sum(b[k] for k in keys)
    cells = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = 0.0
    for x, y in cells:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(cells) - 1


def _p_value(stat: float, df: int) -> float:
    """Upper tail of chi-square(df) by the Wilson-Hilferty normal approximation."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _positions(outs, first, last):
    counts = [Counter() for _ in range(last - first)]
    for o in outs:
        for c in o.outputs:
            for j in range(first, last):
                counts[j - first][c.token_ids[j]] += 1
    return counts


def _divergence(make_engine, comp, monkeypatch=None):
    params = dict(n=300, temperature=0.7, top_k=6, max_tokens=24, ignore_eos=True)
    full = make_engine().generate([PROMPTS[1]], SamplingParams(seed=1, **params), use_tqdm=False)
    eng = make_engine(num_kv_blocks=8192)
    lossless = eng.generate([PROMPTS[1]], SamplingParams(seed=100_000, kv_compression=comp, **params),
                            use_tqdm=False)
    assert eng.stats().lossless_verifications > 0
    stat, df = 0.0, 0
    for a, b in zip(_positions(full, 10, 24), _positions(lossless, 10, 24)):
        s, d = _chi_square_p(a, b)
        stat, df = stat + s, df + d
    return _p_value(stat, df)


AGGRESSIVE = {"method": "kara", "window": 8, "buffer": 2, "ratio": 0.1, "chunk_max": 2, "chunk_budget": 0,
              "compression_period": 6, "lossless": True}


@pytest.mark.slow
def test_lossless_sampling_has_the_full_cache_distribution(make_engine, monkeypatch):
    assert _divergence(make_engine, AGGRESSIVE) > 1e-3
    # a wrong rule, accepting every draft, samples the compressed cache's distribution: the same test rejects it
    import engine.lossless as lossless

    monkeypatch.setattr(lossless, "accept", lambda drafts, target, q, g: list(drafts) + [int(target[-1].argmax())])
    assert _divergence(make_engine, AGGRESSIVE) < 1e-6
