"""A bfloat16 model on a CPU with AVX512-BF16 (engine/linear_path.py `panels_apply`): every linear layer, the LM head
included, on bfloat16 panels (engine/models/bf16_panels.py `panel_linears`), float32 activations, bfloat16 KV pages,
the fused C++ stack. Checked: which configurations take it, what the engine holds, and its teacher-forced
log-probabilities against HF transformers in float64 on the same bfloat16-rounded weights and GEMM inputs: within
a few bf16 roundings with float32 pages, and closer than the bfloat16 oneDNN path (bfloat16 activations) with
bfloat16 pages."""
from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_ext
from engine.config import EngineConfig
from engine.models import bf16_panels

try:
    cpu_ext.load()
except cpu_ext.ExtensionUnavailable as exc:
    pytest.skip(f"C++ extension unavailable: {exc}", allow_module_level=True)


def test_which_configurations_take_panels(monkeypatch, tiny_llama_dir):
    import engine.config as config
    import engine.linear_path as paths

    monkeypatch.setattr(paths, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(bf16_panels, "available", lambda: None)
    cpu, tiny = torch.device("cpu"), str(tiny_llama_dir)
    assert paths.panels_apply(EngineConfig(model=tiny, dtype="bfloat16"), cpu)
    assert paths.panels_apply(EngineConfig(model=tiny), cpu)  # auto is bfloat16 here
    assert paths.panels_apply(EngineConfig(model="smollm2", dtype="bfloat16"), cpu)
    assert not paths.panels_apply(EngineConfig(model="smollm2"), cpu)  # auto on a .gguf: the row split
    for change in ({"dtype": "float32"}, {"dtype": "float16"}, {"gemm_backend": "onednn"}, {"gemm_backend": "torch"},
                   {"layer_ops": "cpu"}, {"attention_backend": "torch"}, {"quantization": "int8"},
                   {"tensor_parallel_size": 2}):
        assert not paths.panels_apply(EngineConfig(model=tiny, **{"dtype": "bfloat16", **change}), cpu), change
    assert not paths.panels_apply(EngineConfig(model=tiny, dtype="bfloat16"), torch.device("cuda"))
    monkeypatch.setattr(bf16_panels, "available", lambda: "the CPU lacks AVX512-BF16")
    assert not paths.panels_apply(EngineConfig(model=tiny, dtype="bfloat16"), cpu)
    monkeypatch.setattr(bf16_panels, "available", lambda: None)
    monkeypatch.setattr(paths, "cpu_has_fast_bf16", lambda: False)
    assert not paths.panels_apply(EngineConfig(model=tiny, dtype="bfloat16"), cpu)


@pytest.mark.skipif(bf16_panels.available() is not None, reason=f"no bf16 panels here: {bf16_panels.available()}")
def test_bf16_engine_runs_on_panels_closer_to_float64_than_onednn(make_engine, tiny_llama_dir, monkeypatch):
    import engine.core
    from engine.models.bf16_panels import Bf16PanelLinear
    from engine.models.onednn import OneDnnLinear

    loaded = []
    real_load = engine.core.load_model
    monkeypatch.setattr(engine.core, "load_model", lambda src, dtype, dev: loaded.append(dtype) or real_load(
        src, dtype, dev))
    eng = make_engine(dtype="bfloat16")
    assert loaded == [torch.bfloat16]  # no float32 copy of the weights on the way to the panels
    core = eng.core
    assert core.panels and core.dtype == torch.float32 and core.kv_format.name == "bfloat16"
    linears = [m for m in core.model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    n_layers = core.model_config.num_layers
    assert len(linears) == 4 * n_layers + 1 and all(isinstance(m, Bf16PanelLinear) for m in linears)
    assert core.model.layer_ops.name == "fused"
    emb = core.model.embed_tokens.weight  # float32 for the activations, bfloat16 values (loaded as bfloat16)
    assert emb.dtype == torch.float32 and torch.equal(emb, emb.bfloat16().float())
    assert f"linear layers: Bf16PanelLinear x{4 * n_layers + 1}" in core.compute_line()
    assert "bfloat16 asked" in core.compute_line()
    onednn = make_engine(dtype="bfloat16", gemm_backend="onednn")
    assert not onednn.core.panels and any(isinstance(m, OneDnnLinear) for m in onednn.core.model.modules())

    # HF in float64 with what the panels round: every weight (the model is loaded as bfloat16) and each linear's
    # input (vdpbf16ps multiplies bfloat16 pairs, accumulating in float32); activations, attention stay unrounded
    from helpers_models import hf_bf16_weight_logprobs, max_logprob_error

    want = hf_bf16_weight_logprobs(tiny_llama_dir, round_linear_inputs=True)
    exact = make_engine(dtype="bfloat16", kv_cache_dtype="float32")
    assert exact.core.panels and exact.core.kv_format.name == "float32"
    errs = {name: max_logprob_error(e, want)
            for name, e in (("panels", eng), ("panels, float32 pages", exact), ("onednn", onednn))}
    # with float32 pages only float32 arithmetic separates it from the reference, and the GEMM inputs it tips to
    # the other bf16 neighbour (a wrong channel is off by ~0.8); bfloat16 pages add their rounding, and oneDNN's
    # path rounds every activation too
    assert errs["panels, float32 pages"] < 5e-3, errs
    assert errs["panels"] < 2e-2 and errs["panels"] < errs["onednn"], errs


@pytest.mark.skipif(bf16_panels.available() is not None, reason=f"no bf16 panels here: {bf16_panels.available()}")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_panel_linears_takes_a_float32_or_bfloat16_model_alike(arch):
    """A bfloat16 model and a float32 copy of its values become the same float32 model on the same panels (logits
    and recomputed queries bit for bit); another dtype is refused, naming why."""
    from helpers_models import assert_converts_to_the_float32_model

    assert_converts_to_the_float32_model(arch, bf16_panels.panel_linears, bf16_panels.panel_linears, torch.float16,
                                         "bfloat16 panels cannot run: the model is torch.float16")


@pytest.mark.skipif(bf16_panels.available() is not None, reason=f"no bf16 panels here: {bf16_panels.available()}")
def test_bf16_engine_compresses_with_recomputed_queries(make_engine):
    """Kara's recomputed window queries (Attention.queries) on the bf16-panel engine, whose qkv layer holds bfloat16
    panels under float32 activations: the rounds run and the sequence reaches its length."""
    from engine import SamplingParams

    kara = {"method": "kara", "window": 16, "buffer": 4, "ratio": 0.25, "chunk_max": 4, "chunk_budget": 2,
            "compression_period": 12, "query_source": "recompute"}
    eng = make_engine(dtype="bfloat16", kv_compression=kara)
    assert eng.core.panels
    prompt = [7, 19, 33, 41, 5, 8, 90, 12, 64, 3, 27, 101, 55, 18, 77, 46, 9, 120, 31, 14]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=56, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 56 and eng.stats().compression.rounds == 4
