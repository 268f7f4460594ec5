"""Structured-output request fields of the HTTP API and their mapping to the engine's `StructuredOutputsParams`.

The three spellings vLLM users send are accepted on both /v1/completions and /v1/chat/completions:

* OpenAI's ``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}``;
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object", plus options
  "disable_any_whitespace", ...}``;
* vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (and
  ``guided_decoding_backend``, accepted and ignored with a log line; ``guided_whitespace_pattern`` is refused:
  xgrammar has no whitespace regex).

As in vLLM, the options of a ``structured_outputs`` object apply to a constraint given elsewhere; two constraints
are a 400. Each constraint remembers the field it came from, so the engine's 400 for a schema the library rejects
names that field (``response_format.json_schema``, ``structured_outputs.regex``, ``guided_json``...).
"""
from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from api.errors import RequestError
from engine.errors import InvalidRequestError
from engine.structured_params import StructuredOutputsParams

logger = logging.getLogger("kvllm.server")


# Unknown keys inside response_format are ignored, as vLLM's models do (some clients add their own).
class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: Optional[str] = None
    # "schema" would shadow a BaseModel attribute: stored as json_schema, sent as "schema"
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` object (its backend-specific fields are accepted where harmless)."""
    model_config = ConfigDict(extra="forbid")
    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None
    disable_fallback: bool = False  # one library, nothing to fall back to
    disable_additional_properties: bool = False  # xgrammar's strict mode already forbids unlisted properties


class StructuredFields(BaseModel):
    """The structured-output fields shared by completions and chat completions."""
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = Field(None, description="Accepted and ignored (kvllm uses xgrammar).")
    guided_whitespace_pattern: Optional[str] = Field(None, description="Not supported.")


def _constraints(req: StructuredFields) -> list[tuple[str, str, Any]]:
    """Every constraint the request carries: (engine field, request field, value)."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("json_object", "response_format", True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise RequestError("response_format of type json_schema needs json_schema.schema",
                               "response_format.json_schema")
        found.append(("json", "response_format.json_schema", rf.json_schema.json_schema))
    so = req.structured_outputs
    if so is not None:
        for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None)):
            if value is not None:
                found.append((name, f"structured_outputs.{name}", value))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((name, f"guided_{name}", value))
    return found


def structured_outputs_params(req: StructuredFields):
    """The engine's StructuredOutputsParams for a request, or None; RequestError (400) naming the field when two
    constraints are given or a field is unusable."""
    if req.guided_decoding_backend is not None:
        logger.info("guided_decoding_backend=%r ignored: kvllm's structured outputs use xgrammar",
                    req.guided_decoding_backend)
    if req.guided_whitespace_pattern is not None:
        raise RequestError("guided_whitespace_pattern is not supported (xgrammar has no whitespace regex); use "
                           "structured_outputs.disable_any_whitespace", "guided_whitespace_pattern")
    so = req.structured_outputs
    if so is not None and so.whitespace_pattern is not None:
        raise RequestError("structured_outputs.whitespace_pattern is not supported (xgrammar has no whitespace "
                           "regex); use disable_any_whitespace", "structured_outputs.whitespace_pattern")
    found = _constraints(req)
    if len(found) > 1:
        raise RequestError(f"only one structured-output constraint may be given, got {len(found)}: "
                           + ", ".join(where for _, where, _ in found), found[1][1])
    if not found:
        if so is not None:
            raise RequestError("structured_outputs needs one of json, regex, choice, grammar, json_object",
                               "structured_outputs")
        return None
    name, where, value = found[0]
    compact = so.disable_any_whitespace if so is not None else False
    try:
        return StructuredOutputsParams(**{name: value}, disable_any_whitespace=compact, param=where)
    except InvalidRequestError as err:
        raise RequestError(str(err), err.param) from None
