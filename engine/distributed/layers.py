"""Megatron-style tensor-parallel layers (Shoeybi et al., arXiv 1909.08053), as nano-vllm and vLLM use them.

- Column-parallel linear: the output features are split; each rank computes its slice and keeps it (no
  communication). A fused weight stacks several logical matrices ("pieces": q, k, v or gate, up); each rank
  holds its slice of every piece, stacked in the same order, so the local output still splits into local
  q/k/v (or gate/up) with `split`/`chunk`.
- Row-parallel linear: the input features are split (the input is a column-parallel output); partial
  products are summed with one all-reduce. The bias is added by rank 0 only, so it is counted once.
- Vocab-parallel embedding: each rank holds a contiguous range of rows; ids outside it look up zeros and
  an all-reduce assembles the rows. The LM head uses the same row ranges (so tied weights share the shard)
  and gathers the logit slices.

Every layer is a subclass of the torch module it replaces, with the same parameter names. With tp.size == 1 the
shapes are the unsharded ones and forward is exactly the unsharded op, with no torch.distributed call.

Weights load from the full (unsharded) checkpoint tensor: `load_hf_weight(attr, full_tensor, piece, hf_name)`
checks the full shape and copies this rank's slice.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.comm import all_gather, all_reduce, gather_to_driver
from engine.distributed.parallel_state import NO_TP, TPGroup


def divide(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide {what} ({n})")
    return n // tp_size


def head_partition(num_q_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank. KV heads are split when tp divides them; when tp is a multiple of
    num_kv_heads each rank holds one KV head, replicated on tp / num_kv_heads ranks (vLLM, mini-sglang), so the
    query heads of a rank still all belong to that one KV head's GQA group."""
    q = divide(num_q_heads, tp_size, "num_q_heads")
    if num_kv_heads % tp_size == 0:
        return q, num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return q, 1
    raise ValueError(f"tensor_parallel_size ({tp_size}) must divide num_kv_heads ({num_kv_heads}) or be a "
                     f"multiple of it (KV heads are then replicated)")


