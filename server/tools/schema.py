"""The JSON schema that forces tool calls (``tool_choice`` named or ``"required"``), as vLLM builds it for its
structured-outputs backend; the sampler masks logits so the output matches it (server/tools/forced.py reads it).

* named ``f``: ``f``'s parameters schema (an empty object schema when ``f`` declares none).
* required: an array of at least one ``{"name": <one tool's name>, "parameters": <that tool's parameters>}``
  (``anyOf`` over the tools; at most one item when ``parallel_tool_calls`` is false), with the tools' ``$defs``
  hoisted to the top so their ``$ref``s resolve.
* none / auto: None (free generation).
"""
from __future__ import annotations

import copy
from typing import Any

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def _function(tool: Any) -> dict[str, Any]:
    d = tool if isinstance(tool, dict) else tool.model_dump(exclude_none=True)
    return d.get("function", d)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return copy.deepcopy(params) if params else dict(_EMPTY_OBJECT)


def tool_choice_schema(tools: list[Any] | None, tool_choice: Any,
                       parallel_tool_calls: bool = True) -> dict[str, Any] | None:
    """The schema for ``tool_choice`` over ``tools`` (dicts or api.tools models); None when nothing is forced.
    Raises ValueError for a named tool that is not among ``tools`` or for conflicting ``$defs``."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    functions = [_function(t) for t in tools]
    if tool_choice != "required":
        choice = tool_choice if isinstance(tool_choice, dict) else tool_choice.model_dump()
        name = choice["function"]["name"]
        for f in functions:
            if f["name"] == name:
                return _parameters(f)
        raise ValueError(f"Tool '{name}' has not been passed in `tools`.")
    defs: dict[str, Any] = {}
    items = []
    for f in functions:
        params = _parameters(f)
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"Tool definition '{key}' has multiple schemas, which is not supported.")
            defs[key] = value
        items.append({"properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
