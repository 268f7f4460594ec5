"""layer_ops 'fused' (engine/models/fused_layers.py, csrc/decoder_layers.cpp): the decoder stack in one C++ call.
It calls the per-layer path's kernels in the same order on the same values, so its hidden states and K/V pages are
compared bit for bit with that path's (CpuLayerOps, one op per call), on tiny random models (float32 panels, a
Qwen2 qkv bias) and on SmolLM2's GGUF blocks; where it does not apply, the forward takes the per-layer path."""
from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_ext

try:
    cpu_ext.load()
except cpu_ext.ExtensionUnavailable as exc:  # no compiler: nothing here can run
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)

from engine.attention.base import build_metadata  # noqa: E402
from engine.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from engine.attention.torch_paged import TorchPagedBackend  # noqa: E402
from engine.models.fused_layers import FusedLayerOps, why_not_fused  # noqa: E402
from engine.models.layer_ops import CpuLayerOps  # noqa: E402
from engine.models.packed import pack_linears  # noqa: E402

# (block tables, query lengths, KV lengths, positions): two 5-token prefills; a mixed step (one sequence's decode
# token, the other's 7-token chunk on top of its 5 cached tokens); a decode step of both
TABLES = [[5, 17, 2, 11], [3, 19, 14, 0]]
STEPS = [(TABLES, [5, 5], [5, 5], list(range(5)) + list(range(40, 45))),
         (TABLES, [1, 7], [6, 12], [5] + list(range(45, 52))),
         (TABLES, [1, 1], [7, 13], [6, 52])]


def _run(model, ops, attn, steps=STEPS, block_size=4, num_blocks=20, seed=3, kv_dtype=torch.float32):
    """Final-normed hidden states of each step and the K/V pages after the last, from fresh caches (NaN where no
    step wrote)."""
    from helpers_models import new_kv_cache

    c = model.config
    model.set_layer_ops(ops)
    caches = new_kv_cache(c.num_layers, num_blocks, block_size, model.num_local_kv_heads, c.head_dim, kv_dtype)
    gen = torch.Generator().manual_seed(seed)
    hidden = []
    for tables, q_lens, kv_lens, pos in steps:
        meta = build_metadata(tables, q_lens, kv_lens, block_size)
        attn.plan(meta, model.num_local_q_heads, model.num_local_kv_heads, c.head_dim, torch.float32)
        ids = torch.randint(0, c.vocab_size, (sum(q_lens),), generator=gen)
        hidden.append(model(ids, torch.tensor(pos), caches, attn, meta))
    return hidden, torch.stack(caches)


def _packed_model(arch):
    from helpers_models import tiny_decoder_pair

    return tiny_decoder_pair(arch, pack_linears, std=0.2)[2]


@pytest.mark.parametrize("kv_dtype", [torch.float32, "int8", "fp8_e4m3"], ids=["float32", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_stack_is_bit_identical_to_the_per_layer_path(arch, kv_dtype):
    """Hidden states and pages (8-bit ones: values and scales, byte for byte) equal the per-layer path's."""
    model = _packed_model(arch)
    assert why_not_fused(model) is None
    fused = FusedLayerOps(model)
    ref_hidden, ref_pages = _run(model, CpuLayerOps(), CpuPagedBackend(), kv_dtype=kv_dtype)
    hidden, pages = _run(model, fused, CpuPagedBackend(), kv_dtype=kv_dtype)
    assert all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))
    if isinstance(kv_dtype, str):
        pages, ref_pages = pages.view(torch.uint8).float(), ref_pages.view(torch.uint8).float()
    assert torch.equal(pages.nan_to_num(), ref_pages.nan_to_num()) and pages.nan_to_num().abs().sum() > 0
    # the comparison can fail: the same call with two layers' weights swapped differs
    wrong = FusedLayerOps(model)
    w = wrong._weights
    w[:18], w[18:36] = w[18:36], w[:18]
    bad_hidden, _ = _run(model, wrong, CpuPagedBackend())
    assert not torch.equal(bad_hidden[0], ref_hidden[0])


def test_fused_stack_on_gguf_blocks_is_bit_identical(smollm2_engine):
    """SmolLM2's default engine (gemm_backend auto = the GGUF blocks) runs fused; its per-layer path agrees."""
    model = smollm2_engine.core.model
    assert model.layer_ops.name == "fused"
    fused = model.layer_ops
    steps = [([[1, 2, 3], [4, 5, 6]], [20, 9], [20, 9], list(range(20)) + list(range(9))),
             ([[1, 2, 3], [4, 5, 6]], [1, 1], [21, 10], [20, 9])]
    try:
        ref_hidden, ref_pages = _run(model, CpuLayerOps(), CpuPagedBackend(), steps, block_size=16, num_blocks=8)
        hidden, pages = _run(model, fused, CpuPagedBackend(), steps, block_size=16, num_blocks=8)
    finally:
        model.set_layer_ops(fused)
    assert all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))
    assert torch.equal(pages.nan_to_num(), ref_pages.nan_to_num())


