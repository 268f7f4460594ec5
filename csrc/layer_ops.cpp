// The elementwise work of a decoder layer as few CPU calls (torch.ops.kvllm_cpu.*), float32 or bfloat16 activations
// (computed in float32; bfloat16 results rounded where torch's bfloat16 ops round):
//   rms_norm(x, weight, eps, out, residual?)  out = RMSNorm(x); with a residual: residual += x, out = RMSNorm(residual)
//   rope_(q, k, cos, sin)                     rotate-half RoPE, in place, on q [T, Hq, D] and k [T, Hkv, D]
//   silu_mul(x, out)                          out = silu(x[:, :I]) * x[:, I:]   (x = the fused gate/up projection)
//   write_kv(k, v, kv_cache, slot_mapping)    new K/V rows into their page slots, converted to the cache's dtype
//                                             (8-bit pages: quantized, each row's scale after its values)
//   argmax(x, out)                            out[r] = torch.argmax(x[r]) of float32 rows (the greedy draw)
// Why: written in torch these are ~25 ops a layer, and each op over more than 32K elements (a decode step of 64
// sequences already has 36K hidden values) is an OpenMP parallel region. Under passive waiting
// (engine/threads.py) every region wakes the sleeping workers, which at 2 threads costs more than the op's own
// work. Here each op runs on the calling thread unless its call has at least kParallelWork elements (a prefill
// chunk), so a decode step's only parallel regions are the GEMMs and the attention call.
// Inputs may be row-strided views (q/k/v and gate/up are slices of one projection output): rows are addressed
// through their stride, the last dimension must be contiguous.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops.h"
#include "simd.h"

namespace kvllm_cpu {
namespace {

// Elements a call needs before its rows are split over the threads (~100 us of work on one core).
constexpr int64_t kParallelWork = 1 << 18;

template <typename F>
void for_rows(int64_t rows, int64_t work_per_row, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_row));
  at::parallel_for(0, rows, grain, f);
}

void check_rows(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                        t.dim() == dim && t.stride(-1) == 1,
                    name, " must be a float32 or bfloat16 CPU tensor of ", dim,
                    " dimensions whose last dimension is contiguous");
}

void check_same_dtype(const at::Tensor& t, const at::Tensor& like, const char* name, const char* like_name) {
  TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type(), name, " must have ", like_name, "'s dtype (",
                    like.scalar_type(), "), got ", t.scalar_type());
}

// Rows are float32 or bfloat16 (T); the arithmetic is float32. A bfloat16 result is rounded wherever torch's own
// bfloat16 ops round (engine/models/layer_ops.py TorchLayerOps): the residual sum, x * inv before the weight,
// silu(gate) before the multiply, and every stored value.
template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

// ---- portable loops --------------------------------------------------------------------------------------
template <typename T>
float sum_squares_portable(const T* x, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return acc;
}

template <typename T>
void add_rows_portable(T* res, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) res[i] = static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(x[i]));
}

template <typename T>
void scale_rows_portable(T* out, const T* x, const T* w, float inv, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(x[i]) * inv));
}

template <typename T>
void rope_row_portable(T* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
    x[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
  }
}

// The index torch.argmax gives: the first largest value; a NaN counts as the largest (the first NaN wins).
int64_t argmax_row_portable(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

template <typename T>
void silu_mul_row_portable(T* out, const T* gate, const T* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
}

// ---- AVX2 loops (simd.h's load8 / store8 / round8 widen and round bfloat16 rows in registers) ---------------
#ifdef KVLLM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <typename T>
float sum_squares_avx2(const T* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = load8(x + i), v1 = load8(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  float sum = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return sum;
}

template <typename T>
void add_rows_avx2(T* res, const T* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(res + i, _mm256_add_ps(load8(res + i), load8(x + i)));
  for (; i < n; ++i) res[i] = static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(x[i]));
}

// w * (x * inv), rounded as the torch module computes it (two products, no FMA)
template <typename T>
void scale_rows_avx2(T* out, const T* x, const T* w, float inv, int64_t n) {
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(load8(w + i), round8<T>(_mm256_mul_ps(load8(x + i), iv))));
  for (; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(x[i]) * inv));
}

