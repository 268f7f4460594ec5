"""The tool-call-parser contract: find the tool calls in a model's (answer) output, at once (`extract`) or while it
streams (`delta`).

A parser is pure, like the reasoning parsers (server/reasoning/base.py): `scan(text, final)` reads what ``text``
says so far: the content that can no longer turn into a call (a tail that might still become a marker is held
back unless ``final``), each call's name once it is complete and its raw arguments text as far as it goes.
`delta` diffs the scans of the previous and the current text, resuming the previous step's reading (a
`new_state` object) instead of reading the whole text again. Arguments are the model's own JSON text of the value
(validated by `extract`), so the streamed fragments of a call add up to exactly its non-streamed arguments. A
call's name is streamed before any of its arguments, and call i+1 only once call i has its name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from server.tools.jsonscan import ObjectReader


@dataclass(frozen=True)
class ToolCallText:
    """One call as read so far: ``name`` None until complete; ``arguments`` the raw JSON text read so far."""

    name: str | None
    arguments: str = ""


@dataclass
class Scan:
    content: str = ""
    calls: list[ToolCallText] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call ``index``: its ``name`` the first time (then None), and new ``arguments`` text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON text


class ToolParser:
    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()  # the format's marker strings (kept in the text if special tokens)

    def new_state(self) -> Any:
        """The incremental reading state of one growing text (`scan`'s ``state``)."""
        return None

    def scan(self, text: str, final: bool, state: Any = None) -> Scan:
        """What ``text`` says so far. ``state`` (from `new_state`) carries the reading of a text that only grows,
        so a stream costs O(new text) per step; without it ``text`` is read from scratch."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]] | None:
        """(content, calls) of a complete output, or None when a call in it is malformed."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a complete output; an output with a malformed call is all content, no call (as in
        vLLM); empty content is None."""
        parsed = self.parse(text)
        if parsed is None:
            return text or None, []
        content, calls = parsed
        return content or None, calls

    def delta(self, previous_text: str, current_text: str, delta_text: str,
              final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call pieces) newly decided when the output grew from ``previous_text`` to ``current_text``
        (= ``previous_text + delta_text``); ``final`` releases a held-back tail. Consecutive calls of one stream
        reuse the previous call's reading."""
        assert current_text.endswith(delta_text) and len(current_text) == len(previous_text) + len(delta_text)
        memo = getattr(self, "_memo", None)
        if memo is None or memo[0] != len(previous_text):
            state = self.new_state()
            memo = (len(previous_text), self.scan(previous_text, False, state), state)
        _, before, state = memo
        now = self.scan(current_text, final, state)
        self._memo = (len(current_text), now, state)
        out = []
        for i, call in enumerate(now.calls):
            old = before.calls[i] if i < len(before.calls) else ToolCallText(None)
            name = call.name if old.name is None else None
            args = call.arguments[len(old.arguments):] if call.arguments.startswith(old.arguments) else ""
            if name is not None or args:
                out.append(ToolCallDelta(i, name, args))
        return now.content[len(before.content):], out


def call_from_reader(text: str, reader: ObjectReader, name_key: str, args_key: str, complete: bool,
                     limit: int | None = None) -> ToolCallText:
    """The call described by the object ``reader`` has read from ``text`` (``{"name": ..., "arguments": {...}}``)
    as far as it goes. Arguments stream only once the name is known, as raw text while they are an object or
    array (up to ``limit``); a scalar value (rare) only when complete; missing ones are ``{}`` once complete."""
    members = {m.key: m for m in reader.members}
    name_member = members.get(name_key)
    if name_member is None or name_member.end is None:
        return ToolCallText(None)
    try:
        name = json.loads(text[name_member.start:name_member.end])
    except ValueError:
        return ToolCallText(None)
    if not isinstance(name, str):
        return ToolCallText(None)
    m = members.get(args_key)
    if m is None:
        return ToolCallText(name, "{}" if complete else "")
    if m.end is not None:
        return ToolCallText(name, text[m.start:m.end])
    if text[m.start] not in "{[":
        return ToolCallText(name, "")
    return ToolCallText(name, text[m.start:len(text) if limit is None else max(m.start, limit)])


def parsed_call(obj: object, raw: str, offset: int, name_key: str, args_key: str) -> ParsedToolCall | None:
    """A complete call from its decoded JSON ``obj`` and raw text (for the arguments' own text), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return None
    call = call_from_reader(raw, ObjectReader(offset).feed(raw), name_key, args_key, complete=True)
    return ParsedToolCall(obj[name_key], call.arguments)
