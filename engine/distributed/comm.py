"""The few collectives tensor parallelism needs. Each is a no-op (no torch.distributed call at all) when the
group has one rank, so tp=1 code paths never touch torch.distributed."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engine.distributed.parallel_state import TPGroup


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """In-place SUM over the device group; returns x."""
    if tp.size == 1:
        return x
    dist.all_reduce(x, group=tp.device_group)
    return x


def gather_to_driver(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's `x` (same shape on all ranks) along `dim` on rank 0; other ranks get None."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(x, parts, dst=0, group=tp.device_group)
    return torch.cat(parts, dim=dim) if tp.rank == 0 else None


def all_gather(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on all ranks) along `dim` on every rank."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.device_group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any, tp: TPGroup, src: int = 0) -> Any:
    """Rank `src`'s picklable `obj` on every rank, over the CPU (gloo) control group."""
    if tp.size == 1:
        return obj
    box = [obj if tp.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=tp.cpu_group)
    return box[0]


def all_reduce_min_int(value: int, tp: TPGroup) -> int:
    """The minimum of an integer over all ranks (CPU group)."""
    if tp.size == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())
