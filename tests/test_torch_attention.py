"""TorchPagedBackend vs a plain dense float64 reference."""
import math

import pytest
import torch

from engine.attention.base import build_metadata
from engine.attention.torch_paged import TorchPagedBackend
from helpers_models import PageTable, new_kv_cache


def reference(q, kv_cache, meta, scale):
    """Loop over sequences; K/V from the slot list; query i attends slots [0, kv_len - q_len + i]."""
    q, cache = q.double(), kv_cache.double()
    bs, hq, hkv = meta.block_size, q.shape[1], kv_cache.shape[3]
    out = torch.zeros_like(q)
    start = 0
    for table, q_len, kv_len in zip(meta.block_tables, meta.q_lens, meta.kv_lens):
        slots = [(table[p // bs], p % bs) for p in range(kv_len)]
        k = torch.stack([cache[b, 0, o] for b, o in slots])  # [kv_len, Hkv, D]
        v = torch.stack([cache[b, 1, o] for b, o in slots])
        for i in range(q_len):
            n = kv_len - q_len + i + 1
            for h in range(hq):
                kh = h * hkv // hq
                w = torch.softmax(k[:n, kh] @ q[start + i, h] * scale, dim=0)
                out[start + i, h] = w @ v[:n, kh]
        start += q_len
    return out




def make_case(q_lens, kv_prefix, hq=4, hkv=2, d=16, bs=4, dtype=torch.float32, seed=0):
    """Cache with random contents for each sequence's cached prefix, plus the step's new q/k/v."""
    g = torch.Generator().manual_seed(seed)
    pages = PageTable(num_blocks=64, block_size=bs, seed=seed)
    cache = torch.randn(64, 2, bs, hkv, d, generator=g).to(dtype)
    for seq, n in kv_prefix.items():
        if n:
            pages.grow(seq, n)
    meta = pages.step(q_lens)
    t = sum(q_lens.values())
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    return cache, meta, q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (3, 3)])
def test_mixed_batch_matches_reference(dtype, tol, hq, hkv):
    # seq 0: fresh prefill; 1: decode (kv 9); 2: chunk of 5 on a cached prefix of 7; 3: decode at a block
    # boundary; 4: decode with kv_len 1; 5: 2-token chunk.
    q_lens = {0: 6, 1: 1, 2: 5, 3: 1, 4: 1, 5: 2}
    prefix = {0: 0, 1: 8, 2: 7, 3: 7, 4: 0, 5: 3}
    cache, meta, q, k, v = make_case(q_lens, prefix, hq=hq, hkv=hkv, dtype=dtype)
    backend = TorchPagedBackend()
    backend.plan(meta, hq, hkv, 16, dtype)
    out = backend.forward(q, k, v, cache, meta, 1 / math.sqrt(16))
    assert out.dtype == dtype and out.shape == q.shape
    # the new K/V landed at the slot mapping
    blocks, offs = meta.slot_mapping // 4, meta.slot_mapping % 4
    assert torch.equal(cache[blocks, 0, offs], k) and torch.equal(cache[blocks, 1, offs], v)
    ref = reference(q, cache, meta, 1 / math.sqrt(16))
    assert (out.double() - ref).abs().max().item() < tol


def test_block_ids_are_non_contiguous():
    _, meta, *_ = make_case({0: 9, 1: 1}, {0: 0, 1: 12})
    for table in meta.block_tables:
        assert table != list(range(table[0], table[0] + len(table)))


def test_decode_only_large_batch_and_plan_reuse_across_layers():
    hq, hkv, d, bs = 8, 2, 32, 16
    g = torch.Generator().manual_seed(1)
    pages = PageTable(num_blocks=128, block_size=bs, seed=1)
    lens = [1, 15, 16, 17, 40, 64, 100, 3]
    for s, n in enumerate(lens):
        pages.grow(s, n - 1)
    meta = pages.step({s: 1 for s in range(len(lens))})
    assert meta.is_decode_only
    caches = [torch.randn(128, 2, bs, hkv, d, generator=g) for _ in range(2)]
    backend = TorchPagedBackend()
    backend.plan(meta, hq, hkv, d, torch.float32)
    for cache in caches:  # one plan, several layers
        q, k, v = (torch.randn(len(lens), h, d, generator=g) for h in (hq, hkv, hkv))
        out = backend.forward(q, k, v, cache, meta, 0.2)
        assert (out.double() - reference(q, cache, meta, 0.2)).abs().max().item() < 1e-5


def test_decode_tokens_not_contiguous_in_batch():
    # decodes interleaved with prefills: the decode outputs are scattered back to their token rows
    q_lens = {0: 1, 1: 4, 2: 1, 3: 3, 4: 1}
    prefix = {0: 5, 1: 2, 2: 11, 3: 0, 4: 1}
    cache, meta, q, k, v = make_case(q_lens, prefix, dtype=torch.float64, seed=3)
    backend = TorchPagedBackend()
    backend.plan(meta, 4, 2, 16, torch.float64)
    out = backend.forward(q, k, v, cache, meta, 0.25)
    assert (out - reference(q, cache, meta, 0.25)).abs().max().item() < 1e-10


def test_no_write_path_uses_cached_kv():
    """write=False (query recomputation): the tokens' K/V are already cached; nothing is written."""
    g = torch.Generator().manual_seed(4)
    pages = PageTable(num_blocks=32, block_size=4, seed=4)
    for s, n in enumerate([9, 6, 13]):
        pages.grow(s, n)
    cache = torch.randn(32, 2, 4, 2, 16, generator=g, dtype=torch.float64)
    before = cache.clone()
    meta = pages.step({0: 3, 1: 1, 2: 13}, write=False)
    assert meta.slot_mapping.numel() == 0 and meta.kv_lens == [9, 6, 13]
    q = torch.randn(17, 4, 16, generator=g, dtype=torch.float64)
    backend = TorchPagedBackend()
    backend.plan(meta, 4, 2, 16, torch.float64)
    out = backend.forward(q, None, None, cache, meta, 0.25)
    assert torch.equal(cache, before)
    assert (out - reference(q, cache, meta, 0.25)).abs().max().item() < 1e-10


def test_bfloat16_close_to_reference():
    q_lens = {0: 7, 1: 1, 2: 1}
    cache, meta, q, k, v = make_case(q_lens, {0: 2, 1: 30, 2: 5}, dtype=torch.bfloat16, seed=5)
    backend = TorchPagedBackend()
    backend.plan(meta, 4, 2, 16, torch.bfloat16)
    out = backend.forward(q, k, v, cache, meta, 0.25)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference(q, cache, meta, 0.25)).abs().max().item() < 2e-2


