"""Per-step attention metadata (FlashInfer's CSR page-table form) and the backend interface.

Every sequence in a step contributes `q_len` new query tokens and sees `kv_len` cached slots *including*
the new ones. Causality is bottom-right aligned: query i of a sequence (0-based among its q_len tokens)
attends KV slots [0, kv_len - q_len + i]. KV slots are not token positions: after compression a
sequence's kv_len is smaller than its logical position, and RoPE is applied by the model before K is
written, so attention never needs positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from paging.kv_format import format_of


class QueryCapture:
    """Collects the post-RoPE queries of chosen tokens from every layer during a forward pass (the compression stage's
    `query_source="cache"`). Attention layers call `add(q)` in layer order."""

    def __init__(self, rows: torch.Tensor, num_layers: int):
        self.rows = rows  # [n] flat token indices of the step
        self.num_layers = num_layers
        self.out: torch.Tensor | None = None  # [L, n, Hq, D]
        self._layer = 0

    def add(self, q: torch.Tensor) -> None:
        if self.out is None:
            self.out = q.new_empty(self.num_layers, self.rows.numel(), *q.shape[1:])
        self.out[self._layer] = q.index_select(0, self.rows)
        self._layer += 1


@dataclass
class AttentionMetadata:
    block_size: int
    # CSR page table, int32, on the model device (what FlashInfer's plan() takes).
    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] physical block ids in logical order
    kv_last_page_len: torch.Tensor  # [B] valid slots in each sequence's last block, 1..block_size
    # Flat slot (block_id * block_size + offset) for each new token's K/V, int64 [T]; empty when nothing
    # is written (query recomputation).
    slot_mapping: torch.Tensor
    # Host copies used for planning and by the torch backend.
    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    capture: QueryCapture | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)


def build_metadata(
    block_tables: Sequence[Sequence[int]],
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    write: bool = True,
) -> AttentionMetadata:
    """Build the step metadata. The new tokens of sequence i occupy KV slots [kv_len - q_len, kv_len)."""
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    qo_indptr, kv_indptr, kv_indices, last_page_len, slots = [0], [0], [], [], []
    for table, q_len, kv_len in zip(block_tables, q_lens, kv_lens):
        if q_len < 1 or kv_len < q_len:
            raise ValueError(f"bad attention lengths: q_len={q_len}, kv_len={kv_len}")
        num_pages = (kv_len + block_size - 1) // block_size
        if num_pages > len(table):
            raise ValueError(f"block table holds {len(table)} blocks, {num_pages} needed for {kv_len} slots")
        kv_indices.extend(table[:num_pages])
        kv_indptr.append(len(kv_indices))
        qo_indptr.append(qo_indptr[-1] + q_len)
        last_page_len.append(kv_len - (num_pages - 1) * block_size)
        if write:
            for p in range(kv_len - q_len, kv_len):
                slots.append(table[p // block_size] * block_size + p % block_size)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    return AttentionMetadata(
        block_size=block_size,
        qo_indptr=i32(qo_indptr),
        kv_indptr=i32(kv_indptr),
        kv_indices=i32(kv_indices),
        kv_last_page_len=i32(last_page_len),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        q_lens=q_lens,
        kv_lens=kv_lens,
        block_tables=[list(t[: (k + block_size - 1) // block_size]) for t, k in zip(block_tables, kv_lens)],
    )


class AttentionBackend(Protocol):
    """One object per engine. `plan` is called once per step (all layers share the plan), then `forward`
    once per layer."""

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> None: ...  # kv_dtype: the pages' (None: dtype)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D], RoPE applied
        k: torch.Tensor | None,  # [T, Hkv, D], RoPE applied; None = do not write (query recomputation)
        v: torch.Tensor | None,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # this layer's pages [num_blocks, 2, block_size, Hkv, D] (NHD)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into the pages at their flat slots (one index_copy_ per K and V), quantized to the pages'
    format (paging/kv_format.py)."""
    num_blocks, _, block_size, h, w = kv_cache.shape
    fmt = format_of(kv_cache, k.shape[-1])
    rows = kv_cache.view(num_blocks * 2 * block_size, h, w)
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    k_rows = blocks * (2 * block_size) + (slot_mapping - blocks * block_size)
    k, v = fmt.quantize(k, keys=True), fmt.quantize(v)
    if fmt.is_8bit:  # as bytes: torch has no index_copy_ for float8 on the CPU
        rows, k, v = rows.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    rows.index_copy_(0, k_rows, k)
    rows.index_copy_(0, k_rows + block_size, v)
