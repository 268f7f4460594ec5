from engine.attention.base import AttentionBackend, AttentionMetadata, build_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "build_metadata", "get_backend"]


def get_backend(name: str, device) -> "AttentionBackend":
    """Pick the attention backend: 'torch', 'flashinfer' or 'auto' (FlashInfer on CUDA when it imports)."""
    import torch

    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'flashinfer', got {name!r}")
    device = torch.device(device)
    if name == "auto":
        from engine.attention.flashinfer import is_available

        name = "flashinfer" if device.type == "cuda" and is_available() else "torch"
    if name == "flashinfer":
        from engine.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(device)
    from engine.attention.torch_paged import TorchPagedBackend

    return TorchPagedBackend()
