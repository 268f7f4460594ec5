"""Shared helpers of the neighbouring compression methods (compression/rkv.py, ams.py, infokv.py, centroid.py,
baselines.py): input checks that name the offending parameter, layer grouping that bounds peak memory, GQA
reshapes, attention probabilities, pooling; and the one validator family (`check_int`, `check_number`), for
function arguments (ValueError naming ``<method>.<arg>``) and parameter records (ConfigError naming
``kv_compression.<field>``) alike.

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

from compression.config import field_error
from compression.primitives import MAX_ELEMS, finite_scores, is_int, layer_groups, topk_sorted


# ----------------------------------------------------------------------------- the validator family
def _fail(method: str | None, name: str, what: str, value) -> Exception:
    """A function argument (``method`` given) is a ValueError naming ``<method>.<name>``; a parameter-record field
    (method None) a ConfigError naming ``kv_compression.<name>``."""
    return field_error(name, what, value) if method is None else ValueError(f"{method}.{name} {what}, got {value!r}")


def check_int(name: str, value, lo: int, hi: int | None = None, *, odd: bool = False, none_ok: bool = False,
              method: str | None = None) -> None:
    """An integer (not a bool) in [lo, hi] (hi None: unbounded), odd if asked, or None when ``none_ok``."""
    if value is None and none_ok:
        return
    if not is_int(value) or value < lo or (hi is not None and value > hi) or (odd and value % 2 == 0):
        what = (f"an integer in [{lo}, {hi}]" if hi is not None else
                f"an odd integer >= {lo}" if odd else f"an integer >= {lo}")
        raise _fail(method, name, "must be " + what + (" or null" if none_ok else ""), value)


def check_number(name: str, value, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
                 method: str | None = None) -> float:
    """A real number (not a bool, not NaN) in [lo, hi], either end optionally open."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(float(value))
    if ok:
        v = float(value)
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        raise _fail(method, name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}",
                    value)
    return float(value)


def check_bool(name: str, value, method: str | None = None) -> None:
    if not isinstance(value, bool):
        raise _fail(method, name, "must be a boolean", value)


def check_window_inputs(queries: torch.Tensor, keys: torch.Tensor, num_region: int) -> None:
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries/keys must be [L, H, W, D], got {tuple(queries.shape)} and {tuple(keys.shape)}")
    L, hq, w, d = queries.shape
    lk, hkv, wk, dk = keys.shape
    if (L, w, d) != (lk, wk, dk):
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} disagree on L, W or D")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if not (0 < num_region <= w):
        raise ValueError(f"num_region must be in (0, {w}], got {num_region}")


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


def threshold_budget(common) -> int:
    """Prefix slots a threshold event keeps (every event scores more than that many: T - w > N - w)."""
    return common.threshold_target - common.observation_window



#: the common top-k, under the name the method modules use
select_topk = topk_sorted

__all__ = ["MAX_ELEMS", "layer_groups", "check_window_inputs", "check_window", "check_threshold", "check_int",
           "check_number", "check_bool", "obs_window_len",
           "group_queries", "causal_probs", "pool1d", "finite_scores", "select_topk", "check_obs_window",
           "threshold_budget"]
