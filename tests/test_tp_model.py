"""A TP=2 DecoderLM (2 gloo processes) equals the TP=1 model: tiny random Llama, Qwen2 (q/k/v bias, tied
embeddings) and Qwen3 (q/k norm, tied), a prefill of 3 sequences of different lengths then 16 paged decode steps,
logits within 1e-4. Both ranks use rank 0's block tables (shuffled, non-contiguous); each rank's KV cache must
hold exactly its KV heads of the TP=1 cache, and recomputed queries its query heads.

All three architectures run in ONE spawned 2-rank job (module fixture) to pay process start-up once.
The slow test runs the real SmolLM2 (9 q / 3 KV heads) at TP=3: greedy tokens equal TP=1.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.distributed import TPGroup
from engine.distributed.launch import run_ranks
from engine.loader import load_model
from helpers_models import Runner, TPRunner, make_tiny_hf_model

ARCHS = ["llama", "qwen2", "qwen3"]
# one KV head (MQA) at TP=2: the KV head is replicated, each rank stores it and keeps 2 of the 4 query heads
REPLICATED = "llama-1kv"
CASES = ARCHS + [REPLICATED]
TP = 2
TOL = 1e-4
DECODE_STEPS = 16
PROMPT_LENS = [5, 11, 8]
SUFFIX = {0: 1, 1: 4, 2: 8}  # recompute the queries of the last n tokens of each sequence


def make_inputs(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and teacher-forced decode tokens (random ids, so logits are compared at every step)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]
    decode = [torch.randint(4, 128, (DECODE_STEPS,), generator=g).tolist() for _ in PROMPT_LENS]
    return prompts, decode


def drive(run, prompts, decode) -> tuple[list, torch.Tensor]:
    """Prefill, 16 decode steps, then recompute the queries of a suffix of each sequence. Returns (per-step
    logits dicts, queries); workers (TPRunner on rank > 0) pass no inputs and get None logits."""
    lead = prompts is not None
    steps = []
    chunks = {s: p for s, p in enumerate(prompts)} if lead else None
    positions = {s: list(range(len(p))) for s, p in enumerate(prompts)} if lead else None
    steps.append(run.step(chunks, positions))
    for j in range(DECODE_STEPS):
        if lead:
            chunks = {s: [decode[s][j]] for s in range(len(prompts))}
            positions = {s: [len(prompts[s]) + j] for s in range(len(prompts))}
        steps.append(run.step(chunks, positions))
    if lead:
        full = [p + d for p, d in zip(prompts, decode)]
        chunks = {s: full[s][-n:] for s, n in SUFFIX.items()}
        positions = {s: list(range(len(full[s]) - n, len(full[s]))) for s, n in SUFFIX.items()}
    return steps, run.queries(chunks, positions)


def _load_shard(path: str, config, tp: TPGroup):
    """The loader's HF-directory path minus transformers' AutoConfig (the parent passes the ModelConfig), so the
    workers skip importing transformers."""
    from safetensors.torch import load_file

    from engine.loader import _empty_model, _safetensors_files

    model = _empty_model(config, torch.float32, torch.device("cpu"), tp)
    for file in _safetensors_files(Path(path)):
        model.load_hf_weights(load_file(file).items())
    return model


def model_job(tp: TPGroup, cases: dict, t_spawn: float) -> dict:
    out = {"started_after_s": time.time() - t_spawn}
    t0 = time.perf_counter()
    for arch, (path, config, prompts, decode) in cases.items():
        model = _load_shard(path, config, tp)
        run = TPRunner(model, config, tp, seed=1)
        lead = tp.rank == 0
        steps, queries = drive(run, prompts if lead else None, decode if lead else None)
        out[arch] = {"steps": steps, "queries": queries, "kv": torch.stack(run.caches),
                     "heads": (model.num_local_q_heads, model.num_local_kv_heads)}
    out["run_s"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    cases = {}
    for i, arch in enumerate(CASES):
        path = tmp_path_factory.mktemp(f"tp-{arch}")
        make_tiny_hf_model(arch.split("-")[0], path, seed=10 + i,
                           config_overrides={"num_key_value_heads": 1} if arch == REPLICATED else None)
        model, config, _ = load_model(str(path), torch.float32, "cpu")
        cases[arch] = (str(path), config, *make_inputs(seed=20 + i), model)
    return cases


@pytest.fixture(scope="module")
def tp2(tiny_models):
    t0 = time.perf_counter()
    results = run_ranks(model_job, TP, args=({a: c[:4] for a, c in tiny_models.items()}, time.time()),
                        timeout_s=180)
    print(f"\n2-rank model job ({len(CASES)} models): {time.perf_counter() - t0:.1f} s; ranks up after "
          f"{max(r['started_after_s'] for r in results):.1f} s, ran {max(r['run_s'] for r in results):.1f} s")
    return results


def _max_diff(a, b) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", CASES)
def test_tp2_logits_equal_tp1_prefill_and_16_decode_steps(tiny_models, tp2, arch):
    path, config, prompts, decode, model = tiny_models[arch]
    run = Runner(model, config, seed=1)
    with torch.inference_mode():
        ref_steps, ref_q = drive(run, prompts, decode)
    assert all(len(t) > 2 and t != sorted(t) for t in run.pages.tables.values())  # shuffled, several blocks
    assert tp2[1][arch]["steps"] == [None] * (1 + DECODE_STEPS)  # logits are gathered to rank 0 only
    got = tp2[0][arch]["steps"]
    diffs = [_max_diff(g[s], r[s]) for g, r in zip(got, ref_steps, strict=True) for s in r]
    print(f"{arch}: TP={TP} vs TP=1 max |logit diff| prefill {max(diffs[:3]):.1e}, "
          f"decode {max(diffs[3:]):.1e}")
    assert len(diffs) == 3 * (1 + DECODE_STEPS) and max(diffs) <= TOL

    # each rank: its query heads of the recomputed queries, its KV heads of the cache (same block ids)
    hq = config.num_q_heads // TP
    hkv = max(config.num_kv_heads // TP, 1)
    ref_kv = torch.stack(run.caches)
    for rank in range(TP):
        r = tp2[rank][arch]
        assert r["heads"] == (hq, hkv)
        q_diff = _max_diff(r["queries"], ref_q[:, :, rank * hq:(rank + 1) * hq])
        kv0 = rank * hkv if config.num_kv_heads >= TP else rank * config.num_kv_heads // TP
        kv_ref = ref_kv[..., kv0:kv0 + hkv, :]
        assert torch.equal(r["kv"].isnan(), kv_ref.isnan())  # exactly the same slots written
        kv_diff = (r["kv"] - kv_ref).nan_to_num().abs().max().item()
        print(f"{arch} rank {rank}: queries diff {q_diff:.1e}, KV diff {kv_diff:.1e}")
        assert q_diff <= TOL and kv_diff <= TOL


@pytest.mark.parametrize("rank", range(TP))
def test_sharded_loading_through_the_loader(tiny_models, rank):
    """load_model(tp=...) alone (no process group is needed to load): every parameter of rank `rank` is the slice
    of the TP=1 parameter that an independent head/row computation predicts."""
    path, config, _, _, full = tiny_models["qwen2"]  # q/k/v biases, tied embeddings
    tp = TPGroup(rank=rank, size=TP)
    shard, _, _ = load_model(path, torch.float32, "cpu", tp)
    d, hq, hkv, inter = config.head_dim, config.num_q_heads, config.num_kv_heads, config.intermediate_size
    q, kv = hq * d, hkv * d
    nq, nkv, ni = q // TP, kv // TP, inter // TP

    def rows(t, start, n):
        return t[start:start + n]

    fp, sp = dict(full.named_parameters()), dict(shard.named_parameters())
    for name, p in sp.items():
        f = fp[name]
        if "qkv_proj" in name:
            want = torch.cat([rows(f, rank * nq, nq), rows(f, q + rank * nkv, nkv), rows(f, q + kv + rank * nkv, nkv)])
        elif "gate_up_proj" in name:
            want = torch.cat([rows(f, rank * ni, ni), rows(f, inter + rank * ni, ni)])
        elif "o_proj.weight" in name or "down_proj.weight" in name:
            cols = f.shape[1] // TP
            want = f[:, rank * cols:(rank + 1) * cols]
        elif "embed_tokens" in name:
            want = rows(f, rank * (config.vocab_size // TP), config.vocab_size // TP)
        else:
            want = f  # norms and row-parallel biases are replicated
        assert torch.equal(p, want), name


# ---- the real model ---------------------------------------------------------------------------------------------
SMOL_TP = 3
SMOL_NEW_TOKENS = 64


def greedy(run, prompts: list[list[int]] | None, new_tokens: int, tp: TPGroup | None = None) -> list[list[int]]:
    """Greedy decode of several prompts together; rank 0 (or the TP=1 runner) picks the tokens and, under TP,
    the next step's plan carries them to the workers."""
    lead = tp is None or tp.rank == 0
    outs = [[] for _ in prompts] if lead else None
    chunks = {s: p for s, p in enumerate(prompts)} if lead else None
    positions = {s: list(range(len(p))) for s, p in enumerate(prompts)} if lead else None
    for step in range(new_tokens):
        logits = run.step(chunks, positions)
        if not lead:
            continue
        for s in chunks:
            outs[s].append(int(logits[s][-1].argmax()))
        chunks = {s: [outs[s][-1]] for s in chunks}
        positions = {s: [len(prompts[s]) + step] for s in chunks}
    return outs


