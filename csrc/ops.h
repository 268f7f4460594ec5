// The ops of csrc/kvllm_cpu.cpp, csrc/layer_ops.cpp, csrc/bf16_linear.cpp and csrc/quant_panels.cpp that
// csrc/decoder_layers.cpp calls directly (C++ to C++, no dispatcher): the same functions the torch.ops.kvllm_cpu
// registrations call, with the same checks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvllm_cpu::ops {

void paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& qo_indptr,
                     const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                     double scale, at::Tensor& out, bool force_portable, int64_t max_isa);
void packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const std::optional<at::Tensor>& bias,
                   at::Tensor& out, int64_t max_isa);
void block_linear(const at::Tensor& x, const at::Tensor& q_packed, const at::Tensor& d, const at::Tensor& m,
                  const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t max_isa);
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out,
              const std::optional<at::Tensor>& residual, int64_t max_isa);
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, int64_t max_isa);
void silu_mul(const at::Tensor& x, at::Tensor& out, int64_t max_isa);
void bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out);
void quant_panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        at::Tensor& out);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping);

}  // namespace kvllm_cpu::ops
