"""Parsers of forced tool calls. With ``tool_choice`` named or ``"required"`` the output is constrained by a JSON
schema (server/tools/schema.py), so it is read as JSON rather than searched for markers:

* named (``{"type": "function", "function": {"name": "f"}}``): the output is the arguments object of one call of
  ``f``; its text is the call's arguments as generated (a cut-off output still yields the call, as in vLLM).
* required: the output is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, one per call.

Both stream like any tool parser (server/tools/base.py): a call's name first, then its arguments' text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from server.tools.base import ParsedToolCall, Scan, ToolCallText, ToolParser, call_from_reader, parsed_call
from server.tools.jsonscan import ObjectReader, skip_ws, value_end
from util.jsondepth import MAX_JSON_DEPTH, text_depth


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def scan(self, text: str, final: bool, state: None = None) -> Scan:
        args = text.lstrip()
        return Scan("", [ToolCallText(self.function_name, args)] if args or final else [])

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        return "", [ParsedToolCall(self.function_name, text.strip())]


@dataclass
class _ArrayState:
    i: int = 0  # where reading continues
    expect: str = "open"  # "open" ([), "element" ({), "separator" (, or ]), "done"
    readers: list[ObjectReader] = field(default_factory=list)


class RequiredToolParser(ToolParser):
    name = "required"

    def new_state(self) -> _ArrayState:
        return _ArrayState()

    def scan(self, text: str, final: bool, state: _ArrayState | None = None) -> Scan:
        st = state if state is not None else self.new_state()
        self._advance(text, st)
        out = Scan()
        for reader in st.readers:
            call = call_from_reader(text, reader, "name", "parameters", complete=reader.end is not None or final)
            out.calls.append(call)
            if call.name is None or reader.end is None:
                break  # the next call is streamed only after this one's name
        return out

    @staticmethod
    def _advance(text: str, st: _ArrayState) -> None:
        while st.expect != "done":
            if st.readers and st.readers[-1].end is None:
                if st.readers[-1].feed(text).end is None:
                    return
                st.i, st.expect = st.readers[-1].end, "separator"
            st.i = skip_ws(text, st.i)
            if st.i >= len(text):
                return
            c = text[st.i]
            if st.expect == "open" and c == "[":
                st.i, st.expect = st.i + 1, "element"
            elif st.expect == "element" and c == "{":
                st.readers.append(ObjectReader(st.i))
            elif st.expect == "separator" and c == ",":
                st.i, st.expect = st.i + 1, "element"
            else:
                st.expect = "done"

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]] | None:
        if text_depth(text, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            return None  # json.loads would recurse past the interpreter's limit
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
