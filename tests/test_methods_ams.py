"""AMS (compression/ams.py) against a plain Python/float64 reference written from the algorithm (arXiv 2605.23200 and
its reference press): mass segmentation, quotas, per-segment top-k, must-keep slots, the window and threshold
policies, the EMA credit across two events, GQA, ties, exactly k kept (hypothesis), bad inputs and mutations."""
from __future__ import annotations

import math
from itertools import accumulate

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import compression.ams as ams
from methods_ref import avg_pool, check_kept, ref_causal_sums, ref_kara, ref_snapkv_window


# ----------------------------------------------------------------------------- reference
def ref_normalize(xs):
    v = [(max(0.0, x) if math.isfinite(x) else 0.0) + 1e-12 for x in xs]
    s = sum(v)
    return [x / s for x in v]


def ref_targets(sm):
    out, i = [], 1
    while i * sm < 1 - 1e-9:
        out.append(i * sm)
        i += 1
    return out


def ref_segments(m, sm, min_len, max_len):
    T = len(m)
    cum = list(accumulate(m))
    starts = {0}
    if T > 1:
        for t in ref_targets(sm):
            p = next((j for j in range(T) if cum[j] >= t), T)  # first position reaching the target
            starts.add(min(max(p, 1), T - 1))
    st_ = sorted(starts) + [T]
    split = []
    for a, b in zip(st_[:-1], st_[1:]):
        while b - a > max_len:
            split.append((a, a + max_len))
            a += max_len
        split.append((a, b))
    merged, i = [], 0
    while i < len(split):
        a, b = split[i]
        while b - a < min_len and i + 1 < len(split):
            i += 1
            b = split[i][1]
        merged.append((a, b))
        i += 1
    return merged


def ref_dec(bud, floors, target):
    """One unit per segment per pass, in segment order, while above the floor."""
    cur = sum(bud)
    while cur > target:
        changed = False
        for i in range(len(bud)):
            if bud[i] > floors[i]:
                bud[i] -= 1
                cur -= 1
                changed = True
                if cur == target:
                    break
        if not changed:
            break


def ref_inc(bud, caps, target):
    cur = sum(bud)
    while cur < target:
        changed = False
        for i in range(len(bud)):
            if bud[i] < caps[i]:
                bud[i] += 1
                cur += 1
                changed = True
                if cur == target:
                    break
        if not changed:
            break


def ref_quotas(segs, m, k, min_keep):
    lens = [b - a for a, b in segs]
    masses = [sum(m[a:b]) for a, b in segs]
    base = [min(n_, min_keep) for n_ in lens]
    if sum(base) >= k:
        bud = base[:]
        ref_dec(bud, [1] * len(bud), k)
        ref_dec(bud, [0] * len(bud), k)
        return bud
    remain = k - sum(base)
    total = sum(masses) + 1e-12
    bud = [min(n_, b + round(remain * (mm / total))) for n_, b, mm in zip(lens, base, masses)]  # half-to-even
    ref_dec(bud, base, k)
    ref_inc(bud, lens, k)
    return bud


def ref_ams_row(mass, scores, k, sm, min_len, max_len, min_keep, n_sink, keep_last):
    m = ref_normalize(mass)
    T = len(m)
    segs = ref_segments(m, sm, min_len, max_len)
    quotas = ref_quotas(segs, m, k, min_keep)
    assert sum(quotas) == k

    def key(j):
        s = scores[j]
        return (math.inf if math.isnan(s) else -s, j)

    cand = set()
    for (a, b), q in zip(segs, quotas):
        cand |= set(sorted(range(a, b), key=key)[:q])
    eff_last = min(keep_last, k)
    eff_sink = min(n_sink, max(0, k - eff_last))
    must = set(range(eff_sink)) | set(range(T - eff_last, T))
    need = k - len(must)
    take = sorted(cand - must, key=key)[:need]
    if len(take) < need:
        take += sorted(set(range(T)) - must - cand, key=key)[: need - len(take)]
    return sorted(must | set(take))


def ref_margin(mass, k, sm, min_len, max_len, min_keep):
    """How far the float32 implementation is from a discontinuity of the reference: the distance of every
    cumulative mass to every target, and of every rounded share to a .5 boundary."""
    m = ref_normalize(mass)
    cum = list(accumulate(m))
    d = min((abs(c - t) for c in cum for t in ref_targets(sm)), default=1.0)
    segs = ref_segments(m, sm, min_len, max_len)
    lens = [b - a for a, b in segs]
    base = [min(n_, min_keep) for n_ in lens]
    if sum(base) < k:
        total = sum(sum(m[a:b]) for a, b in segs) + 1e-12
        for a, b in segs:
            x = (k - sum(base)) * (sum(m[a:b]) / total)
            d = min(d, abs(x - math.floor(x) - 0.5))
    return d


