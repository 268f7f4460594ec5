"""Lossless mode (VeriCache, arXiv 2605.17613): draft tokens from the compressed cache, verify them in one forward
pass against the full cache, keep the agreeing prefix.

A lossless sequence keeps its full KV in a host tier (paging/kv_cache_manager.py) besides its compressed device
cache. While its device cache is still exact (nothing compressed yet) it decodes normally and copies each new
token's KV to the full tier. Once compressed, it drafts `horizon` tokens from the compressed cache, then one
verification step runs [last committed token, drafts...] over the full tier: greedy requests accept the longest
prefix equal to the full cache's argmax plus the full cache's token at the first mismatch (or a bonus token);
sampling requests use speculative-sampling acceptance (accept with min(1, p/q), else resample from
norm(max(0, p - q))), so the output distribution is the full cache's. Rejected drafts are rolled back from the
device cache and the verified K/V of accepted tokens replace the drafted ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.errors import InvalidRequestError
from engine.sampler import draw, sampling_probs
from engine.step_types import Failures, SchedulerOutput, StepResult, tagged
from util import cdiv


@dataclass
class LosslessState:
    horizon: int
    horizon_min: int
    horizon_max: int
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q of each draft (sampling requests only)
    draft_kv_start: int = -1  # device KV length when the current draft began (the last committed token's slot)
    target: int = 0  # drafts to make before verifying, in the current draft
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0

    def adapt(self, num_drafts: int, num_accepted: int) -> None:
        """Long horizons amortise a verification while drafts hold; a rejection halves the horizon."""
        if num_accepted == num_drafts:
            self.horizon = min(self.horizon_max, self.horizon * 2)
        else:
            self.horizon = max(self.horizon_min, self.horizon // 2)

    def reset(self) -> None:
        self.draft_probs.clear()
        self.draft_kv_start = -1


def accept(drafts: list[int], target: torch.Tensor, draft_probs: list[torch.Tensor] | None,
           generator: torch.Generator | None) -> list[int]:
    """The tokens to commit after a verification.

    drafts [h]; target [h + 1, V]: the full cache's sampling distribution after the last committed token and after
    each draft (one-hot argmax rows for greedy requests); draft_probs: the distributions the drafts were sampled
    from (None: greedy). Returns the accepted drafts followed by one token from the full cache (the correction at
    the first rejection, or a bonus token after the last draft)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = target[i]
        if draft_probs is None:  # greedy: the full cache's argmax decides
            best = int(p.argmax())
            out.append(best)
            if best != d:
                return out
            continue
        q = draft_probs[i]
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(q[d]) < float(p[d]):  # accept with probability min(1, p(d) / q(d))
            out.append(d)
            continue
        residual = (p - q).clamp(min=0)
        out.append(draw(residual if float(residual.sum()) > 0 else p, generator))
        return out
    out.append(int(target[len(drafts)].argmax()) if draft_probs is None else draw(target[len(drafts)], generator))
    return out


