"""`dtype='bfloat16'` on a CPU without bf16 arithmetic, and `dtype='float16'` on any CPU (engine/linear_path.py
`widen_applies`): the model is loaded in that dtype, its linears packed as panels of that dtype which the kernel
widens exactly in its tile, the rest widened to float32 (engine/models/packed.py `widen_linears`), float32
activations, KV pages of that dtype, the fused C++ stack.
Checked: which configurations take it, what the engine holds, and its teacher-forced log-probabilities against HF
transformers in float64 on the same rounded weights: within float32 rounding with float32 pages, a few roundings
with half-precision pages; the float32 model (weights not rounded) is outside that bound, so a widening that
skipped the rounding fails."""
from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_ext
from engine.config import EngineConfig
from engine.models import packed

try:
    cpu_ext.load()
except cpu_ext.ExtensionUnavailable as exc:
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)

needs_avx2 = pytest.mark.skipif(packed.kernel_missing() is not None, reason=f"{packed.kernel_missing()}")


@pytest.fixture
def no_fast_bf16(monkeypatch):
    """This host as one without AVX512-BF16 / AMX, whatever it is (the bf16 panels then do not apply)."""
    import engine.config as config
    import engine.core as core
    import engine.linear_path as paths

    monkeypatch.setattr(core, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(paths, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)


def test_which_configurations_widen(monkeypatch, no_fast_bf16, tiny_llama_dir):
    import engine.linear_path as paths

    monkeypatch.setattr(packed, "kernel_missing", lambda: None)
    cpu, tiny = torch.device("cpu"), str(tiny_llama_dir)
    assert paths.widen_applies(EngineConfig(model=tiny, dtype="bfloat16"), cpu)
    assert paths.widen_applies(EngineConfig(model="smollm2", dtype="bfloat16"), cpu)
    assert paths.widen_applies(EngineConfig(model=tiny, dtype="float16"), cpu)
    assert not paths.widen_applies(EngineConfig(model=tiny), cpu)  # auto is float32 on such a CPU
    for change in ({"dtype": "float32"}, {"gemm_backend": "onednn"}, {"gemm_backend": "torch"},
                   {"gemm_backend": "cpu"}, {"layer_ops": "cpu"}, {"attention_backend": "torch"},
                   {"quantization": "int8"}, {"tensor_parallel_size": 2}):
        assert not paths.widen_applies(EngineConfig(model=tiny, **{"dtype": "bfloat16", **change}), cpu), change
    assert not paths.widen_applies(EngineConfig(model=tiny, dtype="bfloat16"), torch.device("cuda"))
    monkeypatch.setattr(packed, "kernel_missing", lambda: "the CPU lacks AVX2 + FMA")
    assert not paths.widen_applies(EngineConfig(model=tiny, dtype="bfloat16"), cpu)
    monkeypatch.setattr(packed, "kernel_missing", lambda: None)
    monkeypatch.setattr(paths, "cpu_has_fast_bf16", lambda: True)  # there the bf16 panels' path is the one
    assert not paths.widen_applies(EngineConfig(model=tiny, dtype="bfloat16"), cpu)
    assert paths.widen_applies(EngineConfig(model=tiny, dtype="float16"), cpu)  # no float16 GEMM anywhere


@needs_avx2
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_engine_runs_on_its_half_panels(make_engine, tiny_llama_dir, monkeypatch, no_fast_bf16, dtype):
    import engine.core
    from engine.models.packed import PackedLinear

    loaded = []
    real_load = engine.core.load_model
    monkeypatch.setattr(engine.core, "load_model", lambda src, dtype, dev: loaded.append(dtype) or real_load(
        src, dtype, dev))
    half = getattr(torch, dtype)
    eng = make_engine(dtype=dtype)
    assert loaded == [half]  # the weights pass through that dtype: they hold its values
    core = eng.core
    assert core.widened and not core.panels and core.dtype == torch.float32 and core.kv_format.name == dtype
    linears = [m for m in core.model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    n_layers = core.model_config.num_layers
    assert len(linears) == 4 * n_layers + 1 and all(isinstance(m, PackedLinear) for m in linears)
    assert all(m.w_packed.dtype == half for m in linears)  # the weights at their own size
    assert core.model.layer_ops.name == "fused"
    for p in core.model.parameters():
        assert p.dtype == torch.float32 and torch.equal(p, p.to(half).float())
    line = core.compute_line()
    assert f"linear layers: PackedLinear x{4 * n_layers + 1}" in line
    assert f"{dtype} asked" in line and f"KV pages {dtype}" in line
    assert ("on a CPU without bf16 arithmetic" if dtype == "bfloat16" else "no float16 GEMM on the CPU") in line

    # HF in float64 on the bfloat16-rounded weights; the linears' inputs and the activations stay unrounded
    from helpers_models import hf_bf16_weight_logprobs, max_logprob_error

    want = hf_bf16_weight_logprobs(tiny_llama_dir, round_linear_inputs=False, dtype=half)
    exact = make_engine(dtype=dtype, kv_cache_dtype="float32")
    assert exact.core.widened and exact.core.kv_format.name == "float32"
    unrounded = make_engine(dtype="float32")  # what a widening that skipped the bfloat16 rounding would compute
    errs = {name: max_logprob_error(e, want)
            for name, e in (("half pages", eng), ("float32 pages", exact), ("float32 weights", unrounded))}
    assert errs["float32 pages"] < 1e-4, errs  # float32 arithmetic alone
    assert errs["half pages"] < 2e-2, errs
    assert errs["float32 weights"] > 10 * errs["float32 pages"], errs


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_widen_linears_is_the_float32_model_of_the_same_values(arch, dtype):
    """A widened bfloat16 or float16 model (half panels) and a packed float32 copy of its values give the same logits
    and recomputed queries bit for bit; a float32 model is refused, naming why."""
    from helpers_models import assert_converts_to_the_float32_model

    assert_converts_to_the_float32_model(arch, packed.widen_linears, packed.pack_linears, torch.float32,
                                         "half-precision weights on the packed kernel cannot run: the model is "
                                         "torch.float32, widening takes bfloat16 or float16", dtype=dtype)
