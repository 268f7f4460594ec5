"""CentroidKV / Chelsea merging (compression/centroid.py) and compaction that writes merged K/V
(paging/compaction.py): hand-computed centroids on worked examples, a plain float64 reference of the chunked soft
matching, invariants under hypothesis (exactly k, clusters inside chunks, centroid = mean of members), and
compaction with computed K/V (exact values, untouched neighbours, freed blocks, per-slot state)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compression.centroid as cen
from methods_ref import check_kept, dot, norm
from paging.compaction import CompactionJob, blocks_to_free, compact_batch, compact_sequence, compact_slot_state


# ----------------------------------------------------------------------------- worked examples
def test_two_clusters_hand_computed():
    # One chunk of 4: A = {0, 2}, B = {1, 3}. k0 ~ k1 and k2 ~ k3, so 0 -> 1 and 2 -> 3 (both edges merge).
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0]])[None, None]
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])[None, None]
    kept, nk, nv = cen.centroid_merge(keys, values, 4, 2, chunk_size=4)
    assert kept.tolist() == [[[1, 3]]]
    torch.testing.assert_close(nk, torch.tensor([[[[1.0, 0.05], [0.05, 1.0]]]]), rtol=0, atol=0)
    torch.testing.assert_close(nv, torch.tensor([[[[2.0, 3.0], [6.0, 7.0]]]]), rtol=0, atol=0)
    _, owner = cen.centroid_clusters(keys, 4, 2, chunk_size=4)
    assert owner.tolist() == [[[1, 1, 3, 3]]]


def test_buffer_untouched_and_singletons_exact():
    # Window of 6, region 4, k = 3: one merge. The most similar A -> B edge is 0 -> 1 (identical keys).
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.3], [9.0, 9.0], [9.0, 9.0]])[None, None]
    values = torch.arange(12, dtype=torch.float32).reshape(1, 1, 6, 2)
    kept, nk, nv = cen.centroid_merge(keys, values, 4, 3, chunk_size=4)
    assert kept.tolist() == [[[1, 2, 3]]]
    torch.testing.assert_close(nk[0, 0], torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.3]]), rtol=0, atol=0)
    torch.testing.assert_close(nv[0, 0], torch.tensor([[1.0, 2.0], [4.0, 5.0], [6.0, 7.0]]), rtol=0, atol=0)


def test_multi_round_centroid_is_size_weighted_mean():
    # Region of 5, k = 1: round 1 merges all three A slots {0, 2, 4} into B slots {1, 3}; round 2 merges the two
    # resulting clusters (sizes 3 and 2, or 2 and 3). The final centroid is the mean of all 5 originals, not the
    # average of the two round-1 centroids.
    keys = torch.tensor([[1.0, 0.0], [0.9, 0.2], [0.0, 1.0], [0.2, 0.9], [0.7, 0.7]])[None, None]
    values = torch.tensor([[0.0, 5.0], [10.0, 0.0], [20.0, 5.0], [30.0, 0.0], [40.0, 10.0]])[None, None]
    kept, nk, nv = cen.centroid_merge(keys, values, 5, 1, chunk_size=8)
    assert kept.tolist() == [[[3]]]
    torch.testing.assert_close(nk[0, 0, 0], keys[0, 0].mean(0))
    torch.testing.assert_close(nv[0, 0, 0], torch.tensor([20.0, 4.0]))


def test_chunks_bound_the_clusters():
    # 8 slots, chunk 4, k = 2: each chunk collapses to one slot holding the chunk's mean.
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 8, 3, generator=gen)
    values = torch.randn(1, 2, 8, 3, generator=gen)
    kept, nk, nv = cen.centroid_merge(keys, values, 8, 2, chunk_size=4)
    assert bool((kept[..., 0] < 4).all()) and bool((kept[..., 1] >= 4).all())
    torch.testing.assert_close(nk, torch.stack([keys[..., :4, :].mean(2), keys[..., 4:, :].mean(2)], dim=2))
    torch.testing.assert_close(nv, torch.stack([values[..., :4, :].mean(2), values[..., 4:, :].mean(2)], dim=2))


def test_chunk_size_grows_when_k_is_small():
    # n = 12, k = 2, chunk_size 4 would leave 3 chunks (k unreachable): chunks become ceil(12 / 2) = 6 long.
    keys = torch.randn(1, 1, 12, 4)
    kept, owner = cen.centroid_clusters(keys, 12, 2, chunk_size=4)
    assert kept.shape == (1, 1, 2)
    assert set(owner[0, 0, :6].tolist()) == {int(kept[0, 0, 0])}
    assert set(owner[0, 0, 6:].tolist()) == {int(kept[0, 0, 1])}


def test_ties_go_to_the_lower_slot():
    # All keys equal: every edge has similarity 1. Round 1 of one chunk of 4: A {0, 2} both pick B slot 1 (the
    # lower of the tied B slots); need = 1, so only the lower A slot (0) merges.
    keys = torch.ones(1, 1, 4, 2)
    kept, owner = cen.centroid_clusters(keys, 4, 3, chunk_size=4)
    assert kept.tolist() == [[[1, 2, 3]]] and owner.tolist() == [[[1, 1, 2, 3]]]


# ----------------------------------------------------------------------------- plain reference
def ref_clusters(keys, n, k, chunk_size):
    """The chunked soft matching of the module docstring with Python lists and float64: returns the owner list of
    every row (row = (layer, head))."""
    L, H, _, d = keys.shape
    rows = [[keys[l, h, j].double().tolist() for j in range(n)] for l in range(L) for h in range(H)]
    c = max(chunk_size, math.ceil(n / k))
    owners = [list(range(n)) for _ in rows]
    alive = [[True] * n for _ in rows]
    need = n - k
    while need > 0:
        edges_all = []
        for x, own, alv in zip(rows, owners, alive):
            cent = {}
            for j in range(n):
                if alv[j]:
                    mem = [x[i] for i in range(n) if own[i] == j]
                    cent[j] = [sum(v[t] for v in mem) / len(mem) for t in range(d)]
            edges = []
            for start in range(0, n, c):
                live = [j for j in range(start, min(n, start + c)) if alv[j]]
                a_set, b_set = live[0::2], live[1::2]
                for a in a_set:
                    if not b_set:
                        continue
                    sims = [dot(cent[a], cent[b]) / (max(norm(cent[a]), 1e-12) * max(norm(cent[b]), 1e-12))
                            for b in b_set]
                    best = max(sims)
                    edges.append((best, a, b_set[sims.index(best)]))
            edges_all.append(edges)
        r = min(need, min(len(e) for e in edges_all))
        for own, alv, edges in zip(owners, alive, edges_all):
            for _, a, b in sorted(edges, key=lambda e: (-e[0], e[1]))[:r]:
                alv[a] = False
                for i in range(n):
                    if own[i] == a:
                        own[i] = b
        need -= r
    return owners


@pytest.mark.parametrize("seed,n,k,c", [(0, 16, 5, 4), (1, 24, 7, 8), (2, 20, 3, 16), (3, 12, 11, 4)])
def test_clusters_match_reference(seed, n, k, c):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, n + 3, 6, generator=gen)
    values = torch.randn(2, 2, n + 3, 5, generator=gen)
    kept, owner = cen.centroid_clusters(keys, n, k, chunk_size=c)
    check_kept(kept, 2, 2, k, n)
    assert owner.reshape(4, n).tolist() == ref_clusters(keys, n, k, c)
    _, nk, nv = cen.centroid_merge(keys, values, n, k, chunk_size=c)
    for l in range(2):
        for h in range(2):
            for t, slot in enumerate(kept[l, h].tolist()):
                members = [j for j in range(n) if int(owner[l, h, j]) == slot]
                torch.testing.assert_close(nk[l, h, t], keys[l, h, members].mean(0))
                torch.testing.assert_close(nv[l, h, t], values[l, h, members].mean(0))


@settings(max_examples=30, deadline=None)
@given(L=st.integers(1, 2), hkv=st.integers(1, 3), n=st.integers(1, 40), data=st.data())
def test_invariants(L, hkv, n, data):
    k = data.draw(st.integers(1, n))
    c = data.draw(st.integers(2, 12))
    extra = data.draw(st.integers(0, 4))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    keys = torch.randn(L, hkv, n + extra, 4, generator=gen)
    if data.draw(st.booleans()):
        keys = keys.round()  # exact duplicates and ties
    values = torch.randn(L, hkv, n + extra, 3, generator=gen)
    kept, owner = cen.centroid_clusters(keys, n, k, chunk_size=c)
    check_kept(kept, L, hkv, k, n)
    ce = max(c, math.ceil(n / k))
    for l in range(L):
        for h in range(hkv):
            ks = kept[l, h].tolist()
            own = owner[l, h].tolist()
            assert set(own) == set(ks) and all(own[s] == s for s in ks)
            assert all(own[j] // ce == j // ce for j in range(n))  # clusters stay inside their chunk
    _, nk, nv = cen.centroid_merge(keys, values, n, k, chunk_size=c)
    assert nk.shape == (L, hkv, k, 4) and nv.shape == (L, hkv, k, 3)
    # Sizes add up: summing centroid * cluster size gives back the region's total.
    size = torch.zeros(L, hkv, n).scatter_add_(2, owner, torch.ones(L, hkv, n)).gather(2, kept)
    torch.testing.assert_close((nv * size[..., None]).sum(2), values[:, :, :n].sum(2), rtol=1e-4, atol=1e-4)


def test_dtype_and_bad_inputs():
    keys = torch.randn(1, 2, 8, 4).bfloat16()
    values = torch.randn(1, 2, 8, 4).bfloat16()
    kept, nk, nv = cen.centroid_merge(keys, values, 6, 3)
    assert nk.dtype == torch.bfloat16 and nv.dtype == torch.bfloat16 and kept.dtype == torch.long
    with pytest.raises(ValueError, match=r"centroid\.k"):
        cen.centroid_merge(keys, values, 6, 0)
    with pytest.raises(ValueError, match=r"centroid\.k"):
        cen.centroid_merge(keys, values, 6, 7)
    with pytest.raises(ValueError, match=r"centroid\.chunk_size"):
        cen.centroid_merge(keys, values, 6, 3, chunk_size=1)
    with pytest.raises(ValueError, match=r"centroid\.values"):
        cen.centroid_merge(keys, values[:, :1], 6, 3)


def test_mutation_no_averaging_fails(monkeypatch):
    # Keeping the representative's own K/V (plain eviction) instead of the cluster mean must be caught.
    def pairwise(x, owner):
        return x

    keys = torch.tensor([[1.0, 0.0], [0.9, 0.2], [0.0, 1.0], [0.2, 0.9], [0.7, 0.7]])[None, None]
    values = torch.tensor([[0.0, 5.0], [10.0, 0.0], [20.0, 5.0], [30.0, 0.0], [40.0, 10.0]])[None, None]
    monkeypatch.setattr(cen, "_centroids", pairwise)
    _, _, nv = cen.centroid_merge(keys, values, 5, 1, chunk_size=8)
    assert not torch.allclose(nv[0, 0, 0], torch.tensor([20.0, 4.0]))


# ----------------------------------------------------------------------------- compaction with computed K/V
BS = 2


def slot_kv(kv, table, s, l=0, h=0):
    return kv[l, table[s // BS], :, s % BS, h]


def test_compaction_writes_merged_rows_hand_worked():
    # L = 1, Hkv = 1, D = 2, blocks of 2; the sequence uses blocks [2, 0, 3] for 6 slots. Region [1, 5) keeps its
    # slots 1 and 3 with computed K/V; the tail slot 5 moves to slot 3; new length 4 -> block 3 is freed.
    kv = torch.arange(4 * 2 * BS * 2, dtype=torch.float32).reshape(1, 4, 2, BS, 1, 2)
    before = kv.clone()
    table = [2, 0, 3]
    nk = torch.tensor([[[[100.0, 101.0], [102.0, 103.0]]]])
    nv = torch.tensor([[[[200.0, 201.0], [202.0, 203.0]]]])
    new_len = compact_sequence(kv, table, 1, 4, torch.tensor([[[1, 3]]]), 6, new_keys=nk, new_values=nv)
    assert new_len == 4
    assert torch.equal(slot_kv(kv, table, 0), slot_kv(before, table, 0))  # before the region: untouched
    assert slot_kv(kv, table, 1).tolist() == [[100.0, 101.0], [200.0, 201.0]]
    assert slot_kv(kv, table, 2).tolist() == [[102.0, 103.0], [202.0, 203.0]]
    assert torch.equal(slot_kv(kv, table, 3), slot_kv(before, table, 5))  # tail moved
    assert torch.equal(kv[:, 1], before[:, 1])  # another sequence's block
    assert blocks_to_free(table, new_len, BS) == [3]


def test_compact_batch_mixes_merging_and_plain_jobs():
    gen = torch.Generator().manual_seed(3)
    L, NB, H, D = 2, 12, 2, 3
    kv = torch.randn(L, NB, 2, BS, H, D, generator=gen).bfloat16()
    before = kv.clone()
    t1, t2 = [5, 1, 7, 9], [2, 11, 0]
    kept1 = torch.tensor([[0, 2], [1, 3]]).expand(L, H, 2).contiguous()
    kept2 = torch.tensor([[1], [0]]).expand(L, H, 1).contiguous()
    nk = torch.randn(L, H, 2, D, generator=gen)
    nv = torch.randn(L, H, 2, D, generator=gen)
    jobs = [CompactionJob(t1, 2, 4, kept1, 8, new_keys=nk, new_values=nv), CompactionJob(t2, 0, 2, kept2, 5)]
    assert compact_batch(kv, jobs) == [6, 4]
    for l in range(L):
        for h in range(H):
            for t in range(2):  # merging job: computed rows, rounded to the pool's dtype
                assert torch.equal(slot_kv(kv, t1, 2 + t, l, h)[0], nk[l, h, t].bfloat16())
                assert torch.equal(slot_kv(kv, t1, 2 + t, l, h)[1], nv[l, h, t].bfloat16())
            for t in range(2):  # its tail
                assert torch.equal(slot_kv(kv, t1, 4 + t, l, h), slot_kv(before, t1, 6 + t, l, h))
            # plain job: kept slot moved, tail moved
            assert torch.equal(slot_kv(kv, t2, 0, l, h), slot_kv(before, t2, int(kept2[l, h, 0]), l, h))
            for t in range(3):
                assert torch.equal(slot_kv(kv, t2, 1 + t, l, h), slot_kv(before, t2, 2 + t, l, h))
    assert blocks_to_free(t1, 6, BS) == [9] and blocks_to_free(t2, 4, BS) == [0]


def test_centroid_merge_through_compaction():
    # Merge a window's region in the pool and compact: the pool then holds the centroids, then the buffer.
    gen = torch.Generator().manual_seed(4)
    L, H, D, W, n, k = 2, 2, 4, 10, 8, 3
    kv = torch.randn(L, 8, 2, BS, H, D, generator=gen)
    table = [6, 2, 4, 0, 7]  # 10 slots
    keys = torch.stack([torch.stack([torch.stack([slot_kv(kv, table, s, l, h)[0] for s in range(W)])
                                     for h in range(H)]) for l in range(L)])
    values = torch.stack([torch.stack([torch.stack([slot_kv(kv, table, s, l, h)[1] for s in range(W)])
                                       for h in range(H)]) for l in range(L)])
    kept, nk, nv = cen.centroid_merge(keys, values, n, k, chunk_size=4)
    new_len = compact_sequence(kv, table, 0, n, kept, W, new_keys=nk, new_values=nv)
    assert new_len == W - n + k == 5
    for l in range(L):
        for h in range(H):
            for t in range(k):
                assert torch.equal(slot_kv(kv, table, t, l, h)[0], nk[l, h, t])
                assert torch.equal(slot_kv(kv, table, t, l, h)[1], nv[l, h, t])
            for t in range(W - n):
                assert torch.equal(slot_kv(kv, table, k + t, l, h)[0], keys[l, h, n + t])
    assert blocks_to_free(table, new_len, BS) == [0, 7]


def test_compaction_rejects_bad_merged_rows():
    kv = torch.zeros(1, 4, 2, BS, 1, 2)
    kept = torch.tensor([[[0]]])
    with pytest.raises(ValueError, match="together"):
        compact_sequence(kv, [0, 1], 0, 2, kept, 4, new_keys=torch.zeros(1, 1, 1, 2))
    with pytest.raises(ValueError, match="new_keys must be"):
        compact_sequence(kv, [0, 1], 0, 2, kept, 4, new_keys=torch.zeros(1, 1, 2, 2),
                         new_values=torch.zeros(1, 1, 2, 2))


def test_compact_slot_state():
    state = torch.arange(12, dtype=torch.float32).reshape(1, 2, 6)  # [L, Hkv, T]
    kept = torch.tensor([[[0, 2], [1, 3]]])
    out = compact_slot_state(state, 1, 4, kept)
    assert out.tolist() == [[[0.0, 1.0, 3.0, 5.0], [6.0, 8.0, 10.0, 11.0]]]
    extra = torch.arange(24).reshape(1, 2, 6, 2)  # trailing dims move along
    assert compact_slot_state(extra, 1, 4, kept)[0, 1].tolist() == [[12, 13], [16, 17], [20, 21], [22, 23]]
    with pytest.raises(ValueError):
        compact_slot_state(state, 3, 4, kept)
