"""The OpenAI-compatible FastAPI app: `build_app(engine, served_model_name=None, max_queued_requests=None)`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
(200 with an empty body, 503 once the engine loop died), ``GET /metrics`` (Prometheus text), ``GET /version``.

Request flow: validate (pydantic; every validation problem is a 400 in the OpenAI error shape, FastAPI's 422
never leaks) → model name (404) → engine health (503) → SamplingParams and prompt checks (400) → admission
(503 + ``Retry-After`` when more than ``max_queued_requests`` requests are waiting) → ``engine.stream`` per
prompt. The engine steps in its own thread; handlers only await per-request queues. A client that
disconnects (streaming or not) cancels its handler, which aborts the engine request and frees its blocks.

Streaming is Server-Sent Events: one ``data: {json}`` event per delta, ``finish_reason`` on each choice's last
chunk, an optional usage chunk (``stream_options.include_usage``), then ``data: [DONE]``. An error after the
response started is sent as ``data: {"error": {...}}`` followed by ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestError,
    UsageInfo,
    clamp_logprob,
    error_body,
    random_uuid,
    to_sampling_params,
)
from server.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics

logger = logging.getLogger("kvllm.server")

try:
    from importlib.metadata import version as _pkg_version

    __version__ = _pkg_version("kvllm")
except Exception:  # running from a source tree that is not installed
    __version__ = "0.1.0"

#: Seconds suggested to clients in the Retry-After header of a 503 (queue full).
RETRY_AFTER_S = 1

_ERROR_RESPONSES: dict[Union[int, str], dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    503: {"model": ErrorResponse, "description": "Queue full or engine not running"},
}


def error_response(status_code: int, message: str, param: str | None = None, err_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, err_type), status_code=status_code,
                        headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}


def _clean_loc(loc) -> list[str]:
    """Field path of a pydantic error without "body" and union-member tags ("str", "list[int]", "Model")."""
    out = []
    for x in loc:
        x = str(x)
        if x == "body" and not out:
            continue
        if x in _TYPE_TAGS or "[" in x or "-" in x or (x[:1].isupper() and x.isidentifier()):
            continue
        out.append(x)
    return out


def _format_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request", None
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"Invalid JSON in the request body{': ' + str(detail) if detail else ''}", None
    items = []
    for i, err in enumerate(errors):
        loc = _clean_loc(err.get("loc", ()))
        if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
            return "The request body must be a JSON object (Content-Type: application/json).", None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        wrong_type = str(err.get("type", "")).endswith("_type")
        items.append((wrong_type, -len(loc), i, ".".join(loc), msg))
    # For a union, the member that got furthest explains best: constraint errors before type mismatches
    # (which mostly come from the other members), then the deepest location.
    items.sort()
    param = items[0][3] or None
    parts, seen = [], set()
    for _, _, _, where, msg in items:
        text = f"{where}: {msg}" if where else msg
        if text not in seen:
            seen.add(text)
            parts.append(text)
    more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more, param


class _SSEResponse(StreamingResponse):
    """A text/event-stream response whose cleanup runs even if the body iterator never started (a client
    that disconnects before the first chunk must still abort its engine requests)."""

    def __init__(self, content: AsyncIterator[str], on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Admission:
    """A request counted as waiting until its first token arrives (or it ends)."""

    def __init__(self, state: "ServerState"):
        self.state = state
        self.active = True

    def release(self) -> None:
        if self.active:
            self.active = False
            self.state.pending -= 1


class _Gen:
    """One engine request (one prompt of an HTTP request) streamed through `engine.stream`."""

    def __init__(self, state: "ServerState", prompt_index: int, ids: list[int], params: Any, request_id: str,
                 admission: _Admission, prompt_text: str | None = None):
        self.state = state
        self.prompt_index = prompt_index
        self.ids = ids
        self.params = params
        self.request_id = request_id
        self.admission = admission
        self.prompt_text = prompt_text
        self.timer = RequestTimer(state.metrics)
        self.finished = False
        self._agen = None
        self._first: asyncio.Future | None = None

    async def start(self) -> None:
        """Submit to the engine; an engine-side rejection raises RequestError before any output is awaited."""
        self._agen = self.state.engine.stream(self.ids, self.params, self.request_id)
        self._first = asyncio.ensure_future(self._agen.__anext__())
        await asyncio.sleep(0)  # the engine's generator runs up to its first suspension (request submitted)
        if self._first.done() and not self._first.cancelled() and self._first.exception() is not None:
            exc = self._first.exception()
            self.finished = True
            raise _engine_error(exc)

    async def outputs(self) -> AsyncIterator[Any]:
        assert self._agen is not None and self._first is not None
        try:
            out = await self._first
        except StopAsyncIteration:
            self.finished = True
            return
        while True:
            self._observe(out)
            yield out
            if out.finished:
                self.finished = True
                return
            try:
                out = await self._agen.__anext__()
            except StopAsyncIteration:
                self.finished = True
                return

    def _observe(self, out: Any) -> None:
        new = max((len(o.token_ids) for o in out.outputs), default=0)
        if self.timer.on_delta(new):
            self.admission.release()
        if out.finished:
            self.admission.release()
            self.timer.on_finish(len(self.ids), [o.finish_reason for o in out.outputs])

    async def close(self) -> None:
        """Abort the engine request unless it finished; safe to call more than once."""
        if not self.finished and self._agen is not None:
            self.state.engine.abort(self.request_id)
            self.state.metrics.request_finished("abort")
        self.finished = True
        if self._first is not None and not self._first.done():
            self._first.cancel()
            with contextlib.suppress(BaseException):
                await self._first
        if self._agen is not None:
            with contextlib.suppress(BaseException):
                await self._agen.aclose()
            self._agen = None


def _engine_error(exc: BaseException) -> Exception:
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, ValueError):
        msg = str(exc)
        param = msg.split(" ", 1)[0].rstrip(":,.") if msg.startswith("kv_compression") else None
        return RequestError(msg, param)
    if type(exc).__name__ == "EngineDeadError":
        return RequestError(f"The engine is not running: {exc}", None, 503)
    return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))


async def _iterate(gens: list[_Gen]) -> AsyncIterator[tuple[_Gen, Any]]:
    """Delta outputs of several engine requests as they arrive."""
    if len(gens) == 1:
        async for out in gens[0].outputs():
            yield gens[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(g: _Gen) -> None:
        try:
            async for out in g.outputs():
                queue.put_nowait((g, out, None))
            queue.put_nowait((g, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # handed to the consumer
            queue.put_nowait((g, None, err))

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            g, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield g, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


class _Choice:
    """Accumulates one choice of a non-streaming response."""

    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "stop_reason")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None

    def add(self, o: Any) -> None:
        self.text.append(o.text)
        self.token_ids.extend(o.token_ids)
        if o.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(o.logprobs)
        if o.finish_reason is not None:
            self.finish_reason = o.finish_reason
            self.stop_reason = o.stop_reason


class ServerState:
    def __init__(self, engine: Any, served_model_names: list[str], max_queued_requests: int | None):
        self.engine = engine
        self.model_names = served_model_names
        self.max_queued_requests = max_queued_requests
        self.metrics = ServerMetrics(engine, served_model_names[0])
        self.pending = 0  # admitted requests without a first token yet
        self.created = int(time.time())
        self._token_cache: dict[int, str] = {}
        self.vocab_size = _vocab_size(engine)

    # -- checks ---------------------------------------------------------------------------------------
    def resolve_model(self, model: str | None) -> str:
        if model is None:
            return self.model_names[0]
        if model in self.model_names:
            return model
        raise RequestError(f"The model `{model}` does not exist.", "model", 404)

    def check_health(self) -> None:
        if not self.engine.is_healthy():
            raise RequestError("The engine is not running (its step loop died); see the server log.", None, 503)

    def admit(self) -> _Admission:
        limit = self.max_queued_requests
        if limit is not None:
            try:
                engine_waiting = self.engine.stats().num_waiting
            except Exception:
                engine_waiting = 0
            waiting = max(self.pending, engine_waiting)
            if waiting >= limit:
                self.metrics.rejections.inc()
                raise RequestError(
                    f"The server is overloaded: {waiting} requests are waiting "
                    f"(max_queued_requests={limit}). Please retry later.", None, 503,
                    headers={"Retry-After": str(RETRY_AFTER_S)})
        self.pending += 1
        return _Admission(self)

    def kv_compression_base(self) -> Any:
        cfg = self.engine.kv_compression_config
        return cfg if cfg.enabled else None

    def sampling_params(self, req: Union[CompletionRequest, ChatCompletionRequest]) -> Any:
        return to_sampling_params(req, vocab_size=self.vocab_size, kv_compression_base=self.kv_compression_base())

    def encode(self, prompt: Union[str, list[int]]) -> list[int]:
        try:
            ids = list(self.engine.encode_prompt(prompt))
        except ValueError as err:
            raise RequestError(str(err), "prompt") from None
        if not ids:
            raise RequestError("The prompt is empty: it must contain at least one token.", "prompt")
        return ids

    def validate(self, ids: list[int], params: Any) -> None:
        try:
            self.engine.validate_request(ids, params)
        except ValueError as err:
            msg = str(err)
            head = msg.split(" ", 1)[0].rstrip(":,")
            param = head if head in ("prompt", "stop_token_ids") else None
            raise RequestError(msg, param) from None

    def token_str(self, token_id: int) -> str:
        s = self._token_cache.get(token_id)
        if s is None:
            tok = self.engine.tokenizer
            s = tok.decode([token_id]) if tok is not None else str(token_id)
            if len(self._token_cache) < 200_000:
                self._token_cache[token_id] = s
        return s

    def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError("This model's tokenizer has no chat template; use /v1/completions.", "messages")
        messages = [m.to_template_dict() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        for reserved in ("conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                         "return_dict", "return_tensors", "chat_template", "tools", "documents"):
            kwargs.pop(reserved, None)
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message, **kwargs)
        except Exception as err:
            raise RequestError(f"Could not apply the chat template: {err}", "messages") from None
        if not isinstance(text, str):
            raise RequestError("The chat template did not produce a prompt string.", "messages")
        try:
            ids = list(tok(text, add_special_tokens=False).input_ids)
        except Exception as err:
            raise RequestError(f"Could not tokenize the chat prompt: {err}", "messages") from None
        if not ids:
            raise RequestError("The chat prompt is empty.", "messages")
        return ids

    # -- logprobs -------------------------------------------------------------------------------------
    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                            offset: int) -> tuple[CompletionLogProbs | None, int]:
        if logprobs is None:
            return None, offset
        out = CompletionLogProbs()
        for tid, entry in zip(token_ids, logprobs):
            s = self.token_str(tid)
            out.tokens.append(s)
            out.token_logprobs.append(clamp_logprob(entry.get(tid, float("-inf"))))
            out.top_logprobs.append({self.token_str(t): clamp_logprob(v) for t, v in
                                     sorted(entry.items(), key=lambda kv: -kv[1])})
            out.text_offset.append(offset)
            offset += len(s)
        return out, offset

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                      top_n: int) -> ChatChoiceLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for tid, entry in zip(token_ids, logprobs):
            s = self.token_str(tid)
            tops = [ChatTopLogprob(token=self.token_str(t), logprob=clamp_logprob(v),
                                   bytes=list(self.token_str(t).encode("utf-8")))
                    for t, v in sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]]
            content.append(ChatTokenLogprob(token=s, logprob=clamp_logprob(entry.get(tid, float("-inf"))),
                                            bytes=list(s.encode("utf-8")), top_logprobs=tops))
        return ChatChoiceLogprobs(content=content)


def _vocab_size(engine: Any) -> int | None:
    cfg = getattr(engine, "model_config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int):
        return v
    tok = getattr(engine, "tokenizer", None)
    try:
        return len(tok) if tok is not None else None
    except Exception:
        return None


# ============================================================================================ the app
def build_app(engine: Any, served_model_name: Optional[Union[str, list[str]]] = None,
              max_queued_requests: Optional[int] = None) -> FastAPI:
    """An OpenAI-compatible app around a started-or-not `engine.Engine` (the engine is not owned: the caller
    shuts it down). ``served_model_name`` (a name or a list; default ``engine.model_name``) is what
    ``/v1/models`` lists and what requests must name; ``max_queued_requests`` bounds the waiting requests
    (beyond it: 503 + Retry-After)."""
    if served_model_name is None:
        names = [engine.model_name]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name) or [engine.model_name]
    if max_queued_requests is not None and max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests!r}")
    state = ServerState(engine, names, max_queued_requests)

    app = FastAPI(title="kvllm", version=__version__,
                  description="OpenAI-compatible LLM server with paged KV cache and in-loop KV compression.")
    app.state.kvllm = state

    def openapi_schema() -> dict[str, Any]:
        """FastAPI's schema without the 422 responses it adds by default (validation errors are 400 here)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi_schema  # type: ignore[method-assign]

    # -- errors in the OpenAI shape ---------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = _format_validation_error(exc)
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return error_response(exc.status_code, exc.message, exc.param, exc.err_type, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")

    # -- plain endpoints ----------------------------------------------------------------------------------
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if engine.is_healthy():
            return Response(status_code=200)
        return error_response(503, "The engine is not running (its step loop died).")

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def _model_cards() -> list[ModelCard]:
        return [ModelCard(id=name, created=state.created, root=engine.model_name,
                          max_model_len=engine.max_model_len) for name in names]

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        return ModelList(data=_model_cards())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def get_model(model_id: str):
        for card in _model_cards():
            if card.id == model_id:
                return card
        raise RequestError(f"The model `{model_id}` does not exist.", "model", 404)

    _stream_doc = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}

    # -- completions ----------------------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERROR_RESPONSES, **_stream_doc})
    async def create_completion(body: CompletionRequest, raw: Request):
        _log_ignored(body)
        model = state.resolve_model(body.model)
        state.check_health()
        params = state.sampling_params(body)
        prompts = body.prompts()
        encoded = []
        for p in prompts:
            ids = state.encode(p)
            state.validate(ids, params)
            encoded.append((p, ids))
        tok = engine.tokenizer
        echoed = [(p if isinstance(p, str) else tok.decode(ids) if tok is not None else "") if body.echo else None
                  for p, ids in encoded]
        admission = state.admit()
        rid = f"cmpl-{random_uuid()}"
        gens = [_Gen(state, i, ids, params, f"{rid}-{i}", admission, text)
                for i, ((_, ids), text) in enumerate(zip(encoded, echoed))]
        return await _start_and_respond(
            raw, gens, admission, body.stream,
            lambda: _completion_stream(state, body, model, rid, gens, admission),
            lambda: _completion_full(state, body, model, rid, gens, admission))

    # -- chat completions -----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERROR_RESPONSES, **_stream_doc})
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        _log_ignored(body)
        model = state.resolve_model(body.model)
        state.check_health()
        params = state.sampling_params(body)
        ids = state.chat_prompt_ids(body)
        state.validate(ids, params)
        admission = state.admit()
        rid = f"chatcmpl-{random_uuid()}"
        gen = _Gen(state, 0, ids, params, rid, admission)
        return await _start_and_respond(
            raw, [gen], admission, body.stream,
            lambda: _chat_stream(state, body, model, rid, gen, admission),
            lambda: _chat_full(state, body, model, rid, gen, admission))

    return app


