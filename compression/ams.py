"""AMS, Adaptive Mass-Segmented KV compression (arXiv 2605.23200), as a wrapper over any base scorer, for the window
policy and for the threshold policy (with its EMA credit as explicit state). Pure torch, batched over all leading
axes (layer-like rows x KV heads); each (row, KV head) gets its own segmentation and keeps exactly k slots.

One selection (`ams_select`), given a mass (attention evidence) m and the base scores s over T positions:
  1. normalise: m <- (relu(m) + 1e-12) / sum(...). Non-finite mass counts as 0.
  2. segment: cut before the first position whose cumulative mass reaches each target t_i = i * segment_mass
     (i >= 1, t_i < 1; cut positions clamped to [1, T - 1], duplicates merged); split segments longer than
     ``max_seg_len`` into pieces of max_seg_len from their start; then merge, left to right, every segment
     shorter than ``min_seg_len`` with the ones after it until it is long enough (the last one may stay short).
  3. quotas: each segment gets min(len, ``min_keep_per_segment``). If that already reaches k, budgets are
     decreased round-robin in segment order (one unit per segment per pass) down to 1 each, then (our addition:
     the reference loops forever there) down to 0. Otherwise the remainder k - sum is split in proportion to
     segment mass, round-half-even, capped at the segment length, and fixed up to sum exactly to k by
     round-robin decrements (not below the minimum) or increments (not above the length).
  4. inside each segment, its quota of positions with the best base score are candidates.
  5. must-keep: the first ``n_sink`` and last ``keep_last`` positions (keep_last capped at k, n_sink at
     k - keep_last). The other k - |must-keep| slots go to the candidates with the best base scores (a global
     ranking: when must-keep slots were not candidates, the weakest candidates drop out); any shortfall would be
     filled by the best non-candidates.
  Ties (scores) -> lower index; NaN scores -> -inf. Cumulative mass is summed in float64 so the cut positions do
  not depend on float32 summation order.

This follows the reference ``AdaptiveMassSegmentWrapperHeadPress`` (EIT-NLP/AdaptiveMassSegment,
``kvpress/presses/adaptive_segment_head_press.py``) step for step; the reference segments the batch-mean mass,
we segment per row (rows are independent sequences/layers here).

Mass evidence (as the reference, SnapKV-style): the observation queries attend causally, probabilities averaged
over them, avg-pooled (kernel 5, zero padding counted) along the keys, averaged over the GQA group.
  * threshold: the last w queries over the prefix [0, T - w); the w observation slots get the row's maximum
    (the reference pads them with the max), so segmentation covers all T slots and the observation slots, kept
    by the caller, are forced kept (keep_last >= w), take their slots of the budget and never starve the prefix.
  * window: the last ``obs_window`` window queries (default the buffer) over the region only.

EMA credit (threshold policy only; the window policy never re-scores a token): per (row, KV head, slot) state
credit <- decay * credit_prev + (1 - decay) * m (slots appended since the last event start at 0), and the mass used
is norm(mix_beta * m + (1 - mix_beta) * norm(credit)). After selection the credit of the kept slots follows them:
`ams_threshold_select` returns it in post-compaction order (kept prefix slots, then the w window slots), so the
caller stores it with the sequence and passes it back (padded or not) at the next event.

Paper defaults (``AMS_DEFAULTS`` in the reference's evaluation/evaluate_registry.py): observation window 32,
segment_mass 0.02, min_seg_len 32, max_seg_len 1024, min_keep_per_segment 8, n_sink 4, keep_last 32, credit decay
0.8, mix_beta 0.7. Window defaults (our choice): n_sink 0 and keep_last 0, because in a window the buffer already
protects the newest tokens and the attention sinks are the sequence's first tokens (in the prompt, outside the
region).

Cost: the base scorer's, plus O(T) per row for the mass and the selection (two sorts), and a Python loop over at
most min(T, ~1/segment_mass + T/max_seg_len) segment starts (vectorised over rows).

Registered as ``ams`` (bottom of this module), periodic (kept count ⌈r·n⌉ per window, no α) and threshold. In the
serving loop the credit is per-sequence state: `ams_threshold_select` gets the credit the sequence's previous event
returned (`PrefixBatch.slot_state["credit"]`, already in that event's post-compaction slot order; slots appended
since then start at 0) and its new credit is stored in its place; a recompute preemption, which rebuilds the cache,
drops it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from compression import registry
from compression.base import Compressor, PrefixBatch, ScoreMethod, Selection, Span
from compression.baselines import (
    H2OCompressor,
    KeyDiffCompressor,
    KnormCompressor,
    SnapKVWindowCompressor,
    TOVACompressor,
)
from compression.config import KVCompressionConfig, field_error
from compression.kara import Kara
from compression.method_utils import check_bool, check_int, check_number, check_threshold, check_window, obs_window_len
from compression.primitives import finite_scores
from compression.rkv import RKVCompressor
from compression.snapkv import snapkv_scores

AMS_SEGMENT_MASS = 0.02
AMS_MIN_SEG_LEN = 32
AMS_MAX_SEG_LEN = 1024
AMS_MIN_KEEP_PER_SEGMENT = 8
AMS_N_SINK = 4
AMS_KEEP_LAST = 32
AMS_CREDIT_DECAY = 0.8
AMS_MIX_BETA = 0.7
AMS_EVIDENCE_KERNEL = 5
_EPS = 1e-12


def _scorer(name: str, cls: type[ScoreMethod], policy: str) -> Callable[..., torch.Tensor]:
    """A registered score method with its default settings, as a base scorer (its `score` alone)."""
    comp = cls(KVCompressionConfig(name, policy=policy))
    if policy == "periodic":
        return lambda q, k, n: comp.score(Span(policy, k, q, n, k.shape[0]))
    return lambda qo, k: comp.score(Span(policy, k, qo, k.shape[2] - qo.shape[2], k.shape[0]))


_BASES = {"kara": Kara, "rkv": RKVCompressor, "tova": TOVACompressor, "snapkv": SnapKVWindowCompressor,
          "h2o": H2OCompressor, "keydiff": KeyDiffCompressor, "knorm": KnormCompressor}
#: Base scorers for the window policy: f(queries, keys, num_region) -> [L, Hkv, n].
WINDOW_BASES = {name: _scorer(name, cls, "periodic") for name, cls in _BASES.items()}
#: Base scorers for the threshold policy: f(queries_obs, keys) -> [L, Hkv, T - w].
THRESHOLD_BASES = {name: _scorer(name, cls, "threshold") for name, cls in _BASES.items() if "threshold" in cls.policies}


# ----------------------------------------------------------------------------- parameter checks
def _check_segment_params(segment_mass: float, min_seg_len: int, max_seg_len: int) -> None:
    check_number("segment_mass", segment_mass, 0, 1, lo_open=True, method="ams")
    check_int("min_seg_len", min_seg_len, 1, method="ams")
    check_int("max_seg_len", max_seg_len, 1, method="ams")
    if max_seg_len < min_seg_len:
        raise ValueError(f"ams.max_seg_len must be >= min_seg_len ({min_seg_len}), got {max_seg_len!r}")


# ----------------------------------------------------------------------------- mass
def ams_normalize(x: torch.Tensor) -> torch.Tensor:
    """(relu(x) + 1e-12) / sum along the last axis, float32; non-finite values count as 0."""
    x = torch.relu(torch.nan_to_num(x.to(torch.float32), nan=0.0, posinf=0.0, neginf=0.0)) + _EPS
    return x / x.sum(dim=-1, keepdim=True)


def ams_credit_update(mass_current: torch.Tensor, credit_prev: torch.Tensor | None, *,
                      credit_decay: float = AMS_CREDIT_DECAY, mix_beta: float = AMS_MIX_BETA
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """EMA credit. mass_current [..., T] (normalised here); credit_prev [..., T'] or None (zeros): slots past T'
    (appended since the last event) start at 0, slots past T are dropped. Returns (mass_used [..., T],
    credit [..., T]), both float32."""
    decay = check_number("credit_decay", credit_decay, 0, 1, hi_open=True, method="ams")
    beta = check_number("mix_beta", mix_beta, 0, 1, method="ams")
    m = ams_normalize(mass_current)
    T = m.shape[-1]
    if credit_prev is None:
        prev = torch.zeros_like(m)
    else:
        if tuple(credit_prev.shape[:-1]) != tuple(m.shape[:-1]):
            raise ValueError(f"ams.credit_prev must be [{', '.join(map(str, m.shape[:-1]))}, T'], "
                             f"got {tuple(credit_prev.shape)}")
        prev = credit_prev.to(device=m.device, dtype=torch.float32)[..., :T]
        if prev.shape[-1] < T:
            prev = torch.cat([prev, prev.new_zeros(*m.shape[:-1], T - prev.shape[-1])], dim=-1)
    credit = decay * prev + (1.0 - decay) * m
    return ams_normalize(beta * m + (1.0 - beta) * ams_normalize(credit)), credit


def ams_window_mass(queries: torch.Tensor, keys: torch.Tensor, num_region: int, *, obs_window: int | None = None,
                    kernel: int = AMS_EVIDENCE_KERNEL) -> torch.Tensor:
    """Window evidence over the region: mean (over the last ``obs_window`` window queries, default the buffer) of
    their causal attention, avg-pooled, GQA-group mean. float32 [L, Hkv, n] (not normalised)."""
    check_window("ams", queries, keys, num_region)
    check_int("kernel", kernel, 1, odd=True, method="ams")
    w = keys.shape[2]
    obs = obs_window_len("ams", obs_window, w, num_region)
    return snapkv_scores(queries[:, :, w - obs:], keys, kernel)[..., :num_region] / obs


def ams_threshold_mass(queries_obs: torch.Tensor, keys: torch.Tensor, *,
                       kernel: int = AMS_EVIDENCE_KERNEL) -> torch.Tensor:
    """Threshold evidence over all T slots: the prefix [0, T - w) as in `ams_window_mass` (mean over the w
    observation queries), the w observation slots padded with the row's maximum (over KV heads and prefix).
    float32 [L, Hkv, T]."""
    w = check_threshold("ams", queries_obs, keys)
    check_int("kernel", kernel, 1, odd=True, method="ams")
    pre = snapkv_scores(queries_obs, keys, kernel) / w
    top = pre.amax(dim=(1, 2), keepdim=True).expand(pre.shape[0], pre.shape[1], w)
    return torch.cat([pre, top], dim=-1)


# ----------------------------------------------------------------------------- segmentation and quotas
def _num_targets(segment_mass: float) -> int:
    """#{i >= 1 : i * segment_mass < 1}, robust to float error (0.02 * 50 must not count)."""
    return max(0, math.ceil(1.0 / segment_mass - 1e-9) - 1)


#: 2^-52: at most 2^52 targets, counted exactly in float64; finer ones resolve nothing more (see `_segment_ids`).
_MIN_SEGMENT_MASS = 2.0 ** -52


def _targets_at_most(x: torch.Tensor, sm: float, nt: int) -> torch.Tensor:
    """#{1 <= i <= nt : i * sm <= x} per entry (float64), the products rounded as float64 like a tensor of
    targets would be: floor(x / sm), corrected by a step either way where the division rounded across."""
    k = torch.floor(x / sm).clamp(0, nt)
    for _ in range(2):
        k = torch.where((k + 1 <= nt) & ((k + 1) * sm <= x), k + 1, k)
        k = torch.where((k > 0) & (k * sm > x), k - 1, k)
    return k


def _segment_ids(m: torch.Tensor, segment_mass: float, min_seg_len: int, max_seg_len: int) -> torch.Tensor:
    """m: normalised mass [R, T]. Returns the segment index of every position, LongTensor [R, T] (0, 1, ...)."""
    R, T = m.shape
    dev = m.device
    pos = torch.arange(T, device=dev)
    is_start = torch.zeros(R, T, dtype=torch.bool, device=dev)
    is_start[:, 0] = True
    # Finer targets than float64 resolves below a cumulative mass of 1 cut the same places (every slot); without
    # the floor 1 / segment_mass overflows and the count of targets leaves float64's exact integers.
    sm = max(float(segment_mass), _MIN_SEGMENT_MASS)
    nt = _num_targets(sm)
    if T > 1 and nt > 0:
        # Target t_i = i * sm (1 <= i <= nt) cuts before the first index whose cumulative mass reaches it, clamped
        # to [1, T - 1]. Counted per position rather than enumerated (nt grows as 1 / segment_mass): slot j starts
        # a segment iff some target lies in (cum[j - 1], cum[j]], the first and last slots' intervals open-ended.
        cum = m.to(torch.float64).cumsum(dim=-1)
        below = _targets_at_most(cum[:, 1:T - 1], sm, nt)  # targets <= cum[j] for 1 <= j <= T - 2
        hi = torch.cat([below, torch.full((R, 1), float(nt), dtype=torch.float64, device=dev)], dim=-1)
        lo = torch.cat([torch.zeros(R, 1, dtype=torch.float64, device=dev), below], dim=-1)
        is_start[:, 1:] |= hi > lo
    # Split long segments: a new start every max_seg_len positions from each segment's start.
    seg_start = torch.where(is_start, pos, 0).cummax(dim=-1).values
    is_start |= (pos - seg_start) % max_seg_len == 0
    if min_seg_len > 1:
        # Merge short segments forward: a start survives iff it lies >= min_seg_len after the last survivor.
        num = int(is_start.sum(dim=-1).max())
        starts = torch.where(is_start, pos, T).sort(dim=-1).values[:, :num]  # [R, num], padded with T
        keep = torch.zeros(R, num, dtype=torch.bool, device=dev)
        keep[:, 0] = True
        last = torch.zeros(R, dtype=torch.long, device=dev)
        for j in range(1, num):
            kj = (starts[:, j] < T) & (starts[:, j] - last >= min_seg_len)
            keep[:, j] = kj
            last = torch.where(kj, starts[:, j], last)
        merged = torch.zeros(R, T + 1, dtype=torch.bool, device=dev)
        merged.scatter_(1, torch.where(keep, starts, T), True)
        is_start = merged[:, :T]
    return is_start.to(torch.long).cumsum(dim=-1) - 1


def _round_robin(head: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Units taken per segment when ``total`` units are taken one per segment per pass, segments in index order,
    a segment taking part while it has headroom left. head [R, S] >= 0, total [R] >= 0 -> taken [R, S]
    (all the headroom when total exceeds it)."""
    # P full passes: the largest P with sum(min(head, P)) <= total; then the first r segments still open.
    lo = torch.zeros_like(total)
    hi = head.amax(dim=-1) if head.shape[-1] else torch.zeros_like(total)
    for _ in range(max(1, int(hi.max()).bit_length() + 1) if hi.numel() else 1):
        mid = (lo + hi + 1) // 2
        ok = torch.minimum(head, mid[:, None]).sum(dim=-1) <= total
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    taken = torch.minimum(head, lo[:, None])
    rest = total - taken.sum(dim=-1)
    open_ = head > lo[:, None]
    return taken + (open_ & (open_.to(torch.long).cumsum(dim=-1) <= rest[:, None])).to(torch.long)


def _quotas(seg: torch.Tensor, m: torch.Tensor, k: int, min_keep: int) -> torch.Tensor:
    """Per-segment quotas [R, S] summing to k (see the module docstring, step 3)."""
    R, T = seg.shape
    S = int(seg.max()) + 1
    seg_len = torch.zeros(R, S, dtype=torch.long, device=seg.device).scatter_add_(1, seg, torch.ones_like(seg))
    seg_mass = torch.zeros(R, S, dtype=torch.float64, device=seg.device).scatter_add_(1, seg, m.to(torch.float64))
    floor = torch.clamp(seg_len, max=min_keep)
    base_sum = floor.sum(dim=-1)
    kk = torch.full_like(base_sum, k)
    # Minimums alone reach k: shrink round-robin to 1 per segment, then to 0.
    shrunk = floor - _round_robin((floor - 1).clamp(min=0), (base_sum - kk).clamp(min=0))
    shrunk = shrunk - _round_robin(shrunk, (shrunk.sum(dim=-1) - kk).clamp(min=0))
    # Otherwise: split the remainder by mass, cap at the length, fix the sum up.
    remain = (kk - base_sum).clamp(min=0).to(torch.float64)
    total = seg_mass.sum(dim=-1, keepdim=True) + _EPS
    extra = torch.round(remain[:, None] * (seg_mass / total)).to(torch.long)  # half-to-even, like Python round
    grown = torch.minimum(seg_len, floor + extra)
    grown = grown - _round_robin(grown - floor, (grown.sum(dim=-1) - kk).clamp(min=0))
    grown = grown + _round_robin(seg_len - grown, (kk - grown.sum(dim=-1)).clamp(min=0))
    return torch.where((base_sum >= kk)[:, None], shrunk, grown)


def ams_segments(mass: torch.Tensor, *, segment_mass: float = AMS_SEGMENT_MASS, min_seg_len: int = AMS_MIN_SEG_LEN,
                 max_seg_len: int = AMS_MAX_SEG_LEN) -> torch.Tensor:
    """Segment index of every position, LongTensor shaped like mass (steps 1-2 of the module docstring)."""
    _check_segment_params(segment_mass, min_seg_len, max_seg_len)
    T = mass.shape[-1]
    m = ams_normalize(mass).reshape(-1, T)
    return _segment_ids(m, segment_mass, min_seg_len, max_seg_len).reshape(mass.shape)


def ams_quotas(mass: torch.Tensor, k: int, *, segment_mass: float = AMS_SEGMENT_MASS,
               min_seg_len: int = AMS_MIN_SEG_LEN, max_seg_len: int = AMS_MAX_SEG_LEN,
               min_keep_per_segment: int = AMS_MIN_KEEP_PER_SEGMENT) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment ids shaped like mass, quotas [..., S] summing to k; S = the most segments of any row, absent
    segments get 0)."""
    _check_segment_params(segment_mass, min_seg_len, max_seg_len)
    check_int("min_keep_per_segment", min_keep_per_segment, 0, method="ams")
    T = mass.shape[-1]
    check_int("k", k, 0, T, method="ams")
    m = ams_normalize(mass).reshape(-1, T)
    seg = _segment_ids(m, segment_mass, min_seg_len, max_seg_len)
    q = _quotas(seg, m, k, min_keep_per_segment)
    return seg.reshape(mass.shape), q.reshape(*mass.shape[:-1], q.shape[-1])


def ams_select(mass: torch.Tensor, scores: torch.Tensor, k: int, *, segment_mass: float = AMS_SEGMENT_MASS,
               min_seg_len: int = AMS_MIN_SEG_LEN, max_seg_len: int = AMS_MAX_SEG_LEN,
               min_keep_per_segment: int = AMS_MIN_KEEP_PER_SEGMENT, n_sink: int = AMS_N_SINK,
               keep_last: int = AMS_KEEP_LAST) -> torch.Tensor:
    """The AMS selection (module docstring, steps 1-5). mass and scores [..., T] (any leading shape, e.g.
    [L, Hkv, T]); returns LongTensor [..., k] of kept positions, strictly ascending, exactly k per row."""
    if mass.shape != scores.shape:
        raise ValueError(f"ams: mass {tuple(mass.shape)} and scores {tuple(scores.shape)} must have the same shape")
    check_int("n_sink", n_sink, 0, method="ams")
    check_int("keep_last", keep_last, 0, method="ams")
    lead, T = mass.shape[:-1], mass.shape[-1]
    seg, quota = ams_quotas(mass, k, segment_mass=segment_mass, min_seg_len=min_seg_len, max_seg_len=max_seg_len,
                            min_keep_per_segment=min_keep_per_segment)
    seg = seg.reshape(-1, T)
    quota = quota.reshape(seg.shape[0], -1)
    R = seg.shape[0]
    dev = seg.device
    s = finite_scores(scores).reshape(R, T).to(dev)
    pos = torch.arange(T, device=dev)

    # Step 4: rank inside each segment (score desc, ties -> lower index) via two stable sorts.
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    by_seg = order.gather(1, torch.sort(seg.gather(1, order), dim=-1, stable=True).indices)
    seg_len = torch.zeros_like(quota).scatter_add_(1, seg, torch.ones_like(seg))
    seg_off = seg_len.cumsum(dim=-1) - seg_len
    sid = seg.gather(1, by_seg)
    in_quota = (pos - seg_off.gather(1, sid)) < quota.gather(1, sid)
    cand = torch.zeros(R, T, dtype=torch.bool, device=dev).scatter_(1, by_seg, in_quota)

    # Step 5: must-keep slots, then the best candidates, then (never needed when quotas sum to k) the best rest.
    eff_last = min(keep_last, k)
    eff_sink = min(n_sink, max(0, k - eff_last))
    must = ((pos < eff_sink) | (pos >= T - eff_last)).expand(R, T)
    need = k - int(must[0].sum()) if R else 0
    c_ord = (cand & ~must).gather(1, order)
    take = c_ord & (c_ord.cumsum(dim=-1) <= need)
    rest = need - take.sum(dim=-1, keepdim=True)
    o_ord = (~cand & ~must).gather(1, order)
    take |= o_ord & (o_ord.cumsum(dim=-1) <= rest)
    keep = torch.zeros(R, T, dtype=torch.bool, device=dev).scatter_(1, order, take) | must
    kept = torch.where(keep, pos, T).sort(dim=-1).values[:, :k]
    return kept.reshape(*lead, k)


# ----------------------------------------------------------------------------- policies
def _base_scores(table: dict, base: str | torch.Tensor, args: tuple, shape: tuple) -> torch.Tensor:
    if isinstance(base, torch.Tensor):
        s = base
    else:
        if base not in table:
            raise ValueError(f"ams.base must be one of {sorted(table)} or a score tensor, got {base!r}")
        s = table[base](*args)
    if tuple(s.shape) != shape:
        raise ValueError(f"ams: base scores must be {shape}, got {tuple(s.shape)}")
    return s


def ams_window_select(queries: torch.Tensor, keys: torch.Tensor, num_region: int, k: int, *,
                      base: str | torch.Tensor = "kara",
                      obs_window: int | None = None, kernel: int = AMS_EVIDENCE_KERNEL,
                      segment_mass: float = AMS_SEGMENT_MASS, min_seg_len: int = AMS_MIN_SEG_LEN,
                      max_seg_len: int = AMS_MAX_SEG_LEN, min_keep_per_segment: int = AMS_MIN_KEEP_PER_SEGMENT,
                      n_sink: int = 0, keep_last: int = 0) -> torch.Tensor:
    """AMS over one window's region. ``base``: a name in WINDOW_BASES (scored with its defaults) or the base
    scores themselves [L, Hkv, n]. Mass: `ams_window_mass` (needs a buffer). LongTensor [L, Hkv, k], ascending."""
    check_window("ams", queries, keys, num_region)
    check_int("k", k, 0, num_region, method="ams")
    L, hkv = keys.shape[:2]
    mass = ams_window_mass(queries, keys, num_region, obs_window=obs_window, kernel=kernel)
    s = _base_scores(WINDOW_BASES, base, (queries, keys, num_region), (L, hkv, num_region))
    return ams_select(mass, s, k, segment_mass=segment_mass, min_seg_len=min_seg_len, max_seg_len=max_seg_len,
                      min_keep_per_segment=min_keep_per_segment, n_sink=n_sink, keep_last=keep_last)


def ams_threshold_select(queries_obs: torch.Tensor, keys: torch.Tensor, budget: int, *,
                         base: str | torch.Tensor = "snapkv",
                         credit_prev: torch.Tensor | None = None, use_credit: bool = True,
                         credit_decay: float = AMS_CREDIT_DECAY, mix_beta: float = AMS_MIX_BETA,
                         kernel: int = AMS_EVIDENCE_KERNEL, segment_mass: float = AMS_SEGMENT_MASS,
                         min_seg_len: int = AMS_MIN_SEG_LEN, max_seg_len: int = AMS_MAX_SEG_LEN,
                         min_keep_per_segment: int = AMS_MIN_KEEP_PER_SEGMENT, n_sink: int = AMS_N_SINK,
                         keep_last: int = AMS_KEEP_LAST) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AMS over the whole cache (threshold policy). queries_obs [L, Hq, w, D], keys [L, Hkv, T, D]; ``base``: a name
    in THRESHOLD_BASES or prefix scores [L, Hkv, T - w]. With kb = min(budget, T - w), returns

      * kept: LongTensor [L, Hkv, kb], ascending indices into the prefix [0, T - w) (the w observation slots are
        kept by the caller, after them);
      * credit_new: float32 [L, Hkv, kb + w], the EMA credit of the surviving slots in post-compaction order
        (kept prefix slots, then the w observation slots), or None when use_credit is False.

    credit_prev: the credit returned by the previous event of this sequence, [L, Hkv, T'] (T' <= T: slots appended
    since then start at 0), or None for the first event."""
    check_int("budget", budget, 0, method="ams")
    w = check_threshold("ams", queries_obs, keys)
    if not isinstance(use_credit, bool):
        raise ValueError(f"ams.use_credit must be a boolean, got {use_credit!r}")
    L, hkv, T = keys.shape[:3]
    n = T - w
    kb = min(budget, n)
    mass = ams_threshold_mass(queries_obs, keys, kernel=kernel)
    credit = None
    if use_credit:
        mass, credit = ams_credit_update(mass, credit_prev, credit_decay=credit_decay, mix_beta=mix_beta)
    pre = _base_scores(THRESHOLD_BASES, base, (queries_obs, keys), (L, hkv, n))
    # The observation slots always win their segment's quota (the caller keeps them), like the reference's
    # max-padding of the base scores.
    s = torch.cat([finite_scores(pre), pre.new_full((L, hkv, w), float("inf"), dtype=torch.float32)], dim=-1)
    kept_all = ams_select(mass, s, kb + w, segment_mass=segment_mass, min_seg_len=min_seg_len,
                          max_seg_len=max_seg_len, min_keep_per_segment=min_keep_per_segment, n_sink=n_sink,
                          keep_last=max(keep_last, w))
    credit_new = credit.gather(-1, kept_all) if credit is not None else None
    return kept_all[..., :kb].contiguous(), credit_new


# ----------------------------------------------------------------------------- registration
@dataclass
class AMSParams:
    """base: the scorer ranking slots inside each segment (null: "kara" under the periodic policy, "snapkv" under
    the threshold policy; periodic: kara, rkv, tova, snapkv, h2o, keydiff, knorm; threshold: the same but kara);
    segment_mass (0.02), min_seg_len (32), max_seg_len (1024), min_keep_per_segment (8): segmentation and quotas;
    n_sink / keep_last: first / last positions always kept (null: 0 / 0 under the periodic policy, where the buffer
    already protects the newest tokens and the sinks are in the prompt; the paper's 4 / 32 under the threshold
    policy); credit_decay (0.8), mix_beta (0.7), use_credit (true): the EMA credit, threshold policy only (a window
    is scored once). Defaults are the paper's (AMS_DEFAULTS of its evaluation registry)."""
    base: str | None = None
    segment_mass: float = AMS_SEGMENT_MASS
    min_seg_len: int = AMS_MIN_SEG_LEN
    max_seg_len: int = AMS_MAX_SEG_LEN
    min_keep_per_segment: int = AMS_MIN_KEEP_PER_SEGMENT
    n_sink: int | None = None
    keep_last: int | None = None
    credit_decay: float = AMS_CREDIT_DECAY
    mix_beta: float = AMS_MIX_BETA
    use_credit: bool = True

    def validate(self) -> None:
        bases = sorted(set(WINDOW_BASES) | set(THRESHOLD_BASES))
        if self.base is not None and self.base not in bases:
            raise field_error("base", f"must be one of {bases} or null", self.base)
        check_number("segment_mass", self.segment_mass, 0.0, 1.0, lo_open=True)
        check_int("min_seg_len", self.min_seg_len, 1)
        check_int("max_seg_len", self.max_seg_len, 1)
        if self.max_seg_len < self.min_seg_len:
            raise field_error("max_seg_len", f"must be >= min_seg_len ({self.min_seg_len})", self.max_seg_len)
        check_int("min_keep_per_segment", self.min_keep_per_segment, 0)
        check_int("n_sink", self.n_sink, 0, none_ok=True)
        check_int("keep_last", self.keep_last, 0, none_ok=True)
        check_number("credit_decay", self.credit_decay, 0.0, 1.0, hi_open=True)
        check_number("mix_beta", self.mix_beta, 0.0, 1.0)
        check_bool("use_credit", self.use_credit)

    def check_common(self, common) -> None:
        table = WINDOW_BASES if common.policy == "periodic" else THRESHOLD_BASES
        if self.base is not None and self.base not in table:
            raise field_error("base", f"must be one of {sorted(table)} under the {common.policy} policy", self.base)


class AMSCompressor(Compressor):
    """AMS over a base scorer: mass-segmented quotas, ⌈r·n⌉ per window; under the threshold policy with its EMA
    credit as per-sequence state."""

    def _segmenting(self) -> dict:
        c = self.config
        return dict(segment_mass=c.segment_mass, min_seg_len=c.min_seg_len, max_seg_len=c.max_seg_len,
                    min_keep_per_segment=c.min_keep_per_segment)

    def select(self, queries, keys, num_region):
        c = self.config
        return ams_window_select(queries, keys, num_region, self.num_kept(num_region), base=c.base or "kara",
                                 n_sink=0 if c.n_sink is None else c.n_sink,
                                 keep_last=0 if c.keep_last is None else c.keep_last, **self._segmenting())

    def select_threshold(self, batch: PrefixBatch):
        c = self.config
        kept, credit = ams_threshold_select(
            batch.queries_obs, batch.keys, batch.budget, base=c.base or "snapkv",
            credit_prev=batch.slot_state.get("credit"), use_credit=c.use_credit, credit_decay=c.credit_decay,
            mix_beta=c.mix_beta, n_sink=AMS_N_SINK if c.n_sink is None else c.n_sink,
            keep_last=AMS_KEEP_LAST if c.keep_last is None else c.keep_last, **self._segmenting())
        return Selection(kept, slot_state=None if credit is None else {"credit": credit})


registry.register("ams", AMSCompressor, AMSParams, policies=("periodic", "threshold"),
                  description="AMS: mass-segmented quotas over a base scorer (+ EMA credit under the threshold "
                              "policy); ⌈r·n⌉ per window")


__all__ = ["AMS_SEGMENT_MASS", "AMS_MIN_SEG_LEN", "AMS_MAX_SEG_LEN", "AMS_MIN_KEEP_PER_SEGMENT", "AMS_N_SINK",
           "AMS_KEEP_LAST", "AMS_CREDIT_DECAY", "AMS_MIX_BETA", "AMS_EVIDENCE_KERNEL", "WINDOW_BASES",
           "THRESHOLD_BASES", "ams_normalize", "ams_credit_update", "ams_window_mass", "ams_threshold_mass",
           "ams_segments", "ams_quotas", "ams_select", "ams_window_select", "ams_threshold_select", "AMSParams",
           "AMSCompressor"]
