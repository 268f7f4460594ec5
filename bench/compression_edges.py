"""The edges of every method's valid compression settings, as data: what a fuzzer or a property test draws from.

`valid_edge_settings(method)` is a hypothesis strategy of flat ``kv_compression`` dicts that the validator accepts
(compression/config.py, including an engine's `Limits` for the given ``max_len`` / ``vocab_size``), biased to the
ends of each range: a ratio keeping ⌈r·n⌉ = 1 slot (r down to 1e-11) or all of them, window = buffer + 1 (a
one-slot region, period 1), budgets 0 and max, chunk and kernel sizes at their bounds, threshold_max =
threshold_target + 1 and threshold_target = observation_window + 1, counts at the kept count. Every such setting
must run in the engine: a round must never be the first to reject one. `valid_edge_requests` adds the request
around it (prompts shorter than a window, max_tokens below the period). `just_outside(method, base)` lists, for
each bounded field, settings equal to a valid ``base`` but for that field, set just past its bound (the validator
must reject each naming ``kv_compression.<field>``).

Each method parameter's range is in `PARAM_RANGES`, by name (names are shared between methods: ``kernel``,
``obs_window``, ...); a registered method with a parameter missing there makes these functions raise, so a new
method states its edges here. hypothesis is imported inside the functions that need it (it is a test dependency).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

from compression import registry
from compression.ams import THRESHOLD_BASES, WINDOW_BASES
from compression.config import INT64_MAX, QUERY_SOURCES, num_topk

#: a bound or a choice list given as a number / tuple, or computed from the settings drawn so far (``ctx``)
Bound = Any


@dataclass(frozen=True)
class Range:
    """One method parameter's valid values. kind: "int", "float", "bool" or "choice"; lo / hi inclusive unless
    open; ints may have to be odd; nullable: None is valid too; null_only(ctx): only None is valid there."""
    kind: str
    lo: Bound = None
    hi: Bound = None
    lo_open: bool = False
    hi_open: bool = False
    odd: bool = False
    nullable: bool = False
    choices: Bound = ()
    null_only: Callable[[dict], bool] | None = None

    def bounds(self, ctx: dict) -> tuple[Any, Any]:
        return tuple(b(ctx) if callable(b) else b for b in (self.lo, self.hi))

    def options(self, ctx: dict) -> tuple:
        return tuple(self.choices(ctx) if callable(self.choices) else self.choices)


def _max_len(ctx: dict) -> int:
    return ctx["max_len"]


def _vocab_size(ctx: dict) -> int:
    return ctx["vocab_size"]


def _kept(ctx: dict) -> int:
    """Slots one selection keeps: ⌈r·n⌉ per window (periodic), threshold_target − observation_window (threshold)."""
    if ctx["policy"] == "periodic":
        return num_topk(ctx["ratio"], ctx["window"] - ctx["buffer"])
    return ctx["threshold_target"] - ctx["observation_window"]


def _threshold(ctx: dict) -> bool:
    return ctx["policy"] == "threshold"


def _ams_bases(ctx: dict) -> tuple:
    return tuple(sorted(WINDOW_BASES if ctx["policy"] == "periodic" else THRESHOLD_BASES))


# Integer token counts are bounded by the engine's max_model_len (compression/config.py `check_limits`).
_COUNT = dict(kind="int", hi=_max_len)
PARAM_RANGES: dict[str, Range] = {
    # Kara (arXiv 2607.01237) and its ablations / budget baselines
    "chunk_max": Range(lo=1, **_COUNT),
    "chunk_budget": Range(lo=0, **_COUNT),
    "token2chunk": Range("bool"),
    "buffer_queries": Range("bool"),
    # SnapKV threshold baseline
    "snapkv_kernel": Range(lo=1, odd=True, **_COUNT),
    # shared by the window methods: observation queries lie in the buffer; unset under the threshold policy
    "obs_window": Range(lo=1, nullable=True, null_only=_threshold, kind="int", hi=lambda c: c["buffer"]),
    "kernel": Range(lo=1, odd=True, **_COUNT),
    "pooling": Range("choice", choices=("avg", "max")),
    "num_recent": Range("int", lo=0, hi=_kept, nullable=True),
    "lam": Range("float", lo=0.0, hi=1.0),
    "rho": Range("float", lo=0.0, hi=1.0),
    "sim_threshold": Range("float", lo=-1.0, hi=1.0),
    # AMS
    "base": Range("choice", choices=_ams_bases, nullable=True),
    "segment_mass": Range("float", lo=0.0, hi=1.0, lo_open=True),
    "min_seg_len": Range(lo=1, **_COUNT),
    "max_seg_len": Range(lo=lambda c: c["min_seg_len"], **_COUNT),
    "min_keep_per_segment": Range(lo=0, **_COUNT),
    "n_sink": Range(lo=0, nullable=True, **_COUNT),
    "keep_last": Range(lo=0, nullable=True, **_COUNT),
    "credit_decay": Range("float", lo=0.0, hi=1.0, hi_open=True),
    "mix_beta": Range("float", lo=0.0, hi=1.0),
    "use_credit": Range("bool"),
    # CentroidKV
    "chunk_size": Range(lo=2, **_COUNT),
    # InfoKV: a top-k over the vocabulary
    "entropy_top_k": Range("int", lo=1, hi=_vocab_size),
}
#: upper bounds that only an engine's `Limits` enforce (not the config alone)
_LIMIT_BOUNDS = (_max_len, _vocab_size)


def _ranges(method: str) -> list[tuple[str, Range]]:
    spec = registry.get(method)
    out = []
    for f in fields(spec.params):
        if f.name not in PARAM_RANGES:
            raise KeyError(f"bench/compression_edges.py: no range for parameter {f.name!r} of method {method!r}; add it to "
                           f"PARAM_RANGES")
        out.append((f.name, PARAM_RANGES[f.name]))
    return out


def _int_edges(lo: int, hi: int, odd: bool = False) -> list[int]:
    vals = {lo, lo + 1, lo + 2, hi - 1, hi}
    return sorted(v for v in vals if lo <= v <= hi and (not odd or v % 2 == 1))


def _float_edges(lo: float, hi: float, lo_open: bool, hi_open: bool) -> list[float]:
    vals = [lo if not lo_open else math.nextafter(lo, hi), lo + 1e-11, hi - 1e-11,
            hi if not hi_open else math.nextafter(hi, lo)]
    return [v for v in vals if (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)]


def _st_int(st, lo: int, hi: int, odd: bool = False):
    """Integers in [lo, hi] (odd ones only if asked): a third at the ends of the range, a third near its low end
    (small windows, periods and budgets are the ones a short request reaches), a third anywhere."""
    if odd:
        lo += lo % 2 == 0
        hi -= hi % 2 == 0
        a, b = (lo - 1) // 2, (hi - 1) // 2
        return st.one_of(st.sampled_from(_int_edges(lo, hi, True)),
                         st.integers(a, min(b, a + 4)).map(lambda k: 2 * k + 1),
                         st.integers(a, b).map(lambda k: 2 * k + 1))
    return st.one_of(st.sampled_from(_int_edges(lo, hi)), st.integers(lo, min(hi, lo + 8)), st.integers(lo, hi))


def _st_param(st, r: Range, ctx: dict):
    if r.null_only is not None and r.null_only(ctx):
        return st.none()
    if r.kind == "bool":
        s = st.booleans()
    elif r.kind == "choice":
        s = st.sampled_from(r.options(ctx))
    else:
        lo, hi = r.bounds(ctx)
        if r.kind == "int":
            s = _st_int(st, lo, hi, r.odd)
        else:
            s = st.one_of(st.sampled_from(_float_edges(lo, hi, r.lo_open, r.hi_open)),
                          st.floats(lo, hi, exclude_min=r.lo_open, exclude_max=r.hi_open, allow_nan=False))
    return st.one_of(st.none(), s) if r.nullable else s


def _ratio_edges(n: int) -> list[float]:
    """Ratios keeping one slot by the rounding's edge (1e-11), exactly ⌈r·n⌉ = 1 and 2 by a hair, all (1)."""
    vals = [1e-11, 5e-324, 1.0 / n, math.nextafter(1.0 / n, 2.0), 2.0 / n, math.nextafter(1.0, 0.0), 1.0, 1]
    return [v for v in vals if 0 < v <= 1]


