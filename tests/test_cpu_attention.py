"""The C++ CPU paged-attention kernel (engine/attention/cpu_paged.py) against a dense float64 reference.

The reference below is written out plainly: gather each sequence's K/V slot by slot through its block table,
then for every query token and head a softmax over the slots it may see (query i of q_len attends slots
[0, kv_len - q_len + i]; query head h reads KV head h // (Hq / Hkv)). Every kernel level the CPU has is checked:
AVX-512 (head_dim % 16 == 0, max_isa=2), AVX2 (head_dim % 8 == 0, max_isa=1) and the portable one (forced, and any
head_dim); a level the CPU lacks is skipped. Level 3 (AVX512-BF16 dot products on a bfloat16 cache, q and the
probabilities rounded to bf16) is held to the bound that rounding allows.
"""
import logging
import math
import random
import shutil

import pytest
import torch

from engine.attention import cpu_ext, get_backend
from engine.attention.base import build_metadata
from engine.attention.torch_paged import TorchPagedBackend

if not cpu_ext.is_available():
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here", allow_module_level=True)
    cpu_ext.load()  # a compiler exists, so the build must work: raise its error instead of skipping

from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402

ISA = cpu_ext.load().isa_level()  # 0 portable, 1 AVX2, 2 AVX-512
ATTENTION_ISA = cpu_ext.load().attention_isa_level()  # 3: AVX512-BF16 dot products on a bfloat16 cache
KERNELS = [pytest.param(2, id="avx512", marks=pytest.mark.skipif(ISA < 2, reason="no AVX-512F on this CPU")),
           pytest.param(1, id="avx2", marks=pytest.mark.skipif(ISA < 1, reason="no AVX2 on this CPU")),
           pytest.param(0, id="portable")]


def kernel(level: int) -> CpuPagedBackend:
    """The backend with its kernel capped at `level` (0: the portable loops)."""
    return CpuPagedBackend(max_isa=level)


