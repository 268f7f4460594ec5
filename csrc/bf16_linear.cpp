// bf16_linear: y = x W^T + b with W held as bfloat16 panels for AVX512-BF16's vdpbf16ps (engine/models/bf16_panels.py
// packs them), x float32 rounded to bfloat16 once per call, y float32.
//
// Layout: panel p holds output channels [16p, 16p + 16) as [K/2, 16, 2]: for each pair of input columns, the 16
// channels' two weights side by side, so one 64-byte load is the panel's weights for two columns and one vdpbf16ps
// with a broadcast (x[r][2k], x[r][2k+1]) pair adds 32 products into the panel's 16 accumulators of row r.
// Tile: MR <= 8 rows x 3 panels (24 accumulators), the three panels streamed in step, K pairs innermost; rows past
// 8 take the next tile over the same panels (then in L2). Panel groups are split over torch's threads.
// Why: a decode step of 8-64 sequences multiplies each weight by few rows; oneDNN's bf16 GEMM runs those shapes well
// below the rate it reaches at prefill sizes, and the float32 kernels on the GGUF blocks do half the work per
// instruction (docs/benchmarks.md, "GEMMs split by row count").
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "panels.h"

namespace kvllm_cpu {
namespace {

constexpr int kTileRows = 8;
constexpr int kTilePanels = 3;
constexpr int64_t kChunkRows = 256;  // rows per work item (a multiple of kTileRows)

// Whether the tiles prefetch the next panel group (rows_of); on unless a benchmark turns it off to measure it
// (torch.ops.kvllm_cpu.set_bf16_prefetch, bench/panel_prefetch.py).
std::atomic<bool> g_prefetch{true};

struct Problem {
  const uint32_t* x;  // [M, K/2] bf16 pairs
  const uint16_t* w;  // [P, K/2, 16, 2]
  const float* bias;  // [N] or null
  float* out;         // [M, N]
  int64_t m, k2, n, panels;
};

#ifdef KVLLM_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma")

// pf: lines of the next panel group to prefetch, one per k pair (pf_lines of them, 64 bytes apart)
template <int MR, int NP>
inline void tile(const Problem& B, int64_t r0, int64_t p0, const char* pf, int64_t pf_lines) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* w[NP];
  for (int j = 0; j < NP; ++j) w[j] = B.w + (p0 + j) * B.k2 * 2 * kPanel;
  const uint32_t* x = B.x + r0 * B.k2;
  for (int64_t kk = 0; kk < B.k2; ++kk) {
    if (kk < pf_lines) _mm_prefetch(pf + kk * 64, _MM_HINT_T1);
    __m512bh wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + kk * 2 * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * B.k2 + kk]));
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * kPanel, nn = std::min<int64_t>(kPanel, B.n - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << nn) - 1u);
    const __m512 b = B.bias ? _mm512_maskz_loadu_ps(mask, B.bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm512_mask_storeu_ps(B.out + (r0 + r) * B.n + n0, mask, _mm512_add_ps(acc[r][j], b));
  }
}

// rows [r0, r1) of panels p0 .. p0 + NP. While they run, the tiles prefetch the next group's panels (`next`,
// `next_lines` 64-byte lines) into L2, each tile a slice, at most one line per k pair: the next group then comes
// from cache rather than DRAM, where hardware prefetch left its first tile waiting (docs/benchmarks.md, "bf16
// panels: prefetching the next group"). More than one line per k pair, at 8 rows, ran slower than none.
template <int NP>
void rows_of(const Problem& B, int64_t p0, int64_t r0, int64_t r1, const char* next, int64_t next_lines) {
  const int64_t tiles = (r1 - r0 + kTileRows - 1) / kTileRows;
  const int64_t slice = next ? (next_lines + tiles - 1) / tiles : 0;
  auto pf = [&](int64_t r, const char** at) {  // this tile's slice: its start, and how many lines (capped by k2)
    const int64_t first = (r - r0) / kTileRows * slice;
    *at = next + first * 64;
    return std::clamp<int64_t>(std::min(slice, next_lines - first), 0, B.k2);
  };
  const char* at = nullptr;
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) {
    const int64_t n = pf(r, &at);
    tile<kTileRows, NP>(B, r, p0, at, n);
  }
  const int64_t n = r < r1 ? pf(r, &at) : 0;
  switch (r1 - r) {
    case 1: return tile<1, NP>(B, r, p0, at, n);
    case 2: return tile<2, NP>(B, r, p0, at, n);
    case 3: return tile<3, NP>(B, r, p0, at, n);
    case 4: return tile<4, NP>(B, r, p0, at, n);
    case 5: return tile<5, NP>(B, r, p0, at, n);
    case 6: return tile<6, NP>(B, r, p0, at, n);
    case 7: return tile<7, NP>(B, r, p0, at, n);
    default: return;
  }
}

