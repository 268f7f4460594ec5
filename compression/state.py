"""Per-sequence compression state: the frontier between the compressed part of the cache and its uncompressed
tail, and when the sequence's next round is due. It depends only on the sequence itself (its own length and its
request's settings), so a greedy or seeded request compresses the same windows at the same points whatever else
runs beside it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from compression.config import coerce

if TYPE_CHECKING:
    from compression.config import KVCompressionConfig


class QueryCache:
    """A ring buffer of one sequence's post-RoPE queries [L, capacity, Hq, D] by logical position, written by the
    steps that compute its tail tokens (query_source="cache"). Holds the positions [lo, hi)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buf: torch.Tensor | None = None
        self.lo = self.hi = 0

    def store(self, first: int, q: torch.Tensor) -> None:
        n = q.shape[1]
        if self.buf is None:
            self.buf = q.new_empty(q.shape[0], self.capacity, *q.shape[2:])
        if first != self.hi:  # not contiguous with what is held (a re-prefill): start over
            self.lo = first
        if n > self.capacity:
            q, first, n = q[:, n - self.capacity:], first + n - self.capacity, self.capacity
            self.lo = first
        # at most two slice copies (the ring wraps once) rather than an arange, a modulo and an index_copy_ on
        # every store: a decode step stores one row per sequence
        for dst, src, count in self._spans(first, n):
            self.buf[:, dst:dst + count].copy_(q[:, src:src + count])
        self.hi = first + n
        self.lo = max(self.lo, self.hi - self.capacity)

    def get(self, first: int, n: int) -> torch.Tensor | None:
        """Queries of positions [first, first + n) as [L, n, Hq, D], or None if some are not held."""
        if self.buf is None or first < self.lo or first + n > self.hi:
            return None
        parts = [self.buf[:, dst:dst + count] for dst, _, count in self._spans(first, n)]
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=1)

    def _spans(self, first: int, n: int) -> list[tuple[int, int, int]]:
        """(ring slot, offset in the n positions, count) of the runs positions [first, first + n) occupy."""
        slot = first % self.capacity
        head = min(n, self.capacity - slot)
        return [(slot, 0, head)] + ([(0, head, n - head)] if head < n else [])

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()


class EntropyStore:
    """One sequence's per-token side signal by logical position (InfoKV's sampling entropy): float32, NaN where
    nothing was recorded (prompt tokens, whose logits are never computed). Position t holds the entropy of the
    distribution token t was sampled from. Positions are logical, so the store survives compaction and
    preemption unchanged (a re-prefill recomputes the same tokens)."""

    def __init__(self, capacity: int = 256):
        self.buf = torch.full((capacity,), float("nan"))

    def put(self, first: int, values: torch.Tensor) -> None:
        values = values.detach().to("cpu", torch.float32).reshape(-1)
        end = first + values.numel()
        if end > self.buf.numel():
            grown = torch.full((max(end, 2 * self.buf.numel()),), float("nan"))
            grown[:self.buf.numel()] = self.buf
            self.buf = grown
        self.buf[first:end] = values

    def get(self, first: int, n: int) -> torch.Tensor:
        """float32 [n] for positions [first, first + n) (NaN past what was recorded)."""
        out = torch.full((n,), float("nan"))
        hi = min(first + n, self.buf.numel())
        if hi > first:
            out[:hi - first] = self.buf[first:hi]
        return out


