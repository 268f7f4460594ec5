"""The whole engine on attention_backend="flashinfer", device="cpu", through the flashinfer test double
(tests/flashinfer_double.py: FlashInfer's plan/run contract checked on every call, attention in float64).

Reference: the same engine with attention_backend="cpu" (the C++ paged kernel, float32). Greedy tokens must be
identical on the tiny Llama (GQA group 2: CUDA-core decode wrapper), a tiny Qwen3 with GQA group 5 (tensor-core
decode wrapper) and SmolLM2, through chunked prefill, prefix-cache hits, swap and recompute preemption, Kara rounds
with compaction (both query sources), lossless mode, structured outputs and tensor_parallel_size=2 (the spawned
worker imports the double too). Every engine checks its allocator invariants after each step and ends with
every block free. Each test also checks that its scenario really happened (hits, preemptions, rounds, ...) and
that the double's wrappers were planned and run.
"""
from __future__ import annotations

import pytest

from conftest import check_every_step
from engine import SamplingParams
from flashinfer_double import flashinfer_double  # noqa: F401 (fixture)
from helpers_models import hard_timeout, make_tiny_hf_model, save_tiny_tokenizer, tp_worker_processes
from server_fixtures import tiny_server_model_dir  # noqa: F401 (fixture)

KARA = dict(method="kara", window=16, buffer=4, ratio=0.25, chunk_max=4, chunk_budget=2, compression_period=12)
PROMPTS = [list(range(10, 30)), [5, 17, 33, 9, 41, 12, 7], list(range(60, 73)), [100, 4, 8, 15, 16, 23, 42]]


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """Tiny random Qwen3 with 10 query heads over 2 KV heads (group 5: FlashInfer decodes it with tensor cores)."""
    path = tmp_path_factory.mktemp("tiny-qwen3-g5")
    make_tiny_hf_model("qwen3", path, seed=1, config_overrides={"num_attention_heads": 10})
    save_tiny_tokenizer(path)
    return path


@pytest.fixture
def models(tiny_llama_dir, tiny_qwen3_dir):
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def build(model, backend, **kw):
    from engine.engine import Engine

    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 256, **kw}
    return check_every_step(Engine(model=str(model), attention_backend=backend, **kw))


def close(eng):
    eng.shutdown()
    eng.check_invariants()
    s = eng.stats()
    assert s.num_free_blocks == s.num_blocks, "KV blocks leaked"


def twins(model, run, **kw):
    """run(engine) on a cpu-backend engine and a flashinfer-backend engine built alike; (outputs, stats) of each."""
    out = {}
    for backend in ("cpu", "flashinfer"):
        eng = build(model, backend, **kw)
        try:
            kind = {"cpu": "CpuPagedBackend", "flashinfer": "FlashInferBackend"}[backend]
            assert type(eng.core.attn).__name__ == kind
            out[backend] = (run(eng), eng.stats())
        finally:
            close(eng)
    return out