// float32 rows -> bf16 (round to nearest even), K even
void to_bf16(const float* x, int64_t m, int64_t k, int64_t ld, uint16_t* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* src = x + r * ld;
    uint16_t* dst = out + r * k;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
      _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i)));
    for (; i < k; ++i) {
      const c10::BFloat16 b(src[i]);  // round to nearest even, as cvtne2ps
      std::memcpy(dst + i, &b, 2);
    }
  }
}

#pragma GCC pop_options
#endif  // KVLLM_X86

}  // namespace

void bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK_VALUE(cpu_has_avx512_bf16(), "bf16_linear needs AVX512-BF16 (this CPU lacks it)");
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                        w.size(2) == kPanel && w.size(3) == 2,
                    "w must be contiguous bf16 panels [P, K/2, 16, 2] (engine/models/bf16_panels.py)");
  const int64_t n = check_panel_rows(x, out, bias, w.size(0));
  const int64_t m = x.size(0), k = x.size(1), panels = w.size(0);
  TORCH_CHECK_VALUE(k == 2 * w.size(1), "x has ", k, " columns, the panels hold ", 2 * w.size(1));
  if (m == 0) return;
#ifdef KVLLM_X86
  std::vector<uint16_t> xb(m * k);
  const float* xf = x.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) { to_bf16(xf + r0 * ld, r1 - r0, k, ld, xb.data() + r0 * k); });
  Problem B{reinterpret_cast<const uint32_t*>(xb.data()), reinterpret_cast<const uint16_t*>(w.data_ptr()),
            bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), m, k / 2, n, panels};
  // work items: (group of 3 panels, chunk of kChunkRows rows), a group's chunks adjacent so that a thread's run of
  // items reuses the group's panels from its cache; a decode step (m <= kChunkRows) splits over groups only
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  const bool prefetch = g_prefetch.load(std::memory_order_relaxed);
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p0 = (i / chunks) * kTilePanels, np = std::min<int64_t>(kTilePanels, panels - p0);
      const int64_t r0 = (i % chunks) * kChunkRows, r1 = std::min<int64_t>(m, r0 + kChunkRows);
      // the last chunk of a group prefetches the next group's panels (contiguous: [P, K/2, 16, 2])
      const int64_t p1 = p0 + np;
      const bool last = prefetch && i % chunks == chunks - 1 && p1 < panels;
      const char* next = last ? reinterpret_cast<const char*>(B.w + p1 * B.k2 * 2 * kPanel) : nullptr;
      const int64_t next_lines = last ? std::min<int64_t>(kTilePanels, panels - p1) * B.k2 : 0;
      if (np == 3) rows_of<3>(B, p0, r0, r1, next, next_lines);
      else if (np == 2) rows_of<2>(B, p0, r0, r1, next, next_lines);
      else rows_of<1>(B, p0, r0, r1, next, next_lines);
    }
  });
#endif
}

bool has_avx512_bf16() { return cpu_has_avx512_bf16(); }

bool set_bf16_prefetch(bool on) { return g_prefetch.exchange(on); }

namespace ops {
void bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  kvllm_cpu::bf16_linear(x, w, bias, out);
}
}  // namespace ops

TORCH_LIBRARY_FRAGMENT(kvllm_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor w_panels, Tensor? bias, Tensor(a!) out) -> ()", &bf16_linear);
  m.def("has_avx512_bf16() -> bool", &has_avx512_bf16);
  m.def("set_bf16_prefetch(bool on) -> bool", &set_bf16_prefetch);
}

}  // namespace kvllm_cpu
