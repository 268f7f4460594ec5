"""The C++ layer ops (csrc/layer_ops.cpp through engine/models/layer_ops.py: RMSNorm with the residual add, RoPE,
SiLU-multiply, K/V writes, the greedy draw's argmax) against float64 references written out here, at each kernel
level the CPU has (AVX2, max_isa=1; portable, max_isa=0), on row-strided views as the model passes them; and the
engine's layer_ops setting."""
import pytest
import torch

from engine.attention import cpu_ext

if not cpu_ext.is_available():  # no compiler: the engine then runs torch ops, and there is nothing here to test
    pytest.skip("C++ extension unavailable", allow_module_level=True)

from engine.attention.base import write_kv as torch_write_kv  # noqa: E402
from engine.models.layer_ops import CpuLayerOps, TorchLayerOps  # noqa: E402

OPS = cpu_ext.load()
LEVELS = [pytest.param(1, marks=pytest.mark.skipif(not OPS.has_avx2(), reason="no AVX2 + FMA"), id="avx2"),
          pytest.param(0, id="portable")]


def rms_ref(x, w, eps):
    x = x.double()
    return w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope_ref(x, positions, inv_freq):
    """Rotate-half RoPE in float64 from the angles themselves (not from float32 tables)."""
    ang = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_mul_ref(x):
    g, u = x.double().chunk(2, dim=-1)
    return g / (1 + torch.exp(-g)) * u


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ---- RMSNorm ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows,h", [(1, 576), (64, 576), (7, 13), (3, 8), (5, 1)])
def test_rms_norm_matches_float64(level, rows, h):
    g = torch.Generator().manual_seed(rows * 1000 + h)
    x = torch.randn(rows, h, generator=g) * 3
    w = torch.randn(h, generator=g)
    out = CpuLayerOps(max_isa=level).rms_norm(x, w, 1e-5)
    assert rel_err(out, rms_ref(x, w, 1e-5)) < 2e-6
    # the torch reference path agrees too (this is what CpuLayerOps replaces)
    assert rel_err(TorchLayerOps().rms_norm(x, w, 1e-5), rms_ref(x, w, 1e-5)) < 2e-6


@pytest.mark.parametrize("level", LEVELS)
def test_rms_norm_with_residual_adds_in_place_then_normalises_the_sum(level):
    g = torch.Generator().manual_seed(1)
    big = torch.randn(6, 40, generator=g)
    x = big[:, 4:36]  # a row-strided view, as a slice of a wider output would be
    residual = torch.randn(6, 32, generator=g)
    expected_sum = x + residual  # float32, the same single rounding per element
    before = residual.clone()
    w = torch.randn(32, generator=g)
    out, res = CpuLayerOps(max_isa=level).rms_norm(x, w, 1e-6, residual)
    assert res.data_ptr() == residual.data_ptr()  # the sum is written into the residual stream
    assert torch.equal(residual, expected_sum)
    assert rel_err(out, rms_ref(x.double() + before.double(), w, 1e-6)) < 2e-6
    t_out, t_res = TorchLayerOps().rms_norm(x, w, 1e-6, before)
    assert torch.equal(t_res, expected_sum) and rel_err(out, t_out.double()) < 2e-6


def test_rms_norm_eps_is_applied():
    """A cheap wrong-implementation check: all-zero rows are finite only because eps is added, and a norm that
    dropped eps (or used it outside the sqrt) would miss the reference on tiny rows."""
    x = torch.full((2, 16), 1e-4)
    x[1] = 0
    w = torch.ones(16)
    out = CpuLayerOps().rms_norm(x, w, 1e-5)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0
    assert rel_err(out[:1], rms_ref(x[:1], w, 1e-5)) < 2e-6
    assert rel_err(out[:1], rms_ref(x[:1], w, 0.0)) > 1e-2  # eps matters at this scale


