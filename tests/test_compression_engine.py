"""Compression inside the serving loop: frontier bookkeeping, blocks freed, logical RoPE positions,
invariants under preemption and aborts, and per-request settings."""
import random

import pytest
import torch

from compression import KVCompressionConfig
from engine import SamplingParams
from helpers_engine import run_with_random_aborts

SMALL = dict(window=16, buffer=4, ratio=0.25, chunk_budget=2, compression_period=12)
KARA = dict(SMALL, method="kara", chunk_max=4)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_periodic_rounds_shrink_kv_and_free_blocks(make_engine):
    eng = make_engine(kv_compression=KARA, num_kv_blocks=64)
    prompt = list(range(10, 30))
    cfg = KVCompressionConfig(**KARA)
    out = eng.generate([prompt], greedy(60), use_tqdm=False)[0]
    st = eng.stats()
    assert len(out.outputs[0].token_ids) == 60
    assert st.compression.rounds >= 3
    # every compressed window of n = 12 slots keeps ceil(0.25 * 12) + 2 = 5
    assert cfg.kept_per_window == 5
    assert st.compression.tokens_seen % 12 == 0 and st.compression.tokens_evicted == st.compression.tokens_seen // 12 * 7
    assert st.compression.blocks_freed > 0


def test_kv_len_and_position_diverge_and_prompt_is_untouched(make_engine):
    eng = make_engine(kv_compression=KARA, num_kv_blocks=64)
    prompt = list(range(10, 30))
    req = eng.new_request(prompt, greedy(50), "a")
    eng.add_request(req)
    seq = req.seqs[0]
    seen, snapshot, compared = [], None, 0
    while not req.done.is_set():
        eng.step()
        if seq.is_finished:
            break
        st = seq.compression
        seen.append((seq.num_computed_tokens, seq.kv_len, st.compressed_tokens, st.compressed_kv_len))
        prompt_kv = eng.core.kv_cache.data[:, seq.block_table[:5]]  # prompt slots 0..19
        if snapshot is None:
            snapshot = prompt_kv.clone()
        elif st.compressed_tokens > len(prompt):  # after rounds, while the sequence still holds its blocks
            assert torch.equal(snapshot, prompt_kv)
            compared += 1
    assert compared > 10
    computed, kv_len, ctoks, ckv = seen[-1]
    assert kv_len < computed and ctoks > len(prompt)
    # the frontier only ever advances by whole regions of n = 12 tokens, each leaving 5 slots
    assert (ctoks - len(prompt)) % 12 == 0 and ckv - len(prompt) == (ctoks - len(prompt)) // 12 * 5
    assert kv_len - ckv == computed - ctoks  # the tail after the frontier is uncompressed


def test_new_tokens_use_logical_positions_after_compression(make_engine, tiny_hf_llama):
    """'streaming' keeps the same (newest) region slots in every head, so HF can reproduce the compressed
    cache with a 4D mask hiding the evicted tokens while keeping logical position ids."""
    eng = make_engine(kv_compression={"method": "streaming", **SMALL}, num_kv_blocks=64)
    prompt = list(range(40, 60))
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert eng.stats().compression.rounds >= 2
    tokens = prompt + out.token_ids
    # replay the schedule: step s (s = 0 is the prefill) yields output s and leaves P + s tokens computed; after
    # it a round runs when the sequence has run 12 tokens since its last round and its tail holds a window of 16
    n, keep, buf, P = 12, 5, 4, len(prompt)
    evicted: set[int] = set()
    frontier, last = P, 0
    mask_rows = []  # (query position, evicted positions) for output i
    for i in range(40):
        mask_rows.append((P - 1 + i, set(evicted)))
        tail = P + i - frontier
        if i - last >= 12 and tail >= 16:
            windows = (tail - buf) // n
            for j in range(windows):
                start = frontier + j * n
                evicted.update(range(start, start + n - keep))  # streaming keeps the newest 5 of 12
            frontier += windows * n
            last = i
    assert evicted
    # HF logits for each generated token's position with the evicted keys masked out
    T = len(tokens)
    mask = torch.zeros(1, 1, T, T)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    mask[0, 0][causal] = float("-inf")
    for q, ev in mask_rows:
        for j in ev:
            mask[0, 0, q, j] = float("-inf")
    with torch.no_grad():
        logits = tiny_hf_llama(torch.tensor([tokens]), attention_mask=mask,
                               position_ids=torch.arange(T)[None]).logits[0]
    for step, (q, _) in enumerate(mask_rows):
        tok = out.token_ids[step]
        expected = logits[q].log_softmax(-1)[tok].item()
        assert out.logprobs[step][tok] == pytest.approx(expected, abs=1e-4), f"step {step}"
        assert logits[q].argmax().item() == tok


def test_ratio_one_keeps_outputs_identical(make_engine):
    prompts = [list(range(5, 25)), list(range(60, 70))]
    ref = make_engine().generate(prompts, greedy(70), use_tqdm=False)
    eng = make_engine(kv_compression={**KARA, "ratio": 1.0})
    outs = eng.generate(prompts, greedy(70), use_tqdm=False)
    assert eng.stats().compression.rounds >= 3
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_long_compressed_runs_with_preemption_and_aborts_keep_invariants(make_engine):
    eng = make_engine(kv_compression=KARA, num_kv_blocks=40, watermark=0, max_num_seqs=8)
    # make_engine checks the invariants after every step
    reqs = run_with_random_aborts(eng, random.Random(0), 10, (3, 20), (20, 90), abort_every=17)
    st = eng.stats()
    assert st.compression.rounds > 0 and st.num_preemptions > 0
    assert st.num_free_blocks == st.num_blocks
    for req in reqs:
        o = req.final.outputs[0]
        assert o.finish_reason in ("length", "abort")
        if o.finish_reason == "length":
            assert len(o.token_ids) == req.params.max_tokens


