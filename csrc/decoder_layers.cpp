// decoder_layers: a Llama-family decoder stack (engine/models/llama.py DecoderLM.forward, without the embedding and
// the LM head) in one call, through the same kernels the per-layer Python path calls one by one (csrc/ops.h), in
// the same order, on the same buffers' contents: the result is bit for bit that path's.
// Why: at a decode step of a small model the Python between those kernels (~14 torch ops a layer, their module
// calls, checks and output allocations) is several milliseconds a step; here it is one call and one allocation
// of each intermediate, reused by every layer. engine/models/fused_layers.py decides when it applies.
// Each kernel call runs under a profiler range named as its torch.ops registration, so torch.profiler splits a
// fused step by kernel as it does the per-layer path's (bench/step_floor.py); with no profiler on, a range costs
// one flag check.
//
// Per layer (weights[18 * i ...]): input norm, qkv linear, o linear, post-attention norm, gate/up linear, down
// linear, each linear as four tensors (w, d, m, bias): a GGUF block layer (int8 w, its d and m; csrc block_linear),
// a float32, bfloat16 or float16 panel layer (w_packed [N/16, K, 16], then two empty tensors; packed_linear), a
// bfloat16 pair-panel layer (w_panels [P, K/2, 16, 2], two empty tensors; csrc/bf16_linear.cpp) or a quantized
// panel layer (uint8 w_panels, two empty tensors; csrc/quant_panels.cpp); an empty bias is none. The final norm's
// weight is the last tensor.
// Activations stay float32 throughout.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace kvllm_cpu {
namespace {

constexpr int64_t kPerLayer = 18;

// a profiler range around one kernel call, named as the op torch.ops.kvllm_cpu registers for that kernel
#define KVLLM_RANGE(name) RECORD_FUNCTION("kvllm_cpu::" name, std::vector<c10::IValue>())

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// w: the four tensors of one linear layer at weights[i]
void linear(const at::Tensor& x, const at::TensorList& w, int64_t i, at::Tensor& out, int64_t isa) {
  if (w[i].scalar_type() == at::kBFloat16 && w[i].dim() == 4) {  // pairs for vdpbf16ps; [N/16, K, 16]: packed
    KVLLM_RANGE("bf16_linear");
    ops::bf16_linear(x, w[i], maybe(w[i + 3]), out);
  } else if (w[i].scalar_type() == at::kByte) {
    KVLLM_RANGE("quant_panel_linear");
    ops::quant_panel_linear(x, w[i], maybe(w[i + 3]), out);
  } else if (w[i].scalar_type() == at::kChar) {
    KVLLM_RANGE("block_linear");
    ops::block_linear(x, w[i], w[i + 1], w[i + 2], maybe(w[i + 3]), out, isa);
  } else {
    KVLLM_RANGE("packed_linear");
    ops::packed_linear(x, w[i], maybe(w[i + 3]), out, isa);
  }
}

at::Tensor decoder_layers(const at::Tensor& hidden, at::TensorList weights, at::TensorList kv_caches,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& qo_indptr,
                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                          const at::Tensor& kv_last_page_len, const at::Tensor& slot_mapping, int64_t num_q_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double scale,
                          double eps, int64_t linear_isa, int64_t ops_isa, int64_t attn_isa, bool attn_portable,
                          const at::Tensor& capture_rows, at::Tensor capture_out) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK_VALUE(layers > 0 && static_cast<int64_t>(weights.size()) == kPerLayer * layers + 1,
                    "weights must hold ",
                    kPerLayer, " tensors per layer and the final norm's weight: ", kPerLayer * layers + 1,
                    " for ", layers, " layers, got ", weights.size());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
                    "hidden must be a contiguous float32 [T, hidden] tensor");
  const int64_t t = hidden.size(0), dim = hidden.size(1);
  const int64_t q_size = num_q_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t inter2 = 2 * intermediate_size;  // the linears check their weights against these shapes
  const auto f32 = hidden.options();
  at::Tensor residual = hidden.clone();  // the embedding stays the caller's; the residual stream adds in place
  at::Tensor h = at::empty({t, dim}, f32), x = at::empty({t, dim}, f32), o = at::empty({t, dim}, f32);
  at::Tensor qkv = at::empty({t, q_size + 2 * kv_size}, f32), attn = at::empty({t, num_q_heads, head_dim}, f32);
  at::Tensor gate_up = at::empty({t, inter2}, f32), act = at::empty({t, inter2 / 2}, f32);
  // q, k, v: views into the projection's output, as in the Python path (RoPE rotates them there)
  at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_q_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
  const at::Tensor attn_rows = attn.view({t, q_size});
  const bool capture = capture_rows.numel() > 0;  // a compression scorer keeps these rows' post-RoPE queries
  if (capture) {
    TORCH_CHECK_VALUE(capture_rows.scalar_type() == at::kLong && capture_rows.dim() == 1,
                      "capture_rows must be a 1-D int64 tensor");
    TORCH_CHECK_VALUE(capture_out.scalar_type() == at::kFloat &&
                          capture_out.sizes() == at::IntArrayRef({layers, capture_rows.numel(), num_q_heads, head_dim}),
                      "capture_out must be a float32 [layers, rows, num_q_heads, head_dim] tensor");
  }
  for (int64_t i = 0; i < layers; ++i) {
    const at::TensorList w = weights.slice(kPerLayer * i, kPerLayer);
    at::Tensor cache = kv_caches[i];
    {
      KVLLM_RANGE("rms_norm");
      if (i == 0) ops::rms_norm(residual, w[0], eps, x, std::nullopt, ops_isa);
      else ops::rms_norm(h, w[0], eps, x, residual, ops_isa);  // residual += h (the last layer's MLP output)
    }
    linear(x, w, 1, qkv, linear_isa);
    {
      KVLLM_RANGE("rope_");
      ops::rope_(q, k, cos, sin, ops_isa);
    }
    if (capture) {
      KVLLM_RANGE("capture_queries");
      at::Tensor layer_rows = capture_out[i];
      at::index_select_out(layer_rows, q, 0, capture_rows);
    }
    {
      KVLLM_RANGE("write_kv");
      ops::write_kv(k, v, cache, slot_mapping);
    }
    {
      KVLLM_RANGE("paged_attention");
      ops::paged_attention(q, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale, attn,
                           attn_portable, attn_isa);
    }
    linear(attn_rows, w, 5, o, linear_isa);
    {
      KVLLM_RANGE("rms_norm");
      ops::rms_norm(o, w[9], eps, x, residual, ops_isa);
    }
    linear(x, w, 10, gate_up, linear_isa);
    {
      KVLLM_RANGE("silu_mul");
      ops::silu_mul(gate_up, act, ops_isa);
    }
    linear(act, w, 14, h, linear_isa);
  }
  at::Tensor out = at::empty({t, dim}, f32);
  KVLLM_RANGE("rms_norm");
  ops::rms_norm(h, weights[kPerLayer * layers], eps, out, residual, ops_isa);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvllm_cpu, m) {
  m.def("decoder_layers(Tensor hidden, Tensor[] weights, Tensor[] kv_caches, Tensor cos, Tensor sin, "
        "Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, Tensor slot_mapping, "
        "int num_q_heads, int num_kv_heads, int head_dim, int intermediate_size, float scale, float eps, "
        "int linear_isa, int ops_isa, int attn_isa, bool attn_portable, Tensor capture_rows, "
        "Tensor(a!) capture_out) -> Tensor",
        &decoder_layers);
}

}  // namespace kvllm_cpu
