"""Shared fixtures: a tiny random Llama saved to disk (with a word-level tokenizer) and engines over it."""
from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: only effective before torch is imported (engine/threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: the server tests run the engine thread beside the test thread, and two OpenMP pools
# on two cores make small matmuls collapse (spin-waiting threads), ~50x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from helpers_models import make_tiny_hf_model, save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf_model("llama", path, seed=0)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def check_every_step(eng):
    """Make `eng` assert the KV manager's invariants (exact block counts and ref counts, no leak once idle) after
    every step it runs, whichever thread drives it."""
    step = eng.core.step

    def checked_step():
        out = step()
        eng.core.check_invariants()
        return out

    eng.core.step = checked_step
    return eng


@pytest.fixture
def make_engine(tiny_llama_dir):
    """Build engines over the tiny model (fp32, CPU). Every engine built here checks its invariants after every
    step, and for leaks after the test."""
    from engine.engine import Engine

    engines = []

    def build(**kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("num_kv_blocks", 256)
        eng = check_every_step(Engine(model=str(tiny_llama_dir), **kwargs))
        engines.append(eng)
        return eng

    yield build
    for eng in engines:
        eng.shutdown()
        eng.check_invariants()
        s = eng.stats()
        assert s.num_free_blocks == s.num_blocks, "KV blocks leaked"


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, never stopping at EOS (like ignore_eos; min_new_tokens would ban EOS instead)."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.max_new_tokens, config.do_sample, config.pad_token_id = max_new_tokens, False, 0
    saved = model.generation_config
    model.generation_config = config
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    finally:
        model.generation_config = saved
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def smollm2_hf():
    """HF transformers' SmolLM2 loaded from the same GGUF (fp32), the independent reference."""
    from transformers import AutoModelForCausalLM

    from engine.loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True).eval()


@pytest.fixture(scope="session")
def smollm2_engine():
    """kvllm's engine on the real SmolLM2 weights in fp32 (shared by the slow tests)."""
    from engine.engine import Engine

    eng = Engine(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=512, max_model_len=2048)
    yield eng
    eng.shutdown()
    eng.check_invariants()
