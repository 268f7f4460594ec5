"""The embedding API: `Engine(model=...)`, `generate`, `chat`, `score`, async `stream`, `abort`, and vLLM's
`add_request` / `step` pair for callers that drive the loop themselves.

The engine is the thread front of `EngineCore` (engine/core.py). Either the caller's thread drives it (`generate`
and `step` with no background loop) or a background thread does (`start()`, used by `stream` and the HTTP
server). Other threads talk to the loop through typed inbox messages (engine/request.py), drained at the start of
each step, so the core is only ever touched by the stepping thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import weakref
from dataclasses import replace
from typing import Any, AsyncIterator, Sequence as Seq

import torch

from engine.chat_template import load_chat_template
from engine.config import EngineConfig, cpu_has_fast_bf16, parse_dtype, parse_memory  # noqa: F401 (re-exported)
from engine.core import EngineCore
from engine.errors import EngineDeadError, InvalidRequestError
from engine.hub import is_hub_id
from engine.outputs import EngineStats, RequestOutput  # noqa: F401 (EngineStats re-exported)
from engine.request import AbortRequest, AddRequest, InboxMessage, Request
from engine.sampling_params import SamplingParams

logger = logging.getLogger("kvllm")


class Engine:
    """``Engine(model="smollm2", dtype="auto", device=None, block_size=16, num_kv_blocks=None,
    kv_cache_memory=None, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=None, kv_compression=None,
    attention_backend="auto", watermark=0.01, enable_prefix_caching=True, seed=0, tensor_parallel_size=1,
    tokenizer=None, revision=None, tokenizer_revision=None, download_dir=None, trust_remote_code=False)``; see
    engine/config.py. ``model`` is 'smollm2', a .gguf file, a Hugging Face directory or a Hub id (fetched into the
    HF cache, or `download_dir`, unless HF_HUB_OFFLINE=1; engine/hub.py). With ``tensor_parallel_size=N > 1`` this
    process is rank 0 and N - 1 worker processes are spawned (engine/distributed/driver.py); call `shutdown()` to
    stop them."""

    def __init__(self, model: str = "smollm2", **kwargs: Any):
        self.config = EngineConfig(model=model, **kwargs)
        if self.config.trust_remote_code:
            logger.warning("trust_remote_code: transformers may run the repository's tokenizer and config code; the "
                           "model itself always runs kvllm's own implementation (engine/models/)")
        # a Hub id is the name clients use (as in vLLM); a local path is served under its last component
        self.model_name = model if model == "smollm2" or is_hub_id(model) else model.rstrip("/").split("/")[-1]
        #: the model and tokenizer as local paths (Hub ids resolved once, here, into the HF cache)
        self.model_source = self.config.model_source().resolve()
        src = self.model_source
        self.core = EngineCore(replace(self.config, model=src.model, tokenizer=src.tokenizer, revision=None,
                                       tokenizer_revision=None))
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._shut = False
        self._step_observers: tuple[weakref.ref, ...] = ()  # replaced, never mutated: the loop reads it unlocked
        self._observers_lock = threading.Lock()
        if self.core.driver is not None:  # tensor parallelism: a worker that dies kills the engine at once
            self.core.driver.start_monitor(self._worker_died)
        for line in self.capacity_log_lines():
            logger.info(line)
        for what in self.config.ignored_settings():
            logger.warning("ignored setting %s", what)

    # -- what the engine serves ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def model(self):
        """The loaded `engine.models.llama.DecoderLM` (read-only use: benchmarks, diagnostics)."""
        return self.core.model

    @property
    def dtype(self):
        return self.core.dtype

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def kv_cache_format(self) -> str:
        """The KV pages' format, 'auto' resolved: float32, bfloat16, float16, int8, fp8_e4m3 or fp8_e5m2."""
        return self.core.kv_cache.format.name

    @property
    def kv_compression_config(self):
        """The engine-wide `compression.KVCompressionConfig` (method "none" when off)."""
        return self.core.stage.default

    def capacity_log_lines(self) -> list[str]:
        return self.core.capacity_log_lines()

    # -- requests -----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        return self.core.encode_prompt(prompt)

    def new_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Encode and validate a prompt once (raises `InvalidRequestError` naming the parameter); the result can
        be passed to `stream` or `add_request`."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return self.core.make_request(prompt, params, rid)

    def _submit(self, req: Request) -> None:
        self._check_alive()
        self._inbox.put(AddRequest(req))
        self._wakeup.set()
        if self._dead is not None:  # the loop died while we queued: it may never see this message
            self._fail_inbox()

    def add_request(self, prompt: str | Seq[int] | Request, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (vLLM's LLMEngine.add_request); `step()` runs it. Returns its id."""
        req = prompt if isinstance(prompt, Request) else self.new_request(prompt, params, request_id)
        self._submit(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); its blocks are freed at the start of the next step."""
        self._inbox.put(AbortRequest(request_id))
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, AddRequest):
                self.core.add_request(msg.request)
            else:
                self.core.abort(msg.request_id)

    # -- the step -----------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or not self._inbox.empty()

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the outputs of requests that finished in it."""
        with self._step_lock, torch.inference_mode():
            self._drain_inbox()
            before = self._tokens_done()
            if self.core.driver is None:
                outs = self.core.step()
            else:
                try:
                    outs = self.core.step()
                except BaseException as err:  # the ranks are out of step for good: stop them, report the cause
                    self._dead = self.core.driver.stop_after_error(err)
                    raise self._dead from err
            self._tell_observers(self._tokens_done() - before)
            return outs

    def _tokens_done(self) -> int:
        c = self.core.counters
        return c.prompt_tokens_total + c.generation_tokens_total

    def add_step_observer(self, observer: Any) -> None:
        """`observer.observe_step(num_tokens)` is called on the stepping thread after each step with the prompt +
        generated tokens it processed (the server's iteration histogram). Held weakly: a discarded observer needs
        no unregistering."""
        with self._observers_lock:
            alive = tuple(r for r in self._step_observers if r() is not None)
            self._step_observers = alive + (weakref.ref(observer),)

    def _tell_observers(self, num_tokens: int) -> None:
        if num_tokens <= 0:  # an idle step, or the counters were reset meanwhile
            return
        for ref in self._step_observers:
            obs = ref()
            if obs is None:
                continue
            try:
                obs.observe_step(num_tokens)
            except Exception:  # an observer must not stop the engine
                logger.debug("step observer failed", exc_info=True)

    # -- driving ------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")

    def is_healthy(self) -> bool:
        return self._dead is None

    def _worker_died(self, err: BaseException) -> None:
        """From the tensor-parallel monitor thread: unhealthy now; the loop fails what is pending."""
        self._dead = err
        self._wakeup.set()

    @classmethod
    def on_loop_thread(cls, model: str = "smollm2", **kwargs: Any) -> "Engine":
        """Build the engine on the thread that then runs its step loop, and return it once built (its loop already
        started; a construction error is raised here). Why: GNU OpenMP keeps one worker pool per thread that opens
        parallel regions, so an engine built (model load, weight packing) on one thread and stepped on another
        leaves two pools; with more pool threads than cores libgomp shortens its spin before sleeping, every
        parallel region of a step then wakes its worker through the kernel, and small decode steps ran
        slower (docs/benchmarks.md, "Engine loop thread"). `kvllm serve` builds its engine this way."""
        built: dict[str, Any] = {}
        ready, cancelled = threading.Event(), threading.Event()

        def run() -> None:
            try:
                engine = cls(model, **kwargs)
            except BaseException as err:  # raised in the caller
                built["error"] = err
                ready.set()
                return
            engine._thread = threading.current_thread()
            built["engine"] = engine
            ready.set()
            if cancelled.is_set():  # the caller gave up (e.g. Ctrl-C) while it loaded: stop what it started
                engine._thread = None
                engine.shutdown()
                return
            engine._loop()

        threading.Thread(target=run, name="kvllm-engine", daemon=True).start()
        try:
            ready.wait()
        except BaseException:
            cancelled.set()
            raise
        if "error" in built:
            raise built["error"]
        return built["engine"]

    def start(self) -> None:
        """Run the step loop in a background thread (idempotent)."""
        if self._thread is None:
            self._check_alive()
            self._thread = threading.Thread(target=self._loop, name="kvllm-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stopping:
            if self._dead is not None:  # a tensor-parallel worker died while the loop waited
                self._fail_all(self._dead)
                return
            if not self.has_unfinished_requests():
                self._wakeup.wait(0.05)
                self._wakeup.clear()
                continue
            try:
                self.step()
            except BaseException as err:  # the loop is dead: fail every request, queued ones too
                logger.exception("engine loop died")
                self._dead = err
                self._fail_all(err)
                return

    def _fail_all(self, err: BaseException) -> None:
        for req in list(self.core.requests.values()):
            self.core.fail(req, EngineDeadError(str(err)), owned=False)
        self._fail_inbox()

    def _fail_inbox(self) -> None:
        err = EngineDeadError(f"the engine loop died: {self._dead!r}")
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, AddRequest):
                self.core.fail(msg.request, err, owned=False)

    def shutdown(self) -> None:
        """Stop the loop thread, then the tensor-parallel workers, if any (idempotent)."""
        self._stopping = True
        self._wakeup.set()
        stuck = False
        if self._thread is not None:
            self._thread.join(timeout=10)
            stuck = self._thread.is_alive()
            self._thread = None
        if self.core.driver is not None and not self._shut:
            self._shut = True
            # only the thread that steps may message the workers: take the step lock unless a step is stuck
            if not stuck and self._step_lock.acquire(timeout=10):
                try:
                    self.core.shutdown(graceful=self._dead is None)
                finally:
                    self._step_lock.release()
            else:
                self.core.shutdown(graceful=False, destroy=False)

    def _run(self, reqs: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        for req in reqs:
            self._submit(req)
        bar = None
        if use_tqdm and len(reqs) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="Processed prompts", dynamic_ncols=True)
        if self._thread is not None:
            for req in reqs:
                req.done.wait()
                if bar:
                    bar.update(1)
        else:
            while not all(r.done.is_set() for r in reqs):
                done = self.step()
                if bar:
                    bar.update(sum(1 for r in reqs if r.done.is_set()) - bar.n)
                if not done and not self.has_unfinished_requests():
                    break
        if bar:
            bar.close()
        self._check_alive()
        for req in reqs:
            if req.error is not None:
                raise req.error
        return [req.final for req in reqs]

    # -- public API ---------------------------------------------------------------------------------------
    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts",
                                          "sampling_params")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        reqs = [self.new_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(reqs, use_tqdm)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None) -> str:
        """The prompt text of `messages`, with the generation prompt. ``chat_template`` (a file path or the Jinja
        text, engine/chat_template.py) replaces the tokenizer's own template."""
        template = load_chat_template(chat_template)
        if self.tokenizer is None or not (template or getattr(self.tokenizer, "chat_template", None)):
            raise InvalidRequestError("messages: this model's tokenizer has no chat template (pass chat_template)",
                                      "messages")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  chat_template=template)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """`generate` on the chat-template prompts of one conversation or a list of them (vLLM's LLM.chat)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = load_chat_template(chat_template)  # read a file once, not per conversation
        prompts = [self.tokenizer(self.apply_chat_template(c, template), add_special_tokens=False).input_ids
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def score(self, context: str | Seq[int] | list, continuation: str | Seq[int] | list, chunk_size: int = 16,
              kv_compression: Any = None) -> RequestOutput | list[RequestOutput]:
        """Teacher-forced scoring (vLLM's prompt_logprobs): log p of every continuation token given all before
        it, fed through the normal scheduler `chunk_size` tokens per step so the compression stage acts on the
        continuation as if it were being decoded. Result in `RequestOutput.prompt_logprobs`. Lists of contexts
        and continuations (pairwise) are scored in one batch and return a list."""
        batched = isinstance(context, list) and context and not isinstance(context[0], int)
        contexts = list(context) if batched else [context]
        continuations = list(continuation) if batched else [continuation]
        if len(contexts) != len(continuations):
            raise InvalidRequestError("score: as many continuations as contexts are needed", "continuation")
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise InvalidRequestError(f"chunk_size must be a positive integer, got {chunk_size!r}", "chunk_size")
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_compression=kv_compression)
        reqs = []
        for ctx, cont in zip(contexts, continuations):
            ctx, cont = self.encode_prompt(ctx), self.encode_prompt(cont)
            if not ctx or not cont:
                raise InvalidRequestError("score: context and continuation must be non-empty", "prompt")
            reqs.append(self.core.make_request(ctx + cont, params, f"score-{next(self._ids)}",
                                               score=(len(ctx), chunk_size)))
        outs = self._run(reqs, use_tqdm=False)
        return outs if batched else outs[0]

    async def stream(self, prompt: str | Seq[int] | Request, sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Async generator of delta outputs; closing it early aborts the request. ``prompt`` may be a request
        from `new_request` (already encoded and validated)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        req = prompt if isinstance(prompt, Request) else self.new_request(prompt, sampling_params, request_id)

        def sink(out) -> None:  # runs on the engine thread
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the consumer's event loop is gone: nobody is listening any more
                self.abort(req.request_id)

        req.sink = sink
        self.start()
        self._submit(req)
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if not req.done.is_set():
                self.abort(req.request_id)

    def reset_stats(self) -> None:
        self.core.reset_stats()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def check_invariants(self) -> None:
        """Allocator invariants, exact block ownership, and no leak once every request finished."""
        with self._step_lock:
            self.core.check_invariants()