template <typename T>
void rope_row_avx2(T* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8(x + i), x2 = load8(x + i + half);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    store8(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    store8(x + i + half, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
    x[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
  }
}

// silu(g) * u = g / (1 + e^-g) * u, with e^-g = 2^(-g log2 e) (exp2_avx clamps the exponent to +-126: for
// g < -87 the result is ~0 either way)
template <typename T>
void silu_mul_row_avx2(T* out, const T* gate, const T* up, int64_t n) {
  const __m256 neg_log2e = _mm256_set1_ps(-1.4426950408889634f), one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 e = exp2_avx(_mm256_mul_ps(g, neg_log2e));
    store8(out + i, _mm256_mul_ps(round8<T>(_mm256_div_ps(g, _mm256_add_ps(one, e))), load8(up + i)));
  }
  silu_mul_row_portable(out + i, gate + i, up + i, n - i);
}

// argmax_row_portable's answer in two passes: the row's max (2 x 8 lanes), then the first index holding it; a row
// with a NaN goes to the portable loop (torch's NaN rule). Why: torch's argmax over a decode step's logits costs
// several times a max over them (docs/benchmarks.md, "Decode step against its floors").
int64_t argmax_row_avx2(const float* x, int64_t n) {
  if (n < 16) return argmax_row_portable(x, n);
  __m256 m0 = _mm256_loadu_ps(x), m1 = m0, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
  const __m256 m = _mm256_max_ps(m0, m1);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float mx = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h)));
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) return argmax_row_portable(x, n);
    mx = std::max(mx, x[j]);
  }
  if (_mm256_movemask_ps(nan)) return argmax_row_portable(x, n);
  const __m256 mv = _mm256_set1_ps(mx);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == mx) return i;
  return 0;  // not reached: mx is one of the row's values
}

#pragma GCC pop_options
#endif  // KVLLM_X86

template <typename T>
struct Loops {
  float (*sum_squares)(const T*, int64_t);
  void (*add_rows)(T*, const T*, int64_t);
  void (*scale_rows)(T*, const T*, const T*, float, int64_t);
  void (*rope_row)(T*, const float*, const float*, int64_t);
  void (*silu_mul_row)(T*, const T*, const T*, int64_t);
};

template <typename T>
Loops<T> loops(int64_t max_isa) {
#ifdef KVLLM_X86
  if (pick_isa(max_isa) >= 1)
    return {sum_squares_avx2<T>, add_rows_avx2<T>, scale_rows_avx2<T>, rope_row_avx2<T>, silu_mul_row_avx2<T>};
#else
  pick_isa(max_isa);  // still checks the argument
#endif
  return {sum_squares_portable<T>, add_rows_portable<T>, scale_rows_portable<T>, rope_row_portable<T>,
          silu_mul_row_portable<T>};
}

// f(T{}) with T the element type of t's rows (check_rows admits float32 and bfloat16)
template <typename F>
void with_row_type(const at::Tensor& t, const F& f) {
  if (t.scalar_type() == at::kBFloat16) return f(c10::BFloat16{});
  return f(float{});
}

