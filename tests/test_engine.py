"""Engine end to end on a tiny random Llama (fp32): HF parity, preemption, sampling, stops, errors, streaming."""
import asyncio

import pytest
import torch

from conftest import hf_greedy
from engine import SamplingParams

PROMPTS = [[5, 17, 33, 9, 41, 12, 7], [88, 3, 19], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72], [100, 4, 8, 15, 16]]


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_greedy_batch_matches_hf_generate(make_engine, tiny_hf_llama):
    eng = make_engine(max_num_batched_tokens=16)  # prompts get chunked, mixed with decodes
    outs = eng.generate(PROMPTS, greedy(20), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_hf_llama, prompt, 20)
        assert out.outputs[0].finish_reason == "length" and out.finished
        assert out.prompt_token_ids == prompt


def test_preemption_resumes_exactly(make_engine):
    ref = make_engine().generate(PROMPTS, greedy(40), use_tqdm=False)
    # 12 blocks x 4 slots cannot hold 4 sequences of up to 53 tokens: preemption must happen
    eng = make_engine(num_kv_blocks=20, watermark=0)
    outs = eng.generate(PROMPTS, greedy(40), use_tqdm=False)
    assert eng.stats().num_preemptions > 0
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert eng.stats().num_free_blocks == 20


def test_seeded_sampling_is_reproducible_and_independent_of_batch(make_engine):
    eng = make_engine()
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=123, max_tokens=12, ignore_eos=True)
    alone = eng.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    batched = eng.generate(PROMPTS, [p, greedy(12), SamplingParams(temperature=1.0, max_tokens=5), greedy(3)],
                           use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    other = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.9, seed=124, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_top_k_one_equals_greedy(make_engine):
    eng = make_engine()
    a = eng.generate(PROMPTS, greedy(10), use_tqdm=False)
    b = eng.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True, seed=1),
                     use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_sampler_respects_top_p_support():
    from engine.sampler import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.7)
    seen = {sample(logits, [p], [torch.Generator().manual_seed(i)])[0].item() for i in range(200)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 are cut


def test_stop_token_ids_eos_min_tokens_and_stop_strings(make_engine):
    eng = make_engine()
    ids = eng.generate([PROMPTS[1]], greedy(15), use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    out = eng.generate([PROMPTS[1]], greedy(15, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist
    out = eng.generate([PROMPTS[1]], greedy(15, stop_token_ids=[stop_tok], min_tokens=first + 2),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    # EOS ends a sequence unless ignore_eos, and min_tokens masks it too. The random model rarely samples the
    # tokenizer's EOS, so the engine is told that the token at index 5 is an EOS id.
    eng.core.eos_token_ids.add(stop_tok)
    try:
        full = eng.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=15), use_tqdm=False)[0].outputs[0]
        assert full.token_ids == ids[:first + 1] and full.finish_reason == "stop" and full.stop_reason is None
        assert eng.generate([PROMPTS[1]], greedy(15), use_tqdm=False)[0].outputs[0].token_ids == ids  # ignore_eos
        late = eng.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=15, min_tokens=first + 2),
                            use_tqdm=False)[0].outputs[0]
        assert len(late.token_ids) >= first + 2 and stop_tok not in late.token_ids[:first + 2]
    finally:
        eng.core.eos_token_ids.discard(stop_tok)
    # stop strings cut the text (the word-level tokenizer joins words with spaces)
    text = eng.generate([PROMPTS[1]], greedy(15), use_tqdm=False)[0].outputs[0].text
    word = text.split()[3]
    out = eng.generate([PROMPTS[1]], greedy(15, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == text[:text.index(word)]
    out = eng.generate([PROMPTS[1]], greedy(15, stop=word, include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(word) + len(word)]


def test_n_completions_and_logprobs(make_engine, tiny_hf_llama):
    eng = make_engine()
    out = eng.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                                    logprobs=2), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == 6
        assert all(tok in lp for tok, lp in zip(o.token_ids, o.logprobs))
        assert o.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(o.token_ids, o.logprobs)))
        # against HF: the raw model log-probs of the sampled token and of the top 2 at every position
        with torch.no_grad():
            logits = tiny_hf_llama(torch.tensor([PROMPTS[0] + o.token_ids])).logits[0].float()
        logp = logits[len(PROMPTS[0]) - 1:-1].log_softmax(-1)
        for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            assert lp[tok] == pytest.approx(logp[i, tok].item(), abs=1e-4)
            top = logp[i].topk(2)
            for tid, val in zip(top.indices.tolist(), top.values.tolist()):
                assert lp[tid] == pytest.approx(val, abs=1e-4)


def test_bad_arguments_raise_value_error_naming_the_field(make_engine, tiny_llama_dir):
    from engine.engine import Engine

    for kwargs, field in [({"max_tokens": -1}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                          ({"temperature": -1}, "temperature"), ({"n": 0}, "n"), ({"top_k": -5}, "top_k"),
                          ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop"),
                          ({"kv_compression": {"ratio": 2}}, "ratio")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    eng = make_engine(max_model_len=32)
    with pytest.raises(ValueError, match="maximum context length is 32"):
        eng.generate([list(range(4, 30))], greedy(10), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        eng.generate([[]], greedy(3), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        eng.generate([[10_000]], greedy(3), use_tqdm=False)
    with pytest.raises(ValueError, match="model"):
        Engine(model="/nonexistent/model/dir")
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(max_model_len=10_000)
    with pytest.raises(ValueError, match="dtype"):
        make_engine(dtype="int7")
    with pytest.raises(ValueError, match="larger than the KV cache"):
        make_engine(num_kv_blocks=4, max_model_len=64)
    assert make_engine(num_kv_blocks=10).max_model_len == 40  # defaults to what one request can hold
    with pytest.raises(ValueError, match="sampling_params"):
        eng.generate(PROMPTS, [greedy(2)], use_tqdm=False)
    eng.check_invariants()


def test_stream_deltas_concatenate_to_generate_and_abort_frees_blocks(make_engine):
    eng = make_engine()
    ref = eng.generate([PROMPTS[2]], greedy(12), use_tqdm=False)[0].outputs[0]

    async def consume():
        tokens, text, last = [], "", None
        async for out in eng.stream(PROMPTS[2], greedy(12), request_id="s1"):
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            last = out
        return tokens, text, last

    tokens, text, last = asyncio.run(consume())
    assert tokens == ref.token_ids and text == ref.text and last.finished
    assert last.outputs[0].finish_reason == "length"

    async def abandon():
        agen = eng.stream(PROMPTS[0], greedy(200), request_id="s2")
        await agen.__anext__()
        await agen.aclose()  # closing early aborts the request
        for _ in range(100):
            s = eng.stats()
            if s.num_free_blocks == s.num_blocks and not eng.has_unfinished_requests():
                return True
            await asyncio.sleep(0.02)
        return False

    assert asyncio.run(abandon())
    eng.check_invariants()


def test_abort_from_another_thread_finishes_with_abort(make_engine):
    eng = make_engine()
    eng.start()
    req = eng.new_request(PROMPTS[0], greedy(200), "x")
    eng.add_request(req)
    eng.abort("x")
    assert req.done.wait(10)
    assert req.final.outputs[0].finish_reason == "abort"
    eng.check_invariants()


def test_score_matches_hf_teacher_forced_logprobs(make_engine, tiny_hf_llama):
    eng = make_engine()
    ctx, cont = PROMPTS[2], [9, 8, 7, 6, 5, 44, 45, 46, 47, 48, 49, 50]
    out = eng.score(ctx, cont, chunk_size=3)
    with torch.no_grad():
        logits = tiny_hf_llama(torch.tensor([ctx + cont])).logits[0].float()
    logp = logits.log_softmax(-1)
    expected = [logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)]
    assert out.prompt_logprobs == pytest.approx(expected, abs=1e-4)


def test_chat_uses_template(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError, match="chat template"):
        eng.chat([{"role": "user", "content": "w5 w6"}])
    eng.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w9"
    out = eng.chat([{"role": "user", "content": "w5 w6"}], greedy(3), use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 9]


def test_stop_token_id_outside_vocab_is_rejected_and_engine_keeps_serving(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.generate([PROMPTS[0]], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[999_999]),
                     use_tqdm=False)
    assert eng.is_healthy()
    out = eng.generate([PROMPTS[0]], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_prompt_filling_the_pool_runs_and_does_not_block_a_small_request(make_engine):
    # 10 blocks x 4 slots = 40 tokens = max_model_len; watermark 10% = 1 block. A 38-token prompt + 2 new
    # tokens needs every block: it must run (nothing else runs), then the small request behind it.
    eng = make_engine(num_kv_blocks=10, watermark=0.1)
    assert eng.max_model_len == 40
    outs = eng.generate([list(range(4, 42)), PROMPTS[1]], [greedy(2), greedy(3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3]


def test_on_loop_thread_builds_and_steps_the_engine_on_one_thread(make_engine, tiny_llama_dir, monkeypatch):
    import threading

    from engine import engine as engine_mod
    from engine.engine import Engine

    built_on = []
    plain_init = engine_mod.EngineCore.__init__

    def recording_init(self, *a, **kw):
        built_on.append(threading.current_thread())
        plain_init(self, *a, **kw)

    monkeypatch.setattr(engine_mod.EngineCore, "__init__", recording_init)
    ref = make_engine().generate(PROMPTS[:3], greedy(12), use_tqdm=False)
    eng = Engine.on_loop_thread(model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4,
                                num_kv_blocks=256)
    try:
        stepped_on = set()
        step = eng.core.step

        def recording_step():
            stepped_on.add(threading.current_thread())
            out = step()
            eng.core.check_invariants()
            return out

        eng.core.step = recording_step
        outs = eng.generate(PROMPTS[:3], greedy(12), use_tqdm=False)
    finally:
        eng.shutdown()
    eng.check_invariants()
    assert eng.stats().num_free_blocks == eng.stats().num_blocks
    assert built_on[1] is not threading.current_thread() and stepped_on == {built_on[1]}
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_on_loop_thread_raises_a_construction_error_in_the_caller(tiny_llama_dir):
    from engine.engine import Engine

    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine.on_loop_thread(model=str(tiny_llama_dir), device="cpu", max_num_seqs=0)
