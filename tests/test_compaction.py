"""In-place paged compaction: bit-exact moves, untouched neighbours, freed blocks."""
from __future__ import annotations

import pytest
import torch

from paging.compaction import CompactionJob, blocks_to_free, compact_batch, compact_sequence

L, NB, BS, HKV, D = 3, 16, 4, 2, 5


def slot(kv, table, s, l, h):
    """[2, D] (K and V) of slot s, layer l, KV head h."""
    return kv[l, table[s // BS], :, s % BS, h]


def random_kept(region_len, K, gen):
    return torch.stack([
        torch.stack([torch.randperm(region_len, generator=gen)[:K].sort().values for _ in range(HKV)])
        for _ in range(L)])


def check_compacted(before, after, table, region_start, region_len, kept, kv_len, new_len):
    K = kept.shape[-1]
    assert new_len == kv_len - region_len + K
    for l in range(L):
        for h in range(HKV):
            for s in range(region_start):  # prefix untouched
                assert torch.equal(slot(after, table, s, l, h), slot(before, table, s, l, h))
            for t in range(K):  # kept, in order
                src = region_start + int(kept[l, h, t])
                assert torch.equal(slot(after, table, region_start + t, l, h), slot(before, table, src, l, h))
            for t in range(kv_len - region_start - region_len):  # moved tail (buffer and after)
                src = region_start + region_len + t
                assert torch.equal(slot(after, table, region_start + K + t, l, h), slot(before, table, src, l, h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_sequence_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(L, NB, 2, BS, HKV, D, generator=gen).to(dtype)
    table = [7, 2, 11, 0, 5, 9]  # non-contiguous; 23 slots use all 6 blocks
    other = [1, 3, 4]  # another sequence's blocks
    before = kv.clone()
    kept = random_kept(12, 5, gen)
    new_len = compact_sequence(kv, table, 8, 12, kept, 23)
    assert new_len == 16
    check_compacted(before, kv, table, 8, 12, kept, 23, new_len)
    untouched = [b for b in range(NB) if b not in table]
    assert set(other) <= set(untouched)
    assert torch.equal(kv[:, untouched], before[:, untouched])
    # 16 slots fill exactly blocks 0..3 of the table; the 5th and 6th (ids 5 and 9) are free.
    assert blocks_to_free(table, new_len, BS) == [5, 9]


def test_compact_unaligned_region_and_per_head_positions():
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(L, NB, 2, BS, HKV, D, generator=gen)
    table = [12, 3, 8, 1, 14]
    before = kv.clone()
    kept = random_kept(9, 4, gen)  # region [5, 14) of kv_len 19: tail 14..18
    assert not torch.equal(kept[0, 0], kept[0, 1]) or not torch.equal(kept[1, 0], kept[1, 1])
    new_len = compact_sequence(kv, table, 5, 9, kept, 19)
    assert new_len == 14
    check_compacted(before, kv, table, 5, 9, kept, 19, new_len)
    assert blocks_to_free(table, new_len, BS) == [14]
    untouched = [b for b in range(NB) if b not in table]
    assert torch.equal(kv[:, untouched], before[:, untouched])


def test_compact_edge_cases():
    gen = torch.Generator().manual_seed(2)
    table = [4, 6, 2, 9]
    # Keep nothing, no tail.
    kv = torch.randn(L, NB, 2, BS, HKV, D, generator=gen)
    before = kv.clone()
    assert compact_sequence(kv, table, 4, 12, torch.empty(L, HKV, 0, dtype=torch.long), 16) == 4
    assert torch.equal(kv, before)  # nothing moved, slots past 4 are just dead
    # Keep everything: a no-op.
    kept = torch.arange(12).expand(L, HKV, 12)
    assert compact_sequence(kv, table, 4, 12, kept, 16) == 16
    assert torch.equal(kv, before)
    # Region at slot 0, keep the last slot of every head, tail of 3.
    kept = torch.full((L, HKV, 1), 9)
    new_len = compact_sequence(kv, table, 0, 10, kept, 13)
    assert new_len == 4
    check_compacted(before, kv, table, 0, 10, kept, 13, new_len)


def test_compact_batch_equals_sequential():
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(L, NB, 2, BS, HKV, D, generator=gen)
    kv2 = kv.clone()
    jobs = [
        CompactionJob([7, 2, 11, 0, 5, 9], 8, 12, random_kept(12, 5, gen), 23),
        CompactionJob([1, 3, 4, 15], 2, 10, random_kept(10, 3, gen), 14),
    ]
    assert compact_batch(kv, jobs) == [16, 7]
    for j in jobs:
        compact_sequence(kv2, j.block_table, j.region_start, j.region_len, j.kept, j.kv_len)
    assert torch.equal(kv, kv2)


def test_blocks_to_free_hand_worked():
    table = [10, 11, 12, 13, 14, 15]  # 6 blocks of 4 hold 21..24 slots
    assert blocks_to_free(table, 16, 4) == [14, 15]  # slots 0..15 = exactly 4 blocks
    assert blocks_to_free(table, 17, 4) == [15]  # slot 16 opens the 5th block
    assert blocks_to_free(table, 20, 4) == [15]
    assert blocks_to_free(table, 21, 4) == []
    assert blocks_to_free(table, 24, 4) == []
    assert blocks_to_free(table, 1, 4) == [11, 12, 13, 14, 15]
    assert blocks_to_free(table, 0, 4) == table


def test_compact_rejects_bad_input():
    kv = torch.zeros(L, NB, 2, BS, HKV, D)
    table = [0, 1, 2]
    with pytest.raises(ValueError):  # out of region
        compact_sequence(kv, table, 2, 4, torch.tensor([0, 4]).expand(L, HKV, 2), 10)
    with pytest.raises(ValueError):  # unsorted / duplicate
        compact_sequence(kv, table, 2, 4, torch.tensor([2, 1]).expand(L, HKV, 2), 10)
    with pytest.raises(ValueError):  # region past kv_len
        compact_sequence(kv, table, 8, 4, torch.tensor([0, 1]).expand(L, HKV, 2), 10)
    with pytest.raises(ValueError):  # table too short
        compact_sequence(kv, table, 2, 4, torch.tensor([0, 1]).expand(L, HKV, 2), 13)
    with pytest.raises(ValueError):  # wrong head count
        compact_sequence(kv, table, 2, 4, torch.tensor([0, 1]).expand(L, HKV + 1, 2), 10)
