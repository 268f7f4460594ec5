"""FlashInferBackend vs TorchPagedBackend on a GPU (skipped without CUDA; on a CUDA host without the `cuda` extra
the tests fail, they do not skip).

Everything runs in bf16 with head_dim 128 (so the whole file needs only FlashInfer's batch-prefill and
batch-decode JIT modules for one dtype/head_dim). Closeness is the relative error ||a - b|| / ||b|| <= 2e-2 of
every sequence's rows on its own (a long sequence must not hide a bad short one).
Covered: attention-level mixed prefill + decode batches on shuffled (non-contiguous) pages, decode-only
batches for GQA groups 2 / 5 (tensor-core decode) / 8, query recomputation (write=False), one plan reused
by all layers, a non-default scale; model-level logits of tiny random Llama (group 2) and Qwen3 (group 5)
over several steps; sequences compacted by Kara (kv_len < logical position); and the decode CUDA-graph path.
"""
import importlib.util
import math

import pytest
import torch

from engine.attention.base import build_metadata
from engine.attention.torch_paged import TorchPagedBackend
from helpers_models import PageTable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEVICE = "cuda"
DT = torch.bfloat16
D = 128
TOL = 2e-2


def make_backend():
    from engine.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(DEVICE)


@pytest.fixture(scope="module")
def fi():
    return make_backend()


def test_flashinfer_is_installed_on_cuda_hosts():
    assert importlib.util.find_spec("flashinfer") is not None, (
        "CUDA is available but flashinfer is not installed: install the cuda extra (pip install -e '.[cuda]')")


def rel_err(a: torch.Tensor, b: torch.Tensor, rows: list[int] | None = None) -> float:
    """The worst relative error over the row groups `rows` (one per sequence; the whole tensor if None)."""
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite values"
    if rows is None:
        return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
    assert sum(rows) == a.shape[0]
    return max(rel_err(x, y) for x, y in zip(a.split(rows), b.split(rows)))


# ---- attention level ----------------------------------------------------------------------------------------
def attn_case(q_lens, prefix, hq, hkv, bs=16, seed=0, write=True, num_blocks=256):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = PageTable(num_blocks=num_blocks, block_size=bs, seed=seed)
    for seq, n in prefix.items():
        if n:
            pages.grow(seq, n)
    meta = pages.step(q_lens, device=DEVICE, write=write)
    t = sum(q_lens.values())
    cache = torch.randn(num_blocks, 2, bs, hkv, D, generator=g).to(DEVICE, DT)
    q, k, v = (torch.randn(t, h, D, generator=g).to(DEVICE, DT) for h in (hq, hkv, hkv))
    return cache, meta, q, k, v


def compare_attention(fi, cache, meta, q, k, v, hq, hkv, scale=None):
    scale = scale or 1 / math.sqrt(D)
    ref_cache, fi_cache = cache.clone(), cache.clone()
    ref = TorchPagedBackend()
    ref.plan(meta, hq, hkv, D, DT)
    expected = ref.forward(q, k, v, ref_cache, meta, scale)
    fi.plan(meta, hq, hkv, D, DT)
    got = fi.forward(q, k, v, fi_cache, meta, scale)
    assert got.shape == q.shape and got.dtype == DT
    assert torch.equal(fi_cache, ref_cache), "K/V not written to the same slots"
    err = rel_err(got, expected, meta.q_lens)
    assert err <= TOL, err


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (10, 2), (32, 8)])
def test_mixed_prefill_decode_batch(fi, hq, hkv, bs):
    # fresh prefill; decodes (one on a block boundary, one with kv_len 1); chunks on cached prefixes
    q_lens = {0: 37, 1: 1, 2: 19, 3: 1, 4: 1, 5: 2, 6: 64}
    prefix = {0: 0, 1: 200, 2: 45, 3: 63, 4: 0, 5: 3, 6: 300}
    compare_attention(fi, *attn_case(q_lens, prefix, hq, hkv, bs=bs), hq, hkv)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (10, 2), (32, 4)])
