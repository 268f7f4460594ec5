"""Shared helpers of the neighbouring compression methods (compression/rkv.py, ams.py, infokv.py, centroid.py,
baselines.py): input checks that name the offending parameter, layer grouping that bounds peak memory, GQA
reshapes, attention probabilities, pooling and the common top-k (ties -> lower index, NaN -> -inf).

Conventions shared by every method module:
  * window methods take ``queries [L, Hq, W, D]`` (post-RoPE, may be None for query-free methods),
    ``keys [L, Hkv, W, D]`` and ``num_region`` n (region = window slots [0, n), buffer = [n, W)) and return kept
    region indices LongTensor [L, Hkv, k], strictly ascending, on the keys' device;
  * threshold (whole-cache) methods take ``queries_obs [L, Hq, w, D]`` (the last w tokens' queries) and
    ``keys [L, Hkv, T, D]`` and return kept indices into the prefix [0, T - w), exactly min(budget, T - w) per row;
  * scores are float32 whatever the input dtype; GQA: query head h belongs to KV head h // g, g = Hq // Hkv.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compression.base import check_window_inputs
from compression.config import field_error
from compression.kara import logit_cap, topk_sorted

# Above this many float32 elements in one [layers, ...] intermediate, work on groups of layers (same bounds as
# compression/kara.py: 1 << 27 floats = 512 MiB, near the last-level cache on a CPU).
MAX_ELEMS = 1 << 27


def layer_groups(L: int, per_layer_elems: int, device: torch.device | None = None) -> list[tuple[int, int]]:
    """[l0, l1) ranges covering [0, L) with at most MAX_ELEMS // per_layer_elems layers each (at least one; on a
    CPU device the cap is compression/kara.py's MAX_LOGIT_ELEMS_CPU)."""
    step = max(1, min(L, logit_cap(MAX_ELEMS, device) // max(1, per_layer_elems)))
    return [(s, min(L, s + step)) for s in range(0, L, step)]


def check_window(method: str, queries: torch.Tensor | None, keys: torch.Tensor, num_region: int,
                 needs_queries: bool = True) -> None:
    """Window inputs. Query-free methods accept queries=None."""
    if queries is None:
        if needs_queries:
            raise ValueError(f"{method}.queries are required (got None)")
        if keys.dim() != 4:
            raise ValueError(f"{method}.keys must be [L, Hkv, W, D], got {tuple(keys.shape)}")
        if not (0 < num_region <= keys.shape[2]):
            raise ValueError(f"{method}.num_region must be in (0, {keys.shape[2]}], got {num_region}")
        return
    check_window_inputs(queries, keys, num_region)


def check_threshold(method: str, queries_obs: torch.Tensor | None, keys: torch.Tensor,
                    obs_window: int | None = None) -> int:
    """Threshold inputs; returns the observation-window length w (from queries_obs, or obs_window for
    query-free methods called with queries_obs=None)."""
    if keys.dim() != 4:
        raise ValueError(f"{method}.keys must be [L, Hkv, T, D], got {tuple(keys.shape)}")
    L, hkv, T, d = keys.shape
    if queries_obs is None:
        if obs_window is None:
            raise ValueError(f"{method}: queries_obs is None, so obs_window must be given")
        w = obs_window
    else:
        if queries_obs.dim() != 4:
            raise ValueError(f"{method}.queries_obs must be [L, Hq, w, D], got {tuple(queries_obs.shape)}")
        lq, hq, w, dq = queries_obs.shape
        if (lq, dq) != (L, d) or hkv < 1 or hq % hkv != 0:
            raise ValueError(f"{method}: queries_obs {tuple(queries_obs.shape)} and keys {tuple(keys.shape)} "
                             f"disagree on L or D, or Hq is not a multiple of Hkv")
        if obs_window is not None and obs_window != w:
            raise ValueError(f"{method}.obs_window ({obs_window}) disagrees with queries_obs ({w} queries)")
    if not (1 <= w < T):
        raise ValueError(f"{method}: need 1 <= observation window ({w}) < number of keys ({T})")
    return w


def check_k(method: str, k: int, n: int, name: str = "k") -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not (0 <= k <= n):
        raise ValueError(f"{method}.{name} must be an integer in [0, {n}], got {k!r}")


def check_budget(method: str, budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"{method}.budget must be an integer >= 0, got {budget!r}")


def check_kernel(method: str, kernel: int, name: str = "kernel") -> None:
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"{method}.{name} must be an odd integer >= 1, got {kernel!r}")


def check_unit(method: str, name: str, value: float, lo_open: bool = False, hi_open: bool = False) -> float:
    """A number in [0, 1] (ends optionally open)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(float(value))
    if ok:
        v = float(value)
        ok = (v > 0 if lo_open else v >= 0) and (v < 1 if hi_open else v <= 1)
    if not ok:
        lo, hi = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{method}.{name} must be in {lo}0, 1{hi}, got {value!r}")
    return float(value)


def obs_window_len(method: str, obs_window: int | None, w: int, num_region: int) -> int:
    """Number of trailing window queries used as observation queries: default the whole buffer (W - n); they must
    all lie in the buffer, so that every region key precedes every observation query."""
    buf = w - num_region
    if buf < 1:
        raise ValueError(f"{method} needs a non-empty buffer (num_region {num_region} < window {w})")
    o = buf if obs_window is None else obs_window
    if isinstance(o, bool) or not isinstance(o, int) or not (1 <= o <= buf):
        raise ValueError(f"{method}.obs_window must be an integer in [1, {buf}] (the buffer), got {obs_window!r}")
    return o


def group_queries(queries: torch.Tensor, hkv: int) -> torch.Tensor:
    """[L, Hq, w, D] -> float32 [L, Hkv, g, w, D] (query head h = kv * g + j)."""
    L, hq, w, d = queries.shape
    return queries.to(torch.float32).reshape(L, hkv, hq // hkv, w, d)


def causal_probs(q: torch.Tensor, k: torch.Tensor, first_pos: int) -> torch.Tensor:
    """Softmax attention of queries at slots first_pos + i over keys [0, first_pos + i] (causal, in slot space).

    q float32 [..., w, D] (unscaled), k float32 [..., T, D] broadcastable. Returns float32 [..., w, T]."""
    w, d = q.shape[-2], q.shape[-1]
    T = k.shape[-2]
    dev = q.device
    masked = torch.arange(T, device=dev)[None, :] > (first_pos + torch.arange(w, device=dev))[:, None]
    logits = torch.matmul(q * (1.0 / math.sqrt(d)), k.transpose(-1, -2)).masked_fill(masked, float("-inf"))
    return torch.softmax(logits, dim=-1)


def pool1d(x: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Stride-1, same-length pooling along the last axis: "avg" counts the zero padding (as F.avg_pool1d), "max"
    pads with -inf (as F.max_pool1d)."""
    if kernel == 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    if mode == "avg":
        out = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    elif mode == "max":
        out = F.max_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"pooling must be 'avg' or 'max', got {mode!r}")
    return out.reshape(shape)


