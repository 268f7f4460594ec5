"""KV-cache compression: method registry, configs, pure scoring/selection logic and the serving-loop stage.

Importing the package registers the built-in methods (each module below calls `registry.register`).
"""
# registration; kara, the default method, first
from compression import kara, ams, baselines, centroid, infokv, rkv, snapkv  # noqa: F401
from compression.base import Compressor, PrefixBatch, ScoreMethod, Selection, Span, WindowBatch, num_kept, num_topk
from compression.config import COMMON_FIELDS, ConfigError, KVCompressionConfig, coerce
from compression.kara import Kara, RandomCompressor, RecentCompressor, kara_scores, token2chunk
from compression.primitives import topk_sorted
from compression.registry import MethodSpec, names, register
from compression.snapkv import SnapKVCompressor, snapkv_scores, snapkv_select


def make_compressor(config: KVCompressionConfig):
    """The compressor of ``config.method`` (None for "none")."""
    return config.make_compressor()


__all__ = [
    "COMMON_FIELDS",
    "Compressor",
    "ScoreMethod",
    "Span",
    "ConfigError",
    "PrefixBatch",
    "Selection",
    "KVCompressionConfig",
    "MethodSpec",
    "WindowBatch",
    "coerce",
    "make_compressor",
    "names",
    "num_kept",
    "num_topk",
    "register",
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
