"""Method registry: a KV-compression method is a name, a compressor factory, its own parameter dataclass and the
policies it runs under. A new method is one new module that calls `register` (and one import line in
compression/__init__.py); the config, the engine, the HTTP API and the CLI pick it up from here. A method class
(compression/base.py `ScoreMethod`) carries its parameter record and policies, so ``register(name, cls)`` is all
it takes; registering at run time reaches every engine of the process (they look names up here per request).

Policies: ``"periodic"`` (KvLLM rounds over complete trailing windows, arXiv 2607.01237 §3.3) and
``"threshold"`` (the whole cache is compressed to a target length once it reaches a trigger length).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

POLICIES = ("periodic", "threshold")


class ConfigError(ValueError):
    """A bad compression setting; ``param`` names it (``kv_compression.<field>``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class NoParams:
    """Methods without parameters of their own."""

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class MethodSpec:
    name: str
    factory: Callable[[Any], Any] | None  # KVCompressionConfig -> compressor; None for "none"
    params: type = NoParams
    policies: tuple[str, ...] = ("periodic",)  # the first is the default
    defaults: dict[str, Any] = field(default_factory=dict)  # parameter defaults overriding the dataclass's
    description: str = ""

    def param_names(self) -> list[str]:
        return [f.name for f in fields(self.params)]


_REGISTRY: dict[str, MethodSpec] = {}


def register(name: str, factory: Callable[[Any], Any] | None, params: type | None = None,
             policies: tuple[str, ...] | None = None, defaults: dict[str, Any] | None = None,
             description: str = "") -> MethodSpec:
    """``params`` / ``policies`` default to the factory's own (`ScoreMethod.params` / ``.policies``), else to
    `NoParams` / periodic only."""
    params = params or getattr(factory, "params", NoParams)
    policies = policies or getattr(factory, "policies", ("periodic",))
    if name in _REGISTRY:
        raise ValueError(f"KV-compression method {name!r} is already registered")
    bad = [p for p in policies if p not in POLICIES]
    if not policies or bad:
        raise ValueError(f"method {name!r}: policies must be a non-empty subset of {POLICIES}, got {policies}")
    spec = MethodSpec(name, factory, params, tuple(policies), dict(defaults or {}), description)
    unknown = set(spec.defaults) - set(spec.param_names())
    if unknown:
        raise ValueError(f"method {name!r}: defaults for unknown parameters {sorted(unknown)}")
    _REGISTRY[name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a method (one registered at run time, e.g. by a test)."""
    del _REGISTRY[name]


def get(name: Any) -> MethodSpec:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ConfigError(f"kv_compression.method must be one of {names()}, got {name!r}", "kv_compression.method")
    return _REGISTRY[name]


def names() -> list[str]:
    return list(_REGISTRY)


register("none", None, description="no compression")
