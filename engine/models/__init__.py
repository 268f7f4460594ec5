"""Plain-torch decoders: DecoderLM covers Llama, Qwen2 and Qwen3 (see ModelConfig.from_hf)."""
from engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.llama import DecoderLM

__all__ = ["DecoderLM", "ModelConfig", "SUPPORTED_ARCHITECTURES", "build_model"]


def build_model(config: ModelConfig) -> DecoderLM:
    """A DecoderLM for any supported architecture (they share one implementation)."""
    return DecoderLM(config)
