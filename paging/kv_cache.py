"""KV storage: one tensor for all layers, each layer a FlashInfer NHD page tensor."""
from __future__ import annotations

import math

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_memory(memory_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> int:
    return int(memory_bytes // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype))


class KVCache:
    """`data` is `[L, num_blocks, 2, block_size, Hkv, D]`; `layers[l]` is layer l's `[num_blocks, 2, block_size,
    Hkv, D]` view (`[:, 0]` keys, `[:, 1]` values)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype,
                                device=device)
        self.layers = list(self.data.unbind(0))

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def capacity_line(self, max_model_len: int) -> str:
        concurrency = self.num_tokens / max_model_len
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                f"({self.nbytes / 2**20:.1f} MiB, {str(self.data.dtype).removeprefix('torch.')}); max concurrency for {max_model_len}-token requests: "
                f"{concurrency:.2f}x")


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
