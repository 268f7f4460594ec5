"""Tool-call parsers by name (``--tool-call-parser NAME``): a parser is one module that calls `register` at its
bottom, plus one import line in server/tools/__init__.py."""
from __future__ import annotations

from server.tools.base import ToolParser

_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    if not cls.name or cls.name in _PARSERS:
        raise ValueError(f"tool-call parser name {cls.name!r} is empty or already registered")
    _PARSERS[cls.name] = cls
    return cls


def get(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; available: {', '.join(names())}") from None


def names() -> list[str]:
    return sorted(_PARSERS)
