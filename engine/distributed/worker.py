"""A tensor-parallel worker (ranks 1..N-1): a spawned process that holds its model shard and KV shard and runs
what rank 0 sends (engine/distributed/protocol.py), nothing else: no scheduler, no block pool, no sampling.

Between messages a worker remembers, per sequence of rank 0, only what rank 0 cannot cheaply resend: the token
ids it has run (a query recomputation reads them) and the sequence's compression state with its tensors (the
query cache, the generator of randomised methods), built from the same config with the same code as on rank 0.
Block tables and KV lengths always come from rank 0's message. A compression round runs rank 0's
`CompressionStage` code on this rank's KV heads; the compactions it makes are logged and checked against rank 0's
at the next message, so a rank that diverged stops with an error instead of serving wrong KV.

The worker exits when rank 0 says so, when its parent process is gone, or on any error (after writing the
traceback where rank 0 reads it).
"""
from __future__ import annotations

import collections
import multiprocessing.util as mp_util
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from compression.stage import CompressionStage
from compression.state import CompressionState
from engine.attention import get_backend
from engine.distributed import protocol as P
from engine.distributed.comm import broadcast_object
from engine.distributed.kv import local_kv_heads
from engine.distributed.parallel_state import TPGroup, destroy_tensor_parallel, init_tensor_parallel
from engine.loader import load_shard
from engine.model_runner import ModelRunner
from engine.models.backends import pick_layer_ops
from paging.compaction import blocks_to_free
from paging.kv_cache import KVCache
from paging.kv_cache_manager import KVCacheManager

#: Control messages can be far apart (an idle server): the control group never times out; a dead peer still
#: fails it at once (its socket closes), and a worker whose parent is gone exits by itself.
CONTROL_TIMEOUT = timedelta(days=3650)


class RankDivergedError(RuntimeError):
    pass


@dataclass(eq=False)
class _SeqView:
    """One of rank 0's sequences as a round on this rank sees it: rank 0's block table and lengths, this rank's
    tokens and compression state. Built afresh for every round (only rank 0's KV manager owns the real ones)."""
    seq_id: int
    request_id: str
    num_computed_tokens: int
    kv_len: int
    block_table: list[int]
    compression: Any
    tokens: list[int]
    scoring: Any = None

    def token_slice(self, start: int, n: int) -> list[int]:
        ids = self.tokens[start:start + n]
        if len(ids) != n or -1 in ids:
            raise RankDivergedError(f"sequence {self.request_id}: tokens [{start}, {start + n}) never ran on this rank")
        return ids

    @property
    def num_pending_tokens(self) -> int:
        return 0


@dataclass(eq=False)
class _Mirror:
    request_id: str
    compression: Any
    tokens: list[int]

    def write(self, start: int, ids: list[int]) -> None:
        """Tokens [start, start + len(ids)) ran; anything after them is no longer in the cache."""
        if len(self.tokens) < start:  # a prefix-cache hit: the first tokens ran for another sequence
            self.tokens.extend([-1] * (start - len(self.tokens)))
        del self.tokens[start:]
        self.tokens.extend(ids)


class _ShardKV:
    """The KV manager a round sees on a worker: key gathers and compaction data movement on this rank's shard.
    Nothing is freed here (rank 0's pool does it); the blocks rank 0 will free are logged for the check."""

    def __init__(self, manager, log: list) -> None:
        self.manager = manager
        self.block_size = manager.block_size
        self.log = log

    def gather_keys(self, seq, start: int, length: int) -> torch.Tensor:
        return self.manager.gather_keys(seq, start, length)

    def compact(self, jobs) -> list[int]:
        new_lens = self.manager.compact_data(jobs)
        freed = []
        for job, new_len in zip(jobs, new_lens):
            blocks = blocks_to_free(job.seq.block_table, new_len, self.block_size)
            self.log.append((job.seq.seq_id, new_len, blocks))
            freed.append(len(blocks))
        return freed


