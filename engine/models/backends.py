"""The kernels a loaded model runs on, as EngineConfig names them: `gemm_backend` (its linear layers and LM head)
and `layer_ops` (its norms, RoPE and SiLU-multiply), each a registry whose 'auto' entry picks among the others.

The choice sits above the implementations (engine/models/packed.py, onednn.py, gguf_linear.py, layer_ops.py,
fused_layers.py), which know nothing of it, so no implementation imports another to choose between them.
"""
from __future__ import annotations

from torch import nn

from engine.models import gguf_linear, onednn, packed
from engine.models.fused_layers import FusedLayerOps, why_not_fused
from engine.models.layer_ops import TORCH_LAYER_OPS, CpuLayerOps, TorchLayerOps, can_use_cpu_ops
from util import Registry

#: EngineConfig.gemm_backend -> function (model, quantized) applying it to a loaded model in place
GEMM_BACKENDS: Registry = Registry("gemm_backend")


@GEMM_BACKENDS.register("torch")
def _torch_gemm(model: nn.Module, quantized: bool) -> None:
    pass  # F.linear, as loaded


@GEMM_BACKENDS.register("cpu")
def _cpu_gemm(model: nn.Module, quantized: bool) -> None:
    packed.pack_linears(model)


@GEMM_BACKENDS.register("auto")
def _auto_gemm(model: nn.Module, quantized: bool) -> None:
    """Packs where it can run: a float32 model into float32 panels (CPU with AVX2, unsharded; one loaded from a
    .gguf keeps the file's blocks, engine/models/gguf_linear.py, with the same results), a bfloat16 one for oneDNN
    (engine/models/onednn.py); a quantized model keeps its own kernel."""
    if quantized:
        return
    if packed.can_pack(model) is None:
        if getattr(model, "gguf_path", None) is not None:
            gguf_linear.block_linears(model)
        else:
            packed.pack_linears(model)
    elif onednn.can_pack(model) is None:
        onednn.pack_linears(model)


@GEMM_BACKENDS.register("onednn")
def _onednn_gemm(model: nn.Module, quantized: bool) -> None:
    onednn.pack_linears(model)  # EngineConfig already refused it with quantization


@GEMM_BACKENDS.register("gguf")
def _gguf_gemm(model: nn.Module, quantized: bool) -> None:
    if quantized:
        raise ValueError("gemm_backend='gguf' keeps the file's own blocks; it does not combine with quantization")
    gguf_linear.block_linears(model)


#: EngineConfig.layer_ops -> function choosing the ops object for a loaded model
LAYER_OPS: Registry = Registry("layer_ops")


@LAYER_OPS.register("torch")
def _torch_ops(model: nn.Module) -> TorchLayerOps:
    return TORCH_LAYER_OPS


@LAYER_OPS.register("cpu")
def _cpu_ops(model: nn.Module) -> TorchLayerOps:
    why = can_use_cpu_ops(model)
    if why is not None:
        raise ValueError(f"layer_ops='cpu' cannot run: {why}")
    return CpuLayerOps()


@LAYER_OPS.register("fused")
def _fused_ops(model: nn.Module) -> TorchLayerOps:
    return FusedLayerOps(model)


@LAYER_OPS.register("auto")
def _auto_ops(model: nn.Module) -> TorchLayerOps:
    if why_not_fused(model) is None:
        return FusedLayerOps(model)
    return CpuLayerOps() if can_use_cpu_ops(model) is None else TORCH_LAYER_OPS


def pick_layer_ops(setting: str, model: nn.Module) -> TorchLayerOps:
    """EngineConfig.layer_ops ('auto', 'cpu', 'fused' or 'torch') -> the ops object for `model`. Raises ValueError
    (naming layer_ops) for 'cpu' or 'fused' where it cannot run."""
    return LAYER_OPS.get(setting)(model)
