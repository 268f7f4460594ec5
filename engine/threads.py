"""CPU threads for inference: set once, at process start, by the server / CLI / benchmarks.

    from engine.threads import configure_threads
    configure_threads()            # first thing in main(), before torch is imported: all cores, short spin
    configure_threads(1)           # one intra-op thread

Why. torch's CPU ops (and the GEMMs, and the C++ attention kernel, which runs on torch's own pool through
at::parallel_for) share one GNU OpenMP pool, and a decode step is ~150 short parallel regions. How an idle worker
waits for the next one decides what a second thread is worth:
- libgomp's default spins for milliseconds before sleeping: on a machine where anything else runs (the HTTP
  thread, the client, another process) a spinning worker takes the core the thread it waits for needs, and steps
  collapse (tests/conftest.py pins one thread for this reason).
- OMP_WAIT_POLICY=PASSIVE sleeps at once: never collapses, but every region then wakes the worker through the
  kernel, and on a VM that wake-up is slow enough to eat what the second thread brings.
- PASSIVE with GOMP_SPINCOUNT=DEFAULT_SPIN_COUNT (the default here) spins long enough to catch the next region of
  the same step, then sleeps (with more OpenMP threads than cores libgomp uses its shorter throttled spin
  instead). Beside a busy process it costs what passive waiting saves (docs/results/cpu_kernels.md, "Threads:
  OpenMP spin before sleep"). `kvllm serve` keeps it too: served with vLLM's client it ran ahead of passive waiting
  once the engine was built on the thread that steps it (libgomp keeps a pool per thread that opens parallel regions,
  and two pools on two cores meant the throttled spin: Engine.on_loop_thread, docs/benchmarks.md, "Engine loop
  thread"). `export GOMP_SPINCOUNT=0` restores pure passive waiting anywhere.

libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT only when it is loaded, i.e. at `import torch`: set later they do
nothing (checked with torch 2.13: the policy of a running process cannot be changed). So configure_threads()
sets the variables only if torch is not imported yet (it never overrides a value the user exported), and reports
what is in effect. The thread count (torch.set_num_threads) can be changed at any time. This module does not
import torch at import time (nor does `import engine`).
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

logger = logging.getLogger("kvllm.threads")

WAIT_POLICIES = ("passive", "active")
# Spins before a passive worker sleeps (GOMP_SPINCOUNT), each one PAUSE: enough to bridge the Python and small ops
# between two parallel regions of one step, short enough to give the core back soon after.
DEFAULT_SPIN_COUNT = 1500


@dataclass(frozen=True)
class ThreadSettings:
    num_threads: int  # torch intra-op threads now in use
    wait_policy: str | None  # OMP_WAIT_POLICY libgomp was started with (None: libgomp's default, spin then sleep)
    spin_count: int | None  # GOMP_SPINCOUNT libgomp was started with (None: the policy's own)


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
_spin_at_torch_import: str | None = None
_set_by_us = False


def _spin(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:  # libgomp also accepts "infinite" / "infinity"
        return None


def configure_threads(num_threads: int | None = None, wait_policy: str | None = "passive",
                      spin_count: int | None = DEFAULT_SPIN_COUNT) -> ThreadSettings:
    """Set torch's intra-op threads (None or 0: all available cores) and, if torch is not imported yet,
    OpenMP's wait policy ('passive', 'active', or None to leave libgomp's default) and, for 'passive', how many
    times an idle worker spins before it sleeps (spin_count; None: not at all). Values the user exported win.
    Returns what is in effect. Raises ValueError for a bad argument."""
    global _policy_at_torch_import, _spin_at_torch_import, _set_by_us
    if num_threads is not None and (not isinstance(num_threads, int) or isinstance(num_threads, bool)
                                    or num_threads < 0):
        raise ValueError(f"num_threads must be a non-negative integer (0 = all cores), got {num_threads!r}")
    if wait_policy is not None and wait_policy not in WAIT_POLICIES:
        raise ValueError(f"wait_policy must be one of {WAIT_POLICIES} or None, got {wait_policy!r}")
    if spin_count is not None and (not isinstance(spin_count, int) or isinstance(spin_count, bool)
                                   or spin_count < 0):
        raise ValueError(f"spin_count must be a non-negative integer or None, got {spin_count!r}")
    torch_loaded = "torch" in sys.modules
    if not torch_loaded:
        # An exported OMP_WAIT_POLICY or GOMP_SPINCOUNT is the user's choice of how to wait: add nothing to it.
        if wait_policy is not None and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
            os.environ["OMP_WAIT_POLICY"] = wait_policy.upper()
            if wait_policy == "passive" and spin_count is not None:
                os.environ["GOMP_SPINCOUNT"] = str(spin_count)
            _set_by_us = True
        _policy_at_torch_import = os.environ.get("OMP_WAIT_POLICY")
        _spin_at_torch_import = os.environ.get("GOMP_SPINCOUNT")
    elif not _set_by_us:
        initial = _initial_environ() or {}
        _policy_at_torch_import = initial.get("OMP_WAIT_POLICY")
        _spin_at_torch_import = initial.get("GOMP_SPINCOUNT")
        if wait_policy is not None and (_policy_at_torch_import or "").lower() != wait_policy:
            logger.warning("torch is already imported, so OMP_WAIT_POLICY=%s cannot take effect any more "
                           "(call configure_threads() before importing torch, or export OMP_WAIT_POLICY)",
                           wait_policy.upper())
    import torch

    n = num_threads or available_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    policy = _policy_at_torch_import.lower() if _policy_at_torch_import else None
    spin = _spin(_spin_at_torch_import)
    logger.info("CPU threads: %d intra-op, OpenMP wait policy %s%s", n, policy or "default (spin, then sleep)",
                f", spin {spin} before sleeping" if spin is not None else "")
    return ThreadSettings(num_threads=torch.get_num_threads(), wait_policy=policy, spin_count=spin)