def assert_double_used(fd, decode=True, prefill=True):
    kinds = {type(w).__name__ for w in fd.WRAPPERS if w.num_runs}
    assert prefill <= ("BatchPrefillWithPagedKVCacheWrapper" in kinds), kinds
    assert decode <= ("BatchDecodeWithPagedKVCacheWrapper" in kinds), kinds


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_chunked_prefill_and_prefix_cache_hits(flashinfer_double, models, name):
    shared = list(range(40, 62))  # 22 shared tokens: 5 full blocks of 4 cached for the later prompts
    prompts = [shared + [7, 8, 9], shared + [11], shared + list(range(90, 99))]

    def run(eng):
        first = tokens(eng.generate(prompts[:1], greedy(12), use_tqdm=False))
        return first + tokens(eng.generate(prompts[1:] + PROMPTS[:2], greedy(12), use_tqdm=False))

    out = twins(models[name], run, max_num_batched_tokens=16)
    assert out["flashinfer"][0] == out["cpu"][0]
    st = out["flashinfer"][1]
    assert st.prefix_cache_hits >= 40 and st.prompt_tokens_total > 16  # hits, and prompts split into chunks
    assert_double_used(flashinfer_double)
    # the tensor-core decode wrapper for group 5, the CUDA-core one for group 2
    tc = {w.use_tensor_cores for w in flashinfer_double.WRAPPERS if hasattr(w, "use_tensor_cores") and w.num_runs}
    assert tc == {name == "qwen3"}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_in_a_tiny_pool(flashinfer_double, tiny_llama_dir, mode):
    prompts = [list(range(10 + 3 * i, 24 + 3 * i)) for i in range(6)]
    out = twins(tiny_llama_dir, lambda eng: tokens(eng.generate(prompts, greedy(40), use_tqdm=False)),
                num_kv_blocks=24, watermark=0, preemption_mode=mode, swap_space="4MiB",
                compress_before_preempt=False, enable_prefix_caching=False)
    assert out["flashinfer"][0] == out["cpu"][0]
    st = out["flashinfer"][1]
    assert st.num_preemptions > 0 and (st.swapped_in_blocks > 0) == (mode == "swap")
    assert_double_used(flashinfer_double)


@pytest.mark.parametrize("name,source", [("llama", "recompute"), ("qwen3", "cache")])
def test_kara_rounds_with_compaction(flashinfer_double, models, name, source):
    params = greedy(60, kv_compression={**KARA, "query_source": source})
    out = twins(models[name], lambda eng: tokens(eng.generate(PROMPTS, params, use_tqdm=False)), num_kv_blocks=96)
    assert out["flashinfer"][0] == out["cpu"][0]
    st = out["flashinfer"][1]
    assert st.compression.rounds >= 3 and st.compression.blocks_freed > 0
    assert_double_used(flashinfer_double)


def test_swap_of_a_compacted_sequence(flashinfer_double, tiny_llama_dir):
    """Swap out and back in mid-generation after Kara rounds (kv_len < position), then decode on."""
    def run(eng):
        req = eng.new_request(PROMPTS[0], greedy(50, kv_compression=KARA), "a")
        eng.add_request(req)
        seq = req.seqs[0]
        while seq.compression.rounds < 2:
            eng.step()
        assert seq.kv_len < seq.num_computed_tokens
        eng.core.scheduler.preempt(seq, swap=True)
        while eng.has_unfinished_requests():
            eng.step()
        return req.final.outputs[0].token_ids

    out = twins(tiny_llama_dir, run, swap_space="4MiB")
    assert out["flashinfer"][0] == out["cpu"][0] and out["flashinfer"][1].swapped_in_blocks > 0


def test_lossless_mode(flashinfer_double, tiny_llama_dir):
    params = greedy(60, kv_compression={**KARA, "lossless": True})
    out = twins(tiny_llama_dir, lambda eng: tokens(eng.generate(PROMPTS, params, use_tqdm=False)))
    assert out["flashinfer"][0] == out["cpu"][0]
    st = out["flashinfer"][1]
    assert st.compression.rounds > 0 and st.lossless_verifications > 0 and st.lossless_drafted > 0
    assert_double_used(flashinfer_double)


def test_structured_outputs(flashinfer_double, tiny_server_model_dir):  # noqa: F811
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    spec = {"json": schema, "disable_any_whitespace": True}

    def run(eng):
        params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=spec),
                  SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": r"[a-z]{3,8} \d{2}"})]
        outs = eng.generate(["Hello", "Hi there", "Name:"], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]

    out = twins(tiny_server_model_dir, run, max_model_len=256, block_size=16, num_kv_blocks=64)
    assert out["flashinfer"][0] == out["cpu"][0]
    for _, text, reason in out["flashinfer"][0][:2]:
        assert reason == "stop" and set(json.loads(text)) == {"name", "age"}
    assert_double_used(flashinfer_double)


