"""Tool calling in the OpenAI chat protocol: the request's ``tools`` / ``tool_choice``, the assistant's
``tool_calls`` (in responses, stream deltas and conversation history) and the checks vLLM makes on them.

``tool_choice``: ``"none"`` (never parse calls; the tools are still shown to the template), ``"auto"`` (the default
when ``tools`` are given; needs the server's ``--enable-auto-tool-choice --tool-call-parser``), ``"required"`` (at
least one call) or ``{"type": "function", "function": {"name": ...}}`` (that function); the last two are forced
with a JSON schema through structured outputs (server/tools/schema.py).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# ------------------------------------------------------------------------------------------------ request
class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice``; ``param`` names the field (HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


_CORRECT_NAMED = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoiceField = Optional[Union[str, dict[str, Any]]]


def resolve_tool_choice(tools: list[ChatCompletionTool] | None, tool_choice: Any,
                        given: bool) -> Union[str, NamedToolChoice]:
    """The effective tool_choice, checked as vLLM checks it (a ToolError names the bad field).
    ``given``: whether the request set ``tool_choice`` (without it: "auto" when tools are given, else "none")."""
    if tools is not None and not tools:
        raise ToolError("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                         "entirely.", "tools")
    if not given or tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice == "none":
        return "none"
    if tools is None:
        raise ToolError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "required"):
            return tool_choice
        raise ToolError(f'Invalid value for `tool_choice`: {tool_choice}! Only named tools, "none", "auto" or '
                         '"required" are supported.', "tool_choice")
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_NAMED}",
                         "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_NAMED}",
                         "tool_choice.function.name")
    if tool_choice.get("type", "function") != "function":
        raise ToolError(f"Invalid `type` in `tool_choice`! {_CORRECT_NAMED}", "tool_choice.type")
    if not any(t.function.name == name for t in tools):
        raise ToolError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                         "tool_choice")
    return NamedToolChoice(function=NamedFunction(name=name))


# ---------------------------------------------------------------------------------------------- responses
class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text


class HistoryFunctionCall(BaseModel):
    """A call in an assistant message sent back as history: OpenAI clients send the arguments as JSON text."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class HistoryToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: HistoryFunctionCall


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _OmitNoneFields(BaseModel):
    """Fields that are None are left out of the JSON (a stream delta carries only what it says)."""

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitNoneFields):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_OmitNoneFields):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None
