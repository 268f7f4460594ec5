"""KV-compression configuration and the `Compressor` interface (pure logic, no model or engine code).

Vocabulary (Kara paper, seed 002 §3): a sequence's trailing *window* W of |W| = ``window`` KV slots is split into
the *compressible region* W\\U (its first n = |W| − |U| slots) and the *buffer* U (its last |U| = ``buffer`` slots,
never dropped by this compression). A window compressor returns, for every layer and KV head, the sorted indices
of the region slots to keep; every (layer, head) keeps the same count K (positions may differ per head), which is
what a paged cache with one block table per sequence needs.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

import torch

#: Sliding-window methods (handled by `make_compressor`).
WINDOW_METHODS = ("kara", "kara_no_chunk", "kara_buffer_queries", "random", "streaming")
#: Every accepted ``method``. "threshold" is the SnapKV threshold-triggered baseline (see compression/snapkv.py),
#: "none" disables compression.
METHODS = WINDOW_METHODS + ("threshold", "none")

_PREFIX = "kv_compression"


def num_topk(ratio: float, n: int) -> int:
    """⌈r·n⌉ (eq. 4), robust to binary float error (0.3 · 10 is 3.0000000000000004 in floats, but ⌈·⌉ must be 3)."""
    if n <= 0:
        return 0
    return min(n, math.ceil(round(ratio * n, 9)))


def num_kept(ratio: float, n: int, chunk_budget: int) -> int:
    """Slots kept per (layer, head) from a region of n slots: ⌈r·n⌉ + α, capped at n."""
    return min(n, num_topk(ratio, n) + chunk_budget)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class KVCompressionConfig:
    """KV-cache compression settings (engine default or per request).

    method:
      * ``"kara"`` — sliding-window bidirectional scores (eq. 3) + TopK (eq. 4) + Token2Chunk (eqs. 5–7).
      * ``"kara_no_chunk"`` — ablation "w/o Token2Chunk": the top ⌈r·n⌉ + α region slots by the same score.
      * ``"kara_buffer_queries"`` — ablation "w/o Bi-Attention": scores from the buffer U's queries only
        (then TopK + Token2Chunk as in kara).
      * ``"random"`` — ⌈r·n⌉ + α uniformly random region slots per (layer, head); reproducible from ``seed``.
      * ``"streaming"`` — StreamingLLM-style recency: keep the newest ⌈r·n⌉ + α slots of the region (the ones
        adjacent to the buffer). The attention sinks of StreamingLLM are the sequence's first tokens, which sit in
        the prompt; the prompt is never compressed unless ``compress_prompt`` is set, so they are kept.
      * ``"threshold"`` — SnapKV threshold-triggered baseline (eqs. 1–2): when the KV length reaches
        ``threshold_max`` (C_max) the whole cache is compressed to ``threshold_target`` (N) slots: the last
        ``observation_window`` slots are kept and the top N − w older slots by SnapKV score (pooling kernel
        ``snapkv_kernel``).
      * ``"none"`` — no compression.

    Window fields: ``ratio`` r ∈ (0, 1]; ``window`` |W|; ``buffer`` |U| with 0 < |U| < |W|; ``chunk_max`` γ ≥ 1;
    ``chunk_budget`` α ≥ 0; ``compression_period`` (decode steps between compression rounds, ≥ |W| − |U| so a
    round only ever sees tokens no earlier round compressed); ``max_seqs_per_round``; ``compress_prompt``
    (also compress the prompt, window by window, after prefill); ``seed`` (for ``"random"``).
    """

    method: str = "kara"
    ratio: float = 0.3
    window: int = 512
    buffer: int = 64
    chunk_max: int = 8
    chunk_budget: int = 16
    compression_period: int = 512
    max_seqs_per_round: int = 64
    compress_prompt: bool = False
    threshold_max: int = 2048
    threshold_target: int = 1024
    observation_window: int = 32
    snapkv_kernel: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the offending field (``kv_compression.<field> ...``)."""

        def err(name: str, what: str) -> ValueError:
            return ValueError(f"{_PREFIX}.{name} {what}, got {getattr(self, name)!r}")

        if not isinstance(self.method, str) or self.method not in METHODS:
            raise err("method", f"must be one of {list(METHODS)}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise err("ratio", "must be a number in (0, 1]")
        if not (0.0 < float(self.ratio) <= 1.0) or math.isnan(float(self.ratio)):
            raise err("ratio", "must be in (0, 1]")
        self.ratio = float(self.ratio)
        for name in ("window", "buffer", "chunk_max", "chunk_budget", "compression_period", "max_seqs_per_round",
                     "threshold_max", "threshold_target", "observation_window", "snapkv_kernel", "seed"):
            if not _is_int(getattr(self, name)):
                raise err(name, "must be an integer")
        if not isinstance(self.compress_prompt, bool):
            raise err("compress_prompt", "must be a boolean")
        if self.window < 2:
            raise err("window", "must be >= 2")
        if not (0 < self.buffer < self.window):
            raise ValueError(f"{_PREFIX}.buffer must satisfy 0 < buffer < window ({self.window}), got {self.buffer!r}")
        if self.chunk_max < 1:
            raise err("chunk_max", "must be >= 1")
        if self.chunk_budget < 0:
            raise err("chunk_budget", "must be >= 0")
        if self.compression_period < self.window - self.buffer:
            raise ValueError(
                f"{_PREFIX}.compression_period must be >= window - buffer ({self.window - self.buffer}), "
                f"got {self.compression_period!r}")
        if self.max_seqs_per_round < 1:
            raise err("max_seqs_per_round", "must be >= 1")
        if self.observation_window < 1:
            raise err("observation_window", "must be >= 1")
        if self.threshold_target <= self.observation_window:
            raise ValueError(
                f"{_PREFIX}.threshold_target must be > observation_window ({self.observation_window}), "
                f"got {self.threshold_target!r}")
        if self.threshold_max <= self.threshold_target:
            raise ValueError(
                f"{_PREFIX}.threshold_max must be > threshold_target ({self.threshold_target}), "
                f"got {self.threshold_max!r}")
        if self.snapkv_kernel < 1 or self.snapkv_kernel % 2 == 0:
            raise err("snapkv_kernel", "must be an odd integer >= 1")
        if self.seed < 0:
            raise err("seed", "must be >= 0")

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, base: "KVCompressionConfig | None" = None) -> "KVCompressionConfig":
        """Build from a JSON/HTTP dict. Missing keys take the value of ``base`` (or the defaults); an unknown key
        raises ValueError naming it; bad values raise ValueError naming the field."""
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise ValueError(f"{_PREFIX} must be an object, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                raise ValueError(f"{_PREFIX}: unknown key {key!r} (allowed: {', '.join(names)})")
        values = asdict(base) if base is not None else {}
        values.update(d)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ derived numbers
    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def is_window_method(self) -> bool:
        return self.method in WINDOW_METHODS

    @property
    def region_len(self) -> int:
        """n = |W| − |U|: slots compressed per window."""
        return self.window - self.buffer

    @property
    def num_topk(self) -> int:
        """⌈r·n⌉ for a full window."""
        return num_topk(self.ratio, self.region_len)

    @property
    def kept_per_window(self) -> int:
        """⌈r·n⌉ + α capped at n, for a full window (n = window − buffer)."""
        return num_kept(self.ratio, self.region_len, self.chunk_budget)


class Compressor(ABC):
    """A sliding-window compressor.

    ``select(queries, keys, num_region)``:
      * queries: [L, Hq, W, D] post-RoPE query states of the W window tokens (recomputed), any float dtype;
      * keys:    [L, Hkv, W, D] post-RoPE keys of the same tokens; GQA: query head h belongs to KV head h // g,
        g = Hq // Hkv;
      * num_region: the window's first ``num_region`` tokens are the compressible region, the remaining
        W − num_region the buffer U.
    Returns a LongTensor [L, Hkv, K] (on the keys' device) of kept indices into [0, num_region), strictly
    increasing along the last axis, with K = ``num_kept(num_region)`` for every layer and head.
    """

    #: False for selectors that ignore the queries (random, recency): the policy then skips their recomputation
    #: and passes a zero-stride placeholder of the right shape.
    needs_queries: bool = True

    def __init__(self, config: KVCompressionConfig):
        self.config = config

    def num_kept(self, num_region: int) -> int:
        return num_kept(self.config.ratio, num_region, self.config.chunk_budget)

    @abstractmethod
    def select(self, queries: torch.Tensor, keys: torch.Tensor, num_region: int) -> torch.Tensor:
        ...

    @staticmethod
    def _check(queries: torch.Tensor, keys: torch.Tensor, num_region: int) -> None:
        check_window_inputs(queries, keys, num_region)


def check_window_inputs(queries: torch.Tensor, keys: torch.Tensor, num_region: int) -> None:
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries/keys must be [L, H, W, D], got {tuple(queries.shape)} and {tuple(keys.shape)}")
    L, hq, w, d = queries.shape
    lk, hkv, wk, dk = keys.shape
    if (L, w, d) != (lk, wk, dk):
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} disagree on L, W or D")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if not (0 < num_region <= w):
        raise ValueError(f"num_region must be in (0, {w}], got {num_region}")


def make_compressor(config: KVCompressionConfig) -> Compressor | None:
    """The window compressor for ``config.method``; None for "none". "threshold" is not a window method:
    use `compression.snapkv.SnapKVCompressor`."""
    from compression.kara import Kara, RandomCompressor, RecentCompressor

    m = config.method
    if m == "none":
        return None
    if m == "kara":
        return Kara(config)
    if m == "kara_no_chunk":
        return Kara(config, token2chunk=False)
    if m == "kara_buffer_queries":
        return Kara(config, buffer_queries_only=True)
    if m == "random":
        return RandomCompressor(config)
    if m == "streaming":
        return RecentCompressor(config)
    raise ValueError(f"{_PREFIX}.method {m!r} is not a sliding-window method (use compression.snapkv.SnapKVCompressor)")
