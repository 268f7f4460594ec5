"""BlockPool: exact ids, errors, and hypothesis-driven invariants."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paging.block_pool import BlockPool


def test_allocate_hands_out_lowest_ids_first_and_reuses_freed_head_blocks():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    pool.free([0, 1, 2])
    assert pool.num_free == 5
    # a freed sequence's first block is reused first
    assert pool.allocate(2) == [0, 1]
    pool.check_invariants()


def test_share_keeps_block_until_last_reference_drops():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.share([b])
    assert pool.ref_counts[b] == 2
    pool.free([b])
    assert pool.num_free == 1 and pool.ref_counts[b] == 1
    pool.free([b])
    assert pool.num_free == 2
    pool.check_invariants()


def test_errors():
    pool = BlockPool(2)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    with pytest.raises(ValueError, match="double free"):
        pool.free([0])
    with pytest.raises(ValueError, match="share free block"):
        pool.share([1])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    pool.check_invariants()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 5), st.integers(0, 100)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=ops)
def test_random_alloc_free_share_keeps_invariants(num_blocks, ops):
    pool = BlockPool(num_blocks)
    owners: list[list[int]] = []  # each entry is one holder's references
    for op, n, pick in ops:
        if op == "alloc":
            if n <= pool.num_free:
                owners.append(pool.allocate(n))
            else:
                with pytest.raises(MemoryError):
                    pool.allocate(n)
        elif op == "free" and owners:
            pool.free(owners.pop(pick % len(owners)))
        elif op == "share" and owners:
            held = owners[pick % len(owners)]
            pool.share(held)
            owners.append(list(held))
        pool.check_invariants()
        refs = {}
        for held in owners:
            for b in held:
                refs[b] = refs.get(b, 0) + 1
        assert pool.num_free == num_blocks - len(refs)
        assert all(pool.ref_counts[b] == c for b, c in refs.items())
    for held in owners:
        pool.free(held)
    pool.check_invariants()
    assert pool.num_free == num_blocks
