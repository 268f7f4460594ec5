"""Backend selection and the CPU-side parts of the FlashInfer backend (run everywhere, no GPU needed).

The last part drives FlashInferBackend on the CPU through a stand-in `flashinfer` module whose wrappers have
the exact signatures of flashinfer-python 0.7.2.post1 (decode.py / prefill.py) and compute attention from
the CSR page table as FlashInfer documents it. That checks the backend's plumbing (argument names, CSR
inputs, dtypes, K/V writes, scale, causal flag, tensor-core choice, graph buffers) against
TorchPagedBackend; the kernels themselves are checked on a GPU by tests/test_flashinfer_backend.py."""
import math
import sys
from pathlib import Path

import pytest
import torch

from engine.attention import get_backend
from engine.attention.base import AttentionMetadata, build_metadata
from engine.attention.flashinfer import (FLASHINFER_VERSION, FlashInferBackend, graph_decode_inputs, is_available,
                                         needs_tensor_cores, plan_inputs)
from engine.attention.torch_paged import TorchPagedBackend

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_auto_on_cpu_is_the_cpu_kernel_else_torch():
    from engine.attention import cpu_ext

    if cpu_ext.is_available():  # the C++ kernel (tests/test_cpu_attention.py); torch only when it cannot be built
        from engine.attention.cpu_paged import CpuPagedBackend

        assert isinstance(get_backend("auto", "cpu"), CpuPagedBackend)
    else:
        assert isinstance(get_backend("auto", "cpu"), TorchPagedBackend)
    assert isinstance(get_backend("torch", "cpu"), TorchPagedBackend)


def test_flashinfer_on_cpu_device_raises_clear_error():
    with pytest.raises(ValueError, match="CUDA devices only.*--attention-backend torch"):
        get_backend("flashinfer", "cpu")


def test_bad_backend_name():
    with pytest.raises(ValueError, match=r"attention_backend must be one of \['auto', 'cpu', 'torch', 'flashinfer'\]"):
        get_backend("flash", "cpu")


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[cuda\]'"):
        FlashInferBackend("cuda")


@no_cuda
def test_not_available_without_cuda():
    assert not is_available()


def test_pyproject_pins_the_verified_version():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert f"flashinfer-python=={FLASHINFER_VERSION}" in project["optional-dependencies"]["cuda"]


@pytest.mark.parametrize("hq,hkv,expected", [(32, 8, False), (12, 12, False), (24, 8, False), (64, 4, False),
                                             (40, 8, True), (28, 4, True), (96, 8, True), (10, 2, True)])
def test_tensor_core_decode_for_unsupported_group_sizes(hq, hkv, expected):
    assert needs_tensor_cores(hq, hkv) is expected


def test_tensor_core_check_rejects_bad_heads():
    with pytest.raises(ValueError, match="multiple"):
        needs_tensor_cores(10, 3)


# Hand-worked step, block_size 4:
#   A: fresh prefill, 6 tokens      -> pages [7, 2],     last page holds 2
#   B: decode at kv_len 9           -> pages [5, 0, 11], last page holds 1
#   C: 3-token chunk, kv_len 8      -> pages [3, 9],     last page full (4)
#   D: decode at kv_len 1           -> page  [4],        last page holds 1
TABLES = [[7, 2], [5, 0, 11, 6], [3, 9], [4]]  # B's table has a spare block past its kv_len
Q_LENS, KV_LENS = [6, 1, 3, 1], [6, 9, 8, 1]


def test_plan_inputs_hand_worked():
    meta = build_metadata(TABLES, Q_LENS, KV_LENS, block_size=4)
    inp = plan_inputs(meta)
    assert inp["qo_indptr"].tolist() == [0, 6, 7, 10, 11]
    assert inp["kv_indptr"].tolist() == [0, 2, 5, 7, 8]
    assert inp["kv_last_page_len"].tolist() == [2, 1, 4, 1]
    assert inp["kv_lens"].tolist() == [6, 9, 8, 1]
    for t in inp.values():
        assert t.dtype == torch.int32 and t.device.type == "cpu" and not t.is_pinned()
    # the same numbers the metadata's device tensors carry, and the pages they index
    assert torch.equal(inp["qo_indptr"], meta.qo_indptr)
    assert torch.equal(inp["kv_indptr"], meta.kv_indptr)
    assert torch.equal(inp["kv_last_page_len"], meta.kv_last_page_len)
    assert meta.kv_indices.tolist() == [7, 2, 5, 0, 11, 3, 9, 4]
    # query recomputation (write=False) plans exactly like the writing step
    recompute = build_metadata(TABLES, Q_LENS, KV_LENS, block_size=4, write=False)
    assert all(torch.equal(a, b) for a, b in zip(plan_inputs(recompute).values(), inp.values()))


