"""bfloat16 linear layers for the CPU path with their weights pre-packed once for oneDNN: `pack_linears(model)`
swaps a loaded bfloat16 DecoderLM's linear layers (and the LM head) for OneDnnLinear, whose weight is reordered at
load into the blocked layout oneDNN's bf16 matmul reads (torch.ops.mkldnn._reorder_linear_weight, the packing
torch inductor applies to frozen CPU linears) and multiplied by torch.ops.mkldnn._linear_pointwise.

Why: F.linear on a plain bfloat16 weight reorders the whole weight into that layout on every call, a cost that
does not shrink with the rows: at the few rows of a small decode batch it is most of the call
(docs/results/cpu_kernels.md), while the result is bit-identical to the packed call (tests/test_onednn_linear.py).
vLLM's CPU backend packs its bf16 weights for oneDNN the same way.

Engine use: EngineConfig.gemm_backend (engine/models/backends.py; 'auto' packs a bfloat16, unsharded, unquantized model on a CPU whose torch
has oneDNN with bf16 support; 'onednn' asks for it). The embedding keeps its table; the LM head (a tied one: a copy
of the embedding) becomes a packed layer the model holds, `DecoderLM.lm_head_layer`. The packed weight is an opaque oneDNN tensor, not a buffer: `.weight` rebuilds the dense one.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.packed import swap_linears, unsharded_cpu_model

PACK_ROWS_HINT = 64  # the row count oneDNN tunes the packed layout for (any count runs); a decode batch's size


def available() -> str | None:
    """None when this torch can pack bf16 weights for oneDNN, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN reports no bf16 support on this CPU"
    return None


class OneDnnLinear(nn.Module):
    """Drop-in for a bfloat16 nn.Linear (y = x W^T + b) on the CPU, weight packed once for oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.w_packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().bfloat16(), PACK_ROWS_HINT)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().bfloat16().clone(),
                                                                  requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in] (a new tensor, for code that reads `.weight` directly, such as
        the GEMM floor of bench/; the forward and query recomputation never build it)."""
        return self.w_packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            x = x.bfloat16()
        return torch.ops.mkldnn._linear_pointwise(x, self.w_packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(model: nn.Module) -> str | None:
    """None when pack_linears(model) can run here, else why not (one line)."""
    return unsharded_cpu_model(model, torch.bfloat16, "the packed oneDNN layers are") or available()


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every unsharded nn.Linear of a loaded bfloat16 DecoderLM with OneDnnLinear and give the LM head a
    packed weight, in place; returns the model. Raises ValueError (naming gemm_backend) where it cannot run."""
    why = can_pack(model)
    if why is not None:
        raise ValueError(f"gemm_backend='onednn' cannot run: {why}")
    return swap_linears(model, OneDnnLinear)