def kv_head_start(rank: int, num_kv_heads: int, tp_size: int) -> int:
    """The first global KV head held by `rank` (see head_partition)."""
    if num_kv_heads % tp_size == 0:
        return rank * (num_kv_heads // tp_size)
    return rank * num_kv_heads // tp_size  # replicated: ranks [k*tp/Hkv, (k+1)*tp/Hkv) hold head k


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first id, end id, rows per rank) of this rank's vocabulary slice. The vocabulary is padded to a multiple
    of tp: every rank holds `rows` rows, the last real rows of the last rank(s) followed by zero padding."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def _check_shape(hf_name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks; the output stays sharded.

    `piece_sizes` are the full output sizes of the logical matrices stacked in the weight; `piece_slices` the
    (start, length) of this rank's rows inside each piece (default: an even split of every piece)."""

    def __init__(self, in_features: int, piece_sizes: Sequence[int], bias: bool, tp: TPGroup = NO_TP,
                 piece_slices: Sequence[tuple[int, int]] | None = None, what: str = "out_features") -> None:
        if piece_slices is None:
            piece_slices = []
            for n in piece_sizes:
                local = divide(n, tp.size, what)
                piece_slices.append((tp.rank * local, local))
        self.tp = tp
        self.piece_sizes = list(piece_sizes)
        self.piece_slices = [tuple(s) for s in piece_slices]
        self.local_offsets = [sum(length for _, length in self.piece_slices[:i]) for i in range(len(piece_sizes))]
        super().__init__(in_features, sum(length for _, length in self.piece_slices), bias=bias)

    @torch.no_grad()
    def load_hf_weight(self, attr: str, tensor: torch.Tensor, piece: int | None, hf_name: str) -> None:
        if piece is None:
            if len(self.piece_sizes) != 1:
                raise ValueError(f"weight {hf_name!r}: a fused layer needs the piece (shard) it belongs to")
            piece = 0
        full = self.piece_sizes[piece]
        _check_shape(hf_name, tensor, (full, self.in_features) if attr == "weight" else (full,))
        start, length = self.piece_slices[piece]
        dest = getattr(self, attr).data.narrow(0, self.local_offsets[piece], length)
        dest.copy_(tensor.narrow(0, start, length))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several equal-role matrices fused along the output (gate_proj and up_proj), each split evenly."""

    def __init__(self, in_features: int, piece_sizes: Sequence[int], bias: bool, tp: TPGroup = NO_TP,
                 what: str = "intermediate_size") -> None:
        super().__init__(in_features, piece_sizes, bias, tp, what=what)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads: this rank's query heads, then its KV heads' k, then their v.
    The q and k/v pieces have different sizes under GQA, so their slices are computed per piece."""

    def __init__(self, hidden_size: int, head_dim: int, num_q_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup = NO_TP) -> None:
        hq, hkv = head_partition(num_q_heads, num_kv_heads, tp.size)
        q0, kv0 = tp.rank * hq, kv_head_start(tp.rank, num_kv_heads, tp.size)
        self.num_local_q_heads, self.num_local_kv_heads, self.head_dim = hq, hkv, head_dim
        self.q_size, self.kv_size = hq * head_dim, hkv * head_dim  # local
        super().__init__(hidden_size, [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp, piece_slices=[(q0 * head_dim, self.q_size), (kv0 * head_dim, self.kv_size),
                                                 (kv0 * head_dim, self.kv_size)])


class RowParallelLinear(nn.Linear):
    """Input features split across ranks; partial outputs summed by an all-reduce; bias added on rank 0 only."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = NO_TP,
                 what: str = "in_features") -> None:
        self.tp = tp
        self.full_in_features = in_features
        super().__init__(divide(in_features, tp.size, what), out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return all_reduce(y, self.tp)

    @torch.no_grad()
    def load_hf_weight(self, attr: str, tensor: torch.Tensor, piece: int | None, hf_name: str) -> None:
        if attr == "bias":  # replicated (only rank 0 adds it)
            _check_shape(hf_name, tensor, (self.out_features,))
            self.bias.data.copy_(tensor)
            return
        _check_shape(hf_name, tensor, (self.out_features, self.full_in_features))
        self.weight.data.copy_(tensor.narrow(1, self.tp.rank * self.in_features, self.in_features))


@torch.no_grad()
def _load_vocab_rows(weight: torch.Tensor, tensor: torch.Tensor, vocab_size: int, tp: TPGroup, hf_name: str) -> None:
    _check_shape(hf_name, tensor, (vocab_size, weight.shape[1]))
    start, end, _ = vocab_range(vocab_size, tp)
    weight[: end - start].copy_(tensor[start:end])
    weight[end - start:].zero_()  # padding rows: looked up by no id, their logits are cut off


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_end) on this rank; ids elsewhere look up zeros, then an all-reduce sums the ranks'
    rows (each id is found on exactly one rank)."""

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TPGroup = NO_TP) -> None:
        self.tp, self.vocab_size = tp, vocab_size
        self.vocab_start, self.vocab_end, rows = vocab_range(vocab_size, tp)
        super().__init__(rows, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        h = F.embedding(torch.where(inside, ids - self.vocab_start, 0), self.weight)
        h.masked_fill_(~inside.unsqueeze(-1), 0)
        return all_reduce(h, self.tp)

    def load_hf_weight(self, attr: str, tensor: torch.Tensor, piece: int | None, hf_name: str) -> None:
        _load_vocab_rows(self.weight.data, tensor, self.vocab_size, self.tp, hf_name)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup = NO_TP,
                          all_ranks: bool = False) -> torch.Tensor | None:
    """float32 logits [T, vocab_size] from this rank's vocabulary rows of the LM head (or tied embedding).

    Every rank must call it. The slices are gathered to rank 0 only (others get None) unless `all_ranks`:
    rank 0 samples and ships the chosen tokens to the workers in the next step's plan, so workers never need
    logits, and a gather moves each slice once instead of to every rank."""
    logits = F.linear(hidden, weight)
    if tp.size == 1:
        return logits.float()
    full = all_gather(logits, tp) if all_ranks else gather_to_driver(logits, tp)
    return None if full is None else full[..., :vocab_size].float()


class ParallelLMHead(nn.Linear):
    """Untied LM head: vocabulary rows split like VocabParallelEmbedding, logits gathered (vocab_parallel_logits)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup = NO_TP) -> None:
        self.tp, self.vocab_size = tp, vocab_size
        self.vocab_start, self.vocab_end, rows = vocab_range(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False)

    def forward(self, hidden: torch.Tensor, all_ranks: bool = False) -> torch.Tensor | None:
        return vocab_parallel_logits(hidden, self.weight, self.vocab_size, self.tp, all_ranks)

    def load_hf_weight(self, attr: str, tensor: torch.Tensor, piece: int | None, hf_name: str) -> None:
        _load_vocab_rows(self.weight.data, tensor, self.vocab_size, self.tp, hf_name)
