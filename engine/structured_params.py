"""Structured-output settings of one request (vLLM's `StructuredOutputsParams`): exactly one constraint, checked
when built, plus the name of the request field it came from so errors can name it. Compiled and enforced by
engine/structured.py. No torch here: `engine` exports this before the threads are configured."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import InvalidRequestError
from util.jsondepth import count_nodes, text_depth, value_depth

KINDS = ("json", "regex", "choice", "grammar", "json_object")

# json.loads recurses once per nesting level: a schema text is measured before it is parsed, against this hard bound
# (below the interpreter's recursion limit) whatever the server's own, lower, depth limit.
PARSE_DEPTH = 512


@dataclass(frozen=True)
class GrammarLimits:
    """How large a constraint may be before it is compiled. Compile time grows faster than linearly with schema
    depth and with the properties of one object, so each has a bound (a 400 naming the field past it); the
    defaults are far above what real schemas, tools and grammars use. ``timeout`` bounds a compile that stays
    within them all (queue wait included)."""
    max_depth: int = 128  # JSON nesting of a schema
    max_properties: int = 512  # object properties across a schema
    max_enum: int = 4096  # enum / const values across a schema, and choices
    max_length: int = 65536  # characters of a regex, a grammar, a schema's text, or all choices together
    max_rules: int = 1024  # rules of an EBNF grammar
    timeout: float = 10.0  # seconds

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_properties", "max_enum", "max_length", "max_rules"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"structured_outputs_{name} must be a positive integer, got {value!r}")
        if self.max_depth > PARSE_DEPTH:
            raise ValueError(f"structured_outputs_max_depth must be <= {PARSE_DEPTH}, got {self.max_depth}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not self.timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0 seconds, got {self.timeout!r}")

    def check(self, so: "StructuredOutputsParams") -> None:
        """An InvalidRequestError naming the field if the constraint is over a limit; cheap and recursion-free."""
        where = so.field
        if so.json is not None:
            text = so.json if isinstance(so.json, str) else None
            if text is not None and len(text) > self.max_length:
                self._over(where, f"a schema of {len(text)} characters", "max_length")
            schema = json.loads(text) if text is not None else so.json
            depth = value_depth(schema, self.max_depth)
            if depth > self.max_depth:
                self._over(where, "a schema nested deeper", "max_depth")
            if count_nodes(schema, 8 * self.max_length) > 8 * self.max_length:
                self._over(where, "a schema this large", "max_length")
            props, values = _schema_counts(schema)
            if props > self.max_properties:
                self._over(where, f"{props} object properties", "max_properties")
            if values > self.max_enum:
                self._over(where, f"{values} enum/const values", "max_enum")
        for name in ("regex", "grammar"):
            value = getattr(so, name)
            if value is not None and len(value) > self.max_length:
                self._over(where, f"a {name} of {len(value)} characters", "max_length")
        if so.grammar is not None:
            rules = len(_RULE.findall(so.grammar))
            if rules > self.max_rules:
                self._over(where, f"{rules} grammar rules", "max_rules")
        if so.choice is not None:
            if len(so.choice) > self.max_enum:
                self._over(where, f"{len(so.choice)} choices", "max_enum")
            total = sum(len(c) for c in so.choice)
            if total > self.max_length:
                self._over(where, f"choices of {total} characters together", "max_length")

    def _over(self, where: str, what: str, limit: str) -> None:
        raise InvalidRequestError(f"{where}: {what} is over this server's limit of {getattr(self, limit)} "
                                  f"(--structured-outputs-{limit.replace('_', '-')})", where)


_RULE = re.compile(r"::=")


def _schema_counts(schema: Any) -> tuple[int, int]:
    """(object properties, enum and const values) anywhere in a parsed schema, without recursion."""
    props = values = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            p = node.get("properties")
            if isinstance(p, dict):
                props += len(p)
            e = node.get("enum")
            if isinstance(e, list):
                values += len(e)
            if "const" in node:
                values += 1
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return props, values


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, dict or string), `regex`, `choice` (a list of strings),
    `grammar` (EBNF / GBNF, as xgrammar and llama.cpp take it) or `json_object` (any JSON object)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace outside strings (compact separators)
    whitespace_pattern: str | None = None  # not supported by xgrammar: rejected
    param: str | None = None  # the request field this came from; errors name it
    # Set by the server, not by requests: the grammar applies only after the output contains these tokens (the
    # reasoning parser's end marker), as vLLM starts structured outputs where the reasoning ends.
    after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = f"got {', '.join(given)}" if given else "got none"
            raise InvalidRequestError(f"structured_outputs needs exactly one of {', '.join(KINDS)} ({what})",
                                      self.param or "structured_outputs")
        where = self.field
        if self.whitespace_pattern is not None:
            raise InvalidRequestError("whitespace_pattern is not supported (xgrammar has no whitespace regex); use "
                                      "disable_any_whitespace", "structured_outputs.whitespace_pattern")
        if self.json_object is not None and self.json_object is not True:
            raise InvalidRequestError(f"json_object must be true, got {self.json_object!r}", where)
        if self.json is not None:
            if isinstance(self.json, str):
                if text_depth(self.json, PARSE_DEPTH) > PARSE_DEPTH:
                    raise InvalidRequestError(f"{where}: nested deeper than {PARSE_DEPTH} levels", where)
                try:
                    parsed = json.loads(self.json)
                except ValueError as err:
                    raise InvalidRequestError(f"{where}: not valid JSON ({err})", where) from None
            else:
                parsed = self.json
                if value_depth(parsed, PARSE_DEPTH) > PARSE_DEPTH:  # json.dumps recurses too
                    raise InvalidRequestError(f"{where}: nested deeper than {PARSE_DEPTH} levels", where)
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError(f"{where}: a JSON schema must be an object, got {type(parsed).__name__}",
                                          where)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{where} must be a non-empty string", where)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError(f"{where} must be a non-empty list of non-empty strings", where)
            self.choice = list(self.choice)
        if self.after is not None:
            if (not isinstance(self.after, (list, tuple)) or not self.after
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.after)):
                raise InvalidRequestError("structured_outputs.after must be a non-empty list of token ids",
                                          "structured_outputs.after")
            self.after = tuple(self.after)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The request field errors name: the given `param`, else ``structured_outputs.<kind>``."""
        return self.param or f"structured_outputs.{self.kind}"

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams | None":
        """None, a StructuredOutputsParams, or a dict of its fields (unknown keys rejected)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"structured_outputs must be an object, got {type(value).__name__}",
                                      "structured_outputs")
        known = {f.name for f in fields(cls)} - {"after"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"structured_outputs: unknown field(s) {unknown}; known: {sorted(known)}",
                                      f"structured_outputs.{unknown[0]}")
        return cls(**value)


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are valid EBNF literals for xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