def test_forward_takes_the_per_layer_path_where_the_call_does_not_apply(monkeypatch):
    model = _packed_model("llama")
    fused = FusedLayerOps(model)
    calls = []
    real = FusedLayerOps.forward_layers
    monkeypatch.setattr(FusedLayerOps, "forward_layers", lambda self, *a: calls.append(1) or real(self, *a))
    # the torch backend: every layer through the module path, same numbers as CpuLayerOps on that backend
    ref, _ = _run(model, CpuLayerOps(), TorchPagedBackend())
    got, _ = _run(model, fused, TorchPagedBackend())
    assert not calls and all(torch.equal(a, b) for a, b in zip(got, ref))
    _run(model, fused, CpuPagedBackend())
    assert len(calls) == len(STEPS)


def test_captured_queries_equal_the_per_layer_paths(monkeypatch):
    """A step that keeps some rows' post-RoPE queries (a compression scorer, query_source 'cache') stays in the
    fused call; its queries, hidden states and pages equal the per-layer path's bit for bit."""
    from engine.attention.base import QueryCapture

    model = _packed_model("llama")
    fused = FusedLayerOps(model)
    rows = torch.tensor([0, 3, 5, 6])  # rows of both sequences in the mixed step

    def run(ops):
        captures = []
        real = build_metadata

        def with_capture(*a, **k):
            meta = real(*a, **k)
            meta.capture = QueryCapture(rows[rows < sum(a[1])], model.config.num_layers)
            captures.append(meta.capture)
            return meta

        monkeypatch.setattr(f"{__name__}.build_metadata", with_capture)
        hidden, pages = _run(model, ops, CpuPagedBackend())
        monkeypatch.undo()
        return hidden, pages, [c.out for c in captures]

    calls = []
    real_forward = FusedLayerOps.forward_layers
    ref = run(CpuLayerOps())
    monkeypatch.setattr(FusedLayerOps, "forward_layers", lambda self, *a: calls.append(1) or real_forward(self, *a))
    got = run(fused)
    assert len(calls) == len(STEPS)
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert torch.equal(got[1].nan_to_num(), ref[1].nan_to_num())
    for a, b in zip(got[2], ref[2]):
        assert a.shape == (model.config.num_layers, b.shape[1], model.num_local_q_heads, model.config.head_dim)
        assert torch.equal(a, b)
    # not vacuous: the queries differ between layers and rows
    assert not torch.equal(got[2][1][0], got[2][1][1]) and not torch.equal(got[2][1][:, 0], got[2][1][:, 1])


def test_which_models_run_fused(make_engine):
    from engine.models.layer_ops import TorchLayerOps
    from helpers_models import tiny_decoder_pair

    assert "per-head q/k norms" in why_not_fused(_packed_model("qwen3"))
    _, _, dense = tiny_decoder_pair("llama", lambda m: m)
    assert "Linear" in why_not_fused(dense)  # gemm_backend torch: F.linear layers
    assert "float32" in why_not_fused(dense.bfloat16()) or "bfloat16" in why_not_fused(dense.bfloat16())
    auto = make_engine().core
    assert auto.model.layer_ops.name == "fused"  # auto: a float32 tiny Llama, packed panels
    assert auto.sampler.argmax == auto.model.layer_ops.argmax
    assert make_engine(layer_ops="cpu").core.model.layer_ops.name == "cpu"
    assert make_engine(gemm_backend="torch").core.model.layer_ops.name == "cpu"  # auto falls back
    assert type(make_engine(dtype="float16", gemm_backend="torch").core.model.layer_ops) is TorchLayerOps
    assert make_engine(dtype="float16").core.model.layer_ops.name == "fused"  # widened: tests/test_bf16_widened.py
    with pytest.raises(ValueError, match="layer_ops='fused' cannot run: .*Linear"):
        make_engine(layer_ops="fused", gemm_backend="torch")


def test_engine_tokens_equal_with_fused_and_per_layer_ops(make_engine):
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 11, 3, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    outs = []
    for ops in ("fused", "cpu"):
        eng = make_engine(layer_ops=ops)
        outs.append([o.outputs[0].token_ids for o in eng.generate(prompts, params)])
    assert outs[0] == outs[1]


def test_profiler_sees_each_kernel_of_the_fused_call():
    """bench/step_floor.py splits a step by kernel with torch.profiler: inside the one fused call each kernel runs
    under a range named as its torch.ops registration, as many of each as the per-layer path calls."""
    from torch.profiler import ProfilerActivity, profile

    model = _packed_model("llama")
    kernels = ("packed_linear", "rms_norm", "rope_", "write_kv", "paged_attention", "silu_mul")

    def counts(ops):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _run(model, ops, CpuPagedBackend(), STEPS[:1])
        return {k: sum(e.count for e in prof.key_averages() if e.key == f"kvllm_cpu::{k}") for k in kernels}

    layers = model.config.num_layers
    fused = counts(FusedLayerOps(model))
    assert fused == counts(CpuLayerOps())
    assert fused["paged_attention"] == layers and fused["packed_linear"] == 4 * layers
