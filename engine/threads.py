"""CPU threads for inference: set once, at process start, by the server / CLI / benchmarks.

    from engine.threads import configure_threads
    configure_threads()            # first thing in main(), before torch is imported: all cores, passive waiting
    configure_threads(1)           # one intra-op thread

Why. torch's CPU ops (and MKL's GEMMs, and the C++ attention kernel, which runs on torch's own pool through
at::parallel_for) share one GNU OpenMP pool. By default its idle threads spin for a while before sleeping, so
on a 2-core machine where anything else runs (the engine thread beside an HTTP thread, another process), a
spinning worker takes the core the thread it waits for needs, and small ops collapse (tests/conftest.py pins one
thread for this reason). OMP_WAIT_POLICY=PASSIVE makes idle threads sleep at once.

libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT only when it is loaded, i.e. at `import torch`: set later they do
nothing (checked with torch 2.13: the policy of a running process cannot be changed). So configure_threads()
sets the variable only if torch is not imported yet (it never overrides a value the user exported), and reports
whether the policy is in effect. The thread count (torch.set_num_threads) can be changed at any time. This module
does not import torch at import time (nor does `import engine`).
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

logger = logging.getLogger("kvllm.threads")

WAIT_POLICIES = ("passive", "active")


@dataclass(frozen=True)
class ThreadSettings:
    num_threads: int  # torch intra-op threads now in use
    wait_policy: str | None  # OMP_WAIT_POLICY libgomp was started with (None: libgomp's default, spin then sleep)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _initial_environ() -> dict[str, str] | None:
    """The environment the process started with (Linux), to tell what libgomp saw at its start."""
    try:
        with open("/proc/self/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    env = {}
    for item in items:
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


_policy_at_torch_import: str | None = None
_set_by_us = False


def configure_threads(num_threads: int | None = None, wait_policy: str | None = "passive") -> ThreadSettings:
    """Set torch's intra-op threads (None or 0: all available cores) and, if torch is not imported yet,
    OpenMP's wait policy ('passive', 'active', or None to leave libgomp's default). Returns what is in effect.
    Raises ValueError for a bad argument."""
    global _policy_at_torch_import, _set_by_us
    if num_threads is not None and (not isinstance(num_threads, int) or isinstance(num_threads, bool)
                                    or num_threads < 0):
        raise ValueError(f"num_threads must be a non-negative integer (0 = all cores), got {num_threads!r}")
    if wait_policy is not None and wait_policy not in WAIT_POLICIES:
        raise ValueError(f"wait_policy must be one of {WAIT_POLICIES} or None, got {wait_policy!r}")
    torch_loaded = "torch" in sys.modules
    if not torch_loaded:
        if wait_policy is not None and "OMP_WAIT_POLICY" not in os.environ:
            os.environ["OMP_WAIT_POLICY"] = wait_policy.upper()
            _set_by_us = True
        _policy_at_torch_import = os.environ.get("OMP_WAIT_POLICY")
    elif not _set_by_us:
        initial = _initial_environ()
        _policy_at_torch_import = (initial or {}).get("OMP_WAIT_POLICY")
        if wait_policy is not None and (_policy_at_torch_import or "").lower() != wait_policy:
            logger.warning("torch is already imported, so OMP_WAIT_POLICY=%s cannot take effect any more "
                           "(call configure_threads() before importing torch, or export OMP_WAIT_POLICY)",
                           wait_policy.upper())
    import torch

    n = num_threads or available_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    policy = _policy_at_torch_import.lower() if _policy_at_torch_import else None
    logger.info("CPU threads: %d intra-op, OpenMP wait policy %s", n, policy or "default (spin, then sleep)")
    return ThreadSettings(num_threads=torch.get_num_threads(), wait_policy=policy)
