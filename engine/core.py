"""EngineCore: the synchronous engine. `add_request`, `abort` and `step` are called from one thread only.

A step is three calls over plain data (engine/step_types.py; docs/DESIGN.md, "The path of one step"): the scheduler
decides (`SchedulerOutput`), the executor runs it (engine/executor.py: forward, KV committed, sampling: a
`StepResult`), the output processor appends and stops. The step components (engine/lossless.py `LosslessStep`,
engine/compression_step.py `CompressionStep`), built with the owners they need, run before the schedule, after the
forward and after the step. A failure in one request's own part of any of these ends that request alone
(`RequestFailedError`, its blocks freed); only a failure of the batched forward itself stops the loop.
"""
from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from typing import Sequence as Seq

import torch

from compression.config import Limits
from compression.stage import CompressionStage
from compression.stats import RoundStats
from engine.attention import cpu_ext, get_backend
from engine.config import EngineConfig, cpu_has_fast_bf16, parse_dtype
from engine.distributed.driver import DriverKVCacheManager, TPDriver
from engine.errors import InvalidRequestError
from engine.compression_step import CompressionStep
from engine.executor import StepExecutor
from engine.linear_path import panels_apply, row_split_applies, widen_applies
from engine.loader import load_model
from engine.lossless import LosslessController, LosslessStep
from engine.model_runner import ModelRunner
from engine.models import bf16_panels, packed
from engine.models.backends import GEMM_BACKENDS, pick_layer_ops
from engine.models.quant import QUANTIZATIONS
from engine.models.row_split import split_rows
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, RequestOutput
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import ScoringState, Sequence
from engine.step_types import Failures, SchedulerOutput, StepComponent, tagged
from engine.structured import StructuredOutputs
from paging.kv_cache import KVCache
from paging.kv_cache_manager import KVCacheManager
from paging.kv_format import kv_format

