"""8-bit KV pages (paging/kv_format.py): int8, fp8_e4m3 and fp8_e5m2 rows of head_dim one-byte values followed by
their float32 scale (per token and KV head).

References are independent of the engine: the formats' bytes are worked by hand; attention is the dense float64
computation of tests/test_cpu_attention.py over the pages dequantized here with a plain loop; the engine is compared
with the float64 reference decoder whose K/V go through a quantizer written below. Every test that moves slots
(compaction, swap, prefix caching, lossless, tensor parallelism) checks that a slot's scale moved with its values,
and a deliberately misplaced scale is shown to fail the checks.
"""
from __future__ import annotations

import math
import struct

import pytest
import torch

from engine import SamplingParams
from engine.attention import cpu_ext
from engine.attention.torch_paged import TorchPagedBackend
from paging.compaction import CompactionJob, blocks_to_free, compact_batch
from paging.kv_cache import bytes_per_block
from paging.kv_format import SCALE_BYTES, hadamard, kv_format

if not cpu_ext.is_available():
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here", allow_module_level=True)
    cpu_ext.load()

from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from test_cpu_attention import (  # noqa: E402
    KERNELS, MIXED_PREFIX, MIXED_Q, make_step, permuted_columns, reference, run)

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KARA = {"method": "kara", "window": 16, "buffer": 4, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 2,
        "compression_period": 12}


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def fmt_of(name):
    return kv_format(name, torch.float32)


def plain_scale(row) -> float:
    """The float32 scale at the end of one stored row, read as little-endian bytes."""
    return struct.unpack("<f", bytes(row.view(torch.uint8)[-SCALE_BYTES:].tolist()))[0]


def sylvester(d: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order d, float64, by Kronecker products of [[1, 1], [1, -1]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / math.sqrt(d)


def rotated(name: str, d: int) -> bool:
    """int8 pages store K rows rotated where head_dim is a power of two (paging/kv_format.py)."""
    return name == "int8" and d & (d - 1) == 0


def plain_dequantize(pages: torch.Tensor, d: int) -> torch.Tensor:
    """Stored pages [blocks, 2, block_size, Hkv, d + 4] -> float64 values [..., d], one row at a time (the
    reference's reading); int8 K rows are rotated back by the Hadamard matrix built here."""
    flat = pages.reshape(-1, pages.shape[-1])
    out = torch.empty(flat.shape[0], d, dtype=torch.float64)
    for i, row in enumerate(flat):
        out[i] = row[:d].double() * plain_scale(row)
    out = out.reshape(*pages.shape[:-1], d)
    if pages.dtype == torch.int8 and rotated("int8", d):
        out[:, 0] = out[:, 0] @ sylvester(d)  # symmetric: H^T = H
    return out


def quantize_pages(name: str, cache: torch.Tensor) -> torch.Tensor:
    """Float pages [blocks, 2, ...] -> the format's pages, K rows as the engine writes them."""
    fmt = fmt_of(name)
    return torch.stack([fmt.quantize(cache[:, 0], keys=True), fmt.quantize(cache[:, 1])], dim=1)


def plain_quantize(name: str):
    """[H, D] float64 -> float64 values an 8-bit row gives back: scale = max|x| / qmax (float32), values rounded
    half to even (int8) or to the nearest fp8 value."""
    def q(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for h in range(x.shape[0]):
            amax = float(torch.tensor(float(x[h].abs().max()), dtype=torch.float32))
            scale = float(torch.tensor(amax / QMAX[name], dtype=torch.float32)) or 1.0
            y = (x[h].float() / torch.tensor(scale, dtype=torch.float32)).clamp(-QMAX[name], QMAX[name])
            vals = y.round() if name == "int8" else y.to(STORAGE[name]).double()
            out[h] = vals.double() * scale
        return out
    return q


def plain_quantize_keys(name: str):
    """plain_quantize for K rows: int8 rotates them by the Hadamard matrix first and back after (float64)."""
    q = plain_quantize(name)

    def k(x: torch.Tensor) -> torch.Tensor:
        if not rotated(name, x.shape[-1]):
            return q(x)
        h = sylvester(x.shape[-1])
        return q(x @ h) @ h
    return k


# ---- the formats, by hand ----------------------------------------------------------------------------------------
def test_int8_rows_hand_worked():
    fmt = fmt_of("int8")
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -127.0], [0.5, -1.27, 0.0, 1.0, 0.25, 0.0],
                      [0.0] * 6])
    rows = fmt.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 6 + SCALE_BYTES)
    # scale 1: half to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0)
    assert rows[0, :6].tolist() == [127, 0, 2, 2, 0, -127] and plain_scale(rows[0]) == 1.0
    # scale 1.27 / 127 = 0.01
    assert rows[1, :6].tolist() == [50, -127, 0, 100, 25, 0]
    assert plain_scale(rows[1]) == pytest.approx(0.01, rel=1e-6)
    # an all-zero row: scale 0, values 0, dequantized 0 (no NaN)
    assert rows[2, :6].tolist() == [0] * 6 and plain_scale(rows[2]) == 0.0
    back = fmt.dequantize(rows)
    assert torch.equal(back[2], torch.zeros(6)) and back[1].tolist() == pytest.approx(x[1].tolist(), abs=1e-6)


