"""What a request's settings do to its next-token logits before a token is drawn, batched over the rows that ask:
EOS and stop ids banned before `min_tokens`, `logit_bias`, and vLLM's penalties.

vLLM's order and rules: the bias is added to the raw logits; then the repetition penalty (every token of the prompt
or of the output so far: a positive logit is divided by it, a negative one multiplied), then the frequency penalty
(minus `frequency_penalty` x the token's count in the output so far) and the presence penalty (minus
`presence_penalty` once for every token in the output so far). Temperature, min-p, top-k and top-p come after, in
the draw (engine/sampler.py). Each function takes the rows' token histories explicitly, so a lossless draft or a
verification row (engine/lossless.py) gets the same rule with the history it stands at.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def ban(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """Mask the listed ids of each row (in place)."""
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    if rows:
        logits[rows, [t for ids in banned for t in ids]] = float("-inf")


def add_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float] | None]) -> None:
    """OpenAI's logit_bias, per row: {token id: bias}, added to the logits (in place)."""
    rows, ids, vals = [], [], []
    for i, bias in enumerate(biases):
        if bias:
            rows += [i] * len(bias)
            ids += list(bias)
            vals += list(bias.values())
    if rows:
        logits.index_put_((torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)),
                          torch.tensor(vals, device=logits.device, dtype=logits.dtype), accumulate=True)


def _scatter_counts(rows: int, vocab: int, lists: Sequence[Sequence[int]], device) -> torch.Tensor:
    """float [rows, vocab]: how often each token occurs in each row's list (one scatter for the whole batch)."""
    counts = torch.zeros(rows, vocab, device=device)
    r = [i for i, ids in enumerate(lists) for _ in ids]
    if r:
        flat = torch.tensor([t for ids in lists for t in ids], device=device)
        counts.index_put_((torch.tensor(r, device=device), flat), torch.ones(len(r), device=device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                    repetition: Sequence[float], frequency: Sequence[float], presence: Sequence[float]) -> None:
    """vLLM's penalties over every row of `logits` (in place): rows, prompts, outputs and the three penalties
    align. Neutral values (1, 0, 0) leave a row unchanged."""
    B, V = logits.shape
    dev = logits.device
    counts = _scatter_counts(B, V, outputs, dev)
    rep = torch.tensor(repetition, device=dev, dtype=logits.dtype).unsqueeze(1)
    if (rep != 1).any():
        seen = (counts > 0) | (_scatter_counts(B, V, prompts, dev) > 0)
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits))
    logits -= torch.tensor(frequency, device=dev, dtype=logits.dtype).unsqueeze(1) * counts
    logits -= torch.tensor(presence, device=dev, dtype=logits.dtype).unsqueeze(1) * (counts > 0)


def has_work(params: Sequence[Any], banned: list[list[int]]) -> bool:
    """Whether `process` would change any row of a batch with these settings and bans."""
    return any(banned) or any(p.logit_bias or p.has_penalties for p in params)


def process(logits: torch.Tensor, params: Sequence[Any], prompts: Sequence[Sequence[int]],
            outputs: Sequence[Sequence[int]], banned: list[list[int]]) -> None:
    """Everything a request's settings do to its logits before the draw, for a batch of rows (in place): the
    min_tokens bans, logit_bias, then the penalties of the rows that have any."""
    ban(logits, banned)
    if any(p.logit_bias for p in params):
        add_logit_bias(logits, [p.logit_bias for p in params])
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    sub = logits[rows]
    apply_penalties(sub, [prompts[i] for i in rows], [outputs[i] for i in rows],
                    [params[i].repetition_penalty for i in rows], [params[i].frequency_penalty for i in rows],
                    [params[i].presence_penalty for i in rows])
    logits[rows] = sub
