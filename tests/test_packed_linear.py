"""Packed linear layers (engine/models/packed.py, csrc/kvllm_cpu.cpp packed_linear): the kernel against a float64
reference, its half-precision panels against its float32 ones, the model swap against the unpacked model, and the
engine's gemm_backend setting."""
import pytest
import torch
from torch import nn

from engine.attention import cpu_ext

if not cpu_ext.is_available():
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here", allow_module_level=True)
    cpu_ext.load()  # a compiler exists, so the build must work: raise its error instead of skipping
if not cpu_ext.load().has_avx2():
    pytest.skip("packed_linear is AVX2 only", allow_module_level=True)

from engine.models.packed import PackedLinear, can_pack, pack_linears, pack_weight  # noqa: E402

ISA = cpu_ext.load().isa_level()  # 1 AVX2 (6 x 16 tile), 2 AVX-512 (8 rows x 3 panels of 16)
LEVELS = [pytest.param(1, id="avx2"),
          pytest.param(2, id="avx512", marks=pytest.mark.skipif(ISA < 2, reason="no AVX-512F on this CPU"))]


def _check_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """float32 accumulation error bound: a few ulps of sum_k |x_k w_k| per output (the float64 reference)."""
    w, b = w.detach(), None if b is None else b.detach()
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = (x.double().abs() @ w.double().abs().T) * 1e-6 * x.shape[1] ** 0.5 + 1e-6
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out.double() - ref).abs() <= bound).all(), float(((out.double() - ref).abs() / bound).max())


def test_pack_weight_layout():
    w = torch.randn(35, 9)
    p = pack_weight(w)
    assert p.shape == (3, 9, 16) and p.is_contiguous()
    for n in range(48):
        for k in range(9):
            assert float(p[n // 16, k, n % 16]) == (float(w[n, k]) if n < 35 else 0.0)
    with pytest.raises(ValueError, match="2-D"):
        pack_weight(torch.randn(3, 4, 5))


# m: 0 rows, the micro-kernels' remainders (AVX2 tile of 6 rows: 1..5, 7, 11, 13; AVX-512 tile of 8: 1..7, 9, 11,
# 12, 13), whole tiles (6, 8, 12, 64, 96) and more than one 96-row block; n: 1, 3, 5 and 13 panels (the AVX-512
# tile takes panels in threes, so a layer ends on a group of 1, 2 or 3), N mostly not a multiple of 16
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("m", [0, 1, 2, 5, 6, 7, 8, 9, 11, 12, 13, 64, 96, 131, 250])
@pytest.mark.parametrize("n,k,bias", [(16, 8, True), (35, 64, False), (5, 33, True), (80, 40, True), (200, 576, False)])
def test_packed_linear_matches_float64(level, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    layer = PackedLinear(lin)
    layer.max_isa = level
    assert torch.equal(layer.weight, lin.weight)  # the packing round-trips exactly
    x = torch.randn(m, k, generator=g)
    _check_close(layer(x), x, lin.weight, lin.bias if bias else None)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("panel", [0, 1, 2, 3])  # each panel of the AVX-512 tile's group of 3, and the next
def test_the_bound_catches_a_misplaced_channel(level, panel):
    """The check above fails a kernel that mixes up two output channels of a panel (a packing slip)."""
    lin = nn.Linear(64, 64, bias=False)
    layer = PackedLinear(lin)
    layer.max_isa = level
    layer.w_packed[panel, :, [3, 4]] = layer.w_packed[panel, :, [4, 3]]
    x = torch.randn(7, 64)
    with pytest.raises(AssertionError):
        _check_close(layer(x), x, lin.weight, None)


# half panels: in registers up to 6 rows on the AVX2 tile, then the first tile keeps the widened floats for the
# rest (7, 13: one and two more tiles), 96-row blocks (97, 200); the AVX-512 tile widens groups of 3 into scratch
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(20, 16), (35, 64), (200, 576)])
def test_half_panels_equal_the_float32_panels_of_their_values(level, dtype, n, k):
    """A layer of bfloat16 or float16 values on half panels computes what the float32 panels of the same values do,
    bit for bit (each value widened exactly, the same tile's sums), at every row count and each tile; so the float64
    bound above holds for them too."""
    g = torch.Generator().manual_seed(n + k)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g).to(dtype).float())
        lin.bias.copy_(torch.randn(n, generator=g))
    full, half = PackedLinear(lin), PackedLinear(lin, dtype)
    assert half.w_packed.dtype == dtype and torch.equal(half.weight, lin.weight) and half.weight.dtype == torch.float32
    full.max_isa = half.max_isa = level
    for m in (0, 1, 5, 6, 7, 13, 97, 200):
        x = torch.randn(m, k, generator=g)
        a, b = full(x), half(x)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (m, float((a - b).abs().max()))
        _check_close(b, x, lin.weight, lin.bias)