def reference(q, cache, block_tables, q_lens, kv_lens, scale, causal_shift=0, group=None):
    """Dense float64 attention. causal_shift / group exist only to build deliberately wrong references."""
    q, cache = q.double(), cache.double()
    bs, hq, hkv = cache.shape[2], q.shape[1], cache.shape[3]
    g = hq // hkv
    out = torch.zeros_like(q)
    row = 0
    for table, q_len, kv_len in zip(block_tables, q_lens, kv_lens):
        k = torch.stack([cache[table[p // bs], 0, p % bs] for p in range(kv_len)])  # [kv_len, Hkv, D]
        v = torch.stack([cache[table[p // bs], 1, p % bs] for p in range(kv_len)])
        for i in range(q_len):
            last = kv_len - q_len + i + causal_shift  # last slot this query may see
            n = max(1, min(kv_len, last + 1))
            for h in range(hq):
                kh = h // g if group is None else group(h, hq, hkv)
                w = torch.softmax((k[:n, kh] @ q[row + i, h]) * scale, dim=0)
                out[row + i, h] = w @ v[:n, kh]
        row += q_len
    return out


def make_step(q_lens, prefix, hq, hkv, d, bs, dtype=torch.float32, seed=0, num_blocks=None, write=True):
    """Random pages and q/k/v for one step. Sequence s already holds prefix[s] slots (its 'compressed' cache may be
    far shorter than its logical position: the kernel never sees positions). Block ids are shuffled so tables are
    not contiguous. With write=False the new tokens are the last q_len cached slots (query recomputation)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(prefix[s] + (q_lens[s] if write else 0)) // bs) for s in q_lens)
    num_blocks = num_blocks or need + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, kvs = [], []
    for s in q_lens:
        kv = prefix[s] + (q_lens[s] if write else 0)
        tables.append([free.pop() for _ in range(-(-kv // bs))])
        kvs.append(kv)
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen).to(dtype)
    meta = build_metadata(tables, list(q_lens.values()), kvs, bs, write=write)
    t = sum(q_lens.values())
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    return cache, meta, q, k, v


def run(backend, meta, q, k, v, cache, scale):
    backend.plan(meta, q.shape[1], cache.shape[3], q.shape[2], q.dtype)
    return backend.forward(q, k, v, cache, meta, scale)


def max_err(out, cache, meta, q, scale, **ref_kwargs):
    ref = reference(q, cache, meta.block_tables, meta.q_lens, meta.kv_lens, scale, **ref_kwargs)
    return (out.double() - ref).abs().max().item()


# mixed step: fresh prefill (crosses a 32-slot chunk), decodes (one at kv_len 1, one at a block boundary),
# chunks on top of cached prefixes, a long decode far past its prefill
MIXED_Q = {0: 37, 1: 1, 2: 5, 3: 1, 4: 1, 5: 2, 6: 1, 7: 9}
MIXED_PREFIX = {0: 0, 1: 8, 2: 7, 3: 15, 4: 0, 5: 3, 6: 90, 7: 40}


@pytest.mark.parametrize("level", KERNELS)
@pytest.mark.parametrize("bs", [1, 4, 16])
# head_dim 64 and 128 take the AVX-512 kernel's 16-keys-at-a-time scores; 16 query heads per KV head: row blocks
# of 3 and single rows
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (6, 2, 8), (3, 3, 32), (8, 1, 16), (4, 2, 12),
                                      (6, 2, 128), (16, 1, 64)])
def test_mixed_prefill_and_decode_match_reference(level, bs, hq, hkv, d):
    cache, meta, q, k, v = make_step(MIXED_Q, MIXED_PREFIX, hq, hkv, d, bs, seed=bs + hq)
    out = run(kernel(level), meta, q, k, v, cache, 1 / math.sqrt(d))
    assert out.dtype == q.dtype and out.shape == q.shape
    # the step's K/V landed at the slot mapping before attention read them
    blocks, offs = meta.slot_mapping // bs, meta.slot_mapping % bs
    assert torch.equal(cache[blocks, 0, offs], k) and torch.equal(cache[blocks, 1, offs], v)
    assert max_err(out, cache, meta, q, 1 / math.sqrt(d)) < 1e-5


@pytest.mark.parametrize("level", KERNELS)
def test_q_and_kv_as_views_into_the_qkv_projection(level):
    """The model hands q, k and v as views into one [T, (Hq + 2 Hkv) D] projection output (rows Hq*D + 2 Hkv*D
    apart): the kernel reads q and writes k/v through those strides, with the contiguous copies' result."""
    hq, hkv, d = 9, 3, 16
    cache, meta, q, k, v = make_step(MIXED_Q, MIXED_PREFIX, hq, hkv, d, 4, seed=11)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qv, kv_, vv = (t.view(-1, h, d) for t, h in zip(qkv.split([hq * d, hkv * d, hkv * d], dim=1), (hq, hkv, hkv)))
    assert not qv.is_contiguous() and qv.stride(0) == (hq + 2 * hkv) * d
    strided_cache = cache.clone()
    out = run(kernel(level), meta, qv, kv_, vv, strided_cache, 0.25)
    ref = run(kernel(level), meta, q, k, v, cache, 0.25)
    assert torch.equal(strided_cache, cache) and torch.equal(out, ref)
    assert max_err(out, cache, meta, q, 0.25) < 1e-5


@pytest.mark.parametrize("level", KERNELS)
def test_decode_only_many_sequences(level):
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 257, 3, 500]
    q_lens, prefix = {s: 1 for s in range(len(lens))}, {s: n - 1 for s, n in enumerate(lens)}
    cache, meta, q, k, v = make_step(q_lens, prefix, 9, 3, 64, 16, seed=1)
    assert meta.is_decode_only
    assert max_err(run(kernel(level), meta, q, k, v, cache, 0.125), cache, meta, q,
                   0.125) < 1e-5


@pytest.mark.parametrize("level", KERNELS)
def test_prefill_only_long_and_chunked(level):
    # 70-token prompt (several 8-token query tiles, 3 chunks of slots); a 33-token chunk on 64 cached slots
    cache, meta, q, k, v = make_step({0: 70, 1: 33, 2: 2}, {0: 0, 1: 64, 2: 0}, 6, 2, 32, 4, seed=2)
    assert max_err(run(kernel(level), meta, q, k, v, cache, 0.2), cache, meta, q,
                   0.2) < 1e-5


@pytest.mark.parametrize("seed", range(12))
def test_random_steps(seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 2, 3, 4])
    d, bs = rng.choice([8, 16, 24, 64]), rng.choice([1, 2, 4, 16])
    n = rng.randint(1, 7)
    q_lens = {s: rng.choice([1, 1, rng.randint(1, 40)]) for s in range(n)}
    prefix = {s: rng.choice([0, rng.randint(0, 80)]) for s in range(n)}
    cache, meta, q, k, v = make_step(q_lens, prefix, hq, hkv, d, bs, seed=seed)
    assert max_err(run(CpuPagedBackend(), meta, q, k, v, cache, d ** -0.5), cache, meta, q, d ** -0.5) < 1e-5


@pytest.mark.parametrize("level", KERNELS)
def test_query_recompute_writes_nothing(level):
    """k is None (write=False): the tokens' K/V are already cached; attention reads them and writes nothing."""
    cache, meta, q, _, _ = make_step({0: 3, 1: 1, 2: 13, 3: 40}, {0: 9, 1: 6, 2: 13, 3: 50}, 4, 2, 16, 4,
                                     seed=4, write=False)
    assert meta.slot_mapping.numel() == 0 and meta.kv_lens == [9, 6, 13, 50]
    before = cache.clone()
    out = run(kernel(level), meta, q, None, None, cache, 0.25)
    assert torch.equal(cache, before)
    assert max_err(out, cache, meta, q, 0.25) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_close_to_reference(dtype):
    cache, meta, q, k, v = make_step({0: 7, 1: 1, 2: 1, 3: 20}, {0: 2, 1: 30, 2: 5, 3: 12}, 6, 2, 16, 4,
                                     dtype=dtype, seed=5)
    out = run(CpuPagedBackend(), meta, q, k, v, cache, 0.25)
    assert out.dtype == dtype
    assert max_err(out, cache, meta, q, 0.25) < 2e-2


@pytest.mark.parametrize("level", KERNELS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [16, 64])
def test_half_cache_with_float32_queries(level, kv_dtype, d):
    """A half-precision KV cache read by float32 queries (rows upcast per chunk); the reference sees the same
    half-precision K/V values, so the only error is float32 arithmetic."""
    cache, meta, q, k, v = make_step(MIXED_Q, MIXED_PREFIX, 6, 2, d, 4, seed=12)
    cache = cache.to(kv_dtype)
    out = run(kernel(level), meta, q, k, v, cache, 0.25)
    assert out.dtype == torch.float32
    assert max_err(out, cache, meta, q, 0.25) < 1e-5


needs_bf16_dots = pytest.mark.skipif(ATTENTION_ISA < 3, reason="no AVX512-BF16 on this CPU")


def permuted_columns(d: int) -> list[int]:
    """Where the level-3 kernel accumulates column i before it restores the order (csrc/kvllm_cpu.cpp,
    permuted_column): within each 32 columns, the 16-bit unpacks put column 8L + i (i < 4) at 4L + i and column
    8L + 4 + i at 16 + 4L + i."""
    out = []
    for col in range(d):
        base, rem = col - col % 32, col % 32
        lane, k = rem // 8, rem % 8
        out.append(base + (16 if k >= 4 else 0) + 4 * lane + k % 4)
    return out


@needs_bf16_dots
@pytest.mark.parametrize("bs", [1, 16])
# head_dim 32-128: scores and value sums on bf16 dot products; 96: a 64-column block then a 32-column one; 256:
# float scores (past the unrolled widths), bf16 value sums
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (16, 1, 64), (4, 4, 32), (6, 2, 96), (6, 2, 128), (3, 1, 256)])
def test_bf16_dot_products_within_the_rounding_of_the_probabilities(bs, hq, hkv, d):
    """With q exact in bf16 after the kernel's pre-scale (scale * log2 e = 1/4), the only rounding left is each
    probability's to bf16 (relative <= 2^-9): |out - float64 reference| <= 2^-9 max|v| plus float32 noise."""
    scale = 0.25 / math.log2(math.e)
    cache, meta, q, k, v = make_step(MIXED_Q, MIXED_PREFIX, hq, hkv, d, bs, seed=d + hq)
    cache, q = cache.bfloat16(), q.bfloat16().float()
    out = run(kernel(3), meta, q, k, v, cache, scale)
    bound = 2 ** -9 * cache[:, 1].float().abs().max().item() + 1e-5
    err = max_err(out, cache, meta, q, scale)
    assert err <= bound
    assert not torch.equal(out, run(kernel(2), meta, q, None, None, cache, scale))  # the bf16 path ran
    # the check is not vacuous: the output with its columns permuted as the kernel accumulates them is far off
    wrong = out[..., torch.tensor(permuted_columns(d))]
    assert max_err(wrong, cache, meta, q, scale) > 20 * bound


@needs_bf16_dots
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (6, 2, 128)])
def test_bf16_dot_products_with_any_query(hq, hkv, d):
    """float32 queries as a model gives them (rounded to bf16 inside): within 2e-2 of the float64 reference on
    randn data (the level-2 kernel: 1e-5), over decode rows, prefill tiles and chunk tails."""
    cache, meta, q, k, v = make_step(MIXED_Q, MIXED_PREFIX, hq, hkv, d, 4, seed=3)
    cache = cache.bfloat16()
    out = run(kernel(3), meta, q, k, v, cache, 1 / math.sqrt(d))
    assert max_err(out, cache, meta, q, 1 / math.sqrt(d)) < 2e-2


@needs_bf16_dots
@pytest.mark.parametrize("kv_dtype,d", [(torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 16),
                                        (torch.int8, 16)])
def test_level_3_is_level_2_elsewhere(kv_dtype, d):
    """Only a bfloat16 cache with head_dim % 32 == 0 takes the bf16 dot products (and an int8 one the integer dot
    products, tests/test_kv_8bit.py); other caches and head_dims run the AVX-512 kernel, bit for bit."""
    cache, meta, q, k, v = make_step(MIXED_Q, MIXED_PREFIX, 6, 2, d, 4, seed=4)
    if kv_dtype == torch.int8:
        cache = torch.randint(-127, 128, cache.shape[:-1] + (d + 4,), dtype=torch.int8)
        cache[..., d:] = torch.tensor([0.01], dtype=torch.float32).view(torch.int8)
        k = v = None
    else:
        cache = cache.to(kv_dtype)
    a = run(kernel(3), meta, q, k, v, cache.clone(), 0.25)
    b = run(kernel(2), meta, q, k, v, cache.clone(), 0.25)
    assert torch.equal(a, b)


def test_max_isa_out_of_range_names_the_field():
    cache, meta, q, _, _ = make_step({0: 3}, {0: 9}, 4, 2, 16, 4, seed=8, write=False)
    with pytest.raises(ValueError, match="max_isa must be 0"):
        cpu_ext.load().paged_attention(q, cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                       meta.kv_last_page_len, 0.25, torch.empty_like(q), False, 5)


def test_float64_goes_to_the_torch_backend():
    cache, meta, q, k, v = make_step({0: 5, 1: 1}, {0: 3, 1: 9}, 4, 2, 16, 4, dtype=torch.float64, seed=6)
    out = run(CpuPagedBackend(), meta, q, k, v, cache, 0.25)
    assert out.dtype == torch.float64 and max_err(out, cache, meta, q, 0.25) < 1e-10


def test_the_check_catches_wrong_kernels():
    """The 1e-5 check is not vacuous: references with an off-by-one causal mask (either way) or the wrong GQA head
    mapping are far from the kernel's output on the mixed step."""
    cache, meta, q, k, v = make_step(MIXED_Q, MIXED_PREFIX, 6, 2, 16, 4, seed=7)
    out = run(CpuPagedBackend(), meta, q, k, v, cache, 0.25)
    assert max_err(out, cache, meta, q, 0.25) < 1e-5
    assert max_err(out, cache, meta, q, 0.25, causal_shift=1) > 1e-2
    assert max_err(out, cache, meta, q, 0.25, causal_shift=-1) > 1e-2
    assert max_err(out, cache, meta, q, 0.25, group=lambda h, hq, hkv: h % hkv) > 1e-2


def on_one_then_two_threads(meta, q, k, v, cache, scale):
    """The kernel's output on 1 thread (writing the step's K/V), then on 2 (K/V already written)."""
    backend = CpuPagedBackend()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(backend, meta, q, k, v, cache, scale)
        torch.set_num_threads(2)
        two = run(backend, meta, q, None, None, cache, scale)
    finally:
        torch.set_num_threads(saved)
    return one, two


def test_two_threads_give_the_same_result():
    cache, meta, q, k, v = make_step({s: 1 for s in range(16)} | {16: 30}, {s: 20 + 7 * s for s in range(17)},
                                     9, 3, 64, 16, seed=8)
    one, two = on_one_then_two_threads(meta, q, k, v, cache, 0.125)
    assert torch.equal(one, two)  # every item is computed by one thread in a fixed order


def test_fewer_sequences_than_threads_split_into_heads():
    """One decode sequence on 2 threads: the kernel splits it into one item per KV head (no cache streaming);
    the same per-head arithmetic as the whole-sequence item of 1 thread, and the float64 reference."""
    cache, meta, q, k, v = make_step({0: 1}, {0: 700}, 9, 3, 64, 16, seed=9)
    one, two = on_one_then_two_threads(meta, q, k, v, cache, 0.125)
    assert torch.equal(one, two)
    assert max_err(two, cache, meta, q, 0.125) < 1e-5


def test_plan_reused_over_layers_and_replanned():
    """One plan for all layers of a step; a new step's metadata works without a stale state."""
    backend = CpuPagedBackend()
    for seed in (10, 11):
        caches, meta, q, k, v = [], None, None, None, None
        for layer in range(3):
            cache, meta, q, k, v = make_step({0: 4, 1: 1}, {0: 5 + seed, 1: 17}, 4, 2, 16, 4, seed=seed)
            caches.append((cache, q, k, v))
        backend.plan(meta, 4, 2, 16, torch.float32)
        for cache, q, k, v in caches:
            assert max_err(backend.forward(q, k, v, cache, meta, 0.25), cache, meta, q, 0.25) < 1e-5


def _call(q, cache, meta, out=None, **over):
    args = dict(qo_indptr=meta.qo_indptr, kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices,
                kv_last_page_len=meta.kv_last_page_len)
    args.update(over)
    cpu_ext.load().paged_attention(q, cache, args["qo_indptr"], args["kv_indptr"], args["kv_indices"],
                                   args["kv_last_page_len"], 0.25, torch.empty_like(q) if out is None else out)


def test_bad_inputs_raise_value_errors_naming_the_field():
    cache, meta, q, _, _ = make_step({0: 3, 1: 1}, {0: 2, 1: 5}, 4, 2, 16, 4, seed=9, num_blocks=8)
    _call(q, cache, meta)  # the good call works
    bad_block = meta.kv_indices.clone()
    bad_block[0] = 8
    with pytest.raises(ValueError, match=r"kv_indices\[0\] = 8"):
        _call(q, cache, meta, kv_indices=bad_block)
    with pytest.raises(ValueError, match="kv_indptr must be a contiguous 1-D int32"):
        _call(q, cache, meta, kv_indptr=meta.kv_indptr.long())
    bad_last = meta.kv_last_page_len.clone()
    bad_last[1] = 5
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\] = 5"):
        _call(q, cache, meta, kv_last_page_len=bad_last)
    with pytest.raises(ValueError, match="qo_indptr must run from 0 to the number of query rows"):
        _call(q[:3], cache, meta)
    with pytest.raises(ValueError, match="num_q_heads"):
        _call(q[:, :3].contiguous(), cache, meta)
    with pytest.raises(ValueError, match="head_dim"):
        _call(q[..., :8].contiguous(), cache, meta)
    with pytest.raises(ValueError, match="kv_len 2 < q_len 3"):
        short = build_metadata(meta.block_tables, [3, 1], [3, 6], 4)
        _call(q, cache, short, kv_last_page_len=torch.tensor([2, 2], dtype=torch.int32))
    bad_indptr = meta.kv_indptr.clone()
    bad_indptr[1] = 100  # would point past kv_indices
    with pytest.raises(ValueError, match="non-decreasing"):
        _call(q, cache, meta, kv_indptr=bad_indptr)
    with pytest.raises(ValueError, match="q must be"):
        _call(q.double(), cache, meta)
    with pytest.raises(ValueError, match="heads and head_dim are contiguous"):
        _call(q.transpose(0, 1), cache, meta)
    with pytest.raises(ValueError, match="out must be"):
        _call(q, cache, meta, out=torch.empty(1))


def test_auto_picks_the_kernel_on_cpu():
    assert isinstance(get_backend("auto", "cpu"), CpuPagedBackend)
    assert isinstance(get_backend("cpu", "cpu"), CpuPagedBackend)
    assert isinstance(get_backend("torch", "cpu"), TorchPagedBackend)
    with pytest.raises(ValueError, match="CPU devices only"):
        get_backend("cpu", "meta")


def test_auto_falls_back_to_torch_with_a_warning(monkeypatch, caplog):
    def broken():
        raise cpu_ext.ExtensionUnavailable("no compiler in this test")

    monkeypatch.setattr(cpu_ext, "load", broken)
    with caplog.at_level(logging.WARNING, logger="kvllm.attention"):
        backend = get_backend("auto", "cpu")
    assert isinstance(backend, TorchPagedBackend)
    assert "no compiler in this test" in caplog.text
    with pytest.raises(cpu_ext.ExtensionUnavailable):
        get_backend("cpu", "cpu")  # asked for by name: an error, not a silent fallback


@pytest.mark.parametrize("which", ["kvllm_cpu.cpp", "layer_ops.cpp", "decoder_layers.cpp", "simd.h", "ops.h"])
def test_a_changed_source_never_loads_a_stale_build(tmp_path, monkeypatch, which):
    copies = {}
    for f in cpu_ext.SOURCES + cpu_ext.HEADERS:
        copies[f.name] = tmp_path / f.name
        shutil.copy(f, copies[f.name])
    monkeypatch.setattr(cpu_ext, "SOURCES", [copies[f.name] for f in cpu_ext.SOURCES])
    monkeypatch.setattr(cpu_ext, "HEADERS", [copies[f.name] for f in cpu_ext.HEADERS])
    before = cpu_ext.library_path()
    copies[which].write_text(copies[which].read_text() + "\n// changed\n")
    assert cpu_ext.library_path() != before


def test_a_failed_compile_is_not_retried_by_every_process(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    fake = tmp_path / "fake-cxx"
    fake.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'error: broken on purpose' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("KVLLM_BUILD_DIR", str(tmp_path / "build"))
    with pytest.raises(cpu_ext.ExtensionUnavailable, match="broken on purpose"):
        cpu_ext.build()
    with pytest.raises(cpu_ext.ExtensionUnavailable, match="earlier compile of this source failed"):
        cpu_ext.build()
    assert calls.read_text().count("x") == 1
    with pytest.raises(cpu_ext.ExtensionUnavailable, match="broken on purpose"):
        cpu_ext.build(retry=True)  # what `python -m engine.attention.cpu_ext` (make install) does
    assert calls.read_text().count("x") == 2


def test_a_built_library_is_readable_by_other_users(tmp_path, monkeypatch):
    """The Docker image builds the library as root and serves as another user, who must be able to load it."""
    fake = tmp_path / "fake-cxx"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho built > "$2"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("KVLLM_BUILD_DIR", str(tmp_path / "build"))
    out = cpu_ext.build()
    assert out.read_text() == "built\n"
    assert out.stat().st_mode & 0o777 == 0o755


def test_a_prebuilt_library_loads_without_a_compiler(tmp_path, monkeypatch):
    """The Docker image's runtime stage has the library that `make install` built but no compiler (Dockerfile):
    the same library must be found there, and with no library and no compiler the error says why."""
    monkeypatch.setenv("KVLLM_BUILD_DIR", str(tmp_path))
    with_compiler = cpu_ext.library_path()  # the name the builder stage (which has c++) gives the library
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda name: None)
    assert cpu_ext.compiler() is None
    with pytest.raises(cpu_ext.ExtensionUnavailable, match="no C\\+\\+ compiler"):
        cpu_ext.build()
    with_compiler.write_bytes(b"prebuilt")
    assert cpu_ext.build() == with_compiler


def test_model_with_positions_ahead_of_kv_len_matches_float64():
    """A tiny DecoderLM decoding after 'compaction': RoPE positions run far ahead of the KV slots. The kernel's
    float32 logits match the float64 model on the reference-checked torch backend."""
    from helpers_models import new_kv_cache, tiny_decoder_pair

    c, model64, model32 = tiny_decoder_pair("llama", lambda m: m, std=0.2, dtype=torch.float64)
    bs, nb = 4, 40
    caches64 = new_kv_cache(c.num_layers, nb, bs, c.num_kv_heads, c.head_dim, torch.float64)
    caches32 = new_kv_cache(c.num_layers, nb, bs, c.num_kv_heads, c.head_dim, torch.float32)
    tables = [[5, 17, 2, 30, 11, 8], [21, 3, 39, 14, 0, 26]]
    be64, be32 = TorchPagedBackend(), CpuPagedBackend()
    # step 1: 9 and 6 tokens at logical positions 200.. and 120.. in slots 0.. (as after compaction)
    # step 2: a decode and a 3-token chunk, positions and slots continuing
    steps = [([9, 6], [9, 6], [list(range(200, 209)), list(range(120, 126))]),
             ([1, 3], [10, 9], [[209], [126, 127, 128]])]
    gen = torch.Generator().manual_seed(1)
    for q_lens, kv_lens, positions in steps:
        ids = torch.randint(0, c.vocab_size, (sum(q_lens),), generator=gen)
        pos = torch.tensor([p for ps in positions for p in ps])
        meta = build_metadata(tables, q_lens, kv_lens, bs)
        be64.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, torch.float64)
        be32.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, torch.float32)
        ref = model64.compute_logits(model64(ids, pos, caches64, be64, meta)).double()
        out = model32.compute_logits(model32(ids, pos, caches32, be32, meta)).double()
        assert (out - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