// ---- ops -------------------------------------------------------------------------------------------------
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out,
              const std::optional<at::Tensor>& residual, int64_t max_isa) {
  check_rows(x, "x", 2);
  check_rows(out, "out", 2);
  check_same_dtype(out, x, "out", "x");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                        weight.dim() == 1 && weight.size(0) == h,
                    "weight must be a contiguous CPU tensor of x's dtype (", x.scalar_type(), ") with ", h,
                    " entries (x's last dimension)");
  TORCH_CHECK_VALUE(out.size(0) == n && out.size(1) == h, "out must have x's shape");
  if (residual) {
    check_rows(*residual, "residual", 2);
    check_same_dtype(*residual, x, "residual", "x");
    TORCH_CHECK_VALUE(residual->size(0) == n && residual->size(1) == h, "residual must have x's shape");
  }
  with_row_type(x, [&](auto tag) {
    using T = decltype(tag);
    const Loops<T> L = loops<T>(max_isa);
    const T* xp = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    T* rp = residual ? residual->data_ptr<T>() : nullptr;
    const int64_t xs = x.stride(0), os = out.stride(0), rs = residual ? residual->stride(0) : 0;
    const float feps = static_cast<float>(eps);
    for_rows(n, h, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* src = xp + r * xs;
        if (rp) {  // residual += x, then normalise the sum; x is read before out is written (out may alias x)
          L.add_rows(rp + r * rs, src, h);
          src = rp + r * rs;
        }
        const float inv = 1.f / std::sqrt(L.sum_squares(src, h) / static_cast<float>(h) + feps);
        L.scale_rows(op + r * os, src, w, inv, h);
      }
    });
  });
}

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, int64_t max_isa) {
  check_rows(q, "q", 3);
  check_rows(k, "k", 3);
  check_same_dtype(k, q, "k", "q");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->stride(1) == 1,
                      "cos and sin must be float32 CPU tensors [T, D/2] whose last dimension is contiguous");
  const int64_t t = q.size(0), d = q.size(2);
  TORCH_CHECK_VALUE(d % 2 == 0 && k.size(2) == d && k.size(0) == t, "q [T, Hq, D] and k [T, Hkv, D] must share T "
                    "and an even D, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.size(0) == t && cos.size(1) == d / 2,
                    "cos and sin must be [T, D/2] = [", t, ", ", d / 2, "], got ", cos.sizes(), " and ", sin.sizes());
  with_row_type(q, [&](auto tag) {
    using T = decltype(tag);
    const Loops<T> L = loops<T>(max_isa);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t half = d / 2, cs = cos.stride(0), ss = sin.stride(0);
    struct Heads {
      T* p;
      int64_t n, token_stride, head_stride;
    };
    const Heads qk[2] = {{q.data_ptr<T>(), q.size(1), q.stride(0), q.stride(1)},
                         {k.data_ptr<T>(), k.size(1), k.stride(0), k.stride(1)}};
    for_rows(t, (q.size(1) + k.size(1)) * d, [&](int64_t t0, int64_t t1) {
      for (int64_t i = t0; i < t1; ++i)
        for (const Heads& x : qk)
          for (int64_t h = 0; h < x.n; ++h) L.rope_row(x.p + i * x.token_stride + h * x.head_stride, cp + i * cs,
                                                       sp + i * ss, half);
    });
  });
}

void silu_mul(const at::Tensor& x, at::Tensor& out, int64_t max_isa) {
  check_rows(x, "x", 2);
  check_rows(out, "out", 2);
  check_same_dtype(out, x, "out", "x");
  const int64_t n = x.size(0), inter = x.size(1) / 2;
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0 && out.size(0) == n && out.size(1) == inter,
                    "x must be [N, 2I] (gate then up) and out [N, I], got ", x.sizes(), " and ", out.sizes());
  with_row_type(x, [&](auto tag) {
    using T = decltype(tag);
    const Loops<T> L = loops<T>(max_isa);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    for_rows(n, inter, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) L.silu_mul_row(op + r * os, xp + r * xs, xp + r * xs + inter, inter);
    });
  });
}

void argmax(const at::Tensor& x, at::Tensor& out, int64_t max_isa) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                        x.size(1) > 0,
                    "x must be a float32 CPU tensor [N, V], V > 0, whose last dimension is contiguous");
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 1 &&
                        out.size(0) == x.size(0) && out.is_contiguous(),
                    "out must be a contiguous int64 CPU tensor [N]");
  int64_t (*row)(const float*, int64_t) = argmax_row_portable;
#ifdef KVLLM_X86
  if (pick_isa(max_isa) >= 1) row = argmax_row_avx2;
#else
  pick_isa(max_isa);
#endif
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(0), v = x.size(1), xs = x.stride(0);
  for_rows(n, v, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row(xp + r * xs, v);
  });
}

// token t's [Hkv, D] rows of src (head_dim contiguous, any token and head strides) into dst, converted
template <typename Src, typename Dst>
void copy_heads(const at::Tensor& src, Dst* dst, int64_t t) {
  const Src* s = src.data_ptr<Src>() + t * src.stride(0);
  const int64_t heads = src.size(1), d = src.size(2), hs = src.stride(1);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) dst[h * d + i] = static_cast<Dst>(static_cast<float>(s[h * hs + i]));
}

