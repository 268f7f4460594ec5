"""A test double of the `flashinfer` module (flashinfer-python 0.7.2.post1's paged wrappers), computing on the CPU.

It implements exactly what engine/attention/flashinfer.py calls: BatchPrefillWithPagedKVCacheWrapper and
BatchDecodeWithPagedKVCacheWrapper, their constructors (eager, and decode with `use_cuda_graph=True` over fixed
indptr / indices / last_page_len buffers), `plan(...)` and `run(q, paged_kv_cache, q_scale=...)`. Every argument
is checked against FlashInfer's documented contract (int32 CSR arrays: indptr [B+1] from 0, non-decreasing, ending
at len(indices); last_page_len [B] in 1..page_size; page ids in range and not repeated within a request; head
counts, head_dim, page_size, layout, dtypes; plan before run; q rows == qo_indptr[-1]) and any violation raises
ContractError. run() computes attention in float64 from exactly the planned arrays: request i reads the pages
indices[indptr[i]:indptr[i+1]] in that order, the last one cut to last_page_len[i]; the causal mask of prefill is
bottom-right aligned (the query rows are the last qo_len KV slots). Only pos_encoding_mode "NONE" and no custom
mask / soft cap / sliding window are implemented (kvllm uses none of them); anything else is refused.

Where it is laxer than the CUDA kernels: float32 q/K/V are accepted (the CPU engines run float32; FlashInfer's
FA2 kernels are compiled for float16 / bfloat16 only) and any head_dim is accepted (the kernels take 64, 128, 256).

Installed by the `flashinfer_double` fixture of tests/test_flashinfer_double.py: `sys.modules["flashinfer"]` is
this module and tests/flashinfer_double_site (a `flashinfer` package that aliases it) goes first on sys.path, so
spawned tensor-parallel workers import it too. RUNS_ON_CPU is what FlashInferBackend looks for before it accepts
device="cpu".
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

RUNS_ON_CPU = True
__version__ = "0.7.2.post1+cpu-double"

CUDA_CORE_DECODE_GROUPS = frozenset({1, 2, 3, 4, 6, 8, 16})  # FlashInfer's DISPATCH_GQA_GROUP_SIZE
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # KV pages only: q and the output stay 16/32-bit
_DTYPE_NAMES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
                "float32": torch.float32, "float": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn,
                "float8_e5m2": torch.float8_e5m2}

# Every wrapper built while the double is installed, in order (tests inspect what kvllm planned).
WRAPPERS: list = []


class ContractError(ValueError):
    """An argument outside FlashInfer's documented contract (the real kernels would misbehave or raise)."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ContractError(msg)


def _dtype(x, name: str, fp8: bool = False) -> torch.dtype:
    if isinstance(x, str):
        _require(x in _DTYPE_NAMES, f"{name}={x!r} is not a dtype FlashInfer's paged kernels take")
        x = _DTYPE_NAMES[x]
    _require(x in FLOAT_DTYPES or (fp8 and x in FP8_DTYPES), f"{name}={x!r} is not a dtype FlashInfer's paged "
             "kernels take")
    return x


