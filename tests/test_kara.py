"""Kara scoring (eq. 3), Token2Chunk (eqs. 4–7 + budget fill), the window compressors and the config."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import (
    Kara,
    KVCompressionConfig,
    RandomCompressor,
    RecentCompressor,
    kara_scores,
    make_compressor,
    num_kept,
    num_topk,
    token2chunk,
)


# ----------------------------------------------------------------------------- eq. 3 reference
def dense_kara_scores(queries, keys, num_region, query_start=0):
    """Eq. 3 written plainly in float64 with explicit loops."""
    q = queries.double()
    k = keys.double()
    L, hq, w, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(L, hkv, num_region, dtype=torch.float64)
    for l in range(L):
        for h in range(hq):
            kvh = h // g
            for i in range(query_start, w):
                logits = [float(q[l, h, i] @ k[l, kvh, j]) / math.sqrt(d) for j in range(num_region)]
                m = max(logits)
                exps = [math.exp(x - m) for x in logits]
                z = sum(exps)
                for j in range(num_region):
                    out[l, kvh, j] += exps[j] / z
    return out


def test_kara_scores_match_dense_gqa():
    torch.manual_seed(0)
    L, hkv, g, w, d, n = 3, 2, 3, 12, 8, 9
    q = torch.randn(L, hkv * g, w, d) * 2
    k = torch.randn(L, hkv, w, d) * 2
    got = kara_scores(q, k, n)
    assert got.dtype == torch.float32 and got.shape == (L, hkv, n)
    torch.testing.assert_close(got.double(), dense_kara_scores(q, k, n), rtol=1e-5, atol=1e-5)
    # Each query distributes one unit of mass over the region: totals are g * W per KV head.
    torch.testing.assert_close(got.sum(-1), torch.full((L, hkv), float(g * w)), rtol=1e-5, atol=1e-4)


def test_kara_scores_buffer_queries_and_bf16():
    torch.manual_seed(1)
    L, hkv, g, w, d, n = 2, 2, 2, 10, 4, 7
    q = torch.randn(L, hkv * g, w, d).to(torch.bfloat16)
    k = torch.randn(L, hkv, w, d).to(torch.bfloat16)
    torch.testing.assert_close(kara_scores(q, k, n, query_start=n).double(),
                               dense_kara_scores(q, k, n, query_start=n), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kara_scores(q, k, n).double(), dense_kara_scores(q, k, n), rtol=1e-5, atol=1e-5)


def test_kara_scores_layer_groups(monkeypatch):
    import compression.primitives as prim

    torch.manual_seed(2)
    q = torch.randn(5, 4, 16, 8)
    k = torch.randn(5, 2, 16, 8)
    full = kara_scores(q, k, 12)
    monkeypatch.setattr(prim, "MAX_ELEMS", 4 * 16 * 12 * 2)  # two layers per group
    torch.testing.assert_close(kara_scores(q, k, 12), full)


# ----------------------------------------------------------------------------- Token2Chunk
def ref_token2chunk(scores: list[float], k: int, gamma: int, alpha: int) -> list[int]:
    """Plain-Python Token2Chunk (same tie rules: lower index / lower chunk first)."""
    n = len(scores)
    if k + alpha >= n:
        return list(range(n))
    order = sorted(range(n), key=lambda j: (-scores[j], j))
    kept_i = sorted(order[:k])
    chunks = []
    for a, b in zip(kept_i, kept_i[1:]):
        gap = b - a - 1
        if gap >= 1 and b - a <= gamma:
            chunks.append(((scores[a] + scores[b]) * gap, a, b))
    chunks.sort(key=lambda c: (-c[0], c[1]))
    keep = set(kept_i)
    for _, a, b in chunks[: alpha // gamma]:
        keep.update(range(a + 1, b))
    for j in order:
        if len(keep) >= k + alpha:
            break
        keep.add(j)
    return sorted(keep)


def background(n: int) -> list[float]:
    return [0.01 * j for j in range(n)]  # low scores, best at the end


def t2c(scores, k, gamma, alpha):
    return token2chunk(torch.tensor(scores), k, gamma, alpha).tolist()


def test_gap_limit_gamma():
    s = background(30)
    s[0], s[3], s[10], s[14] = 10.0, 5.0, 20.0, 20.0
    # gamma = 3: (0,3) has I[k+1]-I[k] = 3 <= 3 (gap 2 = gamma-1) -> eligible, R = 15*2 = 30;
    # (10,14) has difference 4 > 3 (gap 3 = gamma) -> skipped although R would be 120; one chunk (3 // 3).
    # Kept 4 + 2 = 6, one fill slot -> best background position 29.
    assert t2c(s, 4, 3, 3) == [0, 1, 2, 3, 10, 14, 29]
    # gamma = 4 makes (10,14) eligible and it wins (R 120 > 30): +3, one fill slot.
    assert t2c(s, 4, 4, 4) == [0, 3, 10, 11, 12, 13, 14, 29]
    # gamma = 1 never forms chunks: everything is filled by score.
    assert t2c(s, 4, 1, 3) == [0, 3, 10, 14, 27, 28, 29]


def test_chunk_score_ties_lower_first():
    s = background(20)
    s[2], s[4], s[8], s[10] = 5.0, 5.0, 5.0, 5.0
    # gamma 2 -> gaps of 1 only; (2,4) and (8,10) tie at R = 10; (4,8) too wide. One pick -> (2,4).
    assert t2c(s, 4, 2, 2) == [2, 3, 4, 8, 10, 19]


def test_score_ties_lower_index_first():
    assert t2c([1.0] * 10, 3, 2, 2) == [0, 1, 2, 3, 4]
    s = [1.0, 3.0, 2.0, 3.0, 0.0, 3.0, 2.0, 0.0]
    # top-2 of the three 3.0s -> 1, 3; chunk (1,3) gap 1 (gamma 2) -> 2; fill 1 -> 5 (first 3.0 left).
    assert t2c(s, 2, 2, 2) == [1, 2, 3, 5]


def test_budget_fill_when_too_few_chunks():
    s = background(40)
    s[5], s[9], s[30] = 9.0, 8.0, 7.0
    # alpha 16, gamma 8 -> two picks, but only (5,9) is eligible (+6,7,8); (9,30) is too wide. Kept 6 of
    # 3 + 16 = 19 -> 13 more by score: 39..31 and 29..26 (30 is already kept).
    got = t2c(s, 3, 8, 16)
    assert got == [5, 6, 7, 8, 9] + list(range(26, 40))
    assert got == ref_token2chunk(s, 3, 8, 16)


def test_adjacent_best_tokens_fill_everything():
    s = background(30)
    for j, v in zip(range(10, 15), (5.0, 6.0, 7.0, 8.0, 9.0)):
        s[j] = v
    # top-5 are 10..14: no gaps, so all alpha = 4 goes to the fill: 29, 28, 27, 26.
    assert t2c(s, 5, 2, 4) == [10, 11, 12, 13, 14, 26, 27, 28, 29]


def test_topk_plus_budget_exceeds_region():
    assert t2c([3.0, 1.0, 2.0, 0.0, 5.0, 4.0, 1.0, 1.0], 5, 8, 4) == list(range(8))
    assert t2c([3.0, 1.0, 2.0, 0.0], 2, 8, 2) == [0, 1, 2, 3]  # exactly n
    assert t2c([3.0, 1.0, 2.0, 0.0], 4, 8, 0) == [0, 1, 2, 3]
    assert token2chunk(torch.rand(2, 3, 6), 4, 2, 5).shape == (2, 3, 6)


def test_no_budget_is_plain_topk():
    s = [0.5, 0.9, 0.1, 0.8, 0.7, 0.2]
    assert t2c(s, 3, 8, 0) == [1, 3, 4]


def test_token2chunk_batched_rows_independent():
    torch.manual_seed(3)
    scores = torch.randint(0, 6, (3, 4, 50)).float()
    got = token2chunk(scores, 15, 4, 9)
    assert got.shape == (3, 4, 24)
    for l in range(3):
        for h in range(4):
            assert got[l, h].tolist() == ref_token2chunk(scores[l, h].tolist(), 15, 4, 9)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 60),
    ratio=st.floats(0.01, 1.0),
    gamma=st.integers(1, 10),
    alpha=st.integers(0, 24),
    rows=st.integers(1, 3),
)
def test_token2chunk_property(data, n, ratio, gamma, alpha, rows):
    vals = data.draw(st.lists(st.lists(st.integers(0, 7), min_size=n, max_size=n), min_size=rows, max_size=rows))
    scores = torch.tensor(vals, dtype=torch.float32) / 4
    k = num_topk(ratio, n)
    got = token2chunk(scores, k, gamma, alpha)
    expected_len = min(k + alpha, n)
    assert expected_len == num_kept(ratio, n, alpha)
    assert got.shape == (rows, expected_len) and got.dtype == torch.long
    for r in range(rows):
        row = got[r].tolist()
        assert all(a < b for a, b in zip(row, row[1:])) and all(0 <= x < n for x in row)
        assert row == ref_token2chunk(scores[r].tolist(), k, gamma, alpha)
        # The TopK candidates are always kept.
        order = sorted(range(n), key=lambda j: (-float(scores[r, j]), j))
        assert set(order[:k]) <= set(row)


# ----------------------------------------------------------------------------- compressors
def _cfg(method="kara", **kw):
    base = dict(method=method, ratio=0.3, window=40, buffer=8, chunk_budget=6, compression_period=40)
    if method.startswith("kara"):
        base["chunk_max"] = 4  # a Kara parameter: other methods reject it
    if method in ("none", "threshold"):
        base.pop("chunk_budget")
    base.update(kw)
    return KVCompressionConfig(**base)


@pytest.mark.parametrize("method", ["kara", "kara_no_chunk", "kara_buffer_queries"])
def test_kara_batch_equals_per_head(method):
    torch.manual_seed(4)
    L, hkv, g, w, d, n = 3, 2, 2, 40, 16, 32
    q, k = torch.randn(L, hkv * g, w, d), torch.randn(L, hkv, w, d)
    comp = make_compressor(_cfg(method))
    got = comp.select(q, k, n)
    assert got.shape == (L, hkv, comp.num_kept(n)) == (L, hkv, num_topk(0.3, n) + 6)
    for l in range(L):
        for h in range(hkv):
            one = comp.select(q[l:l + 1, h * g:(h + 1) * g], k[l:l + 1, h:h + 1], n)
            assert torch.equal(one[0, 0], got[l, h])


def test_kara_matches_token2chunk_of_scores():
    torch.manual_seed(5)
    q, k = torch.randn(2, 4, 40, 8), torch.randn(2, 2, 40, 8)
    kara = Kara(_cfg())
    a = kara_scores(q, k, 32)
    assert torch.equal(kara.select(q, k, 32), token2chunk(a, num_topk(0.3, 32), 4, 6))
    no_chunk = Kara(_cfg(), token2chunk=False).select(q, k, 32)
    assert torch.equal(no_chunk, a.topk(16, dim=-1).indices.sort(-1).values)
    buf = Kara(_cfg(), buffer_queries_only=True).select(q, k, 32)
    assert torch.equal(buf, token2chunk(kara_scores(q, k, 32, query_start=32), 10, 4, 6))
    with pytest.raises(ValueError):
        Kara(_cfg(), buffer_queries_only=True).select(q, k, 40)  # no buffer -> no queries


@pytest.mark.parametrize("method", ["kara", "kara_no_chunk", "kara_buffer_queries", "random", "streaming"])
@pytest.mark.parametrize("n", [1, 5, 24, 32])
def test_window_methods_shapes(method, n):
    q, k = torch.randn(2, 6, 40, 8), torch.randn(2, 3, 40, 8)
    comp = make_compressor(_cfg(method))
    out = comp.select(q, k, n)
    K = min(n, num_topk(0.3, n) + 6)
    assert out.shape == (2, 3, K) and out.dtype == torch.long
    assert bool((out[..., 1:] > out[..., :-1]).all()) and int(out.min()) >= 0 and int(out.max()) < n


def test_streaming_keeps_newest_and_random_is_seeded():
    q, k = torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    rec = RecentCompressor(_cfg("streaming")).select(q, k, 32)
    assert rec.shape == (2, 2, 16) and all(r == list(range(16, 32)) for r in rec.reshape(-1, 16).tolist())
    a = RandomCompressor(_cfg("random", seed=7))
    b = RandomCompressor(_cfg("random", seed=7))
    x, y = a.select(q, k, 32), b.select(q, k, 32)
    assert torch.equal(x, y)
    assert not torch.equal(a.select(q, k, 32), x)  # successive windows get fresh draws
    assert not torch.equal(RandomCompressor(_cfg("random", seed=8)).select(q, k, 32), x)


def test_make_compressor_non_window_methods():
    assert make_compressor(_cfg("none")) is None
    threshold = make_compressor(_cfg("threshold"))
    with pytest.raises(NotImplementedError, match="periodic"):  # a threshold-only method has no window selection
        threshold.select(torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), 32)
    with pytest.raises(ValueError, match=r"kv_compression\.policy"):
        KVCompressionConfig(method="threshold", policy="periodic")
    with pytest.raises(ValueError, match=r"kv_compression\.chunk_max is not a setting of method 'random'"):
        KVCompressionConfig(method="random", chunk_max=4)


def test_compressor_input_checks():
    comp = make_compressor(_cfg())
    with pytest.raises(ValueError):
        comp.select(torch.randn(2, 5, 40, 8), torch.randn(2, 2, 40, 8), 32)  # 5 % 2 != 0
    with pytest.raises(ValueError):
        comp.select(torch.randn(2, 4, 40, 8), torch.randn(2, 2, 40, 8), 41)
    with pytest.raises(ValueError):
        comp.select(torch.randn(2, 4, 40, 8), torch.randn(2, 2, 40, 8), 0)


# ----------------------------------------------------------------------------- config
def test_config_defaults_and_derived():
    c = KVCompressionConfig()
    assert (c.method, c.ratio, c.window, c.buffer, c.chunk_max, c.chunk_budget) == ("kara", 0.3, 512, 64, 8, 16)
    assert c.region_len == 448 and c.num_topk == 135 and c.kept_per_window == 151
    assert KVCompressionConfig(window=74, buffer=64).kept_per_window == 10  # ⌈3⌉ + 16 capped at n = 10
    assert num_topk(0.3, 10) == 3  # 0.3 * 10 == 3.0000000000000004 in binary floats
    assert num_topk(1.0, 7) == 7 and num_topk(0.01, 7) == 1


@pytest.mark.parametrize("kwargs, field", [
    ({"ratio": 1.5}, "kv_compression.ratio"),
    ({"ratio": 0.0}, "kv_compression.ratio"),
    ({"ratio": "0.3"}, "kv_compression.ratio"),
    ({"method": "snap"}, "kv_compression.method"),
    ({"buffer": 0}, "kv_compression.buffer"),
    ({"buffer": 512}, "kv_compression.buffer"),
    ({"window": 1, "buffer": 1}, "kv_compression.window"),
    ({"window": 64.0}, "kv_compression.window"),
    ({"chunk_max": 0}, "kv_compression.chunk_max"),
    ({"chunk_budget": -1}, "kv_compression.chunk_budget"),
    ({"compression_period": 447}, "kv_compression.compression_period"),
    ({"max_seqs_per_round": 4}, "kv_compression.max_seqs_per_round"),  # removed: rounds are per sequence
    ({"compress_prompt": 1}, "kv_compression.compress_prompt"),
    ({"threshold_target": 4096}, "kv_compression.threshold_max"),
    ({"threshold_target": 16}, "kv_compression.threshold_target"),
    ({"observation_window": 0}, "kv_compression.observation_window"),
    ({"snapkv_kernel": 4}, "kv_compression.snapkv_kernel"),
    ({"chunk_budget": True}, "kv_compression.chunk_budget"),
])
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        KVCompressionConfig(**kwargs)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        KVCompressionConfig.from_dict(kwargs)


def test_config_ratio_message():
    with pytest.raises(ValueError, match=r"kv_compression\.ratio must be in \(0, 1\], got 1\.5"):
        KVCompressionConfig(ratio=1.5)


def test_config_from_dict():
    c = KVCompressionConfig.from_dict({"method": "streaming", "ratio": 1, "window": 256, "buffer": 32})
    assert c.method == "streaming" and c.ratio == 1.0 and isinstance(c.ratio, float) and c.window == 256
    assert KVCompressionConfig.from_dict(None) == KVCompressionConfig()
    base = KVCompressionConfig(ratio=0.5, chunk_budget=32)
    assert KVCompressionConfig.from_dict({"window": 384}, base=base).ratio == 0.5
    with pytest.raises(ValueError, match="'bogus'"):
        KVCompressionConfig.from_dict({"ratio": 0.3, "bogus": 1})
    with pytest.raises(ValueError):
        KVCompressionConfig.from_dict([("ratio", 0.3)])
    assert KVCompressionConfig.from_dict(c.to_dict()) == c
