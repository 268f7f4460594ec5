"""The KV dtype studies' arithmetic: bench.greedy_agreement's split of where greedy runs part (hand-worked), and
bench.kv_quant_schemes' round trips, whose 'kvllm's pages' rows must be the engine's own formats."""
from __future__ import annotations

import math

import pytest
import torch

from bench.greedy_agreement import first_difference, margin, summarize
from bench.kv_quant_schemes import fp8_rows, hadamard, int8_channels, int8_rows
from paging.kv_format import kv_format


def test_first_difference_and_margin_hand_worked():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert margin({7: -0.1, 9: -2.4, 4: -0.35}) == pytest.approx(0.25)


def test_summarize_names_each_parting_its_margin_and_whether_it_took_the_runner_up():
    lp = lambda top, second, third: {top: -0.5, second: -0.6, third: -3.0}  # noqa: E731  margin 0.1
    ref = [([1, 2, 3], [lp(1, 8, 9), lp(2, 8, 9), lp(3, 8, 9)]),
           ([4, 5, 6], [lp(4, 8, 9), lp(5, 7, 9), lp(6, 8, 9)]),
           ([1, 1, 1], [lp(1, 8, 9)] * 3)]
    got = [([1, 2, 3], None), ([4, 7, 0], None), ([9, 1, 1], None)]
    s = summarize(ref, got, 3)
    assert s["equal"] == 1 and s["n"] == 3
    assert [(i, round(m, 6), ru) for i, m, ru in s["parts"]] == [(1, 0.1, True), (0, 0.1, False)]


def test_hadamard_is_orthonormal_and_keeps_dot_products():
    h = hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    q, k = torch.randn(5, 64, dtype=torch.float64), torch.randn(7, 64, dtype=torch.float64)
    assert torch.allclose((q @ h.double()) @ (k @ h.double()).T, q @ k.T)


@pytest.mark.parametrize("name,fn", [("int8", int8_rows),
                                     ("fp8_e4m3", lambda x: fp8_rows(x, torch.float8_e4m3fn, 448.0)),
                                     ("fp8_e5m2", lambda x: fp8_rows(x, torch.float8_e5m2, 57344.0))])
def test_the_studys_row_round_trips_are_the_engines_page_formats(name, fn):
    fmt = kv_format(name, torch.float32)
    x = torch.randn(3, 4, 64) * torch.tensor([0.01, 1.0, 30.0, 500.0]).view(1, 4, 1)
    rows = fmt.quantize(x)
    assert torch.equal(fn(x), fmt.values(rows) * fmt.scales(rows))


def test_grouped_and_per_channel_int8_hand_worked():
    x = torch.tensor([[127.0, 0.5, 31.75, 0.75]])
    # one scale for the row (1): steps of 1, halves to even; a scale per 2 values gives the second pair 0.25
    assert int8_rows(x).tolist() == [[127.0, 0.0, 32.0, 1.0]]
    assert int8_rows(x, group=2).tolist() == [[127.0, 0.0, 31.75, 0.75]]
    seq = torch.tensor([[[[254.0, 127.0], [127.0, -63.5]]]])  # one scale per channel over the two positions: 2, 1
    assert int8_channels(seq).tolist() == [[[[254.0, 127.0], [128.0, -64.0]]]]
    assert math.isclose(int8_rows(torch.tensor([[0.0, 0.0]])).abs().sum().item(), 0.0)


def test_the_studys_rotated_row_is_the_engines_int8_keys():
    """The study's "kvllm's int8 pages" row (K times its Hadamard matrix, rounded, rotated back) is what the engine's
    int8 K rows give back, up to float rounding: a value at a rounding boundary may land one step apart."""
    from bench.kv_quant_schemes import schemes

    fmt = kv_format("int8", torch.float32)
    x = torch.randn(3, 4, 64) * torch.tensor([0.01, 1.0, 30.0, 500.0]).view(1, 4, 1)
    study_k, study_v = schemes(64)["int8 K rotated (Hadamard), int8 V (kvllm's int8 pages)"]
    ours = fmt.dequantize(fmt.quantize(x, keys=True), keys=True)
    step = fmt.scales(fmt.quantize(x, keys=True))  # the rotated rows' scales
    assert ((ours - study_k(x)).abs() <= 1.01 * step).all()
    assert (ours - study_k(x)).abs().mean() < 1e-3 * x.abs().mean()
    assert torch.equal(study_v(x), fmt.dequantize(fmt.quantize(x)))
