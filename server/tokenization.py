"""``/tokenize`` and ``/detokenize`` (vLLM's endpoints): the served model's tokenizer, and for chat bodies its chat
template exactly as ``/v1/chat/completions`` applies it, so ``count`` is the ``prompt_tokens`` a request would use."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from api.protocol import RequestError
from api.tools import ToolError, resolve_tool_choice
from server.chat import render_prompt
from api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from server.state import ServerState


def _tokenizer(state: "ServerState", param: str) -> Any:
    tok = state.engine.tokenizer
    if tok is None:
        raise RequestError("This model has no tokenizer.", param)
    return tok


def tokenize(state: "ServerState", body: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
    state.resolve_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        _tokenizer(state, "messages")
        if body.add_generation_prompt and body.continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot both be true",
                               "continue_final_message")
        try:
            resolve_tool_choice(body.tools, None, False)  # chat's checks of `tools` (there is no tool_choice here)
        except ToolError as err:
            raise RequestError(str(err), err.param) from None
        ids = render_prompt(state, body, add_special_tokens=body.add_special_tokens)[1]
        tok = state.engine.tokenizer
    else:
        tok = _tokenizer(state, "prompt")
        try:
            ids = list(tok(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        except Exception as err:
            raise RequestError(f"Could not tokenize the prompt: {err}", "prompt") from None
    strs = list(tok.convert_ids_to_tokens(ids)) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids, token_strs=strs)


def detokenize(state: "ServerState", body: DetokenizeRequest) -> DetokenizeResponse:
    state.resolve_model(body.model)
    tok = _tokenizer(state, "tokens")
    vocab = state.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise RequestError(f"tokens must be token ids in [0, {vocab}), got {bad[:4]}", "tokens")
    return DetokenizeResponse(prompt=tok.decode(body.tokens))
