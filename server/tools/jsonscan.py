"""Reading JSON that is still being generated: where a value ends (or that it has not ended yet), and the members
of an object read so far. Tool-call parsers use these to stream a call's name as soon as it is complete and its
arguments as raw text while they grow."""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_LITERAL_END = _WS + ",]}"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """Index just after the JSON value starting at ``s[i]``, or None when ``s`` ends before the value does (a
    number or literal at the very end might still grow). The value is not validated, only delimited."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in _LITERAL_END:
        j += 1
    return j if j < len(s) else None


def _string_end(s: str, i: int) -> int | None:
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


@dataclass(frozen=True)
class Member:
    key: str
    start: int  # the value's first character
    end: int | None  # just after the value; None while it is incomplete


def object_members(s: str, i: int = 0) -> list[Member]:
    """The members of the JSON object starting at ``s[i]`` (after whitespace) as far as ``s`` goes: complete
    members, then at most one whose value is incomplete. A malformed object yields what was read before."""
    i = skip_ws(s, i)
    if i >= len(s) or s[i] != "{":
        return []
    out: list[Member] = []
    i += 1
    while True:
        i = skip_ws(s, i)
        if i >= len(s) or s[i] != '"':
            return out
        key_end = _string_end(s, i)
        if key_end is None:
            return out
        try:
            key = json.loads(s[i:key_end])
        except ValueError:
            return out
        i = skip_ws(s, key_end)
        if i >= len(s) or s[i] != ":":
            return out
        start = skip_ws(s, i + 1)
        if start >= len(s):
            return out
        end = value_end(s, start)
        out.append(Member(key, start, end))
        if end is None:
            return out
        i = skip_ws(s, end)
        if i >= len(s) or s[i] != ",":
            return out
        i += 1
