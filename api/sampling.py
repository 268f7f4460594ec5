"""From a validated request to the engine's `SamplingParams`: vLLM's defaults and bounds, the server's defaults
(the model's generation config), every problem a `RequestError` (HTTP 400) naming the offending parameter."""
from __future__ import annotations

from typing import Any, Union

from api.errors import RequestError
from api.protocol import MAX_LOGPROBS, MIN_TEMPERATURE, ChatCompletionRequest, CompletionRequest, _SamplingFields
from api.structured import structured_outputs_params
from engine.sampling_params import SamplingParams


def _check_request(req: _SamplingFields) -> None:
    """Rules between fields, and the fields kvllm does not take (a 400 naming them)."""
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise RequestError("suffix is not supported by kvllm", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of is not supported by kvllm (it must equal n)", "best_of")
        if req.echo and req.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported by kvllm (use prompt_logprobs)", "echo")
    if isinstance(req, ChatCompletionRequest):
        req.effective_tool_choice()
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.add_generation_prompt and req.continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot both be true",
                               "continue_final_message")


def to_sampling_params(req: Union[CompletionRequest, ChatCompletionRequest], *, vocab_size: int | None = None,
                       defaults: dict[str, Any] | None = None, max_logprobs: int = MAX_LOGPROBS):
    """Map a validated request to the engine's SamplingParams; raises RequestError (400) naming the field.

    ``defaults`` are the server's sampling defaults (the model's generation config,
    engine/generation_config.py): a request's own value wins, then the default, then the built-in value; its
    ``max_tokens`` caps every request, as in vLLM. ``max_logprobs`` bounds ``logprobs`` / ``top_logprobs`` /
    ``prompt_logprobs`` (-1: no bound of the server's)."""
    defaults = defaults or {}
    _check_request(req)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_param = "top_logprobs"
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
        logprobs_param = "logprobs"
    for name, value in ((logprobs_param, logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if value is not None and max_logprobs != -1 and value > max_logprobs:
            raise RequestError(f"{name}: at most {max_logprobs} top logprobs per token can be requested from this "
                               f"server (--max-logprobs), got {value}", name)
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
            min_p=float(pick("min_p", 0.0)),
            presence_penalty=float(pick("presence_penalty", 0.0)),
            frequency_penalty=float(pick("frequency_penalty", 0.0)),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            logit_bias=req.logit_bias,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids) if req.stop_token_ids else None,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            kv_compression=req.kv_compression,
            structured_outputs=structured_outputs_params(req),
        )
    except ValueError as err:  # engine.errors.InvalidRequestError names the parameter
        raise RequestError(str(err), getattr(err, "param", None)) from None
