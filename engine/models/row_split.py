"""A float32 model split by row count: `split_rows(model)` gives each linear layer a copy of its weight in bfloat16
panels (engine/models/bf16_panels.py, AVX512-BF16 dot products) that runs its calls of more than a few rows
(engine/models/packed.py split_forward); calls of fewer rows run on the GGUF file's own blocks, repacked as
quantized panels (engine/models/quant_panels.py: 4-bit Q4_0 / Q4_1 and 8-bit Q8_0, the weights at their exact
values, the same dot products), or, for blocks of another kind, on the layer's own float32 kernel. Activations,
norms, RoPE and attention stay float32 on either side (the panels take float32 rows and return float32), so the
fused C++ decoder stack (engine/models/fused_layers.py, csrc/decoder_layers.cpp) runs every forward, picking the
weights by the forward's token count. EngineCore applies it for `dtype='auto'` to a model loaded from a .gguf file
on a CPU with AVX512-BF16 (engine/linear_path.py `row_split_applies`), with bfloat16 KV pages.

Why: a decode step of one or a few sequences is bound by the bytes of weights it reads; the quantized panels (0.625
or 1.06 bytes a weight) beat bfloat16 (2 bytes) there, and the float32 kernel on the blocks (1.25 bytes) up to a
few rows. With more rows the GEMMs are bound by multiply-adds, and the bf16 panels do the fewest instructions per
multiply-add. A step's results then depend on how many tokens it holds, as they do in any engine whose kernels
differ by batch size.
"""
from __future__ import annotations

from torch import nn

from engine.models import quant_panels
from engine.models.bf16_panels import Bf16PanelLinear
from engine.models.gguf_linear import BlockLinear
from engine.models.packed import PackedLinear

# The most rows a GEMM keeps on the float32 kernels (docs/benchmarks.md, "GEMMs split by row count") and on the
# quantized panels by bits (docs/benchmarks.md, "Quantized panels").
SPLIT_ROWS = 4
PANEL_ROWS = {4: 12, 8: 8}


def split_rows(model: nn.Module, rows: int = SPLIT_ROWS, panel_rows: dict[int, int] | None = PANEL_ROWS) -> int:
    """In place, for a float32 DecoderLM whose linears are BlockLinear / PackedLinear (the LM head included): each
    BlockLinear whose blocks fit the quantized panels becomes a QuantPanelLinear (unless `panel_rows` is None or the
    panels do not run here), and each linear runs calls of more than `rows` rows (`panel_rows[bits]` on the
    quantized panels) on a bfloat16-panel copy of its weight (packed.split_forward). The fused stack takes those
    copies for forwards of more than `model.many_rows_above` tokens: the decoder linears' smallest limit where
    every one is on quantized panels, else `rows`. Returns how many linear layers got a copy."""
    use_panels = panel_rows is not None and quant_panels.available() is None

    def make(lin: nn.Module) -> nn.Module:
        few = (quant_panels.QuantPanelLinear.of(lin) if use_panels and isinstance(lin, BlockLinear) else None)
        layer = lin if few is None else few
        layer.many_rows = Bf16PanelLinear(lin)
        layer.many_rows_above = rows if few is None else panel_rows[few.bits]
        return layer

    count = 0
    for parent in list(model.modules()):  # the LM head included: model.lm_head_layer is a child of the model
        for name, child in list(parent.named_children()):
            if isinstance(child, (BlockLinear, PackedLinear)):
                setattr(parent, name, make(child))
                count += 1
    decoder = [m for layer in getattr(model, "layers", ()) for m in layer.modules() if hasattr(m, "many_rows")]
    panels = decoder and all(isinstance(m, quant_panels.QuantPanelLinear) for m in decoder)
    model.many_rows_above = min(m.many_rows_above for m in decoder) if panels else rows
    return count
