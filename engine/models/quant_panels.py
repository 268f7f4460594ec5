"""Quantized weight panels for csrc/quant_panels.cpp: `QuantPanelLinear` multiplies float32 rows by a GGUF file's
4-bit (Q4_0, Q4_1) or 8-bit (Q8_0) blocks (w = d * q + m per 32 input columns) with AVX512-BF16's pair dot
products, the weights at their exact values (each q enters as an exact bfloat16 integer; d and m are applied per
block in float32), the rows rounded to bfloat16 inside the call, float32 out.

Layout: `pack_panels(q, d, m, bits)` turns [N, K] integers and [N, K / 32] float16-exact d, m into uint8
[ceil(N/16), K / 32, 320 (4-bit) or 544 (8-bit)]: per panel of 16 output channels and per block of 32 columns, the
block's weights (csrc/quant_panels.cpp says which byte holds which) then d (and m, 4-bit) as float16. N is padded
with zero channels.

Why: a decode step of a few sequences is bound by the bytes of weights it reads. These panels hold 0.625 (4-bit)
or 1.06 (8-bit) bytes a weight, against 2 for the bf16 panels and 1.25 for the blocks' float32 kernel
(engine/models/gguf_linear.py), and their dot products do twice the work per instruction of that kernel's FMAs
(docs/benchmarks.md, "Quantized panels"). engine/models/row_split.py swaps a .gguf model's BlockLinear layers for
these.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models.bf16_panels import available  # noqa: F401 (the same CPU check: csrc/panels.h)
from engine.models.gguf_linear import BLOCK, BlockLinear, dequantize
from engine.models.packed import PANEL, rows_through, split_forward

BLOCK_BYTES = {4: 320, 8: 544}


def as_panel_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """A layer's blocks (q [N, K], d, m [N, K / 32] float32, w = d * q + m) as (q, d, m, bits) for the panels, the
    same w: 4-bit q in 0..15 (Q4_1 as is; Q4_0's q in -8..7 with m = -0.0 becomes q + 8 with m = -8 d, exact in
    float16 as d is), 8-bit q in -128..127 with m zero (Q8_0, m = -0.0 as gguf_linear.decode_blocks gives it); None
    for any other range or where d or m needs more than float16."""
    lo, hi = int(q.min()), int(q.max())
    offset_free = bool((m == 0).all())
    if 0 <= lo and hi <= 15:
        q, bits = q.to(torch.int16), 4
    elif -8 <= lo and hi <= 7 and offset_free:
        q, m, bits = q.to(torch.int16) + 8, -8 * d, 4
    elif -128 <= lo and hi <= 127 and offset_free:
        q, m, bits = q.to(torch.int16), torch.full_like(d, -0.0), 8
    else:
        return None
    exact = lambda t: bool((t.half().float() == t).all())  # noqa: E731
    if not (exact(d) and exact(m)):
        return None
    return q, d, m, bits


def pack_panels(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] (0..15 for 4 bits, -128..127 for 8), d, m [N, K / 32] -> uint8 panels [ceil(N/16), K / 32,
    BLOCK_BYTES[bits]] (K a multiple of 32; m must be zero for 8 bits)."""
    n, k = q.shape
    if bits not in BLOCK_BYTES:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if k % BLOCK or d.shape != (n, k // BLOCK) or m.shape != d.shape:
        raise ValueError(f"q must be [N, K] with K a multiple of {BLOCK} and d, m [N, K / {BLOCK}], got "
                         f"{tuple(q.shape)}, {tuple(d.shape)}, {tuple(m.shape)}")
    if bits == 8 and bool((m != 0).any()):
        raise ValueError("8-bit panels hold no offset: m must be zero")
    pad = -n % PANEL
    q = q.to(torch.int32)
    if pad:
        q, d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, d, m))
    panels, blocks = q.shape[0] // PANEL, k // BLOCK
    # [panel, channel c, block, group g, half h, column e]: column 4g + 2h + e of the block
    v = q.view(panels, PANEL, blocks, 8, 2, 2)
    if bits == 4:
        body = (v[..., 0, :] | (v[..., 1, :] << 4)).to(torch.uint8)  # low nibble: 4g + e, high: 4g + 2 + e
        body = body.permute(0, 2, 3, 1, 4).reshape(panels, blocks, 256)  # byte 2c + e of group g
    else:
        body = v.to(torch.int8).view(torch.uint8).permute(0, 2, 3, 4, 1, 5).reshape(panels, blocks, 512)

    def scales(t: torch.Tensor) -> torch.Tensor:
        return t.view(panels, PANEL, blocks).transpose(1, 2).contiguous().half().view(torch.uint8).reshape(
            panels, blocks, 2 * PANEL)

    parts = [body, scales(d)] + ([scales(m)] if bits == 4 else [])
    return torch.cat(parts, dim=2).contiguous()


