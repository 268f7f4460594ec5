// kvllm's CPU kernels, registered as torch ops (torch.ops.kvllm_cpu.*):
//   paged_attention: attention that reads K/V in place from kvllm's page tensor (below);
//   int8_linear: y = x @ (W_int8 * scale)^T + bias, weight-only int8 (engine/models/quant.py), further down.
//   block_linear: the same y with W held as a GGUF file's blocks (engine/models/gguf_linear.py), bit-identical to
//   packed_linear on the dequantized weights.
//
// Paged attention.
// Layout (paging/kv_cache.py): one layer is [num_blocks, 2, block_size, Hkv, D], [:, 0] = K, [:, 1] = V.
// Page table (engine/attention/base.py): FlashInfer's CSR form qo_indptr / kv_indptr / kv_indices /
// kv_last_page_len. Sequence b owns query rows [qo[b], qo[b+1]) and kv_len slots; query i of its q_len rows
// attends slots [0, kv_len - q_len + i] (causal, bottom-right aligned in slot space).
//
// One work item = (sequence, KV heads, tile of query tokens). The g = Hq / Hkv query heads of a KV head are
// processed together so each K/V row is read from memory once per item. Softmax is online over chunks of kChunk slots
// (arXiv:2205.14135) in base 2 (q is pre-scaled by scale * log2 e). Items are split over torch's own intra-op
// OpenMP pool (at::parallel_for), so there is no second thread pool and torch.set_num_threads applies.
//
// Build: no -march: the AVX2+FMA (and AVX-512) code is compiled through `#pragma GCC target` and chosen at run
// time (csrc/simd.h); other CPUs take the portable path. The layers' elementwise ops are in csrc/layer_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>


#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"  // KVLLM_X86, the ISA levels, hsum, exp2_avx

namespace kvllm_cpu {
namespace {

constexpr int kChunk = 32;     // KV slots per online-softmax step (one head's K and V chunk: 16 KiB at D=64, in L1)
constexpr int kTileTokens = 8; // prefill: query tokens per work item (x g heads share each K/V row)
constexpr int kStreamChunks = 4;  // chunks read into cache per pass (stream_range): 4 x 48 KiB at SmolLM2's shapes
constexpr float kLog2e = 1.4426950408889634f;

enum class DType { F32, BF16, F16, I8, E5M2, E4M3 };

// 8-bit caches (paging/kv_format.py): a row is D one-byte values and, when scaled, their float32 scale. The compute
// kernels read the values as small floats (int8 as integers, fp8 widened through fp16), and run_item multiplies each
// score by its key's scale and each probability by its value's scale: q.k = s_k (q.k_raw), sum p v = sum (p s_v) v_raw.
template <typename T>
constexpr bool kEightBit = sizeof(T) == 1;

struct Item {
  int32_t seq, h0, h1, i0, i1;  // KV heads [h0, h1), query rows [i0, i1) of `seq` (0-based among its q_len)
};

struct Problem {
  const void* q;      // [T, Hq, D], heads and head_dim contiguous, tokens q_stride elements apart
  void* out;          // [T, Hq, D] contiguous, q's dtype
  const void* cache;  // [num_blocks, 2, bs, Hkv, W] contiguous, W = D (+ 4 scale bytes: `scaled`)
  DType q_dtype, kv_dtype;
  bool scaled;
  const int32_t* qo;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_lens;
  int64_t hq, hkv, g, d, w, bs, q_stride;  // w: elements per (slot, head) row
  int64_t block_stride, v_offset, slot_stride;  // elements
  float qscale;                                 // scale * log2(e)
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
inline void load_row_t(const T* p, int64_t d, float scale, float* dst) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_f(p[i]) * scale;
}

template <typename T>
inline void store_row_t(T* p, int64_t d, float mul, const float* src) {
  for (int64_t i = 0; i < d; ++i) p[i] = static_cast<T>(src[i] * mul);
}

// dst[0, d) = row idx of a q-typed tensor, times scale
inline void load_row(const void* base, DType t, int64_t idx, int64_t d, float scale, float* dst) {
  switch (t) {
    case DType::F32: return load_row_t(static_cast<const float*>(base) + idx, d, scale, dst);
    case DType::BF16: return load_row_t(static_cast<const c10::BFloat16*>(base) + idx, d, scale, dst);
    case DType::F16: return load_row_t(static_cast<const c10::Half*>(base) + idx, d, scale, dst);
  }
}

// row idx of an out-typed tensor = src[0, d) times mul
inline void store_row(void* base, DType t, int64_t idx, int64_t d, float mul, const float* src) {
  switch (t) {
    case DType::F32: return store_row_t(static_cast<float*>(base) + idx, d, mul, src);
    case DType::BF16: return store_row_t(static_cast<c10::BFloat16*>(base) + idx, d, mul, src);
    case DType::F16: return store_row_t(static_cast<c10::Half*>(base) + idx, d, mul, src);
  }
}

// Per-thread scratch (one per part, reused over its items). E: the element type the compute kernels read K/V rows
// in (the cache's own type for AVX2, which converts in registers; float for the portable kernels).
template <typename E>
struct Scratch {
  std::vector<float> qs, o, s, m, l, kbuf, vbuf, ks, vs;  // ks, vs: the chunk's K and V row scales (8-bit)
  std::vector<const E*> kp, vp;
  std::vector<int64_t> off;  // element offsets of the current chunk's K rows (KV head 0)
  std::vector<int32_t> nv;             // valid (causal) slots of each query token's rows in the current chunk
  Scratch(int64_t rows, int64_t d)
      : qs(rows * d), o(rows * d), s(rows * kChunk), m(rows), l(rows), kbuf(kChunk * d), vbuf(kChunk * d),
        ks(kChunk), vs(kChunk), kp(kChunk), vp(kChunk), off(kChunk), nv(rows) {}
};

// The query rows of one KV head within an item, for one chunk of slots: row r attends chunk slots [0, nv[r]).
template <typename E>
struct Rows {
  const float* q;  // [n, d], pre-scaled
  float* o;        // [n, d] running output (unnormalised)
  float* s;        // [n, kChunk] scores, then probabilities (0 past nv)
  const int32_t* nv;
  int64_t n, d;
  const E* const* kp;  // the chunk's K rows
  const E* const* vp;  // and V rows
};

// Offsets of the K rows (KV head 0) of slots [c0, c1) of a sequence, walking its pages without divisions
// per slot (an integer division per slot and head cost as much as the chunk's dot products).
inline void slot_offsets(const Problem& P, const int32_t* pages, int64_t c0, int64_t c1, int64_t* off) {
  int64_t p = c0 / P.bs, o = c0 - p * P.bs;
  int64_t base = pages[p] * P.block_stride;
  for (int64_t j = 0; j < c1 - c0; ++j) {
    off[j] = base + o * P.slot_stride;
    if (++o == P.bs && c0 + j + 1 < c1) {
      o = 0;
      base = pages[++p] * P.block_stride;
    }
  }
}

// Reads every cache line of the K and V rows of all KV heads of slots [c0, c1) of a sequence, so the head-by-head
// compute that follows hits L1/L2. A block's [block_size, Hkv, D] rows are contiguous (K, then V right after), so
// the range is a few address-contiguous runs, read one after another, line by line, in address order. Measured on
// this repository's benchmark machine (AMD Zen 5, 64 x 512 slots, 1 thread; docs/benchmarks.md): reading before
// computing beats computing straight from DRAM, runs in address order beat visiting the runs' lines in turn
// (1.25x), a range of a few chunks beats one chunk, and software prefetch of the next range (into L1 or L2, at
// once or spread over the compute) gained nothing.
template <typename T>
inline void stream_range(const Problem& P, const int32_t* pages, int64_t c0, int64_t c1) {
  const char* cache = static_cast<const char*>(P.cache);
  const int64_t slot_bytes = P.slot_stride * static_cast<int64_t>(sizeof(T));
  auto read = [](const char* p, int64_t n) {  // volatile byte loads: kept, and independent of each other
    for (int64_t b = 0; b < n; b += 64) (void)static_cast<const volatile char*>(p)[b];
  };
  for (int64_t c = c0; c < c1;) {
    const int64_t p = c / P.bs, e = std::min<int64_t>(c1, (p + 1) * P.bs);
    const char* k = cache + (pages[p] * P.block_stride + (c - p * P.bs) * P.slot_stride) * sizeof(T);
    read(k, (e - c) * slot_bytes);
    read(k + P.v_offset * sizeof(T), (e - c) * slot_bytes);
    c = e;
  }
}

// Row pointers of the chunk's slots for KV head h: into the cache when the kernels read its type (E == T), else
// (portable kernels on a half-precision cache) converted into scratch.
template <typename K, typename T, typename E>
inline void chunk_rows(const Problem& P, const int64_t* off, int64_t n, int64_t h, Scratch<E>& sc) {
  const T* cache = static_cast<const T*>(P.cache);
  if constexpr (kEightBit<T>) {
    // the SIMD loads give e4m3 values / 256 (csrc/simd.h load8): the factor rides on the scales
    constexpr float fold = std::is_same_v<T, c10::Float8_e4m3fn> && std::is_same_v<T, E> ? 256.f : 1.f;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t row = off[j] + h * P.w;
      float a = 1.f, b = 1.f;
      if (P.scaled) {
        std::memcpy(&a, cache + row + P.d, sizeof(float));
        std::memcpy(&b, cache + row + P.v_offset + P.d, sizeof(float));
      }
      sc.ks[j] = a * fold;
      sc.vs[j] = b * fold;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = off[j] + h * P.w;
    if constexpr (std::is_same_v<T, E>) {
      sc.kp[j] = cache + row;
      sc.vp[j] = cache + row + P.v_offset;
    } else {
      float* kd = sc.kbuf.data() + j * P.d;
      float* vd = sc.vbuf.data() + j * P.d;
      K::to_float(cache + row, kd, P.d);
      K::to_float(cache + row + P.v_offset, vd, P.d);
      sc.kp[j] = kd;
      sc.vp[j] = vd;
    }
  }
  // kernels that take keys 16 at a time read past n up to the next multiple of 16: valid rows whose scores are
  // never used (softmax and accumulate stop at each row's nv <= n)
  for (int64_t j = n; j < kChunk && n > 0; ++j) {
    sc.kp[j] = sc.kp[n - 1];
    sc.vp[j] = sc.vp[n - 1];
  }
}

// ---- portable kernels -----------------------------------------------------------------------------------
struct Portable {
  template <typename T>
  static void to_float(const T* src, float* dst, int64_t d) {
    for (int64_t i = 0; i < d; ++i) dst[i] = to_f(src[i]);
  }
  template <typename T>
  using Elem = float;  // K/V rows reach these kernels as float (half caches are converted in scratch)
  // s[r][j] = q[r] . k[j] for j < nv[r]
  static void scores(const Rows<float>& R) {
    for (int64_t r = 0; r < R.n; ++r) {
      const float* q = R.q + r * R.d;
      for (int64_t j = 0; j < R.nv[r]; ++j) {
        const float* k = R.kp[j];
        float acc = 0.f;
        for (int64_t i = 0; i < R.d; ++i) acc += q[i] * k[i];
        R.s[r * kChunk + j] = acc;
      }
    }
  }
  static float row_max(const float* x, int64_t n, float mx) {
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, x[j]);
    return mx;
  }
  // x[j] = 2^(x[j] - mx); returns their sum
  static float exp2_shift(float* x, int64_t n, float mx) {
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += (x[j] = std::exp2(x[j] - mx));
    return sum;
  }
  static void scale_row(float* o, int64_t d, float c) {
    for (int64_t i = 0; i < d; ++i) o[i] *= c;
  }
  // the item's output rows [rows, d] into natural order (kernels that accumulate in another order override it)
  static void finish(float*, int64_t, int64_t) {}
  // o[r] += sum_{j < nv[r]} p[r][j] v[j]
  static void accumulate(const Rows<float>& R) {
    for (int64_t r = 0; r < R.n; ++r) {
      float* o = R.o + r * R.d;
      for (int64_t j = 0; j < R.nv[r]; ++j) {
        const float w = R.s[r * kChunk + j];
        const float* v = R.vp[j];
        for (int64_t i = 0; i < R.d; ++i) o[i] += w * v[i];
      }
    }
  }
};

// ---- AVX2 + FMA kernels (D % 8 == 0) -------------------------------------------------------------------
#ifdef KVLLM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// MB query rows x NK keys of dot products, D/8 FMAs each; the NK=4 sums are reduced with two hadd levels.
template <int MB, int NK, typename E>
inline void dots(const float* const* q, const E* const* k, int64_t d, float* const* out) {
  __m256 acc[MB][NK];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NK; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = load8(k[j] + i);
    for (int r = 0; r < MB; ++r) {
      __m256 qv = _mm256_loadu_ps(q[r] + i);
      for (int j = 0; j < NK; ++j) acc[r][j] = _mm256_fmadd_ps(qv, kv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MB; ++r) {
    if constexpr (NK == 4) {
      __m256 t0 = _mm256_hadd_ps(acc[r][0], acc[r][1]);
      __m256 t1 = _mm256_hadd_ps(acc[r][2], acc[r][3]);
      __m256 t2 = _mm256_hadd_ps(t0, t1);
      _mm_storeu_ps(out[r], _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
    } else {
      for (int j = 0; j < NK; ++j) out[r][j] = hsum(acc[r][j]);
    }
  }
}

template <int MB, typename E>
inline void score_block(const Rows<E>& R, int64_t r0, int64_t jmax) {
  const float* q[MB];
  for (int r = 0; r < MB; ++r) q[r] = R.q + (r0 + r) * R.d;
  int64_t j = 0;
  for (; j + 4 <= jmax; j += 4) {
    float* o[MB];
    for (int r = 0; r < MB; ++r) o[r] = R.s + (r0 + r) * kChunk + j;
    dots<MB, 4>(q, R.kp + j, R.d, o);
  }
  for (; j < jmax; ++j) {
    float* o[MB];
    for (int r = 0; r < MB; ++r) o[r] = R.s + (r0 + r) * kChunk + j;
    dots<MB, 1>(q, R.kp + j, R.d, o);
  }
}

// o[r] (rows r0..r0+MB) += sum_{j < jmax} p[r][j] v[j] over D columns [c, c + 8*NV); p is 0 past a row's nv.
template <int MB, int NV, typename E>
inline void pv_block(const Rows<E>& R, int64_t r0, int64_t jmax, int64_t c) {
  __m256 acc[MB][NV];
  for (int r = 0; r < MB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_loadu_ps(R.o + (r0 + r) * R.d + c + 8 * v);
  for (int64_t j = 0; j < jmax; ++j) {
    const E* vr = R.vp[j] + c;
    __m256 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load8(vr + 8 * v);
    for (int r = 0; r < MB; ++r) {
      __m256 w = _mm256_broadcast_ss(R.s + (r0 + r) * kChunk + j);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(w, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(R.o + (r0 + r) * R.d + c + 8 * v, acc[r][v]);
}

template <int MB, typename E>
inline void pv_rows(const Rows<E>& R, int64_t r0, int64_t jmax) {
  int64_t c = 0;
  for (; c + 16 <= R.d; c += 16) pv_block<MB, 2>(R, r0, jmax, c);
  for (; c < R.d; c += 8) pv_block<MB, 1>(R, r0, jmax, c);
}

template <typename E>
inline int64_t block_jmax(const Rows<E>& R, int64_t r0, int64_t mb) {
  int64_t j = 0;
  for (int64_t r = r0; r < r0 + mb; ++r) j = std::max<int64_t>(j, R.nv[r]);
  return j;
}

struct Avx2 {
  template <typename T>
  using Elem = T;  // reads the cache's own type (load8 widens in registers)
  static void finish(float*, int64_t, int64_t) {}
  // Rows go in blocks of 3 (a GQA group of 3, or 3 rows of a prefill tile): each K/V vector loaded from L1
  // feeds 3 FMAs. Within a block, rows with a shorter causal prefix compute (and later zero) a few extra scores.
  template <typename E>
  static void scores(const Rows<E>& R) {
    int64_t r = 0;
    for (; r + 3 <= R.n; r += 3) {
      int64_t jm = block_jmax(R, r, 3);
      if (jm) score_block<3>(R, r, jm);
    }
    for (; r < R.n; ++r)
      if (R.nv[r]) score_block<1>(R, r, R.nv[r]);
  }
  static float row_max(const float* x, int64_t n, float mx) {
    int64_t j = 0;
    if (n >= 8) {
      __m256 m = _mm256_loadu_ps(x);
      for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      mx = std::max(mx, _mm_cvtss_f32(h));
    }
    for (; j < n; ++j) mx = std::max(mx, x[j]);
    return mx;
  }
  static float exp2_shift(float* x, int64_t n, float mx) {
    __m256 m = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 e = exp2_avx(_mm256_sub_ps(_mm256_loadu_ps(x + j), m));
      _mm256_storeu_ps(x + j, e);
      acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; j < n; ++j) sum += (x[j] = std::exp2(x[j] - mx));
    return sum;
  }
  static void scale_row(float* o, int64_t d, float c) {
    __m256 cv = _mm256_set1_ps(c);
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), cv));
  }
  template <typename E>
  static void accumulate(const Rows<E>& R) {
    int64_t r = 0;
    for (; r + 3 <= R.n; r += 3) {
      int64_t jm = block_jmax(R, r, 3);
      if (jm) pv_rows<3>(R, r, jm);
    }
    for (; r < R.n; ++r)
      if (R.nv[r]) pv_rows<1>(R, r, R.nv[r]);
  }
};

#pragma GCC pop_options

// ---- AVX-512 kernels (D % 16 == 0) ---------------------------------------------------------------------
// The accumulation repeats Avx2's loops on 16-float vectors; at head_dim 64 and 128 scores take 16 keys at a time
// (score16 below; other head_dims dots512), and the softmax bookkeeping runs on 16 lanes with masked tails. On
// cores with full-width 512-bit FMA units (AMD Zen 5, Intel server cores) one instruction does twice the work; a
// decode layer call from DRAM is then bound by reading the K/V rows (docs/benchmarks.md, "Attention kernel: this
// build against an earlier one").
// The accumulation loops repeat Avx2's on purpose: one template shared by both `#pragma GCC target` regions would be
// compiled with the target of its definition, i.e. AVX-512 code in the AVX2 instantiation (SIGILL on AVX2-only CPUs).
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e5m2* p) {  // e5m2 is the high byte of an fp16
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {  // value / 256, as simd.h load8 (the kernel folds 256 into the scale)
  const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7F)), 7)));
}

