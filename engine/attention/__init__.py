import logging

import torch

from engine.attention import cpu_ext, flashinfer
from engine.attention.base import AttentionBackend, AttentionMetadata, build_metadata
from engine.attention.cpu_paged import CpuPagedBackend
from engine.attention.torch_paged import TorchPagedBackend
from util import Registry

__all__ = ["AttentionBackend", "AttentionMetadata", "build_metadata", "get_backend", "resolve_backend_name",
           "ATTENTION_BACKENDS"]

logger = logging.getLogger("kvllm.attention")


#: EngineConfig.attention_backend -> function (device) building the backend
ATTENTION_BACKENDS: Registry = Registry("attention_backend")


def get_backend(name: str, device) -> "AttentionBackend":
    """Build the attention backend named by EngineConfig.attention_backend for `device`."""
    return ATTENTION_BACKENDS.get(name)(torch.device(device))


def resolve_backend_name(name: str, device) -> str:
    """The backend `name` builds on `device`, 'auto' resolved without building it: what the KV page format is
    decided from before the backend exists (FlashInfer reads fp8 pages without per-row scales)."""
    device = torch.device(device)
    if name != "auto":
        return name
    if device.type == "cuda":
        return "flashinfer" if flashinfer.is_available() else "torch"
    if device.type == "cpu":
        try:
            cpu_ext.load()
            return "cpu"
        except cpu_ext.ExtensionUnavailable as exc:
            logger.warning("CPU attention kernel unavailable, using the torch backend (slower): %s", exc)
    return "torch"


@ATTENTION_BACKENDS.register("auto")
def _auto(device) -> "AttentionBackend":
    """FlashInfer on CUDA when it imports; on the CPU the C++ kernel when it builds, else torch with a warning."""
    return ATTENTION_BACKENDS.get(resolve_backend_name("auto", device))(device)


@ATTENTION_BACKENDS.register("cpu")
def _cpu(device) -> "AttentionBackend":
    if device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on CPU devices only, got device {device}")
    return CpuPagedBackend()


@ATTENTION_BACKENDS.register("torch")
def _torch(device) -> "AttentionBackend":
    return TorchPagedBackend()


@ATTENTION_BACKENDS.register("flashinfer")
def _flashinfer(device) -> "AttentionBackend":
    return flashinfer.FlashInferBackend(device)
