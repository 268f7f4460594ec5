"""How a KV page stores one (token, KV head) row: the `--kv-cache-dtype` formats.

Float formats (float32, bfloat16, float16) store the head_dim values as they are. The 8-bit formats store them in one
byte each and, on the CPU, a float32 scale right after them in the same row: a row is `head_dim + 4` elements of the
page tensor's 1-byte dtype (int8, float8_e5m2 or float8_e4m3fn), the last 4 being the scale's bytes. Keeping the
scale inside its row means every copy of a slot (compaction, swap, the lossless full tier, prefix sharing,
tensor-parallel shards) moves its scale with it, with no second tensor to keep in step.

- int8: symmetric, per token and per KV head, scale = max|x| / 127, stored = round(x / scale) (round half to even,
  as torch and the C++ write op both do). Symmetric: K after RoPE and V are centred near zero, and a zero point would
  cost an add per element in the attention kernel for no measured gain at 8 bits (KIVI, arXiv 2402.02750, needs
  asymmetry at 2 bits, not 8). K rows (head_dim a power of two) are stored rotated: H k, H the orthonormal
  Walsh-Hadamard matrix (`hadamard`), so a few outlier channels no longer set the scale of every other value
  (QuaRot, arXiv 2404.00456); H is symmetric and H H = I, so the attention kernels rotate q alike (q.k = Hq.Hk) and
  `dequantize(rows, keys=True)` rotates back. Measured: 3.4x less KL to float32 attention than unrotated rows
  (docs/benchmarks.md, "8-bit K and V rows, scheme by scheme").
- fp8_e5m2 / fp8_e4m3: the same per-row scale maps max|x| to the format's largest finite value, then the value is
  rounded to the format (nearest even). On CUDA, FlashInfer reads fp8 pages with one scale per tensor, so there the
  rows carry no scale (scale 1, as vLLM does without calibration): `scaled=False`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # a float32 scale at the end of each 8-bit row

# the flag's values (vLLM's spellings included) -> (canonical name, page dtype)
_FLOAT = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
_EIGHT_BIT = {"int8": ("int8", torch.int8), "fp8": ("fp8_e4m3", torch.float8_e4m3fn),
              "fp8_e4m3": ("fp8_e4m3", torch.float8_e4m3fn), "fp8_e5m2": ("fp8_e5m2", torch.float8_e5m2)}
KV_DTYPE_NAMES = (*_FLOAT, *_EIGHT_BIT)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) times the orthonormal Sylvester-Hadamard matrix, in float32: butterflies
    (a + b, a - b) over strides 1, 2, 4, ..., then one multiply by float32(1 / sqrt(D)): the operations of the C++
    write op (csrc/layer_ops.cpp fwht), so both store the same bytes."""
    d = x.shape[-1]
    shape, x = x.shape, x.float()
    h = 1
    while h < d:
        y = x.reshape(-1, d // (2 * h), 2, h)
        x = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2).reshape(shape)
        h *= 2
    return x * torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)


