"""``--tool-call-parser hermes``: the tool-call format of Hermes 2 Pro and later, Qwen2.5 and Qwen3.

The model answers with optional text, then one or more blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>`` (text between and after the blocks is dropped, as in vLLM).
A block ends at the first ``</tool_call>`` after its JSON object (one inside the JSON's strings does not end it;
a block that does not hold an object ends at the first ``</tool_call>``). The last block may lack
``</tool_call>`` (generation stopped on it); it is a call if its JSON is complete. Text after a block's object
and before its ``</tool_call>`` is dropped too. A block whose JSON is malformed (or nested deeper than
MAX_JSON_DEPTH) makes the whole output plain content (`ToolParser.extract`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from server.textscan import Finder, partial_suffix_len
from server.tools.base import ParsedToolCall, Scan, ToolCallText, ToolParser, call_from_reader, parsed_call
from server.tools.jsonscan import ObjectReader, skip_ws
from server.tools.registry import register
from util.jsondepth import MAX_JSON_DEPTH, text_depth

START, END = "<tool_call>", "</tool_call>"


@dataclass
class _Block:
    body: int  # just after <tool_call>
    reader: ObjectReader
    cap: Finder  # the first </tool_call> after the body: partial arguments never run past it
    end: Finder | None = None  # the </tool_call> that closes the block, searched once known where to look
    stop: int | None = None  # where that </tool_call> starts, once found
    call: ToolCallText | None = None  # the call of a closed block


@dataclass
class _State:
    next_start: Finder = field(default_factory=lambda: Finder(START))
    first: int = -1
    blocks: list[_Block] = field(default_factory=list)


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START, END)

    def new_state(self) -> _State:
        return _State()

    def scan(self, text: str, final: bool, state: _State | None = None) -> Scan:
        st = state if state is not None else self.new_state()
        if not st.blocks and st.next_start.find(text) < 0:
            return Scan(text[:len(text) - (0 if final else partial_suffix_len(text, (START,)))])
        out = Scan(text[:st.first if st.blocks else st.next_start.find(text)])
        i = 0
        while True:
            if i == len(st.blocks):  # all read blocks are closed: is there another one?
                start = st.next_start.find(text)
                if start < 0:
                    return out
                if not st.blocks:
                    st.first = start
                body = start + len(START)
                st.blocks.append(_Block(body, ObjectReader(body), Finder(END, body)))
            blk = st.blocks[i]
            call = self._read(text, blk, final)
            out.calls.append(call)
            if call.name is None or blk.stop is None:
                return out  # the next call is streamed only after this one's name
            if i == len(st.blocks) - 1 and st.next_start.start != blk.stop + len(END):
                st.next_start = Finder(START, blk.stop + len(END))
            i += 1

    def _read(self, text: str, blk: _Block, final: bool) -> ToolCallText:
        if blk.call is not None:
            return blk.call
        reader = blk.reader.feed(text)
        if blk.end is None and (reader.bad or reader.end is not None):
            blk.end = blk.cap if reader.bad else Finder(END, reader.end)
        if blk.end is not None and blk.end.find(text) >= 0:
            blk.stop = blk.end.find(text)
            blk.call = call_from_reader(text, reader, "name", "arguments", complete=True)
            return blk.call
        held = len(text) - (0 if final else partial_suffix_len(text, (END,), blk.body))
        cap = blk.cap.find(text)
        limit = held if cap < 0 else min(held, cap)
        return call_from_reader(text, reader, "name", "arguments", final or reader.end is not None, limit)

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]] | None:
        st = self.new_state()
        scan = self.scan(text, final=True, state=st)
        calls = []
        for blk in st.blocks:
            # the block's object, as the stream delimits it: text after it in the block is dropped (as between
            # blocks), so a stream and the whole output agree on the calls
            if blk.reader.end is None:
                return None
            segment = text[blk.body:blk.reader.end]
            if text_depth(segment, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
                return None  # json.loads would recurse past the interpreter's limit
            try:
                obj = json.loads(segment)
            except ValueError:
                return None
            call = parsed_call(obj, segment, skip_ws(segment, 0), "name", "arguments")
            if call is None:
                return None
            calls.append(call)
        return scan.content, calls


register(HermesToolParser)
