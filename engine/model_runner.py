"""Builds one step's flat inputs and attention metadata, runs the model, returns the logits that matter."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionBackend, QueryCapture, build_metadata
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from paging.kv_cache import KVCache


@dataclass
class StepResult:
    sample_seqs: list[Sequence] = field(default_factory=list)
    logits: torch.Tensor | None = None  # float32 [len(sample_seqs), V]: next-token logits
    # Teacher-forced scoring: per sequence, log p(token[t] | tokens[:t]) for the positions this step covered.
    scored: list[tuple[Sequence, list[float]]] = field(default_factory=list)
    # query_source="cache": (sequence, first logical position, post-RoPE queries [L, n, Hq, D]) of its new tokens
    captured: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model, model_config, kv_cache: KVCache, attn: AttentionBackend, device: torch.device,
                 dtype: torch.dtype):
        self.model = model
        self.config = model_config
        self.kv_cache = kv_cache
        self.attn = attn
        self.device = device
        self.dtype = dtype
        self.scale = 1.0 / math.sqrt(model_config.head_dim)

    def _plan(self, meta) -> None:
        c = self.config
        self.attn.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, self.dtype)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        result = StepResult()
        score_rows: list[int] = []
        score_targets: list[int] = []
        score_spans: list[tuple[Sequence, int]] = []
        capture_rows: list[int] = []
        capture_spans: list[tuple[Sequence, int, int]] = []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            row0 = len(input_ids)
            input_ids.extend(seq.token_slice(start, n))
            positions.extend(range(start, start + n))
            if seq.scoring is not None:
                # logits at position t score token t + 1; only tokens from score_from on, once each
                sc = seq.scoring
                first = max(start, sc.score_from - 1, sc.score_from - 1 + len(sc.prompt_logprobs))
                last = min(start + n, seq.num_prompt_tokens - 1)
                rows = list(range(row0 + first - start, row0 + last - start))
                score_rows.extend(rows)
                score_targets.extend(seq.prompt_token_ids[first + 1:last + 1])
                score_spans.append((seq, len(rows)))
            if item.completes_prefill:
                sample_rows.append(len(input_ids) - 1)
                result.sample_seqs.append(seq)
            st = seq.compression
            if st is not None and st.caches_queries and not st.hold:  # (drafts' queries: from their verification)
                first = max(start, st.start)
                if first < start + n:
                    capture_rows.extend(range(row0 + first - start, row0 + n))
                    capture_spans.append((seq, first, start + n - first))

        meta = build_metadata(
            [s.seq.block_table for s in scheduled],
            [s.num_tokens for s in scheduled],
            [s.seq.kv_len + s.num_tokens for s in scheduled],
            self.kv_cache.block_size,
            self.device,
        )
        self._plan(meta)
        if capture_rows:
            meta.capture = QueryCapture(torch.tensor(capture_rows, device=self.device), self.config.num_layers)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache.layers, self.attn, meta)
        if capture_rows:
            k = 0
            for seq, first, count in capture_spans:
                result.captured.append((seq, first, meta.capture.out[:, k:k + count]))
                k += count
        if sample_rows:
            result.logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        if score_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(score_rows, device=self.device)])
            targets = torch.tensor(score_targets, device=self.device)
            logp = logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            k = 0
            for seq, count in score_spans:
                result.scored.append((seq, logp[k:k + count]))
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
        concatenated."""
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