# ---- RoPE ---------------------------------------------------------------------------------------------------
def qkv_views(t, hq, hkv, d, g):
    """q, k, v as the attention layer makes them: views into one [T, (Hq + 2 Hkv) D] projection output."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def tables(positions, d, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(int(positions.max()) + 1).float(), inv_freq)
    return ang.cos()[positions], ang.sin()[positions], inv_freq


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("d", [64, 12])
def test_rope_in_place_on_projection_views_matches_float64(level, d):
    g = torch.Generator().manual_seed(d)
    t, hq, hkv = 5, 9, 3
    qkv, q, k, v = qkv_views(t, hq, hkv, d, g)
    v_before, q0, k0 = v.clone(), q.clone(), k.clone()
    positions = torch.tensor([0, 1, 7, 300, 2047])
    cos, sin, inv_freq = tables(positions, d)
    q2, k2 = CpuLayerOps(max_isa=level).rope(q, k, cos, sin)
    assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()  # rotated where they lie
    assert torch.equal(v, v_before)  # V (the rest of the row) untouched
    # float32 tables at position 2047 carry ~1e-4 absolute angle error, so compare with the tables' own angles too
    assert (q.double() - rope_ref(q0, positions, inv_freq)).abs().max() < 2e-3
    tq, tk = TorchLayerOps().rope(q0, k0, cos, sin)
    assert (q - tq).abs().max() < 1e-5 and (k - tk).abs().max() < 1e-5
    # a wrong position (off by one) is far outside that tolerance
    wrong = rope_ref(q0, positions + 1, inv_freq)
    assert (q.double() - wrong).abs().max() > 1e-2


def test_rope_without_k_rotates_q_only():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, 8, generator=g)
    positions = torch.arange(4)
    cos, sin, inv_freq = tables(positions, 8)
    q0 = q.clone()
    out, k = CpuLayerOps().rope(q, None, cos, sin)
    assert k is None and (out.double() - rope_ref(q0, positions, inv_freq)).abs().max() < 1e-5


# ---- SiLU-multiply ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows,inter", [(64, 1536), (3, 11), (1, 8)])
def test_silu_mul_matches_float64(level, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 4
    x[0, : min(inter, 6)] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 20.0, 200.0])[: min(inter, 6)]  # exp's ends
    out = CpuLayerOps(max_isa=level).silu_mul(x)
    ref = silu_mul_ref(x)
    assert out.shape == (rows, inter)
    assert rel_err(out, ref) < 2e-6
    assert rel_err(TorchLayerOps().silu_mul(x), ref) < 2e-6


# ---- K/V writes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_torch_scatter(cache_dtype, src_dtype):
    """Exactly the same pages as the torch backend's index_copy (the same rounding to the cache dtype), from
    views into a projection output, with slots in shuffled blocks."""
    g = torch.Generator().manual_seed(3)
    nb, bs, hkv, d = 10, 4, 3, 8
    _, _, k, v = qkv_views(6, 9, hkv, d, g)
    k, v = k.to(src_dtype), v.to(src_dtype)
    slots = torch.tensor([4 * 7 + 1, 4 * 7 + 2, 4 * 2 + 3, 4 * 9 + 0, 0, 4 * 5 + 3])
    cache = torch.randn(nb, 2, bs, hkv, d, generator=g).to(cache_dtype)
    ref = cache.clone()
    OPS.write_kv(k, v, cache, slots)
    torch_write_kv(ref, k, v, slots)
    assert torch.equal(cache, ref)


def test_write_kv_rejects_a_slot_outside_the_cache():
    cache = torch.zeros(2, 2, 4, 1, 8)
    k = torch.ones(1, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        OPS.write_kv(k, k, cache, torch.tensor([8]))
    assert cache.abs().max() == 0


# ---- bfloat16 rows ------------------------------------------------------------------------------------------
# bfloat16 in, bfloat16 out, float32 arithmetic, rounded where TorchLayerOps (torch's own bfloat16 ops) rounds: the
# two agree bit for bit except where float32 summation order tips a rounding (then by one bfloat16 step), and both
# are within bfloat16 rounding of the float64 reference of the same bfloat16 inputs.
BF16_STEP = 2.0 ** -7  # bfloat16's relative spacing (8 significant bits)


def bf16_agreement(out, ref_out):
    """Fraction of elements bit-identical to torch's bfloat16 result, and the largest difference in bfloat16 steps."""
    assert out.dtype == ref_out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    same = (out == ref_out).double().mean().item()
    steps = ((out.double() - ref_out.double()).abs() / (ref_out.double().abs() * BF16_STEP).clamp_min(1e-30)).max()
    return same, steps.item()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows,h", [(64, 576), (7, 13)])
