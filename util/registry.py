"""A name -> implementation table for the pluggable parts (attention backends, GEMM backends, layer ops,
quantization, KV-compression methods): each part registers itself where it is defined, and the engine, the config
checks and the CLI's choices read the same table."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind  # the setting that names an entry, for error messages ("attention_backend")
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T | None = None) -> Callable[[T], T] | T:
        """``register(name, entry)``, or ``@register(name)`` over a function or class."""
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add(entry) if entry is not None else add

    def get(self, name: str) -> T:
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"{self.kind} must be one of {self.names()}, got {name!r}")
        return self._entries[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
