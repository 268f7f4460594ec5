"""R-KV (compression/rkv.py) against a dense float64 reference written plainly from the formulas (arXiv 2505.24133 and
the reference code's conventions): importance with the GQA max before the softmax, redundancy with the newest
near-duplicate exempt, window and threshold forms, GQA, ties, exactly k kept, bad inputs and mutations."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import compression.rkv as rkv
from methods_ref import assert_selects, check_kept, dot, max_pool, norm, softmax


def ref_importance(q, k, kernel=7):
    """q [L, Hq, w, D] observation queries, k [L, Hkv, T, D]; float64 [L, Hkv, T - w]."""
    L, hq, w, d = q.shape
    hkv, T = k.shape[1], k.shape[2]
    g = hq // hkv
    n = T - w
    out = torch.zeros(L, hkv, n, dtype=torch.float64)
    for l in range(L):
        for kv in range(hkv):
            acc = [0.0] * n
            for i in range(w):
                logits = [max(dot(q[l, kv * g + j, i], k[l, kv, t]) / math.sqrt(d) for j in range(g)) for t in range(n)]
                p = softmax(logits)
                for t in range(n):
                    acc[t] += p[t] / w
            out[l, kv] = torch.tensor(max_pool(acc, kernel), dtype=torch.float64)
    return out


def ref_cosine_matrix(k, l, kv):
    T = k.shape[2]
    units = [[float(x) / (norm(k[l, kv, j]) + 1e-8) for x in k[l, kv, j]] for j in range(T)]
    return [[0.0 if i == j else dot(units[i], units[j]) for j in range(T)] for i in range(T)]


def ref_redundancy(k, thr=0.5):
    L, hkv, T, _ = k.shape
    out = torch.zeros(L, hkv, T, dtype=torch.float64)
    for l in range(L):
        for kv in range(hkv):
            c = ref_cosine_matrix(k, l, kv)
            for i in range(T):
                dups = [j for j in range(T) if c[i][j] > thr]
                c[i][max(dups) if dups else 0] = 0.0  # newest duplicate exempt (column 0 when none)
            colmean = [sum(c[i][j] for i in range(T)) / T for j in range(T)]
            out[l, kv] = torch.tensor(softmax(colmean), dtype=torch.float64)
    return out


def ref_rkv_scores(q_obs, k, lam=0.1, kernel=7, thr=0.5):
    n = k.shape[2] - q_obs.shape[2]
    return lam * ref_importance(q_obs, k, kernel) - (1 - lam) * ref_redundancy(k, thr)[..., :n]


def clustered_keys(L, hkv, T, d, gen, spread=0.35):
    """Keys around a few directions, so near-duplicates (cos > 0.5) are common and the exemption matters."""
    centres = torch.randn(L, hkv, 3, d, generator=gen)
    pick = torch.randint(0, 3, (L, hkv, T), generator=gen)
    base = centres.gather(2, pick[..., None].expand(L, hkv, T, d))
    return base + spread * torch.randn(L, hkv, T, d, generator=gen)


def cos_margin(k, thr=0.5):
    """Smallest |cos - thr| over all key pairs (float32 vs float64 may disagree on a pair right at the threshold)."""
    kh = k.double() / (k.double().norm(dim=-1, keepdim=True) + 1e-8)
    c = kh @ kh.transpose(-1, -2)
    return float((c - thr).abs().min())


# ----------------------------------------------------------------------------- hand-worked redundancy
def test_redundancy_hand_worked_newest_duplicate_exempt():
    # k0 = k1 = k2 = e0, k3 = e1. Row 0: duplicates 1, 2 -> C[0,2] = 0; row 1: 0, 2 -> C[1,2] = 0;
    # row 2: 0, 1 -> C[2,1] = 0; row 3: none -> C[3,0] (already 0). Column sums 2, 1, 0, 0; means / 4.
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])[None, None]
    got = rkv.rkv_redundancy(k)[0, 0].double()
    exp = torch.softmax(torch.tensor([0.5, 0.25, 0.0, 0.0], dtype=torch.float64), 0)
    torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-7)


def test_redundancy_row_without_duplicate_zeroes_column_0():
    # cos(k0, k1) = 0.4 <= 0.5: no duplicates. The reference zeroes C[1, 0] (its fallback index is 0) but keeps
    # C[0, 1]: column means (0, 0.4 / 2).
    k = torch.tensor([[1.0, 0.0], [0.4, math.sqrt(1 - 0.16)]])[None, None]
    exp = torch.softmax(torch.tensor([0.0, 0.2], dtype=torch.float64), 0)
    torch.testing.assert_close(rkv.rkv_redundancy(k)[0, 0].double(), exp, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- dense references
@pytest.mark.parametrize("g", [1, 2, 3])
@pytest.mark.parametrize("lam,kernel", [(0.1, 7), (0.5, 3), (1.0, 1)])
def test_threshold_scores_match_dense(g, lam, kernel):
    gen = torch.Generator().manual_seed(100 * g + kernel)
    L, hkv, T, w, d = 2, 2, 16, 4, 8
    k = clustered_keys(L, hkv, T, d, gen)
    q = torch.randn(L, hkv * g, w, d, generator=gen) * 1.5
    assert cos_margin(k) > 1e-5
    ref_imp = ref_importance(q.double(), k.double(), kernel)
    torch.testing.assert_close(rkv.rkv_importance(q, k, kernel=kernel).double(), ref_imp, rtol=1e-5, atol=1e-7)
    ref_red = ref_redundancy(k.double())
    torch.testing.assert_close(rkv.rkv_redundancy(k).double(), ref_red, rtol=1e-5, atol=1e-7)
    ref = ref_rkv_scores(q.double(), k.double(), lam, kernel)
    got = rkv.rkv_scores(q, k, lam=lam, kernel=kernel)
    assert got.dtype == torch.float32 and got.shape == (L, hkv, T - w)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
    for b in (0, 1, 5, 12, 50):
        kept = rkv.rkv_threshold_select(q, k, b, lam=lam, kernel=kernel)
        check_kept(kept, L, hkv, min(b, T - w), T - w)
        assert_selects(kept, ref, min(b, T - w), tol=1e-7)


@pytest.mark.parametrize("g", [2, 3])
@pytest.mark.parametrize("obs", [None, 2])
def test_window_select_matches_dense(g, obs):
    gen = torch.Generator().manual_seed(7 + g)
    L, hkv, w, d, n = 2, 2, 14, 8, 9
    k = clustered_keys(L, hkv, w, d, gen)
    q = torch.randn(L, hkv * g, w, d, generator=gen)
    o = w - n if obs is None else obs
    ref = ref_rkv_scores(q[:, :, w - o:].double(), k.double())[..., :n]
    got = rkv.rkv_window_scores(q, k, n, obs_window=obs)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
    for kk in (0, 1, 4, n):
        kept = rkv.rkv_select(q, k, n, kk, obs_window=obs)
        check_kept(kept, L, hkv, kk, n)
        assert_selects(kept, ref, kk, tol=1e-7)


def test_bf16_inputs_scored_in_float32():
    gen = torch.Generator().manual_seed(3)
    k = clustered_keys(1, 2, 12, 8, gen).bfloat16()
    q = torch.randn(1, 4, 4, 8, generator=gen).bfloat16()
    got = rkv.rkv_scores(q, k)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref_rkv_scores(q.double(), k.double()), rtol=1e-5, atol=1e-7)


def test_ties_go_to_lower_index():
    # Identical keys: equal importance and equal redundancy everywhere -> the lowest region slots win.
    k = torch.ones(1, 2, 10, 4)
    q = torch.randn(1, 4, 10, 4)
    assert rkv.rkv_select(q, k, 6, 3).tolist() == [[[0, 1, 2], [0, 1, 2]]]


def test_layer_groups_give_same_result(monkeypatch):
    import compression.primitives as prim

    gen = torch.Generator().manual_seed(11)
    k = clustered_keys(3, 2, 12, 8, gen)
    q = torch.randn(3, 4, 4, 8, generator=gen)
    full = rkv.rkv_scores(q, k)
    monkeypatch.setattr(prim, "MAX_ELEMS", 2 * 12 * 12 * 3)  # one layer per group
    torch.testing.assert_close(rkv.rkv_scores(q, k), full)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 2), hkv=st.integers(1, 2), g=st.sampled_from([1, 2, 3]), w=st.integers(3, 12),
       data=st.data())
def test_window_exactly_k_and_reference(L, hkv, g, w, data):
    n = data.draw(st.integers(1, w - 1))
    k = data.draw(st.integers(0, n))
    obs = data.draw(st.one_of(st.none(), st.integers(1, w - n)))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    keys = clustered_keys(L, hkv, w, 4, gen)
    q = torch.randn(L, hkv * g, w, 4, generator=gen)
    assume(cos_margin(keys) > 1e-5)
    kept = rkv.rkv_select(q, keys, n, k, obs_window=obs)
    check_kept(kept, L, hkv, k, n)
    o = w - n if obs is None else obs
    assert_selects(kept, ref_rkv_scores(q[:, :, w - o:].double(), keys.double())[..., :n], k, tol=1e-7)


def test_bad_inputs_name_the_parameter():
    q, k = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match=r"rkv\.lambda must be in \[0, 1\], got 2"):
        rkv.rkv_select(q, k, 6, 3, lam=2)
    with pytest.raises(ValueError, match=r"rkv\.kernel"):
        rkv.rkv_select(q, k, 6, 3, kernel=6)
    with pytest.raises(ValueError, match=r"rkv\.obs_window"):
        rkv.rkv_select(q, k, 6, 3, obs_window=5)
    with pytest.raises(ValueError, match=r"rkv needs a non-empty buffer"):
        rkv.rkv_select(q, k, 10, 3)
    with pytest.raises(ValueError, match=r"rkv\.k"):
        rkv.rkv_select(q, k, 6, 7)
    with pytest.raises(ValueError, match=r"rkv\.budget"):
        rkv.rkv_threshold_select(q[:, :, -2:], k, -3)
    with pytest.raises(ValueError, match=r"rkv\.sim_threshold"):
        rkv.rkv_redundancy(k, sim_threshold=float("nan"))


# ----------------------------------------------------------------------------- mutations the reference catches
def _fixture(g=3):
    gen = torch.Generator().manual_seed(42)
    k = clustered_keys(2, 2, 16, 8, gen)
    q = torch.randn(2, 2 * g, 4, 8, generator=gen) * 2
    return q, k, ref_rkv_scores(q.double(), k.double(), lam=0.5)


def test_mutation_gqa_mean_instead_of_max_fails_reference(monkeypatch):
    q, k, ref = _fixture()
    assert_selects(rkv.rkv_threshold_select(q, k, 6, lam=0.5), ref, 6, tol=1e-7)  # the real one passes
    monkeypatch.setattr(rkv, "_group_reduce", lambda logits: logits.mean(dim=-3))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(rkv.rkv_scores(q, k, lam=0.5).double(), ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(AssertionError):
        assert_selects(rkv.rkv_threshold_select(q, k, 6, lam=0.5), ref, 6, tol=1e-7)


def test_mutation_no_duplicate_exemption_fails_reference(monkeypatch):
    q, k, _ = _fixture()
    ref = ref_rkv_scores(q.double(), k.double())  # lambda 0.1: redundancy dominates
    assert_selects(rkv.rkv_threshold_select(q, k, 6), ref, 6, tol=1e-7)
    monkeypatch.setattr(rkv, "_exempt_newest_duplicate", lambda c, thr: None)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(rkv.rkv_scores(q, k).double(), ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(AssertionError):
        assert_selects(rkv.rkv_threshold_select(q, k, 6), ref, 6, tol=1e-7)
