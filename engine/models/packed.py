"""Packed float32 linear layers for the CPU path: `pack_linears(model)` swaps a loaded DecoderLM's linear layers
(and the LM head) for PackedLinear, whose weight is stored in panels of 16 output channels, [N/16, K, 16], and
multiplied by the micro-kernels of csrc/kvllm_cpu.cpp (torch.ops.kvllm_cpu.packed_linear): a 6-row x 16-channel
AVX2 tile, or on CPUs with AVX-512F an 8-row x 3-panel tile (one zmm per panel row, each panel streamed with a
software prefetch ahead), picked at run time.

Why: MKL's sgemm runs the decode shapes of a small model (M <= 64 rows, K = hidden or intermediate size) well
below the core's FMA peak, and these GEMMs are most of a decode step; a register tile over panels read in place
(the int8 kernel's, engine/models/quant.py) keeps the FMA units busy at those shapes (docs/results/cpu_kernels.md,
"Packed float32 GEMM vs torch (MKL)"). Same dtype, same math, a different summation order: results differ from
F.linear by float32 rounding only (tests/test_packed_linear.py).

Engine use: EngineConfig.gemm_backend ('auto' packs on a CPU with AVX2, AVX-512 CPUs included, when the model is
float32, unsharded and not quantized; a model loaded from a .gguf file gets engine/models/gguf_linear.py's
BlockLinear instead, the same kernel tile on the file's own blocks). The embedding keeps its float32 table; a tied
LM head gets a packed copy of it.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from util import Registry

#: EngineConfig.gemm_backend -> function (model, quantized) applying it to a loaded model in place
GEMM_BACKENDS: Registry = Registry("gemm_backend")

PANEL = 16  # output channels per panel (the kernel's register tile width)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N/16), K, 16] (the 16 channels of a panel adjacent per input column), N padded with
    zero rows to a multiple of 16."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    n, k = w.shape
    w = w.detach().float()
    pad = -n % PANEL
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, PANEL, k).transpose(1, 2).contiguous()


def rows_through(x: torch.Tensor, in_features: int, out_features: int,
                 kernel: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """x [..., in] as contiguous float32 rows [M, in] through `kernel(rows, out)`, which fills out [M, out];
    returns out as [..., out]."""
    shape = x.shape
    x2 = x.reshape(-1, in_features)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32, device=x.device)
    kernel(x2, out)
    return out.view(*shape[:-1], out_features)


class PackedLinear(nn.Module):
    """Drop-in for a float32 nn.Linear (y = x W^T + b) on the CPU, weight in 16-channel panels."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from engine.attention import cpu_ext

        self._ops = cpu_ext.load()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w_packed", pack_weight(linear.weight))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)
        self.max_isa = 2  # the best kernel the CPU has; 1 keeps the AVX2 tile (tests, benchmarks)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in] (a new tensor: for code that reads `.weight` directly, such as
        Attention.queries during query recomputation and the GEMM floor of bench/; the forward never builds it)."""
        return self.w_packed.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_through(x, self.in_features, self.out_features,
                            lambda x2, out: self._ops.packed_linear(x2, self.w_packed, self.bias, out, self.max_isa))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _packed_compute_logits(self, hidden: torch.Tensor, all_ranks: bool = False) -> torch.Tensor:
    return self.packed_lm_head(hidden.float())


def unsharded_cpu_model(model: nn.Module, dtype: torch.dtype, layers: str) -> str | None:
    """None when `model` is an unsharded `dtype` model on the CPU, else why not (one line; `layers` names what
    needs it)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device}"
    if param.dtype != dtype:
        return f"the model is {param.dtype}, {layers} {str(dtype).removeprefix('torch.')}"
    if getattr(getattr(model, "tp", None), "size", 1) != 1:
        return "tensor_parallel_size > 1 (the layers are sharded)"
    return None


def can_pack(model: nn.Module) -> str | None:
    """None when pack_linears(model) can run here, else why not (one line)."""
    from engine.attention import cpu_ext

    why = unsharded_cpu_model(model, torch.float32, "the kernel is")
    if why is not None:
        return why
    try:
        ops = cpu_ext.load()
    except cpu_ext.ExtensionUnavailable as exc:
        return f"the C++ extension is unavailable ({exc})"
    if not ops.has_avx2():
        return "the CPU lacks AVX2 + FMA"
    return None


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every unsharded nn.Linear of a loaded float32 DecoderLM (attention and MLP projections) with
    PackedLinear and give the LM head a packed weight, in place; returns the model. Raises ValueError (naming
    gemm_backend) where it cannot run: see can_pack."""
    why = can_pack(model)
    if why is not None:
        raise ValueError(f"gemm_backend='cpu' cannot run: {why}")
    return swap_linears(model, PackedLinear, _packed_compute_logits)


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], compute_logits) -> nn.Module:
    """In place: every nn.Linear of a loaded DecoderLM but the LM head becomes make(linear); the LM head (or a tied
    embedding) gets a copy make()'d as `model.packed_lm_head`, the dense head is dropped, and `compute_logits(model,
    hidden, all_ranks=False)` becomes the model's. Shared by the packed backends (here and engine/models/onednn.py)."""
    with torch.no_grad():
        head = getattr(model, "lm_head", None)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child is not head:
                    setattr(parent, name, make(child))
        weight = head.weight if head is not None else model.embed_tokens.weight
        src = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        src.weight = nn.Parameter(weight.detach(), requires_grad=False)
        model.packed_lm_head = make(src)
        if head is not None:
            model.lm_head = None  # its dense weight is no longer used
        model.compute_logits = types.MethodType(compute_logits, model)
    return model


@GEMM_BACKENDS.register("torch")
def _torch_gemm(model: nn.Module, quantized: bool) -> None:
    pass  # F.linear, as loaded


@GEMM_BACKENDS.register("cpu")
def _cpu_gemm(model: nn.Module, quantized: bool) -> None:
    pack_linears(model)


@GEMM_BACKENDS.register("auto")
def _auto_gemm(model: nn.Module, quantized: bool) -> None:
    """Packs where it can run: a float32 model into these panels (CPU with AVX2, unsharded; one loaded from a .gguf
    keeps the file's blocks, engine/models/gguf_linear.py, with the same results), a bfloat16 one for oneDNN
    (engine/models/onednn.py); a quantized model keeps its own kernel."""
    from engine.models import gguf_linear, onednn

    if quantized:
        return
    if can_pack(model) is None:
        if getattr(model, "gguf_path", None) is not None:
            gguf_linear.block_linears(model)
        else:
            pack_linears(model)
    elif onednn.can_pack(model) is None:
        onednn.pack_linears(model)