def test_fp8_rows_hand_worked():
    e4m3, e5m2 = fmt_of("fp8_e4m3"), fmt_of("fp8_e5m2")
    rows = e4m3.quantize(torch.tensor([[448.0, 1.0, -0.5, 3.0], [896.0, 2.0, 0.0, -13.0]]))
    assert rows.dtype == torch.float8_e4m3fn
    assert rows[0, :4].float().tolist() == [448.0, 1.0, -0.5, 3.0] and plain_scale(rows[0]) == 1.0
    # scale 2; -13 / 2 = -6.5 is between e4m3's -6.5 neighbours: exactly representable
    assert rows[1, :4].float().tolist() == [448.0, 1.0, 0.0, -6.5] and plain_scale(rows[1]) == 2.0
    rows = e5m2.quantize(torch.tensor([[57344.0, 1.0, -0.75, 5.0]]))
    # e5m2 has 2 mantissa bits: 5.0 is representable (1.25 * 4), -0.75 too (1.5 * 0.5)
    assert rows[0, :4].float().tolist() == [57344.0, 1.0, -0.75, 5.0] and plain_scale(rows[0]) == 1.0


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_is_within_the_formats_step(name):
    fmt = fmt_of(name)
    x = torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    back = fmt.dequantize(fmt.quantize(x))
    amax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if name == "int8":  # half a step of max|x| / 127
        assert (err <= amax / 127 / 2 * (1 + 1e-5)).all()
    else:  # half an ulp: 2^-4 (e4m3) / 2^-3 (e5m2) of the value, or of the smallest normal for tiny values
        mant = 3 if name == "fp8_e4m3" else 2
        assert (err <= torch.maximum(x.abs(), amax * 2.0 ** -9) * 2.0 ** -(mant + 1) * (1 + 1e-5)).all()
    assert err.max() > 0


def test_int8_keys_are_stored_rotated_and_read_back():
    """int8 K rows (head_dim a power of two) hold H k: the stored values are the Hadamard-rotated row's, computed here
    with a float64 matrix; dequantize(keys=True) rotates back; V rows, fp8 rows and head_dim 12 are not rotated. On
    rows with an outlier channel, as K after RoPE has, the rotated round trip is far closer to the row."""
    fmt, e4m3 = fmt_of("int8"), fmt_of("fp8_e4m3")
    assert fmt.rotates_keys(64) and fmt.rotates_keys(128) and not fmt.rotates_keys(12)
    assert not e4m3.rotates_keys(64) and not fmt_of("float32").rotates_keys(64)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(200, 64, generator=gen)
    x[:, 7] *= 60  # one outlier channel
    h = sylvester(64)
    assert torch.allclose(hadamard(x).double(), x.double() @ h, atol=1e-4)
    rows = fmt.quantize(x, keys=True)
    # float32 butterflies against a float64 product: a value at a rounding boundary may round one step apart
    diff = (rows[:, :64].int() - fmt.quantize((x.double() @ h).float())[:, :64].int()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99
    back, plain = fmt.dequantize(rows, keys=True), fmt.dequantize(fmt.quantize(x))
    assert torch.allclose(back.double(), (fmt.dequantize(rows).double() @ h), atol=1e-4)
    assert torch.equal(fmt.quantize(x[:, :12], keys=True), fmt.quantize(x[:, :12]))
    assert torch.equal(e4m3.quantize(x, keys=True).view(torch.uint8), e4m3.quantize(x).view(torch.uint8))
    err_rot, err_plain = (back - x).abs().mean(), (plain - x).abs().mean()
    assert err_rot * 4 < err_plain
    # the pair form used by the torch backend and the scorers' reads: K back, V as stored
    kv = torch.stack([rows, fmt.quantize(x)])
    both = fmt.dequantize_kv(kv)
    assert torch.equal(both[0], back) and torch.equal(both[1], plain)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_cpp_write_op_writes_the_bytes_of_the_torch_reference(name, src):
    """csrc/layer_ops.cpp write_kv (the CPU backend's K/V write) and KVFormat.quantize (the torch backend's) store
    the same bytes, scales included."""
    fmt = fmt_of(name)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(11, 3, 64, generator=gen) * 4).to(src), torch.randn(11, 3, 64, generator=gen).to(src)
    k[3] = 0  # a zero row
    slots = torch.tensor([0, 5, 17, 18, 19, 31, 2, 40, 41, 63, 7])
    pages = torch.zeros(4, 2, 16, 3, 64 + SCALE_BYTES, dtype=fmt.storage)
    cpu_ext.load().write_kv(k, v, pages, slots)
    blocks, offs = slots // 16, slots % 16
    assert torch.equal(pages[blocks, 0, offs].view(torch.uint8), fmt.quantize(k, keys=True).view(torch.uint8))
    assert torch.equal(pages[blocks, 1, offs].view(torch.uint8), fmt.quantize(v).view(torch.uint8))


