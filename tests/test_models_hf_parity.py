"""DecoderLM (loaded from a saved tiny HF model) vs HF transformers, fp32, through a real paged cache."""
import importlib

import pytest
import torch

from engine.loader import load_model
from helpers_models import Runner, make_tiny_hf_model, save_tiny_tokenizer

ARCHS = ["llama", "qwen2", "qwen3"]
HF_MODULES = {"llama": "transformers.models.llama.modeling_llama",
              "qwen2": "transformers.models.qwen2.modeling_qwen2",
              "qwen3": "transformers.models.qwen3.modeling_qwen3"}
TOL = 1e-4


def _kernels_available() -> bool:
    from engine.attention import cpu_ext

    return cpu_ext.is_available()


# "torch": torch ops and the torch attention backend (the reference path); "cpu": the engine's CPU path, the C++
# layer ops (engine/models/layer_ops.py) and the C++ paged-attention kernel
@pytest.fixture(scope="module", params=[(a, k) for k in ("torch", "cpu") for a in ARCHS], ids=lambda p: "-".join(p))
def tiny(request, tmp_path_factory):
    arch, kernels = request.param
    if kernels == "cpu" and not _kernels_available():
        pytest.skip("C++ extension unavailable")
    path = tmp_path_factory.mktemp(arch)
    hf = make_tiny_hf_model(arch, path, seed=ARCHS.index(arch))
    save_tiny_tokenizer(path)
    model, config, tokenizer = load_model(str(path), torch.float32, "cpu")
    assert config.architecture == hf.config.architectures[0]
    assert tokenizer is not None and tokenizer.eos_token_id in config.eos_token_ids
    attn = None
    if kernels == "cpu":
        from engine.attention.cpu_paged import CpuPagedBackend
        from engine.models.layer_ops import CpuLayerOps

        model.set_layer_ops(CpuLayerOps())
        attn = CpuPagedBackend()
    return arch, hf, model, config, attn


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation (full recompute each step) and its logits at every position [len, V]."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens, hf(torch.tensor([tokens])).logits[0].float()


def prompts(n_seqs=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 11, 8, 14][:n_seqs]
    return [torch.randint(4, 128, (n,), generator=g).tolist() for n in lens]


def max_diff(a, b):
    return (a - b).abs().max().item()


def test_prefill_then_16_decode_steps_match_hf(tiny):
    arch, hf, model, config, attn = tiny
    steps = 16
    ps = prompts()
    refs = [hf_greedy(hf, p, steps) for p in ps]
    run = Runner(model, config, seed=1, attn=attn)
    diffs = []
    out = run.step({s: p for s, p in enumerate(ps)}, {s: list(range(len(p))) for s, p in enumerate(ps)})
    for s, (tokens, ref) in enumerate(refs):
        diffs.append(max_diff(out[s], ref[: len(ps[s])]))
    for j in range(steps):
        chunks, positions = {}, {}
        for s, (tokens, _) in enumerate(refs):
            p = len(ps[s]) + j  # feed HF's greedy token at position p
            chunks[s], positions[s] = [tokens[p]], [p]
        out = run.step(chunks, positions)
        for s, (tokens, ref) in enumerate(refs):
            diffs.append(max_diff(out[s][0], ref[positions[s][0]]))
    # the block tables really are non-contiguous and longer than one block
    assert all(len(t) > 2 and t != sorted(t) for t in run.pages.tables.values())
    print(f"{arch}: max |logit diff| over prefill + {steps} decode steps = {max(diffs):.2e}")
    assert max(diffs) <= TOL


