"""Weight-only int8 for CPU inference: `quantize_int8(model)` swaps a loaded DecoderLM's linear layers in place.

    from engine.models.quant import quantize_int8
    quantize_int8(engine.model)                 # q/k/v/o, gate/up/down and the LM head -> int8 weights

Each output channel (row of W) gets one float32 scale, max|row| / 127, and round-to-nearest int8 values
(symmetric, per channel; arXiv:2208.07339 discusses why per-channel scales keep LLM weights accurate at 8 bits).
Activations stay float32, so the matmul is float32 on weights converted to float on the fly by the AVX2 kernel
in csrc/kvllm_cpu.cpp (torch.ops.kvllm_cpu.int8_linear). That kernel was chosen by measurement on the 2-core
AVX2 machine (docs/benchmarks.md): torch's `aten._weight_int8pack_mm` has no fast path without AVX512 (20-40x
slower than the float32 GEMM), and dequantize-then-matmul costs a float32 weight copy per call (slower than
float32 at every batch size). Weights take a quarter of the memory, so batch-1 decode, which only streams
weights, is the case that gains; at large batches the GEMM is compute-bound and int8 cannot beat MKL's fp32.

The embedding lookup keeps its float32 table. With `lm_head=True` (default) the LM head gets an int8 copy of its
weight (tied models: of the embedding) and the model's `compute_logits` is replaced on this instance only.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

PANEL = 16  # output channels per packed panel (the kernel's register tile width)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: returns (q int8 [N, K], scale float32 [N]) with w ~= q * scale[:, None]."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_panels(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] int8 -> [ceil(N/16), K, 16] (the 16 channels of a panel adjacent per input column); N padded with
    zero rows (scale 1) to a multiple of 16."""
    n, k = q.shape
    pad = -n % PANEL
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_ones(pad)])
    return q.view(-1, PANEL, k).transpose(1, 2).contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear (y = x W^T + b) with int8 weights and float32 per-channel scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from engine.attention import cpu_ext

        self._ops = cpu_ext.load()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_weight(linear.weight)
        packed, scale = pack_panels(q, scale)
        self.register_buffer("w_packed", packed)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)
        self.force_portable = False  # the non-AVX2 kernel, for tests on AVX2 machines

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight [out, in] (a new tensor: for code that reads `.weight` directly, such as
        Attention.queries during query recomputation; the forward pass never builds it)."""
        w = self.w_packed.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]
        return w.float() * self.scale[: self.out_features, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        self._ops.int8_linear(x2, self.w_packed, self.scale, self.bias, out, self.force_portable)
        return out.view(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _int8_compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    return self.int8_lm_head(hidden).float()


def quantize_int8(model: nn.Module, lm_head: bool = True) -> nn.Module:
    """Replace every nn.Linear of a loaded DecoderLM (attention and MLP projections, and the LM head when
    `lm_head`) with Int8Linear, in place; returns the model. CPU only; raises ValueError on a CUDA model and
    cpu_ext.ExtensionUnavailable when the kernel cannot be built."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantize_int8 runs on CPU models only, got a model on {device}")
    from engine.attention import cpu_ext

    cpu_ext.load()  # fail before touching the model
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child is not getattr(model, "lm_head", None):
                    setattr(parent, name, Int8Linear(child))
        if lm_head:
            head = getattr(model, "lm_head", None)
            weight = head.weight if head is not None else model.embed_tokens.weight
            src = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            src.weight = nn.Parameter(weight.detach(), requires_grad=False)
            model.int8_lm_head = Int8Linear(src)
            if head is not None:
                model.lm_head = None  # its float32 weight is no longer used
            model.compute_logits = types.MethodType(_int8_compute_logits, model)
    return model


def dequantize_reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """x @ (q * scale)^T + b in float64 from the layer's packed weights (what the kernel must compute)."""
    return F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
