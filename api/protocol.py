"""Pydantic v2 models of the OpenAI HTTP protocol as kvllm serves it, plus kvllm's extensions.

Follows vLLM's OpenAI-compatible server:

* ``/v1/completions`` and ``/v1/chat/completions`` request bodies with the OpenAI fields and vLLM's sampling
  extras (``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
  ``skip_special_tokens``), sent as top-level keys (the openai SDK's ``extra_body``).
* Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``): api/structured.py.
* kvllm's per-request ``kv_compression``: ``"none"``, a method name, or an object with the common fields of
  ``compression.KVCompressionConfig`` and the method's own parameters (``{"method": "kara", "ratio": 0.3,
  "chunk_max": 8}``). The engine validates it against the method registry (compression/registry.py), so a new
  method needs no change here; unknown keys are rejected (a typo must not silently change nothing).
* Unknown top-level fields are accepted and ignored, as in vLLM (``extra="allow"``); the server logs them.
* Response, streaming-chunk, usage, model-list and error shapes (``{"error": {message, type, param, code}}``).
* Chat messages (with reasoning and tool calls) are in api/messages.py, ``tools`` / ``tool_choice`` in api/tools.py.

Response shapes: api/responses.py; errors: api/errors.py; the mapping to the engine's `SamplingParams`:
api/sampling.py.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from api.messages import ChatMessage, ChatResponseMessage, DeltaMessage, OmitNone, TextContentPart  # noqa: F401
from api.tools import ChatCompletionTool, NamedToolChoice, ToolChoiceField, ToolError, resolve_tool_choice

from api.errors import (  # noqa: F401 (the protocol's errors)
    ErrorInfo, ErrorResponse, RequestError, error_body, invalid_text_path, printable)
from api.responses import *  # noqa: F401,F403 (the protocol's response shapes)
from api.structured import StructuredFields
from util.jsondepth import MAX_JSON_DEPTH, deep_path

# int64 range, like vLLM's seed bounds (torch generators take 64-bit seeds).
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
#: Largest `n` (choices per prompt) accepted.
MAX_N = 128
#: Default bound on top logprobs per token (vLLM's default max_logprobs; a server sets its own, --max-logprobs).
MAX_LOGPROBS = 20
#: Temperatures in (0, MIN_TEMPERATURE) are raised to it (vLLM does the same: tiny temperatures overflow).
MIN_TEMPERATURE = 1e-2

TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
#: Nesting bound of a whole body. Fields that reach a recursive parser (templates, tool arguments, schemas) have
#: their own bound of MAX_JSON_DEPTH measured from the field, so this one only stops what no field check sees.
MAX_BODY_DEPTH = 2 * MAX_JSON_DEPTH
#: request_id / X-Request-Id: echoed in a response header and the base of every id, so short and header-safe.
MAX_REQUEST_ID_LEN = 256
_REQUEST_ID_CHARS = re.compile(r"[!-~]+")  # visible ASCII: UUIDs and job ids, nothing a header cannot carry


def request_id_problem(value: str) -> str | None:
    """Why ``value`` cannot be a request id (None when it can)."""
    if len(value) > MAX_REQUEST_ID_LEN:
        return f"must be at most {MAX_REQUEST_ID_LEN} characters, got {len(value)}"
    if not _REQUEST_ID_CHARS.fullmatch(value):
        return "must be visible ASCII characters only (letters, digits, punctuation; no spaces or control characters)"
    return None


class OpenAIBaseModel(BaseModel):
    """Request base: unknown fields are kept (and ignored), as in vLLM's OpenAIBaseModel. Every string in the body,
    object keys included, must be valid Unicode text (a lone surrogate is a 400 naming where it is)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic says the body must be an object
        path = deep_path(data, MAX_BODY_DEPTH)  # first: the text check below recurses
        if path is not None:
            # the field and its index or key: the full path is as deep as the value
            param = "".join(f"[{p}]" if isinstance(p, int) else f".{printable(p)}" for p in path[:2]).lstrip(".")
            raise PydanticCustomError("too_deep", "{param}: nested deeper than {limit} levels",
                                      {"param": param, "limit": MAX_BODY_DEPTH})
        path = invalid_text_path(data)
        if path is not None:
            param = ".".join(printable(str(p)) for p in path)
            raise PydanticCustomError("invalid_unicode", "{param}: invalid Unicode text (a lone surrogate)",
                                      {"param": param})
        return data

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------- kv compression
#: "none", a method name, or an object of settings; validated by the engine (compression.config.coerce).
KVCompressionField = Optional[Union[str, dict[str, Any]]]


