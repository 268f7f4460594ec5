"""Chat messages: those a request sends (the conversation, passed to the chat template) and the assistant's message
a response returns whole or as stream deltas.

The assistant's output may be split by the server's parsers (server/chat_output.py) into ``content``, the chain
of thought (``reasoning_content``, and ``reasoning``, the name current vLLM writes: both carry the same text) and
``tool_calls``. History messages carry ``tool_calls`` (assistant) and ``tool_call_id`` (``tool`` role) back to
the template; a call's ``arguments`` JSON text is handed to it as an object, as vLLM does (tool-calling templates
write ``arguments | tojson``).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, model_serializer

from api.tools import DeltaToolCall, HistoryToolCall, ToolCall


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[HistoryToolCall]] = None
    tool_call_id: Optional[str] = None

    def to_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None:
            d["content"] = ""
        for call in d.get("tool_calls", ()):
            args = call["function"].get("arguments")
            if isinstance(args, str):
                try:
                    call["function"]["arguments"] = json.loads(args)
                except ValueError:
                    pass  # not JSON: the template gets the text as sent
        return d


class OmitNone(BaseModel):
    """Fields listed in ``_omit_none`` are left out of the JSON while None or an empty list (OpenAI sends no
    ``usage`` key in ordinary stream chunks and the ``role`` only in a choice's first delta)."""

    _omit_none: tuple[str, ...] = ()

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = handler(self)
        for name in self._omit_none:
            if not data.get(name) and data.get(name) != "":
                data.pop(name, None)
        return data


class ChatResponseMessage(OmitNone):
    _omit_none = ("tool_calls",)
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list[ToolCall] = []


class DeltaMessage(OmitNone):
    """One stream delta: the role only in a choice's first one, the other fields only when they say something."""

    _omit_none = ("role", "reasoning_content", "reasoning", "tool_calls")
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
