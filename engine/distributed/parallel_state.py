"""Tensor-parallel process groups: one TPGroup per process, passed explicitly to the parallel layers.

Every rank gets two communicators over the same ranks (the split vLLM's GroupCoordinator and mini-sglang
make): `device_group` carries tensors (nccl on CUDA, gloo on CPU) and `cpu_group`, always gloo, carries
control messages (the per-step plan, block counts) so they never queue behind, or interleave with, tensor
collectives on the accelerator stream.

Single node only: the store and gloo's sockets listen on 127.0.0.1.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group. size == 1 (NO_TP) means no process group and no
    collective call anywhere: the layers then compute exactly the unsharded math."""

    rank: int = 0
    size: int = 1
    device_group: Any = None  # torch ProcessGroup for tensor collectives (None when size == 1)
    cpu_group: Any = None  # gloo ProcessGroup for control messages (None when size == 1)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank must be in [0, {self.size}), got {self.rank!r}")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler, the block pool and sampling; it receives the gathered logits."""
        return self.rank == 0


NO_TP = TPGroup()
_current: TPGroup = NO_TP


def get_tp_group() -> TPGroup:
    """The group set up by init_tensor_parallel in this process (NO_TP before, or after destroy)."""
    return _current


def get_tp_rank() -> int:
    return _current.rank


def get_tp_size() -> int:
    return _current.size


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; the store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def init_tensor_parallel(rank: int, world_size: int, port: int | None = None, backend: str = "gloo",
                         device: torch.device | str | None = None, timeout_s: float = 60.0,
                         init_method: str | None = None) -> TPGroup:
    """Join a `world_size`-rank group on 127.0.0.1:`port` (rank 0 hosts the store) and return its TPGroup.

    backend "gloo" (CPU tensors) or "nccl" (CUDA; `device` is this rank's GPU). `timeout_s` bounds the
    rendezvous and every collective, so a dead peer raises instead of hanging forever. world_size == 1
    returns NO_TP without creating any group."""
    global _current
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"tensor parallel backend must be 'gloo' or 'nccl', got {backend!r}")
    if world_size == 1:
        _current = NO_TP
        return NO_TP
    if _current.is_parallel or dist.is_initialized():
        raise RuntimeError("a tensor-parallel group is already initialized in this process")
    if init_method is None:
        if port is None:
            raise ValueError("init_tensor_parallel needs a port (see free_port) or an init_method")
        init_method = f"tcp://127.0.0.1:{port}"
    # gloo picks its interface from the hostname; pin it to loopback (single node, never an external NIC)
    lo = _loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    timeout = timedelta(seconds=timeout_s)
    kwargs = {}
    if backend == "nccl":
        dev = torch.device(device if device is not None else f"cuda:{rank}")
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout,
                            **kwargs)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    _current = TPGroup(rank, world_size, device_group, cpu_group)
    return _current


def destroy_tensor_parallel() -> None:
    """Tear down this process's groups (idempotent)."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = NO_TP