# ------------------------------------------------------------------------------------------- request parts
class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _SamplingFields(OpenAIBaseModel, StructuredFields):
    """Fields shared by completions and chat completions (structured outputs: api/structured.py)."""

    model: Optional[str] = Field(None, description="Served model name; defaults to the first one.")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[NonEmptyStr, list[NonEmptyStr]]] = None
    seed: Optional[int] = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    temperature: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="Default 1.0; 0 is greedy.")
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False,
                                              description="Minus this for every token already in the output.")
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False,
                                               description="Minus this times the token's count in the output.")
    logit_bias: Optional[dict[str, float]] = Field(None, description="Token id -> bias added to its logit (±100).")
    user: Optional[str] = None
    # vLLM sampling extras
    top_k: Optional[int] = Field(None, ge=-1, description="0 or -1 disables top-k.")
    min_p: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False,
                                   description="Drop tokens less probable than min_p x the most probable one.")
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2, allow_inf_nan=False,
                                                description="Prompt and output tokens: positive logits / it, "
                                                            "negative x it.")
    prompt_logprobs: Optional[int] = Field(None, ge=0, description="Top logprobs of every prompt token.")
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: Optional[NonEmptyStr] = Field(
        None, description="The response id's base when no X-Request-Id header is sent (vLLM's field); at most "
                          f"{MAX_REQUEST_ID_LEN} visible ASCII characters.")
    # kvllm extension
    kv_compression: KVCompressionField = Field(
        None, description="Per-request KV compression: 'none', a method name, or an object of settings "
                          "({'method': 'kara', 'ratio': 0.3, ...}); omitted fields keep the server's values.")

    @field_validator("request_id")
    @classmethod
    def _check_request_id(cls, value: Optional[str]) -> Optional[str]:
        problem = None if value is None else request_id_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self


# ---------------------------------------------------------------------------------------------- completions
PromptType = Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)],
                   Annotated[list[TokenId], Field(min_length=1)],
                   Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType = Field(..., description="A string, a list of strings, token ids, or lists of token ids.")
    max_tokens: Optional[int] = Field(16, ge=1, description="Default 16; null: up to the context limit.")
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(None, ge=0, description="Top logprobs per token; at most the server's "
                                                              "max_logprobs (default 20).")
    best_of: Optional[int] = Field(None, ge=1, description="Only equal to n is supported.")
    suffix: Optional[str] = Field(None, description="Not supported.")

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt(s) as a list of strings or token-id lists (each one a separate completion)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------- chat
class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="Default: up to the context limit.")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, description="At most the server's max_logprobs (default 20).")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ChatCompletionTool]] = None
    tool_choice: ToolChoiceField = Field(None, description="none|auto|required|{type: function, function: {name}}; "
                                                           "default: auto with tools, else none.")
    parallel_tool_calls: Optional[bool] = Field(True, description="false: at most one tool call.")
    include_reasoning: bool = Field(True, description="false: leave the reasoning out (--reasoning-parser).")
    return_prompt_text: Optional[bool] = Field(None, description="true: the response has the templated prompt.")

    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """tool_choice with its default applied, checked as vLLM checks it (RequestError naming the field)."""
        try:
            return resolve_tool_choice(self.tools, self.tool_choice, "tool_choice" in self.model_fields_set)
        except ToolError as err:
            raise RequestError(str(err), err.param) from None
