"""KV cache sizing under tensor parallelism.

Each rank stores only its KV heads (head_partition), but all ranks share rank 0's block pool: one block id
means the same (sequence, slots) everywhere, so every rank allocates the same number of blocks, the
minimum any of them can hold (vLLM's get_kv_cache_configs and mini-sglang take the same minimum).
"""
from __future__ import annotations

import torch

from engine.distributed.comm import all_reduce_min_int
from engine.distributed.layers import head_partition
from engine.distributed.parallel_state import TPGroup
from engine.models.config import ModelConfig
from paging.kv_cache import num_blocks_for_memory


def local_kv_heads(config: ModelConfig, tp: TPGroup) -> int:
    """KV heads stored on each rank (num_kv_heads / tp, or 1 when KV heads are replicated)."""
    return head_partition(config.num_q_heads, config.num_kv_heads, tp.size)[1]


def rank_num_blocks(memory_bytes: int, config: ModelConfig, block_size: int, dtype: torch.dtype,
                    tp: TPGroup) -> int:
    """Blocks this rank's `memory_bytes` can hold with its local KV heads."""
    return num_blocks_for_memory(memory_bytes, config.num_layers, block_size, local_kv_heads(config, tp),
                                 config.head_dim, dtype)


def common_num_blocks(local_num_blocks: int, tp: TPGroup) -> int:
    """The block count every rank can hold: MIN over ranks of each rank's own capacity (collective on the CPU
    group; every rank must call it). Raises ValueError when some rank cannot hold a single block."""
    n = all_reduce_min_int(local_num_blocks, tp)
    if n < 1:
        raise ValueError(f"a tensor-parallel rank has room for {n} KV blocks; at least one is needed")
    return n
