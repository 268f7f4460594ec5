"""``--tool-call-parser hermes``: the tool-call format of Hermes 2 Pro and later, Qwen2.5 and Qwen3.

The model answers with optional text, then one or more blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>`` (text between and after the blocks is dropped, as in vLLM).
The last block may lack ``</tool_call>`` (generation stopped on it); it is a call if its JSON is complete. A
``</tool_call>`` inside the JSON's strings does not end a block. A block whose JSON is malformed makes the whole
output plain content (`ToolParser.extract`).
"""
from __future__ import annotations

import json

from server.textscan import partial_suffix_len
from server.tools.base import ParsedToolCall, Scan, ToolParser, call_from_object, parsed_call
from server.tools.jsonscan import skip_ws, value_end
from server.tools.registry import register


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start, end)

    def _blocks(self, text: str, final: bool) -> tuple[int, list[tuple[int, int, bool]]]:
        """(end of the content, [(body start, body stop, closed)]) for the blocks in ``text``."""
        first = text.find(self.start)
        if first < 0:
            return len(text) - (0 if final else partial_suffix_len(text, (self.start,))), []
        blocks, pos = [], first
        while pos >= 0:
            body = pos + len(self.start)
            # a "</tool_call>" inside the call's JSON strings does not end the block
            value = skip_ws(text, body)
            json_end = value_end(text, value) if text.startswith("{", value) else None
            stop = text.find(self.end, body if json_end is None else json_end)
            if stop < 0:
                stop = len(text) - (0 if final else partial_suffix_len(text, (self.end,), body))
                blocks.append((body, stop, False))
                break
            blocks.append((body, stop, True))
            pos = text.find(self.start, stop + len(self.end))
        return first, blocks

    def scan(self, text: str, final: bool) -> Scan:
        content_end, blocks = self._blocks(text, final)
        out = Scan(text[:content_end])
        for body, stop, closed in blocks:
            segment = text[body:stop]
            start = skip_ws(segment, 0)
            complete = closed or final or value_end(segment, start) is not None
            call = call_from_object(segment, start, "name", "arguments", complete)
            out.calls.append(call)
            if call.name is None:
                break  # the next call is streamed only after this one's name
        return out

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]] | None:
        content_end, blocks = self._blocks(text, final=True)
        calls = []
        for body, stop, _ in blocks:
            segment = text[body:stop]
            try:
                obj = json.loads(segment)
            except ValueError:
                return None
            call = parsed_call(obj, segment, skip_ws(segment, 0), "name", "arguments")
            if call is None:
                return None
            calls.append(call)
        return text[:content_end], calls


register(HermesToolParser)
