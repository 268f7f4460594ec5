"""Turning freed blocks into throughput: compress before preempting, compression-aware admission, swap preemption,
the cheapest victim, and window queries from the query cache. Exact block ids where the scheduler decides."""
from __future__ import annotations

import pytest
import torch

from compression import KVCompressionConfig
from compression.stage import CompressionStage
from engine import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus
from paging.kv_cache import KVCache
from paging.kv_cache_manager import KVCacheManager
from test_scheduler import run_step as step

BS = 4
STREAM = {"method": "streaming", "window": 8, "buffer": 2, "ratio": 0.1, "chunk_budget": 0,
          "compression_period": 100}
KARA = {"method": "kara", "window": 16, "buffer": 4, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 2,
        "compression_period": 12}


class ReclaimingScheduler(Scheduler):
    """What the engine's compression step does before each schedule: compress the scheduler's shortage away."""

    def __init__(self, *args, stage: CompressionStage, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage = stage

    def schedule(self):
        short = self.shortage()
        if short is not None:
            self.stage.reclaim(short.candidates, self.kv, None, short.blocks)
        return super().schedule()


def setup(num_blocks, reclaim=True, **cfg):
    kv = KVCacheManager(KVCache(1, num_blocks, BS, 1, 2, torch.float32), enable_prefix_caching=False)
    stage = CompressionStage()
    config = SchedulerConfig(max_num_batched_tokens=64, preemption_mode="recompute", **cfg)
    sched = ReclaimingScheduler(config, kv, stage=stage) if reclaim else Scheduler(config, kv)
    return sched, kv, stage


def seq(stage, prompt, rid, comp=STREAM, max_tokens=100):
    s = Sequence(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))
    s.compression = stage.new_state(stage.resolve(comp), len(prompt), None)
    return s


@pytest.mark.parametrize("reclaim", [True, False])
def test_compress_before_preempt_frees_blocks_and_avoids_the_preemption(reclaim):
    sched, kv, stage = setup(6, reclaim)
    a, b = seq(stage, [1, 2, 3, 4], "a"), seq(stage, [5, 6, 7, 8], "b")
    sched.add(a)
    sched.add(b)
    for _ in range(9):  # prefill, then 8 decodes: 12 slots each in 3 blocks, the pool is full
        assert not step(sched).preempted
    assert (a.kv_len, b.kv_len, a.block_table, b.block_table, kv.num_free_blocks) == (12, 12, [0, 2, 4], [1, 3, 5], 0)
    out = step(sched)  # slot 12 needs a fourth block for each
    if reclaim:
        # an on-demand round: each tail of 8 holds one window; streaming keeps 1 of its 6 region slots, so 12 -> 7
        # slots in 2 blocks, freeing blocks 4 and 5; slot 7 then fits each sequence's second block
        assert out.preempted == [] and stage.stats.on_demand_rounds == 1 and stage.stats.blocks_freed == 2
        assert (a.block_table, b.block_table, a.kv_len, b.kv_len) == ([0, 2], [1, 3], 8, 8)
        assert kv.num_free_blocks == 2 and a.compression.compressed_tokens == 10
    else:  # today's policy: the newest sequence is preempted and its blocks go to a
        assert out.preempted == [b] and b.status == SequenceStatus.WAITING and b.block_table == []
        assert a.block_table == [0, 2, 4, 1] and a.kv_len == 13  # b's head block comes back first
    kv.check_invariants(sched.running, sched.waiting)


def test_compression_aware_admission_admits_exactly_what_the_projected_footprint_allows():
    # 20 blocks of 4. Each request: 4 prompt tokens + 36 new. Uncompressed peak 40 tokens = 10 blocks; under
    # streaming (window 8, buffer 2, period 6, keep 1 of 6): tail <= 14, the other 22 generated tokens keep
    # ceil(22 / 6) = 4 slots: 4 + 4 + 14 = 22 tokens = 6 blocks.
    comp = {**STREAM, "compression_period": 6}
    for policy, expect in (("fcfs", ["a", "b", "c", "d"]), ("compression-aware", ["a", "b", "c"])):
        sched, kv, stage = setup(20, scheduling_policy=policy)
        seqs = [seq(stage, [1, 2, 3, 4 + i], r, comp, max_tokens=36) for i, r in enumerate("abcd")]
        assert [sched.projected_blocks(s) for s in seqs] == [6, 6, 6, 6]
        for s in seqs:
            sched.add(s)
        out = step(sched)
        assert [x.seq.request_id for x in out.scheduled] == expect
        assert [s.block_table for s in seqs[:len(expect)]] == [[i] for i in range(len(expect))]
    plain = seq(stage, [1, 2, 3, 4], "p", comp=None, max_tokens=36)
    assert sched.projected_blocks(plain) == 10


