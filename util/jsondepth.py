"""Nesting depth of client JSON, measured without recursion: every parser of client data (json.loads, jinja,
pydantic, a schema walk) recurses, so depth is checked first and a deep value is a 400 naming its field, never a
RecursionError."""
from __future__ import annotations

import re
from typing import Any

# strings first (their brackets do not count), then the brackets themselves
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)

# The default bound: deeper than any real schema or tool argument, far below the interpreter's recursion limit.
MAX_JSON_DEPTH = 64


def text_depth(text: str, limit: int | None = None) -> int:
    """The deepest bracket nesting of JSON text (strings skipped); stops counting past ``limit``."""
    depth = deepest = 0
    for m in _TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if limit is not None and deepest > limit:
                    return deepest
        elif c in "]}":
            depth = max(0, depth - 1)
    return deepest


def value_depth(value: Any, limit: int | None = None) -> int:
    """The deepest nesting of dicts and lists in a Python value (a scalar is 0); stops past ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if limit is not None and deepest > limit:
                return deepest
        stack.extend((c, depth) for c in children)
    return deepest


def count_nodes(value: Any, limit: int | None = None) -> int:
    """How many dicts, lists and scalars a Python value holds; stops past ``limit``."""
    n = 0
    stack = [value]
    while stack:
        node = stack.pop()
        n += 1
        if limit is not None and n > limit:
            return n
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return n


def deep_path(value: Any, limit: int) -> tuple | None:
    """The path (keys and indexes) to the first dict or list of ``value`` nested deeper than ``limit``, or None;
    an error can then name where a too-deep value is."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, (list, tuple)):
            items = list(enumerate(node))
        else:
            continue
        if len(path) >= limit:
            return path
        stack.extend((child, path + (key,)) for key, child in reversed(items))
    return None
