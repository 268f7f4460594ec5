"""An independent float64 reference for compressed decoding: HF's Llama weights and rotary code, a dense
per-(layer, KV head) cache of (position, key, value) entries, and Kara selection written plainly (test_kara's
dense eq. 3 and Token2Chunk). Nothing from engine/, paging/ or compression/ is used."""
from __future__ import annotations

import copy
import math

import torch

from test_kara import dense_kara_scores, ref_token2chunk


class ReferenceDecoder:
    def __init__(self, hf_model, kv_dtype=None):
        self.m = copy.deepcopy(hf_model).double().eval()
        # K/V stored rounded to this dtype (a half-precision KV cache), or through this function ([Hkv, D] float64 ->
        # the values an 8-bit cache gives back), then used in float64
        self.kv_dtype = kv_dtype
        c = self.m.config
        self.L, self.hq, self.hkv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
        self.d = c.hidden_size // self.hq
        self.g = self.hq // self.hkv
        # cache[l][h] = list of (position, key [D], value [D]) kept for KV head h of layer l
        self.cache = [[[] for _ in range(self.hkv)] for _ in range(self.L)]

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.m.model.rotary_emb(x, torch.tensor([[pos]]))
        return apply_rotary_pos_emb(x, x, cos.double(), sin.double(), unsqueeze_dim=1)[0]

    @torch.no_grad()
    def forward_token(self, token: int, pos: int, write: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run one token at logical position `pos` attending to every kept entry with position <= pos (its own
        K/V included). Returns its logits and its post-RoPE queries per layer ([Hq, D] each)."""
        h = self.m.model.embed_tokens(torch.tensor([token])).double()  # [1, hidden]
        queries = []
        for li, layer in enumerate(self.m.model.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = self._rope(a.q_proj(x).view(1, self.hq, 1, self.d), pos)[0, :, 0]  # [Hq, D]
            k = self._rope(a.k_proj(x).view(1, self.hkv, 1, self.d), pos)[0, :, 0]
            v = a.v_proj(x).view(self.hkv, self.d)
            queries.append(q)
            if isinstance(self.kv_dtype, tuple):  # (K round trip, V round trip)
                k, v = self.kv_dtype[0](k), self.kv_dtype[1](v)
            elif callable(self.kv_dtype):
                k, v = self.kv_dtype(k), self.kv_dtype(v)
            elif self.kv_dtype is not None:
                k, v = k.to(self.kv_dtype).double(), v.to(self.kv_dtype).double()
            if write:
                for kv in range(self.hkv):
                    self.cache[li][kv].append((pos, k[kv], v[kv]))
            out = torch.zeros(self.hq, self.d, dtype=torch.float64)
            for head in range(self.hq):
                entries = [e for e in self.cache[li][head // self.g] if e[0] <= pos]
                keys = torch.stack([e[1] for e in entries])
                vals = torch.stack([e[2] for e in entries])
                w = torch.softmax(keys @ q[head] / math.sqrt(self.d), dim=0)
                out[head] = w @ vals
            h = h + a.o_proj(out.view(1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.m.lm_head(self.m.model.norm(h))[0]
        return logits, queries

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        logits = None
        for pos, t in enumerate(tokens):
            logits, _ = self.forward_token(t, pos)
        return logits

    @torch.no_grad()
    def compress(self, tokens: list[int], starts: list[int], window: int, region: int, ratio: float,
                 chunk_max: int, chunk_budget: int) -> None:
        """Kara on the windows starting at logical positions `starts` (one round: every window's queries are
        recomputed first, each token attending to what is kept up to it); every (layer, KV head) keeps ⌈r·n⌉ + α
        region entries of each window by eq. 3 + Token2Chunk, the other region entries are dropped."""
        first, last = starts[0], starts[-1] + window
        qs = {p: self.forward_token(tokens[p], p, write=False)[1] for p in range(first, last)}
        drop: list[list[set[int]]] = [[set() for _ in range(self.hkv)] for _ in range(self.L)]
        for start in starts:
            span = range(start, start + window)
            queries = torch.stack([torch.stack([qs[p][li] for p in span], dim=1) for li in range(self.L)])
            keys = torch.zeros(self.L, self.hkv, window, self.d, dtype=torch.float64)
            for li in range(self.L):
                for kv in range(self.hkv):
                    by_pos = {e[0]: e for e in self.cache[li][kv]}
                    keys[li, kv] = torch.stack([by_pos[p][1] for p in span])
            scores = dense_kara_scores(queries, keys, region)  # [L, Hkv, n]
            topk = min(region, math.ceil(round(ratio * region, 9)))
            for li in range(self.L):
                for kv in range(self.hkv):
                    kept = ref_token2chunk(scores[li, kv].tolist(), topk, chunk_max, chunk_budget)
                    drop[li][kv] |= {start + j for j in range(region)} - {start + j for j in kept}
        for li in range(self.L):
            for kv in range(self.hkv):
                self.cache[li][kv] = [e for e in self.cache[li][kv] if e[0] not in drop[li][kv]]

    def kept_positions(self, layer: int, kv_head: int) -> list[int]:
        return [e[0] for e in self.cache[layer][kv_head]]
