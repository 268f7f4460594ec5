"""Chat completions: the conversation through the chat template (with ``tools``, assistant ``tool_calls`` and
``tool`` messages), then the output read by the request's `OutputPlan` (server/chat_output.py) into
``content``, ``reasoning_content`` / ``reasoning`` and ``tool_calls``, whole or as stream deltas. Generation and
streaming are shared with completions (server/serving.py).

As in vLLM: ``tool_choice: "auto"`` (the default when ``tools`` are given) is a 400 unless the server runs with
``--enable-auto-tool-choice --tool-call-parser``; "required" and named choices are forced with a JSON schema
through structured outputs (server/tools/schema.py); the reasoning tokens count in ``usage`` like all others.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    RequestError,
    random_uuid,
)
from api.tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from engine.structured_params import StructuredOutputsParams
from server import reasoning, tools
from server.chat_output import ChoiceReader, OutputPlan, make_plan
from server.request_ids import engine_ids, response_id
from server.serving import Gen, Serving, log_ignored
from server.state import ServerState
from server.tools.base import ToolCallDelta
from server.tools.schema import check_parameters, tool_choice_schema
from util.jsondepth import MAX_JSON_DEPTH, text_depth, value_depth

AUTO_TOOLS_MESSAGE = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_RESERVED_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
                    "return_tensors", "chat_template", "tools", "documents")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{random_uuid()}"


# ------------------------------------------------------------------------------------------------ prompt
def render_prompt(state: ServerState, req: Any, add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """The chat template's prompt for the conversation (and its token ids): the server's ``--chat-template`` or the
    tokenizer's; the tools are passed to it whatever ``tool_choice`` says, as vLLM does by default. ``req`` is a
    chat request or the chat form of /tokenize."""
    tok = state.engine.tokenizer
    if tok is None or not (state.chat_template or getattr(tok, "chat_template", None)):
        raise RequestError("This model's tokenizer has no chat template; use /v1/completions or start the "
                           "server with --chat-template.", "messages")
    check_template_inputs(req)
    messages = [m.to_template_dict() for m in req.messages]
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
    if getattr(req, "tools", None):
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       chat_template=state.chat_template, **kwargs)
    except Exception as err:
        raise RequestError(f"Could not apply the chat template: {err}", "messages") from None
    if not isinstance(text, str):
        raise RequestError("The chat template did not produce a prompt string.", "messages")
    try:
        ids = list(tok(text, add_special_tokens=add_special_tokens).input_ids)
    except Exception as err:
        raise RequestError(f"Could not tokenize the chat prompt: {err}", "messages") from None
    if not ids:
        raise RequestError("The chat prompt is empty.", "messages")
    return text, ids


def _check_depth(value: Any, param: str, text: bool = False) -> None:
    depth = text_depth(value, MAX_JSON_DEPTH) if text else value_depth(value, MAX_JSON_DEPTH)
    if depth > MAX_JSON_DEPTH:
        raise RequestError(f"{param} is nested deeper than {MAX_JSON_DEPTH} levels", param)


def check_template_inputs(req: Any) -> None:
    """What reaches the chat template is bounded in depth, so neither decoding a call's arguments nor jinja
    recurses without end (a 400 naming the field, not a RecursionError): the JSON text of the history's call
    arguments (the body's own depth bound cannot see into strings), the messages' extra fields, the tools and
    ``chat_template_kwargs``."""
    for i, m in enumerate(req.messages):
        for j, call in enumerate(m.tool_calls or ()):
            args = call.function.arguments
            _check_depth(args, f"messages[{i}].tool_calls[{j}].function.arguments", text=isinstance(args, str))
        for key, value in (m.model_extra or {}).items():
            _check_depth(value, f"messages[{i}].{key}")
    for key, value in (req.chat_template_kwargs or {}).items():
        _check_depth(value, f"chat_template_kwargs.{key}")
    for i, tool in enumerate(getattr(req, "tools", None) or ()):
        _check_depth(tool.function.parameters, f"tools[{i}].function.parameters")
        _check_depth(tool.model_dump(exclude={"function": {"parameters"}}), f"tools[{i}]")


def special_marker(tok: Any, marker: str) -> bool:
    """Whether ``marker`` is one special token of ``tok``. Looked up among the added tokens, never through
    `convert_tokens_to_ids`: that maps a string missing from the vocabulary to the unknown token, which may itself
    be special (SmolLM2's ``<|endoftext|>``), and the markers are then plain text in the output."""
    for token in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if token.content == marker:
            return bool(token.special)
    return False


def markers_are_special(tok: Any, markers: tuple[str, ...]) -> bool:
    """Whether any of a tool parser's markers is a special token of ``tok`` (some Hermes vocabularies)."""
    return any(special_marker(tok, m) for m in markers)


# -------------------------------------------------------------------------------------------- the plan
def output_plan(state: ServerState, body: ChatCompletionRequest, prompt_text: str) -> OutputPlan:
    cfg = state.config
    choice = body.effective_tool_choice()
    if choice == "auto" and not (cfg.enable_auto_tool_choice and cfg.tool_call_parser):
        raise RequestError(AUTO_TOOLS_MESSAGE, "tool_choice")
    return make_plan(
        reasoning_cls=reasoning.get(cfg.reasoning_parser) if cfg.reasoning_parser else None,
        prompt_text=prompt_text, chat_template_kwargs=body.chat_template_kwargs, tool_choice=choice,
        auto_parser=tools.get(cfg.tool_call_parser) if cfg.tool_call_parser else None,
        parallel_tool_calls=body.parallel_tool_calls is not False, include_reasoning=body.include_reasoning)


def with_forced_tools(params: Any, body: ChatCompletionRequest) -> Any:
    """``params`` constrained to the tool_choice's JSON schema (required / named), or unchanged. The engine's
    `SamplingParams.structured_outputs` takes it as ``{"json": schema}`` (or its `StructuredOutputsParams`)."""
    choice = body.effective_tool_choice()
    try:
        schema = tool_choice_schema(body.tools, choice, body.parallel_tool_calls is not False)
    except ValueError as err:
        raise RequestError(str(err), "tools") from None
    if schema is None:
        return params
    # Each forced tool's parameters are checked as a schema here, so errors name the tool; what the grammar
    # compiler still rejects names the tool too (or all of them, for "required" over several).
    forced = [i for i, t in enumerate(body.tools) if choice == "required" or t.function.name == choice.function.name]
    for i in forced:
        param = f"tools[{i}].function.parameters"
        try:
            check_parameters(body.tools[i].function.parameters or {})
        except ValueError as err:
            raise RequestError(f"{param}: {err}", param) from None
    param = f"tools[{forced[0]}].function.parameters" if len(forced) == 1 else "tools"
    if getattr(params, "structured_outputs", None) is not None:
        raise RequestError("You can only either use constraints for structured outputs or tools, not both.",
                           "tool_choice")
    value = StructuredOutputsParams(json=schema, param=param)
    try:
        return dataclasses.replace(params, structured_outputs=value)
    except ValueError as err:
        raise RequestError(str(err), getattr(err, "param", None) or "tool_choice") from None


def constrain_after_reasoning(params: Any, plan: OutputPlan, tok: Any) -> Any:
    """A constrained request of a reasoning model thinks freely and is held to its constraint from the end of its
    think block on (vLLM's rule): the engine gets the end marker's token ids. Not where the prompt already closed
    the block or thinking is off (the parser's explicit mode): there the constraint holds from the first token."""
    so = getattr(params, "structured_outputs", None)
    if so is None or plan.reasoning is None or tok is None:
        return params
    parser = plan.reasoning()
    if parser.explicit_mode:
        return params
    so = StructuredOutputsParams.coerce(so)
    after = tuple(tok.encode(parser.end, add_special_tokens=False))
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(so, after=after))


# ------------------------------------------------------------------------------------------- responses
class ChatServing(Serving):
    def __init__(self, *args: Any, plan: OutputPlan, prompt_text: str | None = None):
        super().__init__(*args)
        self.plan = plan
        self.prompt_text = prompt_text  # sent back when return_prompt_text
        self._readers: dict[int, ChoiceReader] = {}
        self._started: set[int] = set()
        self._top_n = self.body.top_logprobs or 0

    def _logprobs(self, token_ids, logprobs):
        if self.plan.hide_reasoning and self.plan.reasoning is not None:
            return None  # the reasoning's tokens would show in them
        return self.state.chat_logprobs(token_ids, logprobs, self._top_n)

    def response(self, items, usage) -> ChatCompletionResponse:
        choices = []
        for idx, _, c in items:
            reader = self.plan.reader()
            out = reader.full("".join(c.text))
            calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=t.name, arguments=t.arguments))
                     for t in out.calls]
            content = "" if self.plan.forced and out.content is None else out.content  # vLLM: "", not null
            message = ChatResponseMessage(content=content, reasoning_content=out.reasoning, reasoning=out.reasoning,
                                          tool_calls=calls)
            choices.append(ChatCompletionResponseChoice(
                index=idx, message=message, logprobs=self._logprobs(c.token_ids, c.logprobs),
                finish_reason=self.plan.finish_reason(reader.made_calls, c.finish_reason),
                stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.rid, model=self.model, choices=choices, usage=usage,
                                      prompt_logprobs=self.prompt_logprobs.get(0),
                                      prompt_text=self.prompt_text)

    def chunk(self, g, o, usage) -> ChatCompletionStreamResponse | None:
        if g is None:
            return ChatCompletionStreamResponse(id=self.rid, created=self.created, model=self.model, choices=[],
                                                usage=usage)
        logprobs = self._logprobs(o.token_ids, o.logprobs)
        if self.plan.active:
            reader = self._readers.get(o.index)
            if reader is None:
                reader = self._readers[o.index] = self.plan.reader()
            d = reader.feed(o.text, final=o.finish_reason is not None)
            if not d and o.finish_reason is None and logprobs is None:
                return None  # nothing decided yet (a held-back marker)
            delta = DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None,
                                 reasoning=d.reasoning or None,
                                 tool_calls=[self._delta_call(t) for t in d.calls] or None)
            finish = self.plan.finish_reason(reader.made_calls, o.finish_reason)
        else:
            delta, finish = DeltaMessage(content=o.text), o.finish_reason
        first = o.index not in self._started
        if first:  # the role travels with the first delta (no fake early TTFT)
            self._started.add(o.index)
            delta.role = "assistant"
        choice = ChatCompletionResponseStreamChoice(index=o.index, delta=delta, logprobs=logprobs,
                                                    finish_reason=finish, stop_reason=o.stop_reason)
        return ChatCompletionStreamResponse(id=self.rid, created=self.created, model=self.model, choices=[choice],
                                            usage=usage, prompt_text=self.prompt_text if first else None)

    @staticmethod
    def _delta_call(t: ToolCallDelta) -> DeltaToolCall:
        """A call's first delta carries its id, type and name; later ones only argument text (as in vLLM)."""
        if t.name is not None:
            return DeltaToolCall(index=t.index, id=tool_call_id(), type="function",
                                 function=DeltaFunctionCall(name=t.name, arguments=t.arguments or None))
        return DeltaToolCall(index=t.index, function=DeltaFunctionCall(arguments=t.arguments))


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    log_ignored(body)
    model = state.resolve_model(body.model)
    state.check_health()
    params = state.sampling_params(body)
    prompt_text, prompt_ids = render_prompt(state, body)
    plan = output_plan(state, body, prompt_text)
    params = with_forced_tools(params, body)
    params = constrain_after_reasoning(params, plan, state.engine.tokenizer)
    if plan.tools is not None and markers_are_special(state.engine.tokenizer, getattr(plan.tools, "markers", ())):
        params.skip_special_tokens = False  # else the markers would be dropped from the text (as vLLM's hermes)
    rid = response_id("chatcmpl", raw.scope, body.request_id)
    req = await state.new_request(prompt_ids, params, engine_ids(rid, 1)[0])
    admission = state.admit()
    gens = [Gen(state, 0, req, admission)]
    return await ChatServing(state, body, model, rid, gens, admission, plan=plan,
                             prompt_text=prompt_text if body.return_prompt_text else None).respond(raw)
