"""Weight-only int8 for CPU inference: `quantize_int8(model)` swaps a loaded DecoderLM's linear layers in place.

    from engine.models.quant import quantize_int8
    quantize_int8(engine.model)                 # q/k/v/o, gate/up/down and the LM head -> int8 weights

Each output channel (row of W) gets one float32 scale per group of 32 input columns, max|group| / 127, and
round-to-nearest int8 values (symmetric; the grouping of GGUF's Q8_0): per-row scales drift from fp32's greedy
output much sooner than groups of 32 do.
Activations stay float32, so the matmul is float32 on weights converted to float on the fly by the AVX2 kernel
in csrc/kvllm_cpu.cpp (torch.ops.kvllm_cpu.int8_linear): torch's `aten._weight_int8pack_mm` has no fast path
without AVX512, and dequantize-then-matmul copies the weight to float32 on every call. Weights take a quarter of
the memory, so batch-1 decode, which only streams weights, is the case that gains; at large batches the GEMM is
compute-bound and int8 cannot beat a float32 GEMM. The measurements: docs/results/cpu_kernels.md.

The embedding lookup keeps its float32 table. With `lm_head=True` (default) the LM head becomes an Int8Linear the
model holds, `DecoderLM.lm_head_layer`, quantized from the head's weight (tied models: the embedding's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import cpu_ext
from engine.models.packed import PackedLinear
from util import Registry

#: quantization name -> function quantizing a loaded model in place (EngineConfig.quantization)
QUANTIZATIONS: Registry = Registry("quantization")

PANEL = 16  # output channels per packed panel (the kernel's register tile width)
GROUP = 32  # input columns per scale


def group_size_for(in_features: int, group_size: int | None) -> int:
    """The group actually used: `group_size` when it divides in_features, else one group per row."""
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive integer or None, got {group_size!r}")
    return group_size if group_size and in_features % group_size == 0 else in_features


def quantize_weight(w: torch.Tensor, group_size: int | None = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output channel and group of input columns: returns (q int8 [N, K],
    scale float32 [N, K / G]) with w[n, k] ~= q[n, k] * scale[n, k // G]."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    n, k = w.shape
    g = group_size_for(k, group_size)
    w = w.detach().float().reshape(n, k // g, g)
    amax = w.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale


def pack_panels(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] -> [ceil(N/16), K, 16] and scale [N, groups] -> [ceil(N/16), groups, 16] (the 16 channels of a
    panel adjacent per input column / group); N padded with zero rows (scale 1) to a multiple of 16."""
    n, k = q.shape
    pad = -n % PANEL
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_ones(pad, scale.shape[1])])
    packed = q.view(-1, PANEL, k).transpose(1, 2).contiguous()
    return packed, scale.view(-1, PANEL, scale.shape[1]).transpose(1, 2).contiguous()


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear (y = x W^T + b) with int8 weights and float32 per-channel scales."""

    def __init__(self, linear: nn.Linear, group_size: int | None = GROUP) -> None:
        super().__init__()
        self._ops = cpu_ext.load()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size_for(linear.in_features, group_size)
        q, scale = quantize_weight(linear.weight, self.group_size)
        packed, scale = pack_panels(q, scale)
        self.register_buffer("w_packed", packed)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)
        self.force_portable = False  # the non-AVX2 kernel, for tests on AVX2 machines

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight [out, in] (a new tensor: for code that reads `.weight` directly; the
        forward pass and query recomputation never build it)."""
        w = self.w_packed.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].float()
        scale = self.scale.transpose(1, 2).reshape(-1, self.scale.shape[1])[: self.out_features]
        return w * scale.repeat_interleave(self.group_size, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        self._ops.int8_linear(x2, self.w_packed, self.scale, self.bias, out, self.force_portable)
        return out.view(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")


def quantize_int8(model: nn.Module, lm_head: bool = True, group_size: int | None = GROUP) -> nn.Module:
    """Replace every nn.Linear of a loaded DecoderLM (attention and MLP projections, and the LM head when
    `lm_head`) with Int8Linear (one scale per channel and `group_size` input columns; None: per channel), in
    place; returns the model. CPU only; raises ValueError on a CUDA model or a bad group_size and
    cpu_ext.ExtensionUnavailable when the kernel cannot be built."""
    device = next(model.parameters()).device
    if getattr(getattr(model, "tp", None), "size", 1) != 1:
        raise ValueError("quantize_int8 does not shard: use it with tensor_parallel_size 1")
    if device.type != "cpu":
        raise ValueError(f"quantize_int8 runs on CPU models only, got a model on {device}")
    group_size_for(1, group_size)  # validate
    cpu_ext.load()  # fail before touching the model
    head = getattr(model, "lm_head", None)
    held = getattr(model, "lm_head_layer", None)  # a GEMM backend's packed head (engine/models/packed.py)
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                # the TP layers subclass nn.Linear; unsharded (tp size 1) they are plain linears
                unsharded = getattr(getattr(child, "tp", None), "size", 1) == 1
                # a packed float32 layer (engine/models/packed.py) is quantized from its dense weight alike
                if (isinstance(child, (nn.Linear, PackedLinear)) and unsharded and child is not head
                        and child is not held):
                    setattr(parent, name, Int8Linear(child, group_size))
        if lm_head:
            weight = (head.weight if head is not None else held.weight if held is not None
                      else model.embed_tokens.weight)
            src = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            src.weight = nn.Parameter(weight.detach(), requires_grad=False)
            model.lm_head_layer = Int8Linear(src, group_size)
            if head is not None:
                model.lm_head = None  # its float32 weight is no longer used
    return model


def dequantize_reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """x @ (q * scale)^T + b in float64 from the layer's packed weights (what the kernel must compute)."""
    return F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())


@QUANTIZATIONS.register("int8")
def _int8(model: nn.Module) -> None:
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("quantization='int8' is for the CPU path (its kernel is AVX2 C++)")
    quantize_int8(model)
