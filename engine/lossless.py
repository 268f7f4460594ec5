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

from dataclasses import dataclass, field

import torch

from engine.sampler import draw


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
