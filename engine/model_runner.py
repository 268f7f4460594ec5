"""Builds one step's flat inputs and attention metadata, runs the model, returns the logits that matter.

A step is split in three so tensor parallelism can run the same forward on every rank: `prepare` (rank 0: the
scheduled sequences -> a `ForwardPlan` of plain data, ids instead of objects), `forward` (every rank: metadata
from the plan's block tables and lengths, then the model) and `finish` (rank 0: logits, scores and captured
queries back to their sequences). With one process `execute` runs the three in a row.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.attention.base import AttentionBackend, QueryCapture, build_metadata
from engine.sequence import Sequence
from engine.step_types import ScheduledSeq, StepResult
from paging.kv_cache import KVCache


@dataclass
class ForwardPlan:
    """One step's model inputs as plain data: all a tensor-parallel rank needs to run the same forward."""
    seq_ids: list[int]
    starts: list[int]  # first logical position of each sequence's tokens (positions are start, start + 1, ...)
    input_ids: list[int]
    block_tables: list[list[int]]
    q_lens: list[int]
    kv_lens: list[int]  # after the step
    sample_rows: list[int] = field(default_factory=list)  # rows whose next-token logits are sampled
    score_rows: list[int] = field(default_factory=list)  # rows whose logits score a prompt token
    capture_rows: list[int] = field(default_factory=list)  # rows whose queries are kept (query_source="cache")
    capture_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (index in seq_ids, first, count)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None = None  # sample rows (rank 0 only under tensor parallelism)
    score_logits: torch.Tensor | None = None  # score rows (idem)
    captured: list[torch.Tensor] = field(default_factory=list)  # per capture span: [L, count, Hq (local), D]


@dataclass
class _StepContext:
    """What only rank 0 keeps of a step: the sequence objects behind the plan's rows."""
    seqs: list[Sequence]
    sample_seqs: list[Sequence]
    score_targets: list[int]
    score_spans: list[tuple[Sequence, int]]
    captures: list[tuple[Sequence, int]]  # (sequence, first position) of each capture span


