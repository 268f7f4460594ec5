"""Reference paged-attention backend in plain torch (CPU and CUDA).

plan() turns the step's page table into flat row indices once; forward() per layer is only tensor ops:
- decode sequences (q_len == 1) are done together in ONE batched op: K/V rows are gathered straight into a
  head-major padded tensor [2, B, Hkv, S_pad, D], q is viewed as [B, Hkv, g, D] (GQA without repeating
  K/V), and attention is two batched matmuls around a softmax with an additive length mask. With g query rows
  per KV head this is a batch of tiny GEMVs; plain matmuls on the contiguous head-major rows run ~3x faster
  on CPU than SDPA's flash kernel for this shape (measured at 64 sequences x 272 slots, fp32, one thread);
- prefill sequences (q_len > 1) loop per sequence with a bottom-right-aligned causal mask.
Softmax runs in float32 for half/bfloat16 inputs (SDPA's kernels do the same for prefill); the output has q's dtype.
8-bit pages (paging/kv_format.py) are dequantized as they are gathered: the reference the C++ kernel is tested against.

K/V rows are addressed in the layer's page tensor viewed as [num_blocks * 2 * block_size * Hkv, D]:
row(block, kv, offset, head) = ((block * 2 + kv) * block_size + offset) * Hkv + head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, write_kv
from paging.kv_format import format_of

_PAD = 16  # decode KV length is padded to a multiple of this (fewer distinct shapes for the matmul kernels)


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    kv_len: int
    rows: torch.Tensor  # [2 * Hkv * kv_len] int64 rows of K then V
    mask: torch.Tensor  # [q_len, kv_len] bool, True = attend


@dataclass
class _Plan:
    meta: AttentionMetadata
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    # decode part
    num_decode: int = 0
    decode_slice: slice | None = None  # token range when the decode tokens are contiguous
    decode_tokens: torch.Tensor | None = None  # [Bd] token indices otherwise
    decode_rows: torch.Tensor | None = None  # [2 * Bd * Hkv * S_pad] int64
    decode_bias: torch.Tensor | None = None  # [Bd, 1, 1, S_pad] float32: 0 for valid slots, -inf for padding
    decode_kv_pad: int = 0
    prefills: list[_Prefill] = field(default_factory=list)


def _kv_rows(tables: list[list[int]], kv_lens: list[int], block_size: int, num_kv_heads: int, pad_to: int,
             device) -> torch.Tensor:
    """Flat K rows [B, Hkv, pad_to] of KV slots 0..pad_to-1 of each sequence; slots past a sequence's kv_len
    repeat its last slot (valid memory, masked out). V rows are K rows + block_size * Hkv."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).to(device)
    lens = torch.tensor(kv_lens, dtype=torch.int64).to(device)
    slots = torch.minimum(torch.arange(pad_to, device=device)[None, :], lens[:, None] - 1)  # [B, pad_to]
    blocks = table.gather(1, torch.div(slots, block_size, rounding_mode="floor"))
    base = (blocks * 2 * block_size + slots % block_size) * num_kv_heads
    return base[:, None, :] + torch.arange(num_kv_heads, device=device)[None, :, None]


