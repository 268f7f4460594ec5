"""No single request may change another's output or stall or kill the engine: compression decisions per sequence,
per-request failures delivered to that request only, a dead loop failing everything pending at once, and Kara's
in-engine selection checked end to end against an independent float64 reference."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from engine import EngineDeadError, SamplingParams

KARA = {"method": "kara", "window": 16, "buffer": 4, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 2,
        "compression_period": 12}
OTHERS = [[60 + i, 61 + i, 62 + i] + list(range(70, 70 + 3 * i)) for i in range(8)]


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("params", [
    greedy(60, kv_compression=KARA),
    SamplingParams(temperature=0.8, seed=7, max_tokens=60, ignore_eos=True,
                   kv_compression={**{k: v for k, v in KARA.items() if k != "chunk_max"}, "method": "random"}),
], ids=["kara-greedy", "random-seeded"])
def test_a_request_gives_the_same_output_alone_and_among_eight_others(make_engine, params):
    eng = make_engine(kv_compression=KARA)  # the engine default compresses the others too
    prompt = list(range(10, 30))
    alone = eng.generate([prompt], params, use_tqdm=False)[0]
    rounds_alone = eng.stats().compression.rounds
    # the others start earlier and later, with other lengths: the global step count differs from the run alone
    others = [eng.new_request(p, greedy(20 + 7 * i), f"o{i}") for i, p in enumerate(OTHERS)]
    for r in others[:4]:
        eng.add_request(r)
    for _ in range(5):
        eng.step()
    target = eng.new_request(prompt, params, "target")
    eng.add_request(target)
    for r in others[4:]:
        eng.add_request(r)
    while eng.has_unfinished_requests():
        eng.step()
    assert rounds_alone >= 3 and eng.stats().compression.rounds > 2 * rounds_alone
    assert target.final.outputs[0].token_ids == alone.outputs[0].token_ids


def test_request_compression_period_is_honoured_over_the_engine_default(make_engine):
    eng = make_engine(kv_compression=KARA)  # engine period 12
    eng.generate([list(range(10, 30))], greedy(60), use_tqdm=False)
    default_rounds = eng.stats().compression.rounds
    eng.reset_stats()
    eng.generate([list(range(10, 30))], greedy(60, kv_compression={"compression_period": 36}), use_tqdm=False)
    # period 12: rounds at 16, 28, 40, 52 tokens; period 36: one round at 36 (two windows), the next would be at 72
    assert default_rounds == 4 and eng.stats().compression.rounds == 1
    assert eng.stats().compression.tokens_seen == 24


def test_kara_inside_the_engine_matches_an_independent_float64_reference(make_engine, tiny_hf_llama):
    """r < 1 moves data: every (layer, head) keeps its own slots. A float64 decoder with per-(layer, head) kept
    entries, Kara written plainly, and the engine's per-sequence trigger replayed, must give the same tokens and
    log-probs."""
    from reference_decoder import ReferenceDecoder

    eng = make_engine(kv_compression={**KARA, "query_source": "recompute"})  # the paper's way, as the reference
    prompt = [7, 19, 33, 41, 5, 8, 90, 12, 64, 3, 27, 101, 55, 18, 77, 46, 9, 120, 31, 14]
    N, P = 56, len(prompt)
    out = eng.generate([prompt], greedy(N, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert eng.stats().compression.rounds == 4

    ref = ReferenceDecoder(tiny_hf_llama)
    logits = ref.prefill(prompt)
    tokens, logps = list(prompt), []
    frontier, last, rounds = P, 0, 0
    W, U, n = KARA["window"], KARA["buffer"], KARA["window"] - KARA["buffer"]
    for s in range(N):
        tok = int(logits.argmax())
        logps.append(float(logits.log_softmax(-1)[tok]))
        tokens.append(tok)
        computed = P + s  # after step s (its compression check)
        tail = computed - frontier
        if s - last >= KARA["compression_period"] and tail >= W:
            windows = (tail - U) // n
            ref.compress(tokens, [frontier + j * n for j in range(windows)], W, n, KARA["ratio"],
                         KARA["chunk_max"], KARA["chunk_budget"])
            frontier += windows * n
            last, rounds = s, rounds + 1
        if s < N - 1:
            logits, _ = ref.forward_token(tok, P + s)
    assert rounds == 4
    # heads really keep different slots (otherwise a single mask would do)
    kept = {tuple(ref.kept_positions(li, h)) for li in range(ref.L) for h in range(ref.hkv)}
    assert len(kept) > 1
    assert out.token_ids == tokens[P:]
    got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    assert got == pytest.approx(logps, abs=2e-4)


def test_one_requests_failure_is_delivered_to_it_alone(make_engine, monkeypatch):
    eng = make_engine()
    real = eng.core.output.append_token

    def flaky(seq, token):
        if seq.request_id == "bad" and seq.num_outputs == 3:
            raise RuntimeError("detokenizer exploded")
        return real(seq, token)

    monkeypatch.setattr(eng.core.output, "append_token", flaky)
    bad = eng.new_request([5, 6, 7], greedy(10), "bad")
    good = [eng.new_request([8 + i, 9, 10], greedy(10), f"g{i}") for i in range(3)]
    for r in [bad, *good]:
        eng.add_request(r)
    while eng.has_unfinished_requests():
        eng.step()
    assert isinstance(bad.error, RuntimeError) and bad.done.is_set() and bad.final is None
    assert all(len(r.final.outputs[0].token_ids) == 10 for r in good)
    assert eng.is_healthy()
    st = eng.stats()
    assert st.num_free_blocks == st.num_blocks


def test_a_dead_loop_fails_running_and_queued_requests_at_once(make_engine):
    eng = make_engine()
    gate = threading.Event()

    def boom():
        gate.wait(10)
        raise RuntimeError("simulated device failure")

    eng.core.step = boom
    eng.start()
    results = {}

    async def consume(i):
        try:
            async for _ in eng.stream([5, 6, 7 + i], greedy(5), request_id=f"s{i}"):
                pass
            results[i] = "ok"
        except EngineDeadError as err:
            results[i] = err

    async def main():
        tasks = [asyncio.ensure_future(consume(i)) for i in range(3)]
        await asyncio.sleep(0.2)  # all three are in the inbox or the core when the loop dies
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    t0 = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - t0 < 10
    assert all(isinstance(results[i], EngineDeadError) for i in range(3)), results
    assert not eng.is_healthy()
    with pytest.raises(EngineDeadError):
        eng.generate([[5, 6]], greedy(2), use_tqdm=False)


def test_n_greater_than_one_with_compression(make_engine):
    eng = make_engine(kv_compression=KARA)
    p = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=50, ignore_eos=True)
    out = eng.generate([list(range(10, 30))], p, use_tqdm=False)[0]
    assert [len(o.token_ids) for o in out.outputs] == [50, 50, 50]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    st = eng.stats()
    # the three sequences are due at the same steps (16, 28, 40 tokens): three batched rounds of three windows
    assert st.compression.rounds == 3 and st.compression.tokens_seen == 3 * 3 * 12


def test_prompt_plus_max_tokens_equal_to_max_model_len(make_engine):
    eng = make_engine(max_model_len=32)
    out = eng.generate([list(range(5, 25))], greedy(12), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="maximum context length"):
        eng.generate([list(range(5, 25))], greedy(13), use_tqdm=False)
    # max_tokens omitted: up to the context limit
    out = eng.generate([list(range(5, 25))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


@pytest.mark.parametrize("path", ["decode_stream", "window"])
def test_incremental_detokenization_of_multibyte_characters_and_stop_strings_across_tokens(path):
    """The output processor with a byte-level tokenizer, through tokenizers' DecodeStream and through the windowed
    decode that other tokenizers take: characters split over several tokens appear only once complete, and a stop
    string spanning token boundaries is found and held back from the stream."""
    from transformers import AutoTokenizer

    from engine.output_processor import OutputProcessor
    from engine.sequence import Sequence, SequenceStatus
    from server_fixtures import smollm2_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    text = "naïve café — 日本語 🙂 end STOP tail"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    proc = OutputProcessor(tok, {tok.eos_token_id}, 1000)
    assert proc.backend is not None  # a fast tokenizer without space clean-up: the stream applies
    if path == "window":
        proc.backend = None
    seq = Sequence("r", [1], SamplingParams(max_tokens=100, stop=["STOP"]))
    streamed, finished_at = "", None
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        done = proc.append_token(seq, t)
        if not done:
            delta = proc.completion(seq, delta=True).text
            assert "\ufffd" not in delta
            streamed += delta
        if done:
            finished_at = i
            seq.status = SequenceStatus.FINISHED
            streamed += proc.completion(seq, delta=True).text
            break
    assert finished_at is not None and seq.finish_reason == "stop" and seq.stop_reason == "STOP"
    assert streamed == text[:text.index("STOP")] == seq.detok.text


@pytest.mark.parametrize("path", ["decode_stream", "window"])
def test_detokenization_of_a_sequence_cut_inside_a_character(path):
    """A sequence that ends (here: its length) with a character's bytes half emitted gets the rest of its text at the
    finish, the same on both paths: the tokens' own decode."""
    from transformers import AutoTokenizer

    from engine.output_processor import OutputProcessor
    from engine.sequence import Sequence
    from server_fixtures import smollm2_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    ids = tok("ok 🙂🙂", add_special_tokens=False).input_ids
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    proc = OutputProcessor(tok, set(), 1000)
    if path == "window":
        proc.backend = None
    seq = Sequence("r", [1], SamplingParams(max_tokens=cut))
    for t in ids[:cut]:
        seq.output_token_ids.append(t)
        done = proc.append_token(seq, t)
    assert done and seq.finish_reason == "length"
    assert seq.detok.text == tok.decode(ids[:cut])
