"""Turns the last-position logits of a batch into next tokens: greedy, temperature, top-k, top-p, seeds."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def apply_min_tokens(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """Mask EOS / stop tokens of rows that have not reached min_tokens yet (in place)."""
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = float("-inf")


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: float32 [B, V]. Returns int64 [B]. Greedy rows take the argmax; the others are sampled from
    the temperature-scaled, top-k/top-p-filtered distribution by inverse CDF with one uniform per row drawn
    from the row's own generator (so a seeded request is reproducible whatever it is batched with)."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    idx = torch.tensor(rows, device=logits.device)
    x = logits[idx] / torch.tensor([params[i].temperature for i in rows], device=logits.device).unsqueeze(1)
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
    temperature-scaled softmax restricted to top-k and top-p (the same rule as `sample`). Lossless mode's
    speculative-sampling acceptance compares these for the draft (compressed cache) and the target (full cache)."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        if p.greedy:
            out[row, logits[row].argmax()] = 1.0
            continue
        x = logits[row].float() / p.temperature
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