class TorchPagedBackend:
    """AttentionBackend over NHD pages [num_blocks, 2, block_size, Hkv, D]."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._gather_buf: torch.Tensor | None = None

    def _gather(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """rows[index] written into one buffer reused by every layer and step. Fresh tensors of tens of MB are
        mmap-ed and page-faulted in on every call on CPU (measured: the 50 MB decode gather of 64 sequences x 512
        slots took ~2x longer freshly allocated than into a reused buffer)."""
        n, d = index.numel(), rows.shape[1]
        buf = self._gather_buf
        if buf is None or buf.numel() < n * d or buf.dtype != rows.dtype or buf.device != rows.device:
            buf = self._gather_buf = torch.empty(max(n * d, 1), dtype=rows.dtype, device=rows.device)
        out = buf[:n * d].view(n, d)
        torch.index_select(rows, 0, index, out=out)
        return out

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        device = meta.qo_indptr.device
        bs, hkv = meta.block_size, num_kv_heads
        v_shift = bs * hkv  # row offset from a K row to its V row
        p = _Plan(meta, num_q_heads, num_kv_heads, head_dim)
        q_starts = [0]
        for q_len in meta.q_lens:
            q_starts.append(q_starts[-1] + q_len)

        dec = [i for i, q_len in enumerate(meta.q_lens) if q_len == 1]
        if dec:
            kv_lens = [meta.kv_lens[i] for i in dec]
            s_pad = -(-max(kv_lens) // _PAD) * _PAD
            k_rows = _kv_rows([meta.block_tables[i] for i in dec], kv_lens, bs, hkv, s_pad, device)
            p.num_decode = len(dec)
            p.decode_kv_pad = s_pad
            p.decode_rows = torch.stack([k_rows, k_rows + v_shift]).flatten()
            lens = torch.tensor(kv_lens).to(device)
            valid = torch.arange(s_pad, device=device)[None, :] < lens[:, None]
            p.decode_bias = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf")).view(
                len(dec), 1, 1, s_pad)
            tokens = [q_starts[i] for i in dec]
            if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
                p.decode_slice = slice(tokens[0], tokens[0] + len(tokens))
            else:
                p.decode_tokens = torch.tensor(tokens, dtype=torch.int64, device=device)

        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            if q_len == 1:
                continue
            k_rows = _kv_rows([meta.block_tables[i]], [kv_len], bs, hkv, kv_len, device)[0]
            rows = torch.stack([k_rows, k_rows + v_shift]).flatten()
            # query i (0-based among the q_len new tokens) attends slots [0, kv_len - q_len + i]
            last = kv_len - q_len + torch.arange(q_len, device=device)
            causal = torch.arange(kv_len, device=device)[None, :] <= last[:, None]
            p.prefills.append(_Prefill(q_starts[i], q_len, kv_len, rows, causal))
        self._plan = p

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        p = self._plan
        if p is None or p.meta is not meta:
            self.plan(meta, q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype)
            p = self._plan
        if k is not None:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        hq, hkv, d = p.num_q_heads, p.num_kv_heads, p.head_dim
        g = hq // hkv
        fmt = format_of(kv_cache, d)
        rows = kv_cache.view(-1, kv_cache.shape[-1])  # every (block, k/v, offset, head) row
        out = torch.empty_like(q)

        if p.num_decode:
            bd, s_pad = p.num_decode, p.decode_kv_pad
            kv = fmt.dequantize_kv(self._gather(rows, p.decode_rows).view(2, -1, rows.shape[-1]), q.dtype).view(
                2, bd, hkv, s_pad, d)
            qd = q[p.decode_slice] if p.decode_slice is not None else q.index_select(0, p.decode_tokens)
            scores = torch.matmul(qd.reshape(bd, hkv, g, d) * scale, kv[0].transpose(-1, -2))
            if scores.element_size() < 4:
                scores = scores.float()  # softmax of half/bfloat16 scores in float32, as SDPA does
            probs = torch.softmax(scores.add_(p.decode_bias), dim=-1).to(q.dtype)
            o = torch.matmul(probs, kv[1]).reshape(bd, hq, d)
            if p.decode_slice is not None:
                out[p.decode_slice] = o
            else:
                out.index_copy_(0, p.decode_tokens, o)

        for pf in p.prefills:
            n = pf.q_len
            kv = fmt.dequantize_kv(self._gather(rows, pf.rows).view(2, -1, rows.shape[-1]), q.dtype).view(
                2, hkv, 1, pf.kv_len, d)
            # GQA: batch over KV heads, the g query heads of a group see one K/V broadcast (stride 0, no copy)
            qs = q[pf.q_start:pf.q_start + n].reshape(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
            k_, v_ = (t.expand(hkv, g, pf.kv_len, d) for t in kv)
            o = F.scaled_dot_product_attention(qs, k_, v_, attn_mask=pf.mask, scale=scale)  # [Hkv, g, n, D]
            out[pf.q_start:pf.q_start + n] = o.permute(2, 0, 1, 3).reshape(n, hq, d)
        return out
