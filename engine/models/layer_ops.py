"""The elementwise ops of a decoder layer, behind one interface with two implementations:

- TorchLayerOps: plain torch on any device and dtype (the reference; HF's order of operations).
- CpuLayerOps: csrc/layer_ops.cpp, one C++ call per op on float32 or bfloat16 CPU tensors (bfloat16 is rounded
  where TorchLayerOps rounds, so the two differ only where float32 summation order tips a rounding). The residual
  add is fused into the RMSNorm that follows it, RoPE rotates q and k in place inside the fused qkv projection
  output, and SiLU-multiply reads the fused gate/up output; K/V writes into the pages (engine/attention/cpu_paged.py)
  are in the same library.
  Why: written in torch a layer's elementwise work is ~25 ops, each over more than 32K elements an OpenMP parallel
  region, and under passive waiting (engine/threads.py) every region wakes the sleeping worker threads. These calls
  stay on the calling thread at decode sizes, so a step's parallel regions are its GEMMs and attention calls.
  Inputs it does not take (another dtype or device, a 3-D RMSNorm input such as Qwen3's per-head q/k norm) go to
  TorchLayerOps.

EngineConfig.layer_ops picks one (engine/models/backends.py; 'auto': the C++ ops where the model is float32 or bfloat16 on a CPU and the library
loads, and among those engine/models/fused_layers.py's FusedLayerOps, the whole decoder stack in one C++ call, where
the model qualifies).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import cpu_ext


class TorchLayerOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x) * weight; with `residual`: (RMSNorm(x + residual) * weight, x + residual)."""
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)
        return out if residual is None else (out, x)

    def rope(self, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] (or None) with cos/sin [T, D/2], in float32."""
        return apply_rope(q, cos, sin), None if k is None else apply_rope(k, cos, sin)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x = [gate | up] [T, 2I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax over the last dimension (the greedy draw of engine/sampler.py)."""
        return logits.argmax(dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


#: row dtypes the C++ ops take (float32 arithmetic either way; cos/sin tables stay float32)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_ready(*ts: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Every tensor a CPU tensor with a contiguous last dimension and one dtype (`dtype` if given) the ops take."""
    dtype = ts[0].dtype if dtype is None else dtype
    return dtype in KERNEL_DTYPES and all(t.dtype == dtype and t.device.type == "cpu" and t.stride(-1) == 1
                                          for t in ts)


class CpuLayerOps(TorchLayerOps):
    """Raises cpu_ext.ExtensionUnavailable when the library cannot be built or loaded."""

    name = "cpu"

    def __init__(self, max_isa: int = 2) -> None:
        self._ops = cpu_ext.load()
        self.max_isa = max_isa  # 0: the portable loops (tests of each level)

    def rms_norm(self, x, weight, eps, residual=None):
        if x.dim() != 2 or not _kernel_ready(x, weight) or (residual is not None
                                                           and not _kernel_ready(residual, dtype=x.dtype)):
            return super().rms_norm(x, weight, eps, residual)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._ops.rms_norm(x, weight, eps, out, residual, self.max_isa)  # residual += x, in place
        return out if residual is None else (out, residual)

    def rope(self, q, k, cos, sin):
        if (not _kernel_ready(q) or not _kernel_ready(cos, sin, dtype=torch.float32)
                or (k is not None and not _kernel_ready(k, dtype=q.dtype))):
            return super().rope(q, k, cos, sin)
        self._ops.rope_(q, q[:, :0] if k is None else k, cos, sin, self.max_isa)
        return q, k

    def silu_mul(self, x):
        if x.dim() != 2 or not _kernel_ready(x):
            return super().silu_mul(x)
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        self._ops.silu_mul(x, out, self.max_isa)
        return out

    def argmax(self, logits):
        if logits.dim() != 2 or not logits.shape[1] or not _kernel_ready(logits, dtype=torch.float32):
            return super().argmax(logits)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._ops.argmax(logits, out, self.max_isa)
        return out


TORCH_LAYER_OPS = TorchLayerOps()


def can_use_cpu_ops(model: torch.nn.Module) -> str | None:
    """None when CpuLayerOps can run `model`'s layers, else why not (one line)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device}"
    if param.dtype not in KERNEL_DTYPES:
        return f"the model is {param.dtype}, the kernels take float32 and bfloat16"
    try:
        cpu_ext.load()
    except cpu_ext.ExtensionUnavailable as exc:
        return f"the C++ extension is unavailable ({exc})"
    return None
