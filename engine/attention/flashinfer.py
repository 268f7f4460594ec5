"""FlashInfer paged attention (CUDA): a drop-in replacement for TorchPagedBackend.

Written against flashinfer-python 0.7.2.post1 (the version pinned in pyproject's `cuda` extra); see
docs in ../shared/research/flashinfer.md. The page layout is FlashInfer's own NHD layout, so the
engine's page tensors `[num_blocks, 2, block_size, Hkv, D]` are passed to `run()` unchanged.

- plan() is called once per step: it builds pinned host int32 qo_indptr / kv_indptr / last_page_len
  (plan_inputs below) and plans ONE wrapper that every layer's forward() reuses:
    * any q_len > 1  -> BatchPrefillWithPagedKVCacheWrapper(backend="fa2"), causal=True. Its causal mask
      is bottom-right aligned in KV-slot space, which is exactly the engine's rule (new tokens are the
      last q_len slots), also for write=False query recomputation and after compaction;
    * all q_len == 1 -> BatchDecodeWithPagedKVCacheWrapper(backend="fa2"), with tensor cores when the
      GQA group size is outside {1, 2, 3, 4, 6, 8, 16} (the CUDA-core decode kernel dispatches only on
      those; e.g. Qwen3-14B's 40/8 = 5).
  pos_encoding_mode="NONE": the model applies RoPE (at logical positions) before K is written, so the
  kernels never see positions and compressed sequences (kv_len < position) need nothing special.
- forward() scatters the new K/V into the pages at the step's slots (torch index_put: equivalent to
  flashinfer.page.append_paged_kv_cache, graph-capturable, and no extra JIT module), then wrapper.run().
- `import flashinfer` happens lazily, when the backend is constructed: CPU-only installs never need it.

Decode CUDA graphs (optional): init_cuda_graphs() builds one `use_cuda_graph=True` decode wrapper per
captured batch size over fixed device buffers; plan_graph() re-plans it outside the graph before each
replay (sequences padded up to the captured size with 1-slot dummies on a scratch block). See
init_cuda_graphs for the capture/replay recipe.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.attention.base import AttentionMetadata
from paging.kv_format import format_of

FLASHINFER_VERSION = "0.7.2.post1"  # the version whose API this file was written against
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace; must be zeroed before first use
CUDA_CORE_DECODE_GROUPS = frozenset({1, 2, 3, 4, 6, 8, 16})  # utils.cuh DISPATCH_GQA_GROUP_SIZE

_INSTALL_HINT = ("the flashinfer attention backend needs the flashinfer-python package "
                 f"(flashinfer-python=={FLASHINFER_VERSION}): pip install -e '.[cuda]'; "
                 "or run with --attention-backend torch")


def is_available() -> bool:
    """True when CUDA is visible and `import flashinfer` succeeds (any import-time error counts as no)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # a broken install (missing apache-tvm-ffi, CUDA mismatch, ...) is "not available"
        return False
    return True


def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return flashinfer


def _cpu_stand_in():
    """The importable `flashinfer` module when it is a stand-in that computes on the CPU (it sets RUNS_ON_CPU;
    tests/flashinfer_double.py, never shipped), else None. Lets the CPU tests, and their spawned tensor-parallel
    workers, build this backend on device="cpu"; with the real package a CPU device is still refused."""
    try:
        if importlib.util.find_spec("flashinfer") is None:
            return None
        import flashinfer
    except Exception:
        return None
    return flashinfer if getattr(flashinfer, "RUNS_ON_CPU", False) is True else None