def finite_scores(scores: torch.Tensor) -> torch.Tensor:
    """float32 copy with NaN -> -inf (NaN scores rank last)."""
    return torch.nan_to_num(scores.to(torch.float32), nan=float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best positions per row (ties -> lower index, NaN -> -inf), ascending. Same as kara.topk_sorted."""
    return topk_sorted(scores, k)


# ----------------------------------------------------------------------------- parameter records
def _is_int(v) -> bool:
    """An int that is not a bool (JSON true must not pass as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_obs_window(obs_window, common) -> None:
    """The window policy's observation queries must lie in the buffer; the threshold policy observes the last
    ``observation_window`` tokens (a common field) instead, so a per-method obs_window there would be ignored."""
    if obs_window is None:
        return
    if common.policy == "threshold":
        raise field_error("obs_window", "applies to the periodic policy only (the threshold policy observes the last "
                                        "observation_window tokens); leave it unset", obs_window)
    if obs_window > common.buffer:
        raise field_error("obs_window", f"must be <= buffer ({common.buffer}): observation queries lie in the buffer",
                          obs_window)


def validate_obs_window(obs_window) -> None:
    if obs_window is not None and (not _is_int(obs_window) or obs_window < 1):
        raise field_error("obs_window", "must be an integer >= 1 or null (the whole buffer)", obs_window)


def validate_kernel(name: str, kernel) -> None:
    if not _is_int(kernel) or kernel < 1 or kernel % 2 == 0:
        raise field_error(name, "must be an odd integer >= 1", kernel)


def validate_number(name: str, value, lo: float, hi: float, hi_open: bool = False) -> None:
    """A parameter-record field that must be a real number in [lo, hi] (or [lo, hi)); raises naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(float(value))
    if not ok or not lo <= value <= hi or (hi_open and value >= hi):
        raise field_error(name, f"must be a number in [{lo:g}, {hi:g}{')' if hi_open else ']'}", value)


def threshold_budget(common) -> int:
    """Prefix slots a threshold event keeps (every event scores more than that many: T - w > N - w)."""
    return common.threshold_target - common.observation_window



__all__ = ["MAX_ELEMS", "layer_groups", "check_window", "check_threshold", "check_k", "check_budget", "check_kernel",
           "check_unit", "obs_window_len", "group_queries", "causal_probs", "pool1d", "finite_scores", "select_topk",
           "check_obs_window", "validate_obs_window", "validate_kernel", "validate_number", "threshold_budget"]
