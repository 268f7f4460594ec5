"""EngineCore: the synchronous engine. `add_request`, `abort` and `step` are called from one thread only.

One step: schedule → run the model → commit the new KV → sample and process outputs → the compression stage.
Failures that belong to one request (its outputs, its detokenization, its stop checks) end that request with an
error and free its blocks; the step goes on for the others.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence as Seq

import torch

from compression.config import Limits
from compression.stage import CompressionStage
from engine.attention import get_backend
from engine.config import EngineConfig, parse_dtype
from engine.errors import InvalidRequestError, RequestFailedError
from engine.model_runner import ModelRunner
from engine.models.layer_ops import pick_layer_ops
from engine.models.packed import GEMM_BACKENDS
from engine.models.quant import QUANTIZATIONS
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, RequestOutput
from engine.request import Request
from engine.lossless import LosslessState, accept
from engine.sampler import apply_min_tokens, draw, sample, sampling_probs, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import ScoringState, Sequence
from engine.structured import StructuredOutputs
from paging.kv_cache import KVCache
from paging.kv_cache_manager import KVCacheManager

logger = logging.getLogger("kvllm")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.resolve_device()
        self.dtype = parse_dtype(config.dtype, self.device)
        self.driver = None  # tensor parallelism: rank 0's link to the worker ranks (engine/distributed/driver.py)
        try:
            self._build(config)
        except BaseException:
            if self.driver is not None:
                self.driver.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        from engine.loader import load_model

        self.kv_dtype = config.resolve_kv_cache_dtype(self.dtype, self.device)
        if config.tensor_parallel_size > 1:
            from engine.distributed.driver import DriverKVCacheManager, TPDriver

            if config.quantization is not None:
                raise ValueError(f"quantization={config.quantization!r} does not shard: use it with "
                                 f"tensor_parallel_size 1")
            if config.gemm_backend == "cpu":
                raise ValueError("gemm_backend='cpu' does not shard: use 'auto' or 'torch' with "
                                 "tensor_parallel_size > 1")
            self.driver = TPDriver(config.tensor_parallel_size, self.device)
            self.device = self.driver.device
            self.model, self.model_config, self.tokenizer, num_blocks, host_blocks = self.driver.start(config,
                                                                                                       self.dtype)
            kv_manager = DriverKVCacheManager
        else:
            self.model, self.model_config, self.tokenizer = load_model(config.model_source(), self.dtype,
                                                                       self.device)
            if config.quantization is not None:
                QUANTIZATIONS.get(config.quantization)(self.model)
            GEMM_BACKENDS.get(config.gemm_backend)(self.model, config.quantization is not None)
            num_blocks = config.resolve_num_blocks(self.model_config, self.kv_dtype, self.device)
            host_blocks = config.host_blocks(self.model_config, self.kv_dtype)
            kv_manager = KVCacheManager
        self.model.set_layer_ops(pick_layer_ops(config.layer_ops, self.model))
        cfg = self.model_config
        max_model_len = config.resolve_max_model_len(cfg.max_position_embeddings)
        self.max_model_len = config.fit_max_model_len(max_model_len, num_blocks)
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, self.model.num_local_kv_heads,
                                cfg.head_dim, self.kv_dtype, self.device)
        self.kv = kv_manager(self.kv_cache, config.enable_prefix_caching, host_blocks, compute_dtype=self.dtype)
        self.attn = get_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(self.model, cfg, self.kv_cache, self.attn, self.device, self.dtype)
        self.compression = CompressionStage(config.kv_compression, self.device.type,
                                            Limits(self.max_model_len, cfg.vocab_size))
        if self.driver is not None:
            self.driver.check_compression(self.compression.default)
            self.driver.attach(self.runner, self.compression, self.kv)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            watermark_blocks=int(config.watermark * num_blocks),
                            scheduling_policy=config.scheduling_policy,
                            admission_optimism=config.admission_optimism,
                            projected_output_len=config.projected_output_len, max_model_len=self.max_model_len,
                            preemption_mode=config.preemption_mode),
            self.kv, reclaim=self._reclaim if config.compress_before_preempt else None)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        # [structured outputs] grammar compiler (built on the first constrained request), masks, matchers
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, self.eos_token_ids,
                                            torch.get_num_threads())
        self.requests: dict[str, Request] = {}
        self.counters = EngineStats(num_blocks=num_blocks)

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
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequestError(f"logprobs must be <= {vocab} (the vocabulary), got {params.logprobs}",
                                      "logprobs")
        if params.min_tokens > self.max_model_len:
            raise InvalidRequestError(f"min_tokens must be <= {self.max_model_len} (max_model_len), got "
                                      f"{params.min_tokens}", "min_tokens")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:  # apply_min_tokens indexes the logits with these on the engine thread
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[:4]}",
                                      "stop_token_ids")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the messages, {params.max_tokens} in the completion). "
                f"Please reduce the length of the messages or completion.")

    def make_request(self, prompt: str | Seq[int], params: SamplingParams | None, request_id: str,
                     score: tuple[int, int] | None = None) -> Request:
        """Encode and validate once; ``score`` = (score_from, max_chunk) for teacher-forced scoring."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}",
                                      "sampling_params")
        ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        try:
            cfg = self.compression.resolve(params.kv_compression)
            if self.driver is not None:
                self.driver.check_compression(cfg)
        except ValueError as err:
            raise InvalidRequestError(str(err), getattr(err, "param", "kv_compression")) from None
        seqs = []
        for i in range(params.n):
            gen = torch.Generator().manual_seed(params.seed + i) if params.seed is not None else None
            scoring = ScoringState(*score) if score is not None else None
            seq = Sequence(request_id, ids, params, index=i, generator=gen, scoring=scoring)
            seq.compression = self.compression.new_state(params.kv_compression, len(ids),
                                                         score[0] if score is not None else None)
            if seq.compression is not None and seq.compression.config.lossless and score is None:
                c = seq.compression.config
                seq.lossless = LosslessState(c.horizon_min, c.horizon_min, c.horizon_max)
            seqs.append(seq)
        if seqs[0].lossless is not None:
            final = len(ids) + (params.max_tokens or self.max_model_len - len(ids))
            host = self.kv.host_pool.num_blocks if self.kv.host_pool is not None else 0
            if -(-final // self.kv.block_size) * params.n > host:
                raise InvalidRequestError(
                    f"kv_compression.lossless keeps the full KV in host memory: {params.n} x {final} tokens do not fit "
                    f"the host store ({host} blocks); raise lossless_host_memory or lower max_tokens",
                    "kv_compression.lossless")
        if params.structured_outputs is not None:  # [structured outputs] compile once, a matcher per sequence
            self.structured.attach(seqs, params.structured_outputs)
        return Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs,
                       time.monotonic())

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
        self._emit(req)

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
    def _reclaim(self, running: list[Sequence], blocks_wanted: int) -> int:
        return self.compression.reclaim(running, self.kv, self.runner.recompute_queries, blocks_wanted)

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the outputs of requests that finished in it."""
        t0 = time.perf_counter()
        self._start_drafts()
        out = self.scheduler.schedule()
        t_sched = time.perf_counter() - t0
        self._fail_seqs(out.failed, "scheduling")
        self._fail_seqs(self._drain_stage(), "its compression round")
        out.scheduled = [x for x in out.scheduled if not x.seq.is_finished]
        self.counters.num_preemptions += len(out.preempted)
        self.counters.swapped_out_blocks += out.swapped_out
        self.counters.swapped_in_blocks += out.swapped_in
        costs = self.scheduler.costs
        if out.swapped_out or out.swapped_in:  # block copies dominate a schedule that swapped
            costs.seconds_per_block = 0.7 * costs.seconds_per_block + 0.3 * t_sched / (out.swapped_out
                                                                                       + out.swapped_in)
        touched: dict[str, Request] = {}
        if out:
            for item in out.scheduled:
                touched[item.seq.request_id] = self.requests[item.seq.request_id]
            normal = [x for x in out.scheduled if not x.verify]
            if normal:
                t1 = time.perf_counter()
                result = self.runner.execute(normal)
                tokens = sum(x.num_tokens for x in normal)
                if tokens >= 64:  # prefill-heavy steps say what recomputing a token costs
                    costs.seconds_per_token = (0.7 * costs.seconds_per_token
                                               + 0.3 * (time.perf_counter() - t1) / tokens)
                self.scheduler.commit(normal)
                for seq, first, q in result.captured:
                    self._guarded(seq, "storing its queries", seq.compression.queries.store, first, q)
                for item in normal:
                    if item.seq.num_computed_tokens <= item.seq.num_prompt_tokens:
                        self.counters.prompt_tokens_total += item.num_tokens
                    if item.seq.lossless is not None and item.seq.compression.exact:
                        self._guarded(item.seq, "its lossless full tier", self._copy_to_full_tier, item.seq)
                for seq, logps in result.scored:
                    seq.scoring.prompt_logprobs.extend(logps)
                if result.sample_seqs:
                    self._sample_and_append(result.sample_seqs, result.logits)
            verifying = [x.seq for x in out.scheduled if x.verify]
            if verifying:
                self._verify(verifying)
            self.counters.num_steps += 1
            self.compression.after_step(self.scheduler.running, self.kv, self.runner.recompute_queries)
            self._fail_seqs(self._drain_stage(), "its compression round")
        finished = []
        for req in touched.values():
            if req.error is None and self._emit(req):
                finished.append(req.final)
        self.counters.engine_seconds += time.perf_counter() - t0
        return finished

    # -- failures of one request's own part of a step ------------------------------------------------------
    def _fail_seqs(self, failed: list[tuple[Sequence, BaseException]], where: str) -> None:
        for seq, err in failed:
            req = self.requests.get(seq.request_id)
            if req is not None and req.error is None:
                logger.error("request %s failed in %s: %r", seq.request_id, where, err)
                self.fail(req, RequestFailedError(where, err))

    def _guarded(self, seq: Sequence, where: str, fn, *args) -> None:
        """Run one sequence's own piece of work; if it raises, that request fails and the step goes on."""
        try:
            fn(*args)
        except Exception as err:
            self._fail_seqs([(seq, err)], where)

    def _drain_stage(self) -> list[tuple[Sequence, BaseException]]:
        failed, self.compression.failed = self.compression.failed, []
        return failed

    def _banned(self, seq: Sequence, num_committed: int) -> list[int]:
        """Stop ids and EOS are masked while fewer than min_tokens tokens are committed."""
        p = seq.params
        if num_committed >= p.min_tokens:
            return []
        return p.stop_token_ids + ([] if p.ignore_eos else sorted(self.eos_token_ids))

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        drafting = [i for i, s in enumerate(seqs) if s.lossless is not None and s.lossless.draft_kv_start >= 0]
        if drafting:
            self._draft([seqs[i] for i in drafting], logits[drafting])
            keep = [i for i in range(len(seqs)) if i not in set(drafting)]
            if not keep:
                return
            seqs, logits = [seqs[i] for i in keep], logits[keep]
        apply_min_tokens(logits, [self._banned(seq, seq.num_outputs) for seq in seqs])
        self.structured.mask(seqs, logits)  # [structured outputs] grammar bitmasks of the constrained rows
        # InfoKV's side signal: the entropy of the distribution each token is drawn from (only for sequences whose
        # compression method asks for it), stored at the token's logical position before it is appended
        self.compression.record_entropy(seqs, logits)
        self._fail_seqs(self._drain_stage(), "recording its sampling entropy")
        keep = [i for i, s in enumerate(seqs) if not s.is_finished]
        if len(keep) < len(seqs):
            seqs, logits = [seqs[i] for i in keep], logits[keep]
            if not seqs:
                return
        tokens = self._sample(seqs, logits)
        top_n = max((s.params.logprobs or 0) for s in seqs)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        if want_logprobs:
            chosen, top_vals, top_ids = token_logprobs(logits, tokens, top_n)
            chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        for row, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            entry = None
            if want_logprobs and seq.params.logprobs is not None:
                entry = (chosen[row], top_ids[row][:seq.params.logprobs], top_vals[row][:seq.params.logprobs])
            self._append_output(seq, token, entry)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """One batched draw; if it raises, draw row by row so that only the rows that fail end their requests
        (their token is then never appended: `_append_output` skips failed requests)."""
        try:
            return sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.default_generator)
        except Exception:
            tokens = logits.argmax(dim=-1)
            for row, seq in enumerate(seqs):
                try:
                    tokens[row] = sample(logits[row:row + 1], [seq.params], [seq.generator],
                                         self.default_generator)[0]
                except Exception as err:
                    self._fail_seqs([(seq, err)], "sampling")
            return tokens

    def _append_output(self, seq: Sequence, token: int, logprob: tuple | None) -> bool:
        """Commit one generated token: outputs, logprobs, detokenization, stop checks. A failure here ends this
        request alone. Returns whether the sequence finished."""
        req = self.requests.get(seq.request_id)
        if req is None or req.error is not None or seq.is_finished:
            return True
        try:
            seq.output_token_ids.append(token)
            self.structured.accept(seq, token)  # [structured outputs] advance the matcher (raises if rejected)
            self.counters.generation_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if logprob is not None:
                chosen, ids, vals = logprob
                entry = {token: chosen}
                for tid, val in zip(ids, vals):
                    entry.setdefault(tid, val)
                seq.logprobs.append(entry)
                seq.cumulative_logprob += chosen
            if self.output.append_token(seq, token):
                self.scheduler.finish(seq)
                return True
        except Exception as err:  # this request's outputs are broken; the others go on
            logger.exception("request %s failed while processing its output", seq.request_id)
            self.fail(req, err)
            return True
        return False

    # -- lossless mode (engine/lossless.py) -----------------------------------------------------------------
    def _start_drafts(self) -> None:
        """A lossless sequence whose device cache was compressed drafts its next tokens from it."""
        for seq in self.scheduler.running:
            ls = seq.lossless
            if ls is None or ls.draft_kv_start >= 0 or seq.compression.exact or seq.num_pending_tokens != 1:
                continue
            p = seq.params
            remaining = (p.max_tokens if p.max_tokens is not None else self.max_model_len) - seq.num_outputs
            room = self.max_model_len - seq.num_tokens
            ls.target = max(0, min(ls.horizon, remaining - 1, room - 1))
            ls.draft_kv_start = seq.kv_len
            seq.compression.hold = True

    def _draft(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for row, seq in enumerate(seqs):
            p, ls = seq.params, seq.lossless
            banned = self._banned(seq, seq.num_outputs + len(seq.draft_token_ids))
            if banned:
                logits[row, banned] = float("-inf")
            q = sampling_probs(logits[row:row + 1], [p])[0]
            token = int(q.argmax()) if p.greedy else draw(q, seq.generator or self.default_generator)
            seq.draft_token_ids.append(token)
            if not p.greedy:
                ls.draft_probs.append(q)
            ls.drafted += 1
            self.counters.lossless_drafted += 1

    def _copy_to_full_tier(self, seq: Sequence) -> None:
        """Exact mode: the device cache is the full cache; mirror its new slots into the full tier."""
        if not self.kv.full_append_from_device(seq, seq.full_len, seq.kv_len - seq.full_len):
            req = self.requests.get(seq.request_id)
            if req is not None:
                self.fail(req, RuntimeError("the lossless full-KV host store is full; raise lossless_host_memory"))

    def _verify(self, seqs: list[Sequence]) -> None:
        """One forward of [last committed token, drafts...] of every due sequence over its full tier, then the
        acceptance rule, the rollback of rejected drafts and the verified K/V into the device cache."""
        t0 = time.perf_counter()
        tables = [s.full_block_table for s in seqs]
        write_back = None
        if self.device.type == "cpu":
            layers = self.kv.full_tier_layers()
        else:
            layers, tables, write_back = self.kv.stage_full(tables)
        batch = [(s, [s.output_token_ids[-1]] + list(s.draft_token_ids), s.full_len) for s in seqs]
        capture = any(s.compression.caches_queries for s in seqs)
        logits, queries = self.runner.verify(batch, layers, tables, capture)
        if write_back is not None:
            write_back()
        k0 = 0
        for seq, tokens, start in batch:
            rows = logits[k0:k0 + len(tokens)]
            q = queries[:, k0:k0 + len(tokens)] if queries is not None else None
            k0 += len(tokens)
            self._guarded(seq, "its lossless verification", self._accept, seq, tokens[1:], start, rows, q)
        self.counters.lossless_verifications += len(seqs)
        self.counters.lossless_verify_seconds += time.perf_counter() - t0

    def _accept(self, seq: Sequence, drafts: list[int], start: int, rows: torch.Tensor,
                queries: torch.Tensor | None) -> None:
        p, ls, st = seq.params, seq.lossless, seq.compression
        for j in range(rows.shape[0]):
            banned = self._banned(seq, seq.num_outputs + j)
            if banned:
                rows[j, banned] = float("-inf")
        target = sampling_probs(rows, [p] * rows.shape[0])
        committed = accept(drafts, target, None if p.greedy else ls.draft_probs,
                           seq.generator or self.default_generator)
        k = len(committed) - 1  # accepted drafts
        self.counters.lossless_accepted += k
        ls.accepted += k
        ls.verifications += 1
        ls.adapt(len(drafts), k)
        kv_start = ls.draft_kv_start
        ls.reset()
        seq.draft_token_ids.clear()
        st.hold = False
        # the full tier keeps the last committed token and the accepted drafts, computed over the full cache
        self.kv.full_truncate(seq, start + 1 + k)
        if queries is not None and st.caches_queries:
            st.queries.store(start, queries[:, :1 + k])
        fits = self.kv.resize(seq, kv_start + 1 + k)
        if fits:
            self.kv.device_from_full(seq, start, kv_start, 1 + k)
            seq.num_computed_tokens = start + 1 + k
        logp = rows.log_softmax(-1) if p.logprobs is not None else None
        for j, token in enumerate(committed):
            entry = None
            if logp is not None:
                top = logp[j].topk(p.logprobs) if p.logprobs else None
                entry = (float(logp[j, token]), top.indices.tolist() if top is not None else [],
                         top.values.tolist() if top is not None else [])
            if self._append_output(seq, token, entry):
                return
        if not fits:  # the pool has no room for the verified slots: rebuild this sequence from its tokens
            self.scheduler.preempt(seq, swap=False)

    def _emit(self, req: Request) -> bool:
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
        s = EngineStats(**{k: getattr(self.counters, k) for k in self.counters.__dataclass_fields__})
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_free_blocks = self.kv.num_free_blocks
        s.kv_cache_usage = self.kv.pool.usage()
        c = self.compression.stats
        s.compression_rounds, s.compression_blocks_freed = c.rounds, c.blocks_freed
        s.compression_tokens_evicted, s.compression_tokens_seen = c.tokens_evicted, c.tokens_seen
        s.compression_seconds = c.seconds
        s.compression_tokens_merged = c.tokens_merged
        # copied at C level first: another thread (the metrics scrape) may read while the loop adds a method
        s.compression_by_method = {name: m.as_dict() for name, m in list(c.by_method.items())}
        s.compression_on_demand_rounds = c.on_demand_rounds
        s.queries_cached, s.queries_recomputed = c.queries_cached, c.queries_recomputed
        s.query_cache_bytes = sum(q.compression.queries.nbytes for q in self.scheduler.running
                                  if q.compression is not None and q.compression.queries is not None)
        s.recomputed_tokens = self.scheduler.recomputed_tokens
        s.full_tier_bytes = self.kv.full_tier_bytes
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.prefix_queries, self.kv.prefix_hits
        st = self.structured  # [structured outputs]
        s.structured_fill_seconds, s.structured_apply_seconds, s.structured_accept_seconds = st.seconds
        return s

    def reset_stats(self) -> None:
        from compression.stage import RoundStats

        self.counters = EngineStats(num_blocks=self.kv.pool.num_blocks)
        self.compression.stats = RoundStats()
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self.scheduler.recomputed_tokens = 0
        self.structured.seconds = (0.0, 0.0, 0.0)  # [structured outputs]

    def check_invariants(self) -> None:
        """KV-manager invariants (exact block counts, ref counts = table references), and no block in use once
        every request is gone."""
        self.kv.check_invariants(self.scheduler.running, self.scheduler.waiting)
        if not self.requests:
            assert not self.scheduler.has_work(), "sequences left without a request"
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks, "blocks leaked after all requests finished"

    def shutdown(self, graceful: bool = True, destroy: bool = True) -> None:
        """Stop the tensor-parallel workers (nothing to do with one process)."""
        if self.driver is not None:
            self.driver.shutdown(graceful, destroy)

    def capacity_log_lines(self) -> list[str]:
        lines = [self.kv_cache.capacity_line(self.max_model_len)]
        if self.driver is not None:
            lines.extend(self.driver.log_lines())
        lines.extend(self.compression.capacity_lines(self.kv_cache.num_tokens, self.max_model_len))
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
