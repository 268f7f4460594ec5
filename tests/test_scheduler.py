"""Scheduler with exact block ids: chunked prefill, admission, preemption by recompute, finishing."""
import torch

from engine.model_runner import StepResult
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus
from paging.kv_cache import KVCache
from paging.kv_cache_manager import KVCacheManager


def make(num_blocks=8, block_size=4, max_num_seqs=4, budget=16, watermark=0, prefix_caching=False):
    kv = KVCacheManager(KVCache(1, num_blocks, block_size, 1, 2, torch.float32), prefix_caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, watermark_blocks=watermark)
    return Scheduler(cfg, kv), kv.pool


def seq(n_prompt, rid="r"):
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(temperature=0, max_tokens=100))


def run_step(sched, sampled_token=7):
    """Schedule, pretend the model ran, append one token to every sequence whose prefill completed."""
    out = sched.schedule()
    done = [s.seq for s in out.scheduled if s.completes_prefill]
    sched.update_from_output(out, StepResult())  # the model "ran"
    for s in done:
        s.output_token_ids.append(sampled_token)
    return out


def test_chunked_prefill_splits_by_token_budget_and_mixes_with_decode():
    sched, pool = make(num_blocks=10, budget=8)
    a, b = seq(6, "a"), seq(10, "b")
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    # a takes 6 tokens (2 blocks), b gets the remaining 2 of the budget (1 block)
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 6), ("b", 2)]
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert a.num_outputs == 1 and b.num_outputs == 0
    out = run_step(sched)
    # a decodes one token, b continues its prefill with 7 of its 8 remaining tokens
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4]
    assert b.num_computed_tokens == 9 and b.kv_len == 9
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert a.kv_len == 8 and a.block_table == [0, 1]
    assert b.num_outputs == 1
    out = run_step(sched)
    assert a.block_table == [0, 1, 5]  # a's 9th slot needs a third block
    pool.check_invariants()


def test_admission_respects_watermark_and_max_num_seqs():
    sched, pool = make(num_blocks=4, budget=64, max_num_seqs=2, watermark=1)
    a, b, c = seq(8, "a"), seq(4, "b"), seq(1, "c")
    for s in (a, b, c):
        sched.add(s)
    out = run_step(sched)
    # a: 2 blocks, b would need 1 more leaving 1 free = watermark -> admitted; c blocked by max_num_seqs
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    assert list(sched.waiting) == [c]
    sched.finish(b)
    assert b.status == SequenceStatus.FINISHED and b.block_table == []
    out = run_step(sched)
    # a's decode takes block 2 (running sequences never wait on the watermark); c would leave 0 < 1 free
    assert [s.seq.request_id for s in out.scheduled] == ["a"] and a.block_table == [0, 1, 2]
    assert pool.num_free == 1 and list(sched.waiting) == [c]
    sched.finish(a)
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["c"]
    assert c.block_table == [0]
    pool.check_invariants()


def test_preemption_frees_newest_sequence_and_it_resumes_from_prompt_plus_outputs():
    sched, pool = make(num_blocks=4, budget=64)
    a, b = seq(4, "a"), seq(4, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched, sampled_token=11)  # a -> [0], b -> [1]; each has 1 output and 4 slots used
    assert a.block_table == [0] and b.block_table == [1]
    run_step(sched, sampled_token=12)  # both write slot 4 -> a [0,2], b [1,3]; pool now empty
    assert a.block_table == [0, 2] and b.block_table == [1, 3] and pool.num_free == 0
    for _ in range(3):
        run_step(sched, sampled_token=13)  # slots 5..7 fit in the second block
    assert a.kv_len == 8 and b.kv_len == 8 and pool.num_free == 0
    out = sched.schedule()  # a needs a third block: b (newest) is preempted, its blocks go to a
    assert out.preempted == [b]
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert a.block_table == [0, 2, 1]  # b's blocks are freed head-first reusable: block 1 comes back first
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.kv_len == 0
    assert b.num_computed_tokens == 0 and b.output_token_ids == [11, 12, 13, 13, 13]
    assert list(sched.waiting) == [b] and sched.stats.num_preemptions == 1
    pool.check_invariants()
    sched.update_from_output(out, StepResult())  # the model "ran"
    a.output_token_ids.append(14)
    sched.finish(a)
    assert pool.num_free == 4
    out = run_step(sched, sampled_token=15)
    # b recomputes prompt + 5 outputs = 9 tokens in one prefill and samples its next token
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("b", 9)]
    assert b.output_token_ids == [11, 12, 13, 13, 13, 15] and b.kv_len == 9
    sched.finish(b)
    pool.check_invariants()
    assert pool.num_free == 4


def test_sequence_preempts_itself_when_it_is_the_newest():
    sched, pool = make(num_blocks=2, budget=64)
    a, b = seq(3, "a"), seq(4, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a -> [0] (3 slots), b -> [1] (4 slots): the pool is empty
    out = sched.schedule()
    # a's next slot fits its block; b (the newest) needs a second block: the only victim is b itself, so it
    # preempts itself instead of taking a's blocks
    assert out.preempted == [b] and [s.seq for s in out.scheduled] == [a]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and list(sched.waiting) == [b]
    assert a.block_table == [0] and pool.num_free == 1
    pool.check_invariants()


def test_finish_waiting_and_running_returns_every_block():
    sched, pool = make(num_blocks=6, budget=6)
    a, b = seq(12, "a"), seq(3, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a is mid-prefill, b waits for budget
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    sched.finish(a)
    sched.finish(b)
    assert pool.num_free == 6 and not sched.has_work()
    pool.check_invariants()


def test_request_needing_the_whole_pool_is_admitted_when_nothing_runs():
    # 4 blocks, watermark 1: a 16-token prompt needs all 4 blocks. With nothing running the watermark must not
    # apply, or the request (and everything queued behind it) would wait forever.
    sched, pool = make(num_blocks=4, budget=64, watermark=1)
    a, b = seq(16, "a"), seq(2, "b")
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 16)]
    assert a.block_table == [0, 1, 2, 3] and list(sched.waiting) == [b]
    sched.finish(a)
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("b", 2)] and b.block_table == [0]
    sched.finish(b)
    pool.check_invariants()
    assert pool.num_free == 4