// The 8-bit page formats (paging/kv_format.py): a row is D one-byte values, then the float32 scale max|x| / qmax.
// Same arithmetic as KVFormat.quantize (x / scale, clamp, round half to even or c10's fp8 rounding), so both write
// the same bytes.
template <typename Dst> constexpr float kQmax = 127.f;
template <> constexpr float kQmax<c10::Float8_e4m3fn> = 448.f;
template <> constexpr float kQmax<c10::Float8_e5m2> = 57344.f;

template <typename Dst>
inline Dst quantize_one(float y) {
  if constexpr (std::is_same_v<Dst, int8_t>) return static_cast<int8_t>(std::nearbyint(y));
  else return Dst(y);
}

#ifdef KVLLM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// One float32 row to scaled int8 (d % 8 == 0): the same divisions, clamp and round-half-to-even as the scalar loop
// below, eight lanes at a time. Why: the scalar loop's std::nearbyint is a libm call per value (the build has no
// -march), which made the int8 K/V write ~5x the bfloat16 one at decode.
void quantize_row_int8_avx2(const float* x, int64_t d, int8_t* row) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h)));
  float scale = amax / kQmax<int8_t>;
  std::memcpy(row + d, &scale, sizeof(float));
  if (!(scale > 0.f)) scale = 1.f;
  const __m256 sv = _mm256_set1_ps(scale), hi = _mm256_set1_ps(kQmax<int8_t>), lo = _mm256_set1_ps(-kQmax<int8_t>);
  alignas(32) int32_t q[8];
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv), lo), hi);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q),
                       _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    for (int j = 0; j < 8; ++j) row[i + j] = static_cast<int8_t>(q[j]);
  }
}
#pragma GCC pop_options
#endif  // KVLLM_X86

// One float row to a stored 8-bit row (values, then the scale where `scaled`).
template <typename Dst>
void quantize_row(const float* x, int64_t d, Dst* row, bool scaled) {
#ifdef KVLLM_X86
  if constexpr (std::is_same_v<Dst, int8_t>) {
    if (scaled && d % 8 == 0 && best_isa() >= 1) return quantize_row_int8_avx2(x, d, row);
  }
#endif
  constexpr float qmax = kQmax<Dst>;
  float scale = 1.f;
  if (scaled) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
    scale = amax / qmax;
    std::memcpy(row + d, &scale, sizeof(float));
    if (!(scale > 0.f)) scale = 1.f;
  }
  for (int64_t i = 0; i < d; ++i) row[i] = quantize_one<Dst>(std::clamp(x[i] / scale, -qmax, qmax));
}

// Token t's rows of src [T, heads, d] into dst; `keys`: K rows, rotated first where int8 pages store them so
// (simd.h rotates_keys).
template <typename Src, typename Dst>
void quantize_heads(const at::Tensor& src, Dst* dst, int64_t t, bool scaled, bool keys) {
  const Src* s = src.data_ptr<Src>() + t * src.stride(0);
  const int64_t heads = src.size(1), d = src.size(2), hs = src.stride(1), w = scaled ? d + 4 : d;
  const bool rotate = std::is_same_v<Dst, int8_t> && keys && scaled && rotates_keys(d);
  thread_local std::vector<float> buf;
  for (int64_t h = 0; h < heads; ++h) {
    const Src* x = s + h * hs;
    const float* xf = nullptr;
    if constexpr (std::is_same_v<Src, float>) xf = x;
    if (rotate || xf == nullptr) {
      buf.resize(d);
      for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(x[i]);
      if (rotate) fwht(buf.data(), d);
      xf = buf.data();
    }
    quantize_row<Dst>(xf, d, dst + h * w, scaled);
  }
}

template <typename Src, typename Dst>
void write_kv_typed(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache, const int64_t* slots) {
  const int64_t t = k.size(0), bs = cache.size(2), row = cache.size(3) * cache.size(4);
  const bool scaled = cache.size(4) != k.size(2);
  Dst* base = static_cast<Dst*>(cache.data_ptr());
  for_rows(t, 2 * row, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t block = slots[i] / bs, off = slots[i] - block * bs;
      Dst* kdst = base + ((block * 2) * bs + off) * row;  // [block, 0, off]
      if constexpr (sizeof(Dst) == 1) {
        quantize_heads<Src, Dst>(k, kdst, i, scaled, true);
        quantize_heads<Src, Dst>(v, kdst + bs * row, i, scaled, false);  // [block, 1, off]
      } else {
        copy_heads<Src, Dst>(k, kdst, i);
        copy_heads<Src, Dst>(v, kdst + bs * row, i);  // [block, 1, off]
      }
    }
  });
}