def _log_ignored(body: Any) -> None:
    ignored = body.ignored_fields()
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", ignored)


async def _start_and_respond(raw: Request, gens: list[_Gen], admission: _Admission, stream: bool,
                             make_stream, make_full) -> Response:
    """Submit every generator (on any failure: abort those started, release the admission, re-raise), then answer
    as an SSE stream or as one JSON body; both paths abort the requests if the client goes away."""
    try:
        for g in gens:
            await g.start()
    except BaseException:
        await _close_all(gens, admission)
        raise

    async def cleanup() -> None:
        await _close_all(gens, admission)

    if stream:
        return _SSEResponse(make_stream(), cleanup)
    return await _until_disconnect(raw, make_full(), cleanup)


async def _close_all(gens: list[_Gen], admission: _Admission) -> None:
    for g in gens:
        await g.close()
    admission.release()


async def _until_disconnect(raw: Request, coro, cleanup) -> Response:
    """Run a non-streaming handler body; if the client disconnects first, cancel it (aborting the request).
    `cleanup` (idempotent) runs on every path, also when the body was cancelled before it started."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        logger.info("client disconnected; request aborted")
        return error_response(400, "Client disconnected.")
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        await cleanup()


def _usage(gens: list[_Gen], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(g.ids) for g in gens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _error_event(err: BaseException) -> str:
    if isinstance(err, RequestError):
        return _sse(error_body(err.status_code, err.message, err.param, err.err_type))
    mapped = _engine_error(err)
    if isinstance(mapped, RequestError):
        return _sse(error_body(mapped.status_code, mapped.message, mapped.param, mapped.err_type))
    return _sse(error_body(500, f"Internal server error: {type(err).__name__}: {err}"))


# ------------------------------------------------------------------------------------- completions bodies
async def _completion_full(state: ServerState, body: CompletionRequest, model: str, rid: str, gens: list[_Gen],
                           admission: _Admission) -> Response:
    n = body.n
    choices: dict[int, _Choice] = {}
    try:
        async with contextlib.aclosing(_iterate(gens)) as it:
            async for g, out in it:
                for o in out.outputs:
                    choices.setdefault(g.prompt_index * n + o.index, _Choice()).add(o)
    except Exception as err:
        mapped = _engine_error(err)
        if isinstance(mapped, RequestError):
            return error_response(mapped.status_code, mapped.message, mapped.param, mapped.err_type)
        logger.exception("generation failed")
        return error_response(500, f"Internal server error: {type(err).__name__}: {err}")
    finally:
        await _close_all(gens, admission)
    result = []
    completion_tokens = 0
    for idx in sorted(choices):
        c = choices[idx]
        g = gens[idx // n]
        prefix = g.prompt_text or ""
        text = prefix + "".join(c.text)
        lp, _ = state.completion_logprobs(c.token_ids, c.logprobs, len(prefix))
        completion_tokens += len(c.token_ids)
        result.append(CompletionResponseChoice(index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                               stop_reason=c.stop_reason))
    resp = CompletionResponse(id=rid, model=model, choices=result, usage=_usage(gens, completion_tokens))
    return JSONResponse(resp.model_dump(mode="json"))


async def _completion_stream(state: ServerState, body: CompletionRequest, model: str, rid: str,
                             gens: list[_Gen], admission: _Admission) -> AsyncIterator[str]:
    n = body.n
    created = int(time.time())
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    completion_tokens = 0
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    try:
        async with contextlib.aclosing(_iterate(gens)) as it:
            async for g, out in it:
                for o in out.outputs:
                    if not (o.text or o.token_ids or o.finish_reason):
                        continue
                    idx = g.prompt_index * n + o.index
                    text = o.text
                    if g.prompt_text is not None and idx not in echoed:
                        echoed.add(idx)
                        text = g.prompt_text + text
                        offsets[idx] = len(g.prompt_text)
                    completion_tokens += len(o.token_ids)
                    lp, offsets[idx] = state.completion_logprobs(o.token_ids, o.logprobs, offsets.get(idx, 0))
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": idx, "text": text,
                                          "logprobs": lp.model_dump() if lp is not None else None,
                                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}]}
                    if continuous:
                        chunk["usage"] = _usage(gens, completion_tokens).model_dump()
                    yield _sse(chunk)
        if include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": _usage(gens, completion_tokens).model_dump()})
    except asyncio.CancelledError:
        raise
    except Exception as err:
        logger.warning("error during a completion stream: %r", err)
        yield _error_event(err)
    finally:
        await _close_all(gens, admission)
    yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------- chat bodies
async def _chat_full(state: ServerState, body: ChatCompletionRequest, model: str, rid: str, gen: _Gen,
                     admission: _Admission) -> Response:
    choices: dict[int, _Choice] = {}
    try:
        async with contextlib.aclosing(_iterate([gen])) as it:
            async for _, out in it:
                for o in out.outputs:
                    choices.setdefault(o.index, _Choice()).add(o)
    except Exception as err:
        mapped = _engine_error(err)
        if isinstance(mapped, RequestError):
            return error_response(mapped.status_code, mapped.message, mapped.param, mapped.err_type)
        logger.exception("generation failed")
        return error_response(500, f"Internal server error: {type(err).__name__}: {err}")
    finally:
        await _close_all([gen], admission)
    top_n = body.top_logprobs or 0
    result = []
    completion_tokens = 0
    for idx in sorted(choices):
        c = choices[idx]
        completion_tokens += len(c.token_ids)
        result.append(ChatCompletionResponseChoice(
            index=idx, message=ChatResponseMessage(role="assistant", content="".join(c.text)),
            logprobs=state.chat_logprobs(c.token_ids, c.logprobs, top_n), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason))
    resp = ChatCompletionResponse(id=rid, model=model, choices=result, usage=_usage([gen], completion_tokens))
    return JSONResponse(resp.model_dump(mode="json"))


async def _chat_stream(state: ServerState, body: ChatCompletionRequest, model: str, rid: str, gen: _Gen,
                       admission: _Admission) -> AsyncIterator[str]:
    created = int(time.time())
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    top_n = body.top_logprobs or 0
    completion_tokens = 0
    started: set[int] = set()
    try:
        async with contextlib.aclosing(_iterate([gen])) as it:
            async for _, out in it:
                for o in out.outputs:
                    if not (o.text or o.token_ids or o.finish_reason):
                        continue
                    delta: dict[str, Any] = {}
                    if o.index not in started:  # the role travels with the first content (no fake early TTFT)
                        started.add(o.index)
                        delta["role"] = "assistant"
                    delta["content"] = o.text
                    completion_tokens += len(o.token_ids)
                    lp = state.chat_logprobs(o.token_ids, o.logprobs, top_n)
                    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [{"index": o.index, "delta": delta,
                                          "logprobs": lp.model_dump() if lp is not None else None,
                                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}]}
                    if continuous:
                        chunk["usage"] = _usage([gen], completion_tokens).model_dump()
                    yield _sse(chunk)
        if include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": _usage([gen], completion_tokens).model_dump()})
    except asyncio.CancelledError:
        raise
    except Exception as err:
        logger.warning("error during a chat stream: %r", err)
        yield _error_event(err)
    finally:
        await _close_all([gen], admission)
    yield "data: [DONE]\n\n"
