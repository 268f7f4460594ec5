"""The flashinfer test double (tests/flashinfer_double.py) on its own, and FlashInferBackend driven through it.

1. The double against an independent dense float64 attention: each request's K/V are drawn as contiguous
   sequences, scattered into shuffled pages, and the reference runs scaled_dot_product_attention on the
   contiguous tensors (no page arithmetic shared with the double), for prefill (causal), decode, NHD and HND, a
   (k, v) pair and one [pages, 2, ...] tensor, bfloat16 output and q_scale.
2. It rejects every malformed plan / run the contract forbids: wrong dtypes and shapes, indptr not starting at 0,
   non-monotone or one off at its end, last_page_len 0 or > page_size, a page out of range or listed twice,
   run before plan, a q whose length or heads differ from the plan, a causal request with more queries than KV.
3. FlashInferBackend with an off-by-one injected into the last_page_len or kv_indptr it plans with: the double
   raises, or the output differs from TorchPagedBackend.
4. CUDA-graph readiness: a `use_cuda_graph=True` decode wrapper planned for a padded batch reuses its fixed
   buffers (same storage, refilled in place), refuses another batch size, and gives the eager results.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import flashinfer_double as fd
from engine.attention.base import build_metadata
from engine.attention.flashinfer import FlashInferBackend
from engine.attention.torch_paged import TorchPagedBackend
from flashinfer_double import ContractError, flashinfer_double  # noqa: F401 (fixture)

WS = torch.zeros(1 << 10, dtype=torch.uint8)


# ---- an independent reference -------------------------------------------------------------------------------
def make_case(q_lens, kv_lens, hq=4, hkv=2, d=8, ps=4, num_pages=40, seed=0, layout="NHD", dtype=torch.float32):
    """Random K/V per request laid into shuffled pages; the CSR plan inputs; q; and the dense float64 reference."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    free = list(range(num_pages))
    rng.shuffle(free)
    cache = torch.randn(num_pages, 2, ps, hkv, d, generator=g, dtype=torch.float64)  # NHD, garbage in unused slots
    qo, ip, ix, lp, seqs = [0], [0], [], [], []
    for q_len, kv_len in zip(q_lens, kv_lens):
        n_pages = -(-kv_len // ps)
        pages = [free.pop() for _ in range(n_pages)]
        k, v = (torch.randn(kv_len, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
        for s in range(kv_len):
            cache[pages[s // ps], 0, s % ps] = k[s]
            cache[pages[s // ps], 1, s % ps] = v[s]
        seqs.append((k, v))
        qo.append(qo[-1] + q_len)
        ix.extend(pages)
        ip.append(len(ix))
        lp.append(kv_len - (n_pages - 1) * ps)
    q = torch.randn(qo[-1], hq, d, generator=g, dtype=torch.float64)
    ref = torch.empty_like(q)
    for i, (k, v) in enumerate(seqs):
        n, s = q_lens[i], kv_lens[i]
        allowed = torch.ones(n, s, dtype=torch.bool).tril(diagonal=s - n)  # bottom-right aligned causal mask
        kk, vv = (t.repeat_interleave(hq // hkv, dim=1).transpose(0, 1) for t in (k, v))
        o = F.scaled_dot_product_attention(q[qo[i]:qo[i + 1]].transpose(0, 1), kk, vv, attn_mask=allowed)
        ref[qo[i]:qo[i + 1]] = o.transpose(0, 1)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = dict(qo=i32(qo), ip=i32(ip), ix=i32(ix), lp=i32(lp), hq=hq, hkv=hkv, d=d, ps=ps)
    return args, q.to(dtype), cache.to(dtype), ref


def prefill(a, causal=True, dtype=torch.float32, layout="NHD", **kw):
    w = fd.BatchPrefillWithPagedKVCacheWrapper(WS, layout, backend="fa2")
    w.plan(a["qo"], a["ip"], a["ix"], a["lp"], a["hq"], a["hkv"], a["d"], a["ps"], causal=causal,
           pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype, **kw)
    return w


def decode(a, dtype=torch.float32, layout="NHD", tensor_cores=False):
    w = fd.BatchDecodeWithPagedKVCacheWrapper(WS, layout, use_tensor_cores=tensor_cores, backend="fa2")
    w.plan(a["ip"], a["ix"], a["lp"], a["hq"], a["hkv"], a["d"], a["ps"], pos_encoding_mode="NONE",
           q_data_type=dtype, kv_data_type=dtype)
    return w


# ---- 1. the double computes attention ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("pair", [False, True], ids=["one-tensor", "k-v-pair"])
def test_prefill_matches_dense_reference(layout, pair):
    # a fresh prefill, a chunk on a cached prefix (full last page), a 2-token step, a 1-token row among them
    a, q, cache, ref = make_case([5, 3, 2, 1], [5, 8, 11, 7], hq=6, hkv=2, layout=layout)
    w = prefill(a, layout=layout)
    out = w.run(q, (cache[:, 0], cache[:, 1]) if pair else cache)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, atol=1e-6)


@pytest.mark.parametrize("hq,tensor_cores", [(4, False), (10, True)])
def test_decode_matches_dense_reference(hq, tensor_cores):
    a, q, cache, ref = make_case([1] * 5, [1, 4, 5, 8, 13], hq=hq, hkv=2)
    out = decode(a, tensor_cores=tensor_cores).run(q, cache)
    assert torch.allclose(out.double(), ref, atol=1e-6)


def test_bfloat16_and_q_scale():
    a, q, cache, ref = make_case([3, 1], [6, 9], dtype=torch.bfloat16)
    out = prefill(a, dtype=torch.bfloat16).run(q, cache)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 5e-2  # bf16 inputs: the float64 math is exact, the inputs are not
    a, q, cache, _ = make_case([2], [5])
    w = prefill(a)
    scaled = w.run(q, cache, q_scale=0.5)
    assert torch.allclose(scaled, w.run(q * 0.5, cache), atol=1e-6)


def test_non_causal_prefill_sees_every_slot():
    a, q, cache, _ = make_case([3], [3])
    causal, full = prefill(a).run(q, cache), prefill(a, causal=False).run(q, cache)
    assert torch.allclose(causal[-1], full[-1], atol=1e-6) and not torch.allclose(causal[0], full[0])


# ---- 2. malformed plans and runs are refused -----------------------------------------------------------------
def _mutate(a, key, fn):
    b = dict(a)
    b[key] = fn(a[key].clone())
    return b


def _set(i, value):
    def fn(t):
        t[i] = value
        return t
    return fn


BAD_PLANS = {
    # a = make_case([2, 1, 3], [6, 1, 9], ps=4): ip = [0, 2, 3, 6], lp = [2, 1, 1], qo = [0, 2, 3, 6]
    "indptr-int64": ("ip", lambda t: t.long(), "int32"),
    "indices-int64": ("ix", lambda t: t.long(), "int32"),
    "last-page-float": ("lp", lambda t: t.float(), "int32"),
    "indptr-2d": ("ip", lambda t: t[None], "1-D"),
    "indptr-not-from-0": ("ip", _set(0, 1), "start at 0"),
    "indptr-non-monotone": ("ip", _set(1, 4), "increasing"),
    "indptr-end-plus-1": ("ip", _set(-1, 7), "end at 6"),
    "indptr-end-minus-1": ("ip", _set(-1, 5), "end at 6"),
    "indptr-too-short": ("ip", lambda t: t[:-1], "entries for a batch"),
    "empty-request": ("ip", _set(1, 0), "increasing"),
    "last-page-0": ("lp", _set(1, 0), r"outside \[1, page_size=4\]"),
    "last-page-over": ("lp", _set(0, 5), r"outside \[1, page_size=4\]"),
    "negative-page": ("ix", _set(1, -1), "negative"),
    "qo-not-from-0": ("qo", _set(0, 1), "start at 0"),
    "qo-non-monotone": ("qo", _set(1, 4), "non-decreasing"),
    "qo-int64": ("qo", lambda t: t.long(), "int32"),
}


@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_malformed_plan_is_refused(name):
    key, fn, msg = BAD_PLANS[name]
    a, *_ = make_case([2, 1, 3], [6, 1, 9])
    with pytest.raises(ContractError, match=msg):
        prefill(_mutate(a, key, fn))


def test_a_page_listed_twice_and_causal_overflow_are_refused():
    a, *_ = make_case([2, 1, 3], [6, 1, 9])
    with pytest.raises(ContractError, match="lists a page twice"):
        prefill(_mutate(a, "ix", _set(1, int(a["ix"][0]))))
    a, *_ = make_case([4], [3 + 1])
    with pytest.raises(ContractError, match="causal with qo_len 5 > kv_len 4"):
        prefill(_mutate(a, "qo", _set(1, 5)), causal=True)


@pytest.mark.parametrize("change,msg", [
    (dict(q_data_type=torch.int8), "not a dtype"),
    (dict(kv_data_type="float64"), "not a dtype"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "not implemented"),
    (dict(hq=5), "multiple of num_kv_heads"),
    (dict(ps=0), "positive int"),
    (dict(d=8.0), "positive int"),
])
def test_bad_plan_scalars_are_refused(change, msg):
    a, *_ = make_case([2], [5])
    kw = {k: v for k, v in change.items() if k not in a}
    a.update({k: v for k, v in change.items() if k in a})
    w = fd.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", backend="fa2")
    with pytest.raises(ContractError, match=msg):
        w.plan(a["qo"], a["ip"], a["ix"], a["lp"], a["hq"], a["hkv"], a["d"], a["ps"], causal=True,
               **{"q_data_type": torch.float32, **kw})


def test_run_before_plan_and_mismatched_runs_are_refused():
    a, q, cache, _ = make_case([2, 1], [5, 3], hq=4, hkv=2)
    with pytest.raises(RuntimeError, match="before plan"):
        fd.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD").run(q, cache)
    with pytest.raises(RuntimeError, match="before plan"):
        fd.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD").run(q, cache)
    w = prefill(a)
    with pytest.raises(ContractError, match="q has 2 rows, the plan's qo_indptr ends at 3"):
        w.run(q[:2], cache)
    with pytest.raises(ContractError, match="q has 4 rows"):
        w.run(torch.cat([q, q[:1]]), cache)
    with pytest.raises(ContractError, match=r"per row, plan\(\) said \(Hq, D\) = \(4, 8\)"):
        w.run(q[:, :2], cache)
    with pytest.raises(ContractError, match="q_data_type"):
        w.run(q.double(), cache)
    with pytest.raises(ContractError, match="kv_data_type"):
        w.run(q, cache.bfloat16())
    with pytest.raises(ContractError, match=r"per page, plan\(\) said"):
        w.run(q, cache[:, :, :2])  # page_size 2 in the cache, 4 in the plan
    with pytest.raises(ContractError, match="out of range"):
        w.run(q, cache[:int(a["ix"].max())])  # fewer pages than the plan indexes
    with pytest.raises(ContractError, match=r"per page, plan\(\) said"):
        prefill(a, layout="HND").run(q, cache)  # an NHD cache handed to an HND wrapper
    with pytest.raises(ContractError, match="decode"):
        decode(a).run(q, cache)  # decode takes one row per request: [2, 1] is not a decode batch


def test_decode_wrapper_checks_group_size_and_row_count():
    a, q, cache, _ = make_case([1, 1], [5, 3], hq=10, hkv=2)
    with pytest.raises(ContractError, match="use_tensor_cores=True"):
        decode(a)  # group 5 has no CUDA-core kernel
    w = decode(a, tensor_cores=True)
    with pytest.raises(ContractError, match="q has 1 rows"):
        w.run(q[:1], cache)


# ---- 3. FlashInferBackend with an injected off-by-one ----------------------------------------------------------
def _backend_case(flashinfer_double, q_lens, kv_lens, hq=4, hkv=2, d=8, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables, nxt = [], 0
    for kv in kv_lens:
        n = -(-kv // bs)
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))  # reversed pages: logical order matters
        nxt += n
    meta = build_metadata(tables, q_lens, kv_lens, bs)
    cache = torch.randn(nxt + 2, 2, bs, hkv, d, generator=g)
    q, k, v = (torch.randn(sum(q_lens), h, d, generator=g) for h in (hq, hkv, hkv))
    ref = TorchPagedBackend()
    ref.plan(meta, hq, hkv, d, torch.float32)
    expected = ref.forward(q, k, v, cache.clone(), meta, 1 / math.sqrt(d))
    backend = FlashInferBackend("cpu")
    return backend, meta, cache, q, k, v, expected


def _run(backend, meta, cache, q, k, v):
    backend.plan(meta, q.shape[1], k.shape[1], q.shape[2], q.dtype)
    return backend.forward(q, k, v, cache.clone(), meta, 1 / math.sqrt(q.shape[2]))


@pytest.mark.parametrize("q_lens", [[3, 1, 2], [1, 1, 1]], ids=["prefill", "decode"])
def test_backend_through_the_double_matches_torch(flashinfer_double, q_lens):
    backend, meta, cache, q, k, v, expected = _backend_case(flashinfer_double, q_lens, [7, 6, 9])
    got = _run(backend, meta, cache, q, k, v)
    assert torch.allclose(got, expected, atol=1e-5)
    wrapper = flashinfer_double.WRAPPERS[-1] if q_lens[0] == 1 else backend.prefill_wrapper
    assert wrapper.plan_state.kv_lens == [7, 6, 9] and wrapper.num_runs == 1


def _corrupt(monkeypatch, key, fn):
    import engine.attention.flashinfer as fimod

    real = fimod.plan_inputs

    def corrupted(meta, pin=False):
        inp = real(meta, pin)
        inp[key] = fn(inp[key].clone())
        return inp

    monkeypatch.setattr(fimod, "plan_inputs", corrupted)


@pytest.mark.parametrize("q_lens", [[3, 1, 2], [1, 1, 1]], ids=["prefill", "decode"])
@pytest.mark.parametrize("key,fn,raises", [
    ("kv_last_page_len", _set(0, 2), False),  # kv_len 7 -> 6: one slot short, still a valid plan
    ("kv_last_page_len", _set(1, 3), False),  # kv_len 6 -> 7: reads a stale slot
    ("kv_last_page_len", _set(0, 4), False),
    ("kv_last_page_len", _set(1, 5), True),  # past the page
    ("kv_last_page_len", _set(2, 0), True),
    ("kv_indptr", _set(1, 1), False),  # a page moves from request 0 to request 1: valid CSR, wrong pages
    ("kv_indptr", _set(-1, 6), True),  # one short of len(indices)
], ids=["lpl-minus-1", "lpl-plus-1", "lpl-plus-1-full", "lpl-over", "lpl-0", "indptr-shift", "indptr-end"])
def test_an_injected_off_by_one_fails(flashinfer_double, monkeypatch, q_lens, key, fn, raises):
    backend, meta, cache, q, k, v, expected = _backend_case(flashinfer_double, q_lens, [7, 6, 9])
    _corrupt(monkeypatch, key, fn)
    if raises:
        with pytest.raises(ContractError):
            _run(backend, meta, cache, q, k, v)
        return
    got = _run(backend, meta, cache, q, k, v)  # a valid plan, for the wrong lengths or pages
    assert not torch.allclose(got, expected, atol=1e-3), "a corrupted plan went unnoticed"


# ---- 4. CUDA-graph readiness ---------------------------------------------------------------------------------
def test_graph_decode_wrapper_reuses_its_fixed_buffers(flashinfer_double):
    hq, hkv, d, bs = 10, 2, 8, 4
    backend, meta, cache, q, k, v, expected = _backend_case(flashinfer_double, [1, 1, 1], [7, 6, 9], hq=hq)
    scratch = cache.shape[0] - 1  # no sequence's page
    backend.init_cuda_graphs([2, bs], max_pages_per_seq=4, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             dtype=q.dtype, scratch_block=scratch)
    wrapper = backend._graphs[bs].wrapper
    assert wrapper.use_cuda_graph and wrapper.use_tensor_cores and wrapper.fixed_batch_size == bs
    ptrs = [t.data_ptr() for t in wrapper.buffers]
    pad = lambda x: torch.cat([x, torch.zeros(bs - len(x), *x.shape[1:])])  # noqa: E731
    two = build_metadata(meta.block_tables[:2], [1, 1], meta.kv_lens[:2], 4)
    for m, n in ((meta, 3), (two, 2), (meta, 3)):  # 3 then 2 real rows padded to 4: one wrapper, one storage
        backend.plan_graph(m, bs)
        assert [t.data_ptr() for t in wrapper.buffers] == ptrs
        ip, ix, lp = wrapper.buffers
        assert ip.tolist()[:n + 1] == m.kv_indptr.tolist()
        assert lp.tolist() == m.kv_last_page_len.tolist() + [1] * (bs - n)
        assert ix[ip[n]:ip[bs]].tolist() == [scratch] * (bs - n)  # padding rows: one slot of the scratch page
        out = backend.forward(pad(q[:n]), pad(k[:n]), pad(v[:n]), cache.clone(), m, 1 / math.sqrt(d))
        assert out.shape[0] == bs and torch.allclose(out[:n], expected[:n], atol=1e-5)
    # another batch size does not fit this wrapper; too many pages do not fit its indices buffer
    with pytest.raises(ContractError, match="fixed batch size 4"):
        wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, hq, hkv, d, 4, q_data_type=q.dtype)
    big = build_metadata([list(range(20))] * 4, [1] * 4, [70] * 4, 4)
    with pytest.raises(ContractError, match="exceed the fixed indices buffer"):
        wrapper.plan(big.kv_indptr, big.kv_indices, big.kv_last_page_len, hq, hkv, d, 4, q_data_type=q.dtype)


def test_graph_wrapper_reads_the_buffers_at_run_time(flashinfer_double):
    """A replay sees what the fixed buffers hold then: a stale buffer (a missed re-plan) changes the output."""
    a, q, cache, ref = make_case([1] * 3, [5, 3, 8], hq=4, hkv=2)
    bufs = (torch.zeros(4, dtype=torch.int32), torch.zeros(16, dtype=torch.int32), torch.ones(3, dtype=torch.int32))
    w = fd.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                              paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    w.plan(a["ip"], a["ix"], a["lp"], 4, 2, 8, 4, q_data_type=torch.float32)
    assert torch.allclose(w.run(q, cache).double(), ref, atol=1e-6)
    bufs[2][2] -= 1  # as if the buffers were refilled for another step without plan()
    assert not torch.allclose(w.run(q, cache).double(), ref, atol=1e-3)
    with pytest.raises(ContractError, match="batch_size \\+ 1"):
        fd.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0][:3],
                                              paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
