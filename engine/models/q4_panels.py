"""4-bit weight panels for csrc/q4_linear.cpp: `Q4PanelLinear` multiplies float32 rows by a GGUF file's Q4_0 /
Q4_1 blocks (w = d * q + m per 32 input columns) with AVX512-BF16's pair dot products, the weights at their exact
values (each nibble becomes the bfloat16 128 + q; d and m are applied per block in float32), the rows rounded to
bfloat16 inside the call, float32 out.

Layout: `pack_q4(q, d, m)` turns [N, K] nibbles and [N, K / 32] float16-exact d, m into uint8 [ceil(N/16), K / 32,
320]: per panel of 16 output channels and per block of 32 columns, 256 bytes of nibbles (csrc/q4_linear.cpp says
which byte holds which weight) then d and m as float16. N is padded with zero channels.

Why: a decode step of a few sequences is bound by the bytes of weights it reads. These panels hold 0.625 bytes a
weight, against 2 for the bf16 panels and 1.25 for the blocks' float32 kernel (engine/models/gguf_linear.py), and
their dot products do twice the work per instruction of that kernel's FMAs (docs/benchmarks.md, "4-bit panels").
engine/models/row_split.py swaps a .gguf model's 4-bit BlockLinear layers for these.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models.gguf_linear import BLOCK, BlockLinear, dequantize
from engine.models.packed import PANEL, rows_through, split_forward

BLOCK_BYTES = 320


def as_unsigned(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """A layer's blocks (q [N, K], d, m [N, K / 32] float32, w = d * q + m) as nibbles 0..15 with float16-exact d and
    m and the same w, or None where they are not 4-bit (Q8_0) or their d, m need more than float16. Q4_0's q in
    -8..7 (m = -0.0) becomes q + 8 with m = -8 d, exact in float16 as d is."""
    lo, hi = int(q.min()), int(q.max())
    if 0 <= lo and hi <= 15:
        pass
    elif -8 <= lo and hi <= 7 and bool((m == 0).all()):
        q, m = q.to(torch.int16) + 8, -8 * d
    else:
        return None
    exact = lambda t: bool((t.half().float() == t).all())  # noqa: E731
    if not (exact(d) and exact(m)):
        return None
    return q.to(torch.uint8), d, m


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Nibbles q [N, K] (0..15), d, m [N, K / 32] -> uint8 panels [ceil(N/16), K / 32, 320] (K a multiple of 32)."""
    n, k = q.shape
    if k % BLOCK or d.shape != (n, k // BLOCK) or m.shape != d.shape:
        raise ValueError(f"q must be [N, K] with K a multiple of {BLOCK} and d, m [N, K / {BLOCK}], got "
                         f"{tuple(q.shape)}, {tuple(d.shape)}, {tuple(m.shape)}")
    pad = -n % PANEL
    q = q.to(torch.int32)
    if pad:
        q, d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, d, m))
    panels, blocks = q.shape[0] // PANEL, k // BLOCK
    # [panel, channel c, block, group g, half h, column e]: column 4g + 2h + e of the block
    v = q.view(panels, PANEL, blocks, 8, 2, 2)
    nibbles = (v[..., 0, :] | (v[..., 1, :] << 4)).to(torch.uint8)  # low: 4g + e, high: 4g + 2 + e
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(panels, blocks, 256)  # byte 2c + e of group g

    def scales(t: torch.Tensor) -> torch.Tensor:
        return t.view(panels, PANEL, blocks).transpose(1, 2).contiguous().half().view(torch.uint8).reshape(
            panels, blocks, 2 * PANEL)

    return torch.cat([nibbles, scales(d), scales(m)], dim=2).contiguous()


def unpack_q4(w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_q4: (q uint8 [n, K], d, m float32 [n, K / 32])."""
    panels, blocks, _ = w.shape
    nib = w[..., :256].reshape(panels, blocks, 8, PANEL, 2).permute(0, 3, 1, 2, 4).to(torch.int32)
    q = torch.stack([nib & 0x0F, nib >> 4], dim=-2)  # [panel, c, block, g, h, e]
    q = q.reshape(panels * PANEL, blocks * BLOCK)[:n].to(torch.uint8)

    def scales(at: int) -> torch.Tensor:
        t = w[..., at: at + 2 * PANEL].contiguous().view(torch.float16).float()  # [panel, block, 16]
        return t.transpose(1, 2).reshape(panels * PANEL, blocks)[:n]

    return q, scales(256), scales(256 + 2 * PANEL)


def available() -> str | None:
    """None when the kernel runs here, else why not (one line)."""
    try:
        ops = cpu_ext.load()
    except cpu_ext.ExtensionUnavailable as exc:
        return f"the C++ extension is unavailable ({exc})"
    return None if ops.has_q4_linear() else "the CPU lacks AVX512-BF16"


class Q4PanelLinear(nn.Module):
    """y = x W^T + b for float32 x on the CPU, W a BlockLinear's 4-bit blocks held as 4-bit panels, y float32. Under
    a row split its calls of more than `many_rows_above` rows run on `many_rows` (packed.split_forward)."""

    def __init__(self, blocks: BlockLinear, nibbles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self._ops = cpu_ext.load()
        self.in_features, self.out_features = blocks.in_features, blocks.out_features
        self.register_buffer("w_q4", pack_q4(*nibbles))
        self.bias = blocks.bias
        self.max_isa = blocks.max_isa  # the fused stack reads one max_isa across a model's linears
        self.many_rows: nn.Module | None = None
        self.many_rows_above = 0

    @classmethod
    def of(cls, blocks: BlockLinear) -> Q4PanelLinear | None:
        """The layer's 4-bit panels, or None where its blocks are not 4-bit with float16 scales."""
        unpack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1])[: blocks.out_features]  # noqa: E731
        nibbles = as_unsigned(unpack(blocks.q_packed), unpack(blocks.d), unpack(blocks.m))
        return None if nibbles is None else cls(blocks, nibbles)

    @property
    def weight(self) -> torch.Tensor:
        """The dense float32 weight [out, in], exactly the blocks' (a new tensor; the forward never builds it)."""
        return dequantize(*unpack_q4(self.w_q4, self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_forward(self, x, self.forward_q4)

    def forward_q4(self, x: torch.Tensor) -> torch.Tensor:
        return rows_through(x, self.in_features, self.out_features,
                            lambda x2, out: self._ops.q4_linear(x2, self.w_q4, self.bias, out))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