def needs_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """Decode must use the tensor-core (prefill) kernel when the GQA group size has no CUDA-core kernel."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return num_q_heads // num_kv_heads not in CUDA_CORE_DECODE_GROUPS


def _i32(values: Sequence[int], pin: bool) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, pin_memory=pin)


def plan_inputs(meta: AttentionMetadata, pin: bool = False) -> dict[str, torch.Tensor]:
    """The host-side plan() inputs, built from meta's host lists (no device sync): CPU int32 tensors
    qo_indptr [B+1], kv_indptr [B+1] (in pages), kv_last_page_len [B] (1..block_size) and kv_lens [B].
    pin=True puts them in pinned memory (needs CUDA), so plan()'s host->device copies are async."""
    bs = meta.block_size
    qo_indptr, kv_indptr, last_page_len = [0], [0], []
    for q_len, kv_len in zip(meta.q_lens, meta.kv_lens):
        if q_len < 1 or kv_len < q_len:
            raise ValueError(f"bad attention lengths: q_len={q_len}, kv_len={kv_len}")
        num_pages = (kv_len + bs - 1) // bs
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        last_page_len.append(kv_len - (num_pages - 1) * bs)
    return {"qo_indptr": _i32(qo_indptr, pin), "kv_indptr": _i32(kv_indptr, pin),
            "kv_last_page_len": _i32(last_page_len, pin), "kv_lens": _i32(meta.kv_lens, pin)}


