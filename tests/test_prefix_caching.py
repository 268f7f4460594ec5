"""Prefix caching through the engine: outputs identical with and without it (also under compression), hits and
their accounting, eviction under pressure, aborts of requests sharing blocks."""
from __future__ import annotations

import pytest

from engine import SamplingParams

PREFIX = [5 + (7 * i) % 100 for i in range(30)]  # 30 tokens: 7 full blocks of 4
SUFFIXES = [[101, 102], [103], [104, 105, 106], [107, 108, 109, 110, 111]]
KARA = {"method": "kara", "window": 16, "buffer": 4, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 2,
        "compression_period": 12}


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv_compression", [None, KARA])
def test_outputs_identical_with_and_without_prefix_caching(make_engine, kv_compression):
    prompts = [PREFIX + s for s in SUFFIXES]
    ref = make_engine(enable_prefix_caching=False).generate(prompts, greedy(60, kv_compression=kv_compression),
                                                            use_tqdm=False)
    eng = make_engine()
    first = eng.generate(prompts[:1], greedy(60, kv_compression=kv_compression), use_tqdm=False)
    outs = eng.generate(prompts, greedy(60, kv_compression=kv_compression), use_tqdm=False)
    assert tokens(first) == tokens(ref[:1]) and tokens(outs) == tokens(ref)
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in outs] == [28, 28, 28, 28]  # the 7 full prefix blocks
    st = eng.stats()
    assert st.prefix_cache_hits == 4 * 28 and st.prefix_cache_queries == sum(len(p) for p in prompts) + 32
    if kv_compression is not None:
        assert st.compression.rounds > 0


def test_requests_in_flight_share_blocks_and_aborts_free_them(make_engine):
    eng = make_engine(num_kv_blocks=64)
    eng.generate([PREFIX + [120]], greedy(1), use_tqdm=False)  # caches the prefix
    reqs = [eng.new_request(PREFIX + s, greedy(40), f"r{i}") for i, s in enumerate(SUFFIXES)]
    for r in reqs:
        eng.add_request(r)
    eng.step()
    tables = [r.seqs[0].block_table[:7] for r in reqs]
    assert all(t == tables[0] for t in tables)  # the same 7 physical blocks in every table
    assert all(eng.core.kv.pool.ref_counts[b] == 4 for b in tables[0])
    for _ in range(5):
        eng.step()
    eng.abort("r1")
    eng.abort("r3")
    eng.step()
    assert all(eng.core.kv.pool.ref_counts[b] == 2 for b in tables[0])
    while eng.has_unfinished_requests():
        eng.step()
    assert [r.final.outputs[0].finish_reason for r in reqs] == ["length", "abort", "length", "abort"]
    st = eng.stats()
    assert st.num_free_blocks == st.num_blocks  # cached blocks count as free


def test_cached_prefix_is_evicted_under_pressure_and_recomputed(make_engine):
    eng = make_engine(num_kv_blocks=24, watermark=0)  # 96 slots
    eng.generate([PREFIX + [120]], greedy(1), use_tqdm=False)
    assert eng.core.kv.pool.num_cached == 7
    # 80 fresh tokens: the free stack holds only 24 - 7 = 17 blocks, so 3 of the cached prefix blocks are evicted
    eng.generate([list(range(20, 100))], greedy(1), use_tqdm=False)
    again = eng.generate([PREFIX + [121]], greedy(3), use_tqdm=False)[0]
    assert again.num_cached_tokens < 28
    ref = make_engine(enable_prefix_caching=False).generate([PREFIX + [121]], greedy(3), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.slow
def test_smollm2_shared_long_prefix_same_output_cached_or_not_also_with_kara(smollm2_engine):
    """Four prompts sharing a ~300-token system prompt: the first wave is admitted in one step (nothing cached
    yet), the second takes the whole prefix from the cache; greedy outputs are identical, with and without Kara
    compressing 600+ new tokens."""
    from bench.common import real_text

    eng = smollm2_engine
    text = real_text()
    kara = {"method": "kara", "ratio": 0.3, "window": 128, "buffer": 16, "compression_period": 112}
    for k, (comp, n) in enumerate((("none", 32), (kara, 640))):
        system = eng.encode_prompt(text[5000 * k:5000 * k + 1500])[:300]  # a prefix no earlier request cached
        prompts = [system + eng.encode_prompt(q) for q in
                   [" Summarise the text.", " Who wrote it?", " List three key terms.", " Translate the title."]]
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, kv_compression=comp)
        rounds = eng.stats().compression.rounds
        cold = eng.generate(prompts, params, use_tqdm=False)
        warm = eng.generate(prompts, params, use_tqdm=False)
        assert tokens(cold) == tokens(warm)
        assert all(o.num_cached_tokens == 0 for o in cold)
        assert all(o.num_cached_tokens >= 288 for o in warm)
        if comp != "none":
            assert eng.stats().compression.rounds - rounds >= 8
    eng.check_invariants()


def test_scoring_never_takes_scored_positions_from_the_cache(make_engine):
    eng = make_engine()
    ctx, cont = PREFIX[:10], PREFIX[10:] + [7, 8, 9]
    first = eng.score(ctx, cont, chunk_size=4).prompt_logprobs
    again = eng.score(ctx, cont, chunk_size=4)  # ctx + cont is cached now: only blocks before score_from - 1 hit
    assert again.prompt_logprobs == pytest.approx(first, abs=1e-5) and len(first) == len(cont)
    assert again.num_cached_tokens == 8
