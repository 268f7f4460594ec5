"""Completion serving, and what chat serving (server/chat.py) shares with it: turn a validated HTTP request into
engine requests and their outputs into an OpenAI response, either one JSON body or a Server-Sent-Events stream.

Each prompt (each of a completion's prompts) is one engine request, created with `engine.new_request` (encoded and
validated once) before admission, then driven by `engine.stream`. The engine steps in its own thread; handlers only
await per-request queues. A client that disconnects (streaming or not) cancels its handler, which aborts the engine
requests and frees their blocks.

Streaming: one ``data: {json}`` event per delta (the protocol's stream models), ``finish_reason`` on each choice's
last chunk, an optional usage chunk (``stream_options.include_usage``), then ``data: [DONE]``. An error after the
response started is sent as ``data: {"error": {...}}`` followed by ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from api.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from server.errors import error_event, error_response, to_request_error
from server.metrics import RequestTimer
from server.state import Admission, ServerState
from server.request_ids import engine_ids, response_id

logger = logging.getLogger("kvllm.server")

DONE = "data: [DONE]\n\n"

class Gen:
    """One engine request (one prompt of an HTTP request) streamed through `engine.stream`."""

    def __init__(self, state: ServerState, prompt_index: int, request: Any, admission: Admission,
                 prompt_text: str | None = None):
        self.state = state
        self.prompt_index = prompt_index
        self.request = request
        self.admission = admission
        self.prompt_text = prompt_text  # echoed before the completion
        self.timer = RequestTimer(state.metrics)
        self.finished = False
        self._agen = None
        self._first: asyncio.Future | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    async def start(self) -> None:
        """Submit to the engine; a rejection there raises before any output is awaited."""
        self._agen = self.state.engine.stream(self.request)
        self._first = asyncio.ensure_future(self._agen.__anext__())
        await asyncio.sleep(0)  # the engine's generator runs up to its first suspension (request submitted)
        if self._first.done() and not self._first.cancelled() and self._first.exception() is not None:
            exc = self._first.exception()
            self.finished = True
            raise to_request_error(exc) or exc

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
        by_choice = {o.index: len(o.token_ids) for o in out.outputs}
        if self.timer.on_delta(max(by_choice.values(), default=0), by_choice):
            self.admission.release()
        if out.finished:
            self.admission.release()
            self.timer.on_finish(self.num_prompt_tokens, [o.finish_reason for o in out.outputs], out.metrics,
                                 self.request.params)

    async def close(self) -> None:
        """Abort the engine request unless it finished; safe to call more than once."""
        if not self.finished and self._agen is not None:
            self.state.engine.abort(self.request.request_id)
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


async def _iterate(gens: list[Gen]) -> AsyncIterator[tuple[Gen, Any]]:
    """Delta outputs of several engine requests as they arrive."""
    if len(gens) == 1:
        async for out in gens[0].outputs():
            yield gens[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(g: Gen) -> None:
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


def _usage(gens: list[Gen], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(g.num_prompt_tokens for g in gens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


# ------------------------------------------------------------------------------------------- shared driving
class Serving:
    """The parts completions and chat share: start the engine requests, then collect one body or stream chunks.
    Subclasses say how a choice and a chunk look."""

    def __init__(self, state: ServerState, body: Any, model: str, rid: str, gens: list[Gen], admission: Admission):
        self.state, self.body, self.model, self.rid = state, body, model, rid
        self.gens, self.admission = gens, admission
        self.prompt_logprobs: dict[int, list] = {}  # per prompt, with the request's prompt_logprobs
        self.created = int(time.time())

    def choice_index(self, g: Gen, o: Any) -> int:
        return g.prompt_index * self.body.n + o.index

    async def respond(self, raw: Request) -> Response:
        """Submit every generator (on any failure: abort those started, release the admission, re-raise), then
        answer as an SSE stream or as one JSON body; both abort the requests if the client goes away."""
        try:
            for g in self.gens:
                await g.start()
        except BaseException:
            await self.close()
            raise
        if self.body.stream:
            return _SSEResponse(self.stream(), self.close)
        return await _until_disconnect(raw, self.full(), self.close)

    async def close(self) -> None:
        for g in self.gens:
            await g.close()
        self.admission.release()

    async def full(self) -> Response:
        choices: dict[int, tuple[Gen, _Choice]] = {}
        try:
            async with contextlib.aclosing(_iterate(self.gens)) as it:
                async for g, out in it:
                    if out.prompt_logprobs is not None:
                        self.prompt_logprobs[g.prompt_index] = self.state.prompt_logprobs(out.prompt_logprobs)
                    for o in out.outputs:
                        choices.setdefault(self.choice_index(g, o), (g, _Choice()))[1].add(o)
        except Exception as err:
            mapped = to_request_error(err)
            if mapped is not None:
                return error_response(mapped.status_code, mapped.message, mapped.param, mapped.err_type)
            logger.exception("generation failed")
            return error_response(500, f"Internal server error: {type(err).__name__}: {err}")
        finally:
            await self.close()
        items = [(idx, *choices[idx]) for idx in sorted(choices)]
        usage = _usage(self.gens, sum(len(c.token_ids) for _, _, c in items))
        return JSONResponse(self.response(items, usage).model_dump(mode="json"))

    async def stream(self) -> AsyncIterator[str]:
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        completion_tokens = 0
        try:
            async with contextlib.aclosing(_iterate(self.gens)) as it:
                async for g, out in it:
                    for o in out.outputs:
                        if not (o.text or o.token_ids or o.finish_reason):
                            continue
                        completion_tokens += len(o.token_ids)
                        usage = _usage(self.gens, completion_tokens) if continuous else None
                        chunk = self.chunk(g, o, usage)
                        if chunk is not None:
                            yield _sse(chunk)
            if include_usage:
                yield _sse(self.chunk(None, None, _usage(self.gens, completion_tokens)))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            logger.warning("error during a stream: %r", err)
            yield error_event(err)
        finally:
            await self.close()
        yield DONE

    def response(self, items: list[tuple[int, Gen, _Choice]], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def chunk(self, g: Gen | None, o: Any, usage: UsageInfo | None) -> BaseModel | None:
        """The stream chunk of one delta (None: nothing to send yet); with g None, the final usage-only chunk."""
        raise NotImplementedError


class CompletionServing(Serving):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self._offsets: dict[int, int] = {}  # text offset of each choice's logprobs
        self._echoed: set[int] = set()

    def response(self, items, usage) -> CompletionResponse:
        choices = []
        for idx, g, c in items:
            prefix = g.prompt_text or ""
            lp, _ = self.state.completion_logprobs(c.token_ids, c.logprobs, len(prefix))
            choices.append(CompletionResponseChoice(index=idx, text=prefix + "".join(c.text), logprobs=lp,
                                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                    prompt_logprobs=self.prompt_logprobs.get(g.prompt_index)))
        return CompletionResponse(id=self.rid, model=self.model, choices=choices, usage=usage)

    def chunk(self, g, o, usage) -> CompletionStreamResponse:
        if g is None:
            return CompletionStreamResponse(id=self.rid, created=self.created, model=self.model, choices=[],
                                            usage=usage)
        idx = self.choice_index(g, o)
        text = o.text
        if g.prompt_text is not None and idx not in self._echoed:
            self._echoed.add(idx)
            text = g.prompt_text + text
            self._offsets[idx] = len(g.prompt_text)
        lp, self._offsets[idx] = self.state.completion_logprobs(o.token_ids, o.logprobs, self._offsets.get(idx, 0))
        choice = CompletionResponseStreamChoice(index=idx, text=text, logprobs=lp, finish_reason=o.finish_reason,
                                                stop_reason=o.stop_reason)
        return CompletionStreamResponse(id=self.rid, created=self.created, model=self.model, choices=[choice],
                                        usage=usage)


# ------------------------------------------------------------------------------------------- entry points
def log_ignored(body: Any) -> None:
    ignored = body.ignored_fields()
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", ignored)


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    log_ignored(body)
    model = state.resolve_model(body.model)
    state.check_health()
    params = state.sampling_params(body)
    rid = response_id("cmpl", raw.scope, body.request_id)
    prompts = body.prompts()
    reqs = [await state.new_request(p, params, eid) for p, eid in zip(prompts, engine_ids(rid, len(prompts)))]
    tok = state.engine.tokenizer
    echoed = [(p if isinstance(p, str) else tok.decode(r.prompt_token_ids) if tok is not None else "")
              if body.echo else None for p, r in zip(body.prompts(), reqs)]
    admission = state.admit()
    gens = [Gen(state, i, r, admission, text) for i, (r, text) in enumerate(zip(reqs, echoed))]
    return await CompletionServing(state, body, model, rid, gens, admission).respond(raw)


# ------------------------------------------------------------------------------------------- transport
class _SSEResponse(StreamingResponse):
    """A text/event-stream response whose cleanup runs even if the body iterator never started (a client
    that disconnects before the first chunk must still abort its engine requests)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


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
