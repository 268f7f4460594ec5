"""Run a function on N spawned ranks of a fresh tensor-parallel group and collect what each returns.

For tests and offline scripts (one-shot jobs, not the serving workers): every rank runs `fn(tp, *args)` in its
own spawned process (1 torch thread), results come back through files, and the whole job has a hard deadline.
A failing rank makes the others be killed at once (they would otherwise wait in a collective until the group
timeout); on any exit path no child is left running.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch

from engine.distributed.parallel_state import destroy_tensor_parallel, free_port, init_tensor_parallel


class RankFailed(RuntimeError):
    pass


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, backend: str, args: tuple, out_dir: str,
               group_timeout_s: float) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        tp = init_tensor_parallel(rank, world_size, port, backend=backend, timeout_s=group_timeout_s)
        result = fn(tp, *args)
        torch.save(result, out / f"rank{rank}.tmp")
        os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        destroy_tensor_parallel()
    # Skip the interpreter teardown (~1 s with torch loaded, on every rank): the result is on disk already.
    # multiprocessing's own exit hook still runs, so semaphores made in the child (tqdm's lock) are released.
    mp_util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 120.0, backend: str = "gloo",
              group_timeout_s: float = 60.0) -> list[Any]:
    """[fn(tp, *args) on rank r for r in range(world_size)]. `fn` must be importable by name (a module-level
    function) and its results picklable. Raises RankFailed with the failing rank's traceback, or TimeoutError
    after `timeout_s` seconds (the whole job, spawn included)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvllm-tp-") as out_dir:
        procs = [ctx.Process(target=_rank_main, name=f"kvllm-tp-rank{r}", daemon=True,
                             args=(fn, r, world_size, port, backend, args, out_dir, group_timeout_s))
                 for r in range(world_size)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.start()
            pending = {p.sentinel: p for p in procs}
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"tensor-parallel job {fn.__name__} on {world_size} ranks did not finish "
                                       f"within {timeout_s:.0f} s")
                for sentinel in wait(list(pending), timeout=left):
                    p = pending.pop(sentinel)
                    p.join()
                    if p.exitcode != 0:
                        rank = procs.index(p)
                        errs = {r: Path(out_dir, f"rank{r}.err") for r in range(world_size)}
                        detail = "\n".join(f"--- rank {r}:\n{e.read_text()}" for r, e in errs.items() if e.exists())
                        raise RankFailed(f"rank {rank} of {world_size} failed in {fn.__name__} (exit code "
                                         f"{p.exitcode})\n{detail}")
            return [torch.load(Path(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
        finally:
            _stop(procs)