inline __m256 fold256(__m512 a) {  // lanes i and i + 8 added (AVX512F only: no 32x8 extract, which is DQ)
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

template <int MB, int NK, typename E>
inline void dots512(const float* const* q, const E* const* k, int64_t d, float* const* out) {
  __m512 acc[MB][NK];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NK; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    __m512 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = load16(k[j] + i);
    for (int r = 0; r < MB; ++r) {
      __m512 qv = _mm512_loadu_ps(q[r] + i);
      for (int j = 0; j < NK; ++j) acc[r][j] = _mm512_fmadd_ps(qv, kv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MB; ++r) {
    if constexpr (NK == 4) {
      __m256 t0 = _mm256_hadd_ps(fold256(acc[r][0]), fold256(acc[r][1]));
      __m256 t1 = _mm256_hadd_ps(fold256(acc[r][2]), fold256(acc[r][3]));
      __m256 t2 = _mm256_hadd_ps(t0, t1);
      _mm_storeu_ps(out[r], _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
    } else {
      for (int j = 0; j < NK; ++j) out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
    }
  }
}

template <int MB, typename E>
inline void score_block512(const Rows<E>& R, int64_t r0, int64_t jmax) {
  const float* q[MB];
  for (int r = 0; r < MB; ++r) q[r] = R.q + (r0 + r) * R.d;
  int64_t j = 0;
  for (; j + 4 <= jmax; j += 4) {
    float* o[MB];
    for (int r = 0; r < MB; ++r) o[r] = R.s + (r0 + r) * kChunk + j;
    dots512<MB, 4>(q, R.kp + j, R.d, o);
  }
  for (; j < jmax; ++j) {
    float* o[MB];
    for (int r = 0; r < MB; ++r) o[r] = R.s + (r0 + r) * kChunk + j;
    dots512<MB, 1>(q, R.kp + j, R.d, o);
  }
}

template <int MB, int NV, typename E>
inline void pv_block512(const Rows<E>& R, int64_t r0, int64_t jmax, int64_t c) {
  __m512 acc[MB][NV];
  for (int r = 0; r < MB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(R.o + (r0 + r) * R.d + c + 16 * v);
  for (int64_t j = 0; j < jmax; ++j) {
    const E* vr = R.vp[j] + c;
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load16(vr + 16 * v);
    for (int r = 0; r < MB; ++r) {
      __m512 w = _mm512_set1_ps(R.s[(r0 + r) * kChunk + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(w, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(R.o + (r0 + r) * R.d + c + 16 * v, acc[r][v]);
}

template <int MB, typename E>
inline void pv_rows512(const Rows<E>& R, int64_t r0, int64_t jmax) {
  int64_t c = 0;
  for (; c + 64 <= R.d; c += 64) pv_block512<MB, 4>(R, r0, jmax, c);
  for (; c < R.d; c += 16) pv_block512<MB, 1>(R, r0, jmax, c);
}

// Scores 16 keys at a time, with no horizontal sum per dot product: each (row, key) accumulator holds 16 partial
// sums, and a transpose-and-add tree turns the 16 accumulators of a row into one vector of its 16 scores in key
// order (45 shuffles/adds per 16 dot products; dots512's horizontal sum per dot product costs about as much as its
// FMAs).
#define KVLLM_INLINE inline __attribute__((always_inline))

// keys (a0, a1, a2, a3) -> per 128-bit lane L: [sum of a0's 4 lanes in L, a1's, a2's, a3's]
KVLLM_INLINE __m512 tree4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 b01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));  // a0 in 0,2; a1 in 1,3
  const __m512 b23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(b01, b23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(b01, b23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// two vectors of 4-key groups per 128-bit lane, x = [x0 x1 x2 x3], y = [y0 y1 y2 y3] (lanes) ->
// [x0 + x1, x2 + x3, y0 + y1, y2 + y3]: applied twice, four lanes of partial sums per key become one
KVLLM_INLINE __m512 fold_lanes(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// MB rows x 4 keys (k[0..3]) over DV 16-float columns: per row, tree4 of its 4 accumulators
template <int MB, int DV, typename E>
KVLLM_INLINE void quad512(const float* q, int64_t d, const E* const* k, __m512* c) {
  __m512 acc[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int v = 0; v < DV; ++v) {
    __m512 kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = load16(k[j] + 16 * v);
    for (int r = 0; r < MB; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * d + 16 * v);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(qv, kv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MB; ++r) c[r] = tree4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

// s[r][j0, j0 + 16) for rows r0..r0+MB (keys j0..j0+15 must be valid pointers; see chunk_rows)
template <int MB, int DV, typename E>
KVLLM_INLINE void score16(const Rows<E>& R, int64_t r0, int64_t j0) {
  const float* q = R.q + r0 * R.d;
  __m512 c0[MB], c1[MB], half[MB];
  quad512<MB, DV>(q, R.d, R.kp + j0, c0);
  quad512<MB, DV>(q, R.d, R.kp + j0 + 4, c1);
  for (int r = 0; r < MB; ++r) half[r] = fold_lanes(c0[r], c1[r]);  // keys 0-7, two lanes each
  quad512<MB, DV>(q, R.d, R.kp + j0 + 8, c0);
  quad512<MB, DV>(q, R.d, R.kp + j0 + 12, c1);
  for (int r = 0; r < MB; ++r)
    _mm512_storeu_ps(R.s + (r0 + r) * kChunk + j0, fold_lanes(half[r], fold_lanes(c0[r], c1[r])));
}

template <int MB, int DV, typename E>
inline void score_rows16(const Rows<E>& R, int64_t r0, int64_t jmax) {
  for (int64_t j0 = 0; j0 < jmax; j0 += 16) score16<MB, DV>(R, r0, j0);
}

template <int DV, typename E>
inline void scores_tree(const Rows<E>& R) {
  int64_t r = 0;
  for (; r + 3 <= R.n; r += 3) {
    const int64_t jm = block_jmax(R, r, 3);
    if (jm) score_rows16<3, DV>(R, r, jm);
  }
  for (; r < R.n; ++r)
    if (R.nv[r]) score_rows16<1, DV>(R, r, R.nv[r]);
}

// 2^x as exp2_avx (csrc/simd.h: same clamp and polynomial, kExp2Poly), 16 lanes; 2^n applied by scalef
KVLLM_INLINE __m512 exp2_512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.f)), _mm512_set1_ps(126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

KVLLM_INLINE __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }  // n in [0, 16]

struct Avx512 : Avx2 {
  template <typename E>
  static void scores(const Rows<E>& R) {
    if (R.d == 64) return scores_tree<4>(R);
    if (R.d == 128) return scores_tree<8>(R);
    int64_t r = 0;
    for (; r + 3 <= R.n; r += 3) {
      int64_t jm = block_jmax(R, r, 3);
      if (jm) score_block512<3>(R, r, jm);
    }
    for (; r < R.n; ++r)
      if (R.nv[r]) score_block512<1>(R, r, R.nv[r]);
  }
  template <typename E>
  static void accumulate(const Rows<E>& R) {
    int64_t r = 0;
    for (; r + 3 <= R.n; r += 3) {
      int64_t jm = block_jmax(R, r, 3);
      if (jm) pv_rows512<3>(R, r, jm);
    }
    for (; r < R.n; ++r)
      if (R.nv[r]) pv_rows512<1>(R, r, R.nv[r]);
  }
  static float row_max(const float* x, int64_t n, float mx) {
    __m512 m = _mm512_set1_ps(mx);
    for (int64_t j = 0; j < n; j += 16)
      m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail_mask(std::min<int64_t>(16, n - j)), x + j));
    return _mm512_reduce_max_ps(m);
  }
  static float exp2_shift(float* x, int64_t n, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = tail_mask(std::min<int64_t>(16, n - j));
      const __m512 e = exp2_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), m));
      _mm512_mask_storeu_ps(x + j, k, e);
      acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
  }
  static void scale_row(float* o, int64_t d, float c) {
    const __m512 cv = _mm512_set1_ps(c);
    for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), cv));
  }
};

#pragma GCC pop_options

// ---- AVX512-BF16 kernels on a bfloat16 cache (D % 32 == 0) ----------------------------------------------
// vdpbf16ps multiplies 32 bf16 pairs into 16 float32 lanes, so the K and V rows are used as the page stores them,
// with no widening: the scores take q rounded to bf16 (16 keys at a time, Avx512's transpose-and-add tree), the
// value sums take the probabilities rounded to bf16, two keys a step (their V rows interleaved by 16-bit unpacks,
// which leaves the output in a permuted column order that `finish` undoes). The products are exact and summed in
// float32; the rounding of q and p to bf16 (relative 2^-9) is what GPU attention kernels do with bf16 inputs. About
// half the vector instructions of the float path per (slot, KV head) at head_dim 64 (docs/results/cpu_kernels.md,
// "Attention with AVX512-BF16 dot products").
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")

using Bf16 = c10::BFloat16;

KVLLM_INLINE __m512bh load_bh(const Bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// 32 floats -> 32 bf16 (round to nearest even), in order
KVLLM_INLINE __m512bh to_bh(const float* p) { return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p)); }

// MB rows x 4 keys over DV 32-value vectors (q: MB * DV vectors): per row, tree4 of its 4 accumulators
template <int MB, int DV>
KVLLM_INLINE void quad_bh(const __m512bh* q, const Bf16* const* k, __m512* c) {
  __m512 acc[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int v = 0; v < DV; ++v) {
    __m512bh kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = load_bh(k[j] + 32 * v);
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], q[r * DV + v], kv[j]);
  }
  for (int r = 0; r < MB; ++r) c[r] = tree4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

