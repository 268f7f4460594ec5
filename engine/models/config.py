"""ModelConfig: the few numbers the decoder needs, read from a transformers config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain RoPE; else has "rope_type" ("linear" or "llama3")
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)
    o_proj_bias: bool = False  # Llama/Qwen3 with attention_bias=True also bias o_proj; Qwen2 never does
    mlp_bias: bool = False  # Llama's mlp_bias

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _BY_MODEL_TYPE.get(getattr(hf, "model_type", None))
        if arch is None:
            named = archs or [getattr(hf, "model_type", None)]
            raise ValueError(f"unsupported model architecture {named}; supported: {list(SUPPORTED_ARCHITECTURES)}")

        if getattr(hf, "use_sliding_window", False):
            raise ValueError(f"{arch} with use_sliding_window=True is not supported")
        num_q_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_q_heads
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        rope_theta = float(rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0)
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
        rope_scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}

        if arch == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(getattr(hf, "attention_bias", False))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_q_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096) or 4096),
            eos_token_ids=eos_ids,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        )