# ---- attention over 8-bit pages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 24, 12])
def test_cpp_int8_write_rounds_halves_to_even_and_clamps_as_the_reference(d):
    """The vectorized int8 write (head_dim % 8 == 0; 12 takes the scalar loop): rows whose max is 127 have scale 1,
    so x / scale is x itself and its halves must round to even (2.5 -> 2, 3.5 -> 4, -0.5 -> -0); plus 600 random
    rows over six orders of magnitude, byte for byte against KVFormat.quantize and a hand-worked row."""
    fmt = fmt_of("int8")
    gen = torch.Generator().manual_seed(d)
    halves = torch.arange(d, dtype=torch.float32) - d / 2 + 0.5  # ..., -0.5, 0.5, 1.5, 2.5, ...
    halves[0] = 127.0
    k = torch.randn(600, 1, d, generator=gen) * 10.0 ** torch.randint(-3, 3, (600, 1, 1), generator=gen)
    v = -k
    v[0, 0] = -halves
    k[0, 0] = halves
    pages = torch.zeros(40, 2, 16, 1, d + SCALE_BYTES, dtype=torch.int8)
    cpu_ext.load().write_kv(k, v, pages, torch.arange(600))
    flat = pages.view(40, 2, 16, d + SCALE_BYTES)
    stored_k, stored_v = flat[:, 0].reshape(640, -1)[:600], flat[:, 1].reshape(640, -1)[:600]
    assert torch.equal(stored_k.view(torch.uint8), fmt.quantize(k[:, 0], keys=True).view(torch.uint8))
    assert torch.equal(stored_v.view(torch.uint8), fmt.quantize(v[:, 0]).view(torch.uint8))
    want = [-127] + [int(round(-x)) for x in halves[1:].tolist()]  # Python's round: half to even
    assert stored_v[0, :d].tolist() == want and plain_scale(stored_v[0]) == 1.0
    assert want[d // 2 + 2] == -2 and want[d // 2 + 3] == -4  # -2.5 and -3.5


def quantized_step(name, hq, hkv, d, bs, seed, q_lens=MIXED_Q, prefix=MIXED_PREFIX):
    cache, meta, q, k, v = make_step(q_lens, prefix, hq, hkv, d, bs, seed=seed)
    cache = cache * 2.5  # K/V rows of several magnitudes
    return cache, quantize_pages(name, cache), meta, q, k, v


def full_precision(cache, meta, k, v):
    """The float32 pages with the step's K/V written unquantized."""
    full = cache.clone()
    blocks, offs = meta.slot_mapping // cache.shape[2], meta.slot_mapping % cache.shape[2]
    full[blocks, 0, offs], full[blocks, 1, offs] = k, v
    return full


# |attention output - the same over unquantized pages| (max, mean) for these N(0, 2.5^2) K/V with outputs up to ~9,
# scale 1/sqrt(D): the format's own rounding (int8's step is max|x| / 127, e4m3's 2^-4 relative, e5m2's 2^-3).
# Measured over the four shapes: int8 0.094 / 0.0058, e4m3 0.48 / 0.022, e5m2 1.05 / 0.043; the bounds are 1.5x that
UNQUANTIZED_BOUND = {"int8": (0.15, 0.009), "fp8_e4m3": (0.72, 0.033), "fp8_e5m2": (1.6, 0.065)}


@pytest.mark.parametrize("level", KERNELS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (6, 2, 16, 4), (4, 2, 12, 4), (8, 1, 128, 16)])
def test_kernel_on_8bit_pages_equals_float64_attention_over_the_dequantized_pages(level, name, hq, hkv, d, bs):
    cache, pages, meta, q, k, v = quantized_step(name, hq, hkv, d, bs, seed=d + hq)
    scale = 1 / math.sqrt(d)
    out = run(CpuPagedBackend(max_isa=level), meta, q, k, v, pages, scale)
    blocks, offs = meta.slot_mapping // bs, meta.slot_mapping % bs
    fmt = fmt_of(name)
    # the step's K/V were quantized into their slots, each with its own scale
    assert torch.equal(pages[blocks, 0, offs].view(torch.uint8), fmt.quantize(k, keys=True).view(torch.uint8))
    assert torch.equal(pages[blocks, 1, offs].view(torch.uint8), fmt.quantize(v).view(torch.uint8))
    deq = plain_dequantize(pages, d)
    exact = (out.double() - reference(q, deq, meta.block_tables, meta.q_lens, meta.kv_lens, scale)).abs().max()
    assert exact < 1e-5  # float32 arithmetic only (measured <= 2.5e-6)
    full = full_precision(cache, meta, k, v)
    err = (out.double() - reference(q, full, meta.block_tables, meta.q_lens, meta.kv_lens, scale)).abs()
    bound_max, bound_mean = UNQUANTIZED_BOUND[name]
    assert 0 < err.max() < bound_max and err.mean() < bound_mean