template <int MB, int DV>
inline void score_rows_bh(const Rows<Bf16>& R, int64_t r0, int64_t jmax) {
  __m512bh q[MB * DV];
  for (int r = 0; r < MB; ++r)
    for (int v = 0; v < DV; ++v) q[r * DV + v] = to_bh(R.q + (r0 + r) * R.d + 32 * v);
  for (int64_t j0 = 0; j0 < jmax; j0 += 16) {
    __m512 c0[MB], c1[MB], half[MB];
    quad_bh<MB, DV>(q, R.kp + j0, c0);
    quad_bh<MB, DV>(q, R.kp + j0 + 4, c1);
    for (int r = 0; r < MB; ++r) half[r] = fold_lanes(c0[r], c1[r]);
    quad_bh<MB, DV>(q, R.kp + j0 + 8, c0);
    quad_bh<MB, DV>(q, R.kp + j0 + 12, c1);
    for (int r = 0; r < MB; ++r)
      _mm512_storeu_ps(R.s + (r0 + r) * kChunk + j0, fold_lanes(half[r], fold_lanes(c0[r], c1[r])));
  }
}

template <int DV>
inline void scores_bh(const Rows<Bf16>& R) {
  int64_t r = 0;
  for (; r + 3 <= R.n; r += 3) {
    const int64_t jm = block_jmax(R, r, 3);
    if (jm) score_rows_bh<3, DV>(R, r, jm);
  }
  for (; r < R.n; ++r)
    if (R.nv[r]) score_rows_bh<1, DV>(R, r, R.nv[r]);
}

// o[r] (rows r0..r0+MB; columns [c, c + 32 * DH) in the permuted order) += sum_{j < jmax} p[r][j] v[j], two keys
// per vdpbf16ps. pb[r]: row r's probabilities as bf16 pairs (key 2m low, 2m + 1 high), zero from jmax on.
template <int MB, int DH>
inline void pv_bh(const Rows<Bf16>& R, int64_t r0, int64_t jmax, int64_t c, const uint32_t (*pb)[kChunk / 2]) {
  __m512 acc[MB][2 * DH];
  for (int r = 0; r < MB; ++r)
    for (int x = 0; x < 2 * DH; ++x) acc[r][x] = _mm512_loadu_ps(R.o + (r0 + r) * R.d + c + 16 * x);
  for (int64_t j = 0; j < jmax; j += 2) {  // key jmax (when jmax is odd) is a valid row with probability 0
    __m512bh lo[DH], hi[DH];
    for (int h = 0; h < DH; ++h) {
      const __m512i a = _mm512_loadu_si512(R.vp[j] + c + 32 * h), b = _mm512_loadu_si512(R.vp[j + 1] + c + 32 * h);
      lo[h] = (__m512bh)_mm512_unpacklo_epi16(a, b);  // per 128-bit lane: columns 0-3 of its 8, keys j, j + 1
      hi[h] = (__m512bh)_mm512_unpackhi_epi16(a, b);  // columns 4-7
    }
    for (int r = 0; r < MB; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r][j / 2]));
      for (int h = 0; h < DH; ++h) {
        acc[r][2 * h] = _mm512_dpbf16_ps(acc[r][2 * h], w, lo[h]);
        acc[r][2 * h + 1] = _mm512_dpbf16_ps(acc[r][2 * h + 1], w, hi[h]);
      }
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int x = 0; x < 2 * DH; ++x) _mm512_storeu_ps(R.o + (r0 + r) * R.d + c + 16 * x, acc[r][x]);
}

static_assert(kChunk == 32, "pv_rows_bh packs a row's probabilities into one 64-byte vector");

