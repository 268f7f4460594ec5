"""Which path a model's linear layers take on the CPU, decided once from the config before the model loads: the
row split, the bfloat16 panels, half-precision weights widened in the float32 tile, or the GEMM backend asked
(engine/models/backends.py). engine/core.py builds the engine from these answers; docs/DESIGN.md lists the paths."""
from __future__ import annotations

import torch

from engine.config import EngineConfig, cpu_has_fast_bf16, parse_dtype
from engine.loader import gguf_file
from engine.models import bf16_panels, packed


def _cpu_kernels_auto(config: EngineConfig, device: torch.device) -> bool:
    """What every path below needs: an unsharded, unquantized model on the CPU, every kernel choice 'auto'."""
    return (device.type == "cpu" and config.tensor_parallel_size == 1 and config.quantization is None
            and config.gemm_backend == "auto" and config.layer_ops == "auto"
            and config.attention_backend in ("auto", "cpu"))


def _bf16_panels_run(config: EngineConfig, device: torch.device) -> bool:
    """What both bf16-panel paths below need: the kernels auto, on a CPU with AVX512-BF16 (the panels' dot
    products) whose C++ kernels load."""
    return _cpu_kernels_auto(config, device) and cpu_has_fast_bf16() and bf16_panels.available() is None


def row_split_applies(config: EngineConfig, device: torch.device) -> bool:
    """Whether `dtype='auto'` runs the model as float32 with its GEMMs split by row count
    (engine/models/row_split.py): a .gguf model where the bf16 panels run."""
    return (config.dtype == "auto" and _bf16_panels_run(config, device)
            and gguf_file(config.model_source()) is not None)


def panels_apply(config: EngineConfig, device: torch.device) -> bool:
    """Whether a bfloat16 model (`dtype='bfloat16'`, or 'auto' where no row split applies) runs every linear layer
    on bfloat16 panels with float32 activations between them (engine/models/bf16_panels.py `panel_linears`; each
    GEMM rounds its input rows to bfloat16 as a bfloat16 model's would, norms, residuals and attention stay float32),
    where the bf16 panels run. The weights and the KV pages are bfloat16 as asked; the fused C++ decoder stack then
    runs it (it takes float32), where a bfloat16 model would run layer by layer on oneDNN's GEMMs
    (docs/benchmarks.md, "GEMMs split by row count")."""
    return (parse_dtype(config.dtype, device) == torch.bfloat16 and _bf16_panels_run(config, device)
            and not row_split_applies(config, device))


def widen_applies(config: EngineConfig, device: torch.device) -> bool:
    """Whether a half-precision model runs with float32 activations on packed panels of its own weights, which the
    GEMM widens exactly to float32 in its tile (engine/models/packed.py `widen_linears`): bfloat16 where the CPU has
    no bf16 arithmetic (no AVX512-BF16 or AMX: torch and oneDNN emulate it, several times slower), float16 on any
    CPU (kvllm has no float16 GEMM there). Weights and KV pages keep the dtype asked (docs/benchmarks.md, "--dtype
    bfloat16 / float16 on a CPU without their arithmetic")."""
    dtype = parse_dtype(config.dtype, device)
    half = dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_has_fast_bf16())
    return half and _cpu_kernels_auto(config, device) and packed.kernel_missing() is None
