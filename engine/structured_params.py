"""Structured-output settings of one request (vLLM's `StructuredOutputsParams`): exactly one constraint, checked
when built, plus the name of the request field it came from so errors can name it. Compiled and enforced by
engine/structured.py. No torch here: `engine` exports this before the threads are configured."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
                try:
                    parsed = json.loads(self.json)
                except ValueError as err:
                    raise InvalidRequestError(f"{where}: not valid JSON ({err})", where) from None
            else:
                parsed = self.json
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