def ref_ams(mass, scores, k, sm=0.02, min_len=32, max_len=1024, min_keep=8, n_sink=4, keep_last=32):
    """mass, scores [..., T] -> LongTensor [..., k]."""
    lead, T = mass.shape[:-1], mass.shape[-1]
    mr, sr = mass.double().reshape(-1, T).tolist(), scores.double().reshape(-1, T).tolist()
    rows = [ref_ams_row(a, b, k, sm, min_len, max_len, min_keep, n_sink, keep_last) for a, b in zip(mr, sr)]
    return torch.tensor(rows, dtype=torch.long).reshape(*lead, k)


def margin_of(mass, k, sm, min_len, max_len, min_keep):
    T = mass.shape[-1]
    return min(ref_margin(r, k, sm, min_len, max_len, min_keep) for r in mass.double().reshape(-1, T).tolist())


# ----------------------------------------------------------------------------- hand-worked
# Masses 1, 1, 2, 4, 4, 2, 1, 1 (/16): cumulative 1, 2, 4, 8, 12, 14, 15, 16 (/16), exact in float.
MASS8 = torch.tensor([1.0, 1, 2, 4, 4, 2, 1, 1]) / 16


def seg_bounds(seg_ids):
    ids = seg_ids.tolist()
    out, a = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1]:
            out.append((a, j))
            a = j
    return out


def test_segments_hand_worked():
    # Targets 0.3, 0.6, 0.9 are first reached at positions 3 (0.5), 4 (0.75), 6 (0.9375).
    s = ams.ams_segments(MASS8, segment_mass=0.3, min_seg_len=1, max_seg_len=100)
    assert seg_bounds(s) == [(0, 3), (3, 4), (4, 6), (6, 8)]
    # min_seg_len 2: [3, 4) is too short and absorbs [4, 6).
    s = ams.ams_segments(MASS8, segment_mass=0.3, min_seg_len=2, max_seg_len=100)
    assert seg_bounds(s) == [(0, 3), (3, 6), (6, 8)]
    # max_seg_len 2: [0, 3) splits into [0, 2), [2, 3).
    s = ams.ams_segments(MASS8, segment_mass=0.3, min_seg_len=1, max_seg_len=2)
    assert seg_bounds(s) == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 8)]
    # A target reached exactly (0.25 at position 2, cumulative 4/16) cuts at that position.
    s = ams.ams_segments(MASS8, segment_mass=0.25, min_seg_len=1, max_seg_len=100)
    assert seg_bounds(s) == [(0, 2), (2, 3), (3, 4), (4, 8)]
    assert seg_bounds(s) == ref_segments(MASS8.double().tolist(), 0.25, 1, 100)


def test_quotas_and_selection_hand_worked():
    # Segments [0, 3), [3, 6), [6, 8) with masses 4, 10, 2 (/16); k = 4, min keep 1: floors 1, 1, 1, the remaining
    # 1 goes by mass: round(0.25) = 0, round(0.625) = 1, round(0.125) = 0 -> quotas 1, 2, 1.
    seg, q = ams.ams_quotas(MASS8, 4, segment_mass=0.3, min_seg_len=2, max_seg_len=100, min_keep_per_segment=1)
    assert q.tolist() == [1, 2, 1]
    scores = torch.tensor([9.0, 8, 7, 1, 2, 3, 6, 5])
    kw = dict(segment_mass=0.3, min_seg_len=2, max_seg_len=100, min_keep_per_segment=1)
    # Per segment: {0}, {5, 4}, {6}; the global top-4 would be {0, 1, 2, 6}.
    assert ams.ams_select(MASS8, scores, 4, n_sink=0, keep_last=0, **kw).tolist() == [0, 4, 5, 6]
    # keep_last 1: slot 7 is forced; the 3 best candidates by score are 0 (9), 6 (6), 5 (3).
    assert ams.ams_select(MASS8, scores, 4, n_sink=0, keep_last=1, **kw).tolist() == [0, 5, 6, 7]
    # n_sink 2 + keep_last 1: 0, 1, 7 forced; then the best candidate 6.
    assert ams.ams_select(MASS8, scores, 4, n_sink=2, keep_last=1, **kw).tolist() == [0, 1, 6, 7]


