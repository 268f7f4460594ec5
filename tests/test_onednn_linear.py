"""bfloat16 linear layers packed once for oneDNN (engine/models/onednn.py): the layer against F.linear on the dense
weight (bit for bit) and a float64 reference, the model swap against the unpacked bfloat16 model, and the engine's
gemm_backend setting."""
import pytest
import torch
from torch import nn

from engine.models import onednn

if onednn.available() is not None:
    pytest.skip(f"no packed oneDNN bf16 here: {onednn.available()}", allow_module_level=True)

from engine.models.onednn import OneDnnLinear, can_pack, pack_linears  # noqa: E402


def _linear(n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin, g


@pytest.mark.parametrize("m", [0, 1, 2, 7, 64, 131])
@pytest.mark.parametrize("n,k,bias", [(16, 8, True), (35, 33, False), (200, 576, True)])
def test_onednn_linear_equals_f_linear_and_float64(m, n, k, bias):
    lin, g = _linear(n, k, bias, m * 1000 + n)
    layer = OneDnnLinear(lin)
    assert torch.equal(layer.weight, lin.weight)  # the packing round-trips exactly
    x = torch.randn(m, k, generator=g).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert torch.equal(out, lin(x))  # the same oneDNN product, without the per-call weight reorder
    # and within bfloat16 rounding of the exact product (float32 accumulation, one rounding of the output)
    w, b = lin.weight.double(), None if not bias else lin.bias.double()
    ref = x.double() @ w.T + (0 if b is None else b)
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.abs().T) * 1e-6 + 1e-6
    assert ((out.double() - ref).abs() <= bound).all()


def test_the_float64_bound_catches_a_wrong_channel():
    """The reference bound is tight enough to fail a layer whose output channels are off by one."""
    lin, g = _linear(48, 64, False, 3)
    x = torch.randn(8, 64, generator=g).bfloat16()
    out = OneDnnLinear(lin)(x).roll(1, dims=1)
    ref = x.double() @ lin.weight.double().T
    bound = ref.abs() * 2.0 ** -8 + 1e-6
    assert not ((out.double() - ref).abs() <= bound).all()


def test_onednn_linear_keeps_leading_dims_takes_strided_and_float32_input():
    lin, g = _linear(24, 16, True, 5)
    layer = OneDnnLinear(lin)
    x = torch.randn(2, 3, 16, generator=g).bfloat16()
    assert torch.equal(layer(x), lin(x)) and layer(x).shape == (2, 3, 24)
    wide = torch.randn(5, 20, generator=g).bfloat16()
    assert torch.equal(layer(wide[:, 2:18]), lin(wide[:, 2:18]))
    x32 = torch.randn(4, 16, generator=g)
    assert torch.equal(layer(x32), lin(x32.bfloat16()))  # cast to the weights' dtype first


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: tied embeddings and q/k/v bias
def test_packed_bf16_model_equals_the_unpacked_one(arch):
    from helpers_models import mixed_batch_outputs, tiny_decoder_pair

    c, model, packed = tiny_decoder_pair(arch, lambda m: pack_linears(m.bfloat16()), dtype=torch.bfloat16)
    assert not [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert sum(isinstance(m, OneDnnLinear) for m in packed.modules()) == 4 * c.num_layers + 1
    (ref, qf), (out, qp) = mixed_batch_outputs(c, [model, packed])
    assert out.dtype == torch.float32  # logits, as the unpacked model returns them
    assert torch.equal(out, ref)
    assert torch.equal(qp, qf)  # query recomputation reads qkv_proj.weight: the dense weight is rebuilt


def test_can_pack_says_why_not():
    from helpers_models import tiny_decoder_pair

    _, model, _ = tiny_decoder_pair("llama", lambda m: m)
    assert "float32" in can_pack(model)
    with pytest.raises(ValueError, match="gemm_backend='onednn' cannot run"):
        pack_linears(model)
    assert can_pack(model.bfloat16()) is None


def test_engine_gemm_backend_onednn(make_engine):
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40))]
    outs = {}
    for backend in ("torch", "onednn", "auto"):
        eng = make_engine(gemm_backend=backend, dtype="bfloat16")
        packed = any(isinstance(m, OneDnnLinear) for m in eng.model.modules())
        if backend == "auto":  # it packs a bfloat16 model for oneDNN on a CPU without the bf16 panels
            auto_on_panels = eng.core.panels  # (tests/test_bf16_model_panels.py)
        assert packed == (backend == "onednn" or (backend == "auto" and not auto_on_panels))
        outs[backend] = eng.generate(prompts, params, use_tqdm=False)
        eng.check_invariants()
    for backend in ("onednn", "auto"):  # the same products: the same tokens and logprobs
        if backend == "auto" and auto_on_panels:
            continue
        for a, b in zip(outs["torch"], outs[backend]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
    with pytest.raises(ValueError, match="gemm_backend='onednn' cannot run"):
        make_engine(gemm_backend="onednn", dtype="float32")
    with pytest.raises(ValueError, match="gemm_backend='onednn'"):
        make_engine(gemm_backend="onednn", dtype="bfloat16", quantization="int8")