@pytest.mark.parametrize("name", FORMATS)
def test_torch_backend_reads_the_same_pages(name):
    cache, pages, meta, q, k, v = quantized_step(name, 9, 3, 64, 16, seed=3)
    out = run(TorchPagedBackend(), meta, q, k, v, pages, 0.125)
    ref = reference(q, plain_dequantize(pages, 64), meta.block_tables, meta.q_lens, meta.kv_lens, 0.125)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("name", FORMATS)
def test_a_reference_with_each_slots_scale_moved_one_slot_fails(name):
    """The kernel check above sees which scale a row is read with: the same pages with every scale taken from the
    next slot of its block (a wrong scale index) give a reference the kernel's output is far from."""
    cache, pages, meta, q, k, v = quantized_step(name, 9, 3, 64, 16, seed=4)
    out = run(CpuPagedBackend(), meta, q, k, v, pages, 0.125)
    wrong = pages.clone()
    wrong.view(torch.uint8)[..., 64:] = pages.view(torch.uint8)[..., 64:].roll(1, dims=2)
    ref = reference(q, plain_dequantize(wrong, 64), meta.block_tables, meta.q_lens, meta.kv_lens, 0.125)
    assert (out.double() - ref).abs().max() > 0.05


INT8_DOTS = cpu_ext.load().int8_dot_attention()
needs_int8_dots = pytest.mark.skipif(not INT8_DOTS, reason="no AVX512-BF16 + AVX512-VNNI on this CPU")
# |output - float64 attention over the dequantized pages| of the integer-dot kernel (q and the probabilities as int16,
# 2^-16 of their row's largest): measured <= 5.8e-4 over the cases below, outputs up to ~9 (float kernels: 2.5e-6)
INT16_BOUND = 1e-3


@pytest.mark.parametrize("level", [pytest.param(3, id="int8-dots", marks=needs_int8_dots), *KERNELS])
def test_decode_of_many_long_sequences_on_int8_pages(level):
    lens = [1, 16, 17, 100, 257, 500]
    q_lens, prefix = {s: 1 for s in range(len(lens))}, {s: n - 1 for s, n in enumerate(lens)}
    cache, pages, meta, q, k, v = quantized_step("int8", 9, 3, 64, 16, seed=6, q_lens=q_lens, prefix=prefix)
    out = run(CpuPagedBackend(max_isa=level), meta, q, k, v, pages, 0.125)
    ref = reference(q, plain_dequantize(pages, 64), meta.block_tables, meta.q_lens, meta.kv_lens, 0.125)
    assert (out.double() - ref).abs().max() < (INT16_BOUND if level == 3 else 1e-5)


