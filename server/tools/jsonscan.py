"""Reading JSON that is still being generated: where a value ends (or that it has not ended yet), and the members
of an object read so far. Tool-call parsers use these to stream a call's name as soon as it is complete and its
arguments as raw text while they grow.

The readers are resumable: `feed(text)` continues from where the last call stopped, so a stream that grows by a
few characters per step costs a few characters per step (``text`` must only grow between calls). Nothing is
validated beyond delimiting; `json.loads` validates complete outputs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_LITERAL_END = _WS + ",]}"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


class ValueReader:
    """Finds the end of the JSON value starting at ``start`` (its first character)."""

    def __init__(self, start: int):
        self.start = start
        self.i = start  # next character to read
        self.end: int | None = None  # just after the value, once found
        self._depth = 0
        self._in_string = self._escape = False

    def feed(self, s: str) -> int | None:
        if self.end is not None or self.start >= len(s):
            return self.end
        first = s[self.start]
        i = self.i
        if first not in '"{[':  # number or literal: ends at a delimiter (at the end of s it may still grow)
            while i < len(s) and s[i] not in _LITERAL_END:
                i += 1
            self.i = i
            if i < len(s):
                self.end = i
            return self.end
        while i < len(s):
            c = s[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:  # a top-level string value
                        self.end = i
                        break
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = i
                    break
        self.i = i
        return self.end


def value_end(s: str, i: int) -> int | None:
    """Index just after the JSON value starting at ``s[i]``, or None when ``s`` ends before the value does."""
    return ValueReader(i).feed(s)


@dataclass
class Member:
    key: str
    start: int  # the value's first character
    end: int | None  # just after the value; None while it is incomplete


class ObjectReader:
    """The members of the JSON object starting at ``start`` (after whitespace), as far as the text goes: complete
    members, then at most one whose value is incomplete; ``end`` once the object closes; reading stops at
    anything malformed."""

    def __init__(self, start: int):
        self.i = start
        self.members: list[Member] = []
        self.end: int | None = None
        self._state = "open"
        self._key_start = 0
        self._key = ""
        self._value: ValueReader | None = None

    @property
    def bad(self) -> bool:
        return self._state == "bad"

    def feed(self, s: str) -> "ObjectReader":
        while self._state not in ("done", "bad"):
            if not self._step(s):
                break
        return self

    def _step(self, s: str) -> bool:
        """One state transition; False when more text is needed."""
        state = self._state
        if state == "value":
            end = self._value.feed(s)
            if end is None:
                return False
            self.members[-1].end, self.i, self._state = end, end, "after_value"
            return True
        if state == "key":
            close = _string_close(s, self.i)
            if close is None:
                return False
            try:
                self._key = json.loads(s[self._key_start:close])
            except ValueError:
                self._state = "bad"
                return True
            self.i, self._state = close, "colon"
            return True
        self.i = skip_ws(s, self.i)
        if self.i >= len(s):
            return False
        c = s[self.i]
        expected = {"open": "{", "colon": ":"}.get(state)
        if expected is not None:
            self._state = ("key_or_close" if state == "open" else "value_start") if c == expected else "bad"
            self.i += 1
        elif state == "value_start":
            self._value = ValueReader(self.i)
            self.members.append(Member(self._key, self.i, None))
            self._state = "value"
        elif state == "key_or_close" and c == '"':
            self._key_start, self.i, self._state = self.i, self.i + 1, "key"
        elif c == "}" and state in ("key_or_close", "after_value"):
            self.end, self.i, self._state = self.i + 1, self.i + 1, "done"
        elif c == "," and state == "after_value":
            self.i, self._state = self.i + 1, "key_or_close"
        else:
            self._state = "bad"
        return True


def _string_close(s: str, i: int) -> int | None:
    """Index just after the closing quote of the string whose body starts at ``s[i]``, or None."""
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def object_members(s: str, i: int = 0) -> list[Member]:
    """The members of the JSON object starting at ``s[i]`` (after whitespace) as far as ``s`` goes."""
    return ObjectReader(i).feed(s).members