template <int MB>
inline void pv_rows_bh(const Rows<Bf16>& R, int64_t r0, int64_t jmax) {
  alignas(64) uint32_t pb[MB][kChunk / 2];
  for (int r = 0; r < MB; ++r) {
    const float* s = R.s + (r0 + r) * kChunk;
    const __m512 a = _mm512_maskz_loadu_ps(tail_mask(std::min<int64_t>(16, jmax)), s);
    const __m512 b = _mm512_maskz_loadu_ps(tail_mask(std::clamp<int64_t>(jmax - 16, 0, 16)), s + 16);
    _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
  int64_t c = 0;
  for (; c + 64 <= R.d; c += 64) pv_bh<MB, 2>(R, r0, jmax, c, pb);
  for (; c < R.d; c += 32) pv_bh<MB, 1>(R, r0, jmax, c, pb);
}

// column i of a row in pv_bh's order: within each 32 columns, the unpacks leave lane 4L + i of the low vector with
// column 8L + i and of the high vector with column 8L + 4 + i (L: the 128-bit lane, i < 4)
inline int64_t permuted_column(int64_t col) {
  const int64_t base = col & ~int64_t{31}, rem = col & 31, lane = rem / 8, k = rem % 8;
  return base + (k >= 4 ? 16 : 0) + 4 * lane + (k % 4);
}

struct Avx512Bf16 : Avx512 {
  static void scores(const Rows<Bf16>& R) {
    switch (R.d / 32) {
      case 2: return scores_bh<2>(R);
      case 4: return scores_bh<4>(R);
      case 1: return scores_bh<1>(R);
      case 3: return scores_bh<3>(R);
      default: return Avx512::scores(R);  // past head_dim 128: the float path (Avx512Bf16::accumulate still runs)
    }
  }
  static void accumulate(const Rows<Bf16>& R) {
    int64_t r = 0;
    for (; r + 3 <= R.n; r += 3) {
      const int64_t jm = block_jmax(R, r, 3);
      if (jm) pv_rows_bh<3>(R, r, jm);
    }
    for (; r < R.n; ++r)
      if (R.nv[r]) pv_rows_bh<1>(R, r, R.nv[r]);
  }
  static void finish(float* o, int64_t rows, int64_t d) {
    std::array<float, 1024> row;  // head_dim <= 1024 (checked by the caller)
    for (int64_t r = 0; r < rows; ++r) {
      float* x = o + r * d;
      std::copy(x, x + d, row.begin());
      for (int64_t i = 0; i < d; ++i) x[i] = row[permuted_column(i)];
    }
  }
};

#pragma GCC pop_options

// ---- AVX512-VNNI kernels on an int8 cache (D % 32 == 0) -------------------------------------------------
// The K and V rows are integers, so the dot products can stay integer: vpdpwssd multiplies 32 int16 pairs into 16
// int32 lanes, twice the float FMA's work, and the rows widen to int16 with one instruction per 32 values instead
// of two per 16. The scores take q as int16 with one scale per row (max |q| / 32767), the value sums each row's
// probabilities (times the value scales) as int16 with one scale per row and chunk; their sums are exact integers,
// so the only roundings are q's and p's, 2^-16 of their row's largest (the bf16 path rounds them to 2^-9 of each
// value). V rows are interleaved two keys a step as in the bf16 path, with its permuted column order. quad_i16 and
// pv_i16 repeat quad_bh's and pv_bh's loops with the integer instructions, for the reason Avx512's loops repeat
// Avx2's: a template shared by the two target regions would be compiled with one region's target.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")

KVLLM_INLINE __m512i widen_i8(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 32 floats, lo then hi (times `mul`, rounded to nearest even) -> 32 int16, in order; |x * mul| <= 32767
KVLLM_INLINE __m512i to_i16(__m512 lo, __m512 hi, __m512 mul) {
  const __m256i a = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, mul)));
  const __m256i b = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, mul)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// Integer forms of tree4 and fold_lanes (the shuffles move bits alike; the adds are exact)
KVLLM_INLINE __m512i tree4_i(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i b01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i b23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512 x = _mm512_castsi512_ps(b01), y = _mm512_castsi512_ps(b23);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0))),
                          _mm512_castps_si512(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2))));
}

KVLLM_INLINE __m512i fold_lanes_i(__m512i x, __m512i y) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// MB rows x 4 keys over DV 32-value vectors (q: MB * DV int16 vectors): per row, tree4_i of its 4 accumulators
template <int MB, int DV>
KVLLM_INLINE void quad_i16(const __m512i* q, const int8_t* const* k, __m512i* c) {
  __m512i acc[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int v = 0; v < DV; ++v) {
    __m512i kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = widen_i8(k[j] + 32 * v);
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], q[r * DV + v], kv[j]);
  }
  for (int r = 0; r < MB; ++r) c[r] = tree4_i(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

template <int MB, int DV>
inline void score_rows_i16(const Rows<int8_t>& R, int64_t r0, int64_t jmax) {
  __m512i q[MB * DV];
  __m512 unit[MB];  // the value of one int16 step of each row's q
  for (int r = 0; r < MB; ++r) {
    const float* qr = R.q + (r0 + r) * R.d;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = 0; i < R.d; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qr + i)));
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 mul = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int v = 0; v < DV; ++v)
      q[r * DV + v] = to_i16(_mm512_loadu_ps(qr + 32 * v), _mm512_loadu_ps(qr + 32 * v + 16), mul);
    unit[r] = _mm512_set1_ps(m / 32767.f);
  }
  for (int64_t j0 = 0; j0 < jmax; j0 += 16) {
    __m512i c0[MB], c1[MB], half[MB];
    quad_i16<MB, DV>(q, R.kp + j0, c0);
    quad_i16<MB, DV>(q, R.kp + j0 + 4, c1);
    for (int r = 0; r < MB; ++r) half[r] = fold_lanes_i(c0[r], c1[r]);
    quad_i16<MB, DV>(q, R.kp + j0 + 8, c0);
    quad_i16<MB, DV>(q, R.kp + j0 + 12, c1);
    for (int r = 0; r < MB; ++r) {
      const __m512i sums = fold_lanes_i(half[r], fold_lanes_i(c0[r], c1[r]));
      _mm512_storeu_ps(R.s + (r0 + r) * kChunk + j0, _mm512_mul_ps(_mm512_cvtepi32_ps(sums), unit[r]));
    }
  }
}

template <int DV>
inline void scores_i16(const Rows<int8_t>& R) {
  int64_t r = 0;
  for (; r + 3 <= R.n; r += 3) {
    const int64_t jm = block_jmax(R, r, 3);
    if (jm) score_rows_i16<3, DV>(R, r, jm);
  }
  for (; r < R.n; ++r)
    if (R.nv[r]) score_rows_i16<1, DV>(R, r, R.nv[r]);
}

// o[r] (rows r0..r0+MB; columns [c, c + 32 * DH) in the permuted order) += unit[r] * sum_{j < jmax} pi[r][j] v[j],
// two keys per vpdpwssd; pi[r]: row r's int16 probabilities as pairs (key 2m low, 2m + 1 high), zero from jmax on.
// A chunk's integer sums stay below 2^31: 32 keys x 32767 x 128.
template <int MB, int DH>
inline void pv_i16(const Rows<int8_t>& R, int64_t r0, int64_t jmax, int64_t c, const uint32_t (*pi)[kChunk / 2],
                   const __m512* unit) {
  __m512i acc[MB][2 * DH];
  for (int r = 0; r < MB; ++r)
    for (int x = 0; x < 2 * DH; ++x) acc[r][x] = _mm512_setzero_si512();
  for (int64_t j = 0; j < jmax; j += 2) {  // key jmax (when jmax is odd) is a valid row with probability 0
    __m512i lo[DH], hi[DH];
    for (int h = 0; h < DH; ++h) {
      const __m512i a = widen_i8(R.vp[j] + c + 32 * h), b = widen_i8(R.vp[j + 1] + c + 32 * h);
      lo[h] = _mm512_unpacklo_epi16(a, b);
      hi[h] = _mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < MB; ++r) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(pi[r][j / 2]));
      for (int h = 0; h < DH; ++h) {
        acc[r][2 * h] = _mm512_dpwssd_epi32(acc[r][2 * h], w, lo[h]);
        acc[r][2 * h + 1] = _mm512_dpwssd_epi32(acc[r][2 * h + 1], w, hi[h]);
      }
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int x = 0; x < 2 * DH; ++x) {
      float* o = R.o + (r0 + r) * R.d + c + 16 * x;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][x]), unit[r], _mm512_loadu_ps(o)));
    }
}

template <int MB>
inline void pv_rows_i16(const Rows<int8_t>& R, int64_t r0, int64_t jmax) {
  alignas(64) uint32_t pi[MB][kChunk / 2];
  __m512 unit[MB];
  for (int r = 0; r < MB; ++r) {
    const float* s = R.s + (r0 + r) * kChunk;
    const __m512 a = _mm512_maskz_loadu_ps(tail_mask(std::min<int64_t>(16, jmax)), s);
    const __m512 b = _mm512_maskz_loadu_ps(tail_mask(std::clamp<int64_t>(jmax - 16, 0, 16)), s + 16);
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(a, b));  // probabilities are >= 0
    _mm512_store_si512(pi[r], to_i16(a, b, _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f)));
    unit[r] = _mm512_set1_ps(m / 32767.f);
  }
  int64_t c = 0;
  for (; c + 64 <= R.d; c += 64) pv_i16<MB, 2>(R, r0, jmax, c, pi, unit);
  for (; c < R.d; c += 32) pv_i16<MB, 1>(R, r0, jmax, c, pi, unit);
}

struct Avx512I8 : Avx512 {
  static void scores(const Rows<int8_t>& R) {
    switch (R.d / 32) {
      case 2: return scores_i16<2>(R);
      case 4: return scores_i16<4>(R);
      case 1: return scores_i16<1>(R);
      case 3: return scores_i16<3>(R);
      default: return Avx512::scores(R);  // past head_dim 128: the float path (accumulate below still runs)
    }
  }
  static void accumulate(const Rows<int8_t>& R) {
    int64_t r = 0;
    for (; r + 3 <= R.n; r += 3) {
      const int64_t jm = block_jmax(R, r, 3);
      if (jm) pv_rows_i16<3>(R, r, jm);
    }
    for (; r < R.n; ++r)
      if (R.nv[r]) pv_rows_i16<1>(R, r, R.nv[r]);
  }
  static void finish(float* o, int64_t rows, int64_t d) { Avx512Bf16::finish(o, rows, d); }
};

bool cpu_has_avx512_vnni() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  }();
  return ok;
}

#pragma GCC pop_options
#endif  // KVLLM_X86

// ---- one work item -------------------------------------------------------------------------------------
// s[r][j] *= c[j] for j < nv[r] (8-bit caches: key scales on scores, value scales on probabilities)
inline void scale_columns(float* s, int64_t rows, const int32_t* nv, const float* c) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * kChunk;
    for (int64_t j = 0; j < nv[r]; ++j) sr[j] *= c[j];
  }
}

