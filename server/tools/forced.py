"""Parsers of forced tool calls. With ``tool_choice`` named or ``"required"`` the output is constrained by a JSON
schema (server/tools/schema.py), so it is read as JSON rather than searched for markers:

* named (``{"type": "function", "function": {"name": "f"}}``): the output is the arguments object of one call of
  ``f``; its text is the call's arguments as generated (a cut-off output still yields the call, as in vLLM).
* required: the output is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, one per call.

Both stream like any tool parser (server/tools/base.py): a call's name first, then its arguments' text.
"""
from __future__ import annotations

import json

from server.tools.base import ParsedToolCall, Scan, ToolCallText, ToolParser, call_from_object, parsed_call
from server.tools.jsonscan import skip_ws, value_end


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        args = text.lstrip()
        return Scan("", [ToolCallText(self.function_name, args)] if args or final else [])

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        return "", [ParsedToolCall(self.function_name, text.strip())]


class RequiredToolParser(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return out
        i += 1
        while True:
            i = skip_ws(text, i)
            if i >= len(text) or text[i] != "{":
                return out
            end = value_end(text, i)
            call = call_from_object(text, i, "name", "parameters", complete=end is not None or final)
            out.calls.append(call)
            if call.name is None or end is None:
                return out
            i = skip_ws(text, end)
            if i >= len(text) or text[i] != ",":
                return out
            i += 1

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]] | None:
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls, i = [], skip_ws(text, 0) + 1
        for item in items:
            i = skip_ws(text, i)
            call = parsed_call(item, text, i, "name", "parameters")
            if call is None:
                return None
            calls.append(call)
            i = skip_ws(text, value_end(text, i)) + 1  # past the item and its comma
        return "", calls
