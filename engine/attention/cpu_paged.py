"""CPU paged-attention backend: one C++ call per layer reads K/V where they lie in the pages.

The torch backend gathers every sequence's K/V rows into a padded buffer each layer (at 64 sequences x 512
slots that is 50 MB copied per layer) and loops over prefill sequences in Python. This backend hands the
step's CSR page table straight to the kernel in csrc/kvllm_cpu.cpp (built by engine/attention/cpu_ext.py),
which walks each sequence's blocks in place with an online softmax, all sequences (decode and prefill, mixed)
in one call, parallel over (sequence, KV head, query tile) on torch's intra-op threads. The kernel has AVX-512,
AVX2 and portable loops and takes the best the CPU has (`max_isa` caps it).

float32, bfloat16 and float16 run in the kernel, in any mix of query and cache dtype (half K/V are widened in
registers, math in float32: `kv_cache_dtype='float16'` halves the bytes a decode step reads). 8-bit pages (int8,
fp8_e5m2, fp8_e4m3 with a scale per row, paging/kv_format.py) are widened in registers too, their scales applied to
scores and probabilities: a quarter of float32's bytes. Any other dtype or a non-CPU tensor goes to TorchPagedBackend.
On a CPU with AVX512-BF16 a bfloat16 cache (head_dim % 32 == 0) is multiplied as stored, with bf16 dot products, q
and the probabilities rounded to bf16 (max_isa 3, the default; 2 keeps the float32 math): the rounding GPU kernels
apply to bf16 inputs, its cost measured in docs/benchmarks.md ("KV dtype and compression quality").
"""
from __future__ import annotations

import torch

from engine.attention import cpu_ext
from engine.attention.base import AttentionMetadata
from engine.attention.torch_paged import TorchPagedBackend

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the page dtypes the kernel reads: the float ones and the 8-bit formats of paging/kv_format.py
CACHE_DTYPES = (*KERNEL_DTYPES, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn)


class CpuPagedBackend:
    """AttentionBackend over NHD pages [num_blocks, 2, block_size, Hkv, D] on the CPU. Raises
    cpu_ext.ExtensionUnavailable when the kernel cannot be built or loaded."""

    def __init__(self, force_portable: bool = False, max_isa: int = 3) -> None:
        self._ops = cpu_ext.load()
        self._fallback = TorchPagedBackend()
        self.force_portable = force_portable  # the non-AVX2 kernels, for tests on AVX2 machines
        # 3: AVX512-BF16 dot products on a bfloat16 cache where the CPU has them; 2: AVX-512 at most; 1: AVX2 at most;
        # 0: portable (tests of each level)
        self.max_isa = max_isa

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if dtype not in KERNEL_DTYPES or meta.qo_indptr.device.type != "cpu":
            self._fallback.plan(meta, num_q_heads, num_kv_heads, head_dim, dtype)
        # the kernel needs no plan: it reads the CSR tensors of `meta` on every call (O(batch) work)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if (q.dtype not in KERNEL_DTYPES or kv_cache.dtype not in CACHE_DTYPES or q.device.type != "cpu"
                or not kv_cache.is_contiguous()):
            return self._fallback.forward(q, k, v, kv_cache, meta, scale)
        if k is not None:  # one C++ call for K and V (torch's write_kv is ~8 ops a layer)
            self._ops.write_kv(k, v, kv_cache, meta.slot_mapping)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2] or q.stride(0) < q.shape[1] * q.shape[2]:
            q = q.contiguous()  # the kernel takes a row-strided q (a view into the qkv projection) as it is
        out = torch.empty(q.shape, dtype=q.dtype)
        self._ops.paged_attention(q, kv_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                  meta.kv_last_page_len, float(scale), out, self.force_portable, self.max_isa)
        return out
