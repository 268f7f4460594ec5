"""SnapKV-window, TOVA, H2O, KeyDiff and K-norm (compression/baselines.py) against dense float64 references written
plainly with loops: random inputs, GQA (g = 1, 2, 3), hand-made ties, exactly k kept (hypothesis), bad inputs, and
mutations that the references must catch."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compression.baselines as bl
from methods_ref import (
    assert_selects,
    check_kept,
    dot,
    norm,
    ref_causal_sums,
    ref_snapkv_window,
    ref_topk,
    softmax,
)


def rand_qk(L, hkv, g, w, d, seed, T=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(L, hkv * g, w, d, generator=gen) * 1.5
    k = torch.randn(L, hkv, w if T is None else T, d, generator=gen) * 1.5
    return q, k


# ----------------------------------------------------------------------------- references
def ref_tova(q_last, k, n):
    """q_last [L, Hq, D]: softmax over all keys, mean over ALL query heads, same row for every KV head."""
    L, hq, d = q_last.shape
    hkv, T = k.shape[1], k.shape[2]
    g = hq // hkv
    out = torch.zeros(L, hkv, n, dtype=torch.float64)
    for l in range(L):
        acc = [0.0] * n
        for h in range(hq):
            p = softmax([dot(q_last[l, h], k[l, h // g, j]) / math.sqrt(d) for j in range(T)])
            for j in range(n):
                acc[j] += p[j] / hq
        for kv in range(hkv):
            out[l, kv] = torch.tensor(acc, dtype=torch.float64)
    return out


def ref_keydiff(k, anchor_len, n):
    L, hkv = k.shape[:2]
    out = torch.zeros(L, hkv, n, dtype=torch.float64)
    for l in range(L):
        for h in range(hkv):
            units = [[float(x) / norm(k[l, h, j]) for x in k[l, h, j]] for j in range(anchor_len)]
            anchor = [sum(u[t] for u in units) / anchor_len for t in range(k.shape[3])]
            for j in range(n):
                out[l, h, j] = -dot(k[l, h, j], anchor) / (norm(k[l, h, j]) * norm(anchor))
    return out


def ref_knorm(k, n):
    L, hkv = k.shape[:2]
    return torch.tensor([[[-norm(k[l, h, j]) for j in range(n)] for h in range(hkv)] for l in range(L)],
                        dtype=torch.float64)


def ref_recent_plus_heavy(scores, k, recent):
    L, H, n = scores.shape
    out = []
    for l in range(L):
        out.append([sorted(ref_topk(scores[l, h, : n - recent].tolist(), k - recent)
                           + list(range(n - recent, n))) for h in range(H)])
    return torch.tensor(out, dtype=torch.long).reshape(L, H, k)


# ----------------------------------------------------------------------------- SnapKV window
@pytest.mark.parametrize("g", [1, 2, 3])
@pytest.mark.parametrize("pooling,kernel,obs", [("avg", 5, None), ("max", 3, 4), ("avg", 1, 2)])
def test_snapkv_window_matches_dense(g, pooling, kernel, obs):
    L, hkv, w, d, n = 2, 2, 14, 8, 9
    q, k = rand_qk(L, hkv, g, w, d, seed=g * 10 + kernel)
    got = bl.snapkv_window_scores(q, k, n, obs_window=obs, kernel=kernel, pooling=pooling)
    ref = ref_snapkv_window(q.double(), k.double(), n, obs if obs else w - n, kernel, pooling)
    assert got.dtype == torch.float32 and got.shape == (L, hkv, n)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    for kk in (0, 1, 4, n):
        kept = bl.snapkv_window_select(q, k, n, kk, obs_window=obs, kernel=kernel, pooling=pooling)
        check_kept(kept, L, hkv, kk, n)
        assert_selects(kept, ref, kk)


def test_snapkv_window_ties_and_bf16():
    # All keys equal, kernel 1: every prefix key gets the same mass from every observation query -> exact ties.
    L, hkv, g, w, d, n = 1, 2, 2, 10, 4, 7
    q = torch.randn(L, hkv * g, w, d)
    k = torch.ones(L, hkv, w, d)
    s = bl.snapkv_window_scores(q, k, n, kernel=1)
    assert bool((s == s[..., :1]).all())
    assert bl.snapkv_window_select(q, k, n, 3, kernel=1).tolist() == [[[0, 1, 2]] * hkv]
    qb, kb = rand_qk(2, 2, 2, 12, 8, seed=5)
    qb, kb = qb.bfloat16(), kb.bfloat16()
    got = bl.snapkv_window_scores(qb, kb, 8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref_snapkv_window(qb.double(), kb.double(), 8, 4, 5, "avg"),
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- TOVA
@pytest.mark.parametrize("g", [1, 2, 3])
def test_tova_matches_dense(g):
    L, hkv, w, d, n = 2, 2, 13, 8, 10
    q, k = rand_qk(L, hkv, g, w, d, seed=20 + g)
    ref = ref_tova(q[:, :, -1].double(), k.double(), n)
    got = bl.tova_scores(q, k, n)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(got[:, 0], got[:, 1])  # one set per layer, shared by its KV heads
    for kk in (0, 3, n):
        kept = bl.tova_select(q, k, n, kk)
        check_kept(kept, L, hkv, kk, n)
        assert_selects(kept, ref, kk)
    # Threshold form: the newest observation query over all T keys, prefix [0, T - w).
    qo, kt = rand_qk(L, hkv, g, 4, d, seed=30 + g, T=17)
    ref_t = ref_tova(qo[:, :, -1].double(), kt.double(), 13)
    torch.testing.assert_close(bl.tova_threshold_scores(qo, kt).double(), ref_t, rtol=1e-5, atol=1e-7)
    for b in (0, 5, 13, 40):
        kept = bl.tova_threshold_select(qo, kt, b)
        check_kept(kept, L, hkv, min(b, 13), 13)
        assert_selects(kept, ref_t, min(b, 13))


def test_tova_ties_go_to_lower_index():
    q = torch.randn(1, 4, 6, 8)
    k = torch.ones(1, 2, 6, 8) * 0.5  # equal keys -> equal attention everywhere
    assert bl.tova_select(q, k, 5, 2).tolist() == [[[0, 1], [0, 1]]]


# ----------------------------------------------------------------------------- H2O
@pytest.mark.parametrize("g", [1, 2, 3])
def test_h2o_matches_dense(g):
    L, hkv, w, d, n = 2, 2, 12, 8, 9
    q, k = rand_qk(L, hkv, g, w, d, seed=40 + g)
    ref = ref_causal_sums(q.double(), k.double(), 0, n)
    got = bl.h2o_scores(q, k, n)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    for kk, rec in ((6, None), (6, 0), (6, 6), (1, None), (0, None), (n, 2)):
        kept = bl.h2o_select(q, k, n, kk, num_recent=rec)
        check_kept(kept, L, hkv, kk, n)
        r = kk // 2 if rec is None else rec
        exp = ref_recent_plus_heavy(ref, kk, r)
        assert torch.equal(kept, exp), (kk, rec, kept, exp)
    # Threshold form: the w observation queries (slots T - w + i) over the prefix.
    qo, kt = rand_qk(L, hkv, g, 3, d, seed=50 + g, T=15)
    ref_t = ref_causal_sums(qo.double(), kt.double(), 12, 12)
    torch.testing.assert_close(bl.h2o_threshold_scores(qo, kt).double(), ref_t, rtol=1e-5, atol=1e-6)
    kept = bl.h2o_threshold_select(qo, kt, 7)
    assert torch.equal(kept, ref_recent_plus_heavy(ref_t, 7, 3))
    check_kept(bl.h2o_threshold_select(qo, kt, 99), L, hkv, 12, 12)


def test_h2o_hand_worked():
    # One head, D = 1, zero queries: query i spreads 1/(i+1) over keys [0, i]. Window W = 4, region n = 3:
    # A_0 = 1 + 1/2 + 1/3 + 1/4, A_1 = 1/2 + 1/3 + 1/4, A_2 = 1/3 + 1/4.
    q = torch.zeros(1, 1, 4, 1)
    k = torch.randn(1, 1, 4, 1)
    torch.testing.assert_close(bl.h2o_scores(q, k, 3)[0, 0].double(),
                               torch.tensor([25 / 12, 13 / 12, 7 / 12], dtype=torch.float64))
    assert bl.h2o_select(q, k, 3, 2).tolist() == [[[0, 2]]]  # 1 heavy (slot 0) + 1 recent (slot 2)


# ----------------------------------------------------------------------------- KeyDiff, K-norm
def test_keydiff_and_knorm_match_dense():
    gen = torch.Generator().manual_seed(60)
    k = torch.randn(2, 3, 11, 8, generator=gen)
    n = 8
    ref = ref_keydiff(k.double(), n, n)
    torch.testing.assert_close(bl.keydiff_scores(k, n).double(), ref, rtol=1e-5, atol=1e-6)
    for kk in (0, 3, n):
        kept = bl.keydiff_select(None, k, n, kk)
        check_kept(kept, 2, 3, kk, n)
        assert_selects(kept, ref, kk)
    ref_t = ref_keydiff(k.double(), 11, 7)  # threshold: anchor over all T, prefix T - w = 7
    torch.testing.assert_close(bl.keydiff_threshold_scores(None, k, obs_window=4).double(), ref_t,
                               rtol=1e-5, atol=1e-6)
    assert_selects(bl.keydiff_threshold_select(torch.randn(2, 6, 4, 8), k, 5), ref_t, 5)
    refn = ref_knorm(k.double(), n)
    torch.testing.assert_close(bl.knorm_scores(k, n).double(), refn, rtol=1e-6, atol=1e-6)
    assert_selects(bl.knorm_select(None, k, n, 4), refn, 4)
    assert_selects(bl.knorm_threshold_select(None, k, 3, obs_window=4), ref_knorm(k.double(), 7), 3)


def test_keydiff_knorm_ties_and_nan():
    e = torch.zeros(8)
    e[0] = 1.0
    norms = [1.0, 2.0, 3.0, 2.0, 5.0]
    k = torch.stack([e * v for v in norms])[None, None]  # [1, 1, 5, 8]
    # K-norm: scores -1, -2, -3, -2, -5: slots 1 and 3 tie for 2nd place -> slot 1.
    assert bl.knorm_select(None, k, 5, 2).tolist() == [[[0, 1]]]
    # KeyDiff: all keys parallel -> cos = 1 everywhere -> all tie -> the lowest indices.
    assert bl.keydiff_select(None, k, 5, 3).tolist() == [[[0, 1, 2]]]
    # A NaN key ranks last.
    kn = k.clone()
    kn[0, 0, 0, 1] = float("nan")
    assert bl.knorm_select(None, kn, 5, 4).tolist() == [[[1, 2, 3, 4]]]


# ----------------------------------------------------------------------------- exactly k, any shape
@settings(max_examples=30, deadline=None)
@given(L=st.integers(1, 2), hkv=st.integers(1, 3), g=st.sampled_from([1, 2, 3]), w=st.integers(3, 14),
       data=st.data())
def test_window_baselines_keep_exactly_k(L, hkv, g, w, data):
    n = data.draw(st.integers(1, w - 1))
    k = data.draw(st.integers(0, n))
    seed = data.draw(st.integers(0, 10_000))
    q, kk = rand_qk(L, hkv, g, w, 4, seed)
    for kept in (bl.snapkv_window_select(q, kk, n, k, kernel=3), bl.snapkv_window_select(q, kk, n, k, pooling="max"),
                 bl.tova_select(q, kk, n, k), bl.h2o_select(q, kk, n, k), bl.keydiff_select(None, kk, n, k),
                 bl.knorm_select(None, kk, n, k)):
        check_kept(kept, L, hkv, k, n)


def test_bad_inputs_name_the_parameter():
    q, k = rand_qk(1, 2, 2, 10, 4, seed=0)
    with pytest.raises(ValueError, match=r"snapkv\.kernel"):
        bl.snapkv_window_scores(q, k, 6, kernel=4)
    with pytest.raises(ValueError, match=r"snapkv\.obs_window"):
        bl.snapkv_window_scores(q, k, 6, obs_window=5)  # the buffer has only 4 queries
    with pytest.raises(ValueError, match=r"snapkv\.pooling"):
        bl.snapkv_window_scores(q, k, 6, pooling="sum")
    with pytest.raises(ValueError, match=r"tova\.k"):
        bl.tova_select(q, k, 6, 7)
    with pytest.raises(ValueError, match=r"h2o\.num_recent"):
        bl.h2o_select(q, k, 6, 3, num_recent=4)
    with pytest.raises(ValueError, match=r"tova\.budget"):
        bl.tova_threshold_select(q[:, :, -2:], k, -1)
    with pytest.raises(ValueError, match=r"keydiff: queries_obs is None"):
        bl.keydiff_threshold_select(None, k, 3)
    with pytest.raises(ValueError, match=r"h2o\.queries"):
        bl.h2o_scores(None, k, 6)


# ----------------------------------------------------------------------------- mutations the references catch
def test_mutation_h2o_without_causal_mask_fails_reference(monkeypatch):
    q, k = rand_qk(2, 2, 2, 12, 8, seed=70)
    ref = ref_causal_sums(q.double(), k.double(), 0, 9)
    real = bl.causal_probs
    monkeypatch.setattr(bl, "causal_probs", lambda qq, kk, first: real(qq, kk, kk.shape[-2]))  # bidirectional
    with pytest.raises(AssertionError):
        assert_selects(bl._recent_plus_heavy(bl.h2o_scores(q, k, 9), 4, 0), ref, 4)


def test_mutation_tova_per_group_mean_fails_reference():
    # TOVA averages over ALL query heads; a per-KV-group average (SnapKV's convention) is a different method.
    q, k = rand_qk(2, 2, 3, 13, 8, seed=71)
    ref = ref_tova(q[:, :, -1].double(), k.double(), 10)
    per_group = torch.softmax(torch.einsum("lhd,lhtd->lht", q[:, :, -1], k.repeat_interleave(3, 1)) / math.sqrt(8),
                              -1)[..., :10].reshape(2, 2, 3, 10).mean(2)
    with pytest.raises(AssertionError):
        assert_selects(bl.select_topk(per_group, 4), ref, 4)


def test_mutation_ties_to_higher_index_fails(monkeypatch):
    def higher_first(scores, k):
        flipped = scores.flip(-1)
        idx = torch.sort(flipped, dim=-1, descending=True, stable=True).indices[..., :k]
        return (scores.shape[-1] - 1 - idx).sort(-1).values

    monkeypatch.setattr(bl, "select_topk", higher_first)
    q = torch.randn(1, 4, 6, 8)
    k = torch.ones(1, 2, 6, 8)
    assert bl.tova_select(q, k, 5, 2).tolist() != [[[0, 1], [0, 1]]]
