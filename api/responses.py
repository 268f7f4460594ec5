"""Response shapes of the OpenAI protocol as kvllm serves them: completions, chat, their stream chunks, usage,
logprobs and the model list (chat messages and deltas: api/messages.py)."""
from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from api.messages import ChatResponseMessage, DeltaMessage, OmitNone


def random_uuid() -> str:
    return uuid.uuid4().hex


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob of a prompt position's entry."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: per prompt position: None (the first) or {token id: its logprob}, the prompt's own token first
PromptLogprobs = Optional[list[Optional[dict[str, PromptLogprob]]]]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: PromptLogprobs = None  # with the request's prompt_logprobs (vLLM)


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionStreamResponse(OmitNone):
    _omit_none = ("usage",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OmitNone):
    _omit_none = ("prompt_text", "prompt_logprobs")
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_text: Optional[str] = None  # the templated prompt, with return_prompt_text (vLLM)
    prompt_logprobs: PromptLogprobs = None  # with the request's prompt_logprobs (vLLM)


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(OmitNone):
    _omit_none = ("usage", "prompt_text")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_text: Optional[str] = None  # in a choice's first chunk, with return_prompt_text


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def clamp_logprob(value: float) -> float:
    """-inf is not valid JSON: clamp it like vLLM (-9999.0)."""
    if value is None or math.isnan(value):
        return -9999.0
    return max(float(value), -9999.0)


__all__ = ["random_uuid", "UsageInfo", "CompletionLogProbs", "CompletionResponseChoice", "CompletionResponse", "CompletionResponseStreamChoice", "CompletionStreamResponse", "ChatTopLogprob", "ChatTokenLogprob", "ChatChoiceLogprobs", "ChatCompletionResponseChoice", "ChatCompletionResponse", "ChatCompletionResponseStreamChoice", "ChatCompletionStreamResponse", "ModelCard", "ModelList", "clamp_logprob"]