@needs_int8_dots
# head_dim 64 and 128 (the unrolled score widths 2 and 4 vectors), 96 (3: a 64-column value block, then 32), 32 (1)
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (8, 1, 128, 16), (6, 2, 96, 4), (4, 2, 32, 4)])
def test_int8_pages_on_integer_dot_products(hq, hkv, d, bs):
    """Level 3 on int8 pages (csrc/kvllm_cpu.cpp Avx512I8): the dot products are exact integers, so the output is
    within the int16 rounding of q and of the probabilities of float64 attention over the dequantized pages, and
    within the format's bound of attention over the unquantized K/V, as the float kernels are."""
    cache, pages, meta, q, k, v = quantized_step("int8", hq, hkv, d, bs, seed=d + hq)
    scale = 1 / math.sqrt(d)
    out = run(CpuPagedBackend(max_isa=3), meta, q, k, v, pages, scale)  # writes the step's K/V into `pages`
    ref = reference(q, plain_dequantize(pages, d), meta.block_tables, meta.q_lens, meta.kv_lens, scale)
    assert (out.double() - ref).abs().max() < INT16_BOUND
    full = full_precision(cache, meta, k, v)
    err = (out.double() - reference(q, full, meta.block_tables, meta.q_lens, meta.kv_lens, scale)).abs()
    bound_max, bound_mean = UNQUANTIZED_BOUND["int8"]
    assert 0 < err.max() < bound_max and err.mean() < bound_mean
    assert not torch.equal(out, run(CpuPagedBackend(max_isa=2), meta, q, k, v, pages.clone(), scale))  # it ran
    # the check sees the kernel's column order: its output left in the permuted order it accumulates in is far off
    wrong = out[..., torch.tensor(permuted_columns(d))]
    assert (wrong.double() - ref).abs().max() > 20 * INT16_BOUND


# ---- compaction moves a slot's scale with its values -------------------------------------------------------------
L_, NB, BS, HKV, D = 2, 12, 4, 2, 8