def valid_edge_settings(method: str, *, max_len: int = 48, vocab_size: int = 128):
    """A hypothesis strategy of flat ``kv_compression`` dicts for ``method`` (a name in `registry.names()`, not
    "none") that the validator accepts on an engine whose max_model_len is ``max_len`` (>= 4) and whose vocabulary
    has ``vocab_size`` tokens, each integer a third of the time at an end of its range and a third near its low
    end, each float half of the time at or next to an end (module docstring). Every common field is set, so a
    dict means the same whatever the engine's default."""
    from hypothesis import strategies as st

    spec = registry.get(method)
    if spec.factory is None:
        raise ValueError("valid_edge_settings: method 'none' has no settings")
    if max_len < 4:
        raise ValueError(f"valid_edge_settings: max_len must be >= 4, got {max_len}")
    ranges = _ranges(method)

    @st.composite
    def settings(draw) -> dict:
        L = max_len
        policy = draw(st.sampled_from(spec.policies))
        window = draw(_st_int(st, 2, L))
        buffer = draw(_st_int(st, 1, window - 1))
        n = window - buffer
        d: dict[str, Any] = {
            "method": method, "policy": policy, "window": window, "buffer": buffer,
            "compression_period": draw(_st_int(st, n, L)),
            "ratio": draw(st.one_of(st.sampled_from(_ratio_edges(n)),
                                    st.floats(1e-12, 1.0, allow_nan=False, allow_subnormal=False))),
        }
        ow = draw(_st_int(st, 1, L - 2))
        target = draw(_st_int(st, ow + 1, L - 1))
        d.update(observation_window=ow, threshold_target=target, threshold_max=draw(_st_int(st, target + 1, L)),
                 compress_prompt=draw(st.booleans()), query_source=draw(st.sampled_from(QUERY_SOURCES)),
                 seed=draw(st.one_of(st.sampled_from([0, 1, INT64_MAX]), st.integers(0, INT64_MAX))),
                 lossless=draw(st.booleans()))
        hmin = draw(_st_int(st, 1, L))
        d.update(horizon_min=hmin, horizon_max=draw(_st_int(st, hmin, L)))
        ctx = dict(d, max_len=L, vocab_size=vocab_size)
        for name, r in ranges:  # in the dataclass's order: a bound may depend on an earlier field
            ctx[name] = d[name] = draw(_st_param(st, r, ctx))
        return d

    return settings()