def test_plan_inputs_rejects_bad_lengths():
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(4, empty, empty, empty, empty, empty.long(), q_lens=[3], kv_lens=[2],
                             block_tables=[[0]])
    with pytest.raises(ValueError, match="bad attention lengths"):
        plan_inputs(meta)


def test_graph_decode_inputs_pad_to_the_captured_size():
    tables, kv_lens = [[5, 0, 11], [3, 9], [4]], [9, 8, 1]
    meta = build_metadata(tables, [1, 1, 1], kv_lens, block_size=4)
    inp = graph_decode_inputs(meta, batch_size=5, scratch_block=63)
    assert inp["kv_indptr"].tolist() == [0, 3, 5, 6, 7, 8]
    assert inp["kv_indices"].tolist() == [5, 0, 11, 3, 9, 4, 63, 63]
    assert inp["kv_last_page_len"].tolist() == [1, 4, 1, 1, 1]
    assert inp["write_blocks"].tolist() == [11, 9, 4, 63, 63]
    assert inp["write_offsets"].tolist() == [0, 3, 0, 0, 0]
    assert inp["kv_indptr"].dtype == torch.int32 and inp["write_blocks"].dtype == torch.int64
    # real rows write exactly where the step's slot mapping says
    assert (inp["write_blocks"][:3] * 4 + inp["write_offsets"][:3]).tolist() == meta.slot_mapping.tolist()


def test_graph_decode_inputs_rejects_prefill_and_overflow():
    with pytest.raises(ValueError, match="decode-only"):
        graph_decode_inputs(build_metadata(TABLES, Q_LENS, KV_LENS, 4), 8, scratch_block=63)
    meta = build_metadata([[1], [2], [3]], [1, 1, 1], [2, 2, 2], 4)
    with pytest.raises(ValueError, match="do not fit"):
        graph_decode_inputs(meta, 2, scratch_block=63)


# ---- FlashInferBackend on the CPU through a stand-in flashinfer module --------------------------------------
CORE_GROUPS = {1, 2, 3, 4, 6, 8, 16}


def _dtype(x):
    return getattr(torch, x) if isinstance(x, str) else x


def _csr_attention(q, cache, qo_indptr, kv_indptr, kv_indices, last_page_len, causal, scale):
    """FlashInfer's documented semantics: request i owns pages kv_indices[kv_indptr[i]:kv_indptr[i+1]] (in
    logical order), kv_len = (pages - 1) * page_size + last_page_len; causal is bottom-right aligned."""
    for t in (qo_indptr, kv_indptr, kv_indices, last_page_len):
        assert t.dtype == torch.int32
    page_size, hkv, d = cache.shape[2], cache.shape[3], cache.shape[4]
    g = q.shape[1] // hkv
    out = torch.empty_like(q)
    for i in range(len(last_page_len)):
        pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(last_page_len[i])
        assert 1 <= int(last_page_len[i]) <= page_size
        k = cache[pages, 0].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(g, dim=1)
        v = cache[pages, 1].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(g, dim=1)
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        if causal:
            assert kv_len >= q1 - q0
            allowed = torch.arange(kv_len)[None, :] <= (kv_len - (q1 - q0) + torch.arange(q1 - q0))[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


class FakePrefillWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
                 variant_owns_mask=False):
        assert kv_layout == "NHD" and backend == "fa2" and float_workspace_buffer.dtype == torch.uint8
        self.plans = 0

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False,
             uniform_q_len=None):
        assert pos_encoding_mode == "NONE" and num_qo_heads % num_kv_heads == 0
        self.args = (qo_indptr.cpu(), paged_kv_indptr.cpu(), paged_kv_indices.cpu(), paged_kv_last_page_len.cpu())
        self.causal, self.sm_scale, self.page_size = causal, sm_scale, page_size
        self.q_dtype, self.kv_dtype = _dtype(q_data_type), _dtype(kv_data_type or q_data_type)
        self.plans += 1

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None, window_left=None, sinks=None,
            kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
            uses_spcompress=None):
        if q.dtype != self.q_dtype or paged_kv_cache.dtype != self.kv_dtype:
            raise ValueError("dtype mismatch with plan()")
        assert paged_kv_cache.shape[2] == self.page_size and q.shape[0] == int(self.args[0][-1])
        scale = (self.sm_scale or 1 / math.sqrt(q.shape[-1])) * (q_scale or 1.0)
        return _csr_attention(q, paged_kv_cache, *self.args, self.causal, scale)


class FakeDecodeWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD" and backend == "fa2"
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans = 0

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
             fixed_split_size=None, disable_split_kv=False, q_len_per_req=1, is_causal=None):
        assert pos_encoding_mode == "NONE"
        if not self.use_tensor_cores and num_qo_heads // num_kv_heads not in CORE_GROUPS:
            raise RuntimeError("Unsupported group_size")
        if self.use_cuda_graph:  # copy into the fixed buffers, as FlashInfer does
            ip, ix, lp = self.bufs
            assert len(last_page_len) == len(lp) and len(indices) <= len(ix)
            ip.copy_(indptr), lp.copy_(last_page_len), ix[:len(indices)].copy_(indices)
        else:
            self.bufs = (indptr.clone(), indices.clone(), last_page_len.clone())
        self.sm_scale, self.page_size = sm_scale, page_size
        self.q_dtype, self.kv_dtype = _dtype(q_data_type), _dtype(kv_data_type or q_data_type)
        self.plans += 1

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        if q.dtype != self.q_dtype or paged_kv_cache.dtype != self.kv_dtype:
            raise ValueError("dtype mismatch with plan()")
        ip, ix, lp = self.bufs
        assert q.shape[0] == len(lp), "decode takes one query row per request"
        scale = (self.sm_scale or 1 / math.sqrt(q.shape[-1])) * (q_scale or 1.0)
        qo = torch.arange(len(lp) + 1, dtype=torch.int32)
        return _csr_attention(q, paged_kv_cache, qo, ip, ix, lp, False, scale)


class FakeFlashInfer:
    BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper


@pytest.fixture
def fake_backend(monkeypatch):
    import engine.attention.flashinfer as fimod

    monkeypatch.setattr(fimod, "WORKSPACE_BYTES", 1 << 16)
    backend = FlashInferBackend.__new__(FlashInferBackend)
    backend._setup(FakeFlashInfer(), torch.device("cpu"))
    return backend


def _case(q_lens, prefix, hq, hkv, d=16, bs=4, dtype=torch.float32, seed=0, write=True):
    from helpers_models import PageTable

    g = torch.Generator().manual_seed(seed)
    pages = PageTable(num_blocks=64, block_size=bs, seed=seed)
    for seq, n in prefix.items():
        if n:
            pages.grow(seq, n)
    meta = pages.step(q_lens, write=write)
    t = sum(q_lens.values())
    cache = torch.randn(64, 2, bs, hkv, d, generator=g).to(dtype)
    qkv = [torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)]
    return cache, meta, *qkv


def _compare(backend, cache, meta, q, k, v, hq, hkv, scale=None, tol=1e-5):
    d = q.shape[-1]
    scale = scale or 1 / math.sqrt(d)
    ref_cache, fi_cache = cache.clone(), cache.clone()
    ref = TorchPagedBackend()
    ref.plan(meta, hq, hkv, d, q.dtype)
    expected = ref.forward(q, k, v, ref_cache, meta, scale)
    backend.plan(meta, hq, hkv, d, q.dtype)
    got = backend.forward(q, k, v, fi_cache, meta, scale)
    assert torch.equal(fi_cache, ref_cache)  # the same K/V landed in the same slots
    err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err <= tol, err
    return got