def test_tensor_parallel_2(flashinfer_double, tiny_qwen3_dir):
    """TP=2 on the double (rank 1 is a spawned process that imports it from the inherited sys.path) against the
    cpu backend at TP=1, with Kara rounds: 10 query heads / 2 KV heads split into 5 / 1 per rank."""
    params = greedy(40, kv_compression=KARA)
    run = lambda eng: tokens(eng.generate(PROMPTS[:3], params, use_tqdm=False))  # noqa: E731
    with hard_timeout(240):
        ref = build(tiny_qwen3_dir, "cpu", swap_space=0, lossless_host_memory=0)
        try:
            expected = run(ref)
        finally:
            close(ref)
        eng = build(tiny_qwen3_dir, "flashinfer", tensor_parallel_size=2, swap_space=0, lossless_host_memory=0)
        try:
            got = run(eng)
            assert eng.stats().compression.rounds > 0
        finally:
            close(eng)
    left = tp_worker_processes()
    for p in left:
        p.kill()
    assert not left, f"tensor-parallel workers left running: {left}"
    assert got == expected
    assert_double_used(flashinfer_double)


@pytest.mark.slow
def test_smollm2(flashinfer_double):
    """SmolLM2 loads slowly on the CPU, so ONE engine is built (attention_backend="flashinfer") and the reference
    runs on it after its attention backend is swapped for the cpu one (no prefix caching: nothing is reused)."""
    from engine.attention import get_backend

    prompts = ["The capital of France is", "def fibonacci(n):"]
    eng = build("smollm2", "flashinfer", block_size=16, num_kv_blocks=64, max_model_len=512,
                max_num_batched_tokens=4, enable_prefix_caching=False)  # prompts split into chunks of 4
    try:
        got = tokens(eng.generate(prompts, greedy(16), use_tqdm=False))
        assert_double_used(flashinfer_double)
        eng.core.attn = eng.core.runner.attn = get_backend("cpu", "cpu")
        expected = tokens(eng.generate(prompts, greedy(16), use_tqdm=False))
    finally:
        close(eng)
    assert got == expected


def _off_by_one_last_page_len(meta, t):
    return t - (t > 1).int()  # one slot short wherever the page keeps one


def _off_by_one_last_page_len_in_decodes(meta, t):
    return _off_by_one_last_page_len(meta, t) if meta.is_decode_only else t  # always a valid plan


def _off_by_one_indptr(meta, t):
    t[-1] -= 1
    return t


@pytest.mark.parametrize("key,fn,raises", [("kv_last_page_len", _off_by_one_last_page_len, True),
                                           ("kv_last_page_len", _off_by_one_last_page_len_in_decodes, False),
                                           ("kv_indptr", _off_by_one_indptr, True)],
                         ids=["last-page-len", "last-page-len-decode-only", "indptr"])
def test_an_off_by_one_in_the_backends_plan_breaks_the_identity(flashinfer_double, tiny_llama_dir, monkeypatch,
                                                                 key, fn, raises):
    """The identity above cannot hold by accident: the same run with the plan's CSR arrays off by one fails,
    either refused by the double (a fresh prefill left with fewer KV slots than queries, a CSR that does not end
    at len(indices)) or, where the plan stays valid, with other tokens."""
    import engine.attention.flashinfer as fimod

    real = fimod.plan_inputs

    def corrupted(meta, pin=False):
        inp = real(meta, pin)
        inp[key] = fn(meta, inp[key].clone())
        return inp

    ref = build(tiny_llama_dir, "cpu")
    try:
        expected = tokens(ref.generate(PROMPTS, greedy(12), use_tqdm=False))
    finally:
        close(ref)
    monkeypatch.setattr(fimod, "plan_inputs", corrupted)
    eng = build(tiny_llama_dir, "flashinfer")
    try:
        if raises:
            with pytest.raises(flashinfer_double.ContractError):
                eng.generate(PROMPTS, greedy(12), use_tqdm=False)
        else:
            assert tokens(eng.generate(PROMPTS, greedy(12), use_tqdm=False)) != expected
    finally:
        eng.shutdown()
