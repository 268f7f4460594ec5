"""Linear layers that keep a GGUF file's quantized blocks: `gemm_backend='gguf'` (and 'auto' on an AVX2 CPU) swaps
the linear layers of a float32 DecoderLM loaded from a .gguf file for BlockLinear layers holding the file's own
Q4_0 / Q4_1 / Q8_0 blocks (w = d * q + m per 32 input columns), multiplied by csrc/kvllm_cpu.cpp's block_linear.

Why: the loader dequantizes a GGUF model into float32 (transformers' GGUF support), so every decode step then
streams 4 bytes a weight although the file holds ~0.6. Here each weight stays one int8 q (plus a float32 d and m
per 32 weights, ~1.25 bytes a weight) and is dequantized inside the GEMM, in registers or into an L2 scratch panel. The
values are the loader's exactly (d * q is exact in float32, so d * q + m rounds once, as numpy's dequantization
does) and the kernel sums them in packed_linear's order: outputs are bit-identical to gemm_backend='cpu' on the
same model (tests/test_gguf_linear.py), and the model's weights take ~3x less memory. At the few rows of a small
decode batch the GEMMs are bound by weight bytes and run faster; at 64 rows and more they are bound by FMAs and
run at packed_linear's rate or a little below (docs/results/cpu_kernels.md, "GGUF blocks in the GEMM").

Which rows of which file tensor a layer holds is not derived from names: transformers permutes llama.cpp's q/k
rows back and kvllm fuses q/k/v and gate/up. Each model row is found in the file by the bits of its dequantized
values (an exact integer hash), and a layer is swapped only if the blocks it gathered dequantize to its weight
bit for bit; any other layer (another quantization type, no match) stays a PackedLinear.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models.packed import PANEL, PackedLinear, can_pack, rows_through, split_forward, swap_linears

logger = logging.getLogger("kvllm")

BLOCK = 32  # weights per GGUF block of the supported types


def decode_blocks(raw: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One GGUF tensor's rows of blocks (uint8 [rows, bytes]) -> (q int8 [rows, K], d, m float32 [rows, K / 32]) with
    w = d * q + m, or None for a type not handled here. m is -0.0 where the type has no offset (adding -0.0 leaves
    every value, signed zeros included, as d * q)."""
    rows = raw.shape[0]
    if type_name == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        q = blocks[..., 2:].copy().view(np.int8)
        m = None
    elif type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        blocks = raw.reshape(rows, -1, size)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if type_name == "Q4_1" else None
        packed = blocks[..., size - 16:]
        # a block's first 16 weights are the low nibbles of its 16 bytes, the next 16 the high ones
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)
        if type_name == "Q4_0":
            q -= 8
    else:
        return None
    d_t = torch.from_numpy(d.astype(np.float32))
    m_t = torch.from_numpy(m.astype(np.float32)) if m is not None else torch.full_like(d_t, -0.0)
    return torch.from_numpy(q.reshape(rows, -1)), d_t, m_t


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """w = d * q + m, [N, K] float32 (d, m per 32 columns)."""
    return d.repeat_interleave(BLOCK, 1) * q.float() + m.repeat_interleave(BLOCK, 1)


def row_keys(w: torch.Tensor, salt: torch.Tensor) -> list[int]:
    """An exact hash of each row's float32 bits (integer arithmetic, so any summation order gives the same key)."""
    return (w.contiguous().view(torch.int32).long() * salt[: w.shape[1]]).sum(dim=1).tolist()


