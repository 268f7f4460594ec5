// Pieces shared by kvllm's CPU kernel files (kvllm_cpu.cpp, layer_ops.cpp): which instruction set the CPU has,
// and the AVX2 helpers both files use. Everything is built without -march: AVX2 code is compiled per function
// through `#pragma GCC target` and only reached after a run-time check, so one library runs on any x86-64.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#define KVLLM_X86 1  // the AVX2 / AVX-512 code; elsewhere only the portable kernels are compiled
#include <immintrin.h>
#endif

namespace kvllm_cpu {

// int8 K rows are stored rotated, H k with H the orthonormal Sylvester-Hadamard matrix, where head_dim is a power of
// two (paging/kv_format.py): the write op rotates K before quantizing, the attention kernel rotates q alike.
inline bool rotates_keys(int64_t d) { return d >= 2 && (d & (d - 1)) == 0; }

// x[0, d) <- H x: butterflies (a + b, a - b) over strides 1, 2, 4, ..., then one multiply by float(1 / sqrt(d)),
// the operations of paging/kv_format.py hadamard, so the C++ and torch writes store the same bytes.
inline void fwht(float* x, int64_t d) {
  for (int64_t h = 1; h < d; h *= 2)
    for (int64_t i = 0; i < d; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float c = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int64_t j = 0; j < d; ++j) x[j] *= c;
}

inline bool cpu_has_avx2() {
#ifdef KVLLM_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
#else
  return false;
#endif
}

// Instruction-set levels of the kernels: 0 portable, 1 AVX2 + FMA, 2 AVX-512F (+ AVX2). Every op takes a
// `max_isa` (tests run each level on a machine that has it); the best level present is the default.
inline int64_t best_isa() {
#ifdef KVLLM_X86
  static const int64_t level = [] {
    if (!cpu_has_avx2()) return int64_t{0};
    return __builtin_cpu_supports("avx512f") ? int64_t{2} : int64_t{1};
  }();
  return level;
#else
  return 0;
#endif
}

inline int64_t pick_isa(int64_t max_isa) {
  TORCH_CHECK_VALUE(max_isa >= 0 && max_isa <= 2, "max_isa must be 0 (portable), 1 (AVX2) or 2 (AVX-512), got ",
                    max_isa);
  return std::min(max_isa, best_isa());
}

// paged attention has one level more: 3, AVX-512 with AVX512-BF16 dot products on a bfloat16 cache
inline int64_t best_attention_isa() {
#ifdef KVLLM_X86
  static const int64_t level = [] {
    const bool bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    return best_isa() == 2 && bf16 ? int64_t{3} : best_isa();
  }();
  return level;
#else
  return 0;
#endif
}

inline int64_t pick_attention_isa(int64_t max_isa) {
  TORCH_CHECK_VALUE(max_isa >= 0 && max_isa <= 3, "max_isa must be 0 (portable), 1 (AVX2), 2 (AVX-512) or 3 "
                    "(AVX-512 with AVX512-BF16), got ", max_isa);
  return std::min(max_isa, best_attention_isa());
}

#ifdef KVLLM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline float hsum(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// 8 consecutive elements as floats: half-precision rows are widened in registers (bf16 is the high half of a
// float; fp16 through F16C), so a half K/V cache is read at half the bytes with no conversion pass through memory.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// 8-bit KV rows (paging/kv_format.py): int8 as integers; fp8_e5m2 is the high byte of an fp16; fp8_e4m3's 7 bits
// sign-less bits placed at fp16's bits 13..7 give its value / 256 (bias 7 against 15, subnormals included), which the
// attention kernel folds into the row scale.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7F)), 7)));
}

// 8 floats rounded to bfloat16 bits, nearest even, NaN as 0x7FC0: c10::BFloat16's own rounding, so a row stored
// here equals the same values converted by torch.
inline __m128i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // packus works within 128-bit lanes: [r0..r3 r0..r3 | r4..r7 r4..r7]; 64-bit pieces 0 and 2 are r0..r7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(v));
}

// What storing v as T and loading it back gives: v itself for float, v rounded to bfloat16 for bfloat16 (torch's
// bfloat16 ops round every intermediate result they return; the layer ops round at the same points).
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
  }
}

// 1/k! (ln 2)^k for k = 7..0: 2^f's degree-7 Taylor polynomial in Horner order (exp2_avx, and exp2_512 in
// csrc/kvllm_cpu.cpp, which must give the same values)
constexpr float kExp2Poly[8] = {1.525273380405984e-05f, 1.5403530393381606e-04f, 1.3333558146428443e-03f,
                                9.618129107628477e-03f, 5.550410866482158e-02f, 2.402265069591007e-01f,
                                6.931471805599453e-01f, 1.f};

// 2^x for x in [-126, 126] (clamped there): x = n + f, |f| <= 1/2, 2^f by its degree-7 Taylor polynomial
// (relative error < 1e-8), 2^n through the exponent bits. At -126, 2^n is still a normal float (2^-126 is ~1e-38:
// nil next to an online-softmax row's max term, which is 1).
inline __m256 exp2_avx(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.f)), _mm256_set1_ps(126.f));
  __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#pragma GCC pop_options
#endif  // KVLLM_X86

}  // namespace kvllm_cpu
