"""A float32 model split by row count: `split_rows(model)` gives each linear layer a copy of its weight in bfloat16
panels (engine/models/bf16_panels.py, AVX512-BF16 dot products) that runs its calls of more than `rows` rows
(engine/models/packed.py split_forward); calls of at most `rows` rows stay on the layer's own float32 kernel (the
GGUF file's blocks for a .gguf model). A layer whose blocks are 4-bit (Q4_0, Q4_1) is first swapped for 4-bit
panels (engine/models/q4_panels.py), which run calls of at most Q4_ROWS rows, the weights at their exact values.
Activations, norms, RoPE and attention stay float32 on either side (the panels take float32 rows and return
float32), so the fused C++ decoder stack (engine/models/fused_layers.py, csrc/decoder_layers.cpp) runs every
forward, picking the weights by the forward's token count. EngineCore applies it for `dtype='auto'` to a model
loaded from a .gguf file on a CPU with AVX512-BF16 (engine/core.py, `row_split_applies`), with bfloat16 KV pages.

Why: a decode step of one or a few sequences is bound by the bytes of weights it reads; the file's blocks (~1.25
bytes a weight) beat bfloat16 (2 bytes) there, and the 4-bit panels (0.625, with bf16 dot products) beat both up
to about a dozen rows. With more rows the GEMMs are bound by multiply-adds, and the bf16 panels do the fewest
instructions per multiply-add. A step's results then depend on how many tokens it holds, as they
do in any engine whose kernels differ by batch size.
"""
from __future__ import annotations

from torch import nn

from engine.models import q4_panels
from engine.models.bf16_panels import Bf16PanelLinear
from engine.models.gguf_linear import BlockLinear
from engine.models.packed import PackedLinear

# The most rows a GEMM keeps on the blocks (docs/benchmarks.md, "GEMMs split by row count") and on the 4-bit panels
# (docs/benchmarks.md, "4-bit panels").
SPLIT_ROWS = 4
Q4_ROWS = 12


def split_rows(model: nn.Module, rows: int = SPLIT_ROWS, q4_rows: int | None = Q4_ROWS) -> int:
    """In place, for a float32 DecoderLM whose linears are BlockLinear / PackedLinear (the LM head included): each
    4-bit BlockLinear becomes a Q4PanelLinear (unless `q4_rows` is None or the 4-bit panels do not run here), and
    each linear runs calls of more than `rows` rows (`q4_rows` for the 4-bit panels) on a bfloat16-panel copy of its
    weight (packed.split_forward). The fused stack takes those copies for forwards of more than
    `model.many_rows_above` tokens: `q4_rows` where every decoder linear is on 4-bit panels, else `rows`. Returns
    how many linear layers got a copy."""
    q4 = q4_rows is not None and q4_panels.available() is None

    def make(lin: nn.Module) -> nn.Module:
        few = q4_panels.Q4PanelLinear.of(lin) if q4 and isinstance(lin, BlockLinear) else None
        layer = lin if few is None else few
        layer.many_rows = Bf16PanelLinear(lin)
        layer.many_rows_above = rows if few is None else q4_rows
        return layer

    count = 0
    for parent in list(model.modules()):  # the LM head included: model.lm_head_layer is a child of the model
        for name, child in list(parent.named_children()):
            if isinstance(child, (BlockLinear, PackedLinear)):
                setattr(parent, name, make(child))
                count += 1
    decoder = [m for layer in getattr(model, "layers", ()) for m in layer.modules() if hasattr(m, "many_rows")]
    model.many_rows_above = q4_rows if decoder and all(isinstance(m, q4_panels.Q4PanelLinear) for m in decoder) else rows
    return count