@pytest.mark.parametrize("level", LEVELS)
def test_half_panels_see_every_weight(level):
    """One changed weight anywhere (each panel of a 3-panel group, first and last columns) changes its output, so a
    widening that skipped or misplaced values fails the equality above."""
    lin = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    x = torch.randn(9, 64)
    for rows in (x[:1], x):  # in registers, kept
        base = PackedLinear(lin, torch.bfloat16)
        base.max_isa = level
        ref = base(rows)
        for out_ch, col in ((0, 0), (17, 63), (47, 31)):
            layer = PackedLinear(lin, torch.bfloat16)
            layer.max_isa = level
            layer.w_packed[out_ch // 16, col, out_ch % 16] += 1.0
            diff = (layer(rows) - ref).abs() > 0
            assert diff[:, out_ch].all() and diff.sum() == rows.shape[0], (out_ch, col)


def test_half_panels_refuse_values_they_would_round():
    lin = nn.Linear(16, 16)
    with pytest.raises(ValueError, match="not all torch.bfloat16 values"):
        PackedLinear(lin, torch.bfloat16)  # float32 weights of random mantissas
    with pytest.raises(ValueError, match="panel_dtype must be"):
        PackedLinear(lin, torch.float64)


def test_step_floor_reads_half_panels_at_their_size():
    """bench/step_floor.py's bytes-read floor counts a half panel's weights at 2 bytes, a float32 panel's at 4."""
    from bench.step_floor import linear_numel

    lin = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    model = nn.Sequential(PackedLinear(lin), PackedLinear(lin, torch.bfloat16), PackedLinear(lin, torch.float16))
    assert linear_numel(model) == (3 * 64 * 32, 64 * 32 * (4 + 2 + 2))


def test_packed_linear_keeps_leading_dims_and_takes_strided_input():
    lin = nn.Linear(16, 24)
    layer = PackedLinear(lin)
    x = torch.randn(2, 3, 16)
    assert layer(x).shape == (2, 3, 24)
    xt = torch.randn(16, 5).T  # not contiguous
    _check_close(layer(xt), xt, lin.weight, lin.bias)


def test_packed_linear_bad_inputs_name_the_field():
    layer = PackedLinear(nn.Linear(16, 20))
    ops = cpu_ext.load()
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="x must be"):
        ops.packed_linear(x.double(), layer.w_packed, None, torch.empty(3, 20))
    with pytest.raises(ValueError, match="w_packed has K=16, x has K=8"):
        ops.packed_linear(torch.randn(3, 8), layer.w_packed, None, torch.empty(3, 20))
    with pytest.raises(ValueError, match="out has N=40"):
        ops.packed_linear(x, layer.w_packed, None, torch.empty(3, 40))
    with pytest.raises(ValueError, match="bias must be"):
        ops.packed_linear(x, layer.w_packed, torch.zeros(3), torch.empty(3, 20))
    with pytest.raises(ValueError, match="w_packed must be float32, bfloat16 or float16"):
        ops.packed_linear(x, layer.w_packed.double(), None, torch.empty(3, 20))
    with pytest.raises(ValueError, match="w_packed must be a contiguous"):
        ops.packed_linear(x, layer.w_packed.half().transpose(0, 1), None, torch.empty(3, 20))
    with pytest.raises(ValueError, match="max_isa must be"):
        ops.packed_linear(x, layer.w_packed, None, torch.empty(3, 20), 3)
    with pytest.raises(ValueError, match="packed_linear needs AVX2"):
        ops.packed_linear(x, layer.w_packed, None, torch.empty(3, 20), 0)


