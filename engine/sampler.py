"""Turns the last-position logits of a batch into next tokens: the request's logits processors
(engine/logits_processors.py: min_tokens bans, logit_bias, penalties), then greedy, or temperature, min-p, top-k,
top-p and an inverse-CDF draw from the request's own generator (vLLM's order)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.errors import RequestFailedError
from engine.logits_processors import has_work, process
from engine.sampling_params import SamplingParams


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min-p on temperature-scaled logits [B, V]: tokens less probable than min_p x the most probable one go."""
    if not bool((min_p > 0).any()):
        return x
    probs = x.softmax(dim=-1)
    return x.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None,
           argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax) -> torch.Tensor:
    """logits: float32 [B, V]. Returns int64 [B]. Greedy rows take the argmax; the others are sampled from
    the temperature-scaled, top-k/top-p-filtered distribution by inverse CDF with one uniform per row drawn
    from the row's own generator (so a seeded request is reproducible whatever it is batched with). `argmax`:
    torch.argmax over the last dimension, or an implementation that gives the same indices."""
    tokens = argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    idx = torch.tensor(rows, device=logits.device)
    x = logits[idx] / torch.tensor([params[i].temperature for i in rows], device=logits.device).unsqueeze(1)
    x = _min_p(x, torch.tensor([params[i].min_p for i in rows], device=x.device, dtype=x.dtype))
    sorted_logits, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    top_k = torch.tensor([params[i].top_k or vocab for i in rows], device=x.device).clamp(max=vocab)
    ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([params[i].top_p for i in rows], device=x.device, dtype=probs.dtype).unsqueeze(1)
    # keep the smallest prefix whose mass reaches top_p (the first token always survives)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p, 0.0)
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([
        torch.rand((), generator=generators[i] or default_generator, device="cpu") for i in rows
    ]).to(x.device, cdf.dtype) * cdf[:, -1]
    choice = torch.searchsorted(cdf, u.unsqueeze(1)).squeeze(1).clamp(max=vocab - 1)
    tokens[idx] = order.gather(1, choice.unsqueeze(1)).squeeze(1)
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """Raw-model log-probabilities: of the chosen tokens [B], and the top_n (values, ids) [B, top_n]."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_vals, top_ids = logp.topk(top_n, dim=-1) if top_n > 0 else (logp[:, :0], tokens[:, None][:, :0])
    return chosen, top_vals, top_ids


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, [B, V] float32: one-hot on the argmax for greedy rows, otherwise the
    temperature-scaled softmax restricted by min-p, top-k and top-p (the same rule as `sample`). Lossless mode's
    speculative-sampling acceptance compares these for the draft (compressed cache) and the target (full cache)."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        if p.greedy:
            out[row, logits[row].argmax()] = 1.0
            continue
        x = _min_p((logits[row].float() / p.temperature).unsqueeze(0), torch.tensor([float(p.min_p)]))[0]
        sorted_x, order = x.sort(descending=True)
        k = min(p.top_k or vocab, vocab)
        sorted_x[k:] = float("-inf")
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(mass_before >= p.top_p, 0.0)
        out[row, order] = probs / probs.sum()
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution by inverse CDF with one uniform from `generator`."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u.reshape(1)).clamp(max=probs.shape[-1] - 1))


@dataclass
class Sampled:
    """One step's sampled tokens: (sequence, token, logprob entry or None) in row order, and the sequences whose
    own part of sampling failed (their requests end alone)."""
    tokens: list[tuple[Any, int, tuple | None]] = field(default_factory=list)
    failed: list[tuple[Any, BaseException]] = field(default_factory=list)


class Sampler:
    """The sampling owner of a step: bans EOS and stop ids before min_tokens, applies structured-output masks, lets
    side signals read the distribution (InfoKV's entropy), draws every row in one batch, and computes logprobs."""

    def __init__(self, eos_token_ids: set[int], seed: int, structured: Any,
                 side_signals: Callable[[list, torch.Tensor], list] | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax):
        self.eos_token_ids = eos_token_ids
        self.argmax = argmax  # the greedy draw (engine/models/layer_ops.py: a C++ loop on CPU float32 logits)
        self.default_generator = torch.Generator().manual_seed(seed)  # for requests without a seed
        self.structured = structured  # engine/structured.py: grammar masks of constrained rows
        self.side_signals = side_signals  # (seqs, logits) -> failures

    def banned(self, seq: Any, num_committed: int) -> list[int]:
        """Stop ids and EOS are masked while fewer than min_tokens tokens are committed."""
        p = seq.params
        if num_committed >= p.min_tokens:
            return []
        return p.stop_token_ids + ([] if p.ignore_eos else sorted(self.eos_token_ids))

    def process(self, logits: torch.Tensor, seqs: list, outputs: list[list[int]]) -> None:
        """The requests' logits processors (min_tokens bans, logit_bias, penalties) for rows whose sequences stand
        after `outputs` (their committed outputs, and drafts for lossless rows), in place."""
        process(logits, [s.params for s in seqs], [s.prompt_token_ids for s in seqs], outputs,
                [self.banned(s, len(out)) for s, out in zip(seqs, outputs)])

    def sample(self, seqs: list, logits: torch.Tensor | None) -> Sampled:
        out = Sampled()
        if not seqs:
            return out
        try:  # on a copy: a failure half-way must leave the rows unprocessed for the per-row retry
            params, outputs = [s.params for s in seqs], [s.output_token_ids for s in seqs]
            banned = [self.banned(s, len(o)) for s, o in zip(seqs, outputs)]
            if has_work(params, banned):  # else skip the two copies of [B, V]
                processed = logits.clone()
                process(processed, params, [s.prompt_token_ids for s in seqs], outputs, banned)
                logits.copy_(processed)
        except Exception:  # find whose settings failed: only those requests end
            for i, seq in enumerate(seqs):
                try:
                    self.process(logits[i:i + 1], [seq], [seq.output_token_ids])
                except Exception as err:
                    out.failed.append((seq, RequestFailedError("processing its logits", err)))
        out.failed += self.structured.mask(seqs, logits)
        if self.side_signals is not None:
            out.failed += [(seq, RequestFailedError("recording its sampling entropy", err))
                           for seq, err in self.side_signals(seqs, logits)]
        if out.failed:
            gone = {id(seq) for seq, _ in out.failed}
            keep = [i for i, s in enumerate(seqs) if id(s) not in gone]
            if not keep:
                return out
            seqs, logits = [seqs[i] for i in keep], logits[keep]
        tokens = self._draw(seqs, logits, out)
        top_n = max((s.params.logprobs or 0) for s in seqs)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        if want_logprobs:
            chosen, top_vals, top_ids = token_logprobs(logits, tokens, top_n)
            chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        failed = {id(seq) for seq, _ in out.failed}
        for row, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            if id(seq) in failed:
                continue
            entry = None
            if want_logprobs and seq.params.logprobs is not None:
                entry = (chosen[row], top_ids[row][:seq.params.logprobs], top_vals[row][:seq.params.logprobs])
            out.tokens.append((seq, token, entry))
        return out

    def _draw(self, seqs: list, logits: torch.Tensor, out: Sampled) -> torch.Tensor:
        """One batched draw; if it raises, draw row by row so that only the rows that fail end their requests."""
        try:
            return sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.default_generator,
                          self.argmax)
        except Exception:
            tokens = self.argmax(logits)
            for row, seq in enumerate(seqs):
                try:
                    tokens[row] = sample(logits[row:row + 1], [seq.params], [seq.generator],
                                         self.default_generator)[0]
                except Exception as err:
                    out.failed.append((seq, err))
            return tokens
