"""OpenAI-compatible protocol models (pydantic v2) and the request → SamplingParams mapping."""
from api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestError,
    StreamOptions,
    UsageInfo,
)
from api.sampling import to_sampling_params

__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "RequestError",
    "StreamOptions",
    "UsageInfo",
    "to_sampling_params",
]
