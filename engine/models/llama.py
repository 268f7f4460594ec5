"""Plain-torch decoder for Llama (2/3, SmolLM2, DeepSeek-R1-Distill-Llama), Qwen2 and Qwen3.

Tokens of all sequences are flattened ([T] ids, [T] logical positions); attention goes through the
AttentionBackend only. RoPE uses the logical positions, which may exceed the KV slots after compression.

Tensor parallelism (Megatron-style, see engine/distributed/layers.py): with a TPGroup of size N each rank holds
num_q_heads/N query heads and num_kv_heads/N KV heads (one replicated KV head when N > num_kv_heads; its KV
cache has only those), a slice of the MLP and of the vocabulary; norms and RoPE are replicated. Two
all-reduces per layer (o_proj, down_proj) and one for the embedding; logits are gathered to rank 0. With the
default NO_TP the model is the plain unsharded one.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                       RowParallelLinear, VocabParallelEmbedding, head_partition,
                                       vocab_parallel_logits)
from engine.distributed.parallel_state import NO_TP, TPGroup
from engine.models.config import ModelConfig
from engine.models.layer_ops import TORCH_LAYER_OPS, TorchLayerOps


class RMSNorm(nn.Module):
    ops: TorchLayerOps = TORCH_LAYER_OPS  # DecoderLM.set_layer_ops swaps it for every module

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: (RMSNorm(x + residual), x + residual), the sum possibly in residual's
        storage (the C++ ops add in place)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), as transformers computes them."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")  # cpu even under a meta device
    inv_freq = 1.0 / (theta ** (steps.float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables [max_positions, D/2] in float32, built once per device, indexed by positions: [T, D/2]."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.max_positions = config.max_position_embeddings
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._tables.get(positions.device)
        if tables is None:
            t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
            freqs = torch.outer(t, self.inv_freq)
            tables = self._tables[positions.device] = (freqs.cos().to(positions.device),
                                                       freqs.sin().to(positions.device))
        cos, sin = tables
        return cos[positions], sin[positions]


class Attention(nn.Module):
    """Self-attention over this rank's heads (all heads when unsharded)."""

    ops: TorchLayerOps = TORCH_LAYER_OPS

    def __init__(self, c: ModelConfig, tp: TPGroup = NO_TP) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_q_heads, c.num_kv_heads,
                                          c.attention_bias, tp)
        self.num_q_heads, self.num_kv_heads = self.qkv_proj.num_local_q_heads, self.qkv_proj.num_local_kv_heads
        self.head_dim = c.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.scale = c.head_dim ** -0.5
        self.o_proj = RowParallelLinear(c.num_q_heads * c.head_dim, c.hidden_size, c.o_proj_bias, tp,
                                        what="num_q_heads * head_dim")
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x, cos, sin, kv_cache, attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        # q, k, v stay views into the projection's output (the C++ RoPE rotates them there)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_q_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope(q, k, cos, sin)
        if meta.capture is not None:
            meta.capture.add(q)
        o = attn.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.flatten(1))

    def queries(self, x, cos, sin) -> torch.Tensor:
        """Post-RoPE queries [T, Hq, D] only: the q rows of the fused projection, run as the forward runs it (a
        packed layer's `.weight` would rebuild its whole dense weight on every call)."""
        q = self.qkv_proj(x)[..., : self.q_size].reshape(-1, self.num_q_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self.ops.rope(q, None, cos, sin)[0]


class MLP(nn.Module):
    ops: TorchLayerOps = TORCH_LAYER_OPS

    def __init__(self, c: ModelConfig, tp: TPGroup = NO_TP) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, c.mlp_bias, tp)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, c.mlp_bias, tp,
                                           what="intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, tp: TPGroup = NO_TP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, tp)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c, tp)

    def forward(self, h, residual, cos, sin, kv_cache, attn, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this layer's MLP output, the residual stream before it); the residual adds happen in
        the norms (vLLM's form), residual=None on the first layer. Layer i's output is the sum of the two."""
        h, residual = self.norm_input(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, attn, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def norm_input(self, h, residual) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.input_layernorm(h), h
        return self.input_layernorm(h, residual)


# HF checkpoint projection name -> (our fused parameter, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = NO_TP) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # tied: the LM head is embed_tokens.weight (the same vocabulary rows on every rank)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.hidden_size, config.vocab_size,
                                                                              tp)
        # The LM head as a layer of a GEMM backend or of int8 (engine/models/packed.py, quant.py), which give the
        # model one in place of the dense head; None: the dense head, vocabulary-parallel under TP.
        self.lm_head_layer: nn.Module | None = None
        self.rotary = Rotary(config)
        # heads of this rank: what the attention backend plans with and the KV cache stores
        self.num_local_q_heads, self.num_local_kv_heads = head_partition(config.num_q_heads, config.num_kv_heads,
                                                                         tp.size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """[T] ids and logical positions -> final-normed hidden states [T, hidden]. attn.plan() is the
        caller's job."""
        h, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions)
        ops = self.layer_ops
        if ops.name == "fused" and ops.usable(attn, kv_caches, meta):  # the loop in one call
            return ops.forward_layers(h, cos, sin, kv_caches, attn, meta)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv_cache, attn, meta)
        return self.norm(h, residual)[0]

    def set_layer_ops(self, ops: TorchLayerOps) -> None:
        """The implementation of the layers' norms, RoPE and SiLU-multiply (engine/models/layer_ops.py)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.ops = ops

    @property
    def layer_ops(self) -> TorchLayerOps:
        return self.norm.ops

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, all_ranks: bool = False) -> torch.Tensor | None:
        """float32 logits [T, vocab]. Under TP every rank must call it; rank 0 gets the logits, the others None
        (or every rank, with all_ranks)."""
        if self.lm_head_layer is not None:  # unsharded (the backends refuse TP): this rank has every logit
            return self.lm_head_layer(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.config.vocab_size, self.tp, all_ranks)

    @torch.no_grad()
    def recompute_queries(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                          attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """Post-RoPE queries [L, T, Hq, D] of tokens whose K/V are already cached (meta built with write=False).
        Nothing is written (the fused qkv projection's K/V are dropped); the last layer stops after its queries.
        Under TP: this rank's query heads (Hq = num_local_q_heads), every rank must call it."""
        c = self.config
        out = torch.empty(c.num_layers, input_ids.shape[0], self.num_local_q_heads, c.head_dim,
                          dtype=self.embed_tokens.weight.dtype, device=input_ids.device)
        h, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            sa = layer.self_attn
            x, residual = layer.norm_input(h, residual)
            out[i] = q = sa.queries(x, cos, sin)
            if i == c.num_layers - 1:
                break
            h = sa.o_proj(attn.forward(q, None, None, kv_cache, meta, sa.scale).flatten(1))
            h, residual = layer.post_attention_layernorm(h, residual)
            h = layer.mlp(h)
        return out

    # ---- weights -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (model.layers.N.self_attn.q_proj.weight, ..., lm_head.weight) into the fused
        parameters, casting to their dtype/device. Under TP each rank reads the full tensors and keeps its slice
        (the parallel layers' load_hf_weight). Raises ValueError on unknown, missing or misshaped weights
        (shapes are checked against the full, unsharded ones)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        needed = set()
        for name in params:
            target = name.split(".")[-2]
            shards = [s for t, s in PACKED_MODULES.values() if t == target] or [None]
            needed.update((name, s) for s in shards)
        loaded = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            parts = name.split(".")
            target = shard = None
            if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
                target, shard = PACKED_MODULES[parts[-2]]
                name = ".".join(parts[:-2] + [target, parts[-1]])
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.architecture}")
            module_name, attr = name.rpartition(".")[::2]
            load_shard = getattr(modules[module_name], "load_hf_weight", None)
            if load_shard is not None:  # a parallel layer: checks the full shape, copies this rank's slice
                load_shard(attr, tensor, shard, hf_name)
            else:  # replicated (norms)
                dest = params[name].data
                if dest.shape != tensor.shape:
                    raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(dest.shape)}")
                dest.copy_(tensor)
            loaded.add((name, shard))
        missing = sorted(f"{n}" + ("" if s is None else f"[shard {s}]") for n, s in needed - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
