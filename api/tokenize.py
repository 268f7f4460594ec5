"""Bodies of vLLM's ``/tokenize`` and ``/detokenize`` (same field names and defaults as vLLM's).

``/tokenize`` takes either the completion form ``{model, prompt, add_special_tokens=true}`` or the chat form
``{model, messages, add_generation_prompt=true, continue_final_message=false, add_special_tokens=false,
chat_template_kwargs, tools}`` (``tools`` checked as chat checks them), told apart by the ``messages`` key; both
take ``return_token_strs``. The answer is ``{count, max_model_len, tokens, token_strs}``. ``/detokenize`` maps
``{model, tokens}`` to ``{prompt}``.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from api.protocol import ChatMessage, OpenAIBaseModel, TokenId
from api.tools import ChatCompletionTool


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (e.g. BOS).")
    return_token_strs: Optional[bool] = Field(False, description="Also return each token's vocabulary string.")


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = Field(False, description="Add special tokens on top of the chat template's.")
    return_token_strs: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ChatCompletionTool]] = Field(None, description="Shown to the chat template, as in chat.")


def _form(body: Any) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


# The tags are class names so that validation errors name the field alone (server/errors.py drops them).
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
                                  Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]], Discriminator(_form)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