def test_bf16_rms_norm_with_residual_rounds_where_torch_rounds(level, rows, h):
    g = torch.Generator().manual_seed(rows + h)
    big = (torch.randn(rows, h + 6, generator=g) * 3).bfloat16()
    x = big[:, 3:3 + h]  # row-strided view
    residual = torch.randn(rows, h, generator=g).bfloat16()
    w = torch.randn(h, generator=g).bfloat16()
    before = residual.clone()
    out, res = CpuLayerOps(max_isa=level).rms_norm(x, w, 1e-5, residual)
    t_out, t_res = TorchLayerOps().rms_norm(x, w, 1e-5, before)
    assert out.dtype == res.dtype == torch.bfloat16 and res.data_ptr() == residual.data_ptr()
    assert torch.equal(res, t_res)  # the sum is rounded once to bfloat16, as torch's bfloat16 add rounds it
    same, steps = bf16_agreement(out, t_out)
    assert same > 0.99 and steps <= 1.01
    ref = rms_ref(x.double() + before.double(), w, 1e-5)
    assert rel_err(out, ref) < 2 * BF16_STEP
    # no residual: the plain norm
    same, steps = bf16_agreement(CpuLayerOps(max_isa=level).rms_norm(x, w, 1e-5), TorchLayerOps().rms_norm(x, w, 1e-5))
    assert same > 0.99 and steps <= 1.01


