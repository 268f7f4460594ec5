"""Packed linear layers for the CPU path: `pack_linears(model)` swaps a loaded DecoderLM's linear layers
(and the LM head) for PackedLinear, whose weight is stored in panels of 16 output channels, [N/16, K, 16], and
multiplied by the micro-kernels of csrc/kvllm_cpu.cpp (torch.ops.kvllm_cpu.packed_linear): a 6-row x 16-channel
AVX2 tile, or on CPUs with AVX-512F an 8-row x 3-panel tile (one zmm per panel row, each panel streamed with a
software prefetch ahead), picked at run time.

Why: MKL's sgemm runs the decode shapes of a small model (M <= 64 rows, K = hidden or intermediate size) well
below the core's FMA peak, and these GEMMs are most of a decode step; a register tile over panels read in place
(the int8 kernel's, engine/models/quant.py) keeps the FMA units busy at those shapes (docs/results/cpu_kernels.md,
"Packed float32 GEMM vs torch (MKL)"). Same dtype, same math, a different summation order: results differ from
F.linear by float32 rounding only (tests/test_packed_linear.py).

Engine use: EngineConfig.gemm_backend (engine/models/backends.py; 'auto' packs on a CPU with AVX2, AVX-512 CPUs included, when the model is
float32, unsharded and not quantized; a model loaded from a .gguf file gets engine/models/gguf_linear.py's
BlockLinear instead, the same kernel tile on the file's own blocks). The embedding keeps its float32 table; the LM
head (a tied one: a copy of the embedding) becomes a packed layer the model holds, `DecoderLM.lm_head_layer`.
A bfloat16 or float16 model that engine/linear_path.py `widen_applies` picks keeps its linears' values as panels of
its own dtype (`widen_linears`): the kernel widens them exactly in its tile, so they compute what float32 panels of
the same values would, bit for bit, while a step reads half the weight bytes.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention import cpu_ext

PANEL = 16  # output channels per panel (the kernel's register tile width)
HALF_PANELS = (torch.bfloat16, torch.float16)  # panel dtypes the kernel widens in its tile


def pack_weight(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16] of `dtype` (the 16 channels of a panel adjacent per input column), N padded with
    zero rows to a multiple of 16."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    n, k = w.shape
    w = w.detach().to(dtype)
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


def split_forward(layer: nn.Module, x: torch.Tensor, float32_forward: Callable) -> torch.Tensor:
    """A float32 layer's forward under a row split (engine/models/row_split.py): more than `many_rows_above` rows on
    its bfloat16 copy, the others on `float32_forward`; the output in x's dtype. Without a split: float32_forward."""
    if layer.many_rows is None:
        return float32_forward(x)
    if x.numel() > layer.many_rows_above * layer.in_features:
        return layer.many_rows(x).to(x.dtype)
    out = float32_forward(x)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class PackedLinear(nn.Module):
    """Drop-in for a float32 nn.Linear (y = x W^T + b) on the CPU, weight in 16-channel panels: float32, or
    bfloat16 / float16 (`panel_dtype`, a half-precision model's own weights: the kernel widens them exactly in its
    tile, so the layer computes the float32 layer of the same values on half the weight bytes)."""

    def __init__(self, linear: nn.Linear, panel_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if panel_dtype not in HALF_PANELS + (torch.float32,):
            raise ValueError(f"panel_dtype must be float32, bfloat16 or float16, got {panel_dtype}")
        if panel_dtype != torch.float32 and not torch.equal(linear.weight.to(panel_dtype).to(linear.weight.dtype),
                                                            linear.weight):
            raise ValueError(f"the layer's weights are not all {panel_dtype} values: panel_dtype would round them")
        self._ops = cpu_ext.load()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w_packed", pack_weight(linear.weight, panel_dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                  requires_grad=False)
        self.max_isa = 2  # the best kernel the CPU has; 1 keeps the AVX2 tile (tests, benchmarks)
        self.many_rows: nn.Module | None = None  # a bf16 copy for calls of more rows (engine/models/row_split.py)
        self.many_rows_above = 0

    @property
    def weight(self) -> torch.Tensor:
        """The dense float32 weight [out, in] (a new tensor: for code that reads `.weight` directly, such as
        the GEMM floor of bench/; the forward and query recomputation never build it)."""
        return self.w_packed.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_forward(self, x, self.forward_float32)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        return rows_through(x, self.in_features, self.out_features,
                            lambda x2, out: self._ops.packed_linear(x2, self.w_packed, self.bias, out, self.max_isa))

    def extra_repr(self) -> str:
        dtype = str(self.w_packed.dtype).removeprefix("torch.")
        half = "" if dtype == "float32" else f", panels={dtype}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + half)


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


def kernel_missing() -> str | None:
    """None when the packed kernel runs on this host (the C++ extension loads, the CPU has AVX2 + FMA), else why not."""
    try:
        ops = cpu_ext.load()
    except cpu_ext.ExtensionUnavailable as exc:
        return f"the C++ extension is unavailable ({exc})"
    return None if ops.has_avx2() else "the CPU lacks AVX2 + FMA"


def can_pack(model: nn.Module) -> str | None:
    """None when pack_linears(model) can run here, else why not (one line)."""
    return unsharded_cpu_model(model, torch.float32, "the kernel is") or kernel_missing()


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every unsharded nn.Linear of a loaded float32 DecoderLM (attention and MLP projections) with
    PackedLinear and give the LM head a packed weight, in place; returns the model. Raises ValueError (naming
    gemm_backend) where it cannot run: see can_pack."""
    why = can_pack(model)
    if why is not None:
        raise ValueError(f"gemm_backend='cpu' cannot run: {why}")
    return swap_linears(model, PackedLinear)


def widen_linears(model: nn.Module) -> nn.Module:
    """In place: a loaded bfloat16 or float16 DecoderLM becomes a float32 model of the same values (either -> float32
    is exact) whose linear layers and LM head keep those values as half-precision panels (PackedLinear with
    `panel_dtype`), widened to float32 inside the GEMM tile; the embedding and norms become float32. Returns the
    model. For a half-precision model whose GEMMs this CPU would emulate (engine/linear_path.py `widen_applies`):
    the weights are the ones asked for, at their size, and the products and sums are float32, as a half-precision
    GEMM accumulates. Raises ValueError where the model is of another dtype or the kernel cannot run."""
    dtype = next(model.parameters()).dtype
    why = (unsharded_cpu_model(model, dtype, "widening takes") if dtype in HALF_PANELS
           else f"the model is {dtype}, widening takes bfloat16 or float16") or kernel_missing()
    if why is not None:
        raise ValueError(f"half-precision weights on the packed kernel cannot run: {why}")
    swap_linears(model, lambda linear: PackedLinear(linear, dtype))
    for p in model.parameters():
        p.data = p.data.float()
    return model


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """In place: every nn.Linear of a loaded DecoderLM but the LM head becomes make(linear); the LM head (or a tied
    embedding) gets a copy make()'d as `model.lm_head_layer`, which DecoderLM.compute_logits then runs, and the dense
    head is dropped. Shared by the packed backends (here, engine/models/onednn.py and gguf_linear.py)."""
    with torch.no_grad():
        head = getattr(model, "lm_head", None)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child is not head:
                    setattr(parent, name, make(child))
        weight = head.weight if head is not None else model.embed_tokens.weight
        src = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        src.weight = nn.Parameter(weight.detach(), requires_grad=False)
        model.lm_head_layer = make(src)
        if head is not None:
            model.lm_head = None  # its dense weight is no longer used
    return model
