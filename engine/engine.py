"""The embedding API: `Engine(model=...)`, `generate`, `chat`, async `stream`, `abort`.

The engine owns the scheduler, the model runner and the KV pool. `step()` runs one scheduled batch; either
the caller's thread drives it (`generate` with no server) or a background thread does (`start()`, used by
`stream` and the HTTP server). Requests and aborts from other threads go through an inbox drained at the
start of each step, so scheduler state is only ever touched by the stepping thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence as Seq

import torch

from engine.attention import get_backend
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, RequestOutput
from engine.sampler import apply_min_tokens, sample, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from paging.block_pool import BlockPool
from paging.kv_cache import KVCache, bytes_per_block, num_blocks_for_memory

logger = logging.getLogger("kvllm")

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls only beat fp32 on CPUs with AMX or AVX512-BF16; on plain AVX2 they are ~4x slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def parse_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and on CPUs with fast bf16 matmuls, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        on_cuda = device is not None and device.type == "cuda"
        return torch.bfloat16 if on_cuda or cpu_has_fast_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as '512MiB' or '2GB'."""
    if isinstance(value, int):
        nbytes = value
    else:
        text = str(value).strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if unit not in _UNITS or not num:
            raise ValueError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")
        nbytes = int(float(num) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return nbytes


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    sink: Callable[[RequestOutput | BaseException], None] | None = None  # streaming: receives deltas
    done: threading.Event = field(default_factory=threading.Event)
    final: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class EngineDeadError(RuntimeError):
    pass


class Engine:
    def __init__(
        self,
        model: str = "smollm2",
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        kv_compression: Any = None,
        attention_backend: str = "auto",
        watermark: float = 0.01,
        seed: int = 0,
    ):
        from engine.loader import load_model

        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if num_kv_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if num_kv_blocks is not None and (not isinstance(num_kv_blocks, int) or num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks!r}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = parse_dtype(dtype, self.device)
        self.model, self.model_config, self.tokenizer = load_model(model, self.dtype, self.device)
        self.model_name = model if model == "smollm2" else model.rstrip("/").split("/")[-1]
        cfg = self.model_config
        limit = cfg.max_position_embeddings
        if max_model_len is not None and (not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit):
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_model_len!r}")
        self.max_model_len = max_model_len or limit

        if num_kv_blocks is None:
            budget = parse_memory(kv_cache_memory) if kv_cache_memory is not None else self._default_kv_memory()
            num_kv_blocks = num_blocks_for_memory(budget, cfg.num_layers, block_size, cfg.num_kv_heads,
                                                  cfg.head_dim, self.dtype)
            if num_kv_blocks < 1:
                raise ValueError(f"kv_cache_memory={kv_cache_memory!r} is smaller than one KV block "
                                 f"({bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)} bytes)")
        kv_tokens = num_kv_blocks * block_size
        if kv_tokens < self.max_model_len:  # one request must always fit, or it would preempt itself forever
            if max_model_len is not None:
                raise ValueError(f"max_model_len ({max_model_len}) is larger than the KV cache ({kv_tokens} tokens); "
                                 f"raise num_kv_blocks / kv_cache_memory or lower max_model_len")
            self.max_model_len = kv_tokens
        self.kv_cache = KVCache(cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                self.dtype, self.device)
        self.pool = BlockPool(num_kv_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            block_size=block_size, watermark_blocks=int(watermark * num_kv_blocks)),
            self.pool)
        self.attn = get_backend(attention_backend, self.device)
        self.runner = ModelRunner(self.model, cfg, self.kv_cache, self.attn, self.device, self.dtype)
        self.default_generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        self.set_kv_compression(kv_compression)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)

        self.requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._stats = EngineStats(num_blocks=num_kv_blocks)
        for line in self.capacity_log_lines():
            logger.info(line)

    # -- configuration ------------------------------------------------------------------------------------
    def _default_kv_memory(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        return 2 * 2**30

    def set_kv_compression(self, kv_compression: Any) -> None:
        """Engine-wide KV compression setting (None / 'none' / method name / dict / KVCompressionConfig)."""
        from compression.policies import make_policy

        self._compression = make_policy(kv_compression, self)

    @property
    def kv_compression_config(self):
        """The engine-wide `compression.KVCompressionConfig` (method "none" when off)."""
        return self._compression.config

    def capacity_log_lines(self) -> list[str]:
        lines = [self.kv_cache.capacity_line(self.max_model_len)]
        lines.extend(self._compression.capacity_lines(self.kv_cache.num_tokens, self.max_model_len))
        return lines

    # -- requests -----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return list(self.tokenizer(prompt).input_ids)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        return ids

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                             f"prompt has {n} tokens, which leaves no room for completion tokens. Please reduce the "
                             f"length of the prompt.")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:  # apply_min_tokens indexes the logits with these on the engine thread
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[:4]}")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {n + params.max_tokens} tokens ({n} in the messages, {params.max_tokens} "
                             f"in the completion). Please reduce the length of the messages or completion.")

    def _make_request(self, prompt: str | Seq[int], params: SamplingParams | None, request_id: str | None,
                      sink=None, score_from: int | None = None, max_chunk: int | None = None) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        ids = self.encode_prompt(prompt)
        self.validate_request(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seqs = []
        for i in range(params.n):
            gen = torch.Generator().manual_seed(params.seed + i) if params.seed is not None else None
            seqs.append(Sequence(request_id, ids, params, index=i, generator=gen, score_from=score_from,
                                 max_chunk=max_chunk, compress_prompt=self._compression.compresses_prompt(params)))
        return Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs,
                       time.monotonic(), sink)

    def _submit(self, req: Request) -> None:
        self._check_alive()
        self._inbox.put(("add", req))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); its blocks are freed at the start of the next step."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if payload.request_id in self.requests:
                    self._deliver_error(payload, ValueError(f"request_id {payload.request_id!r} is already running"))
                    continue
                self.requests[payload.request_id] = payload
                for seq in payload.seqs:
                    self.scheduler.add(seq)
            else:
                req = self.requests.get(payload)
                if req is None:
                    continue
                for seq in req.seqs:
                    if not seq.is_finished:
                        seq.finish_reason = "abort"
                        self.scheduler.finish(seq)
                self._emit(req)

    # -- the step -----------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or not self._inbox.empty()

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the outputs of requests that finished in it."""
        with self._step_lock, torch.inference_mode():
            t0 = time.perf_counter()
            self._drain_inbox()
            out = self.scheduler.schedule()
            finished: list[RequestOutput] = []
            touched: dict[str, Request] = {}
            if out.preempted:
                self._stats.num_preemptions += len(out.preempted)
            if out:
                result = self.runner.execute(out.scheduled)
                self.scheduler.advance(out.scheduled)
                for item in out.scheduled:
                    if item.seq.num_computed_tokens <= item.seq.num_prompt_tokens:
                        self._stats.prompt_tokens_total += item.num_tokens
                for seq, logps in result.scored:
                    seq.prompt_logprobs.extend(logps)
                if result.sample_seqs:
                    self._sample_and_append(result.sample_seqs, result.logits)
                for item in out.scheduled:
                    touched[item.seq.request_id] = self.requests[item.seq.request_id]
                self._stats.num_steps += 1
                self._compression.after_step(out.scheduled, self._stats)
            for req in touched.values():
                self._emit(req)
                if req.finished:
                    finished.append(req.final)
            self._stats.engine_seconds += time.perf_counter() - t0
            return finished

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        banned = []
        for seq in seqs:
            p = seq.params
            if seq.num_outputs < p.min_tokens:
                banned.append(list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids)))
            else:
                banned.append([])
        apply_min_tokens(logits, banned)
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.default_generator)
        top_n = max((s.params.logprobs or 0) for s in seqs)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        if want_logprobs:
            chosen, top_vals, top_ids = token_logprobs(logits, tokens, top_n)
            chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        now = time.monotonic()
        for row, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            seq.output_token_ids.append(token)
            self._stats.generation_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if want_logprobs and seq.params.logprobs is not None:
                entry = {token: chosen[row]}
                for tid, val in zip(top_ids[row][:seq.params.logprobs], top_vals[row][:seq.params.logprobs]):
                    entry.setdefault(tid, val)
                seq.logprobs.append(entry)
                seq.cumulative_logprob += chosen[row]
            if self.output.append_token(seq, token):
                self.scheduler.finish(seq)

    def _emit(self, req: Request) -> None:
        if req.sink is not None:
            req.sink(self.output.request_output(req, delta=True))
        if req.finished:
            req.final = self.output.request_output(req, delta=False)
            del self.requests[req.request_id]
            req.done.set()

    def _deliver_error(self, req: Request, err: BaseException) -> None:
        if req.sink is not None:
            req.sink(err)
        req.done.set()

    # -- driving ------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")

    def is_healthy(self) -> bool:
        return self._dead is None

    def start(self) -> None:
        """Run the step loop in a background thread (idempotent)."""
        if self._thread is None:
            self._check_alive()
            self._thread = threading.Thread(target=self._loop, name="kvllm-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stopping:
            if not self.has_unfinished_requests():
                self._wakeup.wait(0.05)
                self._wakeup.clear()
                continue
            try:
                self.step()
            except BaseException as err:  # the loop is dead: fail every request, report unhealthy
                logger.exception("engine loop died")
                self._dead = err
                for req in list(self.requests.values()):
                    self._deliver_error(req, EngineDeadError(str(err)))
                return

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

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
            ours = {id(r) for r in reqs}
            while not all(r.done.is_set() for r in reqs):
                done = self.step()
                if bar:
                    bar.update(sum(1 for r in reqs if r.final is not None and id(r) in ours) - bar.n)
                if not done and not self.scheduler.has_work() and self._inbox.empty():
                    break
        if bar:
            bar.close()
        self._check_alive()
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
                raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        reqs = [self._make_request(p, sp, None) for p, sp in zip(prompts, params)]
        return self._run(reqs, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer(self.apply_chat_template(c), add_special_tokens=False).input_ids
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def score(self, context: str | Seq[int], continuation: str | Seq[int], chunk_size: int = 16,
              kv_compression: Any = None) -> RequestOutput:
        """Teacher-forced scoring (vLLM's prompt_logprobs): log p of every continuation token given all
        before it, fed through the normal scheduler `chunk_size` tokens per step so the compression policy
        acts on the continuation as if it were being decoded. Result in `RequestOutput.prompt_logprobs`."""
        ctx, cont = self.encode_prompt(context), self.encode_prompt(continuation)
        if not ctx or not cont:
            raise ValueError("score: context and continuation must be non-empty")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_compression=kv_compression)
        req = self._make_request(ctx + cont, params, None, score_from=len(ctx), max_chunk=chunk_size)
        return self._run([req], use_tqdm=False)[0]

    async def stream(self, prompt: str | Seq[int], sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Async generator of delta outputs; closing it early aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def sink(out) -> None:  # runs on the engine thread
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the consumer's event loop is gone: nobody is listening any more
                self.abort(req.request_id)

        req = self._make_request(prompt, sampling_params, request_id, sink=sink)
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
        self._stats = EngineStats(num_blocks=self.pool.num_blocks)

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_free_blocks = self.pool.num_free
        s.kv_cache_usage = self.pool.usage()
        return EngineStats(**{k: getattr(s, k) for k in s.__dataclass_fields__})

    def check_invariants(self) -> None:
        """Allocator invariants, and every used block belongs to exactly one live sequence."""
        self.pool.check_invariants()
        owned = [b for seq in self.scheduler.running for b in seq.block_table]
        assert len(owned) == len(set(owned)), "a block is in two block tables"
        assert len(owned) == self.pool.num_used, f"{self.pool.num_used} blocks used, {len(owned)} owned"
        for seq in self.scheduler.running:
            assert seq.kv_len <= len(seq.block_table) * self.kv_cache.block_size
            assert seq.kv_len <= seq.num_computed_tokens
        for seq in self.scheduler.waiting:
            assert not seq.block_table
        if not self.requests and self._inbox.empty():
            assert self.pool.num_free == self.pool.num_blocks, "blocks leaked after all requests finished"