def test_forward_replans_for_new_metadata():
    cache, meta, q, k, v = make_case({0: 3, 1: 1}, {0: 0, 1: 4}, dtype=torch.float64, seed=6)
    backend = TorchPagedBackend()
    backend.plan(build_metadata([[0]], [1], [1], 4), 4, 2, 16, torch.float64)  # a stale plan
    out = backend.forward(q, k, v, cache, meta, 0.25)
    assert (out - reference(q, cache, meta, 0.25)).abs().max().item() < 1e-10


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_matches_reference(dtype, tol):
    q_lens = {0: 6, 1: 1, 2: 5, 3: 1, 4: 1, 5: 2}
    prefix = {0: 0, 1: 8, 2: 7, 3: 7, 4: 0, 5: 3}
    cache, meta, q, k, v = make_case(q_lens, prefix, hq=6, hkv=2, dtype=dtype)
    pages = PageTable(num_blocks=64, block_size=4, seed=0)  # same allocation as make_case, on the GPU
    for seq, n in prefix.items():
        if n:
            pages.grow(seq, n)
    meta_cuda = pages.step(q_lens, device="cuda")
    cache_cuda = cache.cuda()
    backend = TorchPagedBackend()
    backend.plan(meta_cuda, 6, 2, 16, dtype)
    out = backend.forward(q.cuda(), k.cuda(), v.cuda(), cache_cuda, meta_cuda, 0.25).cpu()
    backend.plan(meta, 6, 2, 16, dtype)
    backend.forward(q, k, v, cache, meta, 0.25)  # writes the same K/V on the CPU copy for the reference
    assert torch.equal(cache_cuda.cpu(), cache)
    assert (out.double() - reference(q, cache, meta, 0.25)).abs().max().item() < tol