def test_decode_only_batch(fi, hq, hkv):
    lens = [1, 15, 16, 17, 100, 513, 1500, 2048]  # long ones make FlashInfer split the KV
    case = attn_case({s: 1 for s in range(len(lens))}, {s: n - 1 for s, n in enumerate(lens)}, hq, hkv,
                     num_blocks=512)
    compare_attention(fi, *case, hq, hkv)


@pytest.mark.parametrize("q_lens", [{0: 24, 1: 7}, {0: 1, 1: 1}])
def test_query_recomputation_without_write(fi, q_lens):
    cache, meta, q, _, _ = attn_case(q_lens, {0: 90, 1: 30}, 10, 2, write=False)
    compare_attention(fi, cache, meta, q, None, None, 10, 2)


def test_one_plan_serves_every_layer(fi):
    hq, hkv = 8, 2
    cache, meta, q, k, v = attn_case({0: 9, 1: 1, 2: 1}, {0: 20, 1: 33, 2: 7}, hq, hkv)
    layers = [cache.clone(), (cache * 0.5).clone(), cache.flip(0).clone()]
    ref = TorchPagedBackend()
    ref.plan(meta, hq, hkv, D, DT)
    fi.plan(meta, hq, hkv, D, DT)
    for layer in layers:
        expected = ref.forward(q, k, v, layer.clone(), meta, 0.1)
        assert rel_err(fi.forward(q, k, v, layer, meta, 0.1), expected, meta.q_lens) <= TOL  # non-default scale


# ---- model level --------------------------------------------------------------------------------------------
def tiny_config(arch: str, hq: int, hkv: int, layers: int = 3):
    from engine.models.config import ModelConfig

    return ModelConfig(architecture=arch, vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=layers,
                       num_q_heads=hq, num_kv_heads=hkv, head_dim=D, rms_norm_eps=1e-6, rope_theta=10000.0,
                       rope_scaling=None, tie_word_embeddings=arch != "LlamaForCausalLM", attention_bias=False,
                       qk_norm=arch == "Qwen3ForCausalLM", max_position_embeddings=4096)


def tiny_model(config, seed=0):
    from engine.models import build_model

    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.06 * torch.randn_like(p))
    return model.to(DEVICE, DT).eval()


MODELS = {"llama": ("LlamaForCausalLM", 4, 2), "qwen3-gqa5": ("Qwen3ForCausalLM", 10, 2)}


class Twin:
    """One model, one page table, two KV caches: every step runs with the torch backend and FlashInfer."""

    def __init__(self, fi, config, num_blocks=256, block_size=16, seed=0):
        from paging.kv_cache import KVCache

        self.config, self.model = config, tiny_model(config, seed)
        self.pages = PageTable(num_blocks=num_blocks, block_size=block_size, seed=seed)
        self.backends = {"torch": TorchPagedBackend(), "flashinfer": fi}
        self.kv = {name: KVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, D, DT, DEVICE)
                   for name in self.backends}
        self.tokens: dict[int, list[int]] = {}
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self, q_lens: dict[int, int]) -> dict[str, torch.Tensor]:
        """Add q_lens[seq] random tokens to each sequence; logits of every new token from both backends."""
        ids, pos = [], []
        for seq, n in q_lens.items():
            toks = self.tokens.setdefault(seq, [])
            pos.extend(range(len(toks), len(toks) + n))  # logical positions, beyond kv_len once compacted
            new = torch.randint(0, self.config.vocab_size, (n,), generator=self.gen).tolist()
            toks.extend(new)
            ids.extend(new)
        meta = self.pages.step(q_lens, device=DEVICE)
        return self.run(meta, ids, pos)

    def run(self, meta, ids, pos, recompute=False):
        ids = torch.tensor(ids, device=DEVICE)
        pos = torch.tensor(pos, device=DEVICE)
        c, out = self.config, {}
        for name, attn in self.backends.items():
            attn.plan(meta, c.num_q_heads, c.num_kv_heads, D, DT)
            if recompute:
                out[name] = self.model.recompute_queries(ids, pos, self.kv[name].layers, attn, meta)
            else:
                out[name] = self.model.compute_logits(self.model(ids, pos, self.kv[name].layers, attn, meta))
        return out


