import logging

from engine.attention.base import AttentionBackend, AttentionMetadata, build_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "build_metadata", "get_backend"]

logger = logging.getLogger("kvllm.attention")


def get_backend(name: str, device) -> "AttentionBackend":
    """Pick the attention backend: 'cpu' (the C++ paged kernel), 'torch', 'flashinfer' or 'auto' (FlashInfer on
    CUDA when it imports; on the CPU the C++ kernel when it builds, else torch with a warning)."""
    import torch

    if name not in ("auto", "torch", "flashinfer", "cpu"):
        raise ValueError(f"attention_backend must be 'cpu', 'auto', 'torch' or 'flashinfer', got {name!r}")
    device = torch.device(device)
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on CPU devices only, got device {device}")
    if name == "auto":
        from engine.attention.flashinfer import is_available

        if device.type == "cuda":
            name = "flashinfer" if is_available() else "torch"
        elif device.type == "cpu":
            from engine.attention.cpu_ext import ExtensionUnavailable

            try:
                return _cpu_backend()
            except ExtensionUnavailable as exc:
                logger.warning("CPU attention kernel unavailable, using the torch backend (slower): %s", exc)
                name = "torch"
        else:
            name = "torch"
    if name == "cpu":
        return _cpu_backend()
    if name == "flashinfer":
        from engine.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(device)
    from engine.attention.torch_paged import TorchPagedBackend

    return TorchPagedBackend()


def _cpu_backend():
    from engine.attention.cpu_paged import CpuPagedBackend

    return CpuPagedBackend()