def smollm2_job(tp: TPGroup, path: str, prompts) -> dict:
    t0 = time.perf_counter()
    model, config, _ = load_model(path, torch.float32, "cpu", tp)
    t1 = time.perf_counter()
    run = TPRunner(model, config, tp, seed=3, block_size=16, num_blocks=32)
    tokens = greedy(run, prompts if tp.rank == 0 else None, SMOL_NEW_TOKENS, tp)
    return {"tokens": tokens, "load_s": t1 - t0, "decode_s": time.perf_counter() - t1,
            "heads": (model.num_local_q_heads, model.num_local_kv_heads)}


@pytest.mark.slow
def test_smollm2_tp3_greedy_equals_tp1(smollm2_hf, tmp_path):
    """SmolLM2-135M (9 q / 3 KV heads, 30 layers, tied embeddings) at TP=3, one KV head per rank. The GGUF is
    parsed and dequantized once (the session's smollm2_hf fixture) and its weights saved as safetensors, so the
    ranks load in seconds instead of each parsing the GGUF (~20 s apiece, 3 processes on 2 cores)."""
    import json

    from safetensors.torch import save_file

    t0 = time.perf_counter()
    hf_config = smollm2_hf.config.to_dict()
    hf_config.pop("quantization_config", None)  # dequantized already (save_pretrained refuses GGUF models)
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    # tied: lm_head.weight is the embedding (safetensors refuses shared storage; the loader skips it anyway)
    save_file({k: v.contiguous() for k, v in smollm2_hf.state_dict().items() if k != "lm_head.weight"},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, config, _ = load_model(str(tmp_path), torch.float32, "cpu")
    assert (config.num_layers, config.num_q_heads, config.num_kv_heads) == (30, 9, 3)
    from engine.loader import smollm2_gguf_path
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok(chat, add_special_tokens=False).input_ids, tok("The tallest mountain in the world").input_ids]
    run = Runner(model, config, seed=3, block_size=16, num_blocks=32)
    with torch.inference_mode():
        ref = greedy(run, prompts, SMOL_NEW_TOKENS)
    del model, run
    t1 = time.perf_counter()
    results = run_ranks(smollm2_job, SMOL_TP, args=(str(tmp_path), prompts), timeout_s=300, group_timeout_s=240)
    t2 = time.perf_counter()
    r0 = results[0]
    print(f"\nSmolLM2 TP=1 reference {t1 - t0:.1f} s; TP={SMOL_TP} job {t2 - t1:.1f} s (load {r0['load_s']:.1f} s, "
          f"prefill + {SMOL_NEW_TOKENS - 1} decode steps {r0['decode_s']:.1f} s)")
    print(f"TP=1 greedy: {tok.decode(ref[0])!r}")
    assert all(r["heads"] == (3, 1) for r in results)
    assert results[1]["tokens"] is None and results[2]["tokens"] is None
    assert r0["tokens"] == ref
