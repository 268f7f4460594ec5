"""4-bit panels (csrc/q4_linear.cpp, engine/models/q4_panels.py): the packing against its inverse, the kernel against
float64 over the bfloat16-rounded rows and the blocks' exact weights, Q4_0 / Q4_1 / Q8_0 blocks told apart, and the
row split that swaps a .gguf model's 4-bit layers for them: the fused stack equal bit for bit to the per-layer path,
and the model's answer within bfloat16 rounding of the blocks'."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models import q4_panels

try:
    cpu_ext.load()
except cpu_ext.ExtensionUnavailable as exc:
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)
if q4_panels.available() is not None:
    pytest.skip(f"no 4-bit panels here: {q4_panels.available()}", allow_module_level=True)

from engine.models.bf16_panels import Bf16PanelLinear  # noqa: E402
from engine.models.fused_layers import FusedLayerOps  # noqa: E402
from engine.models.gguf_linear import BlockLinear, dequantize  # noqa: E402
from engine.models.layer_ops import CpuLayerOps  # noqa: E402
from engine.models.packed import PackedLinear  # noqa: E402
from engine.models.q4_panels import Q4PanelLinear, as_unsigned, pack_q4, unpack_q4  # noqa: E402
from engine.models.row_split import split_rows  # noqa: E402

OPS = cpu_ext.load()


def _nibbles(n: int, k: int, seed: int = 0):
    """Q4_1-style blocks: q in 0..15, d > 0 and m float16 values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return q, d, m


def _q4_linear(x: torch.Tensor, w: torch.Tensor, n: int, bias=None) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    OPS.q4_linear(x, w, bias, out)
    return out


@pytest.mark.parametrize("n,k", [(1, 32), (40, 64), (48, 96), (37, 160)])
def test_pack_round_trip(n, k):
    q, d, m = _nibbles(n, k)
    w = pack_q4(q, d, m)
    assert w.dtype == torch.uint8 and w.shape == (-(-n // 16), k // 32, 320)
    q2, d2, m2 = unpack_q4(w, n)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)


def test_pack_checks_shapes():
    q, d, m = _nibbles(16, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_q4(q[:, :48], d, m)
    with pytest.raises(ValueError, match="d, m"):
        pack_q4(q, d[:, :1], m)


# (out channels, in columns): one panel, a padded panel, panel groups of 3 with a remainder of 1 or 2, SmolLM2's
# shapes; rows: the one-panel tiles (<= 4 rows), 8-row tiles of three panels, their remainders
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (80, 96), (960, 576), (576, 1536)])
def test_q4_linear_against_float64(n, k):
    q, d, m = _nibbles(n, k, seed=n)
    w = pack_q4(q, d, m)
    dense = dequantize(q.to(torch.int16), d, m).double()
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    for rows in (1, 2, 4, 5, 8, 11, 17):
        x = torch.randn(rows, k, generator=g) * 3
        xb = x.bfloat16().double()  # the kernel rounds its rows to bfloat16 once
        got = _q4_linear(x, w, n, bias).double()
        ref = xb @ dense.T + bias.double()
        # float32 sums of x (128 + q) d, less 128 d S: bounded by the terms' magnitude, not the result's
        mag = xb.abs() @ (143 * d.repeat_interleave(32, 1) + m.abs().repeat_interleave(32, 1)).double().T
        err = (got - ref).abs()
        assert (err <= 1e-6 * mag + 1e-6).all(), (rows, (err / mag).max().item())
        # far tighter than the bf16 panels' rounding of the weights: those would fail the bound above
        panels = torch.empty(rows, n)
        OPS.bf16_linear(x, Bf16PanelLinear(_linear(dense.float())).w_panels, None, panels)
        assert not ((panels.double() + bias.double() - ref).abs() <= 1e-6 * mag + 1e-6).all()


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