logger = logging.getLogger("kvllm")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.resolve_device()
        self.dtype = parse_dtype(config.dtype, self.device)
        self.row_split = row_split_applies(config, self.device)
        self.panels = panels_apply(config, self.device)
        self.widened = not self.panels and widen_applies(config, self.device)
        # where activations are float32 over half-precision weights (or the row split's bf16 copies): their dtype
        self.weight_dtype = torch.bfloat16 if self.row_split or self.panels else self.dtype
        if self.row_split or self.panels or self.widened:
            self.dtype = torch.float32
        self.driver = None  # tensor parallelism: rank 0's link to the worker ranks (engine/distributed/driver.py)
        try:
            self._build(config)
        except BaseException:
            if self.driver is not None:
                self.driver.shutdown()
            raise

    def _load(self, config: EngineConfig) -> tuple[int, int, type]:
        """The model (and its shards under tensor parallelism); returns the KV pool's and the host store's block
        counts and the KV manager class."""
        if config.tensor_parallel_size > 1:
            if config.quantization is not None:
                raise ValueError(f"quantization={config.quantization!r} does not shard: use it with "
                                 f"tensor_parallel_size 1")
            if config.gemm_backend in ("cpu", "onednn"):
                raise ValueError(f"gemm_backend={config.gemm_backend!r} does not shard: use 'auto' or 'torch' with "
                                 "tensor_parallel_size > 1")
            self.driver = TPDriver(config.tensor_parallel_size, self.device)
            self.device = self.driver.device
            self.model, self.model_config, self.tokenizer, num_blocks, host_blocks = self.driver.start(config,
                                                                                                       self.dtype)
            return num_blocks, host_blocks, DriverKVCacheManager
        # panels and widening load the weights in their half dtype (their values; the panels: no float32 copy)
        self.model, self.model_config, self.tokenizer = load_model(
            config.model_source(), self.weight_dtype if self.panels or self.widened else self.dtype, self.device)
        if config.quantization is not None:
            QUANTIZATIONS.get(config.quantization)(self.model)
        if self.panels:
            bf16_panels.panel_linears(self.model)
        elif self.widened:
            packed.widen_linears(self.model)
        else:
            GEMM_BACKENDS.get(config.gemm_backend)(self.model, config.quantization is not None)
        if self.row_split:
            split_rows(self.model)
        self.model.gguf_reader = None  # the GGUF file's mapping (kept by the loader for gemm_backend 'gguf')
        return (config.resolve_num_blocks(self.model_config, self.kv_format, self.device),
                config.host_blocks(self.model_config, self.kv_format), KVCacheManager)

    def _build(self, config: EngineConfig) -> None:
        # float32 activations over half-precision weights: 'auto' KV pages are the weights' dtype, the model's
        self.kv_format = kv_format(str(self.weight_dtype).removeprefix("torch."), self.dtype) if (
            self.weight_dtype != self.dtype and config.kv_cache_dtype == "auto") else config.resolve_kv_cache_dtype(
            self.dtype, self.device)
        num_blocks, host_blocks, kv_manager = self._load(config)
        self.model.set_layer_ops(pick_layer_ops(config.layer_ops, self.model))
        cfg = self.model_config
        self.max_model_len = config.fit_max_model_len(config.resolve_max_model_len(cfg.max_position_embeddings),
                                                      num_blocks)
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, self.model.num_local_kv_heads,
                                cfg.head_dim, self.kv_format, self.device)
        self.kv = kv_manager(self.kv_cache, config.enable_prefix_caching, host_blocks, compute_dtype=self.dtype)
        self.attn = get_backend(config.attention_backend, self.device)
        tp = self.driver  # under tensor parallelism each plan and each round goes to the workers first
        self.runner = ModelRunner(self.model, cfg, self.kv_cache, self.attn, self.device, self.dtype,
                                  on_plan=tp.on_plan if tp is not None else None)
        self.stage = CompressionStage(config.kv_compression, self.device.type,
                                      Limits(self.max_model_len, cfg.vocab_size),
                                      round_hook=tp.on_round if tp is not None else None)
        if tp is not None:
            tp.check_compression(self.stage.default)
            tp.attach(self.kv)
        self.counters = EngineStats(num_blocks=num_blocks)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, self.eos_token_ids,
                                            torch.get_num_threads(), stats=self.counters,
                                            limits=config.grammar_limits(),
                                            workers=config.structured_outputs_compile_threads)
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.structured, self.stage.record_entropy,
                               argmax=self.model.layer_ops.argmax)
        self.lossless = LosslessController(self.kv, self.runner, self.sampler, self.counters, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            watermark_blocks=int(config.watermark * num_blocks),
                            scheduling_policy=config.scheduling_policy,
                            admission_optimism=config.admission_optimism,
                            projected_output_len=config.projected_output_len, max_model_len=self.max_model_len,
                            preemption_mode=config.preemption_mode),
            self.kv, external=self.lossless, stats=self.counters)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.counters,
                                      self.structured, finish=self.scheduler.finish)
        # the optional stages of every step, in order (lossless drafts start before a round may reclaim blocks)
        self.components: list[StepComponent] = [
            LosslessStep(self.lossless, self.scheduler, self.output),
            CompressionStep(self.stage, self.scheduler, self.kv, self.runner, config.compress_before_preempt),
        ]
        self.executor = StepExecutor(self.runner, self.scheduler, self.sampler, self.components)
        self.requests: dict[str, Request] = {}

    # -- inputs -------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt: this model has no tokenizer; pass token ids", "prompt")
            return list(self.tokenizer(prompt).input_ids)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt: token ids must be integers in [0, {vocab})", "prompt")
        return ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has {n} "
                f"tokens, which leaves no room for completion tokens. Please reduce the length of the prompt.")
        vocab = self.model_config.vocab_size
        # every number a request carries is bounded by what this engine holds (a bound that is too loose lets one
        # request size a buffer, or index a tensor, inside the step loop)
        slots = self.kv.pool.num_blocks * self.kv.block_size
        if params.n > slots:
            raise InvalidRequestError(f"n must be <= {slots} (the KV pool's token slots), got {params.n}", "n")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise InvalidRequestError(f"{name} must be <= {vocab} (the vocabulary), got {value}", name)
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab}), got {bad[:4]}", "logit_bias")
        if params.min_tokens > self.max_model_len:
            raise InvalidRequestError(f"min_tokens must be <= {self.max_model_len} (max_model_len), got "
                                      f"{params.min_tokens}", "min_tokens")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:  # the sampler indexes the logits with these on the engine thread
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[:4]}",
                                      "stop_token_ids")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the messages, {params.max_tokens} in the completion). "
                f"Please reduce the length of the messages or completion.")

    def make_request(self, prompt: str | Seq[int], params: SamplingParams | None, request_id: str,
                     score: tuple[int, int] | None = None) -> Request:
        """Encode and validate once, and resolve the request's KV compression once into a typed config;
        ``score`` = (score_from, max_chunk) for teacher-forced scoring."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}",
                                      "sampling_params")
        ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        try:
            cfg = self.stage.resolve(params.kv_compression)
            if self.driver is not None:
                self.driver.check_compression(cfg)
        except ValueError as err:
            raise InvalidRequestError(str(err), getattr(err, "param", None) or "kv_compression") from None
        seqs = []
        for i in range(params.n):
            gen = torch.Generator().manual_seed(params.seed + i) if params.seed is not None else None
            scoring = ScoringState(*score) if score is not None else None
            if scoring is None and params.prompt_logprobs is not None:  # the whole prompt, in ordinary chunks
                scoring = ScoringState(1, self.config.max_num_batched_tokens, decode_like=False,
                                       top_n=params.prompt_logprobs)
            seq = Sequence(request_id, ids, params, index=i, generator=gen, scoring=scoring)
            seq.compression = self.stage.new_state(cfg, len(ids), score[0] if score is not None else None)
            seqs.append(seq)
        if cfg is not None and cfg.lossless and score is None:
            self.lossless.attach(seqs, cfg)
        if params.structured_outputs is not None:  # compile once, a matcher per sequence
            self.structured.attach(seqs, params.structured_outputs)
        return Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs,
                       time.monotonic(), kv_compression=cfg)

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            self.fail(req, InvalidRequestError(f"request_id {req.request_id!r} is already running", "request_id"),
                      owned=False)
            return
        self.requests[req.request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self._emit_one(req)

    def fail(self, req: Request, err: BaseException, owned: bool = True) -> None:
        """End one request with an error: its sequences stop, its blocks go back, its consumer gets `err`."""
        if owned:
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
            self.requests.pop(req.request_id, None)
        req.error = err
        if req.sink is not None:
            try:
                req.sink(err)
            except Exception:  # a consumer that is gone cannot be told
                logger.debug("could not deliver an error to %s", req.request_id, exc_info=True)
        req.done.set()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update, with the step components before the schedule and after the step; returns
        the outputs of requests that finished in it."""
        t0 = time.perf_counter()
        for component in self.components:
            self._fail(component.before_schedule())
        sched = self.scheduler.schedule()
        result = self.executor.execute(sched)
        self._fail(result.failed + self.output.update_from_output(result.scored, result.sampled), "sampling")
        for component in self.components:
            self._fail(component.after_step(sched))
        self._count_step(sched, time.perf_counter() - t0)
        return self._emit(sched)

    def _fail(self, failed: Failures, where: str = "this step") -> None:
        """The requests of sequences whose own part of the step failed end alone; the step goes on."""
        for seq, err in tagged(failed, where):
            req = self.requests.get(seq.request_id)
            if req is not None and req.error is None:
                if isinstance(err, InvalidRequestError):  # the request's own settings: the client is told (a 400)
                    logger.info("request %s ended: %s", seq.request_id, err)
                else:
                    logger.error("request %s failed: %r", seq.request_id, err)
                self.fail(req, err)

    def _count_step(self, sched: SchedulerOutput, seconds: float) -> None:
        self.counters.num_steps += bool(sched)
        self.counters.engine_seconds += seconds

    def _emit(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Deltas to the consumers of the step's requests; the final outputs of those that finished."""
        reqs = {item.seq.request_id: self.requests.get(item.seq.request_id) for item in sched.scheduled}
        return [req.final for req in reqs.values() if req is not None and req.error is None and self._emit_one(req)]

    def _emit_one(self, req: Request) -> bool:
        """Send the request's delta to its consumer; on finish, store the final output and forget it. A consumer
        whose sink raises is failed alone."""
        try:
            if req.sink is not None:
                req.sink(self.output.request_output(req, delta=True))
            if not req.finished:
                return False
            req.final = self.output.request_output(req, delta=False)
        except Exception as err:
            logger.exception("request %s failed while emitting its output", req.request_id)
            self.fail(req, err)
            return False
        del self.requests[req.request_id]
        req.done.set()
        return True

    # -- introspection -------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot: the counters as they are, the compression stage's record, and the gauges read now."""
        s = copy.copy(self.counters)
        s.compression = self.stage.stats.snapshot()
        running = list(self.scheduler.running)
        s.num_running, s.num_waiting = len(running), len(self.scheduler.waiting)
        s.num_free_blocks, s.kv_cache_usage = self.kv.num_free_blocks, self.kv.pool.usage()
        s.query_cache_bytes = sum(q.compression.query_cache_bytes() for q in running if q.compression is not None)
        s.full_tier_bytes = self.kv.full_tier_bytes
        s.kv_cache_bytes_per_token = self.kv_cache.bytes_per_token
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.prefix_queries, self.kv.prefix_hits
        return s

    def reset_stats(self) -> None:
        self.counters.reset()
        self.counters.num_blocks = self.kv.pool.num_blocks
        self.stage.stats = RoundStats()
        self.kv.prefix_queries = self.kv.prefix_hits = 0

    def check_invariants(self) -> None:
        """KV-manager invariants (exact block counts, ref counts = table references), and no block in use once
        every request is gone."""
        self.kv.check_invariants(self.scheduler.running, self.scheduler.waiting)
        if not self.requests:
            assert not self.scheduler.has_work(), "sequences left without a request"
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks, "blocks leaked after all requests finished"

    def shutdown(self, graceful: bool = True, destroy: bool = True) -> None:
        """Stop the grammar compiles and the tensor-parallel workers."""
        self.structured.close()
        if self.driver is not None:
            self.driver.shutdown(graceful, destroy)

    def compute_line(self) -> str:
        """What 'auto' picked on this host, for the startup log: the dtype and why, the linear layers' kernels, the
        layer ops, the attention backend and its instruction set, the threads."""
        c = self.config
        why = ""
        if self.row_split:
            few = sorted({(f"{m.bits}-bit panels" if hasattr(m, "bits") else type(m).__name__, m.many_rows_above)
                          for m in self.model.modules() if getattr(m, "many_rows", None) is not None},
                         key=lambda kind: (-kind[1], kind[0]))
            kernel = {"BlockLinear": "the file's blocks", "PackedLinear": "float32 panels"}
            why = (" activations (auto: a .gguf model on a CPU with AVX512-BF16: GEMMs of "
                   + ", ".join(f"<= {rows} rows on {kernel.get(name, name)}" for name, rows in few)
                   + f", of more rows on bfloat16 panels; KV pages {self.kv_format.name})")
        elif self.panels:
            why = (f" activations ({'auto: this CPU has AVX512-BF16' if c.dtype == 'auto' else 'bfloat16 asked'}: "
                   f"bfloat16 weights on panels, KV pages {self.kv_format.name})")
        elif self.widened:
            name = str(self.weight_dtype).removeprefix("torch.")
            cpu = "on a CPU without bf16 arithmetic" if name == "bfloat16" else "kvllm has no float16 GEMM on the CPU"
            why = (f" activations ({name} asked, {cpu}: {name} weight panels widened to float32 in the GEMM, KV "
                   f"pages {self.kv_format.name})")
        elif c.dtype == "auto" and self.device.type == "cpu":
            why = " (auto: this CPU has AVX512-BF16/AMX)" if cpu_has_fast_bf16() else " (auto: no fast bf16 here)"
        # a row split's bf16 copies are submodules of the layers they serve: named beside them, not counted as layers
        copies = {id(m.many_rows): type(m.many_rows).__name__ for m in self.model.modules()
                  if getattr(m, "many_rows", None) is not None}
        linears = Counter(type(m).__name__ + (f" (+ a {copies[id(m.many_rows)]} copy)" if getattr(
            m, "many_rows", None) is not None else "") for m in self.model.modules()
            if id(m) not in copies and hasattr(m, "in_features") and hasattr(m, "out_features"))
        attn = type(self.attn).__name__
        if attn == "CpuPagedBackend":
            level = min(self.attn.max_isa, cpu_ext.load().attention_isa_level())
            if level == 3 and (self.kv_format.name != "bfloat16" or self.model_config.head_dim % 32):
                level = 2  # the bf16 dot products read bfloat16 pages of head_dim % 32 == 0 only
            attn += f" ({('portable', 'AVX2', 'AVX-512', 'AVX512-BF16 dot products')[level]} kernel)"
        return (f"Compute: {str(self.dtype).removeprefix('torch.')}{why}; linear layers: "
                + ", ".join(f"{n} x{k}" for n, k in linears.most_common())
                + f"; layer ops: {getattr(self.model.layer_ops, 'name', type(self.model.layer_ops).__name__)}; "
                f"attention: {attn}; {torch.get_num_threads()} threads")

    def capacity_log_lines(self) -> list[str]:
        lines = [self.compute_line(), self.kv_cache.capacity_line(self.max_model_len)]
        if self.driver is not None:
            lines.extend(self.driver.log_lines())
        lines.extend(self.stage.capacity_lines(self.kv_cache.num_tokens, self.max_model_len))
        lines.append(f"Prefix caching: {'on' if self.kv.enable_prefix_caching else 'off'}")
        c, sc = self.config, self.scheduler.config
        host = self.kv.host_pool.num_blocks if self.kv.host_pool is not None else 0
        if self.kv.host_pool is not None:
            nbytes = self.kv.host_pool.num_blocks * self.kv.host[:, 0].numel() * self.kv.host.element_size()
            lines.append(f"Host KV store (swap space + lossless full tier): {self.kv.host_pool.num_blocks} blocks x "
                         f"{self.kv.block_size} tokens = {self.kv.host_pool.num_blocks * self.kv.block_size} tokens "
                         f"({nbytes / 2**20:.1f} MiB, allocated as used)")
        lines.append(f"Scheduler: {sc.scheduling_policy} admission"
                     + (f" (optimism {sc.admission_optimism}, projected output "
                        f"{sc.projected_output_len or 'max_tokens'})" if sc.scheduling_policy != "fcfs" else "")
                     + f"; under memory pressure: {'compress, then ' if c.compress_before_preempt else ''}preempt "
                       f"the {sc.preemption_victim} victim by {sc.preemption_mode}"
                     + (f" (swap space {host} blocks)" if host and sc.preemption_mode != "recompute" else ""))
        return lines