@pytest.mark.parametrize("hq,hkv", [(4, 2), (10, 2), (8, 8)])
def test_fake_mixed_prefill_decode_batch(fake_backend, hq, hkv):
    q_lens = {0: 6, 1: 1, 2: 5, 3: 1, 4: 1, 5: 2}
    prefix = {0: 0, 1: 8, 2: 7, 3: 7, 4: 0, 5: 3}
    _compare(fake_backend, *_case(q_lens, prefix, hq, hkv), hq, hkv)
    assert isinstance(fake_backend._step.wrapper, FakePrefillWrapper) and fake_backend._step.wrapper.causal


@pytest.mark.parametrize("hq,hkv,tensor_cores", [(4, 2, False), (10, 2, True), (14, 2, True), (12, 2, False)])
def test_fake_decode_only_uses_decode_wrapper(fake_backend, hq, hkv, tensor_cores):
    lens = {0: 1, 1: 15, 2: 16, 3: 17, 4: 40}
    _compare(fake_backend, *_case({s: 1 for s in lens}, {s: n - 1 for s, n in lens.items()}, hq, hkv), hq, hkv)
    wrapper = fake_backend._step.wrapper
    assert isinstance(wrapper, FakeDecodeWrapper) and wrapper.use_tensor_cores is tensor_cores


def test_fake_bf16_and_custom_scale(fake_backend):
    q_lens, prefix = {0: 5, 1: 1}, {0: 3, 1: 9}
    _compare(fake_backend, *_case(q_lens, prefix, 4, 2, dtype=torch.bfloat16), 4, 2, scale=0.3, tol=2e-2)


@pytest.mark.parametrize("q_lens", [{0: 4, 1: 3}, {0: 1, 1: 1}])
def test_fake_query_recomputation_without_write(fake_backend, q_lens):
    cache, meta, q, _, _ = _case(q_lens, {0: 9, 1: 6}, 4, 2, write=False)
    assert meta.slot_mapping.numel() == 0
    _compare(fake_backend, cache, meta, q, None, None, 4, 2)
    with pytest.raises(RuntimeError, match="write=False"):
        fake_backend.forward(q, q[:, :2], q[:, :2], cache, meta, 0.25)


def test_fake_plan_once_for_all_layers(fake_backend):
    cache, meta, q, k, v = _case({0: 3, 1: 1}, {0: 2, 1: 5}, 4, 2)
    fake_backend.plan(meta, 4, 2, 16, q.dtype)
    for _ in range(3):
        fake_backend.forward(q, k, v, cache.clone(), meta, 0.25)
    assert fake_backend.prefill_wrapper.plans == 1
    # like TorchPagedBackend, forward() with metadata it was not planned for plans it first
    other = build_metadata([[1]], [1], [1], 4)
    fake_backend.forward(q[:1], k[:1], v[:1], cache, other, 0.25)
    assert fake_backend._step.meta is other and isinstance(fake_backend._step.wrapper, FakeDecodeWrapper)


def test_fake_graph_decode_pads_and_writes_fixed_buffers(fake_backend):
    hq, hkv, d, scratch = 10, 2, 16, 63
    lens = {0: 1, 1: 15, 2: 16}
    cache, meta, q, k, v = _case({s: 1 for s in lens}, {s: n - 1 for s, n in lens.items()}, hq, hkv)
    ref_cache = cache.clone()
    ref = TorchPagedBackend()
    ref.plan(meta, hq, hkv, d, q.dtype)
    expected = ref.forward(q, k, v, ref_cache, meta, 0.25)

    fake_backend.init_cuda_graphs([2, 4, 8], max_pages_per_seq=8, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                  dtype=q.dtype, scratch_block=scratch)
    bs = fake_backend.graph_batch_size_for(meta.num_seqs)
    assert bs == 4 and fake_backend.graph_batch_sizes == [2, 4, 8]
    fake_backend.plan_graph(meta, bs)
    pad = lambda x: torch.cat([x, torch.zeros(bs - len(x), *x.shape[1:], dtype=x.dtype)])  # noqa: E731
    out = fake_backend.forward(pad(q), pad(k), pad(v), cache, meta, 0.25)
    assert out.shape[0] == bs
    assert torch.allclose(out[:3], expected, atol=1e-5)
    ref_cache[scratch] = cache[scratch]  # padding rows wrote only the scratch block
    assert torch.equal(cache, ref_cache)
    with pytest.raises(ValueError, match="no decode graph wrapper"):
        fake_backend.plan_graph(meta, 16)
