"""Weight-only int8 (engine/models/quant.py): quantisation, panel packing and the C++ kernel against plain
float64 references, then a quantised tiny DecoderLM end to end."""
import pytest
import torch
from torch import nn

from engine.attention import cpu_ext

if not cpu_ext.is_available():
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here", allow_module_level=True)
    cpu_ext.load()  # a compiler exists, so the build must work: raise its error instead of skipping

from engine.models.quant import Int8Linear, pack_panels, quantize_int8, quantize_weight  # noqa: E402


@pytest.mark.parametrize("group,groups", [(None, 1), (10, 5), (32, 1)])  # 32 does not divide 50: per channel
def test_quantize_weight_is_per_group_round_to_nearest(group, groups):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g) * torch.linspace(0.01, 3, 37)[:, None]
    w[5] = 0  # an all-zero channel must not divide by zero
    q, scale = quantize_weight(w, group)
    size = 50 // groups
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    assert scale.shape == (37, groups)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    for n in (0, 17, 36):  # the largest magnitude of each group maps to +-127
        for j in range(groups):
            assert torch.isclose(scale[n, j], w[n, j * size:(j + 1) * size].abs().max() / 127)
    full_scale = torch.stack([scale[:, kk // size] for kk in range(50)], dim=1).double()
    err = (q.double() * full_scale - w.double()).abs()
    assert (err <= full_scale / 2 + 1e-7).all()  # round to nearest
    assert torch.equal(q[5], torch.zeros(50, dtype=torch.int8))


def test_pack_panels_layout():
    q = torch.randint(-127, 128, (35, 9), dtype=torch.int8)
    scale = torch.rand(35, 3)
    packed, pscale = pack_panels(q, scale)
    assert packed.shape == (3, 9, 16) and pscale.shape == (3, 3, 16)
    for n in range(48):
        for k in range(9):
            assert int(packed[n // 16, k, n % 16]) == (int(q[n, k]) if n < 35 else 0)
        for j in range(3):
            assert float(pscale[n // 16, j, n % 16]) == (float(scale[n, j]) if n < 35 else 1.0)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n,k,bias,group", [(16, 8, True, None), (35, 64, False, 32), (70, 33, True, 32),
                                            (20, 96, True, 8)])
def test_int8_linear_matches_float64_dequantized(portable, m, n, k, bias, group):
    g = torch.Generator().manual_seed(m * 100 + n)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    layer = Int8Linear(lin, group)
    layer.force_portable = portable
    x = torch.randn(m, k, generator=g)
    q, scale = quantize_weight(lin.weight, group)  # the reference dequantises independently of the packing
    size = k // scale.shape[1]
    w = torch.stack([q[:, kk].double() * scale[:, kk // size].double() for kk in range(k)], dim=1)
    ref = x.double() @ w.T + (lin.bias.double() if bias else 0)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert (out.double() - ref).abs().max().item() < 1e-4
    assert torch.allclose(layer.weight.double(), w)
    # and the quantisation itself is close to the float layer (per-channel int8: ~0.5% relative error)
    full = lin(x).double()
    assert ((out.double() - full).norm() / full.norm()).item() < 2e-2


def test_int8_linear_keeps_leading_dims_and_dtype():
    lin = nn.Linear(16, 24)
    layer = Int8Linear(lin)
    x = torch.randn(2, 3, 16)
    assert layer(x).shape == (2, 3, 24)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_int8_linear_bad_inputs_name_the_field():
    layer = Int8Linear(nn.Linear(16, 20))
    ops = cpu_ext.load()
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="x must be"):
        ops.int8_linear(x.double(), layer.w_packed, layer.scale, None, torch.empty(3, 20), False)
    with pytest.raises(ValueError, match="w_packed has K=16, x has K=8"):
        ops.int8_linear(torch.randn(3, 8), layer.w_packed, layer.scale, None, torch.empty(3, 20), False)
    with pytest.raises(ValueError, match="out has N=40"):
        ops.int8_linear(x, layer.w_packed, layer.scale, None, torch.empty(3, 40), False)
    with pytest.raises(ValueError, match="bias must be"):
        ops.int8_linear(x, layer.w_packed, layer.scale, torch.zeros(3), torch.empty(3, 20), False)
    with pytest.raises(ValueError, match="scale must be"):
        ops.int8_linear(x, layer.w_packed, torch.ones(2, 3, 16), None, torch.empty(3, 20), False)
    with pytest.raises(ValueError, match="group_size"):
        Int8Linear(nn.Linear(16, 20), group_size=0)


def _tiny_models():
    from helpers_models import tiny_decoder_pair

    return tiny_decoder_pair("qwen2", quantize_int8)  # tied embeddings, q/k/v bias


def test_quantized_tiny_model_tracks_float32():
    from helpers_models import mixed_batch_outputs

    c, model, quant = _tiny_models()
    linears = [m for m in quant.modules() if isinstance(m, nn.Linear)]
    assert not linears and sum(isinstance(m, Int8Linear) for m in quant.modules()) == 4 * c.num_layers + 1
    (ref, qf), (out, qr) = mixed_batch_outputs(c, [model, quant])
    assert ((out - ref).norm() / ref.norm()).item() < 5e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.7
    # query recomputation reads qkv_proj.weight directly: the dequantised weight keeps it working
    assert ((qr - qf).norm() / qf.norm()).item() < 5e-2


def test_quantize_rejects_non_cpu_models():
    _, _, quant = _tiny_models()
    with pytest.raises(ValueError, match="CPU models only"):
        quantize_int8(quant.to("meta"))


def test_engine_quantization_flag_runs_int8_and_reaches_the_cli(make_engine):
    from engine import SamplingParams
    from engine.models.quant import Int8Linear
    from server.cli import build_parser, engine_kwargs_from_args

    kw = engine_kwargs_from_args(build_parser().parse_args(["serve", "--quantization", "int8", "--threads", "1"]))
    assert kw == {"quantization": "int8"}  # --threads is applied before torch loads, not an engine argument
    eng = make_engine(quantization="int8")
    assert any(isinstance(m, Int8Linear) for m in eng.model.modules())
    out = eng.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="quantization"):
        make_engine(quantization="int4")
