"""A float32 model split by row count: `split_rows(model)` gives each linear layer a copy of its weight in bfloat16
panels (engine/models/bf16_panels.py, AVX512-BF16 dot products) that runs its calls of more than `rows` rows
(engine/models/packed.py split_forward); calls of at most `rows` rows stay on the layer's own float32 kernel (the
GGUF file's blocks for a .gguf model). Activations, norms,
RoPE and attention stay float32 on either side (the panels take float32 rows and return float32), so the fused C++
decoder stack (engine/models/fused_layers.py, csrc/decoder_layers.cpp) runs every forward, picking the weights by
the forward's token count. EngineCore applies it for `dtype='auto'` to a model loaded from a .gguf file on a CPU
with AVX512-BF16 (engine/core.py, `row_split_applies`), with bfloat16 KV pages.

Why: a decode step of one or a few sequences is bound by the bytes of weights it reads; the file's blocks (~1.25
bytes a weight) beat bfloat16 (2 bytes) there. With more rows the GEMMs are bound by multiply-adds, and a
vdpbf16ps does twice the work of a float32 FMA. A step's results then depend on how many tokens it holds, as they
do in any engine whose kernels differ by batch size.
"""
from __future__ import annotations

from torch import nn

from engine.models.bf16_panels import Bf16PanelLinear
from engine.models.gguf_linear import BlockLinear
from engine.models.packed import PackedLinear

# The most rows a GEMM keeps on the blocks (docs/benchmarks.md, "GEMMs split by row count").
SPLIT_ROWS = 4


def split_rows(model: nn.Module, rows: int = SPLIT_ROWS) -> int:
    """In place, for a float32 DecoderLM whose linears are BlockLinear / PackedLinear (the LM head included): each
    linear runs calls of more than `rows` rows on a bfloat16-panel copy of its weight (packed.split_forward), and
    the fused stack takes those copies for forwards of more than `rows` tokens (`model.many_rows_above`). Returns
    how many linear layers got a copy."""
    layers = [m for m in model.modules() if isinstance(m, (BlockLinear, PackedLinear))]
    for lin in layers:
        lin.many_rows = Bf16PanelLinear(lin)
        lin.many_rows_above = rows
    model.many_rows_above = rows
    return len(layers)