def test_quotas_shrink_round_robin_and_floor_zero():
    mass = torch.ones(15)
    # segment_mass 1 (no mass cuts), max_seg_len 5: three segments of 5. Min keep 3: floors 3, 3, 3 = 9 >= k = 4.
    # Shrink by 5 round-robin to 1 each: 2, 2, 2 after one pass, then 1, 1, 2.
    kw = dict(segment_mass=1.0, min_seg_len=5, max_seg_len=5)
    _, q = ams.ams_quotas(mass, 4, min_keep_per_segment=3, **kw)
    assert q.tolist() == [1, 1, 2]
    # k = 2 < 3 segments: down to 1 each, then (the reference would loop forever) to 0 from the first.
    _, q = ams.ams_quotas(mass, 2, min_keep_per_segment=1, **kw)
    assert q.tolist() == [0, 1, 1]
    # Growing: k = 14, floors 1 each, the remainder 11 by (equal) mass: round(11/3) = 4 each -> 5, 5, 5 = 15 > 14,
    # decreased round-robin from the first segment -> 4, 5, 5.
    _, q = ams.ams_quotas(mass, 14, min_keep_per_segment=1, **kw)
    assert q.tolist() == [4, 5, 5]


def test_ties_and_nan_scores():
    kw = dict(segment_mass=0.3, min_seg_len=2, max_seg_len=100, min_keep_per_segment=1, n_sink=0, keep_last=0)
    # All scores equal: each segment keeps its lowest slots.
    assert ams.ams_select(MASS8, torch.zeros(8), 4, **kw).tolist() == [0, 3, 4, 6]
    # NaN ranks last inside its segment.
    s = torch.zeros(8)
    s[0] = float("nan")
    assert ams.ams_select(MASS8, s, 4, **kw).tolist() == [1, 3, 4, 6]


