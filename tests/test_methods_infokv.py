"""InfoKV-style scoring (compression/infokv.py): the top-k renormalised entropy helper, the representation change,
and the combined score / selection against float64 references written plainly (window and threshold policies,
GQA, per-slot signals, NaN entropy, ties, exactly k kept), bad inputs and a mutation."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compression.infokv as ik
from methods_ref import assert_selects, avg_pool, check_kept, ref_causal_sums, ref_kara


# ----------------------------------------------------------------------------- entropy helper
def ref_topk_entropy(row, k, temperature):
    top = sorted((float(x) for x in row), reverse=True)[: min(k, len(row))]
    top = [x / temperature for x in top]
    m = max(top)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in top]
    z = sum(e)
    return -sum((v / z) * math.log(v / z) for v in e if v > 0)


@pytest.mark.parametrize("k,temperature", [(10, 1.0), (1, 1.0), (5, 0.7), (1000, 1.3)])
def test_topk_entropy_matches_reference(k, temperature):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(6, 50, generator=gen) * 3
    logits[2, 10:] = float("-inf")  # a row with only 10 allowed tokens
    got = ik.topk_entropy(logits.bfloat16() if k == 5 else logits, k=k, temperature=temperature)
    assert got.dtype == torch.float32 and got.shape == (6,)
    src = logits.bfloat16().double() if k == 5 else logits.double()
    exp = torch.tensor([ref_topk_entropy(r, k, temperature) for r in src.tolist()], dtype=torch.float64)
    torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-6)


def test_topk_entropy_hand_worked():
    assert float(ik.topk_entropy(torch.zeros(1, 100))[0]) == pytest.approx(math.log(10), abs=1e-6)
    assert float(ik.topk_entropy(torch.tensor([[0.0, 0.0, float("-inf")]]))[0]) == pytest.approx(math.log(2))
    # k = 2 of (3, 1, 0): p = (e^2, 1) / (e^2 + 1).
    p = math.exp(2) / (math.exp(2) + 1)
    exp = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert float(ik.topk_entropy(torch.tensor([[3.0, 1.0, 0.0]]), k=2)[0]) == pytest.approx(exp, abs=1e-6)
    assert float(ik.topk_entropy(torch.tensor([[5.0, -50.0]]), k=2)[0]) == pytest.approx(0.0, abs=1e-6)
    assert float(ik.topk_entropy(torch.full((1, 4), float("-inf")))[0]) == 0.0  # no distribution


def test_representation_change():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    b = torch.tensor([[0.0, 3.0], [2.0, 2.0], [-1.0, 0.0]])
    torch.testing.assert_close(ik.representation_change(a, b), torch.tensor([1.0, 0.0, 2.0]))


# ----------------------------------------------------------------------------- combined score
def ref_share(xs):
    fin = [x for x in xs if math.isfinite(x)]
    mean = sum(fin) / len(fin) if fin else 0.0
    v = [max(0.0, x if math.isfinite(x) else mean) for x in xs]
    s = sum(v)
    return [x / s for x in v] if s > 0 else [1.0 / len(v)] * len(v)


def per_slot(sig, l, h):
    return sig[l].tolist() if sig.dim() == 2 else sig[l, h].tolist()


def ref_combine(attn, ent, rep, lam, rho, n):
    L, H, _ = attn.shape
    out = torch.zeros(L, H, n, dtype=torch.float64)
    for l in range(L):
        for h in range(H):
            a = ref_share(attn[l, h].tolist())
            e = ref_share(per_slot(ent, l, h)[:n])
            info = e
            if rep is not None:
                r = ref_share(per_slot(rep, l, h)[:n])
                info = [(1 - rho) * x + rho * y for x, y in zip(e, r)]
            out[l, h] = torch.tensor([(1 - lam) * x + lam * y for x, y in zip(a, info)], dtype=torch.float64)
    return out


@pytest.mark.parametrize("g", [1, 2, 3])
@pytest.mark.parametrize("lam,rho,with_rep",
                         [(0.5, 0.25, True), (0.5, 0.25, False), (0.9, 0.6, True), (0.0, 0.5, True)])
def test_window_select_matches_reference(g, lam, rho, with_rep):
    gen = torch.Generator().manual_seed(g * 7 + int(lam * 10))
    L, hkv, w, d, n = 2, 2, 12, 8, 8
    q = torch.randn(L, hkv * g, w, d, generator=gen) * 2
    k = torch.randn(L, hkv, w, d, generator=gen) * 2
    ent = torch.rand(L, w, generator=gen) * 2.3
    ent[0, 3] = float("nan")  # unknown (e.g. a prompt token): counts as the row mean
    rep = torch.rand(L, w, generator=gen) if with_rep else None
    got = ik.infokv_window_scores(q, k, n, ent, rep, lam=lam, rho=rho)
    ref = ref_combine(ref_kara(q.double(), k.double(), n), ent.double(), None if rep is None else rep.double(),
                      lam, rho, n)
    assert got.dtype == torch.float32 and got.shape == (L, hkv, n)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
    for kk in (0, 3, n):
        kept = ik.infokv_select(q, k, n, kk, ent, rep, lam=lam, rho=rho)
        check_kept(kept, L, hkv, kk, n)
        assert_selects(kept, ref, kk, tol=1e-7)
    # The region-length form of the signals ([L, n]) gives the same scores.
    same = ik.infokv_window_scores(q, k, n, ent[:, :n], None if rep is None else rep[:, :n], lam=lam, rho=rho)
    torch.testing.assert_close(same, got)


@pytest.mark.parametrize("g", [2, 3])
def test_threshold_select_per_slot_signals(g):
    gen = torch.Generator().manual_seed(30 + g)
    L, hkv, w, d, T = 2, 2, 4, 8, 18
    n = T - w
    q = torch.randn(L, hkv * g, w, d, generator=gen) * 2
    k = torch.randn(L, hkv, T, d, generator=gen) * 2
    ent = torch.rand(L, hkv, T, generator=gen)  # after a compaction: one value per (layer, head, slot)
    rep = torch.rand(L, T, generator=gen)
    sums = ref_causal_sums(q.double(), k.double(), n, n, per_group_mean=True)
    attn = torch.tensor([[avg_pool(sums[l, h].tolist(), 5) for h in range(hkv)] for l in range(L)],
                        dtype=torch.float64)
    ref = ref_combine(attn, ent.double(), rep.double(), 0.5, 0.25, n)
    torch.testing.assert_close(ik.infokv_threshold_scores(q, k, ent, rep).double(), ref, rtol=1e-5, atol=1e-7)
    for b in (0, 5, n, 99):
        kept = ik.infokv_threshold_select(q, k, b, ent, rep)
        check_kept(kept, L, hkv, min(b, n), n)
        assert_selects(kept, ref, min(b, n), tol=1e-7)


def test_entropy_moves_the_selection_and_ties():
    # Equal keys: attention is uniform, so the entropy decides; equal entropy too -> lowest slots (ties).
    q = torch.randn(1, 4, 8, 4)
    k = torch.ones(1, 2, 8, 4)
    flat = torch.ones(1, 8)
    assert ik.infokv_select(q, k, 6, 2, flat).tolist() == [[[0, 1], [0, 1]]]
    ent = torch.tensor([[0.1, 0.1, 0.1, 2.0, 0.1, 1.5, 0.0, 0.0]])
    assert ik.infokv_select(q, k, 6, 2, ent).tolist() == [[[3, 5], [3, 5]]]
    # lam = 0: attention only (uniform here) -> ties again.
    assert ik.infokv_select(q, k, 6, 2, ent, lam=0.0).tolist() == [[[0, 1], [0, 1]]]
    # All-zero or all-NaN entropy is neutral (uniform share), not an error.
    zero = ik.infokv_window_scores(q, k, 6, torch.zeros(1, 8))
    nan = ik.infokv_window_scores(q, k, 6, torch.full((1, 8), float("nan")))
    torch.testing.assert_close(zero, nan)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 2), hkv=st.integers(1, 3), g=st.sampled_from([1, 2, 3]), w=st.integers(2, 12),
       data=st.data())
def test_exactly_k(L, hkv, g, w, data):
    n = data.draw(st.integers(1, w))
    kk = data.draw(st.integers(0, n))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    q = torch.randn(L, hkv * g, w, 4, generator=gen)
    k = torch.randn(L, hkv, w, 4, generator=gen)
    ent = torch.rand(L, w, generator=gen)
    check_kept(ik.infokv_select(q, k, n, kk, ent, torch.rand(L, hkv, w, generator=gen)), L, hkv, kk, n)


def test_bad_inputs_name_the_parameter():
    q, k = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"infokv\.lambda must be in \[0, 1\], got 2"):
        ik.infokv_select(q, k, 6, 2, torch.rand(1, 8), lam=2)
    with pytest.raises(ValueError, match=r"infokv\.rho"):
        ik.infokv_select(q, k, 6, 2, torch.rand(1, 8), rho=-0.1)
    with pytest.raises(ValueError, match=r"infokv\.entropy"):
        ik.infokv_select(q, k, 6, 2, torch.rand(1, 7))
    with pytest.raises(ValueError, match=r"infokv\.rep_change"):
        ik.infokv_select(q, k, 6, 2, torch.rand(1, 8), torch.rand(1, 3, 8))
    with pytest.raises(ValueError, match=r"infokv\.topk"):
        ik.topk_entropy(torch.randn(2, 5), k=0)
    with pytest.raises(ValueError, match=r"infokv\.temperature"):
        ik.topk_entropy(torch.randn(2, 5), temperature=0)
    with pytest.raises(ValueError, match=r"infokv\.logits"):
        ik.topk_entropy(torch.randn(5))


def test_mutation_unnormalised_signals_fail_reference(monkeypatch):
    # Mixing raw values instead of shares puts entropy (up to ln k) on a different scale from attention.
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 12, 8, generator=gen) * 2, torch.randn(2, 2, 12, 8, generator=gen) * 2
    ent = torch.rand(2, 12, generator=gen) * 2.3
    ref = ref_combine(ref_kara(q.double(), k.double(), 8), ent.double(), None, 0.5, 0.25, 8)
    monkeypatch.setattr(ik, "_share", lambda x: x.to(torch.float32))
    with pytest.raises(AssertionError):
        assert_selects(ik.infokv_select(q, k, 8, 4, ent), ref, 4, tol=1e-7)
