"""SnapKV scores (threshold baseline) against a dense float64 loop reference."""
from __future__ import annotations

import math

import pytest
import torch

from compression import KVCompressionConfig, SnapKVCompressor, snapkv_scores, snapkv_select


def dense_snapkv(queries_obs, keys, kernel):
    q, k = queries_obs.double(), keys.double()
    L, hq, w, d = q.shape
    hkv, T = k.shape[1], k.shape[2]
    g = hq // hkv
    n = T - w
    summed = torch.zeros(L, hkv, n, dtype=torch.float64)
    for l in range(L):
        for h in range(hq):
            for i in range(w):
                visible = n + i + 1  # causal: keys [0, n + i]
                logits = [float(q[l, h, i] @ k[l, h // g, j]) / math.sqrt(d) for j in range(visible)]
                m = max(logits)
                exps = [math.exp(x - m) for x in logits]
                z = sum(exps)
                for j in range(n):
                    summed[l, h // g, j] += exps[j] / z / g  # mean over the g heads of the group
    pooled = torch.zeros_like(summed)
    p = kernel // 2
    for j in range(n):
        for t in range(j - p, j - p + kernel):
            if 0 <= t < n:
                pooled[:, :, j] += summed[:, :, t]
    return pooled / kernel  # zero padding counted, like F.avg_pool1d


@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_snapkv_scores_match_dense(kernel):
    torch.manual_seed(0)
    L, hkv, g, w, T, d = 2, 2, 3, 4, 15, 8
    q = torch.randn(L, hkv * g, w, d) * 2
    k = torch.randn(L, hkv, T, d) * 2
    got = snapkv_scores(q, k, kernel)
    assert got.shape == (L, hkv, T - w) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), dense_snapkv(q, k, kernel), rtol=1e-5, atol=1e-6)


def test_snapkv_layer_groups(monkeypatch):
    import compression.primitives as prim

    torch.manual_seed(1)
    q, k = torch.randn(4, 4, 3, 8), torch.randn(4, 2, 20, 8)
    full = snapkv_scores(q, k, 5)
    monkeypatch.setattr(prim, "MAX_ELEMS", 4 * 3 * 20)  # one layer at a time
    torch.testing.assert_close(snapkv_scores(q, k, 5), full)


def test_snapkv_select_and_compressor():
    s = torch.tensor([[[0.1, 0.5, 0.5, 0.2, 0.9, 0.0]]])
    assert snapkv_select(s, 3).tolist() == [[[1, 2, 4]]]
    assert snapkv_select(s, 10).tolist() == [[[0, 1, 2, 3, 4, 5]]]
    cfg = KVCompressionConfig(method="threshold", threshold_max=24, threshold_target=12, observation_window=4,
                              snapkv_kernel=3)
    comp = SnapKVCompressor(cfg)
    assert cfg.policy == "threshold" and cfg.threshold_target - cfg.observation_window == 8
    torch.manual_seed(2)
    q, k = torch.randn(3, 4, 4, 8), torch.randn(3, 2, 24, 8)
    kept = comp.select_prefix(q, k, 8)
    assert kept.shape == (3, 2, 8)
    assert bool((kept[..., 1:] > kept[..., :-1]).all()) and int(kept.max()) < 20
    expected = snapkv_scores(q, k, 3).topk(8, dim=-1).indices.sort(-1).values
    assert torch.equal(kept, expected)
    with pytest.raises(ValueError):
        snapkv_scores(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), 3)  # no prefix
