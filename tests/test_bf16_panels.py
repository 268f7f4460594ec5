"""The bfloat16-panel GEMM (csrc/bf16_linear.cpp, engine/models/bf16_panels.py) against a float64 reference over the
same bf16-rounded inputs and weights: the products are exact, so the only error is float32 summation. Shapes cover
the tile's edges (rows past 8, fewer than 3 panels in the last group, a partial last panel), bias or none; the
packing is checked element by element, and a deliberately wrong packing is shown to fail the reference check."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models import bf16_panels

try:
    cpu_ext.load()
except cpu_ext.ExtensionUnavailable as exc:
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)

from engine.models.bf16_panels import Bf16PanelLinear, pack_panels  # noqa: E402

needs_kernel = pytest.mark.skipif(bf16_panels.available() is not None,
                                  reason=f"no bf16 panels here: {bf16_panels.available()}")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 x W^T + b over x and W rounded to bf16 (as the kernel reads them), bias in float32."""
    y = x.bfloat16().double() @ w.bfloat16().double().T
    return y if b is None else y + b.double()


def bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """float32 summation of K exact products and the bias: |error| <= (K + 1) * 2^-23 * (sum |x_k w_k| + |b|), a
    loose per-output bound."""
    mags = x.bfloat16().double().abs() @ w.bfloat16().double().abs().T
    if b is not None:
        mags = mags + b.double().abs()
    return (x.shape[1] + 1) * 2.0 ** -23 * mags + 1e-30


def test_packing_puts_each_weight_where_the_kernel_reads_it():
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)  # exact in bf16
    p = pack_panels(w)
    assert p.shape == (2, 3, 16, 2) and p.dtype == torch.bfloat16
    for n in range(32):
        for k in range(6):
            want = w[n, k] if n < 20 else 0.0  # channels past N are zero padding
            assert p[n // 16, k // 2, n % 16, k % 2].item() == want
    with pytest.raises(ValueError, match="even in_features"):
        pack_panels(torch.zeros(4, 7))


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 96), (16, 2), (100, 576), (33, 30)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64_over_bf16_inputs(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    layer = Bf16PanelLinear(lin)
    x = torch.randn(m, k, generator=g)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    err = (y.double() - reference(x, lin.weight, lin.bias)).abs()
    assert (err <= bound(x, lin.weight, lin.bias)).all()
    assert torch.equal(layer.weight, lin.weight.detach().bfloat16())


@needs_kernel
def test_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(7)
    lin = nn.Linear(64, 48, bias=False)
    layer = Bf16PanelLinear(lin)
    wide = torch.randn(5, 100, generator=g)
    x = wide[:, 10:74]  # rows 100 floats apart
    assert torch.equal(layer(x), layer(x.contiguous()))
    x3 = torch.randn(2, 3, 64, generator=g)
    assert torch.equal(layer(x3), layer(x3.reshape(6, 64)).view(2, 3, 48))


@needs_kernel
def test_threads_do_not_change_the_result():
    g = torch.Generator().manual_seed(8)
    layer = Bf16PanelLinear(nn.Linear(576, 960))
    x = torch.randn(20, 576, generator=g)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)  # each output is one tile's, summed in one order


@needs_kernel
def test_prefill_sized_calls_split_into_row_chunks():
    """More rows than one work item holds (256): the chunks cover every row once, a partial last chunk included."""
    g = torch.Generator().manual_seed(10)
    lin = nn.Linear(96, 40)
    layer = Bf16PanelLinear(lin)
    x = torch.randn(600, 96, generator=g)
    err = (layer(x).double() - reference(x, lin.weight, lin.bias)).abs()
    assert (err <= bound(x, lin.weight, lin.bias)).all()
    assert torch.equal(layer(x)[300:], layer(x[300:]))


@needs_kernel
@pytest.mark.parametrize("m", [1, 8, 9, 33, 300])
def test_prefetching_the_next_group_leaves_every_output_as_it_was(m):
    """The tiles prefetch the next panel group (csrc/bf16_linear.cpp rows_of); a prefetch moves no data into the
    result: outputs equal with it off, over a partial last group (13 panels: groups of 3, 3, 3, 3, 1) and prefill
    chunks. set_bf16_prefetch returns the previous setting."""
    g = torch.Generator().manual_seed(m)
    layer = Bf16PanelLinear(nn.Linear(96, 200))
    x = torch.randn(m, 96, generator=g)
    ops = cpu_ext.load()
    assert ops.set_bf16_prefetch(False) is True
    try:
        off = layer(x)
    finally:
        assert ops.set_bf16_prefetch(True) is False
    assert torch.equal(layer(x), off)


@needs_kernel
def test_the_check_catches_a_wrong_packing():
    """The reference check is not vacuous: panels whose column pairs are swapped (a transposed pair layout) or
    whose channels are shifted by one are far outside the bound."""
    g = torch.Generator().manual_seed(9)
    lin = nn.Linear(64, 48, bias=False)
    layer = Bf16PanelLinear(lin)
    x = torch.randn(9, 64, generator=g)
    ok = (layer(x).double() - reference(x, lin.weight, None)).abs()
    assert (ok <= bound(x, lin.weight)).all()
    for wrong in (layer.w_panels.flip(-1).contiguous(), layer.w_panels.roll(1, dims=2).contiguous()):
        out = torch.empty(9, 48)
        cpu_ext.load().bf16_linear(x, wrong, None, out)
        assert ((out.double() - reference(x, lin.weight, None)).abs() > 100 * bound(x, lin.weight)).any()


@needs_kernel
def test_bad_inputs_name_the_field():
    ops = cpu_ext.load()
    w = pack_panels(torch.randn(32, 64))
    with pytest.raises(ValueError, match="x has 62 columns"):
        ops.bf16_linear(torch.randn(2, 62), w, None, torch.empty(2, 32))
    with pytest.raises(ValueError, match="out must be"):
        ops.bf16_linear(torch.randn(2, 64), w, None, torch.empty(2, 50))
    with pytest.raises(ValueError, match="bias must be"):
        ops.bf16_linear(torch.randn(2, 64), w, torch.zeros(31), torch.empty(2, 32))
    with pytest.raises(ValueError, match="x must be"):
        ops.bf16_linear(torch.randn(2, 64).double(), w, None, torch.empty(2, 32))
