"""Quantized panels (csrc/quant_panels.cpp, engine/models/quant_panels.py), 4-bit and 8-bit: the packing against its
inverse, the kernel against float64 over the bfloat16-rounded rows and the blocks' exact weights, which blocks fit
which format (Q4_0, Q4_1, Q8_0), and the row split that swaps a .gguf model's block layers for them: the fused stack
equal bit for bit to the per-layer path, and the model's answer within bfloat16 rounding of the blocks'."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models import quant_panels

try:
    cpu_ext.load()
except cpu_ext.ExtensionUnavailable as exc:
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)
if quant_panels.available() is not None:
    pytest.skip(f"no quantized panels here: {quant_panels.available()}", allow_module_level=True)

from engine.models.bf16_panels import Bf16PanelLinear  # noqa: E402
from engine.models.fused_layers import FusedLayerOps  # noqa: E402
from engine.models.gguf_linear import BlockLinear, dequantize  # noqa: E402
from engine.models.layer_ops import CpuLayerOps  # noqa: E402
from engine.models.packed import PackedLinear  # noqa: E402
from engine.models.quant_panels import QuantPanelLinear, as_panel_blocks, pack_panels, unpack_panels  # noqa: E402
from engine.models.row_split import split_rows  # noqa: E402

OPS = cpu_ext.load()
BITS = [4, 8]


def _blocks(n: int, k: int, bits: int, seed: int = 0):
    """Q4_1-style blocks (q in 0..15, d > 0 and m float16 values) or Q8_0-style ones (q in -128..127, m = -0.0)."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
        m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16)
        m = torch.full((n, k // 32), -0.0)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    return q, d, m


def _linear_op(x: torch.Tensor, w: torch.Tensor, n: int, bias=None) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    OPS.quant_panel_linear(x, w, bias, out)
    return out


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n,k", [(1, 32), (40, 64), (48, 96), (37, 160)])
def test_pack_round_trip(n, k, bits):
    q, d, m = _blocks(n, k, bits)
    w = pack_panels(q, d, m, bits)
    assert w.dtype == torch.uint8 and w.shape == (-(-n // 16), k // 32, {4: 320, 8: 544}[bits])
    q2, d2, m2 = unpack_panels(w, n)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2.view(torch.int32), m.view(torch.int32))


def test_pack_checks_its_inputs():
    q, d, m = _blocks(16, 64, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_panels(q[:, :48], d, m, 4)
    with pytest.raises(ValueError, match="d, m"):
        pack_panels(q, d[:, :1], m, 4)
    with pytest.raises(ValueError, match="bits"):
        pack_panels(q, d, m, 6)
    with pytest.raises(ValueError, match="no offset"):
        pack_panels(q, d, m, 8)


# (out channels, in columns): one panel, a padded panel, panel groups of 3 with a remainder of 1 or 2, SmolLM2's
# shapes; rows: the one-panel tiles (<= 4 rows), 8-row tiles of three panels, their remainders
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (80, 96), (960, 576), (576, 1536)])
def test_quant_panels_against_float64(n, k, bits):
    q, d, m = _blocks(n, k, bits, seed=n)
    w = pack_panels(q, d, m, bits)
    dense = dequantize(q, d, m).double()
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    # float32 sums of x q' d (q' = 128 + q for 4 bits), less 128 d S: bounded by the terms' magnitude
    big = (143 if bits == 4 else 128) * d.repeat_interleave(32, 1) + m.abs().repeat_interleave(32, 1)
    for rows in (1, 2, 4, 5, 8, 11, 17):
        x = torch.randn(rows, k, generator=g) * 3
        xb = x.bfloat16().double()  # the kernel rounds its rows to bfloat16 once
        got = _linear_op(x, w, n, bias).double()
        ref = xb @ dense.T + bias.double()
        mag = xb.abs() @ big.double().T
        err = (got - ref).abs()
        assert (err <= 1e-6 * mag + 1e-6).all(), (rows, (err / mag).max().item())
        # far tighter than the bf16 panels' rounding of the weights: those fail the bound
        panels = torch.empty(rows, n)
        OPS.bf16_linear(x, Bf16PanelLinear(_linear(dense.float())).w_panels, None, panels)
        assert not ((panels.double() + bias.double() - ref).abs() <= 1e-6 * mag + 1e-6).all()


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


@pytest.mark.parametrize("bits", BITS)
def test_a_wrong_weight_order_or_scale_fails(bits):
    """The bound above catches a layout slip: the two k pairs of a group swapped, or the scale of another block."""
    n, k = 48, 64
    q, d, m = _blocks(n, k, bits)
    x = torch.randn(5, k)
    ref = x.bfloat16().double() @ dequantize(q, d, m).double().T
    swapped = q.view(n, k // 4, 2, 2).flip(2).reshape(n, k)
    for wrong in (pack_panels(swapped, d, m, bits), pack_panels(q, d.flip(1), m, bits)):
        assert (_linear_op(x, wrong, n).double() - ref).abs().max() > 1e-2 * ref.abs().max()


def test_quant_panel_linear_checks_inputs():
    q, d, m = _blocks(32, 64, 4)
    w = pack_panels(q, d, m, 4)
    with pytest.raises(ValueError, match="columns"):
        _linear_op(torch.randn(2, 96), w, 32)
    with pytest.raises(ValueError, match="320"):
        OPS.quant_panel_linear(torch.randn(2, 64), w[..., :256].contiguous(), None, torch.empty(2, 32))
    with pytest.raises(ValueError, match="channels"):
        _linear_op(torch.randn(2, 64), w, 40)


def test_which_blocks_fit_which_format():
    q, d, m = _blocks(16, 64, 4)
    got = as_panel_blocks(q.to(torch.int8), d, m)  # Q4_1: as is
    assert got is not None and got[3] == 4 and torch.equal(got[0], q) and torch.equal(got[2], m)
    # Q4_0: q - 8 in -8..7 with m = -0.0 becomes q with m = -8 d, the same weights bit for bit
    signed = (q - 8).to(torch.int8)
    minus0 = torch.full_like(d, -0.0)
    got = as_panel_blocks(signed, d, minus0)
    assert got is not None and got[3] == 4 and torch.equal(got[0], q)
    assert torch.equal(dequantize(*got[:3]).view(torch.int32), dequantize(signed, d, minus0).view(torch.int32))
    # Q8_0: 8-bit, the same weights bit for bit (signed zeros included)
    q8 = torch.randint(-128, 128, (16, 64), dtype=torch.int8)
    got = as_panel_blocks(q8, d, minus0)
    assert got is not None and got[3] == 8
    assert torch.equal(dequantize(*got[:3]).view(torch.int32), dequantize(q8, d, minus0).view(torch.int32))
    # an offset with a signed range, or scales float16 cannot hold: neither format
    assert as_panel_blocks(signed, d, m) is None
    assert as_panel_blocks(q.to(torch.int8), d + 1e-9, m) is None


def _blocks_of(lin: nn.Linear, bits: int = 4) -> BlockLinear:
    """A float32 nn.Linear quantized to Q4_1-style or Q8_0-style blocks (its weight replaced by their
    dequantization)."""
    n, k = lin.weight.shape
    w = lin.weight.detach().view(n, k // 32, 32)
    if bits == 4:
        lo, hi = w.amin(-1), w.amax(-1)
        d = ((hi - lo) / 15).clamp_min(1e-4).half().float()
        m = lo.half().float()
        q = ((w - m[..., None]) / d[..., None]).round().clamp(0, 15)
    else:
        d = (w.abs().amax(-1) / 127).clamp_min(1e-4).half().float()
        m = torch.full_like(d, -0.0)
        q = (w / d[..., None]).round().clamp(-128, 127)
    q = q.reshape(n, k).to(torch.int8)
    with torch.no_grad():
        lin.weight.copy_(dequantize(q, d, m))
    return BlockLinear(lin, (q, d, m))


@pytest.mark.parametrize("bits", BITS)
def test_panel_layer_of_a_block_layer(bits):
    torch.manual_seed(0)
    blocks = _blocks_of(nn.Linear(96, 40), bits)
    layer = QuantPanelLinear.of(blocks)
    assert layer is not None and layer.bits == bits
    assert torch.equal(layer.weight.view(torch.int32), blocks.weight.view(torch.int32))
    x = torch.randn(3, 7, 96)
    assert torch.equal(layer(x), _linear_op(x.reshape(21, 96), layer.w_panels, 40, layer.bias).view(3, 7, 40))
    # bf16-rounded rows against the blocks' float32 rows
    assert torch.allclose(layer(x), blocks(x), atol=3e-2 * blocks(x).abs().max().item(), rtol=0)


def _block_model(bits_of=lambda name: 4):
    from helpers_models import tiny_decoder_pair

    def to_blocks(model):
        from engine.models.packed import swap_linears

        return swap_linears(model, lambda lin: _blocks_of(lin, bits_of(lin)))

    return tiny_decoder_pair("llama", to_blocks, std=0.2)[2]


ROWS, PANEL_ROWS = 2, {4: 6, 8: 5}


@pytest.mark.parametrize("bits", BITS)
def test_split_swaps_block_layers_and_the_stack_takes_them(monkeypatch, bits):
    from test_row_split import _run

    split = _block_model(lambda lin: bits)
    assert split_rows(split, rows=ROWS, panel_rows=PANEL_ROWS) == 3 * 4 + 1
    lins = [m for m in split.modules() if isinstance(m, (BlockLinear, PackedLinear, QuantPanelLinear))]
    assert lins and all(isinstance(m, QuantPanelLinear) and m.bits == bits and
                        m.many_rows_above == PANEL_ROWS[bits] and isinstance(m.many_rows, Bf16PanelLinear)
                        for m in lins)
    assert isinstance(split.lm_head_layer, QuantPanelLinear) and split.many_rows_above == PANEL_ROWS[bits]
    split.set_layer_ops(FusedLayerOps(split))
    loop = _block_model(lambda lin: bits)
    split_rows(loop, rows=ROWS, panel_rows=PANEL_ROWS)
    loop.set_layer_ops(CpuLayerOps())
    base = _block_model(lambda lin: bits)  # the blocks' float32 kernel
    base.set_layer_ops(CpuLayerOps())
    calls = []
    real = FusedLayerOps.forward_layers
    monkeypatch.setattr(FusedLayerOps, "forward_layers", lambda self, *a: calls.append(1) or real(self, *a))
    tables = [[5, 17, 2, 11], [3, 19, 14, 0]]
    few = [(tables, [2, 2], [2, 2], [0, 1, 40, 41]), (tables, [2, 3], [4, 5], [2, 3, 42, 43, 44])]  # <= 5 rows
    many = [(tables, [5, 6], [5, 6], list(range(5)) + list(range(40, 46)))]  # 11 rows: the bf16 copies
    for steps in (few, many):
        calls.clear()
        fused, fused_pages = _run(split, steps, torch.bfloat16)
        assert len(calls) == len(steps)
        want, want_pages = _run(loop, steps, torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(fused, want))
        assert torch.equal(fused_pages.nan_to_num(), want_pages.nan_to_num())
        ref, _ = _run(base, steps, torch.bfloat16)
        for a, b in zip(fused, ref):  # bf16 rounding of the rows (and of the weights, for the copies)
            assert (a - b).abs().max() <= 0.05 * b.abs().max() and not torch.equal(a, b)


def test_the_stack_takes_the_smallest_limit_or_the_blocks_one():
    mixed = _block_model(lambda lin: 8 if lin.in_features == 96 else 4)  # the down projections 8-bit
    split_rows(mixed, rows=ROWS, panel_rows=PANEL_ROWS)
    assert mixed.layers[0].mlp.down_proj.bits == 8 and mixed.layers[0].self_attn.o_proj.bits == 4
    assert mixed.many_rows_above == PANEL_ROWS[8]
    model = _block_model()
    model.layers[1].mlp.down_proj = PackedLinear(nn.Linear(96, 64))
    split_rows(model, rows=ROWS, panel_rows=PANEL_ROWS)
    assert model.many_rows_above == ROWS  # the stack's few-row weights hold a float32 layer
    assert isinstance(model.layers[0].mlp.down_proj, QuantPanelLinear)
    assert model.layers[1].mlp.down_proj.many_rows_above == ROWS
    plain = _block_model()
    split_rows(plain, rows=ROWS, panel_rows=None)  # the quantized panels off: the blocks stay
    assert all(not isinstance(m, QuantPanelLinear) for m in plain.modules()) and plain.many_rows_above == ROWS