def test_chunked_prefill_mixed_with_decode_matches_hf(tiny):
    arch, hf, model, config, attn = tiny
    ps = prompts(4, seed=2)
    toks, refs = zip(*(hf_greedy(hf, p, 4) for p in ps))
    run = Runner(model, config, seed=2, attn=attn)
    done = [0] * 4
    schedule = [{0: 5, 1: 6}, {0: 1, 1: 5, 2: 3}, {0: 1, 1: 1, 2: 5, 3: 14}, {3: 1, 2: 1, 1: 1, 0: 1}]
    diffs = []
    for plan in schedule:
        chunks = {s: toks[s][done[s]:done[s] + n] for s, n in plan.items()}
        positions = {s: list(range(done[s], done[s] + n)) for s, n in plan.items()}
        out = run.step(chunks, positions)
        for s, n in plan.items():
            diffs.append(max_diff(out[s], refs[s][done[s]:done[s] + n]))
            done[s] += n
    print(f"{arch}: chunked/mixed max |logit diff| = {max(diffs):.2e}")
    assert max(diffs) <= TOL


def hf_queries(arch, hf, ids, positions) -> torch.Tensor:
    """Post-RoPE queries [L, S, Hq, D] captured inside HF's attention (apply_rotary_pos_emb patched)."""
    mod = importlib.import_module(HF_MODULES[arch])
    original, captured = mod.apply_rotary_pos_emb, []

    def recording(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = original(q, k, cos, sin, *args, **kwargs)
        captured.append(q_embed[0].transpose(0, 1))
        return q_embed, k_embed

    mod.apply_rotary_pos_emb = recording
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0]
    finally:
        mod.apply_rotary_pos_emb = original
    return torch.stack(captured), logits


def test_logical_positions_beyond_kv_slots(tiny):
    """Positions with a gap (as after compression): token at position p is rotated by p although its KV slot
    is smaller; logits and recomputed queries match HF run with the same position_ids."""
    arch, hf, model, config, attn = tiny
    ids = prompts(1, seed=3)[0] + [7, 9, 11]  # 8 tokens
    positions = [0, 1, 2, 3, 40, 41, 42, 43]
    ref_q, ref_logits = hf_queries(arch, hf, ids, positions)
    run = Runner(model, config, seed=3, attn=attn)
    out = run.step({0: ids[:6]}, {0: positions[:6]})[0]  # prefill slots 0..5
    out2 = run.step({0: ids[6:]}, {0: positions[6:]})[0]  # chunk at slots 6..7, positions 42, 43
    assert max_diff(torch.cat([out, out2]), ref_logits) <= TOL
    assert run.pages.kv_lens[0] == 8 < positions[-1]
    # recompute queries of the last 3 tokens (slots 5..7, positions 41..43), nothing written
    before = [c.clone() for c in run.caches]
    q = run.queries({0: ids[5:]}, {0: positions[5:]})
    assert q.shape == (config.num_layers, 3, config.num_q_heads, config.head_dim)
    for a, b in zip(before, run.caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    print(f"{arch}: position-gap logits diff {max_diff(torch.cat([out, out2]), ref_logits):.2e}, "
          f"queries diff {max_diff(q, ref_q[:, 5:]):.2e}")
    assert max_diff(q, ref_q[:, 5:]) <= TOL


def test_recompute_queries_batched_matches_hf(tiny):
    """Several sequences in the cache; recompute a suffix of each (different lengths, one full sequence)."""
    arch, hf, model, config, attn = tiny
    ps = prompts(3, seed=4)
    run = Runner(model, config, seed=4, attn=attn)
    run.step({s: p for s, p in enumerate(ps)}, {s: list(range(len(p))) for s, p in enumerate(ps)})
    suffix = {0: 1, 1: 4, 2: len(ps[2])}
    q = run.queries({s: ps[s][-n:] for s, n in suffix.items()},
                    {s: list(range(len(ps[s]) - n, len(ps[s]))) for s, n in suffix.items()})
    ref = torch.cat([hf_queries(arch, hf, ps[s], list(range(len(ps[s]))))[0][:, -n:] for s, n in suffix.items()],
                    dim=1)
    assert q.shape == ref.shape
    print(f"{arch}: recompute_queries max diff {max_diff(q, ref):.2e}")
    assert max_diff(q, ref) <= TOL
