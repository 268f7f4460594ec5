"""A float32 model split by row count: `split_rows(model)` keeps the forwards of at most `rows` tokens on the fused
C++ decoder stack over the GGUF file's blocks (engine/models/fused_layers.py, gguf_linear.py) and runs every larger
forward's layer loop in bfloat16 on oneDNN copies of the weights (engine/models/onednn.py), into the same KV pages.
EngineCore applies it for `dtype='auto'` to a model loaded from a .gguf file on a CPU with AVX512-BF16 or AMX
(engine/core.py, `row_split_applies`), with bfloat16 KV pages.

Why: a decode step of a few sequences is bound by the bytes of weights it reads and by the Python between its ops;
the file's blocks (~1.25 bytes a weight) in the one-call stack beat bfloat16 oneDNN (2 bytes a weight, an op per
Python call) there. With more rows the GEMMs are bound by multiply-adds, and AVX512-BF16's dot products do twice
the float32 FMAs' work a cycle: prefill chunks and large decode batches run as a bfloat16 model would. A step's
results then depend on how many tokens it holds, as they do in any engine whose kernels differ by batch size.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.gguf_linear import BlockLinear
from engine.models.llama import RMSNorm
from engine.models.onednn import OneDnnLinear
from engine.models.packed import PackedLinear

# The most tokens a forward keeps on the blocks and the fused stack (docs/benchmarks.md,
# "GEMMs split by row count").
SPLIT_ROWS = 16
MANY_ROWS_DTYPE = torch.bfloat16


def split_rows(model: nn.Module, rows: int = SPLIT_ROWS) -> int:
    """In place, for a float32 DecoderLM whose linears are BlockLinear / PackedLinear (the LM head included): each
    linear runs calls of more than `rows` rows on a bfloat16 oneDNN copy of its weight (packed.split_forward),
    each RMSNorm gets a bfloat16 copy of its weight, the fused stack takes forwards of at most `rows` tokens
    (`model.fused_max_rows`) and larger forwards run their layer loop in bfloat16 (`model.many_rows_dtype`).
    Returns how many linear layers got a copy."""
    layers = [m for m in model.modules() if isinstance(m, (BlockLinear, PackedLinear))]
    for lin in layers:
        dense = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(lin.weight)
            if lin.bias is not None:
                dense.bias.copy_(lin.bias)
        lin.many_rows = OneDnnLinear(dense.to(MANY_ROWS_DTYPE))
        lin.many_rows_above = rows
    for norm in [m for m in model.modules() if isinstance(m, RMSNorm)]:
        norm.weight_as = norm.weight.detach().to(MANY_ROWS_DTYPE)
    model.fused_max_rows = rows
    model.many_rows_dtype = MANY_ROWS_DTYPE
    return len(layers)