// Item rows are ordered (KV head, query token, head in group). An item normally covers all KV heads: the K (and
// V) rows of all heads of a slot are contiguous in a block ([block_size, Hkv, D]), so the slots are
// read into cache kStreamChunks chunks at a time (stream_range), then computed head by head from there.
template <typename K, typename T, typename E = typename K::template Elem<T>>
void run_item(const Problem& P, const Item& it, Scratch<E>& sc) {
  const int64_t d = P.d, g = P.g;
  const int64_t q0 = P.qo[it.seq], q_len = P.qo[it.seq + 1] - q0, kv_len = P.kv_lens[it.seq];
  const int64_t rows_h = (it.i1 - it.i0) * g, rows = rows_h * (it.h1 - it.h0);
  const int32_t* pages = P.kv_indices + P.kv_indptr[it.seq];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hh = it.h0 + r / rows_h, rr = r % rows_h;
    const int64_t t = q0 + it.i0 + rr / g, head = hh * g + rr % g;
    load_row(P.q, P.q_dtype, t * P.q_stride + head * d, d, P.qscale, sc.qs.data() + r * d);
    sc.m[r] = -std::numeric_limits<float>::infinity();
    sc.l[r] = 0.f;
  }
  if constexpr (std::is_same_v<T, int8_t>) {
    if (P.scaled && rotates_keys(d))  // the K rows hold H k (paging/kv_format.py): q.k = (H q).(H k)
      for (int64_t r = 0; r < rows; ++r) fwht(sc.qs.data() + r * d, d);
  }
  std::fill(sc.o.begin(), sc.o.begin() + rows * d, 0.f);
  const int64_t first = kv_len - q_len + it.i0;  // the first token's last attended slot
  const int64_t end = kv_len - q_len + it.i1;    // one past the last token's last attended slot
  for (int64_t c0 = 0; c0 < end; c0 += kChunk) {
    const int64_t c1 = std::min<int64_t>(c0 + kChunk, end), n = c1 - c0;
    slot_offsets(P, pages, c0, c1, sc.off.data());
    // all heads in the item: read the next kStreamChunks chunks' rows into cache (split heads: straight from memory)
    if (it.h1 - it.h0 == P.hkv && P.hkv > 1 && c0 % (kStreamChunks * kChunk) == 0)
      stream_range<T>(P, pages, c0, std::min<int64_t>(end, c0 + kStreamChunks * kChunk));
    for (int64_t rr = 0; rr < rows_h; ++rr)
      sc.nv[rr] = static_cast<int32_t>(std::clamp<int64_t>(first + rr / g - c0 + 1, 0, n));
    for (int64_t hh = it.h0; hh < it.h1; ++hh) {
      const int64_t rb = (hh - it.h0) * rows_h;
      chunk_rows<K, T, E>(P, sc.off.data(), n, hh, sc);
      Rows<E> R{sc.qs.data() + rb * d, sc.o.data() + rb * d, sc.s.data() + rb * kChunk, sc.nv.data(), rows_h, d,
             sc.kp.data(), sc.vp.data()};
      K::scores(R);
      if constexpr (kEightBit<T>) scale_columns(R.s, rows_h, sc.nv.data(), sc.ks.data());
      for (int64_t rr = 0; rr < rows_h; ++rr) {
        const int64_t nv = sc.nv[rr], r = rb + rr;
        float* sr = R.s + rr * kChunk;
        if (nv == 0) {  // past this token's causal limit: no weight (other rows of its block may use the chunk)
          std::fill(sr, sr + n, 0.f);
          continue;
        }
        const float mx = K::row_max(sr, nv, sc.m[r]);
        const float corr = std::exp2(sc.m[r] - mx);  // 0 on the first chunk (m = -inf)
        const float sum = K::exp2_shift(sr, nv, mx);
        std::fill(sr + nv, sr + n, 0.f);
        if (corr != 1.f) K::scale_row(R.o + rr * d, d, corr);
        sc.l[r] = sc.l[r] * corr + sum;
        sc.m[r] = mx;
      }
      if constexpr (kEightBit<T>) scale_columns(R.s, rows_h, sc.nv.data(), sc.vs.data());
      K::accumulate(R);
    }
  }
  K::finish(sc.o.data(), rows, d);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hh = it.h0 + r / rows_h, rr = r % rows_h;
    const int64_t t = q0 + it.i0 + rr / g, head = hh * g + rr % g;
    store_row(P.out, P.q_dtype, (t * P.hq + head) * d, d, 1.f / sc.l[r], sc.o.data() + r * d);
  }
}

template <typename K, typename T>
void run_items(const Problem& P, const std::vector<Item>& items, const std::vector<int64_t>& bounds) {
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    Scratch<typename K::template Elem<T>> sc(kTileTokens * P.g * P.hkv, P.d);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = bounds[p]; i < bounds[p + 1]; ++i) run_item<K, T>(P, items[i], sc);
  });
}

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default: TORCH_CHECK_VALUE(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return DType::F32;
}

DType kv_dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kChar: return DType::I8;
    case at::kFloat8_e5m2: return DType::E5M2;
    case at::kFloat8_e4m3fn: return DType::E4M3;
    default: return dtype_of(t, "kv_cache");
  }
}

void check_index(const at::Tensor& t, const char* name, int64_t min_len) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(), name,
                    " must be a contiguous 1-D int32 CPU tensor");
  TORCH_CHECK_VALUE(t.numel() >= min_len, name, " has ", t.numel(), " entries, expected at least ", min_len);
}

// out[T, Hq, D] = attention of q over the pages. `force_portable` selects the portable kernels (tests).
void paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& qo_indptr,
                     const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                     double scale, at::Tensor& out, bool force_portable, int64_t max_isa) {
  const int64_t isa = force_portable ? 0 : pick_attention_isa(max_isa);
  // q may be a view into the fused qkv projection: only its heads and head_dim need to be contiguous
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
                        q.stride(0) >= q.size(1) * q.size(2),
                    "q must be a [T, Hq, D] CPU tensor whose heads and head_dim are contiguous");
  TORCH_CHECK_VALUE(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(1) == 2 &&
                        kv_cache.is_contiguous(),
                    "kv_cache must be a contiguous [num_blocks, 2, block_size, Hkv, D] CPU tensor");
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous() &&
                        out.device().is_cpu(),
                    "out must be a contiguous CPU tensor with q's shape and dtype");
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t num_blocks = kv_cache.size(0), bs = kv_cache.size(2), hkv = kv_cache.size(3), w = kv_cache.size(4);
  const bool scaled = kv_cache.element_size() == 1 && w == d + 4;  // 8-bit rows with their scale
  TORCH_CHECK_VALUE(w == d || scaled, "kv_cache rows of ", w, " elements hold neither q's head_dim ", d,
                    " nor (8-bit) head_dim values and a 4-byte scale");
  TORCH_CHECK_VALUE(hkv > 0 && hq % hkv == 0, "num_q_heads (", hq, ") must be a multiple of num_kv_heads (", hkv, ")");
  const int64_t B = kv_last_page_len.numel();
  check_index(qo_indptr, "qo_indptr", B + 1);
  check_index(kv_indptr, "kv_indptr", B + 1);
  check_index(kv_last_page_len, "kv_last_page_len", B);
  check_index(kv_indices, "kv_indices", 0);
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kvp = kv_indptr.data_ptr<int32_t>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qo[0] == 0 && qo[B] == T, "qo_indptr must run from 0 to the number of query rows (", T, "), got ",
                    qo[0], "..", qo[B]);
  TORCH_CHECK_VALUE(kvp[0] == 0 && kvp[B] <= kv_indices.numel(),
                    "kv_indptr must run from 0 to at most len(kv_indices)");
  for (int64_t b = 0; b < B; ++b)  // before any index is read through them
    TORCH_CHECK_VALUE(qo[b + 1] >= qo[b] && kvp[b + 1] >= kvp[b],
                      "qo_indptr and kv_indptr must be non-decreasing");
  std::vector<int32_t> kv_lens(B);
  const int64_t g = hq / hkv;
  // All KV heads in one item (contiguous reads, streamed into cache: see run_item) unless that leaves a thread
  // without an item; then one item per KV head. Even 3 long sequences on 2 threads (2 items on one thread) ran
  // faster whole than split into heads, which read each head's rows straight from memory (docs/benchmarks.md).
  int64_t tiles = 0;
  for (int64_t b = 0; b < B; ++b) tiles += (qo[b + 1] - qo[b] + kTileTokens - 1) / kTileTokens;
  const int64_t heads_per_item = tiles >= at::get_num_threads() ? hkv : 1;
  std::vector<Item> items;
  std::vector<int64_t> cost;  // per item: attended slots summed over its query tokens, plus a fixed overhead
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qo[b + 1] - qo[b], pages = kvp[b + 1] - kvp[b];
    TORCH_CHECK_VALUE(pages == 0 ? q_len == 0 : (last[b] >= 1 && last[b] <= bs),
                      "kv_last_page_len[", b, "] = ", last[b], " must be in [1, block_size=", bs, "]");
    const int64_t kv_len = pages ? (pages - 1) * bs + last[b] : 0;
    TORCH_CHECK_VALUE(kv_len >= q_len, "sequence ", b, ": kv_len ", kv_len, " < q_len ", q_len);
    for (int64_t p = kvp[b]; p < kvp[b + 1]; ++p)
      TORCH_CHECK_VALUE(idx[p] >= 0 && idx[p] < num_blocks, "kv_indices[", p, "] = ", idx[p],
                        " is not a block of kv_cache (", num_blocks, " blocks)");
    kv_lens[b] = static_cast<int32_t>(kv_len);
    for (int64_t i0 = 0; i0 < q_len; i0 += kTileTokens) {
      const int64_t i1 = std::min<int64_t>(i0 + kTileTokens, q_len);
      const int64_t slots = (i1 - i0) * (kv_len - q_len) + (i0 + i1 + 1) * (i1 - i0) / 2;
      for (int64_t h = 0; h < hkv; h += heads_per_item) {
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(std::min(hkv, h + heads_per_item)), static_cast<int32_t>(i0),
                         static_cast<int32_t>(i1)});
        cost.push_back((slots * g + 64) * (std::min(hkv, h + heads_per_item) - h));
      }
    }
  }
  if (items.empty()) return;
  // contiguous runs of items of about equal cost, one per thread (at::parallel_for splits evenly by count)
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<int64_t> bounds{0};
  int64_t total = 0;
  for (int64_t c : cost) total += c;
  int64_t acc = 0;
  for (size_t i = 0; i < items.size() && static_cast<int64_t>(bounds.size()) < parts; ++i) {
    acc += cost[i];
    if (acc * parts >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(i + 1);
  }
  if (bounds.back() != static_cast<int64_t>(items.size())) bounds.push_back(items.size());

  Problem P;
  P.q = q.data_ptr();
  P.out = out.data_ptr();
  P.cache = kv_cache.data_ptr();
  P.q_dtype = dtype_of(q, "q");
  P.kv_dtype = kv_dtype_of(kv_cache);
  P.scaled = scaled;
  P.qo = qo;
  P.kv_indptr = kvp;
  P.kv_indices = idx;
  P.kv_lens = kv_lens.data();
  P.hq = hq; P.hkv = hkv; P.g = g; P.d = d; P.w = w; P.bs = bs; P.q_stride = q.stride(0);
  P.slot_stride = hkv * w;
  P.v_offset = bs * hkv * w;
  P.block_stride = 2 * bs * hkv * w;
  P.qscale = static_cast<float>(scale) * kLog2e;

  auto go = [&](auto kernels) {
    using K = decltype(kernels);
    switch (P.kv_dtype) {
      case DType::F32: run_items<K, float>(P, items, bounds); break;
      case DType::BF16: run_items<K, c10::BFloat16>(P, items, bounds); break;
      case DType::F16: run_items<K, c10::Half>(P, items, bounds); break;
      case DType::I8: run_items<K, int8_t>(P, items, bounds); break;
      case DType::E5M2: run_items<K, c10::Float8_e5m2>(P, items, bounds); break;
      case DType::E4M3: run_items<K, c10::Float8_e4m3fn>(P, items, bounds); break;
    }
  };
#ifdef KVLLM_X86
  if (isa >= 3 && P.kv_dtype == DType::BF16 && d % 32 == 0 && d <= 1024)
    return run_items<Avx512Bf16, c10::BFloat16>(P, items, bounds);
  if (isa >= 3 && P.kv_dtype == DType::I8 && d % 32 == 0 && d <= 1024 && cpu_has_avx512_vnni())
    return run_items<Avx512I8, int8_t>(P, items, bounds);
  if (isa >= 2 && d % 16 == 0) return go(Avx512{});
  if (isa >= 1 && d % 8 == 0) return go(Avx2{});
#endif
  go(Portable{});
}


