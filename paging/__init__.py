"""Paged KV memory: block allocator, KV storage and compaction (no model code)."""
from paging.block_pool import BlockPool
from paging.kv_cache import KVCache

__all__ = ["BlockPool", "KVCache"]
