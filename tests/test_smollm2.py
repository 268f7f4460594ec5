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
