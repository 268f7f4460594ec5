"""Tool calling: tool-call parsers (``--tool-call-parser``; the contract in base.py, the names in registry.py),
the parsers of forced calls (``tool_choice`` required / named, forced.py) and their JSON schemas (schema.py)."""
from server.tools import hermes  # noqa: F401  (registers itself)
from server.tools.base import ParsedToolCall, ToolCallDelta, ToolParser
from server.tools.registry import get, names

__all__ = ["ParsedToolCall", "ToolCallDelta", "ToolParser", "get", "names"]