def test_a_wrong_nibble_order_or_scale_fails():
    """The bound above catches a layout slip: the two k pairs of a group swapped, or m read as d."""
    n, k = 48, 64
    q, d, m = _nibbles(n, k)
    x = torch.randn(5, k)
    ref = x.bfloat16().double() @ dequantize(q.to(torch.int16), d, m).double().T
    swapped = q.view(n, k // 4, 2, 2).flip(2).reshape(n, k)
    for wrong in (pack_q4(swapped, d, m), pack_q4(q, m, d)):
        assert (_q4_linear(x, wrong, n).double() - ref).abs().max() > 1e-2 * ref.abs().max()


def test_q4_linear_checks_inputs():
    q, d, m = _nibbles(32, 64)
    w = pack_q4(q, d, m)
    with pytest.raises(ValueError, match="columns"):
        _q4_linear(torch.randn(2, 96), w, 32)
    with pytest.raises(ValueError, match="320"):
        OPS.q4_linear(torch.randn(2, 64), w[..., :256].contiguous(), None, torch.empty(2, 32))
    with pytest.raises(ValueError, match="channels"):
        _q4_linear(torch.randn(2, 64), w, 40)


def test_which_blocks_are_4_bit():
    q, d, m = _nibbles(16, 64)
    same = as_unsigned(q.to(torch.int8), d, m)  # Q4_1: as is
    assert same is not None and torch.equal(same[0], q) and torch.equal(same[2], m)
    # Q4_0: q - 8 in -8..7 with m = -0.0 becomes q with m = -8 d, the same weights bit for bit
    signed = (q.to(torch.int16) - 8).to(torch.int8)
    minus0 = torch.full_like(d, -0.0)
    got = as_unsigned(signed, d, minus0)
    assert got is not None and torch.equal(got[0], q)
    assert torch.equal(dequantize(got[0].to(torch.int16), got[1], got[2]).view(torch.int32),
                       dequantize(signed, d, minus0).view(torch.int32))
    # Q8_0's range, or an offset with Q4_0's range, or scales float16 cannot hold: not 4-bit panels
    assert as_unsigned(torch.randint(-128, 128, (16, 64), dtype=torch.int8), d, minus0) is None
    assert as_unsigned(signed, d, m) is None
    assert as_unsigned(q.to(torch.int8), d + 1e-9, m) is None


def _blocks_of(lin: nn.Linear) -> BlockLinear:
    """A float32 nn.Linear quantized to Q4_1-style blocks (its weight replaced by their dequantization)."""
    n, k = lin.weight.shape
    w = lin.weight.detach().view(n, k // 32, 32)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).clamp_min(1e-4).half().float()
    m = lo.half().float()
    q = ((w - m[..., None]) / d[..., None]).round().clamp(0, 15).reshape(n, k).to(torch.int8)
    with torch.no_grad():
        lin.weight.copy_(dequantize(q, d, m))
    return BlockLinear(lin, (q, d, m))


def test_q4_layer_of_a_block_layer():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    blocks = _blocks_of(lin)
    q4 = Q4PanelLinear.of(blocks)
    assert q4 is not None
    assert torch.equal(q4.weight.view(torch.int32), blocks.weight.view(torch.int32))
    x = torch.randn(3, 7, 96)
    assert torch.equal(q4(x), _q4_linear(x.reshape(21, 96), q4.w_q4, 40, q4.bias).view(3, 7, 40))
    # bf16-rounded rows against the blocks' float32 rows
    assert torch.allclose(q4(x), blocks(x), atol=3e-2 * blocks(x).abs().max().item(), rtol=0)
    # a layer of 8-bit blocks has none
    g = torch.Generator().manual_seed(0)
    q8 = BlockLinear(nn.Linear(64, 16, bias=False), (torch.randint(-128, 128, (16, 64), generator=g,
                                                                   dtype=torch.int8),
                                                     torch.rand(16, 2, generator=g).half().float(),
                                                     torch.full((16, 2), -0.0)))
    assert Q4PanelLinear.of(q8) is None


def _q4_model():
    from helpers_models import tiny_decoder_pair

    def to_blocks(model):
        from engine.models.packed import swap_linears

        return swap_linears(model, _blocks_of)

    return tiny_decoder_pair("llama", to_blocks, std=0.2)[2]


ROWS, Q4_ROWS = 2, 6


def test_split_swaps_4_bit_layers_and_the_stack_takes_them(monkeypatch):
    from test_row_split import _run

    split = _q4_model()
    assert split_rows(split, rows=ROWS, q4_rows=Q4_ROWS) == 3 * 4 + 1
    lins = [m for m in split.modules() if isinstance(m, (BlockLinear, PackedLinear, Q4PanelLinear))]
    assert lins and all(isinstance(m, Q4PanelLinear) and m.many_rows_above == Q4_ROWS and
                        isinstance(m.many_rows, Bf16PanelLinear) for m in lins)
    assert isinstance(split.lm_head_layer, Q4PanelLinear) and split.many_rows_above == Q4_ROWS
    split.set_layer_ops(FusedLayerOps(split))
    loop = _q4_model()
    split_rows(loop, rows=ROWS, q4_rows=Q4_ROWS)
    loop.set_layer_ops(CpuLayerOps())
    base = _q4_model()  # the blocks' float32 kernel
    base.set_layer_ops(CpuLayerOps())
    calls = []
    real = FusedLayerOps.forward_layers
    monkeypatch.setattr(FusedLayerOps, "forward_layers", lambda self, *a: calls.append(1) or real(self, *a))
    tables = [[5, 17, 2, 11], [3, 19, 14, 0]]
    few = [(tables, [2, 2], [2, 2], [0, 1, 40, 41]), (tables, [3, 3], [5, 5], [2, 3, 4, 42, 43, 44])]  # <= 6 rows
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


def test_split_keeps_the_row_count_of_blocks_where_a_layer_is_not_4_bit():
    model = _q4_model()
    model.layers[1].mlp.down_proj = PackedLinear(nn.Linear(96, 64))
    split_rows(model, rows=ROWS, q4_rows=Q4_ROWS)
    assert model.many_rows_above == ROWS  # the stack's few-row weights hold a float32 layer
    assert isinstance(model.layers[0].mlp.down_proj, Q4PanelLinear)
    assert model.layers[1].mlp.down_proj.many_rows_above == ROWS
    plain = _q4_model()
    split_rows(plain, rows=ROWS, q4_rows=None)  # the 4-bit panels off: the blocks stay
    assert all(not isinstance(m, Q4PanelLinear) for m in plain.modules()) and plain.many_rows_above == ROWS
