"""KV storage: one tensor for all layers, each layer a FlashInfer NHD page tensor."""
from __future__ import annotations

import ctypes
import math
import sys

import torch

from paging.kv_format import KVFormat, as_format

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zeroed CPU tensor whose memory is advised to transparent huge pages (Linux), or None where that cannot be
    done. Why: attention walks a few KiB per block at shuffled block addresses; with 4 KiB pages every block is
    several TLB misses and hardware prefetchers stop at each page boundary (docs/results/cpu_kernels.md measures the
    attention call on both)."""
    if not sys.platform.startswith("linux"):
        return None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE_PAGE:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)  # not touched yet: advised before first use
        start = -buf.data_ptr() % _HUGE_PAGE
        if libc.madvise(ctypes.c_void_p(buf.data_ptr() + start), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) != 0:
            return None  # no THP in this kernel: plain pages
    except (OSError, AttributeError):
        return None
    return buf[start:start + nbytes].view(dtype).view(shape).zero_()


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    fmt: torch.dtype | KVFormat) -> int:
    """Bytes of one block over all layers, K and V, scales included (8-bit formats)."""
    return num_layers * 2 * block_size * num_kv_heads * as_format(fmt).row_bytes(head_dim)


def num_blocks_for_memory(memory_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                          fmt: torch.dtype | KVFormat) -> int:
    return int(memory_bytes // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, fmt))


class KVCache:
    """`data` is `[L, num_blocks, 2, block_size, Hkv, W]`; `layers[l]` is layer l's `[num_blocks, 2, block_size,
    Hkv, W]` view (`[:, 0]` keys, `[:, 1]` values). W is head_dim, plus the scale's 4 bytes in the 8-bit formats
    (paging/kv_format.py)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 fmt: torch.dtype | KVFormat, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_dim = head_dim
        self.format = as_format(fmt)
        dtype = self.format.storage
        shape = (num_layers, num_blocks, 2, block_size, num_kv_heads, self.format.width(head_dim))
        huge = _zeros_in_huge_pages(shape, dtype) if torch.device(device).type == "cpu" else None
        self.data = huge if huge is not None else torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(self.data.unbind(0))

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one cached token takes over all layers (scales included)."""
        return self.nbytes // max(1, self.num_tokens)

    def capacity_line(self, max_model_len: int) -> str:
        concurrency = self.num_tokens / max_model_len
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                f"({self.nbytes / 2**20:.1f} MiB, {self.format.name}: {self.bytes_per_token} bytes/token, "
                f"{2**30 // max(1, self.bytes_per_token)} tokens/GiB); "
                f"max concurrency for {max_model_len}-token requests: {concurrency:.2f}x")


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
