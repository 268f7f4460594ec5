"""Rank 0 of a tensor-parallel engine: starts the workers, drives them, watches them, stops them.

Rank 0 is the engine process itself: it keeps the thread front, the scheduler, the KV block pool and tables, the
compression policy and sampling, and runs model shard 0 on KV shard 0. Ranks 1..N-1 are spawned processes
(engine/distributed/worker.py) that run what rank 0 sends over a gloo control group (the messages are in
engine/distributed/protocol.py), so the ranks stay in step with no scheduler of their own: the central-scheduler
design of nano-vllm and vLLM. Tensors (the all-reduces inside the model, the logits gathered to rank 0) use the
device group: nccl on CUDA, gloo on CPU.

Three hooks connect it to the single-process engine, which otherwise does not change:
- `ModelRunner(on_plan=...)`: each step's `ForwardPlan` goes to the workers before rank 0 runs it;
- `CompressionStage(round_hook=...)`: each compression round goes to the workers before rank 0 runs it (every rank runs
  the same stage code on its own KV heads; the kept count is uniform per (layer, KV head), so the new KV lengths,
  and so the block tables, are the same on every rank and only rank 0's pool frees blocks);
- `DriverKVCacheManager`: rank 0's KV manager, which also records the block copies of swap preemption and the
  result of every compaction for the workers (they copy the same blocks and check their compactions against it).

A monitor thread waits on the workers' process sentinels: a worker that dies makes the engine unhealthy at once
(`Engine.is_healthy`, `/health` 503) and the other workers are stopped, so a collective rank 0 may be waiting in
fails at once instead of waiting for the group timeout; pending requests then fail with `WorkerDiedError`.
"""
from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist

from compression.config import coerce
from engine.distributed import protocol as P
from engine.distributed.comm import broadcast_object
from engine.distributed.layers import head_partition
from engine.distributed.parallel_state import destroy_tensor_parallel, free_port, init_tensor_parallel
from engine.distributed.worker import CONTROL_TIMEOUT, worker_main
from engine.errors import EngineDeadError
from engine.loader import check_tensor_parallel, load_model_for_tp
from paging.kv_cache_manager import KVCacheManager

logger = logging.getLogger("kvllm")

#: Bounds the rendezvous and every tensor collective: ranks run the same work between collectives, so a rank
#: that is this late is hung (a dead one fails the collective at once).
GROUP_TIMEOUT_S = 300.0


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker process died; the engine cannot serve any more."""


class DriverKVCacheManager(KVCacheManager):
    """Rank 0's KV manager under tensor parallelism: the same books, plus a record of what the workers must
    repeat or check on their KV shards: swap copies (in order) and the result of each compaction."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.copies: list[tuple[str, list[int], list[int]]] = []
        self.compactions: list[tuple[int, int, list[int]]] = []

    def swap_out(self, seq) -> int:
        table = list(seq.block_table)
        moved = super().swap_out(seq)
        self.copies.append(("out", table, list(seq.host_block_table)))
        return moved

    def swap_in(self, seq) -> int:
        host = list(seq.host_block_table)
        moved = super().swap_in(seq)
        self.copies.append(("in", host, list(seq.block_table)))
        return moved

    def compact(self, jobs) -> list[int]:
        before = [list(job.seq.block_table) for job in jobs]
        freed = super().compact(jobs)
        for job, table, n in zip(jobs, before, freed):
            self.compactions.append((job.seq.seq_id, job.seq.kv_len, table[len(table) - n:] if n else []))
        return freed


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill_at_exit(ref: "weakref.ReferenceType[TPDriver]", procs: list) -> None:
    """At interpreter exit, before multiprocessing's own exit hook (which would wait forever for workers that ignore
    its SIGTERM): kill the workers of an engine nobody shut down. Holds the processes, not the engine."""
    driver = ref()
    if driver is not None:
        driver._closing = True  # expected deaths: the monitor stays quiet
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(10)


