"""Reasoning parsers by name (``--reasoning-parser NAME``): a parser is one module that calls `register` at its
bottom, plus one import line in server/reasoning/__init__.py."""
from __future__ import annotations

from server.reasoning.base import ReasoningParser

_PARSERS: dict[str, type[ReasoningParser]] = {}


def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    if not cls.name or cls.name in _PARSERS:
        raise ValueError(f"reasoning parser name {cls.name!r} is empty or already registered")
    _PARSERS[cls.name] = cls
    return cls


def get(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(names())}") from None


def names() -> list[str]:
    return sorted(_PARSERS)