// ---- weight-only int8 linear ---------------------------------------------------------------------------
// W is packed by engine/models/quant.py into panels of 16 output channels, [N/16, K, 16] int8 (N padded to a
// multiple of 16), so the 16 weights of one input column are one 16-byte load, with one float scale per channel
// and group of G input columns, [N/16, K/G, 16]. A micro-kernel keeps MR rows x 16 outputs in registers and, per
// input column k, converts the 16 int8 weights to float and scales them once, then uses them for the MR rows
// (broadcast x[r][k], FMA). At batch 1 this reads about a quarter of fp32's weight bytes (decode is bound by
// them); at large batch it is an fp32 GEMM on the fly-converted panel. Panels are split over torch's threads.
constexpr int kPanel = 16;

struct Int8Problem {
  const float* x;        // [M, K]
  const int8_t* w;       // [P, K, 16]
  const float* scale;    // [P, K / G, 16]
  const float* bias;     // [N] or null
  float* out;            // [M, N]
  int64_t m, k, n, group;
};

inline void int8_store(const Int8Problem& I, int64_t row, int64_t n0, const float* acc16) {
  const int64_t nn = std::min<int64_t>(kPanel, I.n - n0);
  float* o = I.out + row * I.n + n0;
  for (int64_t j = 0; j < nn; ++j) o[j] = acc16[j] + (I.bias ? I.bias[n0 + j] : 0.f);
}

void int8_panel_portable(const Int8Problem& I, int64_t p) {
  const int8_t* w = I.w + p * I.k * kPanel;
  float acc[kPanel];
  for (int64_t r = 0; r < I.m; ++r) {
    const float* x = I.x + r * I.k;
    std::fill(acc, acc + kPanel, 0.f);
    for (int64_t k = 0; k < I.k; ++k) {
      const float* sc = I.scale + (p * (I.k / I.group) + k / I.group) * kPanel;
      for (int j = 0; j < kPanel; ++j) acc[j] += x[k] * (static_cast<float>(w[k * kPanel + j]) * sc[j]);
    }
    int8_store(I, r, p * kPanel, acc);
  }
}

// The current group's d and m of a panel of GGUF blocks (block_linear: w = d * q + m per G input columns), for the
// weight sources that dequantize in registers (BlockWeights, Blocks512).
struct BlockScales {
  const float* d;    // [K / G, 16]
  const float* m;
  int64_t group;
  const float* dg = nullptr;
  const float* mg = nullptr;
  inline void begin_group(int64_t g0) {
    dg = d + (g0 / group) * kPanel;
    mg = m + (g0 / group) * kPanel;
  }
};

#ifdef KVLLM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Weight source of the micro-kernel: int8 converted and scaled per column on the fly (few rows: the weights are
// read once, so converting in registers is cheapest), or a float panel converted once into scratch (many rows:
// the conversion is then paid once per panel instead of once per 6 rows).
struct Int8Weights {
  const int8_t* w;   // [K, 16]
  const float* sc;   // [K / G, 16]
  int64_t group;
  __m256 s0, s1;     // the current group's scales
  inline void begin_group(int64_t g0) {
    s0 = _mm256_loadu_ps(sc + (g0 / group) * kPanel);
    s1 = _mm256_loadu_ps(sc + (g0 / group) * kPanel + 8);
  }
  inline void get(int64_t k, __m256& w0, __m256& w1) const {
    const __m128i wq = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel));
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(wq)), s0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(wq, 8))), s1);
  }
};

struct FloatWeights {
  const float* w;  // [K, 16]
  int64_t group;   // = K: one "group"
  inline void begin_group(int64_t) {}
  inline void get(int64_t k, __m256& w0, __m256& w1) const {
    w0 = _mm256_load_ps(w + k * kPanel);
    w1 = _mm256_load_ps(w + k * kPanel + 8);
  }
};

template <int MR, typename W>
inline void int8_micro(const Int8Problem& I, W wsrc, int64_t p, int64_t r0) {
  const float* x = I.x + r0 * I.k;
  const int64_t kk = I.k, group = wsrc.group;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < kk; g0 += group) {
    wsrc.begin_group(g0);
    for (int64_t k = g0; k < g0 + group; ++k) {
      __m256 w0, w1;
      wsrc.get(k, w0, w1);
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * kk + k);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
  }
  // Spill the tile with constant indices only: a loop over r calling int8_store would make acc addressable and
  // GCC then stores every accumulator to the stack on each k (measured 2x slower).
  alignas(32) float buf[MR * kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(buf + r * kPanel, acc[r][0]);
    _mm256_store_ps(buf + r * kPanel + 8, acc[r][1]);
  }
  for (int r = 0; r < MR; ++r) int8_store(I, r0 + r, p * kPanel, buf + r * kPanel);
}

template <typename W>
void int8_rows(const Int8Problem& I, const W& wsrc, int64_t p) {
  int64_t r = 0;
  for (; r + 6 <= I.m; r += 6) int8_micro<6>(I, wsrc, p, r);
  switch (I.m - r) {
    case 5: int8_micro<5>(I, wsrc, p, r); break;
    case 4: int8_micro<4>(I, wsrc, p, r); break;
    case 3: int8_micro<3>(I, wsrc, p, r); break;
    case 2: int8_micro<2>(I, wsrc, p, r); break;
    case 1: int8_micro<1>(I, wsrc, p, r); break;
    default: break;
  }
}

// `panel` is thread scratch of K x 16 floats (32-byte aligned), used when there are more than 6 rows.
void int8_panel_avx2(const Int8Problem& I, int64_t p, float* panel) {
  Int8Weights q{I.w + p * I.k * kPanel, I.scale + p * (I.k / I.group) * kPanel, I.group, {}, {}};
  if (I.m <= 6) return int8_rows(I, q, p);
  for (int64_t g0 = 0; g0 < I.k; g0 += I.group) {
    q.begin_group(g0);
    for (int64_t k = g0; k < g0 + I.group; ++k) {
      __m256 w0, w1;
      q.get(k, w0, w1);
      _mm256_store_ps(panel + k * kPanel, w0);
      _mm256_store_ps(panel + k * kPanel + 8, w1);
    }
  }
  int8_rows(I, FloatWeights{panel, I.k}, p);
}

// How far ahead of its loads a packed float32 panel stream is prefetched. At decode batch sizes a step reads every
// weight once from DRAM and the tiles are bound by the cache lines in flight; the hardware prefetcher alone keeps
// too few (docs/results/cpu_kernels.md, "Packed GEMM kernel"). 2 KiB = 32 input columns of one panel.
constexpr int kPrefetchBytes = 2048;

// A packed float32 panel read from memory (not scratch, which int8_panel_avx2 fills): its next lines prefetched.
struct StreamedFloatWeights : FloatWeights {
  inline void get(int64_t k, __m256& w0, __m256& w1) const {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * kPanel) + kPrefetchBytes, _MM_HINT_T0);
    FloatWeights::get(k, w0, w1);
  }
};

void packed_panel_avx2(const Int8Problem& I, const float* w, int64_t p) {
  int8_rows(I, StreamedFloatWeights{{w + p * I.k * kPanel, I.k}}, p);
}

// GGUF blocks (block_linear) dequantized in registers for the AVX2 tile, for the few rows where converting a panel
// into scratch costs as much as the FMAs (d and m are read per column from L1: the tile has no registers left).
struct BlockWeights : BlockScales {
  const int8_t* w;   // [K, 16]
  inline void get(int64_t k, __m256& w0, __m256& w1) const {
    const __m128i wq = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(wq)), _mm256_loadu_ps(dg), _mm256_loadu_ps(mg));
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(wq, 8))), _mm256_loadu_ps(dg + 8),
                         _mm256_loadu_ps(mg + 8));
  }
};

// A weight source that also keeps the floats it converts in `keep` ([K, 16], 32-byte aligned scratch).
template <typename W>
struct Kept : W {
  float* keep;
  inline void get(int64_t k, __m256& w0, __m256& w1) const {
    W::get(k, w0, w1);
    _mm256_store_ps(keep + k * kPanel, w0);
    _mm256_store_ps(keep + k * kPanel + 8, w1);
  }
};

// More than 6 rows of one panel whose weights need converting (the half panels): the first tile converts them in
// registers as it multiplies and keeps the floats, and the tiles after it read those from cache. A separate
// conversion pass before the tiles measured slower (docs/results/cpu_kernels.md, "Half-precision panels").
template <typename W>
void kept_rows(const Int8Problem& B, const W& wsrc, float* keep, int64_t p) {
  int8_micro<6>(B, Kept<W>{wsrc, keep}, p, 0);
  Int8Problem rest = B;
  rest.x += 6 * B.k;
  rest.out += 6 * B.n;
  rest.m -= 6;
  int8_rows(rest, FloatWeights{keep, B.k}, p);
}

// One panel of GGUF blocks to floats, as dequant_panels_avx512 (which says why the values are exact). Converting
// in the first tile instead (kept_rows, as the half panels do) measured no faster for the blocks, whose conversion
// costs more registers and loads (docs/results/cpu_kernels.md, "Half-precision panels").
void dequant_panel_avx2(const int8_t* q, const float* d, const float* m, int64_t k, int64_t group, float* out) {
  for (int64_t g = 0; g < k / group; ++g) {
    const __m256 d0 = _mm256_loadu_ps(d + g * kPanel), d1 = _mm256_loadu_ps(d + g * kPanel + 8);
    const __m256 m0 = _mm256_loadu_ps(m + g * kPanel), m1 = _mm256_loadu_ps(m + g * kPanel + 8);
    for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
      const __m128i qv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * kPanel));
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qv));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qv, 8)));
      _mm256_store_ps(out + kk * kPanel, _mm256_fmadd_ps(q0, d0, m0));
      _mm256_store_ps(out + kk * kPanel + 8, _mm256_fmadd_ps(q1, d1, m1));
    }
  }
}

// Half-precision panels (packed_linear with bfloat16 or float16 w_packed): 8 stored values to float32, exactly.
// bfloat16 is float32's upper half, so a zero-extend and a shift; float16 through F16C.
template <bool BF16>
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

// Half panels widened in registers for the AVX2 tile's few rows (a weight used by at most 6 FMAs): half the bytes
// of a float32 panel cross the bus, prefetched as far ahead in bytes.
template <bool BF16>
struct HalfWeights {
  const uint16_t* w;  // [K, 16]
  int64_t group;      // = K: one group
  inline void begin_group(int64_t) {}
  inline void get(int64_t k, __m256& w0, __m256& w1) const {
    const uint16_t* row = w + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    w0 = widen8<BF16>(row);
    w1 = widen8<BF16>(row + 8);
  }
};

// `n` (a multiple of 8) half values to float32 in `out` (scratch for more rows: widened once, read by every tile)
template <bool BF16>
void widen_avx2(const uint16_t* w, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, widen8<BF16>(w + i));
}

#pragma GCC pop_options

// AVX-512 packed micro-kernel: a panel row (16 channels) is one zmm, so a tile of MR rows x NP panels keeps
// MR * NP accumulators; 8 x 3 uses 24 of the 32 registers and issues 24 FMAs per 3 weight loads and 8 broadcasts.
// Three panel streams, each prefetched kPrefetchBytes ahead, keep more lines in flight than the 12 x 2 tile this
// replaced (docs/results/cpu_kernels.md, "Packed GEMM kernel"), and the tile is no slower when the GEMM is
// compute-bound.
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

