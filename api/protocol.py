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

`to_sampling_params` maps a validated request to the engine's `SamplingParams`; every problem it finds is
raised as `RequestError` (HTTP 400 in the OpenAI error shape) naming the offending parameter (the engine's
`InvalidRequestError` carries it).
"""
from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from api.messages import ChatMessage, ChatResponseMessage, DeltaMessage, OmitNone, TextContentPart  # noqa: F401
from api.tools import ChatCompletionTool, NamedToolChoice, ToolChoiceField, ToolError, resolve_tool_choice

from api.structured import StructuredFields, structured_outputs_params

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


class RequestError(Exception):
    """An invalid request: rendered as an OpenAI error object with this status (400 unless told)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type
        self.headers = headers


def random_uuid() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------------------------- base classes
def _is_valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: valid JSON ("\ud800"), but no text
        return False
    return True


def printable(text: str) -> str:
    """`text` with lone surrogates escaped, so that it can go into a response body or a log line."""
    return text if _is_valid_text(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid_text_path(value: Any, path: tuple = ()) -> tuple | None:
    """The path to the first string (or object key) in a decoded JSON value that is not valid Unicode text."""
    if isinstance(value, str):
        return None if _is_valid_text(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _is_valid_text(key):
                return path + (key,)
            found = invalid_text_path(item, path + (key,))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = invalid_text_path(item, path + (i,))
            if found is not None:
                return found
    return None


class OpenAIBaseModel(BaseModel):
    """Request base: unknown fields are kept (and ignored), as in vLLM's OpenAIBaseModel. Every string in the body,
    object keys included, must be valid Unicode text (a lone surrogate is a 400 naming where it is)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
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
    presence_penalty: Optional[float] = Field(0.0, ge=-2, le=2, allow_inf_nan=False,
                                              description="Only 0 is supported.")
    frequency_penalty: Optional[float] = Field(0.0, ge=-2, le=2, allow_inf_nan=False,
                                               description="Only 0 is supported.")
    logit_bias: Optional[dict[str, float]] = Field(None, description="Not supported (must be empty).")
    user: Optional[str] = None
    # vLLM sampling extras
    top_k: Optional[int] = Field(None, ge=-1, description="0 or -1 disables top-k.")
    min_p: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False, description="Only 0 is supported.")
    repetition_penalty: Optional[float] = Field(None, gt=0, allow_inf_nan=False,
                                                description="Only 1 is supported.")
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: Optional[NonEmptyStr] = Field(
        None, description="The response id's base when no X-Request-Id header is sent (vLLM's field).")
    # kvllm extension
    kv_compression: KVCompressionField = Field(
        None, description="Per-request KV compression: 'none', a method name, or an object of settings "
                          "({'method': 'kara', 'ratio': 0.3, ...}); omitted fields keep the server's values.")

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


# --------------------------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


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
    _omit_none = ("prompt_text",)
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_text: Optional[str] = None  # the templated prompt, with return_prompt_text (vLLM)


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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
                413: "RequestEntityTooLargeError", 415: "UnsupportedMediaTypeError",
                422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(status_code: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    """The OpenAI error object as a plain dict (code is the HTTP status, as in current vLLM)."""
    if err_type is None:
        err_type = _ERROR_TYPES.get(status_code, "InternalServerError" if status_code >= 500 else "BadRequestError")
    # a message may quote what the client sent: it must still encode as UTF-8
    return ErrorResponse(error=ErrorInfo(message=printable(message), type=err_type,
                                         param=printable(param) if param is not None else None,
                                         code=status_code)).model_dump()


# ------------------------------------------------------------------------------------ → SamplingParams
def _check_unsupported(req: _SamplingFields) -> None:
    if req.presence_penalty:
        raise RequestError("presence_penalty is not supported by kvllm (only 0)", "presence_penalty")
    if req.frequency_penalty:
        raise RequestError("frequency_penalty is not supported by kvllm (only 0)", "frequency_penalty")
    if req.repetition_penalty is not None and req.repetition_penalty != 1.0 and not sampler_supports(
            "repetition_penalty"):
        raise RequestError("repetition_penalty is not supported by kvllm (only 1)", "repetition_penalty")
    if req.min_p and not sampler_supports("min_p"):
        raise RequestError("min_p is not supported by kvllm (only 0)", "min_p")
    if req.logit_bias:
        raise RequestError("logit_bias is not supported by kvllm", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise RequestError("suffix is not supported by kvllm", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of is not supported by kvllm (it must equal n)", "best_of")
        if req.echo and req.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported by kvllm (no prompt logprobs)",
                               "echo")
    if isinstance(req, ChatCompletionRequest):
        req.effective_tool_choice()
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.add_generation_prompt and req.continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot both be true",
                               "continue_final_message")


def sampler_supports(field: str) -> bool:
    """Whether the engine's SamplingParams has `field` (min_p and repetition_penalty are passed on once it does)."""
    from engine.sampling_params import SamplingParams

    return field in {f.name for f in dataclasses.fields(SamplingParams)}


#: Sampling fields whose default can come from the model's generation config (engine/generation_config.py) but
#: that the sampler may not support yet: passed to SamplingParams only when it has them.
OPTIONAL_SAMPLING_FIELDS = ("min_p", "repetition_penalty")


def to_sampling_params(req: Union[CompletionRequest, ChatCompletionRequest], *, vocab_size: int | None = None,
                       defaults: dict[str, Any] | None = None, max_logprobs: int = MAX_LOGPROBS):
    """Map a validated request to the engine's SamplingParams; raises RequestError (400) naming the field.

    ``defaults`` are the server's sampling defaults (the model's generation config,
    engine/generation_config.py): a request's own value wins, then the default, then the built-in value; its
    ``max_tokens`` caps every request, as in vLLM. ``max_logprobs`` bounds ``logprobs`` / ``top_logprobs`` (-1: no
    bound of the server's)."""
    from engine.sampling_params import SamplingParams

    defaults = defaults or {}
    _check_unsupported(req)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_param = "top_logprobs"
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
        logprobs_param = "logprobs"
    if logprobs is not None and max_logprobs != -1 and logprobs > max_logprobs:
        raise RequestError(f"{logprobs_param}: at most {max_logprobs} top logprobs per token can be requested from "
                           f"this server (--max-logprobs), got {logprobs}", logprobs_param)
    caps = [m for m in (max_tokens, defaults.get("max_tokens")) if m is not None]
    max_tokens = min(caps) if caps else None

    def pick(name: str, builtin: Any) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, builtin)

    temperature = float(pick("temperature", 1.0))
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_k = int(pick("top_k", 0))
    if vocab_size is not None and top_k >= vocab_size:
        top_k = 0  # keeping the whole vocabulary is no top-k at all
    # min_p / repetition_penalty: passed on once the sampler has them (until then a request setting them is rejected
    # above, and a generation-config default is reported at startup by the server)
    optional = {name: pick(name, None) for name in OPTIONAL_SAMPLING_FIELDS if sampler_supports(name)}
    stop = req.stop
    if isinstance(stop, list) and not stop:
        stop = None
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    try:
        return SamplingParams(
            n=req.n,
            temperature=temperature,
            top_p=float(pick("top_p", 1.0)),
            top_k=top_k,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids) if req.stop_token_ids else None,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            kv_compression=req.kv_compression,
            **{k: v for k, v in optional.items() if v is not None},
            structured_outputs=structured_outputs_params(req),
        )
    except ValueError as err:  # engine.errors.InvalidRequestError names the parameter
        raise RequestError(str(err), getattr(err, "param", None)) from None


def clamp_logprob(value: float) -> float:
    """-inf is not valid JSON: clamp it like vLLM (-9999.0)."""
    if value is None or math.isnan(value):
        return -9999.0
    return max(float(value), -9999.0)