class TPDriver:
    def __init__(self, size: int, device: torch.device, group_timeout_s: float = GROUP_TIMEOUT_S) -> None:
        if size < 2:
            raise ValueError(f"a tensor-parallel driver needs tensor_parallel_size >= 2, got {size}")
        self.size = size
        self.group_timeout_s = group_timeout_s
        if device.type == "cuda":
            base = device.index or 0
            if torch.cuda.device_count() < base + size:
                raise ValueError(f"tensor_parallel_size={size} needs GPUs cuda:{base}..cuda:{base + size - 1}; "
                                 f"{torch.cuda.device_count()} visible")
            self.devices = [torch.device("cuda", base + r) for r in range(size)]
            self.backend = "nccl"
            self.threads = torch.get_num_threads()
        else:
            self.devices = [torch.device("cpu")] * size
            self.backend = "gloo"
            # one host's cores are shared by the ranks; more threads than cores make OpenMP spin-wait
            self.threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // size))
            torch.set_num_threads(self.threads)
        self.device = self.devices[0]
        self.procs: list[Any] = []
        self.tp = self.control = None
        self.kv: DriverKVCacheManager | None = None
        self.replicated = False
        self._known: set[int] = set()  # sequences the workers hold a mirror of
        self._dropped: collections.deque[int] = collections.deque()  # filled by finalizers (any thread)
        self._err_dir = tempfile.mkdtemp(prefix="kvllm-tp-")
        self._failure: WorkerDiedError | None = None
        self._closing = self._closed = False
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._heads = None
        # registered after multiprocessing's exit hook, so it runs before it
        atexit.register(_kill_at_exit, weakref.ref(self), self.procs)

    # -- start-up -----------------------------------------------------------------------------------------
    def start(self, config, dtype: torch.dtype):
        """Spawn the workers, join the group, load every shard, agree on the block count and allocate every KV
        shard. Returns (rank 0's model, model config, tokenizer, num_blocks, host_blocks)."""
        model_source = config.model_source().resolve()  # Hub ids: fetched once, here
        early = check_tensor_parallel(model_source, self.size)
        if early is not None:  # reject an impossible compression default before any worker starts
            self._set_heads(early, *head_partition(early.num_q_heads, early.num_kv_heads, self.size))
            self.check_compression(coerce(config.kv_compression))
        self._spawn()
        model, model_config, tokenizer, source = load_model_for_tp(model_source, dtype, self.device, self.tp)
        try:
            self.send(P.Init(source, replace(config, kv_compression=None), dtype))
            replies = self._gather(None)[1:]
        finally:
            if source.export_dir is not None:  # every rank has read it (or failed)
                shutil.rmtree(source.export_dir, ignore_errors=True)
        self._raise_startup_errors([err for err, _ in replies], "load its model shard")
        self._set_heads(model_config, model.num_local_q_heads, model.num_local_kv_heads)
        c = model_config
        fmt = config.resolve_kv_cache_dtype(dtype, self.device)  # every rank stores its heads in this format
        capacity = config.resolve_num_blocks(c, fmt, self.device, model.num_local_kv_heads)
        # one block id must mean the same slots on every rank: all use the smallest capacity (vLLM, mini-sglang)
        num_blocks = min([capacity] + [n for _, n in replies])
        host_blocks = config.host_blocks(c, fmt, model.num_local_kv_heads)
        self.send(P.Allocate(num_blocks, host_blocks))
        self._raise_startup_errors(self._gather(None)[1:], "allocate its KV cache")
        return model, model_config, tokenizer, num_blocks, host_blocks

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        for r in range(1, self.size):
            p = ctx.Process(target=worker_main, name=f"kvllm-tp-rank{r}", daemon=True,
                            args=(r, self.size, port, self.backend, str(self.devices[r]), self.threads,
                                  self.group_timeout_s, os.getpid(), self._error_path(r)))
            p.start()
            self.procs.append(p)
        box: dict[str, Any] = {}

        def rendezvous() -> None:
            try:
                tp = init_tensor_parallel(0, self.size, port, backend=self.backend,
                                          device=self.device if self.backend == "nccl" else None,
                                          timeout_s=self.group_timeout_s)
                box["control"] = replace(tp, cpu_group=dist.new_group(list(range(self.size)), backend="gloo",
                                                                      timeout=CONTROL_TIMEOUT))
                box["tp"] = tp
            except BaseException as err:
                box["error"] = err

        # the rendezvous runs beside a watch on the workers: one that dies while starting fails start-up now
        t = threading.Thread(target=rendezvous, name="kvllm-tp-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            dead = self.failure()
            if dead is not None and t.is_alive():
                self._kill()
                raise dead
        if "error" in box:
            self._kill()
            raise RuntimeError(f"tensor-parallel rendezvous of {self.size} ranks on 127.0.0.1:{port} failed: "
                               f"{box['error']}") from box["error"]
        self.tp, self.control = box["tp"], box["control"]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _raise_startup_errors(self, errors: list, what: str) -> None:
        for rank, err in enumerate(errors, start=1):
            if err is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} could not {what}:\n{err}")

    def attach(self, kv: DriverKVCacheManager) -> None:
        """The engine's KV manager, whose block copies and compactions each message carries to the workers (the
        model runner and the compression stage were built with `on_plan` and `on_round`)."""
        self.kv = kv

    # -- messages -----------------------------------------------------------------------------------------
    def _announce(self, seq) -> P.NewSequence:
        self._known.add(seq.seq_id)
        weakref.finalize(seq, self._dropped.append, seq.seq_id)  # the worker forgets it when rank 0 does
        spec = None if seq.compression is None else seq.compression.spec()
        return P.NewSequence(seq.seq_id, seq.request_id, spec)

    def send(self, op: Any, seqs=()) -> None:
        """Send one op to every worker (rank 0's thread that runs the engine step is the only sender)."""
        sync = P.Sync(new=[self._announce(s) for s in seqs if s.seq_id not in self._known])
        while self._dropped:
            sid = self._dropped.popleft()
            self._known.discard(sid)
            sync.dropped.append(sid)
        if self.kv is not None:
            sync.copies, self.kv.copies = self.kv.copies, []
            sync.compactions, self.kv.compactions = self.kv.compactions, []
        broadcast_object((sync, op), self.control)

    def _gather(self, obj: Any) -> list:
        out = [None] * self.size
        dist.gather_object(obj, out, dst=0, group=self.control.cpu_group)
        return out

    def on_plan(self, plan, seqs) -> None:
        self.send(P.Step(plan), seqs)

    def on_round(self, kind: str, seqs) -> None:
        snaps = [P.RoundSequence(s.seq_id, s.num_computed_tokens, s.kv_len, list(s.block_table),
                                 s.compression.frontier()) for s in seqs]
        self.send(P.Round(kind, snaps), seqs)

    def inspect(self) -> list[dict]:
        """Each worker's snapshot (ranks 1..N-1): its compactions, how many were checked against rank 0's, its
        stage counters, the sequences it mirrors. Call it between steps, from the thread that steps."""
        self.send(P.Inspect())
        return self._gather(None)[1:]

    # -- compression under tensor parallelism ---------------------------------------------------------------
    def _set_heads(self, config, local_q: int, local_kv: int) -> None:
        self._heads = (local_q, config.num_q_heads, local_kv, config.num_kv_heads)
        self.replicated = local_kv * self.size != config.num_kv_heads

    def check_compression(self, cfg) -> None:
        """Replicated KV heads (tensor_parallel_size > num_kv_heads) leave each rank only part of a KV head's
        query heads, so a method that scores keys with the queries would keep different tokens on the ranks that
        replicate one head. Query-free methods (random, streaming, ...) select the same tokens on every replica."""
        if cfg is None or not cfg.enabled:
            return
        if getattr(cfg, "lossless", False):  # its full-KV host tier and verification forwards have no messages yet
            err = ValueError(f"kv_compression.lossless is not supported with tensor_parallel_size={self.size} "
                             f"(> 1) yet")
            err.param = "kv_compression.lossless"
            raise err
        if cfg.make_compressor().needs_entropy:  # recorded by rank 0's sampler; workers have no copy of it yet
            err = ValueError(f"kv_compression method {cfg.method!r} reads sampling entropies, which are not sent "
                             f"to tensor-parallel workers yet (tensor_parallel_size={self.size})")
            err.param = "kv_compression.method"
            raise err
        if not self.replicated:
            return
        if cfg.make_compressor().needs_queries:
            hq, Hq, hkv, Hkv = self._heads
            raise ValueError(f"kv_compression method {cfg.method!r} scores each KV head with its query heads, but "
                             f"tensor_parallel_size={self.size} > num_kv_heads={Hkv} replicates the KV heads and "
                             f"splits their query heads across ranks; use a tensor_parallel_size that divides "
                             f"num_kv_heads ({Hkv}) or a method that does not read queries")

    def log_lines(self) -> list[str]:
        hq, Hq, hkv, Hkv = self._heads
        devices = ", ".join(map(str, dict.fromkeys(self.devices)))
        return [f"Tensor parallel: {self.size} ranks ({self.backend}: {devices}), {hq}/{Hq} query heads and "
                f"{hkv}/{Hkv} KV heads per rank"
                + (" (KV heads replicated)" if self.replicated else "")
                + f", {self.threads} torch thread(s) per rank; worker pids "
                + ", ".join(str(p.pid) for p in self.procs)]

    # -- health -------------------------------------------------------------------------------------------
    def _error_path(self, rank: int) -> str:
        return os.path.join(self._err_dir, f"rank{rank}.err")

    def _died(self, rank: int, proc) -> WorkerDiedError:
        detail = ""
        try:
            with open(self._error_path(rank)) as f:
                lines = [ln for ln in f.read().strip().splitlines() if ln.strip()]
            if lines:
                detail = f": {lines[-1].strip()}"
        except OSError:
            pass
        return WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died "
                               f"({_describe_exit(proc.exitcode)}){detail}")

    def failure(self, wait_s: float = 0.0) -> WorkerDiedError | None:
        """The first worker found dead (waiting up to `wait_s` for one to exit), or None."""
        if self._failure is not None:
            return self._failure
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self._closing:
                    self._failure = self._died(rank, p)
                    return self._failure
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def start_monitor(self, on_death: Callable[[WorkerDiedError], None]) -> None:
        """Call `on_death` (from a monitor thread) as soon as a worker process exits unasked."""
        def monitor() -> None:
            sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
            ready = wait(list(sentinels) + [self._wake_r])
            if self._closing:
                return
            rank, proc = next(sentinels[s] for s in ready if s in sentinels)
            proc.join(1)
            if self._failure is None:
                self._failure = self._died(rank, proc)
            logger.error("%s; stopping the other ranks", self._failure)
            self._kill()  # a collective rank 0 waits in fails now, not at the group timeout
            on_death(self._failure)

        self._monitor = threading.Thread(target=monitor, name="kvllm-tp-monitor", daemon=True)
        self._monitor.start()

    def stop_after_error(self, err: BaseException) -> EngineDeadError:
        """Rank 0 failed inside a step: the ranks are out of step for good. Returns the error to report (the dead
        worker's, if one died) and stops the workers."""
        failure = self.failure(wait_s=2.0)
        self._closing = True
        self._kill()
        return failure or EngineDeadError(f"tensor-parallel step failed on rank 0: {err!r}")

    # -- shutdown -----------------------------------------------------------------------------------------
    def _kill(self) -> None:
        for p in self.procs:  # workers ignore SIGTERM (see worker_main) and hold nothing to save
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join(10)

    def shutdown(self, graceful: bool = True, destroy: bool = True) -> None:
        """Stop the workers (idempotent). `graceful`: tell them first, which only the thread that steps may do
        when no step runs; otherwise they are terminated. `destroy`: tear down this process's groups (once no
        thread can be inside a collective), so a later engine can form a new group."""
        if self._closed:
            return
        was_closing, self._closing = self._closing, True
        try:
            self._wake_w.send(None)
        except OSError:
            pass
        alive = all(p.exitcode is None for p in self.procs)
        logger.info("stopping %d tensor-parallel worker(s)%s", len(self.procs),
                    "" if graceful and alive else " (terminating them)")
        if graceful and not was_closing and alive and self.control is not None:
            try:
                broadcast_object((P.Sync(), P.Shutdown()), self.control)
            except Exception:  # a worker died meanwhile
                logger.debug("could not tell the tensor-parallel workers to stop", exc_info=True)
            deadline = time.monotonic() + 10
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        if destroy and self.tp is not None:
            destroy_tensor_parallel()
        shutil.rmtree(self._err_dir, ignore_errors=True)
        self._closed = True