@pytest.mark.parametrize("name", list(MODELS))
def test_model_logits_prefill_then_mixed_then_decode(fi, name):
    twin = Twin(fi, tiny_config(*MODELS[name]))
    steps = [{0: 37, 1: 20}, {0: 1, 1: 9, 2: 5}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1, 3: 70}, {0: 1, 1: 1, 3: 1}]
    for q_lens in steps:
        logits = twin.step(q_lens)
        err = rel_err(logits["flashinfer"], logits["torch"], list(q_lens.values()))
        assert err <= TOL, (q_lens, err)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_logits_after_kara_compaction(fi, name):
    from compression.base import KVCompressionConfig
    from compression.kara import Kara
    from paging.compaction import compact_sequence

    twin = Twin(fi, tiny_config(*MODELS[name]))
    twin.step({0: 300, 1: 180})
    cfg = KVCompressionConfig(window=128, buffer=16, ratio=0.3, chunk_max=8, chunk_budget=16,
                              compression_period=112)
    kara, bs = Kara(cfg), twin.pages.block_size
    for seq in (0, 1):
        kv_len, w, n = twin.pages.kv_lens[seq], cfg.window, cfg.region_len
        pos0 = len(twin.tokens[seq]) - w  # the window is the newest w tokens (never compacted before)
        meta = twin.pages.step({seq: w}, device=DEVICE, write=False)
        queries = twin.run(meta, twin.tokens[seq][pos0:], list(range(pos0, pos0 + w)), recompute=True)
        assert rel_err(queries["flashinfer"].transpose(0, 1).flatten(1), queries["torch"].transpose(0, 1).flatten(1),
                       [1] * w) <= TOL  # write=False through every layer; every token on its own
        table = twin.pages.tables[seq]
        slots = torch.arange(kv_len - w, kv_len)
        blocks = torch.tensor(table, device=DEVICE)[slots // bs]
        offsets = (slots % bs).to(DEVICE)
        keys = twin.kv["torch"].data[:, blocks, 0, offsets].permute(0, 2, 1, 3)  # [L, Hkv, W, D]
        kept = kara.select(queries["torch"].permute(0, 2, 1, 3), keys, n)  # [L, Hkv, K]
        new_lens = {name: compact_sequence(kv.data, table, kv_len - w, n, kept, kv_len)
                    for name, kv in twin.kv.items()}
        assert new_lens["torch"] == new_lens["flashinfer"] == kv_len - n + kept.shape[-1] < kv_len
        twin.pages.kv_lens[seq] = new_lens["torch"]
    # positions now run ahead of the KV lengths; decode, a chunk on a compacted sequence, a new prefill
    for q_lens in [{0: 1, 1: 1}, {0: 1, 1: 12}, {0: 1, 1: 1, 2: 33}, {0: 1, 1: 1, 2: 1}]:
        logits = twin.step(q_lens)
        assert len(twin.tokens[0]) > twin.pages.kv_lens[0]
        err = rel_err(logits["flashinfer"], logits["torch"], list(q_lens.values()))
        assert err <= TOL, (q_lens, err)


def test_decode_cuda_graph_matches_torch(fi):
    """Capture the model's decode step at batch size 4, replay it for 3 real sequences over several steps."""
    twin = Twin(make_backend(), tiny_config("Qwen3ForCausalLM", 10, 2))  # own backend: graph state
    graph_fi = twin.backends["flashinfer"]
    scratch = twin.pages.free.pop(0)  # a block no sequence will get (PageTable hands out from the end)
    twin.step({0: 40, 1: 17, 2: 5})
    c, bs = twin.config, 4
    graph_fi.init_cuda_graphs([2, bs], max_pages_per_seq=8, num_q_heads=c.num_q_heads,
                              num_kv_heads=c.num_kv_heads, head_dim=D, dtype=DT, scratch_block=scratch)
    ids = torch.zeros(bs, dtype=torch.long, device=DEVICE)
    pos = torch.zeros(bs, dtype=torch.long, device=DEVICE)
    layers = twin.kv["flashinfer"].layers
    graph, hidden = torch.cuda.CUDAGraph(), None
    for step in range(4):
        q_lens = {0: 1, 1: 1, 2: 1}
        new = torch.randint(0, c.vocab_size, (3,), generator=twin.gen).tolist()
        p = [len(twin.tokens[s]) for s in range(3)]
        for s in range(3):
            twin.tokens[s].append(new[s])
        meta = twin.pages.step(q_lens, device=DEVICE)
        assert graph_fi.graph_batch_size_for(meta.num_seqs) == bs
        ref_attn = twin.backends["torch"]
        ref_attn.plan(meta, c.num_q_heads, c.num_kv_heads, D, DT)
        t_ids, t_pos = torch.tensor(new, device=DEVICE), torch.tensor(p, device=DEVICE)
        expected = twin.model.compute_logits(twin.model(t_ids, t_pos, twin.kv["torch"].layers, ref_attn, meta))

        graph_fi.plan_graph(meta, bs)
        ids[:3].copy_(t_ids)
        pos[:3].copy_(t_pos)
        if step == 0:  # warm up on a side stream, then capture (this also computes step 0's K/V twice: same)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                twin.model(ids, pos, layers, graph_fi, meta)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                hidden = twin.model(ids, pos, layers, graph_fi, meta)
        graph.replay()
        got = twin.model.compute_logits(hidden[:3])
        err = rel_err(got, expected, [1, 1, 1])
        assert err <= TOL, (step, err)
    # the eager path still works after graph use
    logits = twin.step({0: 2, 1: 1})
    assert rel_err(logits["flashinfer"], logits["torch"], [2, 1]) <= TOL


def test_engine_on_cuda_end_to_end(tiny_llama_dir):
    """The whole engine on the GPU (FlashInfer picked by 'auto'), with Kara compression and a small pool: greedy
    tokens agree with the same engine on the torch backend (bf16 on both: near-ties may flip late tokens)."""
    from engine import Engine, SamplingParams

    prompts = [list(range(10, 30)), [5, 17, 33, 9, 41, 12, 7]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                            kv_compression={"method": "kara", "window": 16, "buffer": 4, "chunk_max": 4,
                                            "chunk_budget": 2, "compression_period": 12})
    outs = {}
    for backend in ("auto", "torch"):
        eng = Engine(model=str(tiny_llama_dir), device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64,
                     attention_backend=backend)
        assert (type(eng.core.attn).__name__ == "FlashInferBackend") == (backend == "auto")
        outs[backend] = [o.outputs[0].token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
        assert eng.stats().compression.rounds > 0
        eng.check_invariants()
    agree = [sum(x == y for x, y in zip(a, b)) / len(a) for a, b in zip(outs["auto"], outs["torch"])]
    assert outs["auto"][0][:8] == outs["torch"][0][:8] and min(agree) >= 0.5, agree


def test_engine_on_cuda_with_fp8_pages(tiny_llama_dir):
    """fp8 KV pages on the GPU: FlashInfer reads them without row scales (planned with the fp8 kv_data_type), the
    torch backend with a scale per row; both agree with bfloat16 pages on the first greedy tokens."""
    from engine import Engine, SamplingParams

    prompts = [list(range(10, 30)), [5, 17, 33, 9, 41, 12, 7]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    for kv, backend in (("auto", "auto"), ("fp8_e4m3", "auto"), ("fp8_e4m3", "torch")):
        eng = Engine(model=str(tiny_llama_dir), device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64,
                     attention_backend=backend, kv_cache_dtype=kv)
        if kv != "auto":
            data = eng.core.kv_cache.data
            assert data.dtype == torch.float8_e4m3fn
            assert data.shape[-1] == eng.core.model_config.head_dim + (4 if backend == "torch" else 0)
        outs[(kv, backend)] = [o.outputs[0].token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
        eng.check_invariants()
    ref = outs[("auto", "auto")]
    for key in (("fp8_e4m3", "auto"), ("fp8_e4m3", "torch")):
        assert [t[:6] for t in outs[key]] == [t[:6] for t in ref], key
