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


@pytest.mark.parametrize("corrupt", [
    lambda p: p.ref_counts.__setitem__(0, 0),               # used block with ref count 0, not free
    lambda p: p.ref_counts.__setitem__(4, 1),               # free block with a reference
    lambda p: p.ref_counts.__setitem__(7, 1),               # a never-allocated block with a reference
    lambda p: p.ref_counts.__setitem__(1, -1),              # negative count
    lambda p: p._free.append(p._free[-1]),                  # a block free twice
    lambda p: p._free.append(0),                            # a used block also on the free list
    lambda p: p._free.pop(),                                # a block lost: neither free nor used
    lambda p: p._free.append(6),                            # a never-allocated block on the free stack
    lambda p: p._evictable.__setitem__(p._free[0], None),   # free and evictable, not cached
], ids=["used-zero", "free-referenced", "fresh-referenced", "negative", "free-twice", "used-and-free", "lost",
        "fresh-on-stack", "evictable-uncached"])
def test_check_invariants_catches_each_corruption(corrupt):
    """The checks are set/count based (a host pool has ~10^5 blocks): each kind of bad state still fails them."""
    pool = BlockPool(8)
    pool.free(pool.allocate(6)[3:])  # blocks 0-2 used, 5 4 3 on the free stack, 6 7 never allocated
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_invariants()