@dataclass
class CompressionState:
    config: KVCompressionConfig
    start: int  # first logical token compression may touch (end of the prompt, 0 with compress_prompt)
    compressed_tokens: int = 0  # logical tokens before the uncompressed tail
    compressed_kv_len: int = 0  # KV slot where the uncompressed tail starts
    last_round_at: int = 0  # the sequence's logical length at its last periodic round (or `start`)
    pending: bool = False  # compress every complete window as soon as the (re-)prefill is done
    ever_compressed: bool = False
    generator: torch.Generator | None = None  # randomised selectors draw from the sequence's own stream
    rounds: int = 0
    query_source: str = "recompute"  # resolved ("recompute" or "cache")
    kept_per_window: int = 0  # region slots the method keeps of a full window (for footprint projections)
    queries: QueryCache | None = None
    # InfoKV's side signal (None unless the method `needs_entropy`): sampling entropy by logical position,
    # recorded by the engine with top-k = entropy_top_k.
    entropy: EntropyStore | None = None
    entropy_top_k: int = 10
    entropy_fn: Callable | None = None  # the method's `token_entropy`
    # Threshold policy, per KV slot, valid while the cache holds what the last event left: the method's own state
    # (`Selection.slot_state`, e.g. AMS's credit), and the entropy of slots [0, T0) as compacted ([L, Hkv, T0];
    # slots from T0 on are uncompressed: slot T0 + i is logical position slot_entropy_pos + i).
    slot_state: dict = field(default_factory=dict)
    slot_entropy: torch.Tensor | None = None
    slot_entropy_pos: int = 0
    max_tail: int | None = None  # the engine's max_model_len: no tail is longer (bounds what is sized from config)
    # Held by another stage of the engine (lossless mode, while unverified slots sit in the cache): no round may read
    # or rewrite the cache and no query of the step's tokens is kept until it resumes.
    paused: bool = False

    #: the frontier: what a tensor-parallel worker needs of rank 0's state to run the same round
    FRONTIER = ("start", "compressed_tokens", "compressed_kv_len", "last_round_at", "pending", "ever_compressed",
                "rounds")

    def __post_init__(self) -> None:
        self.reset()
        self.pending = self.config.compress_prompt
        if self.query_source == "cache":
            # the longest tail a periodic round sees: a window plus a period's worth of tokens, plus one step's chunk
            # (never more than a whole sequence holds, however large the period)
            tail = self.config.window + self.config.compression_period
            self.queries = QueryCache(min(tail, self.max_tail or tail) + 64)

    # -- what the rest of the engine may ask ---------------------------------------------------------------
    def caches_queries(self) -> bool:
        return self.queries is not None

    def store_queries(self, first: int, q: torch.Tensor) -> None:
        """Keep the post-RoPE queries [L, n, Hq, D] of positions [first, first + n) computed by a step."""
        self.queries.store(first, q)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def capture_from(self, start: int) -> int | None:
        """The first position of a step's tokens (starting at `start`) whose queries to keep, or None."""
        return max(start, self.start) if self.queries is not None and not self.paused else None

    def protected_tokens(self) -> int:
        """Leading tokens compaction never rewrites (the prefix cache may share their blocks)."""
        return 0 if self.config.policy == "threshold" else self.start

    def query_cache_bytes(self) -> int:
        return self.queries.nbytes if self.queries is not None else 0

    def lossless(self) -> bool:
        return self.config.lossless

    def tail(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - self.compressed_tokens

    def windows(self, tail: int) -> int:
        """Complete windows a periodic round compresses in an uncompressed tail of this length."""
        c = self.config
        return (tail - c.buffer) // c.region_len if tail >= c.window else 0

    def savings(self, num_computed_tokens: int) -> int:
        """KV slots a periodic round run now would free."""
        return self.windows(self.tail(num_computed_tokens)) * (self.config.region_len - self.kept_per_window)

    def peak_kv_len(self, final_tokens: int) -> int:
        """The most KV slots the sequence holds on its way to `final_tokens` logical tokens under this setting."""
        c = self.config
        if c.policy == "threshold":
            return min(final_tokens, c.threshold_max)
        # a compressed region of n tokens keeps `kept`; the tail before a round is at most |W| + period
        grown = max(0, final_tokens - self.start)
        tail = min(grown, c.window + c.compression_period)
        return self.start + math.ceil((grown - tail) * self.kept_per_window / c.region_len) + tail

    def frontier(self) -> dict:
        return {name: getattr(self, name) for name in self.FRONTIER}

    def spec(self) -> dict:
        """What rebuilds this state elsewhere (a tensor-parallel worker): `CompressionState.from_spec`."""
        return {"config": self.config.to_dict(), "start": self.start, "query_source": self.query_source,
                "kept_per_window": self.kept_per_window}

    @classmethod
    def from_spec(cls, spec: dict) -> "CompressionState":
        return cls(coerce(spec["config"]), spec["start"], query_source=spec["query_source"],
                   kept_per_window=spec["kept_per_window"])

    def set_frontier(self, values: dict) -> None:
        for name in self.FRONTIER:
            setattr(self, name, values[name])

    # -- the stage's own bookkeeping -----------------------------------------------------------------------
    def rng(self) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.config.seed)
        return self.generator

    def reset(self) -> None:
        self.compressed_tokens = self.compressed_kv_len = self.last_round_at = self.start

    def on_preempt(self) -> None:
        """The KV cache is gone (recompute preemption). A sequence that was ever compressed is compressed again right
        after its re-prefill rather than holding its whole uncompressed tail until its next round; `ever_compressed`
        is sticky so a second preemption keeps that."""
        self.reset()
        self.pending = self.config.compress_prompt or self.ever_compressed
        # the re-prefill rebuilds an uncompressed cache: per-slot state of the old slots means nothing there
        self.slot_state = {}
        self.slot_entropy, self.slot_entropy_pos = None, 0

    def slot_entropies(self, kv_len: int, layers: int, kv_heads: int) -> torch.Tensor:
        """float32 [L, Hkv, kv_len]: the entropy of every KV slot (threshold policy, see `slot_entropy`)."""
        if self.entropy is None:
            raise RuntimeError("this sequence's method records no entropy")
        t0 = 0 if self.slot_entropy is None else self.slot_entropy.shape[2]
        tail = self.entropy.get(self.slot_entropy_pos, kv_len - t0).expand(layers, kv_heads, kv_len - t0)
        return tail.clone() if self.slot_entropy is None else torch.cat([self.slot_entropy, tail], dim=2)

    def advance(self, region: int, kept: int) -> None:
        self.compressed_tokens += region
        self.compressed_kv_len += kept
        self.ever_compressed = True