def _tiny(arch: str):
    from helpers_models import tiny_decoder_pair

    return tiny_decoder_pair(arch, pack_linears)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: tied embeddings and q/k/v bias
def test_packed_tiny_model_equals_the_unpacked_one(arch, monkeypatch):
    from helpers_models import mixed_batch_outputs

    def no_dense(self):
        raise AssertionError("a forward or a query recomputation built a packed layer's dense weight")

    monkeypatch.setattr(PackedLinear, "weight", property(no_dense))
    c, model, packed = _tiny(arch)
    assert not [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 4 * c.num_layers + 1
    (ref, qf), (out, qp) = mixed_batch_outputs(c, [model, packed])
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 1e-4
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # query recomputation runs the packed qkv layer itself (engine/models/llama.py Attention.queries)
    assert (qp - qf).abs().max().item() < 1e-4


def test_int8_of_a_packed_model_equals_int8_of_the_dense_one():
    from engine.models.quant import Int8Linear, quantize_int8

    _, model, packed = _tiny("llama")
    a, b = quantize_int8(model), quantize_int8(packed)
    la = [m for m in a.modules() if isinstance(m, Int8Linear)]
    lb = [m for m in b.modules() if isinstance(m, Int8Linear)]
    assert len(la) == len(lb) > 0 and not hasattr(b, "packed_lm_head")
    for x, y in zip(la, lb):
        assert torch.equal(x.w_packed, y.w_packed) and torch.equal(x.scale, y.scale)


def test_can_pack_says_why_not():
    _, model, _ = _tiny("llama")
    assert can_pack(model) is None
    assert "bfloat16" in can_pack(model.to(torch.bfloat16))
    with pytest.raises(ValueError, match="gemm_backend='cpu' cannot run"):
        pack_linears(model)


def test_engine_gemm_backend_setting(make_engine):
    from engine import SamplingParams
    from server.cli import build_parser, engine_kwargs_from_args

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40))]
    outs = {}
    for backend in ("torch", "cpu", "auto"):
        eng = make_engine(gemm_backend=backend)
        packed = any(isinstance(m, PackedLinear) for m in eng.model.modules())
        assert packed == (backend != "torch")  # auto packs here: a float32 model on an AVX2 CPU
        outs[backend] = eng.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs["torch"], outs["cpu"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [d[t] for d, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lb = [d[t] for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
    with pytest.raises(ValueError, match="gemm_backend"):
        make_engine(gemm_backend="mkl")
    with pytest.raises(ValueError, match="gemm_backend='cpu'"):
        make_engine(gemm_backend="cpu", quantization="int8")
    with pytest.raises(ValueError, match="gemm_backend='cpu'"):
        make_engine(gemm_backend="cpu", dtype="bfloat16")
    # auto at bfloat16: these float32 panels (of the bfloat16 weights) only on a CPU without bf16 arithmetic
    # (test_bf16_widened.py), else the bf16 panels (test_bf16_model_panels.py)
    from engine.config import cpu_has_fast_bf16

    eng = make_engine(dtype="bfloat16")
    assert eng.core.widened == any(isinstance(m, PackedLinear) for m in eng.model.modules()) != cpu_has_fast_bf16()
    kw = engine_kwargs_from_args(build_parser().parse_args(["serve", "--gemm-backend", "torch"]))
    assert kw == {"gemm_backend": "torch"}
