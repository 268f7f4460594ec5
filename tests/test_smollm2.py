"""Real SmolLM2-135M-Instruct weights (fp32): kvllm's batched greedy output equals HF `generate`."""
import pytest

from conftest import hf_greedy
from engine import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a short poem about the sea:\n",
    "Question: What is 12 times 7?\nAnswer:",
]


def test_greedy_matches_hf_generate_with_four_prompts_batched(smollm2_engine, smollm2_hf):
    eng = smollm2_engine
    ids = [eng.encode_prompt(p) for p in PROMPTS]
    outs = eng.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(smollm2_hf, prompt_ids, 32)
    eng.check_invariants()


def test_chat_template_and_eos(smollm2_engine):
    out = smollm2_engine.chat([{"role": "user", "content": "Say hello."}],
                              SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert "<|im_start|>assistant" in smollm2_engine.tokenizer.decode(out.prompt_token_ids)
    assert out.outputs[0].text.strip()


def test_kara_with_ratio_one_is_lossless_over_many_rounds(smollm2_engine):
    """r = 1 keeps every token, so compaction must be an exact no-op for the model: 320 new tokens with a
    round every 56 steps give several rounds, and the greedy output equals the uncompressed run."""
    eng = smollm2_engine
    prompts = [eng.encode_prompt(PROMPTS[2]), eng.encode_prompt(PROMPTS[0])]
    kara = {"method": "kara", "ratio": 1.0, "window": 64, "buffer": 8, "compression_period": 56}
    base = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=320, ignore_eos=True, kv_compression="none"),
                        use_tqdm=False)
    before = eng.stats().compression.rounds
    comp = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=320, ignore_eos=True, kv_compression=kara),
                        use_tqdm=False)
    assert eng.stats().compression.rounds - before >= 4
    for a, b in zip(base, comp):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    eng.check_invariants()


def test_lossless_kara_equals_uncompressed_output(smollm2_engine):
    """Lossless mode on real weights: 4 prompts, 320 greedy tokens, Kara at r = 0.25 compressing every 56 steps;
    drafts from the compressed cache are verified against the full tier, so the output is the uncompressed one.
    (8 prompts x 1000 tokens on a memory-limited pool, with preemptions and R-KV too: bench/lossless.py's
    "output = none" column.)"""
    eng = smollm2_engine
    prompts = [eng.encode_prompt(p) for p in PROMPTS]
    kara = {"method": "kara", "ratio": 0.25, "window": 64, "buffer": 8, "compression_period": 56,
            "lossless": True}
    params = dict(temperature=0, max_tokens=320, ignore_eos=True)
    ref = eng.generate(prompts, SamplingParams(kv_compression="none", **params), use_tqdm=False)
    eng.reset_stats()
    out = eng.generate(prompts, SamplingParams(kv_compression=kara, **params), use_tqdm=False)
    st = eng.stats()
    assert st.compression.rounds >= 4 and st.lossless_verifications > 0 and st.lossless_drafted > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    eng.check_invariants()