def test_cheapest_victim_is_the_one_with_the_least_work():
    sched, kv, stage = setup(6, reclaim=False)
    a, b, c = (seq(stage, p, r, comp=None) for p, r in (([1] * 8, "a"), ([2] * 2, "b"), ([3] * 5, "c")))
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # a [0, 1] (8 slots), b [2], c [3, 4]
    for _ in range(2):
        step(sched)  # b 4 slots in [2]; c 7 in [3, 4]; a 10 in [0, 1, 5]
    assert (a.kv_len, b.kv_len, c.kv_len, kv.num_free_blocks) == (10, 4, 7, 0)
    out = step(sched)  # b needs a second block: of b and c (not yet scheduled), b has the least work
    assert out.preempted == [b] and [x.seq.request_id for x in out.scheduled] == ["a", "c"]


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_swap_out_and_in_restores_the_cache_bit_identically_and_the_output(make_engine):
    prompt = list(range(10, 30))
    ref = make_engine(kv_compression=KARA).generate([prompt], greedy(60), use_tqdm=False)[0].outputs[0].token_ids
    eng = make_engine(kv_compression=KARA)
    req = eng.new_request(prompt, greedy(60), "a")
    eng.add_request(req)
    seq = req.seqs[0]
    while seq.compression.rounds < 2:
        eng.step()
    def slots(n):  # K and V of the sequence's first n slots, every layer: [L, n, 2, Hkv, D]
        p = torch.arange(n)
        table = torch.tensor(seq.block_table)
        return eng.core.kv_cache.data[:, table[p // 4], :, p % 4].clone()

    before = slots(seq.kv_len)
    state = (seq.kv_len, seq.num_computed_tokens, seq.compression.compressed_tokens, seq.compression.compressed_kv_len)
    eng.core.scheduler.preempt(seq, swap=True)
    assert seq.swapped and seq.block_table == [] and eng.stats().num_free_blocks == eng.stats().num_blocks
    eng.step()  # swapped back in and decoded one token, no recompute
    assert not seq.swapped and eng.stats().swapped_in_blocks > 0
    assert (seq.kv_len - 1, seq.num_computed_tokens - 1, seq.compression.compressed_tokens,
            seq.compression.compressed_kv_len) == state
    assert torch.equal(slots(state[0]), before)  # bit-identical
    while eng.has_unfinished_requests():
        eng.step()
    assert req.final.outputs[0].token_ids == ref
    assert eng.stats().recomputed_tokens == 0


def test_engine_under_pressure_compresses_instead_of_preempting(make_engine):
    prompts = [list(range(5 + i, 25 + i)) for i in range(4)]
    runs = {}
    for on in (False, True):
        eng = make_engine(kv_compression={**KARA, "compression_period": 200}, num_kv_blocks=40, watermark=0,
                          compress_before_preempt=on, preemption_mode="recompute")
        outs = eng.generate(prompts, greedy(60), use_tqdm=False)
        runs[on] = eng.stats()
        assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert runs[False].num_preemptions > 0 and runs[False].compression.on_demand_rounds == 0
    assert runs[True].compression.on_demand_rounds > 0
    assert runs[True].num_preemptions < runs[False].num_preemptions
    assert runs[True].recomputed_tokens < runs[False].recomputed_tokens


def test_cached_queries_give_the_same_first_round_selection_as_recomputed_ones(make_engine, monkeypatch):
    """The first window's tokens were computed before any compression, so their stored queries equal what a
    recomputation gives: the same kept slots in every (layer, head)."""
    from compression.kara import Kara

    kept = {}
    real = Kara.select_windows

    def record(self, batch):
        out = real(self, batch)
        kept.setdefault(self.config.query_source, out.clone())
        return out

    monkeypatch.setattr(Kara, "select_windows", record)
    outs = {}
    for source in ("recompute", "cache"):
        eng = make_engine(kv_compression={**KARA, "query_source": source})
        outs[source] = eng.generate([list(range(10, 30))], greedy(26), use_tqdm=False)[0].outputs[0].token_ids
        st = eng.stats()
        assert st.compression.rounds == 1 and (st.compression.queries_cached > 0) == (source == "cache")
    assert torch.equal(kept["recompute"], kept["cache"])
    assert outs["recompute"] == outs["cache"]


def test_settings_reach_the_engine_from_the_cli_and_the_startup_log_states_them(make_engine):
    from server.cli import build_parser, engine_kwargs_from_args

    args = build_parser().parse_args(["serve", "--scheduling-policy", "compression-aware", "--admission-optimism",
                                      "1.5", "--preemption-mode", "swap", "--swap-space", "4MiB",
                                      "--no-compress-before-preempt", "--compression-query-source", "recompute",
                                      "--kv-compression", "kara"])
    kw = engine_kwargs_from_args(args)
    assert kw == {"scheduling_policy": "compression-aware", "admission_optimism": 1.5, "preemption_mode": "swap",
                  "swap_space": "4MiB", "compress_before_preempt": False,
                  "kv_compression": {"method": "kara", "query_source": "recompute"}}
    kw.pop("kv_compression")
    eng = make_engine(**kw)
    line = [x for x in eng.capacity_log_lines() if x.startswith("Scheduler:")][0]
    assert "compression-aware admission (optimism 1.5" in line and "preempt the cheapest victim by swap" in line
    assert "compress, then" not in line and eng.core.kv.host_pool.num_blocks > 0
    with pytest.raises(ValueError, match="preemption_mode"):
        make_engine(preemption_mode="teleport")