// Weight sources of the AVX-512 tile, each giving panel n's 16 weights of input column k. Panels512: packed_linear's
// float panels [K, 16] read in place, each line prefetched kPrefetchBytes ahead.
struct Panels512 {
  const float* wp;   // panel 0; panel n at wp + n * K * 16
  int64_t kk;
  int64_t group;     // = K: one group
  inline void begin_group(int64_t) {}
  inline __m512 get(int64_t k, int n) const {
    const float* row = wp + (n * kk + k) * kPanel;  // one 64-byte line per panel and k
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    return _mm512_loadu_ps(row);
  }
};

// GGUF blocks (block_linear) dequantized in registers: d * q + m, exact as dequant_panels_avx512 says. For few rows,
// where every weight is used by at most a handful of FMAs and converting it once into scratch costs as much.
struct Blocks512 : BlockScales {  // d, m: panel n's at + n * (K / G) * 16
  const int8_t* q;   // panel 0 [K, 16]; panel n at q + n * K * 16
  int64_t kk;
  inline __m512 get(int64_t k, int n) const {
    const int8_t* row = q + (n * kk + k) * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    const int64_t off = n * (kk / group) * kPanel;
    return _mm512_fmadd_ps(qf, _mm512_loadu_ps(dg + off), _mm512_loadu_ps(mg + off));
  }
};

// MR rows x NP panels of outputs (columns [16 p, 16 (p + NP))); every accumulator sums over k in order, whatever
// the weight source, so both sources give bit-identical results for the same weight values. XT: I.x holds the MR
// rows transposed, [K, MR] (r0 = 0), so one pointer and constant offsets address every row's x[k].
template <int MR, int NP, typename W, bool XT = false>
inline void packed_micro512(const Int8Problem& I, W wsrc, int64_t p, int64_t r0) {
  const float* x = XT ? I.x : I.x + r0 * I.k;
  const int64_t kk = I.k, group = wsrc.group;
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NP; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < kk; g0 += group) {
    wsrc.begin_group(g0);
    for (int64_t k = g0; k < g0 + group; ++k) {
      __m512 wv[NP];
      for (int n = 0; n < NP; ++n) wv[n] = wsrc.get(k, n);
      for (int r = 0; r < MR; ++r) {
        const __m512 xb = _mm512_set1_ps(XT ? x[k * MR + r] : x[r * kk + k]);
        for (int n = 0; n < NP; ++n) acc[r][n] = _mm512_fmadd_ps(xb, wv[n], acc[r][n]);
      }
    }
  }
  alignas(64) float buf[MR * NP * kPanel];  // constant-index spill, as in int8_micro
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NP; ++n) _mm512_store_ps(buf + (r * NP + n) * kPanel, acc[r][n]);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NP; ++n) int8_store(I, r0 + r, (p + n) * kPanel, buf + (r * NP + n) * kPanel);
}

template <int NP, typename W>
void packed_rows512(const Int8Problem& I, const W& wsrc, int64_t p) {
  int64_t r = 0;
  for (; r + 8 <= I.m; r += 8) packed_micro512<8, NP>(I, wsrc, p, r);
  switch (I.m - r) {
    case 7: packed_micro512<7, NP>(I, wsrc, p, r); break;
    case 6: packed_micro512<6, NP>(I, wsrc, p, r); break;
    case 5: packed_micro512<5, NP>(I, wsrc, p, r); break;
    case 4: packed_micro512<4, NP>(I, wsrc, p, r); break;
    case 3: packed_micro512<3, NP>(I, wsrc, p, r); break;
    case 2: packed_micro512<2, NP>(I, wsrc, p, r); break;
    case 1: packed_micro512<1, NP>(I, wsrc, p, r); break;
    default: break;
  }
}

constexpr int64_t kGroup512 = 3;  // panels per AVX-512 tile

// panels [3 * q, 3 * q + 3) of w, fewer when they are the last of the layer
void packed_group_avx512(const Int8Problem& I, const float* w, int64_t q, int64_t panels) {
  const int64_t p = kGroup512 * q;
  const Panels512 wsrc{w + p * I.k * kPanel, I.k, I.k};
  switch (std::min<int64_t>(kGroup512, panels - p)) {
    case 3: return packed_rows512<3>(I, wsrc, p);
    case 2: return packed_rows512<2>(I, wsrc, p);
    default: return packed_rows512<1>(I, wsrc, p);
  }
}

// GGUF blocks (block_linear below): `count` panels of q [K, 16] int8 with d, m [K / G, 16] float32 each, to float
// panels [K, 16] in `out`. d * q is exact in float32 (at most an 11-bit by 8-bit product), so with or without a
// fused multiply-add the value is d * q + m rounded once, as the loader's dequantization computes it.
void dequant_panels_avx512(const int8_t* q, const float* d, const float* m, int64_t k, int64_t group,
                           int64_t count, float* out) {
  const int64_t groups = k / group;
  for (int64_t n = 0; n < count; ++n) {
    const int8_t* qn = q + n * k * kPanel;
    float* on = out + n * k * kPanel;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 dv = _mm512_loadu_ps(d + (n * groups + g) * kPanel);
      const __m512 mv = _mm512_loadu_ps(m + (n * groups + g) * kPanel);
      for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
        const __m128i qv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + kk * kPanel));
        _mm512_store_ps(on + kk * kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qv)), dv, mv));
      }
    }
  }
}

#pragma GCC pop_options
#endif  // KVLLM_X86

// Shape checks shared by the packed linears: x [M, K] float32, w_packed [N/16, K, 16] of `wtype`, out [M, N]
// float32, bias [N] float32 or none. Returns {M, K, N, panels}.
std::array<int64_t, 4> check_linear(const at::Tensor& x, const at::Tensor& w_packed, at::ScalarType wtype,
                                    const char* wname, const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                        x.size(1) > 0, "x must be a contiguous float32 [M, K] CPU tensor with K > 0");
  TORCH_CHECK_VALUE(w_packed.device().is_cpu() && w_packed.scalar_type() == wtype && w_packed.dim() == 3 &&
                        w_packed.size(2) == kPanel && w_packed.is_contiguous(),
                    "w_packed must be a contiguous ", wname, " [N/16, K, 16] CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), panels = w_packed.size(0);
  TORCH_CHECK_VALUE(w_packed.size(1) == k, "w_packed has K=", w_packed.size(1), ", x has K=", k);
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == m &&
                        out.is_contiguous(), "out must be a contiguous float32 [M, N] CPU tensor");
  const int64_t n = out.size(1);
  TORCH_CHECK_VALUE(n > (panels - 1) * kPanel && n <= panels * kPanel, "out has N=", n, " columns, w_packed holds ",
                    panels, " panels of ", kPanel);
  if (bias) {
    TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                          bias->numel() == n, "bias must be a contiguous float32 tensor of N=", n, " entries");
  }
  return {m, k, n, panels};
}

void int8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, bool force_portable) {
  const auto [m, k, n, panels] = check_linear(x, w_packed, at::kChar, "int8", bias, out);
  TORCH_CHECK_VALUE(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                        scale.dim() == 3 && scale.size(0) == panels && scale.size(2) == kPanel && scale.size(1) > 0 &&
                        k % scale.size(1) == 0,
                    "scale must be a contiguous float32 [N/16, groups, 16] tensor with groups dividing K=", k);
  Int8Problem I{x.data_ptr<float>(), w_packed.data_ptr<int8_t>(), scale.data_ptr<float>(),
                bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), m, k, n, k / scale.size(1)};
  if (m == 0) return;
  const bool avx = !force_portable && cpu_has_avx2();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scratch(avx && m > 6 ? k * kPanel + 8 : 0);
    float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
    for (int64_t p = p0; p < p1; ++p) {
#ifdef KVLLM_X86
      if (avx) {
        int8_panel_avx2(I, p, panel);
        continue;
      }
#endif
      int8_panel_portable(I, p);
    }
  });
}

// y = x @ W^T + bias with W packed by engine/models/packed.py into panels of 16 output channels, [N/16, K, 16]
// float32: the int8 path's 6 x 16 micro-kernel on float panels read in place (no conversion). On AVX2-only CPUs
// MKL's sgemm runs the decode shapes (M <= 64 rows, K <= 1536) below this tile's rate (docs/benchmarks.md).
// Panels of bfloat16 or float16 (a half-precision model's weights, engine/models/packed.py `widen_linears`) go
// through half_rows: the same tile on their values widened exactly, half the weight bytes.
constexpr int64_t kRowBlock = 96;

#ifdef KVLLM_X86
template <bool BF16>
void half_rows(const Int8Problem& B, const uint16_t* w, int64_t panels, int64_t isa);  // below block_rows
#endif

void packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const std::optional<at::Tensor>& bias,
                   at::Tensor& out, int64_t max_isa) {
  const at::ScalarType wt = w_packed.scalar_type();
  TORCH_CHECK_VALUE(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf,
                    "w_packed must be float32, bfloat16 or float16 panels, got ", wt);
  const auto [m, k, n, panels] = check_linear(x, w_packed, wt, c10::toString(wt), bias, out);
  const int64_t isa = pick_isa(max_isa);
  TORCH_CHECK_VALUE(isa >= 1, "packed_linear needs AVX2 + FMA (max_isa >= 1 on a CPU that has them)");
  Int8Problem I{x.data_ptr<float>(), nullptr, nullptr, bias ? bias->data_ptr<float>() : nullptr,
                out.data_ptr<float>(), m, k, n, k};
  if (m == 0) return;
#ifdef KVLLM_X86
  const uint16_t* w16 = wt == at::kFloat ? nullptr : reinterpret_cast<const uint16_t*>(w_packed.data_ptr());
  const float* w = wt == at::kFloat ? w_packed.data_ptr<float>() : nullptr;
  // Row blocks of kRowBlock: a block's x rows stay in L2 while every panel streams past them.
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    Int8Problem B = I;
    B.x = I.x + r0 * k;
    B.out = I.out + r0 * n;
    B.m = std::min<int64_t>(kRowBlock, m - r0);
    if (wt == at::kBFloat16) {
      half_rows<true>(B, w16, panels, isa);
    } else if (wt == at::kHalf) {
      half_rows<false>(B, w16, panels, isa);
    } else if (isa >= 2) {
      at::parallel_for(0, (panels + kGroup512 - 1) / kGroup512, 1, [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; ++q) packed_group_avx512(B, w, q, panels);
      });
    } else {
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) packed_panel_avx2(B, w, p);
      });
    }
  }
#endif
}

