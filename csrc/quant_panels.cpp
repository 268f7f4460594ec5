// quant_panel_linear: y = x W^T + b with W held as a GGUF file's 4-bit or 8-bit blocks (w = d * q + m per 32 input
// columns) repacked into panels for AVX512-BF16's vdpbf16ps (engine/models/quant_panels.py packs them); x float32
// rounded to bfloat16 once per call, y float32.
//
// The weights enter the dot products as exact bfloat16 integers, and d and m are applied per block in float32, so
// the weights are used at their exact values d q + m (the bf16 panels of csrc/bf16_linear.cpp round each to
// bfloat16):
//   4-bit (q in 0..15): a nibble becomes the bfloat16 whose bits are 0x4300 | q, the value 128 + q (exponent 2^7, q
//     in the mantissa), one AND/OR per weight vector; per block T = sum x (128 + q), then
//     y += d T + (m - 128 d) S, S = sum x over the block.
//   8-bit (q in -128..127, m = 0): q is exact in bfloat16; it is widened to float32 and narrowed to bfloat16
//     (three instructions per 16 weights); per block y += d T, T = sum x q.
// Layout: panel p holds output channels [16p, 16p + 16); per block of 32 columns one stream of bytes, 8 groups
// (group g: columns 4g .. 4g + 3, two k pairs), then d [16] (and m [16], 4-bit) as float16:
//   4-bit, 320 bytes a block: a group is 32 bytes; byte 2c + e holds channel c's column 4g + e in its low nibble
//     and column 4g + 2 + e in its high one (one vpmovzxbw makes both k pairs' vectors).
//   8-bit, 544 bytes a block: a group is 64 bytes, k pair 2g then 2g + 1, byte 2c + e of each its channel c,
//     column e.
// Why: a decode step of a few sequences reads every weight once; at 0.625 (4-bit) or 1.06 (8-bit) bytes a weight
// these panels read 3.2x / 1.9x fewer bytes than the bf16 panels, for a few more instructions per weight
// (docs/benchmarks.md, "Quantized panels").
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"
#include "panels.h"

namespace kvllm_cpu {
namespace {

constexpr int kBlock = 32;            // columns per block
constexpr int kQ4Bytes = 320;         // 8 x 32 nibble bytes + 2 x 16 float16
constexpr int kQ8Bytes = 544;         // 8 x 64 bytes + 16 float16
constexpr int kTileRows = 8;
constexpr int64_t kChunkRows = 256;  // rows per work item (a multiple of kTileRows)

struct Problem {
  const uint32_t* x;  // [M, K/2] bf16 pairs
  const float* s;     // [M, K/32] sums of the bf16-rounded x per block (4-bit)
  const uint8_t* w;   // [P, K/32, block bytes]
  const float* bias;  // [N] or null
  float* out;         // [M, N]
  int64_t m, k2, blocks, n, panels;
};

#ifdef KVLLM_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")

// 32 int8 -> the 32 bfloat16 of the same values
inline __m512bh q8_bf16(const uint8_t* p) {
  const __m128i* v = reinterpret_cast<const __m128i*>(p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

template <int MR, int NP, bool Q8>
inline void tile(const Problem& B, int64_t r0, int64_t p0) {
  constexpr int64_t bytes = Q8 ? kQ8Bytes : kQ4Bytes;
  __m512 acc[MR][NP], t[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint8_t* w[NP];
  for (int j = 0; j < NP; ++j) w[j] = B.w + (p0 + j) * B.blocks * bytes;
  const uint32_t* x = B.x + r0 * B.k2;
  const __m512i low = _mm512_set1_epi16(0x000F), one28 = _mm512_set1_epi16(0x4300);
  for (int64_t b = 0; b < B.blocks; ++b) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) t[r][j] = _mm512_setzero_ps();
    const uint32_t* xb = x + b * (kBlock / 2);
    for (int g = 0; g < 8; ++g) {
      __m512bh wa[NP], wb[NP];
      for (int j = 0; j < NP; ++j) {
        if constexpr (Q8) {
          wa[j] = q8_bf16(w[j] + b * bytes + g * 64);
          wb[j] = q8_bf16(w[j] + b * bytes + g * 64 + 32);
        } else {
          const __m512i v = _mm512_cvtepu8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + b * bytes + g * 32)));
          wa[j] = (__m512bh)_mm512_ternarylogic_epi32(v, low, one28, 0xEA);  // (v & low) | one28
          wb[j] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), one28);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * B.k2 + 2 * g]));
        const __m512bh xc = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * B.k2 + 2 * g + 1]));
        for (int j = 0; j < NP; ++j) {
          t[r][j] = _mm512_dpbf16_ps(t[r][j], xa, wa[j]);
          t[r][j] = _mm512_dpbf16_ps(t[r][j], xc, wb[j]);
        }
      }
    }
    for (int j = 0; j < NP; ++j) {
      const uint8_t* sc = w[j] + b * bytes + (bytes - (Q8 ? 32 : 64));
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      if constexpr (Q8) {
        for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_fmadd_ps(t[r][j], d, acc[r][j]);
      } else {
        const __m512 mm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
        const __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, mm);  // m - 128 d
        for (int r = 0; r < MR; ++r) {
          const __m512 s = _mm512_set1_ps(B.s[(r0 + r) * B.blocks + b]);
          acc[r][j] = _mm512_fmadd_ps(t[r][j], d, acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(c, s, acc[r][j]);
        }
      }
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * kPanel, nn = std::min<int64_t>(kPanel, B.n - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << nn) - 1u);
    const __m512 bias = B.bias ? _mm512_maskz_loadu_ps(mask, B.bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm512_mask_storeu_ps(B.out + (r0 + r) * B.n + n0, mask, _mm512_add_ps(acc[r][j], bias));
  }
}