class LosslessController:
    """Owns lossless mode in the engine: each lossless sequence's `LosslessState`, its full tier (hosted by the KV
    manager, `KVCacheManager.full_tier`), its drafts (fed to the model as the sequence's lookahead tokens), when it
    drafts and when its drafts are verified. The scheduler sees it as `ExternalWork` (engine/scheduler.py: items
    run outside the pool); compression sees a paused `CompressionState` while unverified slots sit in the cache, and
    the KV length (a device cache that still holds every slot, `kv_len == num_computed_tokens`, is exact)."""

    def __init__(self, kv, runner, sampler, stats, max_model_len: int):
        self.kv, self.runner, self.sampler, self.stats = kv, runner, sampler, stats
        self.max_model_len = max_model_len

    # -- requests -----------------------------------------------------------------------------------------
    def _final_blocks(self, seq) -> int:
        """Full-tier blocks of the sequence at its longest (prompt + max_tokens, or up to max_model_len)."""
        p = seq.params
        final = seq.num_prompt_tokens + (p.max_tokens if p.max_tokens is not None
                                         else self.max_model_len - seq.num_prompt_tokens)
        return cdiv(final, self.kv.block_size)

    def attach(self, seqs: list, cfg) -> None:
        """Give a new request's sequences their lossless state (``cfg``: its KVCompressionConfig, draft horizons);
        InvalidRequestError if their full tiers cannot fit the host store even alone."""
        for seq in seqs:
            seq.lossless = LosslessState(cfg.horizon_min, cfg.horizon_min, cfg.horizon_max)
        host = self.kv.host_pool.num_blocks if self.kv.host_pool is not None else 0
        need = self._final_blocks(seqs[0]) * len(seqs)
        if need > host:
            raise InvalidRequestError(
                f"kv_compression.lossless keeps the full KV in host memory: {len(seqs)} x "
                f"{self._final_blocks(seqs[0]) * self.kv.block_size} tokens do not fit the host store ({host} "
                f"blocks); raise lossless_host_memory or lower max_tokens", "kv_compression.lossless")

    # -- the scheduler's ExternalWork ----------------------------------------------------------------------
    def due(self, seq) -> int:
        ls = seq.lossless
        if ls is None or ls.draft_kv_start < 0 or len(seq.lookahead_token_ids) < ls.target:
            return 0
        return len(seq.lookahead_token_ids) + 1  # [last committed token, drafts...]

    def reserve(self, seq, num_tokens: int) -> bool:
        return self.kv.full_reserve(seq, self.kv.full_tier(seq).length + num_tokens)

    def admissible(self, seq, busy: bool) -> bool:
        """Its whole full tier must fit the host store now (alone it always fits: `attach` checked)."""
        if seq.lossless is None or self.kv.host_pool is None or not busy:
            return True
        return self._final_blocks(seq) <= self.kv.host_pool.num_free

    def swappable(self, seq) -> bool:
        return seq.lossless is None  # its host store is busy with the full tier

    def on_preempt(self, seq) -> None:
        if seq.lossless is not None:  # unverified drafts are dropped; the committed tokens stay
            seq.lookahead_token_ids.clear()
            seq.lossless.reset()
            seq.compression.resume()

    # -- the step -----------------------------------------------------------------------------------------
    def before_schedule(self, running: list) -> None:
        """A lossless sequence whose device cache was compressed drafts its next tokens from it."""
        for seq in running:
            ls = seq.lossless
            if (ls is None or ls.draft_kv_start >= 0 or seq.kv_len == seq.num_computed_tokens
                    or seq.num_pending_tokens != 1):
                continue
            p = seq.params
            remaining = (p.max_tokens if p.max_tokens is not None else self.max_model_len) - seq.num_outputs
            room = self.max_model_len - seq.num_tokens
            ls.target = max(0, min(ls.horizon, remaining - 1, room - 1))
            ls.draft_kv_start = seq.kv_len
            seq.compression.pause()  # unverified slots: no round may read or rewrite them, no query is kept

    def update_from_output(self, forward: list) -> list[tuple[Any, BaseException]]:
        """While a device cache is exact, mirror the step's new slots into the sequence's full tier."""
        failed = []
        for item in forward:
            seq = item.seq
            if seq.lossless is None or seq.kv_len != seq.num_computed_tokens:
                continue
            try:
                full_len = self.kv.full_tier(seq).length
                if not self.kv.full_append_from_device(seq, full_len, seq.kv_len - full_len):
                    raise RuntimeError("the lossless full-KV host store is full; raise lossless_host_memory")
            except Exception as err:
                failed.append((seq, err))
        return failed

    def draft(self, seqs: list, logits: torch.Tensor | None) -> tuple[list, torch.Tensor | None]:
        """Drafting sequences take their next token as a draft (fed to the model, never output until verified);
        returns the other rows for normal sampling."""
        rows = [i for i, s in enumerate(seqs) if s.lossless is not None and s.lossless.draft_kv_start >= 0]
        if not rows:
            return seqs, logits
        for i in rows:
            seq, p = seqs[i], seqs[i].params
            row = logits[i:i + 1]
            self.sampler.process(row, [seq], [seq.output_token_ids + seq.lookahead_token_ids])
            q = sampling_probs(row, [p])[0]
            token = int(q.argmax()) if p.greedy else draw(q, seq.generator or self.sampler.default_generator)
            seq.lookahead_token_ids.append(token)
            if not p.greedy:
                seq.lossless.draft_probs.append(q)
            seq.lossless.drafted += 1
            self.stats.lossless_drafted += 1
        keep = [i for i in range(len(seqs)) if i not in set(rows)]
        return [seqs[i] for i in keep], (logits[keep] if keep else None)

    def verify(self, seqs: list, append: Callable[[Any, int, tuple | None], bool],
               restart: Callable[[Any], None]) -> list[tuple[Any, BaseException]]:
        """One forward of [last committed token, drafts...] of every due sequence over its full tier, then the
        acceptance rule, the rollback of rejected drafts and the verified K/V into the device cache. `append`
        commits a token (the output processor's); `restart` rebuilds a sequence from its tokens (the scheduler's
        preemption by recompute)."""
        if not seqs:
            return []
        t0 = time.perf_counter()
        tiers = [self.kv.full_tier(s) for s in seqs]
        tables = [t.block_table for t in tiers]
        write_back = None
        if self.kv.kv_cache.data.device.type == "cpu":
            layers = self.kv.full_tier_layers()
        else:
            layers, tables, write_back = self.kv.stage_full(tables)
        batch = [(s, [s.output_token_ids[-1]] + list(s.lookahead_token_ids), t.length) for s, t in zip(seqs, tiers)]
        capture = any(s.compression.caches_queries() for s in seqs)
        logits, queries = self.runner.verify(batch, layers, tables, capture)
        if write_back is not None:
            write_back()
        failed, k0 = [], 0
        for seq, tokens, start in batch:
            rows = logits[k0:k0 + len(tokens)]
            q = queries[:, k0:k0 + len(tokens)] if queries is not None else None
            k0 += len(tokens)
            try:
                self._accept(seq, tokens[1:], start, rows, q, append, restart)
            except Exception as err:  # this sequence's own part: only its request ends
                failed.append((seq, err))
        self.stats.lossless_verifications += len(seqs)
        self.stats.lossless_verify_seconds += time.perf_counter() - t0
        return failed

    def _accept(self, seq, drafts: list[int], start: int, rows: torch.Tensor, queries: torch.Tensor | None,
                append: Callable, restart: Callable) -> None:
        p, ls = seq.params, seq.lossless
        # row j stands after the committed outputs and the first j drafts
        self.sampler.process(rows, [seq] * rows.shape[0],
                             [seq.output_token_ids + drafts[:j] for j in range(rows.shape[0])])
        target = sampling_probs(rows, [p] * rows.shape[0])
        committed = accept(drafts, target, None if p.greedy else ls.draft_probs,
                           seq.generator or self.sampler.default_generator)
        k = len(committed) - 1  # accepted drafts
        self.stats.lossless_accepted += k
        ls.accepted += k
        ls.verifications += 1
        ls.adapt(len(drafts), k)
        kv_start = ls.draft_kv_start
        ls.reset()
        seq.lookahead_token_ids.clear()
        seq.compression.resume()
        # the full tier keeps the last committed token and the accepted drafts, computed over the full cache
        self.kv.full_truncate(seq, start + 1 + k)
        if queries is not None and seq.compression.caches_queries():
            seq.compression.store_queries(start, queries[:, :1 + k])
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
            if append(seq, token, entry):
                return
        if not fits:  # the pool has no room for the verified slots: rebuild this sequence from its tokens
            restart(seq)


class LosslessStep:
    """Lossless mode as a step component (engine/core.py): drafts start before the schedule, the full tier mirrors
    exact caches and draft rows leave normal sampling after the forward, due drafts are verified after the step."""

    def __init__(self, controller: LosslessController, scheduler, output):
        self.controller, self.scheduler, self.output = controller, scheduler, output

    def before_schedule(self) -> Failures:
        self.controller.before_schedule(self.scheduler.running)
        return []

    def after_forward(self, sched: SchedulerOutput, result: StepResult) -> Failures:
        failed = tagged(self.controller.update_from_output(sched.forward), "its lossless full tier")
        result.sample_seqs, result.logits = self.controller.draft(result.sample_seqs, result.logits)
        return failed

    def after_step(self, sched: SchedulerOutput) -> Failures:
        return tagged(self.controller.verify(sched.external, self.output.append, self._restart),
                      "its lossless verification")

    def _restart(self, seq) -> None:
        self.scheduler.preempt(seq, swap=False)