def _int32_vector(t, name: str) -> list[int]:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _require(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.tolist()


def _positive_int(x, name: str) -> int:
    _require(isinstance(x, int) and not isinstance(x, bool) and x > 0, f"{name} must be a positive int, got {x!r}")
    return x


def _indptr(values: list[int], name: str, total: int, strict: bool) -> None:
    _require(len(values) >= 2, f"{name} needs at least 2 entries (batch size >= 1), got {values}")
    _require(values[0] == 0, f"{name} must start at 0, got {values[0]}")
    steps = [b - a for a, b in zip(values, values[1:])]
    _require(all(s > 0 if strict else s >= 0 for s in steps),
             f"{name} must be {'increasing' if strict else 'non-decreasing'}, got {values}")
    _require(values[-1] == total, f"{name} must end at {total}, got {values[-1]}")


@dataclass
class Plan:
    """What plan() accepted, as host lists (run() reads these, never the caller's tensors)."""
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    last_page_len: list[int]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    sm_scale: float

    @property
    def batch_size(self) -> int:
        return len(self.last_page_len)

    @property
    def kv_lens(self) -> list[int]:
        return [(self.kv_indptr[i + 1] - self.kv_indptr[i] - 1) * self.page_size + self.last_page_len[i]
                for i in range(self.batch_size)]


def check_plan(qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
               causal, q_data_type, kv_data_type, o_data_type, sm_scale) -> Plan:
    """Every plan() argument against the contract; the accepted plan as host lists."""
    hq = _positive_int(num_qo_heads, "num_qo_heads")
    hkv = _positive_int(num_kv_heads, "num_kv_heads")
    _require(hq % hkv == 0, f"num_qo_heads={hq} must be a multiple of num_kv_heads={hkv}")
    d = _positive_int(head_dim, "head_dim")
    ps = _positive_int(page_size, "page_size")
    qo = _int32_vector(qo_indptr, "qo_indptr")
    ip = _int32_vector(kv_indptr, "paged_kv_indptr")
    ix = _int32_vector(kv_indices, "paged_kv_indices")
    lp = _int32_vector(last_page_len, "paged_kv_last_page_len")
    b = len(lp)
    _require(b >= 1, "empty batch")
    _require(len(qo) == b + 1, f"qo_indptr has {len(qo)} entries for a batch of {b} (needs {b + 1})")
    _require(len(ip) == b + 1, f"paged_kv_indptr has {len(ip)} entries for a batch of {b} (needs {b + 1})")
    _indptr(qo, "qo_indptr", qo[-1], strict=False)
    # every request holds at least one page: its last page has 1..page_size valid slots
    _indptr(ip, "paged_kv_indptr", len(ix), strict=True)
    for i, n in enumerate(lp):
        _require(1 <= n <= ps, f"paged_kv_last_page_len[{i}]={n} is outside [1, page_size={ps}]")
    _require(all(p >= 0 for p in ix), f"negative page id in paged_kv_indices: {min(ix) if ix else None}")
    for i in range(b):
        pages = ix[ip[i]:ip[i + 1]]
        _require(len(set(pages)) == len(pages), f"request {i} lists a page twice: {pages}")
    q_dt = _dtype(q_data_type, "q_data_type")
    kv_dt = _dtype(kv_data_type if kv_data_type is not None else q_dt, "kv_data_type", fp8=True)
    o_dt = _dtype(o_data_type if o_data_type is not None else q_dt, "o_data_type")
    _require(sm_scale is None or (isinstance(sm_scale, float) and sm_scale > 0), f"bad sm_scale {sm_scale!r}")
    plan = Plan(qo, ip, ix, lp, hq, hkv, d, ps, bool(causal), q_dt, kv_dt, o_dt,
                sm_scale if sm_scale is not None else 1.0 / math.sqrt(d))
    if causal:  # bottom-right aligned: every query row must have its own KV slot
        for i, kv_len in enumerate(plan.kv_lens):
            n = qo[i + 1] - qo[i]
            _require(kv_len >= n, f"request {i}: causal with qo_len {n} > kv_len {kv_len}")
    return plan


def _unpack_cache(paged_kv_cache, layout: str, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) pages, each [num_pages, page_size, Hkv, D] whatever the layout, checked against the plan."""
    if isinstance(paged_kv_cache, (tuple, list)):
        _require(len(paged_kv_cache) == 2, "a (k, v) paged cache must be a pair")
        k, v = paged_kv_cache
        _require(isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor), "k and v pages must be tensors")
        _require(k.shape == v.shape and k.dtype == v.dtype, "k and v pages differ in shape or dtype")
        _require(k.dim() == 4, f"k/v pages must be 4-D, got {tuple(k.shape)}")
    else:
        _require(isinstance(paged_kv_cache, torch.Tensor), "paged_kv_cache must be a tensor or a (k, v) pair")
        _require(paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2,
                 f"a single paged cache must be [pages, 2, ...], got {tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    want = (plan.page_size, plan.num_kv_heads, plan.head_dim)
    _require(tuple(k.shape[1:]) == want,
             f"{layout} pages are {tuple(k.shape[1:])} per page, plan() said (page_size, Hkv, D) = {want}")
    _require(k.dtype == plan.kv_dtype, f"paged_kv_cache is {k.dtype}, plan() said kv_data_type={plan.kv_dtype}")
    _require(not plan.kv_indices or max(plan.kv_indices) < k.shape[0],
             f"page id {max(plan.kv_indices) if plan.kv_indices else None} out of range for {k.shape[0]} pages")
    return k, v


def paged_attention_f64(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: Plan,
                        scale: float) -> torch.Tensor:
    """Attention of every request in float64, from exactly the planned CSR arrays. q [T, Hq, D] -> [T, Hq, D]."""
    hq, hkv, d, ps = plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size
    g = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, kv_len in enumerate(plan.kv_lens):
        q0, q1 = plan.qo_indptr[i], plan.qo_indptr[i + 1]
        n = q1 - q0
        if n == 0:
            continue
        pages = torch.tensor(plan.kv_indices[plan.kv_indptr[i]:plan.kv_indptr[i + 1]], dtype=torch.long)
        k = k_pages.index_select(0, pages).reshape(-1, hkv, d)[:kv_len].double()  # [S, Hkv, D]
        v = v_pages.index_select(0, pages).reshape(-1, hkv, d)[:kv_len].double()
        qs = q[q0:q1].double().reshape(n, hkv, g, d)
        s = torch.einsum("nhgd,shd->hgns", qs, k) * scale
        if plan.causal:  # query j (0-based) sees KV slots [0, kv_len - n + j]
            allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hgns,shd->nhgd", s.softmax(-1), v)
        out[q0:q1] = o.reshape(n, hq, d)
    return out


class _Wrapper:
    """What both wrappers share: the constructor checks, the planned state and run()."""

    def __init__(self, float_workspace_buffer, kv_layout: str, backend: str) -> None:
        _require(isinstance(float_workspace_buffer, torch.Tensor) and float_workspace_buffer.dtype == torch.uint8
                 and float_workspace_buffer.dim() == 1, "float_workspace_buffer must be a 1-D uint8 tensor")
        _require(kv_layout in ("NHD", "HND"), f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        _require(backend in ("auto", "fa2", "fa3"), f"unknown backend {backend!r}")
        self.workspace = float_workspace_buffer
        self.kv_layout = kv_layout
        self.backend = backend
        self.plan_state: Plan | None = None
        self.num_plans = 0
        self.num_runs = 0
        WRAPPERS.append(self)

    def _run(self, q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse) -> torch.Tensor:
        plan = self.plan_state
        if plan is None:
            raise RuntimeError("run() called before plan()")
        _require(out is None and lse is None and not return_lse, "out= / lse= / return_lse are not implemented")
        _require(isinstance(q, torch.Tensor) and q.dim() == 3, "q must be a 3-D tensor [tokens, Hq, D]")
        _require(q.shape[0] == plan.qo_indptr[-1],
                 f"q has {q.shape[0]} rows, the plan's qo_indptr ends at {plan.qo_indptr[-1]}")
        _require(tuple(q.shape[1:]) == (plan.num_qo_heads, plan.head_dim),
                 f"q is [{q.shape[1]}, {q.shape[2]}] per row, plan() said (Hq, D) = ({plan.num_qo_heads}, "
                 f"{plan.head_dim})")
        _require(q.dtype == plan.q_dtype, f"q is {q.dtype}, plan() said q_data_type={plan.q_dtype}")
        _require(q.stride(-1) == 1, "q's last dimension must be contiguous")
        _require(q.device == self.workspace.device, "q and the workspace are on different devices")
        k, v = _unpack_cache(paged_kv_cache, self.kv_layout, plan)
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            _require(s is None or (isinstance(s, float) and s > 0), f"{name} must be None or a positive float")
        scale = plan.sm_scale * (q_scale or 1.0) * (k_scale or 1.0)
        o = paged_attention_f64(q, k, v, plan, scale)
        self.num_runs += 1
        return (o * (v_scale or 1.0)).to(plan.o_dtype)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        super().__init__(float_workspace_buffer, kv_layout, backend)
        _require(not use_cuda_graph, "the double implements CUDA-graph buffers for the decode wrapper only")
        _require(custom_mask_buf is None and mask_indptr_buf is None and jit_args is None and jit_kwargs is None,
                 "custom masks / JIT variants are not implemented")

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True):
        _require(pos_encoding_mode == "NONE", f"pos_encoding_mode={pos_encoding_mode!r} is not implemented")
        _require(custom_mask is None and packed_custom_mask is None, "custom masks are not implemented")
        _require(head_dim_vo in (None, head_dim_qk), "head_dim_vo != head_dim_qk is not implemented")
        _require(window_left == -1 and logits_soft_cap in (None, 0.0) and not use_fp16_qk_reduction,
                 "sliding window / soft cap / fp16 reduction are not implemented")
        self.plan_state = check_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                     num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, q_data_type,
                                     kv_data_type, o_data_type, sm_scale)
        self.num_plans += 1

    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False):
        return self._run(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, backend)
        _require(jit_args is None, "JIT variants are not implemented")
        self.use_cuda_graph = bool(use_cuda_graph)
        self.use_tensor_cores = bool(use_tensor_cores)
        bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if self.use_cuda_graph:  # fixed buffers: the batch size is fixed for the wrapper's life
            for name, t in zip(("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                "paged_kv_last_page_len_buffer"), bufs):
                _int32_vector(t, name)
                _require(t.device == float_workspace_buffer.device, f"{name} is not on the workspace's device")
            _require(len(bufs[0]) == len(bufs[2]) + 1,
                     "paged_kv_indptr_buffer must hold batch_size + 1 entries (batch_size = len(last_page_len buffer))")
            self.fixed_batch_size = len(bufs[2])
        else:
            _require(all(t is None for t in bufs), "fixed buffers are given only with use_cuda_graph=True")
        self.buffers = bufs

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True):
        _require(pos_encoding_mode == "NONE", f"pos_encoding_mode={pos_encoding_mode!r} is not implemented")
        _require(window_left == -1 and logits_soft_cap in (None, 0.0), "sliding window / soft cap not implemented")
        if data_type is not None:  # the deprecated spelling of q_data_type + kv_data_type
            q_data_type = kv_data_type = data_type
        b = len(last_page_len) if isinstance(last_page_len, torch.Tensor) else -1
        qo = torch.arange(max(b, 0) + 1, dtype=torch.int32)  # one query row per request
        plan = check_plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                          False, q_data_type, kv_data_type, o_data_type, sm_scale)
        if not self.use_tensor_cores and plan.num_qo_heads // plan.num_kv_heads not in CUDA_CORE_DECODE_GROUPS:
            raise ContractError(f"the CUDA-core decode kernel has no GQA group size "
                                f"{plan.num_qo_heads // plan.num_kv_heads} (use_tensor_cores=True is needed)")
        if self.use_cuda_graph:
            ip_buf, ix_buf, lp_buf = self.buffers
            _require(plan.batch_size == self.fixed_batch_size,
                     f"batch size {plan.batch_size} != the fixed batch size {self.fixed_batch_size} of a CUDA-graph "
                     f"wrapper (pad the batch)")
            _require(len(plan.kv_indices) <= len(ix_buf),
                     f"{len(plan.kv_indices)} page ids exceed the fixed indices buffer ({len(ix_buf)})")
            # the captured kernels read these addresses: copy in place, as FlashInfer does
            ip_buf.copy_(indptr)
            ix_buf[:len(plan.kv_indices)].copy_(indices)
            lp_buf.copy_(last_page_len)
        self.plan_state = plan
        self.num_plans += 1

    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False):
        if self.use_cuda_graph and self.plan_state is not None:
            # a replayed graph sees whatever the fixed buffers hold now, not a copy taken at plan()
            ip_buf, ix_buf, lp_buf = self.buffers
            n = int(ip_buf[-1])
            _require(0 <= n <= len(ix_buf), "the fixed indptr buffer points past the indices buffer")
            self.plan_state = check_plan(
                torch.arange(self.fixed_batch_size + 1, dtype=torch.int32), ip_buf.cpu(), ix_buf[:n].cpu(),
                lp_buf.cpu(), self.plan_state.num_qo_heads, self.plan_state.num_kv_heads, self.plan_state.head_dim,
                self.plan_state.page_size, False, self.plan_state.q_dtype, self.plan_state.kv_dtype,
                self.plan_state.o_dtype, self.plan_state.sm_scale)
        if self.plan_state is not None and isinstance(q, torch.Tensor) and q.dim() == 3:
            b = self.plan_state.batch_size
            _require(q.shape[0] == b, f"q has {q.shape[0]} rows for a decode batch of {b} requests (one row each)")
        return self._run(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse)


# ---- installing it --------------------------------------------------------------------------------------------
@pytest.fixture
def flashinfer_double(monkeypatch):
    """The double installed as `flashinfer` for one test, here and in processes spawned from here (import this
    fixture into a test module); monkeypatch undoes it."""
    import engine.attention.flashinfer as fimod

    this = sys.modules[__name__]
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "flashinfer_double_site"))
    monkeypatch.setitem(sys.modules, "flashinfer", this)
    monkeypatch.setattr(fimod, "WORKSPACE_BYTES", 1 << 20)  # this process only: the double never touches it
    WRAPPERS.clear()
    yield this
    WRAPPERS.clear()