def test_per_request_settings(make_engine):
    eng = make_engine(kv_compression=KARA)
    p = [list(range(5, 25))]
    eng.generate(p, greedy(50, kv_compression="none"), use_tqdm=False)
    assert eng.stats().compression.rounds == 0
    eng.generate(p, greedy(50, kv_compression={**SMALL, "method": "random", "ratio": 0.5}), use_tqdm=False)
    assert eng.stats().compression.rounds > 0
    off = make_engine()
    off.generate(p, greedy(50, kv_compression=KARA), use_tqdm=False)
    assert off.stats().compression.rounds > 0
    with pytest.raises(ValueError, match="window"):  # a rule between fields: checked once merged with the engine's
        eng.generate(p, greedy(5, kv_compression={"method": "kara", "window": 4, "buffer": 8}), use_tqdm=False)
    with pytest.raises(ValueError, match="window"):
        greedy(5, kv_compression={"method": "kara", "window": 1})
    with pytest.raises(ValueError, match="unknown key"):
        greedy(5, kv_compression={"method": "kara", "windw": 4})


def test_threshold_policy_caps_kv_length(make_engine):
    cfg = {"method": "threshold", "threshold_max": 32, "threshold_target": 20, "observation_window": 4}
    eng = make_engine(kv_compression=cfg)
    req = eng.new_request(list(range(5, 15)), greedy(60), "t")
    eng.add_request(req)
    peak, lengths = 0, []
    while not req.done.is_set():
        eng.step()
        if not req.seqs[0].is_finished:
            peak = max(peak, req.seqs[0].kv_len)
            lengths.append(req.seqs[0].kv_len)
    assert peak <= 32 and eng.stats().compression.rounds >= 3
    # every round shrinks the cache from C_max = 32 to exactly N = 20 (and it then grows one slot per step)
    drops = [(a, b) for a, b in zip(lengths, lengths[1:]) if b < a]
    assert len(drops) == eng.stats().compression.rounds and all(b == 20 for _, b in drops)


def test_prompt_compression(make_engine):
    eng = make_engine(kv_compression={**KARA, "compress_prompt": True})
    req = eng.new_request(list(range(4, 44)), greedy(2), "p")  # 40-token prompt: (40 - 4) // 12 = 3 windows
    eng.add_request(req)
    eng.step()  # prefill + first token, then the prompt's windows are compressed
    seq = req.seqs[0]
    assert seq.compression.compressed_tokens == 36 and seq.kv_len == 40 - 36 + 3 * 5
    while not req.done.is_set():
        eng.step()


@pytest.mark.parametrize("method,source,recomputes", [("kara", "recompute", True), ("kara", "cache", False),
                                                      ("streaming", "recompute", False),
                                                      ("random", "recompute", False)])
def test_query_recomputation_only_for_selectors_that_use_queries(make_engine, monkeypatch, method, source,
                                                                 recomputes):
    cfg = KARA if method == "kara" else {"method": method, **SMALL}
    eng = make_engine(kv_compression={**cfg, "query_source": source}, num_kv_blocks=64)
    calls = []
    real = eng.core.runner.recompute_queries
    monkeypatch.setattr(eng.core.runner, "recompute_queries", lambda spans: calls.append(len(spans)) or real(spans))
    eng.generate([list(range(10, 30))], greedy(40), use_tqdm=False)
    st = eng.stats()
    assert st.compression.rounds >= 2 and st.compression.tokens_evicted == st.compression.tokens_seen // 12 * 7
    assert bool(calls) == recomputes
    if method == "kara":  # the window tokens' queries come from one place or the other
        assert (st.compression.queries_cached > 0) == (source == "cache") and (st.compression.queries_recomputed > 0) == recomputes


def _preempt_and_reprefill(eng, seq):
    """Force a recompute preemption of `seq`, then step until its re-prefill completed."""
    eng.core.scheduler.preempt(seq, swap=False)  # recompute (swap would keep the cache)
    assert seq.compression.pending and seq.kv_len == 0 and seq.block_table == []
    rounds = eng.stats().compression.rounds
    while seq.num_pending_tokens > 1:  # the re-prefill of prompt + outputs
        eng.step()
    # the step that completed the re-prefill ran a round for it: every full window of the recomputed outputs
    assert eng.stats().compression.rounds == rounds + 1 and not seq.compression.pending
    st = seq.compression
    tail = seq.num_computed_tokens - 20
    assert st.compressed_tokens - 20 == (tail - 4) // 12 * 12 > 0
    assert seq.kv_len == 20 + (st.compressed_tokens - 20) // 12 * 5 + st.tail(seq.num_computed_tokens)


def test_preempted_compressed_sequence_is_compressed_again_right_after_its_reprefill(make_engine):
    eng = make_engine(kv_compression=KARA, num_kv_blocks=64)
    req = eng.new_request(list(range(10, 30)), greedy(90), "a")
    eng.add_request(req)
    seq = req.seqs[0]
    while seq.compression.compressed_tokens == seq.compression.start:
        eng.step()
    outputs_before = seq.num_outputs
    _preempt_and_reprefill(eng, seq)
    assert seq.num_outputs >= outputs_before
    for _ in range(3):
        eng.step()
    # a second preemption must keep the "was compressed" flag (it used to be derived from the reset frontier)
    _preempt_and_reprefill(eng, seq)
    assert seq.num_preemptions == 2
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    assert len(req.final.outputs[0].token_ids) == 90 and st.num_free_blocks == st.num_blocks