// y = x @ W^T + bias with W held as a GGUF file's 32-column blocks (engine/models/gguf_linear.py): q int8
// [N/16, K, 16] and d, m float32 [N/16, K/G, 16], w = d * q + m. For a few rows the tile dequantizes in registers;
// else a group of panels (3 with AVX-512, 1 with AVX2) is dequantized once per block of rows into thread scratch
// and multiplied there with packed_linear's tile: every output is the same products summed in the same order as
// packed_linear on the dequantized weights, so the result is bit-identical to it, while the weights cross the
// memory bus at ~1.25 bytes each instead of 4.
// Rows up to which the AVX-512 path dequantizes in registers (measured on SmolLM2's shapes: faster than scratch up to
// 24 rows, even at 32, slower from 48).
constexpr int64_t kBlocksInRegisters = 24;
static_assert(kBlocksInRegisters <= 32, "block_rows splits the in-register rows into at most 2 tall tiles");
// Rows per block of block_linear, 4x packed_linear's: each block converts every panel again (measured: the fewer
// conversions outweigh x spilling from L2; docs/benchmarks.md, "GGUF blocks in the GEMM").
constexpr int64_t kBlockRows = 384;

#ifdef KVLLM_X86
// 9-24 rows, blocks in registers: one tile of up to 16 rows per panel (two of 8-12 above 16), so each weight is
// dequantized once per tile rather than once per 8 rows (docs/results/cpu_kernels.md, "GGUF blocks in the GEMM").
// T.x is the tile's rows transposed ([K, MR]): with MR row pointers the tile runs out of general registers and GCC parks them in vector registers,
// moving them back on every k.
template <int MR>
void blocks_tall512(const Int8Problem& T, const int8_t* qg, const float* dg, const float* mg, int64_t groups,
                    int64_t group, int64_t p, int64_t count) {
  for (int64_t n = 0; n < count; ++n) {
    const Blocks512 wsrc{{dg + n * groups * kPanel, mg + n * groups * kPanel, group}, qg + n * T.k * kPanel, T.k};
    packed_micro512<MR, 1, Blocks512, true>(T, wsrc, p + n, 0);
  }
}

// block_linear over one block of rows (B.m <= kBlockRows): groups of `per` panels split over torch's threads.
void block_rows(const Int8Problem& B, const int8_t* q, const float* dp, const float* mp, int64_t groups,
                int64_t group, int64_t panels, int64_t per, int64_t isa) {
  const int64_t k = B.k;
  const bool tall = isa >= 2 && B.m > 8 && B.m <= kBlocksInRegisters;
  std::array<Int8Problem, 2> tiles;  // B's rows in tiles of at most 16, each with x transposed, for the tall tile
  const int64_t nt = tall ? (B.m + 15) / 16 : 0;  // 1 or 2 (kBlocksInRegisters <= 32)
  thread_local std::vector<float> xt;
  if (tall) {
    if (xt.size() < static_cast<size_t>(B.m * k)) xt.resize(B.m * k);
    int64_t r0 = 0;
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t mr = B.m / nt + (j < B.m % nt ? 1 : 0);
      Int8Problem T = B;
      float* xj = xt.data() + r0 * k;
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t c = 0; c < k; ++c) xj[c * mr + r] = B.x[(r0 + r) * k + c];
      T.x = xj;
      T.out = B.out + r0 * B.n;
      T.m = mr;
      tiles[j] = T;
      r0 += mr;
    }
  }
  at::parallel_for(0, (panels + per - 1) / per, 1, [&](int64_t g0, int64_t g1) {
    // a group's floats, grown once per thread: a fresh vector each call would be an mmap and its page faults
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(per * k * kPanel + 16)) scratch.resize(per * k * kPanel + 16);
    float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * per, count = std::min<int64_t>(per, panels - p);
      const int8_t* qg = q + p * k * kPanel;
      const float* dg = dp + p * groups * kPanel;
      const float* mg = mp + p * groups * kPanel;
      if (tall) {
        for (int64_t j = 0; j < nt; ++j) switch (const Int8Problem& T = tiles[j]; T.m) {  // 8-16 (8: of 17 rows)
          case 8: blocks_tall512<8>(T, qg, dg, mg, groups, group, p, count); break;
          case 9: blocks_tall512<9>(T, qg, dg, mg, groups, group, p, count); break;
          case 10: blocks_tall512<10>(T, qg, dg, mg, groups, group, p, count); break;
          case 11: blocks_tall512<11>(T, qg, dg, mg, groups, group, p, count); break;
          case 12: blocks_tall512<12>(T, qg, dg, mg, groups, group, p, count); break;
          case 13: blocks_tall512<13>(T, qg, dg, mg, groups, group, p, count); break;
          case 14: blocks_tall512<14>(T, qg, dg, mg, groups, group, p, count); break;
          case 15: blocks_tall512<15>(T, qg, dg, mg, groups, group, p, count); break;
          default: blocks_tall512<16>(T, qg, dg, mg, groups, group, p, count); break;
        }
      } else if (isa >= 2 && B.m <= 8) {
        const Blocks512 wsrc{{dg, mg, group}, qg, k};
        switch (count) {
          case 3: packed_rows512<3>(B, wsrc, p); break;
          case 2: packed_rows512<2>(B, wsrc, p); break;
          default: packed_rows512<1>(B, wsrc, p); break;
        }
      } else if (isa >= 2) {
        // the group once into scratch (L2), then packed_linear's tile reads it in place for every row
        dequant_panels_avx512(qg, dg, mg, k, group, count, panel);
        const Panels512 wsrc{panel, k, k};
        switch (count) {
          case 3: packed_rows512<3>(B, wsrc, p); break;
          case 2: packed_rows512<2>(B, wsrc, p); break;
          default: packed_rows512<1>(B, wsrc, p); break;
        }
      } else if (B.m <= 6) {  // one AVX2 tile: the blocks in registers
        int8_rows(B, BlockWeights{{dg, mg, group}, qg}, p);
      } else {
        dequant_panel_avx2(qg, dg, mg, k, group, panel);
        int8_rows(B, FloatWeights{panel, k}, p);
      }
    }
  });
}

// packed_linear over one block of rows with half-precision panels: at most 6 rows on the AVX2 tile widen in
// registers; otherwise each group of panels (3 with AVX-512, 1 with AVX2) is widened once into thread scratch and
// multiplied there by the float32 panels' tile. Either way every output is the float32 tile's products summed in
// its order, so results equal packed_linear on the widened float32 panels bit for bit.
template <bool BF16>
void half_rows(const Int8Problem& B, const uint16_t* w, int64_t panels, int64_t isa) {
  const int64_t k = B.k, per = isa >= 2 ? kGroup512 : 1;
  at::parallel_for(0, (panels + per - 1) / per, 1, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<float> scratch;  // grown once per thread, as block_rows'
    if (scratch.size() < static_cast<size_t>(per * k * kPanel + 16)) scratch.resize(per * k * kPanel + 16);
    float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * per, count = std::min<int64_t>(per, panels - p);
      const uint16_t* wg = w + p * k * kPanel;
      if (isa < 2 && B.m <= 6) {
        int8_rows(B, HalfWeights<BF16>{wg, k}, p);
        continue;
      }
      if (isa < 2) {
        kept_rows(B, HalfWeights<BF16>{wg, k}, panel, p);
        continue;
      }
      widen_avx2<BF16>(wg, count * k * kPanel, panel);
      const Panels512 wsrc{panel, k, k};
      switch (count) {
        case 3: packed_rows512<3>(B, wsrc, p); break;
        case 2: packed_rows512<2>(B, wsrc, p); break;
        default: packed_rows512<1>(B, wsrc, p); break;
      }
    }
  });
}

#endif

void block_linear(const at::Tensor& x, const at::Tensor& q_packed, const at::Tensor& d, const at::Tensor& m_,
                  const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t max_isa) {
  const auto [m, k, n, panels] = check_linear(x, q_packed, at::kChar, "int8", bias, out);
  for (const at::Tensor* t : {&d, &m_}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                          t->size(0) == panels && t->size(2) == kPanel && t->size(1) > 0 && k % t->size(1) == 0 &&
                          t->sizes() == d.sizes(),
                      "d and m must be contiguous float32 [N/16, groups, 16] tensors of one shape, groups dividing K=",
                      k);
  }
  const int64_t isa = pick_isa(max_isa);
  TORCH_CHECK_VALUE(isa >= 1, "block_linear needs AVX2 + FMA (max_isa >= 1 on a CPU that has them)");
  const int64_t group = k / d.size(1), groups = d.size(1);
  Int8Problem I{x.data_ptr<float>(), nullptr, nullptr, bias ? bias->data_ptr<float>() : nullptr,
                out.data_ptr<float>(), m, k, n, k};
  if (m == 0) return;
  const int8_t* q = q_packed.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m_.data_ptr<float>();
#ifdef KVLLM_X86
  const int64_t per = isa >= 2 ? kGroup512 : 1;  // panels dequantized together
  // Row blocks of kBlockRows (above), x rows of a block reused by every panel.
  for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
    Int8Problem B = I;
    B.x = I.x + r0 * k;
    B.out = I.out + r0 * n;
    B.m = std::min<int64_t>(kBlockRows, m - r0);
    block_rows(B, q, dp, mp, groups, group, panels, per, isa);
  }
#endif
}

bool has_avx2() { return cpu_has_avx2(); }
int64_t isa_level() { return best_isa(); }
int64_t attention_isa_level() { return best_attention_isa(); }
// whether max_isa 3 runs int8 pages (head_dim % 32 == 0) on integer dot products (Avx512I8)
bool int8_dot_attention() {
#ifdef KVLLM_X86
  return best_attention_isa() >= 3 && cpu_has_avx512_vnni();
#else
  return false;
#endif
}

}  // namespace

// csrc/ops.h: the entry points csrc/decoder_layers.cpp calls
namespace ops {
void paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& qo_indptr,
                     const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                     double scale, at::Tensor& out, bool force_portable, int64_t max_isa) {
  kvllm_cpu::paged_attention(q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale, out,
                             force_portable, max_isa);
}
void packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const std::optional<at::Tensor>& bias,
                   at::Tensor& out, int64_t max_isa) {
  kvllm_cpu::packed_linear(x, w_packed, bias, out, max_isa);
}
void block_linear(const at::Tensor& x, const at::Tensor& q_packed, const at::Tensor& d, const at::Tensor& m,
                  const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t max_isa) {
  kvllm_cpu::block_linear(x, q_packed, d, m, bias, out, max_isa);
}
}  // namespace ops

TORCH_LIBRARY(kvllm_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
        "Tensor kv_last_page_len, float scale, Tensor(a!) out, bool force_portable=False, int max_isa=3) -> ()",
        &paged_attention);
  m.def("int8_linear(Tensor x, Tensor w_packed, Tensor scale, Tensor? bias, Tensor(a!) out, "
        "bool force_portable=False) -> ()", &int8_linear);
  m.def("packed_linear(Tensor x, Tensor w_packed, Tensor? bias, Tensor(a!) out, int max_isa=2) -> ()",
        &packed_linear);
  m.def("block_linear(Tensor x, Tensor q_packed, Tensor d, Tensor m, Tensor? bias, Tensor(a!) out, int max_isa=2) "
        "-> ()", &block_linear);
  m.def("has_avx2() -> bool", &has_avx2);
  m.def("isa_level() -> int", &isa_level);
  m.def("attention_isa_level() -> int", &attention_isa_level);
  m.def("int8_dot_attention() -> bool", &int8_dot_attention);
}

}  // namespace kvllm_cpu
