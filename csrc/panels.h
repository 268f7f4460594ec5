// What the two panel GEMM files (csrc/bf16_linear.cpp, csrc/quant_panels.cpp) share: the CPU check for their
// AVX512-BF16 dot products and the checks of their x, out and bias (16 output channels a panel).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "simd.h"

namespace kvllm_cpu {

constexpr int kPanel = 16;  // output channels a panel

inline bool cpu_has_avx512_bf16() {
#ifdef KVLLM_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return best_isa() >= 2 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  }();
  return ok;
#else
  return false;
#endif
}

// x float32 [M, K] with contiguous rows; out float32 [M, N] contiguous with N within `panels` panels' channels;
// bias none or float32 [N]. Returns N.
inline int64_t check_panel_rows(const at::Tensor& x, const at::Tensor& out, const std::optional<at::Tensor>& bias,
                                int64_t panels) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                    "x must be a float32 CPU [M, K] tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                        out.size(0) == x.size(0) && out.is_contiguous() && out.size(1) > (panels - 1) * kPanel &&
                        out.size(1) <= panels * kPanel,
                    "out must be a contiguous float32 [M, N] tensor, N within the panels' ", panels * kPanel,
                    " channels");
  const int64_t n = out.size(1);
  if (bias) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                      "bias must be a contiguous float32 [N] tensor");
  }
  return n;
}

}  // namespace kvllm_cpu
