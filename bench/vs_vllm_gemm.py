"""The linear layers of one SmolLM2 decode step as each engine runs them, at several batch sizes, one thread.

    build/vllm-venv/bin/python bench/vs_vllm_gemm.py vllm   # vLLM's CPU GEMM dispatch (oneDNN / sgl kernel)
    .venv/bin/python -m bench.vs_vllm_gemm kvllm             # kvllm's packed float32 GEMM (engine/models/packed.py)
    .venv/bin/python -m bench.vs_vllm_gemm torch             # torch F.linear (MKL), the common reference

Shapes are vLLM's (fused qkv and gate_up, the tied LM head) for SmolLM2-135M's 30 layers; kvllm packs the same
products (its per-projection layers hold the same weights). Prints the minimum over repeats of one step's GEMMs
(ms) per batch size as JSON: on a shared machine the minimum is the least disturbed run. Part of bench/vs_vllm.py's
profile; only the standard library at the top, as the vLLM side runs in its own venv.
"""
from __future__ import annotations

import json
import os
import sys
import time

HIDDEN, INTER, Q, KV, VOCAB, LAYERS = 576, 1536, 576, 192, 49152, 30
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (out N, in K) per layer


def _linears(impl: str):
    """One callable x -> y per distinct (N, K) shape plus the LM head, with random float32 weights."""
    import torch

    torch.manual_seed(0)
    shapes = SHAPES + [(VOCAB, HIDDEN)]
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    if impl == "torch":
        return [(lambda x, w=w: torch.nn.functional.linear(x, w)) for w in weights], shapes
    if impl == "vllm":
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        fns = []
        for w in weights:
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(w, requires_grad=False)
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            fns.append(lambda x, layer=layer: layer.cpu_linear(x, layer.weight, None))
        return fns, shapes
    from engine.models.packed import PackedLinear

    fns = []
    for w in weights:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        fns.append(PackedLinear(lin))
    return fns, shapes


def measure(impl: str, batches: list[int], repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    fns, shapes = _linears(impl)
    out = {}
    with torch.inference_mode():
        for b in batches:
            xs = [torch.randn(b, k) for _, k in shapes]

            def step():
                for fn, x in zip(fns[:-1], xs[:-1]):
                    for _ in range(LAYERS):
                        fn(x)
                fns[-1](xs[-1][-min(b, 64):])  # the LM head: one row per sequence

            step()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out[b] = min(times) * 1e3
    return out


def main() -> None:
    impl = sys.argv[1] if len(sys.argv) > 1 else "torch"
    if impl == "vllm":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8,32,64").split(",")]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    print(json.dumps({"impl": impl, "ms_per_step": measure(impl, batches, repeats)}))


if __name__ == "__main__":
    main()