def valid_edge_requests(method: str, *, max_len: int = 48, vocab_size: int = 128):
    """A hypothesis strategy of (settings, prompt_len, max_tokens): `valid_edge_settings` plus a request around it
    with prompt_len + max_tokens <= max_len, both biased to the setting's own edges (a prompt one short of a window,
    max_tokens one short of or at the period, ...)."""
    from hypothesis import strategies as st

    @st.composite
    def requests(draw) -> tuple[dict, int, int]:
        d = draw(valid_edge_settings(method, max_len=max_len, vocab_size=vocab_size))
        key = d["window"] if d["policy"] == "periodic" else d["threshold_max"]
        p_edges = [v for v in (1, 2, key - 1, key, key + 1, d["buffer"], max_len - 1) if 1 <= v <= max_len - 1]
        prompt_len = draw(st.one_of(st.sampled_from(p_edges), st.integers(1, max_len - 1)))
        room = max_len - prompt_len
        period = d["compression_period"] if d["policy"] == "periodic" else d["threshold_max"] - prompt_len
        # max_tokens around the first round (a period after the first complete window; threshold: C_max reached)
        due = max(period, d["window"]) if d["policy"] == "periodic" else period
        t_edges = [v for v in (1, period - 1, period, period + 1, due, due + 1, due + period, room)
                   if 1 <= v <= room]
        return d, prompt_len, draw(st.one_of(st.sampled_from(t_edges), st.integers(1, room)))

    return requests()


def just_outside(method: str, base: dict) -> list[tuple[str, dict]]:
    """(field, settings) pairs: ``base`` (a valid flat dict of ``method``, e.g. drawn from `valid_edge_settings`)
    with one field set just past a bound of its range: a ratio of 0 or just above 1, buffer = window, a period one
    short of the region, threshold_max = threshold_target, an even kernel, a count one below its minimum or one
    above a bound that depends on other fields, a float just outside [lo, hi], a float for an integer. Bounds that
    only an engine's `Limits` enforce (max_model_len, vocab_size) are left out: the config alone accepts those."""
    n = base["window"] - base["buffer"]
    out: list[tuple[str, Any]] = [
        ("ratio", 0.0), ("ratio", math.nextafter(1.0, 2.0)), ("ratio", -1e-11), ("ratio", float("nan")),
        ("window", 1), ("buffer", 0), ("buffer", base["window"]), ("compression_period", n - 1),
        ("compression_period", 0), ("observation_window", 0), ("threshold_target", base["observation_window"]),
        ("threshold_max", base["threshold_target"]), ("horizon_max", base["horizon_min"] - 1),
        ("seed", -1), ("seed", INT64_MAX + 1), ("window", float(base["window"])),
    ]
    ctx = dict(base)
    for name, r in _ranges(method):
        if r.null_only is not None and r.null_only(ctx):
            out.append((name, 1))
        elif r.kind == "bool":
            out.append((name, 1))
        elif r.kind == "choice":
            out.append((name, "no-such-" + name))
        elif r.kind == "int":
            lo = r.lo(ctx) if callable(r.lo) else r.lo
            out += [(name, lo - 2 if r.odd and lo % 2 == 1 else lo - 1), (name, float(max(lo, 1)))]
            if r.odd:
                out.append((name, lo + 1 if lo % 2 == 1 else lo))
            if callable(r.hi) and r.hi not in _LIMIT_BOUNDS:
                out.append((name, r.hi(ctx) + 1))
        else:
            lo, hi = r.bounds(ctx)
            out += [(name, lo if r.lo_open else math.nextafter(lo, -math.inf)),
                    (name, hi if r.hi_open else math.nextafter(hi, math.inf)), (name, float("nan"))]
    return [(name, dict(base, **{name: v})) for name, v in out]


__all__ = ["PARAM_RANGES", "Range", "valid_edge_settings", "valid_edge_requests", "just_outside"]
