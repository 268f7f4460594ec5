"""The row split (engine/models/row_split.py): a float32 model whose forwards of at most `rows` tokens run the fused
stack on the float32 kernels and whose larger forwards take bfloat16-panel copies of the linears' weights (in the
same fused stack, or layer by layer). Each side is compared bit for bit with what it stands in for (the unsplit
float32 model; the per-layer path of the split model), the linear dispatch at the boundary row count, and when
`dtype='auto'` picks it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import cpu_ext
from engine.models import bf16_panels

try:
    cpu_ext.load()
except cpu_ext.ExtensionUnavailable as exc:
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)
if bf16_panels.available() is not None:
    pytest.skip(f"no bf16 panels here: {bf16_panels.available()}", allow_module_level=True)

from engine.attention.base import build_metadata  # noqa: E402
from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.linear_path import row_split_applies  # noqa: E402
from engine.models.fused_layers import FusedLayerOps  # noqa: E402
from engine.models.gguf_linear import BlockLinear  # noqa: E402
from engine.models.layer_ops import CpuLayerOps  # noqa: E402
from engine.models.bf16_panels import Bf16PanelLinear  # noqa: E402
from engine.models.packed import PackedLinear, pack_linears  # noqa: E402
from engine.models.row_split import split_rows  # noqa: E402

ROWS = 4


def _block_linear(n=48, k=64, seed=0) -> BlockLinear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // 32, generator=g) * 0.02
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    return BlockLinear(nn.Linear(k, n, bias=False), (q, d, m))


@pytest.mark.parametrize("make", [_block_linear, lambda: PackedLinear(nn.Linear(64, 48))], ids=["blocks", "panels"])
def test_linear_dispatch_at_the_boundary(make):
    lin = make()
    holder = nn.Module()
    holder.lin = lin
    assert split_rows(holder, rows=ROWS, panel_rows=None) == 1 and holder.many_rows_above == ROWS
    assert isinstance(lin.many_rows, Bf16PanelLinear)
    with torch.no_grad():  # the bf16 copy holds the layer's own weight, rounded once
        assert torch.equal(lin.many_rows.weight, lin.weight.bfloat16())
    g = torch.Generator().manual_seed(1)
    for rows in (1, ROWS, ROWS + 1, 3 * ROWS):
        x = torch.randn(rows, 64, generator=g)
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 48)
        want = lin.forward_float32(x) if rows <= ROWS else lin.many_rows(x)
        assert torch.equal(got, want), rows
        # either side against float64 over the layer's weight: float32 rounding, or bf16's (inputs and weights)
        ref = x.double() @ lin.weight.double().T + (0 if lin.bias is None else lin.bias.double())
        tol = 1e-5 if rows <= ROWS else 3e-2
        assert torch.allclose(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=0), rows
    # bfloat16 inputs: either side, the output cast back to bf16
    xb = torch.randn(ROWS + 1, 64, generator=g).bfloat16()
    assert torch.equal(lin(xb), lin.many_rows(xb).bfloat16())
    xs = xb[:2]
    assert torch.equal(lin(xs), lin.forward_float32(xs).bfloat16())
    # a boundary off by one is caught: with the threshold one higher, ROWS + 1 rows would take the float32 kernel
    lin.many_rows_above = ROWS + 1
    x = torch.randn(ROWS + 1, 64, generator=g)
    assert not torch.equal(lin(x), lin.many_rows(x))


# two sequences; SMALL: steps of <= ROWS tokens (float32 kernels), LARGE: steps of more (the bfloat16 copies)
TABLES = [[5, 17, 2, 11], [3, 19, 14, 0]]
SMALL = [(TABLES, [2, 2], [2, 2], [0, 1, 40, 41]), (TABLES, [1, 1], [3, 3], [2, 42])]
LARGE = [(TABLES, [5, 6], [5, 6], list(range(5)) + list(range(40, 46))),
         (TABLES, [1, 7], [6, 13], [5] + list(range(46, 53)))]


def _run(model, steps, kv_dtype):
    from helpers_models import new_kv_cache

    c = model.config
    caches = new_kv_cache(c.num_layers, 20, 4, model.num_local_kv_heads, c.head_dim, kv_dtype)
    gen = torch.Generator().manual_seed(3)
    hidden = []
    for tables, q_lens, kv_lens, pos in steps:
        meta = build_metadata(tables, q_lens, kv_lens, 4)
        attn = CpuPagedBackend()
        attn.plan(meta, model.num_local_q_heads, model.num_local_kv_heads, c.head_dim, torch.float32)
        ids = torch.randint(0, c.vocab_size, (sum(q_lens),), generator=gen)
        hidden.append(model(ids, torch.tensor(pos), caches, attn, meta))
    return hidden, torch.stack(caches)


def test_each_side_equals_the_model_it_stands_in_for(monkeypatch):
    from helpers_models import tiny_decoder_pair

    def packed():  # float32, packed panels; the same weights on every call (seeded)
        return tiny_decoder_pair("llama", pack_linears, std=0.2)[2]

    base = packed()
    base.set_layer_ops(FusedLayerOps(base))
    split = packed()
    split_rows(split, rows=ROWS)
    split.set_layer_ops(FusedLayerOps(split))
    # the per-layer path of the same split model: each linear picks its side in Python (packed.split_forward)
    loop = packed()
    split_rows(loop, rows=ROWS)
    loop.set_layer_ops(CpuLayerOps())
    calls = []
    real = FusedLayerOps.forward_layers
    monkeypatch.setattr(FusedLayerOps, "forward_layers", lambda self, *a: calls.append(1) or real(self, *a))

    small, small_pages = _run(split, SMALL, torch.bfloat16)
    assert len(calls) == len(SMALL)
    want, want_pages = _run(base, SMALL, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(small, want))
    assert torch.equal(small_pages.nan_to_num(), want_pages.nan_to_num())

    calls.clear()
    large, large_pages = _run(split, LARGE, torch.bfloat16)
    assert len(calls) == len(LARGE) and all(h.dtype == torch.float32 for h in large)
    want, want_pages = _run(loop, LARGE, torch.bfloat16)
    assert len(calls) == len(LARGE)  # the loop model never took the fused call
    assert all(torch.equal(a, b) for a, b in zip(large, want))
    assert torch.equal(large_pages.nan_to_num(), want_pages.nan_to_num())
    # the float32 model's own answer within bf16 rounding (a wrong weight or layer order would be far off), and not
    # equal to it (a large forward that kept the float32 kernels would be)
    ref, _ = _run(base, LARGE, torch.bfloat16)
    for a, b in zip(large, ref):
        assert (a - b).abs().max() <= 0.05 * b.abs().max()
        assert not torch.equal(a, b)


def test_which_configurations_split(monkeypatch):
    import engine.linear_path as paths

    monkeypatch.setattr(paths, "cpu_has_fast_bf16", lambda: True)
    cpu = torch.device("cpu")
    assert row_split_applies(EngineConfig(model="smollm2"), cpu)
    for change in ({"dtype": "bfloat16"}, {"dtype": "float32"}, {"gemm_backend": "onednn"},
                   {"layer_ops": "cpu"}, {"attention_backend": "torch"}, {"quantization": "int8"}):
        assert not row_split_applies(EngineConfig(model="smollm2", **change), cpu), change
    assert not row_split_applies(EngineConfig(model="smollm2"), torch.device("cuda"))
    assert not row_split_applies(EngineConfig(model="/nonexistent/dir"), cpu)  # not a .gguf (and not fetched)
    monkeypatch.setattr(paths, "cpu_has_fast_bf16", lambda: False)
    assert not row_split_applies(EngineConfig(model="smollm2"), cpu)


def test_smollm2_at_auto_splits_and_serves():
    """The default engine on a CPU with AVX512-BF16: float32 compute, bfloat16 pages, the startup line says so; a
    greedy batch of a short and a long prompt runs both sides (a prefill of > 12 tokens on the bf16 panels, decodes
    of 2 on the quantized ones) to its length, the allocator's invariants holding after."""
    from engine import Engine, SamplingParams
    from engine.config import cpu_has_fast_bf16

    if not cpu_has_fast_bf16():
        pytest.skip("no AVX512-BF16/AMX: dtype auto is float32 without a split")
    eng = Engine(model="smollm2", num_kv_blocks=64, max_model_len=512)
    try:
        core = eng.core
        assert core.row_split and core.dtype == torch.float32 and core.kv_format.name == "bfloat16"
        line = core.compute_line()
        assert "GEMMs of <= 12 rows on 4-bit panels, <= 8 rows on 8-bit panels, of more" in line, line
        # 30 layers x 4 linears (Q4_1) and the LM head (Q8_0), each counted once with its bf16 copy named beside it
        assert "linear layers: QuantPanelLinear (+ a Bf16PanelLinear copy) x121" in line, line
        assert "Bf16PanelLinear x" not in line
        assert core.model.layer_ops.name == "fused" and core.model.many_rows_above == 12
        text = open("/usr/share/common-licenses/GPL-3").read()[:600]
        outs = eng.generate(["The capital of France is", text],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    finally:
        eng.shutdown()
        eng.check_invariants()
