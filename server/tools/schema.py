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
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
# keywords whose value is a schema, a list of schemas, or a map of name -> schema
_SCHEMA = ("not", "additionalProperties", "additionalItems", "contains", "propertyNames", "if", "then", "else",
           "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_parameters(schema: Any) -> None:
    """Raises ValueError when a tool's ``parameters`` is not a JSON schema in the shapes the keywords need (a
    ``type`` that is no JSON type, ``properties`` that are not schemas, ...), so a forced tool_choice names the
    tool, not the structured output made from it. Walks without recursion (depth is bounded by the caller)."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        at = f" at {where}" if where else ""
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise ValueError(f"a schema must be an object or a boolean{at}, got {type(node).__name__}")
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        if (not kinds and kind is not None) or not all(isinstance(k, str) and k in _TYPES for k in kinds):
            raise ValueError(f"unsupported type {kind!r}{at}; a JSON schema type is one of {sorted(_TYPES)}")
        required = node.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ValueError(f"'required'{at} must be a list of property names")
        if "enum" in node and not isinstance(node["enum"], list):
            raise ValueError(f"'enum'{at} must be a list")
        for key in _SCHEMA:
            if key in node:
                stack.append((node[key], f"{where}.{key}".lstrip(".")))
        items = node.get("items")
        if isinstance(items, list):
            stack.extend((s, f"{where}.items[{i}]".lstrip(".")) for i, s in enumerate(items))
        elif items is not None:
            stack.append((items, f"{where}.items".lstrip(".")))
        for key in _SCHEMA_LIST:
            if key in node:
                if not isinstance(node[key], list) or not node[key]:
                    raise ValueError(f"'{key}'{at} must be a non-empty list of schemas")
                stack.extend((s, f"{where}.{key}[{i}]".lstrip(".")) for i, s in enumerate(node[key]))
        for key in _SCHEMA_MAP:
            if key in node:
                if not isinstance(node[key], dict):
                    raise ValueError(f"'{key}'{at} must be an object of schemas")
                stack.extend((s, f"{where}.{key}.{name}".lstrip(".")) for name, s in node[key].items())


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