# ----------------------------------------------------------------------------- random vs reference
@settings(max_examples=60, deadline=None)
@given(R=st.integers(1, 4), T=st.integers(1, 40), data=st.data())
def test_select_matches_reference(R, T, data):
    k = data.draw(st.integers(0, T))
    sm = data.draw(st.sampled_from([0.02, 0.05, 0.1, 0.25, 1 / 3, 1.0]))
    min_len = data.draw(st.integers(1, 6))
    max_len = data.draw(st.integers(min_len, 12))
    min_keep = data.draw(st.integers(0, 4))
    n_sink, keep_last = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 5))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    mass = torch.rand(R, 2, T, generator=gen) ** 3  # peaked masses
    if data.draw(st.booleans()):
        mass[..., : T // 3] = 0  # zero mass spans
    scores = torch.randn(R, 2, T, generator=gen)
    if data.draw(st.booleans()):
        scores = scores.round()  # many exact ties
    kept = ams.ams_select(mass, scores, k, segment_mass=sm, min_seg_len=min_len, max_seg_len=max_len,
                          min_keep_per_segment=min_keep, n_sink=n_sink, keep_last=keep_last)
    check_kept(kept, R, 2, k, T)
    assume(margin_of(mass, k, sm, min_len, max_len, min_keep) > 1e-5)
    exp = ref_ams(mass, scores, k, sm, min_len, max_len, min_keep, n_sink, keep_last)
    assert torch.equal(kept, exp), (kept, exp)


@pytest.mark.parametrize("g", [1, 2, 3])
@pytest.mark.parametrize("base", ["kara", "keydiff", "snapkv"])
def test_window_policy_matches_reference(g, base):
    gen = torch.Generator().manual_seed(17 * g)
    L, hkv, w, d, n, k = 2, 2, 40, 8, 32, 12
    q = torch.randn(L, hkv * g, w, d, generator=gen) * 2
    keys = torch.randn(L, hkv, w, d, generator=gen) * 2
    kw = dict(segment_mass=0.1, min_seg_len=3, max_seg_len=12, min_keep_per_segment=1)
    kept = ams.ams_window_select(q, keys, n, k, base=base, **kw)
    check_kept(kept, L, hkv, k, n)
    mass = ref_snapkv_window(q.double(), keys.double(), n, w - n, 5, "avg") / (w - n)
    torch.testing.assert_close(ams.ams_window_mass(q, keys, n).double(), mass, rtol=1e-5, atol=1e-7)
    if base == "kara":
        s = ref_kara(q.double(), keys.double(), n)
    elif base == "snapkv":
        s = ref_snapkv_window(q.double(), keys.double(), n, w - n, 5, "avg")
    else:
        import compression.baselines as bl

        s = bl.keydiff_scores(keys, n).double()  # checked against its own dense reference in test_methods_baselines
    assert margin_of(mass, k, 0.1, 3, 12, 1) > 1e-5
    # The implementation's float32 base scores, rounded like the reference's, must give the same selection.
    got_s = ams.WINDOW_BASES[base](q, keys, n)
    torch.testing.assert_close(got_s.double(), s, rtol=1e-5, atol=1e-6)
    exp = ref_ams(mass, got_s, k, 0.1, 3, 12, 1, 0, 0)
    assert torch.equal(kept, exp)
    # Precomputed base scores give the same result.
    assert torch.equal(ams.ams_window_select(q, keys, n, k, base=got_s, **kw), kept)


def ref_threshold(q_obs, keys, budget, credit_prev, kernel=5, decay=0.8, beta=0.7, **kw):
    """(kept prefix [L, Hkv, kb], credit_new [L, Hkv, kb + w]) in float64 with base = snapkv."""
    L, hq, w, d = q_obs.shape
    hkv, T = keys.shape[1], keys.shape[2]
    n = T - w
    kb = min(budget, n)
    sums = ref_causal_sums(q_obs.double(), keys.double(), n, n, per_group_mean=True)
    base = torch.tensor([[avg_pool(sums[l, h].tolist(), kernel) for h in range(hkv)] for l in range(L)],
                        dtype=torch.float64)
    pre = base / w
    mass = torch.cat([pre, pre.amax(dim=(1, 2), keepdim=True).expand(L, hkv, w)], dim=-1)
    kept_out, credit_out = [], []
    for l in range(L):
        kr, cr = [], []
        for h in range(hkv):
            m = ref_normalize(mass[l, h].tolist())
            prev = [0.0] * T
            if credit_prev is not None:
                p = credit_prev[l, h].double().tolist()[:T]
                prev[: len(p)] = p
            credit = [decay * a + (1 - decay) * b for a, b in zip(prev, m)]
            cn = ref_normalize(credit)
            used = ref_normalize([beta * a + (1 - beta) * b for a, b in zip(m, cn)])
            scores = base[l, h].tolist() + [math.inf] * w
            kl = max(kw.get("keep_last", 32), w)
            kept = ref_ams_row(used, scores, kb + w, kw.get("sm", 0.02), kw.get("min_len", 32),
                               kw.get("max_len", 1024), kw.get("min_keep", 8), kw.get("n_sink", 4), kl)
            kr.append(kept[:kb])
            cr.append([credit[j] for j in kept])
        kept_out.append(kr)
        credit_out.append(cr)
    return torch.tensor(kept_out, dtype=torch.long), torch.tensor(credit_out, dtype=torch.float64)


@pytest.mark.parametrize("g", [2, 3])
def test_threshold_policy_with_credit_over_two_events(g):
    gen = torch.Generator().manual_seed(5 + g)
    L, hkv, w, d, T1, budget = 2, 2, 4, 8, 44, 20
    kw = dict(segment_mass=0.1, min_seg_len=3, max_seg_len=16, min_keep_per_segment=2, n_sink=2, keep_last=6)
    rkw = dict(sm=0.1, min_len=3, max_len=16, min_keep=2, n_sink=2, keep_last=6)
    q1 = torch.randn(L, hkv * g, w, d, generator=gen) * 2
    k1 = torch.randn(L, hkv, T1, d, generator=gen) * 2
    kept1, credit1 = ams.ams_threshold_select(q1, k1, budget, **kw)
    check_kept(kept1, L, hkv, budget, T1 - w)
    assert credit1.shape == (L, hkv, budget + w)
    exp_kept, exp_credit = ref_threshold(q1, k1, budget, None, **rkw)
    assert torch.equal(kept1, exp_kept)
    torch.testing.assert_close(credit1.double(), exp_credit, rtol=1e-5, atol=1e-9)
    # Compaction: kept prefix, then the observation window; 12 new tokens are appended before the next event.
    idx = torch.cat([kept1, torch.arange(T1 - w, T1).expand(L, hkv, w)], dim=-1)
    k2 = torch.cat([k1.gather(2, idx[..., None].expand(L, hkv, budget + w, d)),
                    torch.randn(L, hkv, 12, d, generator=gen) * 2], dim=2)
    q2 = torch.randn(L, hkv * g, w, d, generator=gen) * 2
    kept2, credit2 = ams.ams_threshold_select(q2, k2, budget, credit_prev=credit1, **kw)
    exp_kept2, exp_credit2 = ref_threshold(q2, k2, budget, credit1, **rkw)
    assert torch.equal(kept2, exp_kept2)
    torch.testing.assert_close(credit2.double(), exp_credit2, rtol=1e-5, atol=1e-9)
    # The credit is used: a credit-free event on the same inputs selects differently.
    kept_nc, none = ams.ams_threshold_select(q2, k2, budget, use_credit=False, **kw)
    assert none is None and kept_nc.shape == kept2.shape and not torch.equal(kept_nc, kept2)


@pytest.mark.parametrize("base", sorted(ams.THRESHOLD_BASES))
def test_threshold_bases_keep_exactly_budget(base):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 8, 8, generator=gen)
    keys = torch.randn(2, 2, 100, 8, generator=gen)
    for b in (0, 10, 60, 92, 200):
        kept, credit = ams.ams_threshold_select(q, keys, b, base=base)
        kb = min(b, 92)
        check_kept(kept, 2, 2, kb, 92)
        assert credit.shape == (2, 2, kb + 8)


