"""bench/activation_quant.py's rounding, on hand-worked rows."""
import torch

from bench.activation_quant import int8_round


def test_int8_round_per_row_and_per_block():
    x = torch.tensor([[1.0, -2.54, 0.01, 0.0]], dtype=torch.float64)
    # one scale for the row: 2.54 / 127 = 0.02; 1.0 -> 50 steps, 0.01 -> half a step, rounded to even (0)
    assert torch.allclose(int8_round(x, 0), torch.tensor([[1.0, -2.54, 0.0, 0.0]], dtype=torch.float64))
    # blocks of two: the second block's scale is 0.01 / 127, so 0.01 survives exactly
    assert torch.allclose(int8_round(x, 2), torch.tensor([[1.0, -2.54, 0.01, 0.0]], dtype=torch.float64))
    # an all-zero block stays zero (no division by a zero scale)
    assert int8_round(torch.zeros(1, 4), 2).eq(0).all()