template <typename Src>
void write_kv_from(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache, const int64_t* slots) {
  switch (cache.scalar_type()) {
    case at::kFloat: return write_kv_typed<Src, float>(k, v, cache, slots);
    case at::kBFloat16: return write_kv_typed<Src, c10::BFloat16>(k, v, cache, slots);
    case at::kHalf: return write_kv_typed<Src, c10::Half>(k, v, cache, slots);
    case at::kChar: return write_kv_typed<Src, int8_t>(k, v, cache, slots);
    case at::kFloat8_e5m2: return write_kv_typed<Src, c10::Float8_e5m2>(k, v, cache, slots);
    case at::kFloat8_e4m3fn: return write_kv_typed<Src, c10::Float8_e4m3fn>(k, v, cache, slots);
    default: TORCH_CHECK_VALUE(false, "kv_cache must be float32, bfloat16, float16, int8, float8_e5m2 or "
                               "float8_e4m3fn, got ", cache.scalar_type());
  }
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(1) == 2 &&
                        kv_cache.is_contiguous(),
                    "kv_cache must be a contiguous [num_blocks, 2, block_size, Hkv, D] CPU tensor");
  for (const auto* t : {&k, &v})
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1 && t->size(1) == kv_cache.size(3) &&
                          (t->size(2) == kv_cache.size(4) ||
                           (kv_cache.element_size() == 1 && t->size(2) + 4 == kv_cache.size(4))) &&
                          t->scalar_type() == k.scalar_type(),
                      "k and v must be [T, Hkv, D] CPU tensors of one dtype, head_dim contiguous, matching kv_cache's "
                      "[.., Hkv, D] = ", kv_cache.sizes().slice(3));
  TORCH_CHECK_VALUE(v.size(0) == k.size(0), "k and v must have the same number of tokens");
  TORCH_CHECK_VALUE(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                        slot_mapping.dim() == 1 && slot_mapping.is_contiguous() && slot_mapping.numel() == k.size(0),
                    "slot_mapping must be a contiguous int64 CPU tensor with one slot per token (", k.size(0), ")");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(2);
  for (int64_t i = 0; i < k.size(0); ++i)
    TORCH_CHECK_VALUE(slots[i] >= 0 && slots[i] < num_slots, "slot_mapping[", i, "] = ", slots[i],
                      " is not a slot of kv_cache (", num_slots, " slots)");
  switch (k.scalar_type()) {
    case at::kFloat: return write_kv_from<float>(k, v, kv_cache, slots);
    case at::kBFloat16: return write_kv_from<c10::BFloat16>(k, v, kv_cache, slots);
    case at::kHalf: return write_kv_from<c10::Half>(k, v, kv_cache, slots);
    default: TORCH_CHECK_VALUE(false, "k and v must be float32, bfloat16 or float16, got ", k.scalar_type());
  }
}

}  // namespace

// csrc/ops.h: the entry points csrc/decoder_layers.cpp calls
namespace ops {
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out,
              const std::optional<at::Tensor>& residual, int64_t max_isa) {
  kvllm_cpu::rms_norm(x, weight, eps, out, residual, max_isa);
}
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, int64_t max_isa) {
  kvllm_cpu::rope_(q, k, cos, sin, max_isa);
}
void silu_mul(const at::Tensor& x, at::Tensor& out, int64_t max_isa) { kvllm_cpu::silu_mul(x, out, max_isa); }
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  kvllm_cpu::write_kv(k, v, kv_cache, slot_mapping);
}
}  // namespace ops

TORCH_LIBRARY_FRAGMENT(kvllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out, Tensor(b!)? residual=None, int max_isa=2) "
        "-> ()", &rms_norm);
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int max_isa=2) -> ()", &rope_);
  m.def("silu_mul(Tensor x, Tensor(a!) out, int max_isa=2) -> ()", &silu_mul);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()", &write_kv);
  m.def("argmax(Tensor x, Tensor(a!) out, int max_isa=2) -> ()", &argmax);
}

}  // namespace kvllm_cpu
