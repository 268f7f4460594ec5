"""From a validated request to the engine's `SamplingParams`: vLLM's defaults and bounds, the server's defaults
(the model's generation config), every problem a `RequestError` (HTTP 400) naming the offending parameter."""
from __future__ import annotations

import dataclasses
from typing import Any, Union

from api.errors import RequestError
from api.protocol import MAX_LOGPROBS, MIN_TEMPERATURE, ChatCompletionRequest, CompletionRequest, _SamplingFields
from api.structured import structured_outputs_params


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