class BlockIndex:
    """Every row of a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors, by row width and hash of its dequantized bits."""

    def __init__(self, path: Path | str, reader=None) -> None:
        import gguf

        reader = reader if reader is not None else gguf.GGUFReader(str(path))
        self.salt = torch.randint(1, 2 ** 31 - 1, (1 << 16,), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.long)
        self.tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.rows: dict[tuple[int, int], tuple[int, int]] = {}  # (K, key) -> (tensor, row)
        for t in reader.tensors:
            decoded = decode_blocks(np.asarray(t.data), t.tensor_type.name) if len(t.shape) == 2 else None
            if decoded is None or decoded[0].shape[1] > self.salt.numel():
                continue
            index = len(self.tensors)
            self.tensors.append(decoded)
            k = decoded[0].shape[1]
            for row, key in enumerate(row_keys(dequantize(*decoded), self.salt)):
                self.rows.setdefault((k, key), (index, row))

    def blocks_for(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q, d, m) whose dequantization equals `w` [N, K] bit for bit, gathered row by row from the file, or None."""
        n, k = w.shape
        if k % BLOCK or k > self.salt.numel():
            return None
        found = [self.rows.get((k, key)) for key in row_keys(w.detach(), self.salt)]
        if any(f is None for f in found):
            return None
        tensor_of = torch.tensor([t for t, _ in found])
        row_of = torch.tensor([r for _, r in found])
        q, d, m = (torch.empty(n, cols, dtype=dtype) for cols, dtype in
                   ((k, torch.int8), (k // BLOCK, torch.float32), (k // BLOCK, torch.float32)))
        for t in tensor_of.unique().tolist():
            mine = tensor_of == t
            for out, part in zip((q, d, m), self.tensors[t]):
                out[mine] = part[row_of[mine]]
        if not torch.equal(dequantize(q, d, m).view(torch.int32), w.detach().contiguous().view(torch.int32)):
            return None  # a hash collision, or rows equal in value but not in bits
        return q, d, m


def pack_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[N, K] / [N, K / 32] -> panels of 16 output channels, [N/16, K, 16] / [N/16, K / 32, 16], N padded with zero
    rows (d = m = 0)."""
    pad = -q.shape[0] % PANEL

    def panels(t: torch.Tensor) -> torch.Tensor:
        if pad:
            t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
        return t.view(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()

    return panels(q), panels(d), panels(m)


class BlockLinear(nn.Module):
    """Drop-in for a float32 nn.Linear whose weight is the dequantization of GGUF blocks (q, d, m)."""

    def __init__(self, linear: nn.Linear, blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self._ops = cpu_ext.load()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, d, m = pack_blocks(*blocks)
        self.register_buffer("q_packed", q)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)
        self.max_isa = 2  # the best kernel the CPU has; 1 keeps the AVX2 path (tests)
        self.many_rows: nn.Module | None = None  # a bf16 copy for calls of many rows (engine/models/row_split.py)
        self.many_rows_above = 0

    @property
    def weight(self) -> torch.Tensor:
        """The dense float32 weight [out, in] (a new tensor, for code that reads `.weight`; the forward never
        builds it)."""
        unpack = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1])[: self.out_features]  # noqa: E731
        return dequantize(unpack(self.q_packed), unpack(self.d), unpack(self.m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_forward(self, x, self.forward_float32)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        return rows_through(x, self.in_features, self.out_features, lambda x2, out: self._ops.block_linear(
            x2, self.q_packed, self.d, self.m, self.bias, out, self.max_isa))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def block_linears(model: nn.Module, path: Path | str | None = None) -> nn.Module:
    """In place: every linear layer of a float32 DecoderLM (and its LM head) whose weight the GGUF file at `path`
    (default: the file the model was loaded from, `model.gguf_path`) holds as Q4_0 / Q4_1 / Q8_0 blocks becomes a
    BlockLinear, every other one a PackedLinear. Raises ValueError (naming gemm_backend) where it cannot run."""
    why = can_pack(model)
    path = path if path is not None else getattr(model, "gguf_path", None)
    if why is None and path is None:
        why = "the model was not loaded from a .gguf file"
    if why is not None:
        raise ValueError(f"gemm_backend='gguf' cannot run: {why}")
    index = BlockIndex(path, getattr(model, "gguf_reader", None) if path == getattr(model, "gguf_path", None) else None)
    counts = {"blocks": 0, "float32": 0}

    def make(linear: nn.Linear) -> nn.Module:
        blocks = index.blocks_for(linear.weight)
        counts["blocks" if blocks is not None else "float32"] += 1
        return BlockLinear(linear, blocks) if blocks is not None else PackedLinear(linear)

    swap_linears(model, make)
    model.gguf_reader = None  # the index copied what it needs; the file's mapping can go
    logger.info("gemm_backend gguf: %d linear layers keep %s's blocks, %d stay float32 panels", counts["blocks"],
                Path(path).name, counts["float32"])
    model.block_layer_counts = counts
    return model
