"""Plain float64 helpers shared by the tests of the neighbouring compression methods (tests/test_methods_*.py):
softmax, cosine, pooling and a reference top-k (ties -> lower index, NaN -> -inf), written with Python floats."""
from __future__ import annotations

import math

import torch


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    if m == -math.inf:
        return [float("nan")] * len(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    z = sum(e)
    return [v / z for v in e]


def dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a, b))


def norm(a) -> float:
    return math.sqrt(dot(a, a))


def avg_pool(xs: list[float], kernel: int) -> list[float]:
    """Stride 1, padding kernel // 2 of zeros, counted in the mean (F.avg_pool1d's default)."""
    p = kernel // 2
    n = len(xs)
    return [sum(xs[t] for t in range(j - p, j + p + 1) if 0 <= t < n) / kernel for j in range(n)]


def max_pool(xs: list[float], kernel: int) -> list[float]:
    p = kernel // 2
    n = len(xs)
    return [max(xs[t] for t in range(j - p, j + p + 1) if 0 <= t < n) for j in range(n)]


def ref_topk(scores: list[float], k: int) -> list[int]:
    """The k best positions (ties -> lower index, NaN -> -inf), ascending."""
    key = [(-math.inf if math.isnan(s) else s) for s in scores]
    order = sorted(range(len(scores)), key=lambda j: (-key[j], j))
    return sorted(order[:k])


def assert_selects(got: torch.Tensor, ref_scores, k: int, tol: float = 1e-6) -> None:
    """got [L, H, k] equals the reference top-k of ref_scores [L, H, n] (float64) row by row. Where the reference
    has a near-tie (within tol) at the k-th place, float32 rounding may pick either side: then require only that
    got is a top-k up to tol."""
    ref = torch.as_tensor(ref_scores, dtype=torch.float64)
    L, H, n = ref.shape
    assert tuple(got.shape) == (L, H, k), (tuple(got.shape), (L, H, k))
    assert got.dtype == torch.long
    for l in range(L):
        for h in range(H):
            row = ref[l, h].tolist()
            exp = ref_topk(row, k)
            g = got[l, h].tolist()
            if g == exp:
                continue
            assert g == sorted(set(g)) and all(0 <= j < n for j in g), g
            key = [(-math.inf if math.isnan(s) else s) for s in row]
            lo = min(key[j] for j in g)
            hi = max((key[j] for j in range(n) if j not in set(g)), default=-math.inf)
            assert lo >= hi - tol, f"row ({l}, {h}): got {g}, expected {exp} (scores {row})"


def check_kept(kept: torch.Tensor, L: int, H: int, k: int, n: int) -> None:
    """Shape [L, H, k], long, strictly ascending inside [0, n)."""
    assert kept.dtype == torch.long and tuple(kept.shape) == (L, H, k), (kept.dtype, tuple(kept.shape))
    if k:
        assert int(kept.min()) >= 0 and int(kept.max()) < n
        if k > 1:
            assert bool((kept[..., 1:] > kept[..., :-1]).all())


def ref_kara(q, k, n):
    """Kara eq. 3: every window query attends the region keys (bidirectional), probabilities summed over the
    queries and the GQA group. float64 [L, Hkv, n]."""
    L, hq, w, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(L, hkv, n, dtype=torch.float64)
    for l in range(L):
        for h in range(hq):
            for i in range(w):
                p = softmax([dot(q[l, h, i], k[l, h // g, j]) / math.sqrt(d) for j in range(n)])
                for j in range(n):
                    out[l, h // g, j] += p[j]
    return out


def ref_causal_sums(q, k, first_pos, num_scored, per_group_mean=False):
    """Sum over the queries (slot first_pos + i sees keys [0, first_pos + i]) of the softmax probabilities,
    summed (or averaged) over each GQA group: float64 [L, Hkv, num_scored]."""
    L, hq, w, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(L, hkv, num_scored, dtype=torch.float64)
    for l in range(L):
        for h in range(hq):
            for i in range(w):
                vis = first_pos + i + 1
                p = softmax([dot(q[l, h, i], k[l, h // g, j]) / math.sqrt(d) for j in range(vis)])
                for j in range(min(num_scored, vis)):
                    out[l, h // g, j] += p[j] / (g if per_group_mean else 1)
    return out


def ref_snapkv_window(q, k, n, obs, kernel, pooling):
    w = k.shape[2]
    P = w - obs
    sums = ref_causal_sums(q[:, :, P:], k, P, P, per_group_mean=True)
    pool = avg_pool if pooling == "avg" else max_pool
    out = torch.zeros(k.shape[0], k.shape[1], n, dtype=torch.float64)
    for l in range(k.shape[0]):
        for h in range(k.shape[1]):
            out[l, h] = torch.tensor(pool(sums[l, h].tolist(), kernel)[:n], dtype=torch.float64)
    return out