class Worker:
    def __init__(self, tp: TPGroup, control: TPGroup, device: torch.device) -> None:
        self.tp, self.control, self.device = tp, control, device
        self.model = self.config = self.dtype = self.runner = self.kv = self.stage = None
        self.mirrors: dict[int, _Mirror] = {}
        self.pending_checks: list = []  # this rank's compactions since the last message
        self.history: collections.deque = collections.deque(maxlen=4096)  # (seq id, new len, freed) for Inspect
        self.checked = 0  # compactions checked against rank 0's

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            sync, op = broadcast_object(None, self.control)
            if isinstance(op, P.Shutdown):
                return
            handler = {P.Step: self._step, P.Round: self._round, P.Init: self._init, P.Allocate: self._allocate,
                       P.Inspect: self._inspect}[type(op)]
            with torch.inference_mode():  # the KV shard is allocated (and always written) in inference mode
                self._apply(sync)
                handler(op)

    def _gather(self, obj: Any) -> None:
        dist.gather_object(obj, None, dst=0, group=self.control.cpu_group)

    def _apply(self, sync: P.Sync) -> None:
        if [tuple(c) for c in sync.compactions] != [tuple(c) for c in self.pending_checks]:
            raise RankDivergedError(f"rank {self.tp.rank} compacted {self.pending_checks} where rank 0 compacted "
                                    f"{sync.compactions}")
        self.checked += len(self.pending_checks)
        self.pending_checks.clear()
        for sid in sync.dropped:
            self.mirrors.pop(sid, None)
        for new in sync.new:
            self.mirrors[new.seq_id] = _Mirror(new.request_id, self._compression_state(new.compression), [])
        for kind, src, dst in sync.copies:
            self._copy(kind, src, dst)

    def _compression_state(self, spec: dict | None):
        if spec is None:
            return None
        return CompressionState.from_spec(spec)

    def _copy(self, kind: str, src: list[int], dst: list[int]) -> None:
        """Swap preemption's data movement, as rank 0's KVCacheManager.swap_out / swap_in make it."""
        data, host = self.kv.manager.kv_cache.data, self.kv.manager.host
        if kind == "out":
            host[:, torch.tensor(dst)] = data[:, torch.tensor(src, device=data.device)].to(
                "cpu", non_blocking=host.is_pinned())
            if host.is_pinned():
                torch.cuda.current_stream(data.device).synchronize()
        else:
            data[:, torch.tensor(dst, device=data.device)] = host[:, torch.tensor(src)].to(data.device,
                                                                                          non_blocking=True)

    # -- start-up -----------------------------------------------------------------------------------------
    def _init(self, op: P.Init) -> None:
        try:
            self.config, self.dtype = op.config, op.dtype
            self.model = load_shard(op.source, op.dtype, self.device, self.tp)
            self.model.set_layer_ops(pick_layer_ops(op.config.layer_ops, self.model))
            self.model_config = op.source.config
            capacity = op.config.resolve_num_blocks(self.model_config, self._kv_format(), self.device,
                                                    local_kv_heads(self.model_config, self.tp))
            reply = (None, capacity)
        except Exception:
            reply = (traceback.format_exc(), 0)
        self._gather(reply)
        if reply[0] is not None:
            raise RuntimeError(f"rank {self.tp.rank} could not load its shard")

    def _kv_format(self):
        return self.config.resolve_kv_cache_dtype(self.dtype, self.device)

    def _allocate(self, op: P.Allocate) -> None:
        try:
            c = self.model_config
            cache = KVCache(c.num_layers, op.num_blocks, self.config.block_size, self.model.num_local_kv_heads,
                            c.head_dim, self._kv_format(), self.device)
            attn = get_backend(self.config.attention_backend, self.device)
            self.runner = ModelRunner(self.model, c, cache, attn, self.device, self.dtype)
            # scorers read keys in the model dtype on every rank, as on rank 0 (engine/core.py)
            self.kv = _ShardKV(KVCacheManager(cache, enable_prefix_caching=False, host_blocks=op.host_blocks,
                                              compute_dtype=self.dtype), self.pending_checks)
            self.stage = CompressionStage(None, self.device.type)
            reply = None
        except Exception:
            reply = traceback.format_exc()
        self._gather(reply)
        if reply is not None:
            raise RuntimeError(f"rank {self.tp.rank} could not allocate its KV cache")

    # -- steps and rounds ---------------------------------------------------------------------------------
    def _mirror(self, sid: int) -> _Mirror:
        m = self.mirrors.get(sid)
        if m is None:
            raise RankDivergedError(f"rank {self.tp.rank} never heard of sequence {sid}")
        return m

    def _step(self, op: P.Step) -> None:
        plan = op.plan
        row = 0
        for sid, start, n in zip(plan.seq_ids, plan.starts, plan.q_lens):
            self._mirror(sid).write(start, plan.input_ids[row:row + n])
            row += n
        out = self.runner.forward(plan)
        for (i, first, _), q in zip(plan.capture_spans, out.captured, strict=True):
            self.mirrors[plan.seq_ids[i]].compression.store_queries(first, q)

    def _round(self, op: P.Round) -> None:
        views = []
        for rs in op.seqs:
            m = self._mirror(rs.seq_id)
            m.compression.set_frontier(rs.state)
            views.append(_SeqView(rs.seq_id, m.request_id, rs.num_computed_tokens, rs.kv_len, list(rs.block_table),
                                  m.compression, m.tokens))
        start = len(self.pending_checks)
        if op.kind == "window":
            self.stage.run_window_round(views, self.kv, self.runner.recompute_queries)
        else:
            self.stage.run_threshold(views, self.kv, self.runner.recompute_queries)
        self.history.extend(self.pending_checks[start:])

    def _inspect(self, op: P.Inspect) -> None:
        from dataclasses import asdict

        s = self.stage.stats if self.stage is not None else None
        self._gather({
            "rank": self.tp.rank, "pid": os.getpid(), "heads": (self.model.num_local_q_heads,
                                                               self.model.num_local_kv_heads),
            "num_blocks": None if self.kv is None else self.kv.manager.kv_cache.num_blocks,
            "compactions": list(self.history), "checked": self.checked,
            "stage": None if s is None else asdict(s), "sequences": sorted(self.mirrors),
            "threads": torch.get_num_threads(),
        })