// rows [r0, r1) of panels p0 .. p0 + NP, in tiles of 8 rows and one of the rest
template <int NP, bool Q8>
void rows_of(const Problem& B, int64_t p0, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) tile<kTileRows, NP, Q8>(B, r, p0);
  switch (r1 - r) {
    case 1: return tile<1, NP, Q8>(B, r, p0);
    case 2: return tile<2, NP, Q8>(B, r, p0);
    case 3: return tile<3, NP, Q8>(B, r, p0);
    case 4: return tile<4, NP, Q8>(B, r, p0);
    case 5: return tile<5, NP, Q8>(B, r, p0);
    case 6: return tile<6, NP, Q8>(B, r, p0);
    case 7: return tile<7, NP, Q8>(B, r, p0);
    default: return;
  }
}

template <bool Q8>
void panel_group(const Problem& B, int64_t np, int64_t p0, int64_t r0, int64_t r1) {
  if (np == 3) rows_of<3, Q8>(B, p0, r0, r1);
  else if (np == 2) rows_of<2, Q8>(B, p0, r0, r1);
  else rows_of<1, Q8>(B, p0, r0, r1);
}

// float32 rows -> bf16 (round to nearest even) and each block's sum of the rounded values; K a multiple of 32
void to_bf16_sums(const float* x, int64_t m, int64_t k, int64_t ld, uint16_t* out, float* sums) {
  for (int64_t r = 0; r < m; ++r) {
    const float* src = x + r * ld;
    uint16_t* dst = out + r * k;
    for (int64_t i = 0; i < k; i += kBlock) {
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
      _mm512_storeu_si512(dst + i, h);
      if (!sums) continue;
      // bf16 -> float32 is a shift left by 16
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
      const __m512 hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
      sums[r * (k / kBlock) + i / kBlock] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}

#pragma GCC pop_options
#endif  // KVLLM_X86

}  // namespace

void quant_panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        at::Tensor& out) {
  TORCH_CHECK_VALUE(cpu_has_avx512_bf16(), "quant_panel_linear needs AVX512-BF16 (this CPU lacks it)");
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                        (w.size(2) == kQ4Bytes || w.size(2) == kQ8Bytes),
                    "w must be contiguous quantized panels uint8 [P, K/32, 320 (4-bit) or 544 (8-bit)] "
                    "(engine/models/quant_panels.py)");
  const int64_t n = check_panel_rows(x, out, bias, w.size(0));
  const bool q8 = w.size(2) == kQ8Bytes;
  const int64_t m = x.size(0), k = x.size(1), panels = w.size(0), blocks = w.size(1);
  TORCH_CHECK_VALUE(k == kBlock * blocks, "x has ", k, " columns, the panels hold ", kBlock * blocks);
  if (m == 0) return;
#ifdef KVLLM_X86
  std::vector<uint16_t> xb(m * k);
  std::vector<float> sums(q8 ? 0 : m * blocks);
  const float* xf = x.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
    to_bf16_sums(xf + r0 * ld, r1 - r0, k, ld, xb.data() + r0 * k, q8 ? nullptr : sums.data() + r0 * blocks);
  });
  Problem B{reinterpret_cast<const uint32_t*>(xb.data()), sums.data(), w.data_ptr<uint8_t>(),
            bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), m, k / 2, blocks, n, panels};
  // up to 4 rows a work item is one panel (more items to split, one stream each); above, three panels share each
  // row's broadcast of x (docs/benchmarks.md, "Quantized panels")
  const int64_t np = m <= 4 ? 1 : 3;
  const int64_t groups = (panels + np - 1) / np;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p0 = (i / chunks) * np, here = std::min<int64_t>(np, panels - p0);
      const int64_t r0 = (i % chunks) * kChunkRows, r1 = std::min<int64_t>(m, r0 + kChunkRows);
      if (q8) panel_group<true>(B, here, p0, r0, r1);
      else panel_group<false>(B, here, p0, r0, r1);
    }
  });
#endif
}

namespace ops {
void quant_panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        at::Tensor& out) {
  kvllm_cpu::quant_panel_linear(x, w, bias, out);
}
}  // namespace ops

TORCH_LIBRARY_FRAGMENT(kvllm_cpu, m) {
  m.def("quant_panel_linear(Tensor x, Tensor w_panels, Tensor? bias, Tensor(a!) out) -> ()", &quant_panel_linear);
}

}  // namespace kvllm_cpu