def unpack_panels(w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_panels: (q int16 [n, K], d, m float32 [n, K / 32])."""
    panels, blocks, size = w.shape
    bits = {v: k for k, v in BLOCK_BYTES.items()}[size]
    if bits == 4:
        byte = w[..., :256].reshape(panels, blocks, 8, PANEL, 2).permute(0, 3, 1, 2, 4).to(torch.int32)
        q = torch.stack([byte & 0x0F, byte >> 4], dim=-2)  # [panel, c, block, g, h, e]
    else:
        q = w[..., :512].contiguous().view(torch.int8).reshape(panels, blocks, 8, 2, PANEL, 2).permute(
            0, 4, 1, 2, 3, 5)
    q = q.reshape(panels * PANEL, blocks * BLOCK)[:n].to(torch.int16)

    def scales(at: int) -> torch.Tensor:
        t = w[..., at: at + 2 * PANEL].contiguous().view(torch.float16).float()  # [panel, block, 16]
        return t.transpose(1, 2).reshape(panels * PANEL, blocks)[:n]

    at = 256 if bits == 4 else 512
    d = scales(at)
    return q, d, (scales(at + 2 * PANEL) if bits == 4 else torch.full_like(d, -0.0))


class QuantPanelLinear(nn.Module):
    """y = x W^T + b for float32 x on the CPU, W a BlockLinear's blocks held as 4-bit or 8-bit panels, y float32.
    Under a row split its calls of more than `many_rows_above` rows run on `many_rows` (packed.split_forward)."""

    def __init__(self, blocks: BlockLinear, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> None:
        super().__init__()
        self._ops = cpu_ext.load()
        self.in_features, self.out_features = blocks.in_features, blocks.out_features
        self.bits = bits
        self.register_buffer("w_panels", pack_panels(q, d, m, bits))
        self.bias = blocks.bias
        self.max_isa = blocks.max_isa  # the fused stack reads one max_isa across a model's linears
        self.many_rows: nn.Module | None = None
        self.many_rows_above = 0

    @classmethod
    def of(cls, blocks: BlockLinear) -> QuantPanelLinear | None:
        """The layer's panels, or None where its blocks fit neither format (see as_panel_blocks)."""
        unpack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1])[: blocks.out_features]  # noqa: E731
        found = as_panel_blocks(unpack(blocks.q_packed), unpack(blocks.d), unpack(blocks.m))
        return None if found is None else cls(blocks, *found)

    @property
    def weight(self) -> torch.Tensor:
        """The dense float32 weight [out, in], exactly the blocks' (a new tensor; the forward never builds it)."""
        return dequantize(*unpack_panels(self.w_panels, self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_forward(self, x, self.forward_panels)

    def forward_panels(self, x: torch.Tensor) -> torch.Tensor:
        return rows_through(x, self.in_features, self.out_features,
                            lambda x2, out: self._ops.quant_panel_linear(x2, self.w_panels, self.bias, out))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"bias={self.bias is not None}")