def check_compacted_rows(before, after, table, start, region_len, kept, kv_len):
    """Every kept slot and every moved tail slot holds its source row bit for bit: values and scale bytes."""
    def row(kv, s, l, h):
        return kv[l, table[s // BS], :, s % BS, h].view(torch.uint8)
    K = kept.shape[-1]
    for l in range(L_):
        for h in range(HKV):
            for t in range(K):
                assert torch.equal(row(after, start + t, l, h), row(before, start + int(kept[l, h, t]), l, h))
            for t in range(kv_len - start - region_len):
                assert torch.equal(row(after, start + K + t, l, h), row(before, start + region_len + t, l, h))


@pytest.mark.parametrize("name", FORMATS)
def test_compaction_moves_each_rows_scale_and_frees_exact_blocks(name):
    fmt = fmt_of(name)
    gen = torch.Generator().manual_seed(0)
    # each slot's rows at a magnitude of their own, so every scale differs
    x = torch.randn(L_, NB, 2, BS, HKV, D, generator=gen) * torch.rand(L_, NB, 2, BS, HKV, 1, generator=gen) * 10
    kv = fmt.quantize(x)
    table, kv_len = [7, 2, 11, 0, 5, 9], 23
    kept = torch.stack([torch.stack([torch.randperm(12, generator=gen)[:5].sort().values for _ in range(HKV)])
                        for _ in range(L_)])
    before = kv.clone()
    [new_len] = compact_batch(kv, [CompactionJob(table, 8, 12, kept, kv_len)])
    assert new_len == 16 and blocks_to_free(table, new_len, BS) == [5, 9]
    check_compacted_rows(before, kv, table, 8, 12, kept, kv_len)
    # a compaction that moved the values but left each slot's old scale behind is caught
    wrong = kv.clone()
    wrong.view(torch.uint8)[..., D:] = before.view(torch.uint8)[..., D:]
    with pytest.raises(AssertionError):
        check_compacted_rows(before, wrong, table, 8, 12, kept, kv_len)


def test_merged_rows_are_quantized_with_scales_of_their_own():
    """A merging job (CentroidKV) writes computed K/V rows: each is quantized with its own fresh scale."""
    fmt = fmt_of("int8")
    gen = torch.Generator().manual_seed(2)
    kv = fmt.quantize(torch.randn(L_, NB, 2, BS, HKV, D, generator=gen))
    table = [3, 1, 4]
    kept = torch.tensor([0, 2, 5]).expand(L_, HKV, 3).contiguous()
    new_k, new_v = torch.randn(L_, HKV, 3, D, generator=gen) * 7, torch.randn(L_, HKV, 3, D, generator=gen) / 7
    compact_batch(kv, [CompactionJob(table, 2, 8, kept, 12, new_k, new_v)])
    for t in range(3):
        s = 2 + t
        got_k = kv[:, table[s // BS], 0, s % BS]  # [L, Hkv, D + 4]
        got_v = kv[:, table[s // BS], 1, s % BS]
        assert torch.equal(got_k.view(torch.uint8), fmt.quantize(new_k[:, :, t], keys=True).view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), fmt.quantize(new_v[:, :, t]).view(torch.uint8))


# ---- the engine on 8-bit pages -----------------------------------------------------------------------------------
PROMPT = [7, 19, 33, 41, 5, 8, 90, 12, 64, 3, 27, 101, 55, 18, 77, 46, 9, 120, 31, 14]


def reference_logprobs(hf_model, quantize, n):
    from reference_decoder import ReferenceDecoder

    ref = ReferenceDecoder(hf_model, kv_dtype=quantize)
    logits = ref.prefill(PROMPT)
    tokens, logps = [], []
    for s in range(n):
        tok = int(logits.argmax())
        tokens.append(tok)
        logps.append(float(logits.log_softmax(-1)[tok]))
        if s < n - 1:
            logits, _ = ref.forward_token(tok, len(PROMPT) + s)
    return tokens, logps


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", FORMATS)
def test_engine_on_8bit_pages_matches_a_float64_decoder_with_quantized_kv(make_engine, tiny_hf_llama, name, backend):
    """Tokens equal the float64 decoder whose every K/V row goes through the 8-bit quantizer; log-probs are close
    to it and measurably further from the same decoder without quantization."""
    n = 24
    eng = make_engine(kv_cache_dtype=name, attention_backend=backend)
    assert eng.core.kv_cache.data.dtype == STORAGE[name] and eng.kv_cache_format == name
    out = eng.generate([PROMPT], greedy(n, logprobs=0), use_tqdm=False)[0].outputs[0]
    got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    tokens, quantized = reference_logprobs(tiny_hf_llama, (plain_quantize_keys(name), plain_quantize(name)), n)
    assert out.token_ids == tokens
    err_quantized = max(abs(a - b) for a, b in zip(got, quantized))
    _, exact = reference_logprobs(tiny_hf_llama, None, n)
    err_exact = max(abs(a - b) for a, b in zip(got, exact))
    # a K/V element within float32 error of a rounding boundary may round the other way than in float64: one
    # step of max|x| / 127 (int8) or an fp8 ulp, on a few elements
    assert err_quantized < 2e-3
    assert err_exact > 5 * err_quantized


def test_the_pool_holds_blocks_by_bytes_with_the_scales_counted(make_engine):
    full = make_engine(num_kv_blocks=None, kv_cache_memory="3MiB", swap_space=0, lossless_host_memory=0)
    eight = make_engine(num_kv_blocks=None, kv_cache_memory="3MiB", swap_space=0, lossless_host_memory=0,
                        kv_cache_dtype="int8")
    cfg = eight.core.model_config
    L, hkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert eight.stats().kv_cache_bytes_per_token == L * 2 * hkv * (d + 4)  # d bytes and a 4-byte scale per row
    assert full.stats().kv_cache_bytes_per_token == L * 2 * hkv * d * 4
    assert eight.stats().num_blocks == 3 * 2**20 // bytes_per_block(L, 4, hkv, d, eight.core.kv_cache.format)
    assert eight.stats().num_blocks == 3 * 2**20 // (4 * L * 2 * hkv * (d + 4))
    assert eight.core.kv_cache.nbytes <= 3 * 2**20
    compute, line = eight.capacity_log_lines()[:2]
    assert compute.startswith("Compute: float32;") and "attention: CpuPagedBackend" in compute
    assert f"int8: {L * 2 * hkv * (d + 4)} bytes/token" in line and "tokens/GiB" in line


def slots_of(eng, seq, n):
    """Every layer's stored K and V rows (values and scale bytes) of the sequence's first n slots, as bytes:
    [L, n, 2, Hkv, D + 4]."""
    p = torch.arange(n)
    table = torch.tensor(seq.block_table)
    bs = eng.core.kv_cache.block_size
    return eng.core.kv_cache.data[:, table[p // bs], :, p % bs].view(torch.uint8).transpose(0, 1).clone()


def test_swap_out_and_in_restores_values_and_scales_bit_identically(make_engine):
    prompt = list(range(10, 30))
    ref = make_engine(kv_cache_dtype="int8", kv_compression=KARA).generate([prompt], greedy(60), use_tqdm=False)
    eng = make_engine(kv_cache_dtype="int8", kv_compression=KARA)
    req = eng.new_request(prompt, greedy(60), "a")
    eng.add_request(req)
    seq = req.seqs[0]
    while seq.compression.rounds < 2:
        eng.step()
    before = slots_of(eng, seq, seq.kv_len)
    assert before[..., -SCALE_BYTES:].any()  # real scales
    n = seq.kv_len
    eng.core.scheduler.preempt(seq, swap=True)
    assert seq.swapped and seq.block_table == []
    eng.step()
    assert not seq.swapped and eng.stats().swapped_in_blocks > 0
    assert torch.equal(slots_of(eng, seq, n), before)  # values and scales, bit for bit
    while eng.has_unfinished_requests():
        eng.step()
    assert req.final.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert eng.stats().recomputed_tokens == 0


def test_kara_rounds_keep_each_slots_scale_and_free_the_blocks_past_the_new_end(make_engine, monkeypatch):
    """A spy on the KV manager's compaction: after each round every kept slot holds the row (values and scale) it
    was selected from, and exactly the blocks past the new end went back to the pool."""
    eng = make_engine(kv_cache_dtype="int8")
    kv = eng.core.kv
    real, seen = kv.compact, []

    def compact(jobs):
        snap = [(list(j.seq.block_table), j.kv_len, slots_of(eng, j.seq, j.kv_len)) for j in jobs]
        free_before = kv.num_free_blocks
        out = real(jobs)
        for job, (table, kv_len, rows) in zip(jobs, snap):
            after = slots_of(eng, job.seq, job.seq.kv_len)
            K = job.kept.shape[-1]
            for l in range(after.shape[0]):
                for h in range(after.shape[3]):
                    src = job.region_start + job.kept[l, h].long()
                    assert torch.equal(after[l, job.region_start:job.region_start + K, :, h], rows[l, src, :, h])
            tail = kv_len - job.region_start - job.region_len
            assert torch.equal(after[:, job.region_start + K:job.region_start + K + tail],
                               rows[:, job.region_start + job.region_len:])
            bs = eng.core.kv_cache.block_size
            assert job.seq.block_table == table[:-(-job.seq.kv_len // bs)]
            seen.append(blocks_to_free(table, job.seq.kv_len, bs))
        assert kv.num_free_blocks - free_before == sum(len(f) for f in seen[-len(jobs):]) == sum(out)
        return out

    monkeypatch.setattr(kv, "compact", compact)
    prompts = [list(range(5 + i, 25 + i)) for i in range(3)]
    eng.generate(prompts, greedy(70, kv_compression=KARA), use_tqdm=False)
    assert len(seen) >= 6 and any(seen)


def test_prefix_cache_shares_int8_blocks_and_outputs_equal_uncached(make_engine):
    prefix = [5 + (7 * i) % 100 for i in range(30)]
    prompts = [prefix + s for s in ([101, 102], [103], [104, 105, 106])]
    ref = make_engine(kv_cache_dtype="int8", enable_prefix_caching=False).generate(prompts, greedy(40),
                                                                                   use_tqdm=False)
    eng = make_engine(kv_cache_dtype="int8")
    eng.generate(prompts[:1], greedy(1), use_tqdm=False)  # caches the 7 full prefix blocks
    reqs = [eng.new_request(p, greedy(40), f"r{i}") for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    eng.step()
    tables = [r.seqs[0].block_table[:7] for r in reqs]
    assert all(t == tables[0] for t in tables)  # the same 7 physical blocks, scales and all
    assert all(eng.core.kv.pool.ref_counts[b] == 3 for b in tables[0])
    while eng.has_unfinished_requests():
        eng.step()
    assert [r.final.outputs[0].token_ids for r in reqs] == [o.outputs[0].token_ids for o in ref]
    assert [r.final.num_cached_tokens for r in reqs] == [28, 28, 28]


def test_lossless_on_int8_pages_equals_uncompressed_int8_output(make_engine):
    """The full tier lives in the host store at int8 too: lossless output equals the uncompressed output of the
    same int8 cache, through swap preemptions."""
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    ref = make_engine(kv_cache_dtype="int8").generate(prompts, greedy(80), use_tqdm=False)
    eng = make_engine(kv_cache_dtype="int8", num_kv_blocks=64, watermark=0, max_model_len=128,
                      preemption_mode="swap")
    outs = eng.generate(prompts, greedy(80, kv_compression={**KARA, "lossless": True}), use_tqdm=False)
    st = eng.stats()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert st.compression.rounds > 0 and st.lossless_verifications > 0 and st.lossless_accepted > 0


def test_flashinfer_backend_takes_fp8_pages_without_row_scales(make_engine, monkeypatch):
    """FlashInfer's fp8 pages carry no row scale (read with scale 1): the format is unscaled, planned with the fp8
    kv_data_type, and int8 is refused naming the flag. Runs through the float64 double of flashinfer on the CPU."""
    import flashinfer_double

    monkeypatch.setitem(__import__("sys").modules, "flashinfer", flashinfer_double)
    eng = make_engine(kv_cache_dtype="fp8_e4m3", attention_backend="flashinfer")
    assert eng.core.kv_cache.data.shape[-1] == eng.core.model_config.head_dim  # no scale bytes
    out = eng.generate([PROMPT], greedy(8), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    plans = [w.plan_state for w in flashinfer_double.WRAPPERS if w.plan_state is not None]
    assert plans and all(p.kv_dtype == torch.float8_e4m3fn for p in plans)
    with pytest.raises(ValueError, match="kv-cache-dtype int8"):
        make_engine(kv_cache_dtype="int8", attention_backend="flashinfer")


def test_an_8bit_dtype_the_backend_cannot_run_is_a_startup_error(make_engine, monkeypatch):
    monkeypatch.setattr(cpu_ext, "converts_fp8_in_hardware", lambda: False)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e5m2.*int8"):
        make_engine(kv_cache_dtype="fp8_e5m2", attention_backend="cpu")
    assert make_engine(kv_cache_dtype="int8", attention_backend="cpu").kv_cache_format == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine(kv_cache_dtype="int4")


def test_cli_flag_and_metrics_name_the_format():
    from server.cli import build_parser, engine_kwargs_from_args

    for name in ("int8", "fp8_e5m2", "fp8_e4m3", "fp8"):
        args = build_parser().parse_args(["serve", "--kv-cache-dtype", name])
        assert engine_kwargs_from_args(args) == {"kv_cache_dtype": name}
    assert kv_format("fp8", torch.float32).name == "fp8_e4m3"  # vLLM's alias


# ---- the real model ----------------------------------------------------------------------------------------------
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Here is a short poem about the sea:\n",
                   "Question: What is 12 times 7?\nAnswer:", "Once upon a time, in a small village,",
                   "The three laws of thermodynamics are", "import numpy as np\n", "Photosynthesis converts"]


@pytest.mark.slow
def test_smollm2_int8_pages_agree_with_float32_pages_token_by_token(smollm2_engine):
    """Greedy agreement, teacher-forced: along float32 KV's own 64-token greedy continuation of each of 8 prompts,
    the int8-KV engine's top token equals the one float32 KV chose at nearly every position (measured 503 / 512,
    every prompt >= 61 / 64, on an AMD Zen 4, with K rows rotated or not; bfloat16 KV: 511 / 512). Free-running, the 8
    prompts' runs stay equal on 2 / 8 with int8 pages and 6 / 8 with bfloat16 ones: docs/benchmarks.md, "Free-running greedy agreement by KV page
    dtype", and "8-bit K and V rows, scheme by scheme" for the term (K's rounding)."""
    from engine import Engine

    p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ids = [smollm2_engine.encode_prompt(x) for x in SMOLLM2_PROMPTS]
    ref = [o.outputs[0].token_ids for o in smollm2_engine.generate(ids, p, use_tqdm=False)]
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def agreement(eng):  # positions where the continuation token is the engine's top-1 (rank 1)
        outs = eng.generate([i + r for i, r in zip(ids, ref)], forced, use_tqdm=False)
        return [sum(lp[1] == 1 for lp in o.prompt_logprobs[len(i):]) for o, i in zip(outs, ids)]

    assert agreement(smollm2_engine) == [64] * 8  # the measure itself: float32 pages agree with themselves
    eng = Engine(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=512, max_model_len=2048,
                 kv_cache_dtype="int8")
    try:
        got = agreement(eng)
    finally:
        eng.shutdown()
        eng.check_invariants()
    assert sum(got) >= 0.95 * 512 and min(got) >= 56, got
