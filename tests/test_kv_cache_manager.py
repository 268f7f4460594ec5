"""KVCacheManager: prefix caching with exact block ids, eviction, compaction next to shared blocks, and
hypothesis-driven invariants under allocate / prefix hit / compact / preempt / free."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import KVCompressionConfig
from paging.compaction import CompactionJob
from compression.state import CompressionState
from engine.model_runner import StepResult
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus
from paging.kv_cache import KVCache
from paging.kv_cache_manager import KVCacheManager

BS = 4


def manager(num_blocks=10, prefix_caching=True):
    return KVCacheManager(KVCache(1, num_blocks, BS, 1, 1, torch.float32), prefix_caching)


def seq(prompt, rid="r", compression=None):
    s = Sequence(rid, list(prompt), SamplingParams(temperature=0, max_tokens=100))
    if compression is not None:
        s.compression = CompressionState(compression, 0 if compression.compress_prompt else len(prompt))
    return s


def write_tokens(kv: KVCacheManager, s: Sequence, start: int, n: int) -> None:
    """Stand-in for the model: slot i of `s` holds its token id (so cached blocks can be checked by content)."""
    data = kv.kv_cache.data
    for p in range(start, start + n):
        data[0, s.block_table[p // BS], 0, p % BS, 0, 0] = float(s.all_token_ids()[p])


def prefill(kv: KVCacheManager, s: Sequence) -> list[int]:
    """Admit `s` the way the scheduler does and compute its whole prompt; returns the cached prefix blocks used."""
    cached = kv.find_cached_prefix(s)
    n = s.num_tokens - len(cached) * BS
    assert kv.allocate_slots(s, n, cached)
    s.num_computed_tokens = len(cached) * BS
    write_tokens(kv, s, s.num_computed_tokens, n)
    s.num_computed_tokens += n
    kv.commit(s, n)
    return cached


def test_second_request_with_a_cached_three_block_prefix_prefills_only_the_rest():
    kv = manager()
    a = seq(range(1, 15), "a")  # 14 tokens: blocks 0, 1, 2 full, block 3 partial
    assert prefill(kv, a) == [] and a.block_table == [0, 1, 2, 3]
    assert [kv.pool.is_cached(b) for b in a.block_table] == [True, True, True, False]
    b = seq(list(range(1, 13)) + [90, 91, 92, 93, 94], "b")  # same first 12 tokens (3 blocks), then its own
    assert kv.find_cached_prefix(b) == [0, 1, 2]
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    a.output_token_ids.append(99)  # a sampled its first token and decodes next to b's admission
    a.status = SequenceStatus.RUNNING
    sched.running.append(a)
    sched.add(b)
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 5)]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12 and b.kv_len == 12
    assert a.block_table == [0, 1, 2, 3]  # a's 15th slot fits its last block
    assert b.block_table == [0, 1, 2, 4, 5]  # b's 5 new tokens need 2 new blocks after the shared three
    assert [kv.pool.ref_counts[x] for x in range(7)] == [2, 2, 2, 1, 1, 1, 0]
    assert kv.prefix_queries == 14 + 17 and kv.prefix_hits == 12  # a looked up 14 tokens, b 17
    sched.update_from_output(out, StepResult())  # the model "ran"
    kv.check_invariants(sched.running)
    sched.finish(a)
    sched.finish(b)
    kv.check_invariants([])
    # everything is free for allocation, but the full prompt blocks stay cached (evictable) for the next request:
    # the three shared ones and b's own fourth block [90, 91, 92, 93]
    assert kv.num_free_blocks == 10 and kv.pool.num_cached == 4
    c = seq(list(range(1, 13)) + [7], "c")
    assert kv.find_cached_prefix(c) == [0, 1, 2]


def test_cached_blocks_are_evicted_least_recently_freed_first_under_pressure():
    kv = manager(num_blocks=6)
    a = seq(range(1, 9), "a")  # 2 full blocks, both cacheable... but one token must stay to compute
    prefill(kv, a)
    assert a.block_table == [0, 1] and kv.pool.num_cached == 2
    kv.free(a)
    assert kv.num_free_blocks == 6
    big = seq(range(50, 66), "big")  # 16 tokens: 4 blocks; the 4 never-cached free blocks go first
    assert prefill(kv, big) == [] and big.block_table == [2, 3, 4, 5]
    assert kv.find_cached_prefix(seq(range(1, 10), "again")) == [0, 1]  # a's prompt is still cached
    more = seq(range(70, 75), "more")  # 2 blocks: the pool must evict both of a's, block 1 first
    assert prefill(kv, more) == [] and more.block_table == [1, 0]  # a's tail block was freed (and cached) first
    assert kv.find_cached_prefix(seq(range(1, 10), "again")) == []
    kv.check_invariants([big, more])


def test_only_protected_prompt_blocks_are_cached_and_compaction_never_touches_them():
    kara = KVCompressionConfig("kara", window=8, buffer=2, compression_period=6)
    prompt_compressed = KVCompressionConfig("kara", window=8, buffer=2, compression_period=6, compress_prompt=True)
    kv = manager(num_blocks=20)
    a = seq(range(1, 10), "a", kara)  # 9 prompt tokens: 2 cacheable blocks
    prefill(kv, a)
    b = seq(range(1, 10), "b", kara)
    assert prefill(kv, b) == [0, 1]  # b shares a's two prompt blocks
    c = seq(range(1, 10), "c", prompt_compressed)
    assert prefill(kv, c) == [] and not any(kv.pool.is_cached(x) for x in c.block_table)
    # b decodes 12 tokens; compacting its generated region keeps the shared prompt blocks untouched
    for t in range(12):
        b.output_token_ids.append(100 + t)
        assert kv.allocate_slots(b, 1)
        write_tokens(kv, b, b.kv_len, 1)
        b.num_computed_tokens += 1
        kv.commit(b, 1)
    before = kv.kv_cache.data[:, b.block_table[:2]].clone()
    kept = torch.tensor([[[0, 3, 5]]])
    freed = kv.compact([CompactionJob.of(b, 9, 8, kept)])
    assert b.kv_len == 21 - 8 + 3 and freed == [2] and len(b.block_table) == 4
    assert torch.equal(kv.kv_cache.data[:, b.block_table[:2]], before)
    vals = [float(kv.kv_cache.data[0, b.block_table[p // BS], 0, p % BS, 0, 0]) for p in range(9, b.kv_len)]
    assert vals == [100, 103, 105, 108, 109, 110, 111]
    kv.check_invariants([a, b, c])
    # a compaction reaching into a shared block is refused
    with pytest.raises(RuntimeError, match="shared or cached"):
        kv.compact([CompactionJob.of(b, 4, 8, torch.tensor([[[0]]]))])


def test_prefix_caching_off_shares_nothing():
    kv = manager(prefix_caching=False)
    a, b = seq(range(1, 15), "a"), seq(range(1, 15), "b")
    prefill(kv, a)
    assert prefill(kv, b) == [] and kv.pool.num_cached == 0 and kv.prefix_queries == 0
    kv.check_invariants([a, b])


PREFIXES = [list(range(1, 9)), list(range(1, 5)) + [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37]]
ops = st.lists(st.tuples(st.sampled_from(["admit", "decode", "compact", "preempt", "free"]), st.integers(0, 10 ** 6)),
               min_size=1, max_size=40)


@settings(max_examples=120, deadline=None)
@given(ops=ops, num_blocks=st.integers(6, 24))
def test_random_operations_keep_invariants_and_cached_blocks_hold_their_tokens(ops, num_blocks):
    kv = manager(num_blocks)
    cfg = KVCompressionConfig("kara", window=8, buffer=2, compression_period=6)
    running: list[Sequence] = []
    waiting: list[Sequence] = []
    made = 0
    for op, pick in ops:
        if op == "admit":
            if waiting and pick % 2:
                s = waiting.pop(pick % len(waiting))
            else:
                made += 1
                s = seq(PREFIXES[pick % 3] + [40 + pick % 7] * (pick % 3), f"s{made}", cfg)
            cached = kv.find_cached_prefix(s)
            for i, b in enumerate(cached):  # a hit must hold exactly this prompt's tokens
                got = [float(kv.kv_cache.data[0, b, 0, o, 0, 0]) for o in range(BS)]
                assert got == [float(t) for t in s.prompt_token_ids[i * BS:(i + 1) * BS]]
            n = s.num_tokens - len(cached) * BS
            if kv.allocate_slots(s, n, cached):
                s.num_computed_tokens = len(cached) * BS
                write_tokens(kv, s, s.num_computed_tokens, n)
                s.num_computed_tokens += n
                kv.commit(s, n)
                running.append(s)
            else:
                assert not s.block_table
                waiting.append(s)
        elif op == "decode" and running:
            s = running[pick % len(running)]
            s.output_token_ids.append(200 + pick % 50)
            if kv.allocate_slots(s, 1):
                write_tokens(kv, s, s.kv_len, 1)
                s.num_computed_tokens += 1
                kv.commit(s, 1)
            else:
                s.output_token_ids.pop()
        elif op == "compact" and running:
            s = running[pick % len(running)]
            tail = s.kv_len - s.num_prompt_tokens
            if tail >= 2:
                region = 1 + pick % (tail - 1)
                g = torch.Generator().manual_seed(pick)
                kept = torch.randperm(region, generator=g)[:max(1, region // 2)].sort().values.view(1, 1, -1)
                kv.compact([CompactionJob.of(s, s.num_prompt_tokens, region, kept)])
        elif op == "preempt" and running:
            s = running.pop(pick % len(running))
            kv.free(s, finished=False)
            s.num_computed_tokens = 0
            waiting.append(s)
        elif op == "free" and running:
            kv.free(running.pop(pick % len(running)))
        kv.check_invariants(running, waiting)
    for s in running:
        kv.free(s)
    kv.check_invariants([], waiting)
    assert kv.num_free_blocks == num_blocks


@pytest.mark.parametrize("corrupt", ["extra-ref", "unlisted-ref", "missing-ref"])
def test_manager_invariants_catch_a_ref_count_that_no_table_explains(corrupt):
    kv = manager(10, prefix_caching=False)
    a, b = seq(range(1, 9), "a"), seq(range(20, 26), "b")
    prefill(kv, a)
    prefill(kv, b)
    kv.check_invariants([a, b])
    if corrupt == "extra-ref":  # a block of a's table counted twice
        kv.pool.ref_counts[a.block_table[0]] += 1
        kv.pool.ref_counts[a.block_table[1]] -= 1  # totals still agree: the per-block check must catch it
    elif corrupt == "unlisted-ref":  # a reference nobody holds, on a block no table lists
        free = kv.pool.allocate(1)[0]
        assert all(free not in s.block_table for s in (a, b))
    else:  # b's blocks dropped from its table without freeing them
        b.block_table.clear()
        b.kv_len = 0
    with pytest.raises(AssertionError):
        kv.check_invariants([a, b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_kv_cache_is_zeroed_contiguous_and_huge_page_aligned(dtype):
    """Over 2 MiB the pages are allocated advised to transparent huge pages (paging/kv_cache.py): the tensor must
    still be one zeroed, contiguous [L, N, 2, bs, Hkv, D] tensor whose layer views write through, on a 2 MiB
    boundary where the platform allows it."""
    import sys

    c = KVCache(3, 700, 16, 3, 64, dtype)
    assert c.data.shape == (3, 700, 2, 16, 3, 64) and c.data.dtype == dtype and c.data.is_contiguous()
    assert c.nbytes > 2 << 20 and not c.data.any()
    if sys.platform.startswith("linux"):
        assert c.data.data_ptr() % (2 << 20) == 0
    c.layers[2][699, 1, 15, 2, 63] = 1
    assert c.data.flatten()[-1] == 1 and c.data.sum() == 1