def _parent_gone(parent_pid: int, wait_s: float = 0.0) -> bool:
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (killed, crashed): nothing would ever tell this worker to stop."""
    def watch() -> None:
        while not _parent_gone(parent_pid):
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="kvllm-tp-parent-watch", daemon=True).start()


def worker_main(rank: int, size: int, port: int, backend: str, device: str, threads: int, group_timeout_s: float,
                parent_pid: int, error_path: str) -> None:
    """Entry point of a spawned worker process."""
    # Ctrl-C, `timeout` and systemd signal the whole process group: rank 0 decides when its workers stop (it tells
    # them, or kills them), and a worker whose parent is gone exits by itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    _watch_parent(parent_pid)
    code, text = 0, ""
    try:
        dev = torch.device(device)
        tp = init_tensor_parallel(rank, size, port, backend=backend, device=dev if dev.type == "cuda" else None,
                                  timeout_s=group_timeout_s)
        control = replace(tp, cpu_group=dist.new_group(list(range(size)), backend="gloo", timeout=CONTROL_TIMEOUT))
        Worker(tp, control, dev).run()
    except BaseException:
        text = traceback.format_exc()
        # rank 0's process ended (its sockets closed first, then it is gone): nothing to report
        code = 3 if _parent_gone(parent_pid, wait_s=1.0) else 1
    if code == 1:
        try:
            with open(error_path, "w") as f:
                f.write(text)
        except OSError:
            pass
        print(f"kvllm tensor-parallel worker rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
    try:
        destroy_tensor_parallel()
    except Exception:
        pass
    # skip the interpreter teardown (seconds with torch loaded); multiprocessing's exit hook still runs
    mp_util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