@pytest.mark.parametrize("level", LEVELS)
def test_bf16_rms_norm_rounds_before_the_weight(level):
    """TorchLayerOps rounds x * inv to bfloat16 before multiplying by the weight (HF's order); a kernel that kept
    that product in float32 would differ from torch on a sizeable share of elements, not on a handful."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 576, generator=g).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    out = CpuLayerOps(max_isa=level).rms_norm(x, w, 1e-6)
    t_out = TorchLayerOps().rms_norm(x, w, 1e-6)
    one_rounding = (w.double() * rms_ref(x, torch.ones(576), 1e-6)).bfloat16()  # what skipping it would give
    assert (out == t_out).double().mean() > 0.99
    assert (one_rounding == t_out).double().mean() < 0.95


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("d", [64, 12])
def test_bf16_rope_in_place_matches_torch(level, d):
    g = torch.Generator().manual_seed(d + 1)
    qkv, q, k, v = qkv_views(5, 9, 3, d, g)
    qkv.copy_(qkv.bfloat16().float())
    qkv16 = qkv.bfloat16()
    q16, k16, v16 = (t.view(5, -1, d) for t in qkv16.split([9 * d, 3 * d, 3 * d], dim=-1))
    v_before, q0, k0 = v16.clone(), q16.clone(), k16.clone()
    positions = torch.tensor([0, 1, 7, 300, 2047])
    cos, sin, inv_freq = tables(positions, d)
    CpuLayerOps(max_isa=level).rope(q16, k16, cos, sin)
    assert q16.dtype == torch.bfloat16 and torch.equal(v16, v_before)
    tq, tk = TorchLayerOps().rope(q0, k0, cos, sin)
    for out, ref in ((q16, tq), (k16, tk)):
        same, steps = bf16_agreement(out, ref)
        assert same > 0.99 and steps <= 1.01
    assert (q16.double() - rope_ref(q0, positions, inv_freq)).abs().max() < 4 * BF16_STEP * q0.double().abs().max()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows,inter", [(64, 1536), (3, 11)])
def test_bf16_silu_mul_rounds_silu_before_the_product(level, rows, inter):
    g = torch.Generator().manual_seed(rows * inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).bfloat16()
    out = CpuLayerOps(max_isa=level).silu_mul(x)
    t_out = TorchLayerOps().silu_mul(x)  # F.silu rounds to bfloat16, then the bfloat16 multiply rounds again
    same, steps = bf16_agreement(out, t_out)
    assert out.shape == (rows, inter) and same > 0.99 and steps <= 1.01
    assert rel_err(out, silu_mul_ref(x)) < 2 * BF16_STEP
    if rows == 64:  # one rounding only (silu * up in float32) is a different function: visibly fewer matches
        one_rounding = silu_mul_ref(x).bfloat16()
        assert (one_rounding == t_out).double().mean() < 0.95


def test_bf16_model_logits_with_cpu_ops_match_torch_ops():
    """A tiny bfloat16 DecoderLM (Llama and Qwen3) on the C++ ops against the same model on torch ops, and both
    against the float64 model: the C++ ops add no error beyond bfloat16's own."""
    from helpers_models import new_kv_cache, tiny_decoder_pair

    from engine.attention.base import build_metadata
    from engine.attention.torch_paged import TorchPagedBackend

    for arch in ("llama", "qwen3"):
        c, model64, model16 = tiny_decoder_pair(arch, lambda m: m, std=0.2, dtype=torch.float64)
        model16 = model16.bfloat16()
        bs, nb = 4, 20
        tables_ = [[5, 17, 2, 11], [3, 19, 14, 0]]
        ids = torch.randint(0, c.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
        meta = build_metadata(tables_, [7, 5], [7, 5], bs)
        pos = torch.tensor(list(range(7)) + list(range(40, 45)))
        logits = {}
        for name, ops, model, dtype in (("cpu", CpuLayerOps(), model16, torch.bfloat16),
                                        ("torch", TorchLayerOps(), model16, torch.bfloat16),
                                        ("f64", TorchLayerOps(), model64, torch.float64)):
            model.set_layer_ops(ops)
            be = TorchPagedBackend()
            be.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, dtype)
            caches = new_kv_cache(c.num_layers, nb, bs, c.num_kv_heads, c.head_dim, dtype)
            logits[name] = model.compute_logits(model(ids, pos, caches, be, meta)).double()
        scale = logits["f64"].abs().max().item()
        err_cpu = (logits["cpu"] - logits["f64"]).abs().max().item() / scale
        err_torch = (logits["torch"] - logits["f64"]).abs().max().item() / scale
        assert err_cpu < 0.05 and err_cpu < 2 * err_torch + 1e-3, (arch, err_cpu, err_torch)
        assert (logits["cpu"] - logits["torch"]).abs().max().item() / scale < 0.05, arch