class ModelRunner:
    def __init__(self, model, model_config, kv_cache: KVCache, attn: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, on_plan: Callable[[ForwardPlan, list[Sequence]], None] | None = None):
        self.model = model
        self.config = model_config
        self.kv_cache = kv_cache
        self.attn = attn
        self.device = device
        self.dtype = dtype
        self.scale = 1.0 / math.sqrt(model_config.head_dim)
        # Tensor parallelism (engine/distributed/driver.py): sends each plan to the other ranks before rank 0 runs it.
        self.on_plan = on_plan

    def _plan(self, meta) -> None:
        # this rank's heads (all of them without tensor parallelism)
        self.attn.plan(meta, self.model.num_local_q_heads, self.model.num_local_kv_heads, self.config.head_dim,
                       self.dtype, self.kv_cache.format.storage)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        """One forward of the scheduled items (an empty list: nothing runs, an empty result)."""
        if not scheduled:
            return StepResult()
        t0 = time.perf_counter()
        plan, ctx = self.prepare(scheduled)
        if self.on_plan is not None:
            self.on_plan(plan, ctx.seqs)
        result = self.finish(ctx, self.forward(plan))
        result.num_tokens, result.seconds = len(plan.input_ids), time.perf_counter() - t0
        return result

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[ForwardPlan, _StepContext]:
        plan = ForwardPlan([], [], [], [], [], [])
        ctx = _StepContext([], [], [], [], [])
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            row0 = len(plan.input_ids)
            plan.seq_ids.append(seq.seq_id)
            plan.starts.append(start)
            plan.input_ids.extend(seq.token_slice(start, n))
            plan.block_tables.append(list(seq.block_table))
            plan.q_lens.append(n)
            plan.kv_lens.append(seq.kv_len + n)
            ctx.seqs.append(seq)
            if seq.scoring is not None:
                # logits at position t score token t + 1; only tokens from score_from on, once each
                sc = seq.scoring
                first = max(start, sc.score_from - 1, sc.score_from - 1 + len(sc.prompt_logprobs))
                last = min(start + n, seq.num_prompt_tokens - 1)
                rows = list(range(row0 + first - start, row0 + last - start))
                if rows:  # (none once the prompt is done: a prompt_logprobs request then decodes as usual)
                    plan.score_rows.extend(rows)
                    ctx.score_targets.extend(seq.prompt_token_ids[first + 1:last + 1])
                    ctx.score_spans.append((seq, len(rows)))
            if item.completes_prefill:
                plan.sample_rows.append(len(plan.input_ids) - 1)
                ctx.sample_seqs.append(seq)
            # (none while its compression is paused: a lossless draft's queries come from its verification instead)
            first = seq.compression.capture_from(start) if seq.compression is not None else None
            if first is not None:
                if first < start + n:
                    plan.capture_rows.extend(range(row0 + first - start, row0 + n))
                    plan.capture_spans.append((i, first, start + n - first))
                    ctx.captures.append((seq, first))
        return plan, ctx

    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> ForwardOutput:
        """Run a plan on this rank's shard and KV cache (every rank derives the same metadata from the plan)."""
        meta = build_metadata(plan.block_tables, plan.q_lens, plan.kv_lens, self.kv_cache.block_size, self.device)
        self._plan(meta)
        if plan.capture_rows:
            meta.capture = QueryCapture(torch.tensor(plan.capture_rows, device=self.device), self.config.num_layers)
        positions = [p for start, n in zip(plan.starts, plan.q_lens) for p in range(start, start + n)]
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache.layers, self.attn, meta)
        out = ForwardOutput()
        if plan.capture_rows:
            k = 0
            for _, _, count in plan.capture_spans:
                out.captured.append(meta.capture.out[:, k:k + count])
                k += count
        # under tensor parallelism every rank takes part in gathering the logits; rank 0 receives them
        if plan.sample_rows:
            out.logits = self.model.compute_logits(hidden[torch.tensor(plan.sample_rows, device=self.device)])
        if plan.score_rows:
            out.score_logits = self.model.compute_logits(hidden[torch.tensor(plan.score_rows, device=self.device)])
        return out

    def finish(self, ctx: _StepContext, out: ForwardOutput) -> StepResult:
        result = StepResult(sample_seqs=ctx.sample_seqs, logits=out.logits)
        result.captured = [(seq, first, q) for (seq, first), q in zip(ctx.captures, out.captured, strict=True)]
        if ctx.score_spans:
            targets = torch.tensor(ctx.score_targets, device=self.device)
            all_logp = out.score_logits.log_softmax(-1)
            logp = all_logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top_n = max(seq.scoring.top_n for seq, _ in ctx.score_spans)
            vals, ids = (all_logp.topk(top_n, dim=-1) if top_n else (all_logp[:, :0], targets[:, None][:, :0]))
            vals, ids = vals.tolist(), ids.tolist()
            # with top logprobs, each prompt token's rank in the vocabulary too (vLLM reports it)
            ranks = ((all_logp > all_logp.gather(1, targets.unsqueeze(1))).sum(-1) + 1).tolist() if top_n else None
            k = 0
            for seq, count in ctx.score_spans:
                n = seq.scoring.top_n
                tops = [(dict(zip(ids[r][:n], vals[r][:n])), ranks[r]) for r in range(k, k + count)] if n else []
                result.scored.append((seq, logp[k:k + count], tops))
                k += count
        return result

    @torch.inference_mode()
    def verify(self, items: list[tuple[Sequence, list[int], int]], kv_layers: list[torch.Tensor],
               tables: list[list[int]], capture: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Lossless verification: each item's tokens at logical positions [start, start + n) run over its full tier
        (`kv_layers` with `tables`; `start` slots already there) and their K/V are written after them. Returns the
        float32 logits of every token [sum n, V] and, with `capture`, their queries [L, sum n, Hq, D]."""
        input_ids, positions = [], []
        for _, tokens, start in items:
            input_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
        meta = build_metadata(tables, [len(t) for _, t, _ in items], [s + len(t) for _, t, s in items],
                              self.kv_cache.block_size, self.device)
        self._plan(meta)
        if capture:
            meta.capture = QueryCapture(torch.arange(len(input_ids), device=self.device), self.config.num_layers)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, kv_layers, self.attn, meta)
        return self.model.compute_logits(hidden), (meta.capture.out if capture else None)

    @torch.inference_mode()
    def recompute_queries(self, spans: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """Post-RoPE queries of every layer for already-cached tokens. Each span is (seq, first logical
        token, count); the span and every token after it must be uncompressed (one KV slot each, at the end of
        kv_len), e.g. a prefix of the uncompressed tail: the span's queries then attend exactly the slots up to
        its last token, so later tokens need not be recomputed. Returns [L, T, Hq, D] with the spans' tokens
        concatenated (this rank's query heads under tensor parallelism, where every rank must call it)."""
        input_ids, positions, kv_ends = [], [], []
        for seq, start, n in spans:
            input_ids.extend(seq.token_slice(start, n))
            positions.extend(range(start, start + n))
            kv_ends.append(seq.kv_len - (seq.num_computed_tokens - (start + n)))  # the slot after the span's end
        meta = build_metadata([s.block_table for s, _, _ in spans], [n for _, _, n in spans],
                              kv_ends, self.kv_cache.block_size, self.device, write=False)
        self._plan(meta)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model.recompute_queries(ids, pos, self.kv_cache.layers, self.attn, meta)
