"""Reasoning parsers (``--reasoning-parser``): split a reasoning model's output into ``reasoning_content`` and
``content``. The contract is in base.py, the names in registry.py."""
from server.reasoning import deepseek_r1, qwen3  # noqa: F401  (they register themselves)
from server.reasoning.base import ReasoningParser
from server.reasoning.registry import get, names

__all__ = ["ReasoningParser", "get", "names"]
