"""A float32 model split by row count: `split_rows(model)` gives each linear layer a bfloat16 oneDNN copy of its
weight (engine/models/onednn.py) that runs its calls of more than `rows` rows (engine/models/packed.py
split_forward); calls of fewer rows stay on the GGUF file's blocks. Activations, norms, RoPE and attention stay
float32 on either side, so the fused C++ decoder stack (engine/models/fused_layers.py, csrc/decoder_layers.cpp)
runs every forward, picking the copies by the forward's token count. EngineCore applies it for `dtype='auto'` to
a model loaded from a .gguf file on a CPU with AVX512-BF16 or AMX (engine/core.py, `row_split_applies`), with
bfloat16 KV pages.

Why: a decode step of a few sequences is bound by the bytes of weights it reads; the file's blocks (~1.25 bytes a
weight) beat bfloat16 (2 bytes) there. With more rows the GEMMs are bound by multiply-adds, and AVX512-BF16's dot
products do twice the float32 FMAs' work a cycle. A step's results then depend on how many tokens it holds, as
they do in any engine whose kernels differ by batch size.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.gguf_linear import BlockLinear
from engine.models.onednn import OneDnnLinear
from engine.models.packed import PackedLinear

# The most tokens a forward keeps on the blocks (docs/benchmarks.md, "GEMMs split by row count").
SPLIT_ROWS = 8
MANY_ROWS_DTYPE = torch.bfloat16


def split_rows(model: nn.Module, rows: int = SPLIT_ROWS) -> int:
    """In place, for a float32 DecoderLM whose linears are BlockLinear / PackedLinear (the LM head included): each
    linear runs calls of more than `rows` rows on a bfloat16 oneDNN copy of its weight (packed.split_forward), and
    the fused stack takes those copies for forwards of more than `rows` tokens (`model.many_rows_above`). Returns
    how many linear layers got a copy."""
    layers = [m for m in model.modules() if isinstance(m, (BlockLinear, PackedLinear))]
    for lin in layers:
        dense = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(lin.weight)
            if lin.bias is not None:
                dense.bias.copy_(lin.bias)
        lin.many_rows = OneDnnLinear(dense.to(MANY_ROWS_DTYPE))
        lin.many_rows_above = rows
    model.many_rows_above = rows
    return len(layers)
