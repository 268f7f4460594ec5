"""engine.loader: safetensors (single and sharded), error cases, and the real SmolLM2 GGUF."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import load_model
from engine.models import ModelConfig
from helpers_models import Runner, make_tiny_hf_model


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_sharded_safetensors(tmp_path):
    hf = make_tiny_hf_model("qwen3", tmp_path, seed=7, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    model, config, tokenizer = load_model(str(tmp_path), torch.float32, "cpu")
    assert tokenizer is None  # no tokenizer files saved
    assert (config.architecture, config.num_layers, config.num_q_heads, config.num_kv_heads, config.head_dim) == \
        ("Qwen3ForCausalLM", 2, 4, 2, 16)
    ids = [5, 17, 99, 3, 64, 12, 8, 40, 41]
    out = Runner(model, config, seed=7).step({0: ids}, {0: list(range(len(ids)))})[0]
    assert (out - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_bfloat16_load(tmp_path):
    hf = make_tiny_hf_model("llama", tmp_path, seed=8)
    model, config, _ = load_model(str(tmp_path), torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = [5, 17, 99, 3, 64, 12]
    out = Runner(model, config, seed=8, dtype=torch.bfloat16).step({0: ids}, {0: list(range(len(ids)))})[0]
    assert out.dtype == torch.float32
    assert (out - hf_logits(hf, ids)).abs().max().item() < 0.1


@pytest.mark.parametrize("what", ["missing", "empty_dir", "config_only", "text_file"])
def test_not_a_model_raises_value_error(tmp_path, what):
    target = tmp_path / "nope"
    if what == "empty_dir":
        target.mkdir()
    elif what == "config_only":
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    elif what == "text_file":
        target = tmp_path / "notes.txt"
        target.write_text("hello")
    with pytest.raises(ValueError, match="model") as err:
        load_model(str(target), torch.float32, "cpu")
    assert str(target) in str(err.value)


def test_unknown_architecture_is_named():
    hf = SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf(hf)


def test_missing_weight_is_reported(tmp_path):
    make_tiny_hf_model("qwen2", tmp_path, seed=9)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.bias"):
        load_model(str(tmp_path), torch.float32, "cpu")


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2_engine, smollm2_hf):
    model, config, tokenizer = smollm2_engine.model, smollm2_engine.model_config, smollm2_engine.tokenizer
    hf = smollm2_hf
    assert (config.architecture, config.num_layers, config.num_q_heads, config.num_kv_heads, config.head_dim) == \
        ("LlamaForCausalLM", 30, 9, 3, 64)
    assert config.tie_word_embeddings and tokenizer.eos_token_id in config.eos_token_ids
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    run = Runner(model, config, seed=10, block_size=16, num_blocks=16)
    out = run.step({0: ids}, {0: list(range(len(ids)))})[0]
    ref = hf_logits(hf, ids)
    diff = (out - ref).abs().max().item()
    print(f"smollm2 prompt ({len(ids)} tokens) max |logit diff| = {diff:.2e}")
    assert diff <= 1e-3
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
