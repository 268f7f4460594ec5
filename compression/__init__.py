"""KV-cache compression: pure scoring/selection logic (no model, engine or paging code)."""
from compression.base import (
    METHODS,
    WINDOW_METHODS,
    Compressor,
    KVCompressionConfig,
    make_compressor,
    num_kept,
    num_topk,
)
from compression.kara import Kara, RandomCompressor, RecentCompressor, kara_scores, token2chunk, topk_sorted
from compression.snapkv import SnapKVCompressor, snapkv_scores, snapkv_select

__all__ = [
    "METHODS",
    "WINDOW_METHODS",
    "Compressor",
    "KVCompressionConfig",
    "make_compressor",
    "num_kept",
    "num_topk",
    "Kara",
    "RandomCompressor",
    "RecentCompressor",
    "kara_scores",
    "token2chunk",
    "topk_sorted",
    "SnapKVCompressor",
    "snapkv_scores",
    "snapkv_select",
]
