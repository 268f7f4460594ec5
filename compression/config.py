"""`KVCompressionConfig` (engine default or per request) and `coerce`, the one converter every caller uses.

A config is flat when written (``{"method": "kara", "ratio": 0.3, "chunk_max": 8}``): the keys are the common
fields below plus the method's own parameters (its dataclass in the registry, compression/registry.py). A parameter
dataclass has ``validate()`` (each field alone) and may have ``check_common(common)`` (rules between its fields and
the common ones, e.g. a count that must fit the kept budget), run once the whole config is known; both raise
`field_error` naming the field.

Vocabulary (arXiv 2607.01237 §3): a sequence's trailing *window* W of |W| = ``window`` KV slots is split into the
*compressible region* (its first n = |W| − |U| slots) and the *buffer* U (its last |U| = ``buffer`` slots, never
dropped by this compression).

Common fields:
  * ``method`` — a registered method name (``compression.registry.names()``); ``"none"`` disables compression.
  * ``policy`` — ``"periodic"`` (rounds over complete trailing windows) or ``"threshold"`` (compress the whole
    cache to ``threshold_target`` once it reaches ``threshold_max``); defaults to the method's first policy.
  * ``ratio`` r ∈ (0, 1] — fraction of each window's region kept (periodic policy): ⌈r·n⌉, so at least one slot.
  * ``window`` |W|, ``buffer`` |U| with 0 < |U| < |W|.
  * ``compression_period`` — a sequence's own decode steps between its rounds (≥ |W| − |U|, so a round only
    ever sees tokens no earlier round compressed).
  * ``compress_prompt`` — also compress the prompt, window by window, right after prefill.
  * ``threshold_max`` C_max, ``threshold_target`` N, ``observation_window`` w — threshold policy.
  * ``seed`` — for randomised methods (each sequence draws from its own generator seeded with it).
  * ``query_source`` — where a round's window queries come from: ``"recompute"`` (the paper's way: a forward pass
    of the window tokens over the current cache), ``"cache"`` (each tail token's post-RoPE queries, stored by the
    step that computed it until its window is compressed: no second forward, memory L·Hq·D per tail token), or
    ``"auto"`` (cache on CPU where compute is scarce, recompute on CUDA).
  * ``lossless`` — VeriCache-style exact decoding (engine/lossless.py): draft from the compressed cache, verify
    against a full copy kept in host memory; ``horizon_min`` / ``horizon_max`` bound the adaptive draft length.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from compression import registry
from compression.primitives import is_int
from compression.registry import ConfigError

_PREFIX = "kv_compression"
#: Seeds feed torch generators, which take 64-bit seeds.
INT64_MAX = 2**63 - 1


def num_topk(ratio: float, n: int) -> int:
    """⌈r·n⌉ (eq. 4), robust to binary float error (0.3 · 10 is 3.0000000000000004 in floats, but ⌈·⌉ must be 3).
    At least 1 for r > 0: ⌈·⌉ of a positive number is >= 1, and the rounding must not turn a tiny r·n into 0 (a
    ratio the validator accepts never asks a round to keep nothing of a region)."""
    if n <= 0:
        return 0
    return min(n, max(1, math.ceil(round(ratio * n, 9))))


def field_error(name: str, what: str, value: Any) -> ConfigError:
    return ConfigError(f"{_PREFIX}.{name} {what}, got {value!r}", f"{_PREFIX}.{name}")


@dataclass(frozen=True)
class _Common:
    policy: str = ""  # "" -> the method's default policy
    ratio: float = 0.3
    window: int = 512
    buffer: int = 64
    compression_period: int = 512
    compress_prompt: bool = False
    threshold_max: int = 2048
    threshold_target: int = 1024
    observation_window: int = 32
    seed: int = 0
    query_source: str = "auto"
    lossless: bool = False
    horizon_min: int = 2
    horizon_max: int = 32


COMMON_FIELDS = tuple(f.name for f in fields(_Common))
QUERY_SOURCES = ("auto", "recompute", "cache")
_INT_FIELDS = ("window", "buffer", "compression_period", "threshold_max", "threshold_target", "observation_window",
               "seed", "horizon_min", "horizon_max")


class KVCompressionConfig:
    """Validated, immutable compression settings. ``KVCompressionConfig(method="kara", ratio=0.2, chunk_max=4)``:
    keyword arguments are common fields or the method's parameters; method parameters are also readable as
    attributes (``cfg.chunk_max``)."""

    __slots__ = ("method", "common", "params", "_key")

    def __init__(self, method: str = "kara", _relations: bool = True, **values: Any):
        spec = registry.get(method)
        common_values, param_values = {}, dict(spec.defaults)
        allowed = set(COMMON_FIELDS) | set(spec.param_names())
        for key, value in values.items():
            if key in COMMON_FIELDS:
                common_values[key] = value
            elif key in allowed:
                param_values[key] = value
            else:
                raise ConfigError(f"{_PREFIX}.{key} is not a setting of method {method!r}: unknown key {key!r} "
                                  f"(allowed: {', '.join(['method', *sorted(allowed)])})", f"{_PREFIX}.{key}")
        common = _Common(**common_values)
        if not common.policy:
            common = replace(common, policy=spec.policies[0])
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "common", _validate_common(common, spec, _relations))
        try:
            params = spec.params(**param_values)
        except TypeError as err:  # a dataclass that rejects a value type in its own __init__
            raise ConfigError(f"{_PREFIX}: {err}", _PREFIX) from None
        params.validate()
        check = getattr(params, "check_common", None)
        if _relations and check is not None:  # a rule between a method parameter and the common fields
            check(object.__getattribute__(self, "common"))
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "_key", tuple(sorted(self.to_dict().items(), key=lambda kv: kv[0])))

    def __getattr__(self, name: str) -> Any:
        if name in COMMON_FIELDS:
            return getattr(self.common, name)
        params = object.__getattribute__(self, "params")
        if name in {f.name for f in fields(params)}:
            return getattr(params, name)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        raise AttributeError("KVCompressionConfig is immutable; build a new one (coerce / replace)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCompressionConfig) and self._key == other._key

    def __reduce__(self):  # immutable slots: pickled (to tensor-parallel workers) as its settings
        return _from_dict, (self.to_dict(),)

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        try:
            body = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        except AttributeError:  # raised during __init__
            body = "..."
        return f"KVCompressionConfig({body})"

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **asdict(self.common), **asdict(self.params)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, base: "KVCompressionConfig | None" = None) -> "KVCompressionConfig":
        return coerce({} if d is None else d, base)

    def replace(self, **changes: Any) -> "KVCompressionConfig":
        return coerce(changes, self)

    # ------------------------------------------------------------------ derived numbers
    @property
    def spec(self) -> registry.MethodSpec:
        return registry.get(self.method)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def periodic(self) -> bool:
        return self.enabled and self.policy == "periodic"

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
        """Region slots the method keeps from a full window (n = window − buffer)."""
        comp = self.make_compressor()
        return comp.num_kept(self.region_len) if comp is not None else self.region_len

    def make_compressor(self):
        spec = self.spec
        return spec.factory(self) if spec.factory is not None else None


def _from_dict(d: dict) -> "KVCompressionConfig":
    d = dict(d)
    return KVCompressionConfig(d.pop("method"), **d)


def _validate_common(c: _Common, spec: registry.MethodSpec, relations: bool = True) -> _Common:
    if c.policy not in spec.policies:
        raise field_error("policy", f"must be one of {list(spec.policies)} for method {spec.name!r}", c.policy)
    if isinstance(c.ratio, bool) or not isinstance(c.ratio, (int, float)):
        raise field_error("ratio", "must be a number in (0, 1]", c.ratio)
    if math.isnan(float(c.ratio)) or not 0.0 < float(c.ratio) <= 1.0:
        raise field_error("ratio", "must be in (0, 1]", c.ratio)
    for name in _INT_FIELDS:
        if not is_int(getattr(c, name)):
            raise field_error(name, "must be an integer", getattr(c, name))
    if not isinstance(c.compress_prompt, bool):
        raise field_error("compress_prompt", "must be a boolean", c.compress_prompt)
    if not isinstance(c.lossless, bool):
        raise field_error("lossless", "must be a boolean", c.lossless)
    if c.query_source not in QUERY_SOURCES:
        raise field_error("query_source", f"must be one of {list(QUERY_SOURCES)}", c.query_source)
    for name, low in (("window", 2), ("buffer", 1), ("compression_period", 1), ("observation_window", 1),
                      ("threshold_target", 2), ("threshold_max", 3), ("seed", 0), ("horizon_min", 1),
                      ("horizon_max", 1)):
        if getattr(c, name) < low:
            raise field_error(name, f"must be >= {low}", getattr(c, name))
    if c.seed > INT64_MAX:
        raise field_error("seed", f"must be <= {INT64_MAX}", c.seed)
    if relations:  # between fields: only once the fields are complete (a request's dict may rely on the engine's)
        if c.buffer >= c.window:
            raise field_error("buffer", f"must satisfy 0 < buffer < window ({c.window})", c.buffer)
        if c.compression_period < c.window - c.buffer:
            raise field_error("compression_period", f"must be >= window - buffer ({c.window - c.buffer})",
                              c.compression_period)
        if c.threshold_target <= c.observation_window:
            raise field_error("threshold_target", f"must be > observation_window ({c.observation_window})",
                              c.threshold_target)
        if c.threshold_max <= c.threshold_target:
            raise field_error("threshold_max", f"must be > threshold_target ({c.threshold_target})", c.threshold_max)
        if c.horizon_max < c.horizon_min:
            raise field_error("horizon_max", f"must be >= horizon_min ({c.horizon_min})", c.horizon_max)
    return replace(c, ratio=float(c.ratio))


def coerce(value: Any, base: KVCompressionConfig | None = None,
           relations: bool = True) -> KVCompressionConfig | None:
    """The one way to turn a user's setting into a config.

    ``value``: None (→ ``base``), a config, a method name, or a dict of fields. Fields not given keep ``base``'s
    values: the common ones always, the method parameters when the method stays the same (so
    ``{"ratio": 0.2}`` changes only the ratio of a server's setting). Raises `ConfigError` naming the field."""
    if value is None:
        return base
    if isinstance(value, KVCompressionConfig):
        return value
    if isinstance(value, str):
        if value not in registry.names():  # the whole field is the bad parameter
            raise ConfigError(f"{_PREFIX} must be one of {registry.names()} or an object, got {value!r}", _PREFIX)
        value = {"method": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_PREFIX} must be a method name or an object of settings, got {value!r}", _PREFIX)
    d = dict(value)
    method = d.pop("method", base.method if base is not None and base.enabled else "kara")
    if method == "none":
        if d:  # like every method, "none" rejects settings it does not have (a typo must not pass silently)
            key = sorted(map(str, d))[0]
            raise ConfigError(f"{_PREFIX}.{key} is not a setting of method 'none' (it takes no other key)",
                              f"{_PREFIX}.{key}")
        return KVCompressionConfig("none")
    values: dict[str, Any] = {}
    if base is not None and base.enabled:
        values.update(asdict(base.common))
        if method == base.method:
            values.update(asdict(base.params))
        else:
            values.pop("policy")  # another method: its own default policy unless given
    values.update(d)
    return KVCompressionConfig(method, _relations=relations, **values)


@dataclass(frozen=True)
class Limits:
    """What one engine can hold, which bounds every integer setting a request can carry: token counts (windows,
    buffers, periods, thresholds, horizons, chunk and kernel sizes) by ``max_model_len`` (a longer one could never
    act, and buffers are sized from them), and the fields a method's parameter record names in its ``LIMITS``
    (e.g. ``{"entropy_top_k": "vocab_size"}``) by that attribute instead."""
    max_model_len: int
    vocab_size: int


def check_limits(cfg: KVCompressionConfig, reference: KVCompressionConfig | None, limits: Limits) -> None:
    """Raise `ConfigError` naming the first integer setting of ``cfg`` above its bound. A value up to what the
    engine itself would use for this method (``reference``: its configured setting) is always allowed, so an
    operator's default never makes requests fail."""
    if not cfg.enabled:
        return
    named = getattr(cfg.params, "LIMITS", {})
    ref = reference.to_dict() if reference is not None and reference.method == cfg.method else {}
    for name, value in cfg.to_dict().items():
        if not is_int(value) or name == "seed":  # seeds: int64, checked with the other fields
            continue
        attr = named.get(name, "max_model_len")
        bound = getattr(limits, attr)
        if value > max(bound, ref.get(name) if is_int(ref.get(name)) else 0):
            raise field_error(name, f"must be <= {bound} (this engine's {attr})", value)


__all__ = ["KVCompressionConfig", "ConfigError", "coerce", "num_topk", "COMMON_FIELDS", "Limits", "check_limits"]
