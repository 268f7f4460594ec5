"""layer_ops 'fused': a float32 decoder stack on the CPU in one C++ call per forward (csrc/decoder_layers.cpp).

The call runs, layer by layer, the kernels the per-layer path (engine/models/llama.py with CpuLayerOps) calls one
by one: RMSNorm with the residual add, the qkv / o / gate-up / down linears (GGUF blocks, float32 panels (or a
half-precision model's weights packed alike, widened in the kernel), or, for a bfloat16 model, bfloat16 panels;
under a row split, engine/models/row_split.py, quantized panels or the blocks, and their bfloat16-panel copies for
forwards of more tokens), RoPE, the K/V writes and paged attention, SiLU-multiply,
and keeps the post-RoPE queries of the rows a compression scorer asks for (`meta.capture`, the cache query source).
Same kernels, same order, same inputs: the hidden states are bit for bit the per-layer path's. What it removes is
the Python between them (module calls, argument checks, an output allocation per op), which at a small model's
decode step is several milliseconds.

It applies where every one of those kernels would run anyway: a float32 model on the CPU, not split by tensor
parallelism, without per-head q/k norms (Qwen3), every layer linear a BlockLinear, PackedLinear, Bf16PanelLinear or
QuantPanelLinear (gemm_backend gguf or cpu, engine/linear_path.py `panels_apply`, or the row split), the cpu attention
backend on a float or 8-bit cache (engine/attention/cpu_paged.py). A forward that does not qualify takes the
per-layer path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.cpu_paged import CpuPagedBackend
from engine.models.bf16_panels import Bf16PanelLinear
from engine.models.gguf_linear import BlockLinear
from engine.models.layer_ops import CpuLayerOps, can_use_cpu_ops
from engine.models.packed import PackedLinear
from engine.models.quant_panels import QuantPanelLinear

if TYPE_CHECKING:
    from engine.attention.base import AttentionMetadata
    from engine.models.llama import DecoderLM

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn)


def why_not_fused(model: torch.nn.Module) -> str | None:
    """None when FusedLayerOps can run `model`'s decoder stack, else why not (one line)."""
    why = can_use_cpu_ops(model)
    if why is not None:
        return why
    layers = getattr(model, "layers", None)
    if not layers:
        return "the model has no decoder layers"
    if next(model.parameters()).dtype != torch.float32:
        return f"the model is {next(model.parameters()).dtype}, the fused stack takes float32"
    if getattr(model, "tp", None) is not None and model.tp.size > 1:
        return "the model is split by tensor parallelism"
    if model.config.qk_norm:
        return "the model has per-head q/k norms"
    for i, layer in enumerate(layers):
        for name, lin in _linears(layer):
            if not isinstance(lin, (BlockLinear, PackedLinear, Bf16PanelLinear, QuantPanelLinear)):
                return (f"layer {i}'s {name} is a {type(lin).__name__} (the fused stack takes gemm_backend gguf or "
                        f"cpu layers, or bfloat16 or quantized panels)")
    return None


def _linears(layer) -> list[tuple[str, torch.nn.Module]]:
    return [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
            ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]


def _stack_weights(model: DecoderLM, many: bool) -> list[torch.Tensor]:
    """The tensors csrc/decoder_layers.cpp takes, 18 a layer and the final norm's weight; with `many`, each linear's
    bf16-panel copy in place of its own weight."""
    empty = torch.empty(0)
    weights = []
    for layer in model.layers:
        weights.append(layer.input_layernorm.weight)
        for name, lin in _linears(layer):
            if many:
                lin = lin.many_rows
            bias = empty if lin.bias is None else lin.bias
            if isinstance(lin, BlockLinear):
                weights += [lin.q_packed, lin.d, lin.m, bias]
            elif isinstance(lin, Bf16PanelLinear):
                weights += [lin.w_panels, empty, empty, bias]
            elif isinstance(lin, QuantPanelLinear):
                weights += [lin.w_panels, empty, empty, bias]
            else:  # PackedLinear's panels (float32, or a half-precision model's bfloat16 / float16)
                weights += [lin.w_packed, empty, empty, bias]
            if name == "o_proj":
                weights.append(layer.post_attention_layernorm.weight)
    weights.append(model.norm.weight)
    return [w.detach() for w in weights]


class FusedLayerOps(CpuLayerOps):
    """CpuLayerOps plus `forward_layers`, the whole stack in one call, for one model (built for it). Raises
    ValueError (naming layer_ops) where the model does not qualify, cpu_ext.ExtensionUnavailable where the library
    does not load."""

    name = "fused"

    def __init__(self, model: DecoderLM, max_isa: int = 2) -> None:
        why = why_not_fused(model)
        if why is not None:
            raise ValueError(f"layer_ops='fused' cannot run: {why}")
        super().__init__(max_isa)
        self._linears = [lin for layer in model.layers for _, lin in _linears(layer)]
        if len({lin.max_isa for lin in self._linears}) > 1:
            raise ValueError("layer_ops='fused' cannot run: the linear layers' max_isa differ")
        self._weights = _stack_weights(model, many=False)
        # under a row split (engine/models/row_split.py) forwards of more rows take the linears' bf16 copies
        self.many_rows_above: int | None = getattr(model, "many_rows_above", None)
        self._weights_many = None if self.many_rows_above is None else _stack_weights(model, many=True)
        self._no_capture = (torch.empty(0, dtype=torch.int64), torch.empty(0))
        attn = model.layers[0].self_attn
        self._shape = (attn.num_q_heads, attn.num_kv_heads, attn.head_dim, model.layers[0].mlp.down_proj.in_features,
                       attn.scale, model.norm.eps)

    def usable(self, attn, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool:
        """Whether this forward can take the fused call (the backend and cache the kernels take)."""
        cache = kv_caches[0]
        return (type(attn) is CpuPagedBackend and cache.dtype in CACHE_DTYPES and cache.device.type == "cpu"
                and cache.is_contiguous())

    def forward_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                       attn, meta: AttentionMetadata) -> torch.Tensor:
        """Embedded tokens [T, hidden] -> the final-normed hidden states, as DecoderLM.forward's layer loop."""
        hq, hkv, d, inter, scale, eps = self._shape
        many = self._weights_many is not None and h.shape[0] > self.many_rows_above
        rows, out = self._no_capture
        if meta.capture is not None:  # a compression scorer's queries (engine/attention/base.py QueryCapture)
            rows = meta.capture.rows.long()
            out = meta.capture.out = h.new_empty(len(kv_caches), rows.numel(), hq, d)
        weights = self._weights_many if many else self._weights
        return self._ops.decoder_layers(h.contiguous(), weights, kv_caches, cos.contiguous(), sin.contiguous(),
                                        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                                        meta.slot_mapping, hq, hkv, d, inter, float(scale), float(eps),
                                        self._linears[0].max_isa, self.max_isa, attn.max_isa, attn.force_portable,
                                        rows, out)