def test_credit_update_alignment():
    m = torch.tensor([[1.0, 3.0]])
    mass, credit = ams.ams_credit_update(m, None)
    torch.testing.assert_close(credit, 0.2 * torch.tensor([[0.25, 0.75]]))
    torch.testing.assert_close(mass, torch.tensor([[0.25, 0.75]]))
    # A longer cache: the old credit covers the first slots, the new slot starts at 0.
    mass2, credit2 = ams.ams_credit_update(torch.tensor([[1.0, 1.0, 2.0]]), credit)
    exp = 0.8 * torch.tensor([[0.05, 0.15, 0.0]]) + 0.2 * torch.tensor([[0.25, 0.25, 0.5]])
    torch.testing.assert_close(credit2, exp)


def test_bad_inputs_name_the_parameter():
    with pytest.raises(ValueError, match=r"ams\.segment_mass must be in \(0, 1\]"):
        ams.ams_segments(MASS8, segment_mass=0)
    with pytest.raises(ValueError, match=r"ams\.max_seg_len"):
        ams.ams_segments(MASS8, min_seg_len=4, max_seg_len=2)
    with pytest.raises(ValueError, match=r"ams\.k"):
        ams.ams_select(MASS8, MASS8, 9)
    with pytest.raises(ValueError, match=r"ams\.keep_last"):
        ams.ams_select(MASS8, MASS8, 2, keep_last=-1)
    with pytest.raises(ValueError, match=r"ams\.credit_decay"):
        ams.ams_credit_update(MASS8, None, credit_decay=1.0)
    with pytest.raises(ValueError, match=r"ams\.base"):
        ams.ams_window_select(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), 6, 3, base="nope")
    with pytest.raises(ValueError, match=r"ams\.base"):
        ams.ams_threshold_select(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 10, 4), 3, base="kara")
    with pytest.raises(ValueError, match=r"ams\.credit_prev"):
        ams.ams_threshold_select(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 10, 4), 3, credit_prev=torch.zeros(3))


# ----------------------------------------------------------------------------- mutations the reference catches
def test_mutation_round_robin_from_the_last_segment_fails(monkeypatch):
    real = ams._round_robin
    monkeypatch.setattr(ams, "_round_robin", lambda head, total: real(head.flip(-1), total).flip(-1))
    _, q = ams.ams_quotas(torch.ones(15), 4, segment_mass=1.0, min_seg_len=5, max_seg_len=5, min_keep_per_segment=3)
    assert q.tolist() != [1, 1, 2]  # the reference order (first segment first) gives 1, 1, 2


def test_mutation_target_at_total_mass_fails(monkeypatch):
    # Counting the target i * segment_mass = 1 adds a cut where the cumulative mass reaches 1.
    monkeypatch.setattr(ams, "_num_targets", lambda sm: math.ceil(1.0 / sm - 1e-9))
    s = ams.ams_segments(MASS8, segment_mass=0.25, min_seg_len=1, max_seg_len=100)
    assert seg_bounds(s) != ref_segments(MASS8.double().tolist(), 0.25, 1, 100)
