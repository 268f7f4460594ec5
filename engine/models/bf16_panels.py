"""bfloat16 weight panels for csrc/bf16_linear.cpp: `Bf16PanelLinear` multiplies float32 rows by a layer's weight
rounded to bfloat16, with AVX512-BF16's pair dot products, into float32 outputs (the rows are rounded to bfloat16
inside the call; no bf16 tensor leaves it).

Layout: `pack_panels(w)` turns [N, K] into [ceil(N/16), K/2, 16, 2]: per panel of 16 output channels and per pair
of input columns, the channels' two weights side by side (one 64-byte load feeds a vdpbf16ps). N is padded with
zero channels, K must be even.

Why: a decode step of 8-64 sequences multiplies every weight by a few rows; there this kernel keeps the dot-product
units busier than oneDNN's bf16 GEMM, and does twice the work per instruction of the float32 kernels on a GGUF
file's blocks (docs/benchmarks.md, "GEMMs split by row count"). engine/models/row_split.py gives each layer of a
row-split model one for its many-row calls; `panel_linears` makes every linear of a bfloat16 model one
(engine/linear_path.py `panels_apply`).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models.packed import rows_through, swap_linears, unsharded_cpu_model

PANEL = 16


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 [ceil(N/16), K/2, 16, 2] (K even; N padded with zero rows)."""
    if w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features] with an even in_features, got "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    w = w.detach().to(torch.bfloat16)
    pad = -n % PANEL
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, PANEL, k // 2, 2).transpose(1, 2).contiguous()


def available() -> str | None:
    """None when the kernel runs here, else why not (one line)."""
    try:
        ops = cpu_ext.load()
    except cpu_ext.ExtensionUnavailable as exc:
        return f"the C++ extension is unavailable ({exc})"
    return None if ops.has_avx512_bf16() else "the CPU lacks AVX512-BF16"


class Bf16PanelLinear(nn.Module):
    """y = x W^T + b for float32 x on the CPU, W held as bf16 panels, y float32."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self._ops = cpu_ext.load()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w_panels", pack_panels(linear.weight))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)
        self.max_isa = 2  # one kernel path; the fused stack reads one max_isa across a model's linears

    @property
    def weight(self) -> torch.Tensor:
        """The dense bf16-rounded weight [out, in] (a new tensor; the forward never builds it)."""
        return self.w_panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_through(x, self.in_features, self.out_features,
                            lambda x2, out: self._ops.bf16_linear(x2, self.w_panels, self.bias, out))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def panel_linears(model: nn.Module) -> nn.Module:
    """In place: every linear layer of a loaded float32 or bfloat16 DecoderLM, the LM head included, becomes a
    Bf16PanelLinear (its weight rounded to bfloat16 once), and every other parameter (embedding, norms) becomes
    float32, the activations' dtype; returns the model. Loaded as bfloat16, a model never holds a float32 copy of
    its linears' weights. Raises ValueError where the kernel cannot run."""
    dtype = next(model.parameters()).dtype
    why = (unsharded_cpu_model(model, dtype, "the panels take") if dtype in (torch.float32, torch.bfloat16)
           else f"the model is {dtype}, the panels take float32 or bfloat16") or available()
    if why is not None:
        raise ValueError(f"bfloat16 panels cannot run: {why}")
    swap_linears(model, Bf16PanelLinear)
    for p in model.parameters():
        p.data = p.data.float()
    return model