# ---- the parallel split -------------------------------------------------------------------------------------
def test_large_inputs_split_over_threads_give_the_single_thread_result():
    """Prefill-sized calls run on every thread (rows split, each row computed the same way): bit-identical."""
    g = torch.Generator().manual_seed(5)
    x, res, w = torch.randn(2048, 576, generator=g), torch.randn(2048, 576, generator=g), torch.randn(576, generator=g)
    gu = torch.randn(512, 3072, generator=g)
    _, q, k, _ = qkv_views(2048, 9, 3, 64, g)
    cos, sin, _ = tables(torch.arange(2048), 64)
    ops = CpuLayerOps()
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            r = res.clone()
            qq, kk = q.clone(), k.clone()
            out, _ = ops.rms_norm(x, w, 1e-5, r)
            ops.rope(qq, kk, cos, sin)
            results.append((out, r, qq, kk, ops.silu_mul(gu)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---- argmax (the greedy draw) -------------------------------------------------------------------------------
def argmax_ref(row: list[float]) -> int:
    """A Python loop: the first largest value's index, or the first NaN's (torch.argmax's rule)."""
    best = 0
    for i, v in enumerate(row):
        if v != v:
            return i
        if v > row[best]:
            best = i
    return best


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("v", [1, 7, 16, 23, 49152])
def test_argmax_is_the_first_max_and_the_first_nan(level, v):
    """Ties, infinities, signed zeros, NaN in the vector body, in the tail and twice, on row-strided views with an
    offset start; the long rows also split over the threads."""
    g = torch.Generator().manual_seed(v)
    x = torch.randn(12, v + 5, generator=g)[:, 2:v + 2]
    inf, nan = float("inf"), float("nan")
    x[1] = 0.5
    x[2, v // 2] = x[2, v - 1] = 100.0
    x[3] = -inf
    x[4, v - 1] = inf
    x[5, v // 3] = nan
    x[6, v - 1] = nan
    x[7, v - 1] = nan
    x[7, v // 5] = nan
    x[8] = -1.0
    x[8, v - 1] = 0.0
    x[8, v // 2] = -0.0
    x[9, :] = -inf
    x[9, v - 1] = nan
    out = CpuLayerOps(max_isa=level).argmax(x)
    assert out.dtype == torch.int64 and out.shape == (12,)
    assert out.tolist() == [argmax_ref(r) for r in x.tolist()]
    assert out.tolist() == x.argmax(dim=-1).tolist()


def test_argmax_takes_only_float32_rows_and_falls_back_otherwise():
    ops = CpuLayerOps()
    for x in (torch.randn(3, 40).bfloat16(), torch.randn(3, 40, dtype=torch.float64), torch.randn(40),
              torch.randn(40, 3).t()):
        assert ops.argmax(x).tolist() == x.argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="x must be a float32"):
        OPS.argmax(torch.randn(3, 40, dtype=torch.float64), torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="out must be"):
        OPS.argmax(torch.randn(3, 40), torch.empty(2, dtype=torch.int64))


# ---- bad input ----------------------------------------------------------------------------------------------
def test_bad_arguments_name_the_field():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        OPS.rms_norm(x, torch.ones(7), 1e-5, torch.empty(4, 8), None)
    with pytest.raises(ValueError, match="x must be a float32"):
        OPS.rms_norm(x.double(), torch.ones(8), 1e-5, torch.empty(4, 8), None)
    with pytest.raises(ValueError, match="residual"):
        OPS.rms_norm(x, torch.ones(8), 1e-5, torch.empty(4, 8), torch.empty(3, 8))
    with pytest.raises(ValueError, match="cos and sin"):
        OPS.rope_(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.randn(2, 3), torch.randn(2, 3))
    with pytest.raises(ValueError, match="x must be"):
        OPS.silu_mul(torch.randn(2, 5), torch.empty(2, 2))
    with pytest.raises(ValueError, match="max_isa"):
        OPS.silu_mul(torch.randn(2, 4), torch.empty(2, 2), 3)
    with pytest.raises(ValueError, match="out must have x's dtype"):
        OPS.silu_mul(torch.randn(2, 4), torch.empty(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight must be a contiguous CPU tensor of x's dtype"):
        OPS.rms_norm(x.bfloat16(), torch.ones(8), 1e-5, torch.empty(4, 8, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="cos and sin must be float32"):
        half_tables = torch.randn(2, 4).bfloat16()
        OPS.rope_(torch.randn(2, 1, 8), torch.randn(2, 1, 8), half_tables, half_tables)


def test_inputs_the_kernels_do_not_take_fall_back_to_torch():
    """Other dtypes and Qwen3's per-head [T, H, D] q/k norm take the torch ops instead of an error."""
    ops, ref = CpuLayerOps(), TorchLayerOps()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    x32 = torch.randn(3, 4, 8)
    assert torch.equal(ops.rms_norm(x32, w.float(), 1e-6), ref.rms_norm(x32, w.float(), 1e-6))
    half = torch.randn(2, 16).half()
    assert torch.equal(ops.silu_mul(half), ref.silu_mul(half))
    bf = torch.randn(2, 16).bfloat16()  # a bfloat16 norm weight with float32 rows: mixed dtypes go to torch too
    assert torch.equal(ops.rms_norm(bf.float(), bf[0], 1e-6), ref.rms_norm(bf.float(), bf[0], 1e-6))


# ---- in the model and the engine ----------------------------------------------------------------------------
def test_model_logits_with_cpu_ops_match_float64_model():
    """A tiny DecoderLM (Qwen3: q/k norms too) on the C++ ops and attention, a prefill and a decode step, against
    the float64 model on torch ops and the torch backend."""
    from helpers_models import new_kv_cache, tiny_decoder_pair

    from engine.attention.base import build_metadata
    from engine.attention.cpu_paged import CpuPagedBackend
    from engine.attention.torch_paged import TorchPagedBackend

    def on_cpu_ops(model):
        model.set_layer_ops(CpuLayerOps())
        return model

    for arch in ("llama", "qwen3"):
        c, model64, model32 = tiny_decoder_pair(arch, on_cpu_ops, std=0.2, dtype=torch.float64)
        assert model32.layer_ops.name == "cpu" and model64.layer_ops.name == "torch"
        bs, nb = 4, 20
        caches64 = new_kv_cache(c.num_layers, nb, bs, c.num_kv_heads, c.head_dim, torch.float64)
        caches32 = new_kv_cache(c.num_layers, nb, bs, c.num_kv_heads, c.head_dim, torch.float32)
        tables_ = [[5, 17, 2, 11], [3, 19, 14, 0]]
        be64, be32 = TorchPagedBackend(), CpuPagedBackend()
        gen = torch.Generator().manual_seed(1)
        for q_lens, kv_lens, pos in (([7, 5], [7, 5], list(range(7)) + list(range(40, 45))),
                                     ([1, 1], [8, 6], [7, 45])):
            ids = torch.randint(0, c.vocab_size, (sum(q_lens),), generator=gen)
            meta = build_metadata(tables_, q_lens, kv_lens, bs)
            be64.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, torch.float64)
            be32.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, torch.float32)
            ref = model64.compute_logits(model64(ids, torch.tensor(pos), caches64, be64, meta)).double()
            out = model32.compute_logits(model32(ids, torch.tensor(pos), caches32, be32, meta)).double()
            assert (out - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item()), arch


def test_engine_layer_ops_setting(make_engine):
    from engine.models.layer_ops import CpuLayerOps as Cpu
    from server.cli import build_parser, engine_kwargs_from_args

    auto = make_engine().core
    assert isinstance(auto.model.layer_ops, Cpu)  # auto: float32 on the CPU
    assert auto.sampler.argmax == auto.model.layer_ops.argmax  # the greedy draw takes the C++ argmax too
    eng = make_engine(layer_ops="torch")
    assert type(eng.core.model.layer_ops) is TorchLayerOps
    assert eng.core.sampler.argmax == eng.core.model.layer_ops.argmax
    assert all(m.ops is eng.core.model.layer_ops for m in eng.core.model.modules() if hasattr(m, "ops"))
    assert isinstance(make_engine(dtype="bfloat16").core.model.layer_ops, Cpu)  # auto: bfloat16 too
    # auto: a float16 model widens to float32 panels (tests/test_bf16_widened.py); on F.linear, not float16
    assert type(make_engine(dtype="float16", gemm_backend="torch").core.model.layer_ops) is TorchLayerOps
    with pytest.raises(ValueError, match="layer_ops='cpu' cannot run"):
        make_engine(layer_ops="cpu", dtype="float16")
    with pytest.raises(ValueError, match="layer_ops"):
        make_engine(layer_ops="bogus")
    kw = engine_kwargs_from_args(build_parser().parse_args(["serve", "--layer-ops", "torch"]))
    assert kw == {"layer_ops": "torch"}


def test_engine_outputs_are_the_same_tokens_with_either_ops(make_engine):
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 11, 3, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    outs = {}
    for ops in ("cpu", "torch"):
        eng = make_engine(layer_ops=ops)
        outs[ops] = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
    assert outs["cpu"] == outs["torch"]