def graph_decode_inputs(meta: AttentionMetadata, batch_size: int, scratch_block: int,
                        pin: bool = False) -> dict[str, torch.Tensor]:
    """Decode inputs padded to a captured batch size: CPU kv_indptr [bs+1], kv_indices [pages] and
    kv_last_page_len [bs] (int32), plus the K/V write position of every row, write_blocks / write_offsets
    [bs] (int64). Padding rows are 1-slot sequences on `scratch_block` (slot 0), which the engine never
    hands to a sequence. Each real row writes its one new token at slot kv_len - 1."""
    if not meta.is_decode_only:
        raise ValueError("graph decode needs a decode-only step (every q_len == 1)")
    n = meta.num_seqs
    if n > batch_size:
        raise ValueError(f"{n} sequences do not fit a graph captured for batch size {batch_size}")
    bs = meta.block_size
    kv_indptr, kv_indices, last_page_len, wblocks, woffsets = [0], [], [], [], []
    for table, kv_len in zip(meta.block_tables, meta.kv_lens):
        num_pages = (kv_len + bs - 1) // bs
        kv_indices.extend(table[:num_pages])
        kv_indptr.append(len(kv_indices))
        last_page_len.append(kv_len - (num_pages - 1) * bs)
        wblocks.append(table[(kv_len - 1) // bs])
        woffsets.append((kv_len - 1) % bs)
    for _ in range(batch_size - n):
        kv_indices.append(scratch_block)
        kv_indptr.append(len(kv_indices))
        last_page_len.append(1)
        wblocks.append(scratch_block)
        woffsets.append(0)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, pin_memory=pin)  # noqa: E731
    return {"kv_indptr": _i32(kv_indptr, pin), "kv_indices": _i32(kv_indices, pin),
            "kv_last_page_len": _i32(last_page_len, pin), "write_blocks": i64(wblocks),
            "write_offsets": i64(woffsets)}


@dataclass
class _GraphSlot:
    """Fixed device buffers + wrapper for one captured decode batch size (addresses never change)."""
    batch_size: int
    wrapper: Any
    write_blocks: torch.Tensor  # [bs] int64
    write_offsets: torch.Tensor  # [bs] int64


@dataclass
class _Step:
    """What plan() decided for this step; forward() of every layer reads it."""
    wrapper: Any
    head_dim: int
    write_blocks: torch.Tensor | None  # [T] int64, None = nothing to write
    write_offsets: torch.Tensor | None
    meta: AttentionMetadata | None  # None in graph mode (forward must not touch per-step tensors)


class FlashInferBackend:
    """AttentionBackend over FlashInfer's FA2 paged kernels (NHD pages, bf16/fp16, head_dim 64/128/256)."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda":
            fi = _cpu_stand_in()
            if fi is not None:  # the tests' CPU double of flashinfer: the whole engine runs through it
                self._setup(fi, device)
                return
            raise ValueError(f"the flashinfer attention backend runs on CUDA devices only, got device "
                             f"{str(device)!r}; use --attention-backend torch (or auto) instead")
        fi = _import_flashinfer()
        if not torch.cuda.is_available():
            raise RuntimeError("the flashinfer attention backend needs CUDA, but torch.cuda.is_available() is "
                               "False; use --attention-backend torch")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._setup(fi, device)

    def _setup(self, fi, device: torch.device) -> None:
        """Everything but the checks (the CPU tests drive it with a stand-in flashinfer module)."""
        self.fi = fi
        self.device = device
        self._cuda = device.type == "cuda"
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Both eager wrappers share the float workspace: only one of them runs in a step.
        self.prefill_wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._decode_wrappers: dict[bool, Any] = {}  # use_tensor_cores -> wrapper (made on first use)
        self._graphs: dict[int, _GraphSlot] = {}
        self._graph_cfg: tuple | None = None
        self._step: _Step | None = None
        # plan() stages its schedule in the wrapper's pinned buffer and copies it to the device
        # asynchronously; wait for the previous step's copy before the buffer is overwritten.
        self._plan_done = torch.cuda.Event() if self._cuda else None
        self._planned_once = False

    # ---- eager path ------------------------------------------------------------------------------------
    def _decode_wrapper(self, tensor_cores: bool):
        w = self._decode_wrappers.get(tensor_cores)
        if w is None:
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tensor_cores,
                                                           backend="fa2")
            self._decode_wrappers[tensor_cores] = w
        return w

    def _wait_previous_plan(self) -> None:
        if self._plan_done is not None and self._planned_once:
            self._plan_done.synchronize()

    def _plan_recorded(self) -> None:
        if self._plan_done is not None:
            self._plan_done.record()
            self._planned_once = True

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> None:
        tensor_cores = needs_tensor_cores(num_q_heads, num_kv_heads)
        self._wait_previous_plan()
        inp = plan_inputs(meta, pin=self._cuda)
        kv_indices = meta.kv_indices.to(self.device, torch.int32, non_blocking=True)
        # fp8 pages (paging/kv_format.py, no row scales here) are read by the kernels as they are: scale 1
        common = dict(pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=kv_dtype or dtype)
        if meta.is_decode_only:
            wrapper = self._decode_wrapper(tensor_cores)
            wrapper.plan(inp["kv_indptr"], kv_indices, inp["kv_last_page_len"], num_q_heads, num_kv_heads,
                         head_dim, meta.block_size, **common)
        else:
            wrapper = self.prefill_wrapper
            wrapper.plan(inp["qo_indptr"], inp["kv_indptr"], kv_indices, inp["kv_last_page_len"], num_q_heads,
                         num_kv_heads, head_dim, meta.block_size, causal=True, **common)
        self._plan_recorded()
        blocks = offsets = None
        if meta.slot_mapping.numel():
            slots = meta.slot_mapping.to(self.device, torch.int64, non_blocking=True)
            blocks = torch.div(slots, meta.block_size, rounding_mode="floor")
            offsets = slots - blocks * meta.block_size
        self._step = _Step(wrapper, head_dim, blocks, offsets, meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        step = self._step
        if step is None or (step.meta is not None and step.meta is not meta):  # not planned: plan now
            self.plan(meta, q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype, kv_cache.dtype)
            step = self._step
        if k is not None:
            if step.write_blocks is None:
                raise RuntimeError("forward() got new K/V but the step's metadata has no slot mapping "
                                   "(it was built with write=False)")
            fmt = format_of(kv_cache, q.shape[2])  # fp8 pages: clamped to the format's range (a cast would give NaN)
            kv_cache[step.write_blocks, 0, step.write_offsets] = fmt.quantize(k, keys=True)
            kv_cache[step.write_blocks, 1, step.write_offsets] = fmt.quantize(v)
        # plan() used FlashInfer's default sm_scale 1/sqrt(D); any other scale folds in through q_scale.
        ratio = scale * math.sqrt(step.head_dim)
        q_scale = None if abs(ratio - 1.0) < 1e-6 else ratio
        return step.wrapper.run(q.contiguous(), kv_cache, q_scale=q_scale)

    # ---- decode CUDA graphs (optional) -----------------------------------------------------------------
    def init_cuda_graphs(self, batch_sizes: Sequence[int], max_pages_per_seq: int, num_q_heads: int,
                         num_kv_heads: int, head_dim: int, dtype: torch.dtype, scratch_block: int,
                         kv_dtype: torch.dtype | None = None) -> None:
        """One `use_cuda_graph=True` decode wrapper per batch size, over fixed device buffers sized for
        `max_pages_per_seq` pages per sequence. `scratch_block` is a KV block the engine never gives to a
        sequence: padding rows read and write it. Recipe for the model runner (decode steps only;
        prefills, query recomputation and compression rounds stay eager through plan()):

            attn.init_cuda_graphs(sizes, max_pages, Hq, Hkv, D, dtype, scratch_block)
            for bs in sizes:                       # capture, largest first, sharing one graph pool
                meta = build_metadata([[scratch_block]] * bs, [1] * bs, [1] * bs, block_size, device)
                attn.plan_graph(meta, bs)
                model(ids[:bs], pos[:bs], layers, attn, meta)     # eager warm-up (allocs, lazy tables)
                with torch.cuda.graph(graph[bs], pool=pool):
                    hidden[bs] = model(ids[:bs], pos[:bs], layers, attn, meta)
            # each decode step with n <= bs sequences:
            attn.plan_graph(meta, bs); ids[:n].copy_(...); pos[:n].copy_(...); graph[bs].replay()
            logits = model.compute_logits(hidden[bs][:n])

        While in graph mode forward() ignores `meta`'s tensors: it reads only the fixed buffers."""
        tensor_cores = needs_tensor_cores(num_q_heads, num_kv_heads)
        self._graph_cfg = (num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype or dtype, scratch_block,
                           max_pages_per_seq)
        dev = self.device
        for bs in sorted(set(batch_sizes)):
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, backend="fa2",
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(bs * max_pages_per_seq, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev))
            self._graphs[bs] = _GraphSlot(bs, wrapper, torch.zeros(bs, dtype=torch.int64, device=dev),
                                          torch.zeros(bs, dtype=torch.int64, device=dev))

    @property
    def graph_batch_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def graph_batch_size_for(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds num_seqs sequences (None if none does)."""
        return next((bs for bs in sorted(self._graphs) if bs >= num_seqs), None)

    def plan_graph(self, meta: AttentionMetadata, batch_size: int) -> None:
        """Re-plan the captured decode wrapper for `batch_size` (outside the graph) and refresh its fixed
        buffers: page table, last-page lengths and the K/V write slots. Then forward() (captured or
        eager) uses that wrapper."""
        if self._graph_cfg is None or batch_size not in self._graphs:
            raise ValueError(f"no decode graph wrapper for batch size {batch_size}; call init_cuda_graphs first")
        hq, hkv, d, dtype, kv_dtype, scratch, max_pages = self._graph_cfg
        too_long = [len(t) for t in meta.block_tables if len(t) > max_pages]
        if too_long:
            raise ValueError(f"a sequence needs {max(too_long)} pages; the graph buffers hold {max_pages}")
        slot = self._graphs[batch_size]
        self._wait_previous_plan()
        inp = graph_decode_inputs(meta, batch_size, scratch, pin=self._cuda)
        kv_indices = inp["kv_indices"].to(self.device, non_blocking=True)  # D2D into the fixed buffer
        slot.wrapper.plan(inp["kv_indptr"], kv_indices, inp["kv_last_page_len"], hq, hkv, d,
                          meta.block_size, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=kv_dtype)
        slot.write_blocks.copy_(inp["write_blocks"], non_blocking=True)
        slot.write_offsets.copy_(inp["write_offsets"], non_blocking=True)
        self._plan_recorded()
        self._step = _Step(slot.wrapper, d, slot.write_blocks, slot.write_offsets, None)


__all__ = ["FlashInferBackend", "FLASHINFER_VERSION", "is_available", "needs_tensor_cores", "plan_inputs",
           "graph_decode_inputs"]