@dataclass(frozen=True)
class KVFormat:
    name: str  # canonical: float32, bfloat16, float16, int8, fp8_e4m3, fp8_e5m2
    storage: torch.dtype  # the page tensor's dtype
    scaled: bool = False  # rows end in a float32 scale (8-bit formats on the CPU)

    @property
    def is_8bit(self) -> bool:
        return self.storage in _QMAX

    def width(self, head_dim: int) -> int:
        """Elements of the page tensor per (token, KV head) row."""
        return head_dim + SCALE_BYTES if self.scaled else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.width(head_dim) * torch.empty((), dtype=self.storage).element_size()

    def rotates_keys(self, head_dim: int) -> bool:
        """Whether K rows are stored rotated (int8 rows with their scales, head_dim a power of two)."""
        return self.storage == torch.int8 and self.scaled and head_dim >= 2 and head_dim & (head_dim - 1) == 0

    def quantize(self, x: torch.Tensor, keys: bool = False) -> torch.Tensor:
        """Rows [..., D] of any float dtype -> stored rows [..., width(D)] (the torch reference of the C++ write op,
        csrc/layer_ops.cpp write_kv, which gives the same bytes). keys=True: K rows (rotated where
        `rotates_keys`)."""
        if not self.is_8bit:
            return x.to(self.storage)
        qmax = _QMAX[self.storage]
        x = hadamard(x) if keys and self.rotates_keys(x.shape[-1]) else x.float()
        if not self.scaled:  # fp8 pages read with scale 1 (FlashInfer): clamp, as a cast of a larger value is NaN
            return x.clamp(-qmax, qmax).to(self.storage)
        scale = x.abs().amax(-1, keepdim=True) / qmax
        y = (x / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-qmax, qmax)
        vals = y.round().to(torch.int8) if self.storage == torch.int8 else y.to(self.storage)
        out = torch.empty((*x.shape[:-1], self.width(x.shape[-1])), dtype=self.storage, device=x.device)
        out[..., :x.shape[-1]] = vals
        out.view(torch.uint8)[..., x.shape[-1]:] = scale.view(torch.uint8)
        return out

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """The stored values of rows [..., width] without the scale, as float32 (exact for every format)."""
        d = rows.shape[-1] - SCALE_BYTES if self.scaled else rows.shape[-1]
        return rows[..., :d].float()

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., 1] float32 scales of rows [..., width] (ones where rows carry none)."""
        if not self.scaled:
            return torch.ones((*rows.shape[:-1], 1), dtype=torch.float32, device=rows.device)
        d = rows.shape[-1] - SCALE_BYTES
        raw = rows.view(torch.uint8)[..., d:]
        try:
            return raw.view(torch.float32)  # in place where the strides allow (a page tensor's rows)
        except RuntimeError:
            return raw.contiguous().view(torch.float32)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None, keys: bool = False) -> torch.Tensor:
        """Stored rows [..., width] -> the values attention sees, [..., D], in `dtype` (default: float32 for 8-bit
        formats, the page dtype otherwise). keys=True: K rows, rotated back where `rotates_keys`."""
        if not self.is_8bit:
            return rows if dtype is None else rows.to(dtype)
        x = self.values(rows) * self.scales(rows) if self.scaled else rows.float()
        if keys and self.rotates_keys(x.shape[-1]):
            x = hadamard(x)
        return x if dtype is None else x.to(dtype)

    def dequantize_kv(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows [2, ..., width] (K then V) -> values [2, ..., D], K rotated back where `rotates_keys`."""
        if not self.rotates_keys(rows.shape[-1] - SCALE_BYTES):  # rotated rows are int8 ones with their scale
            return self.dequantize(rows, dtype)
        x = self.dequantize(rows)
        x[0] = hadamard(x[0])
        return x if dtype is None else x.to(dtype)


def kv_format(name: str | torch.dtype | KVFormat, model_dtype: torch.dtype, row_scales: bool = True) -> KVFormat:
    """The format `--kv-cache-dtype name` means for a model computing in `model_dtype` ('auto': the model's dtype).
    row_scales=False: the attention backend reads 8-bit pages without per-row scales (FlashInfer's fp8 pages), so
    the rows carry none and int8, which needs them, is refused. Raises ValueError naming the flag."""
    if isinstance(name, KVFormat):
        return name
    if isinstance(name, torch.dtype):
        if name not in _FLOAT.values():
            raise ValueError(f"kv_cache_dtype: a torch dtype must be float32, bfloat16 or float16, got {name}")
        return KVFormat(str(name).removeprefix("torch."), name)
    if name == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype)
    if name in _FLOAT:
        dt = _FLOAT[name]
        return KVFormat(str(dt).removeprefix("torch."), dt)
    if name not in _EIGHT_BIT:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_DTYPE_NAMES)}, got {name!r}")
    canonical, storage = _EIGHT_BIT[name]
    if not row_scales and storage == torch.int8:
        raise ValueError("--kv-cache-dtype int8 needs a scale per row, which FlashInfer's pages do not carry: use "
                         "fp8_e4m3 or fp8_e5m2 with the flashinfer backend, or --attention-backend torch / cpu")
    return KVFormat(canonical, storage, scaled=row_scales)


_NAME_OF = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def format_of(pages: torch.Tensor, head_dim: int) -> KVFormat:
    """The format of a page tensor (or rows) whose last dimension holds rows of `head_dim` values: what the
    attention backends and the write op read off the tensor they are handed."""
    if pages.dtype not in _NAME_OF:
        return KVFormat(str(pages.dtype).removeprefix("torch."), pages.dtype)
    scaled = pages.shape[-1] == head_dim + SCALE_BYTES
    if not scaled and pages.shape[-1] != head_dim:
        raise ValueError(f"8-bit KV rows of {pages.shape[-1]} elements hold neither {head_dim} values nor "
                         f"{head_dim} values and a scale")
    return KVFormat(_NAME_OF[pages.dtype], pages.dtype, scaled)


def as_format(x: torch.dtype | KVFormat) -> KVFormat:
    return x if isinstance(x, KVFormat) else kv_format(x, x)


__all__ = ["KVFormat", "KV_DTYPE_NAMES", "SCALE_BYTES", "as_format", "format_of", "hadamard", "kv_format"]
