"""What the HTTP handlers share (`ServerState`): the engine, the served names, admission control (503 +
Retry-After), metrics, the chat template and the server's default sampling parameters, token strings for logprobs."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Union

from api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
    CompletionRequest,
    RequestError,
    clamp_logprob,
)
from api.sampling import to_sampling_params
from engine.chat_template import load_chat_template
from server.config import ServerConfig
from server.errors import to_request_error
from server.metrics import ServerMetrics
from server.request_log import log_request
from server.sampling_defaults import model_sampling_defaults

logger = logging.getLogger("kvllm.server")

#: Seconds suggested to clients in the Retry-After header of a 503 (queue full).
RETRY_AFTER_S = 1
GRAMMAR_WAITERS = 32


class Admission:
    """A request counted as waiting until its first token arrives (or it ends)."""

    def __init__(self, state: "ServerState"):
        self.state = state
        self.active = True

    def release(self) -> None:
        if self.active:
            self.active = False
            self.state.pending -= 1


class ServerState:
    """What the handlers share: the engine, the served names, admission control, metrics, token strings."""

    def __init__(self, engine: Any, served_model_names: list[str], max_queued_requests: int | None,
                 config: Any = None):
        self.engine = engine
        self.config = config if config is not None else ServerConfig()
        self.chat_template = load_chat_template(self.config.chat_template)  # None: the tokenizer's
        self.sampling_defaults = model_sampling_defaults(engine, self.config.generation_config)
        self.max_logprobs = self.config.max_logprobs
        self.model_names = served_model_names
        self.max_queued_requests = max_queued_requests
        self.metrics = ServerMetrics(engine, served_model_names[0], self.config.metric_prefixes)
        self.log_requests = self.config.log_requests
        self.max_log_len = self.config.max_log_len
        self.pending = 0  # admitted requests without a first token yet
        self.created = int(time.time())
        self._token_cache: dict[int, str] = {}
        self.vocab_size = engine.model_config.vocab_size
        # threads that only wait for the engine's bounded compile workers; past this many, grammar requests queue
        # here while every other request goes on
        self._grammar_waiters = ThreadPoolExecutor(max_workers=GRAMMAR_WAITERS, thread_name_prefix="kvllm-grammar")

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

    def admit(self) -> Admission:
        limit = self.max_queued_requests
        if limit is not None:
            waiting = max(self.pending, self.engine.stats().num_waiting)
            if waiting >= limit:
                self.metrics.rejections.inc()
                raise RequestError(
                    f"The server is overloaded: {waiting} requests are waiting "
                    f"(max_queued_requests={limit}). Please retry later.", None, 503,
                    headers={"Retry-After": str(RETRY_AFTER_S)})
        self.pending += 1
        return Admission(self)

    async def new_request(self, prompt: Union[str, list[int]], params: Any, request_id: str) -> Any:
        """Encode and validate a prompt once (engine errors become 400s naming the parameter). A request with a
        grammar waits for its compile on a thread of its own, so the event loop (/health, every other request)
        never waits for a grammar."""
        try:
            if params.structured_outputs is None:
                req = self.engine.new_request(prompt, params, request_id)
            else:
                loop = asyncio.get_running_loop()
                req = await loop.run_in_executor(self._grammar_waiters, self.engine.new_request, prompt, params,
                                                 request_id)
        except ValueError as err:
            raise to_request_error(err) or RequestError(str(err)) from None
        if self.log_requests:
            log_request(logger, req, self.max_log_len)
        return req

    def sampling_params(self, req: Union[CompletionRequest, ChatCompletionRequest]) -> Any:
        return to_sampling_params(req, vocab_size=self.vocab_size, defaults=self.sampling_defaults,
                                  max_logprobs=self.max_logprobs)

    # -- logprobs -------------------------------------------------------------------------------------
    def token_str(self, token_id: int) -> str:
        s = self._token_cache.get(token_id)
        if s is None:
            tok = self.engine.tokenizer
            s = tok.decode([token_id]) if tok is not None else str(token_id)
            if len(self._token_cache) < 200_000:
                self._token_cache[token_id] = s
        return s

    def prompt_logprobs(self, entries: list) -> list:
        """vLLM's prompt_logprobs: per position None (the first) or {token id: {logprob, rank, decoded_token}}, the
        prompt's own token first (its rank in the vocabulary), then the most probable ones (ranks 1, 2, ...)."""
        out: list = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            logps, rank = e
            own = next(iter(logps))
            by_rank = {t: r for r, t in enumerate(sorted(logps, key=lambda t: -logps[t]), 1)}
            out.append({str(t): {"logprob": clamp_logprob(v), "rank": rank if t == own else by_rank[t],
                                 "decoded_token": self.token_str(t)} for t, v in logps.items()})
        return out

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
