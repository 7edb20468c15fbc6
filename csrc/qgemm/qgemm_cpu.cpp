// pykernels._cpu_qgemm: quantized GEMMs on the CPU.
//
// Weights arrive packed by pykernels/quant/_format.py (layouts described there): every scheme is
// w = s[n,g] * u + m[n,g] with an unsigned code u, so per group  x.w = s * sum(x*u) + m * sum(x).
//
// 1. Weight-only (float activations x 1..8-bit codes), `wo_gemm`:
//    Activations are quantized per 32-element block to int16 (scale = absmax/32767, error <= 1.5e-5 of
//    the block's max: far below bf16's 3.9e-3) so that the inner product is an exact integer dot
//    product with AVX2 `vpmaddwd` (16 int16 x int16 -> 8 int32), the integer variant of the llama.cpp
//    Q4 x Q8 idea (ALGORITHMS.md) with int16 instead of int8 activations to keep fp32 accuracy. Codes
//    are widened in registers (vpmovzxbw + AND/shift for nibbles); four weight rows are interleaved so
//    one cache line holds a 32-element block of 4 rows and each activation load feeds 4 outputs.
//    At M=1 the kernel then streams the packed weights at memory bandwidth (~6 uops per 32 weights).
//    Threads split the output rows (N), never K, so no reduction is needed.
// 2. Bit-serial (act_bits, bipolar-INT), `bitserial_gemm`:
//    activations are quantized per token to p-bit codes and split into bit planes; every (i, j) pair of
//    activation/weight planes gives a one-bit GEMM  popcount(a_i AND w_j)  (64-bit POPCNT, or AVX2
//    vpshufb nibble counts + vpsadbw on 4 weight rows at once), recombined by shifts 2^(i+j) into the
//    exact integer sum(u_a*u_w) per group, then the affine recombination of ALGORITHMS.md:
//      sum_k A W = sa*s*I + sa*m*sum(u_a) + ma*s*sum(u_w) + ma*m*len   (per group, A = sa*u_a + ma).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "pk_common.h"
#include "pk_threads.h"
#if PK_X86
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace {

constexpr int RT = 4;   // rows per tile (ROW_TILE in _format.py)
constexpr int KB = 32;  // codes per block (K_BLOCK in _format.py)

// ---------------------------------------------------------------------------------------------
// dtype conversions at the boundary (activations in, outputs out)
// ---------------------------------------------------------------------------------------------
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (e == 0) {
    float f = std::ldexp((float)man, -24);
    return sign ? -f : f;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((e + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds past 65504: inf
  if (ax < 0x38800000u) {                                     // half subnormal (or zero)
    float a;
    std::memcpy(&a, &ax, 4);
    return (uint16_t)(sign | (uint32_t)std::nearbyint(a * 16777216.0f));
  }
  uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
  r -= 0x38000000u;
  return (uint16_t)(sign | (r >> 13));
}

inline float load_elem(const void* base, pk::DType dt, int64_t i) {
  switch (dt) {
    case pk::DType::Float32: return static_cast<const float*>(base)[i];
    case pk::DType::BFloat16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case pk::DType::Float16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return 0.f;
  }
}
inline void store_elem(void* base, pk::DType dt, int64_t i, float v) {
  switch (dt) {
    case pk::DType::Float32: static_cast<float*>(base)[i] = v; break;
    case pk::DType::BFloat16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); break;
    case pk::DType::Float16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); break;
    default: break;
  }
}

pk::DType float_dtype(int code, const char* op, const char* arg) {
  auto dt = static_cast<pk::DType>(code);
  if (dt != pk::DType::Float32 && dt != pk::DType::BFloat16 && dt != pk::DType::Float16)
    pk::fail_value(op, std::string("expected float32/bfloat16/float16 for '") + arg + "'");
  return dt;
}

// ---------------------------------------------------------------------------------------------
// Weight-only GEMM
// ---------------------------------------------------------------------------------------------
struct WoShape {
  int64_t M, N, K, Kp, B, G, gsize;
  int lbits;  // 4: nibble layout, 8: byte layout
  int center; // codes enter the integer dot product as u - center (2^(bits-1)): see wo_gemm
  int64_t tile_bytes() const { return B * RT * (lbits == 4 ? 16 : 32); }
};

// Activations of one token -> int16 per 32-block (+ block scales) and exact per-group sums.
void quantize_act_int16(const void* x, pk::DType dt, int64_t row, const WoShape& s, int16_t* q, float* bscale,
                        float* gsum) {
  const int64_t K = s.K;
  std::vector<float> xr(s.Kp, 0.f);
  for (int64_t k = 0; k < K; ++k) xr[k] = load_elem(x, dt, row * K + k);
  for (int64_t b = 0; b < s.B; ++b) {
    float amax = 0.f;
    for (int k = 0; k < KB; ++k) amax = std::max(amax, std::fabs(xr[b * KB + k]));
    bool finite = true;
    for (int k = 0; k < KB; ++k) finite &= std::isfinite(xr[b * KB + k]);
    if (!finite) {  // NaN/inf: the block's products become NaN (never a silent finite answer)
      bscale[b] = std::numeric_limits<float>::quiet_NaN();
      for (int k = 0; k < KB; ++k) q[b * KB + k] = 0;
    } else if (amax == 0.f) {
      bscale[b] = 0.f;
      for (int k = 0; k < KB; ++k) q[b * KB + k] = 0;
    } else {
      bscale[b] = amax / 32767.f;
      const float inv = 32767.f / amax;
      for (int k = 0; k < KB; ++k) {
        float v = std::nearbyint(xr[b * KB + k] * inv);
        v = std::min(32767.f, std::max(-32767.f, v));
        q[b * KB + k] = (int16_t)v;
      }
    }
  }
  for (int64_t g = 0; g < s.G; ++g) {
    double acc = 0;
    const int64_t k1 = std::min(K, (g + 1) * s.gsize);
    for (int64_t k = g * s.gsize; k < k1; ++k) acc += xr[k];
    gsum[g] = (float)acc;
  }
}

struct WoArgs {
  WoShape s;
  const uint8_t* w;
  const float* scales;   // [N, G]
  const float* offsets;  // [N, G]
  const int16_t* xq;     // [M, Kp]
  const float* xs;       // [M, B]
  const float* xsum;     // [M, G]
  const float* bias;     // [N] or null
  void* y;
  pk::DType ydt;
};

inline void block_range(const WoShape& s, int64_t g, int64_t* b0, int64_t* b1) {
  // group sizes are multiples of 32, except group_size=-1 (one group: every block)
  if (s.G == 1) { *b0 = 0; *b1 = s.B; return; }
  *b0 = g * s.gsize / KB;
  *b1 = std::min(s.B, ((g + 1) * s.gsize + KB - 1) / KB);
}

inline void finish_tile(const WoArgs& a, int64_t m, int64_t n0, int rows, const double* out) {
  for (int r = 0; r < rows; ++r) {
    double v = out[r] + (a.bias ? a.bias[n0 + r] : 0.f);
    store_elem(a.y, a.ydt, m * a.s.N + n0 + r, (float)v);
  }
}

void wo_tile_portable(const WoArgs& a, int64_t t) {
  const WoShape& s = a.s;
  const int64_t n0 = t * RT;
  const int rows = (int)std::min<int64_t>(RT, s.N - n0);
  const uint8_t* wt = a.w + t * s.tile_bytes();
  const int bw = s.lbits == 4 ? 16 : 32;
  for (int64_t m = 0; m < s.M; ++m) {
    const int16_t* xq = a.xq + m * s.Kp;
    const float* xs = a.xs + m * s.B;
    double out[RT] = {0, 0, 0, 0};
    for (int64_t g = 0; g < s.G; ++g) {
      int64_t b0, b1;
      block_range(s, g, &b0, &b1);
      float f[RT] = {0, 0, 0, 0};
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* wb = wt + b * RT * bw;
        const int16_t* x = xq + b * KB;
        for (int r = 0; r < RT; ++r) {
          int32_t acc = 0;
          if (s.lbits == 4) {
            for (int j = 0; j < 16; ++j) {
              const uint8_t v = wb[r * 16 + j];
              acc += ((int32_t)(v & 0x0f) - s.center) * x[j] + ((int32_t)(v >> 4) - s.center) * x[16 + j];
            }
          } else {
            for (int j = 0; j < 32; ++j) acc += ((int32_t)wb[r * 32 + j] - s.center) * x[j];
          }
          f[r] += (float)acc * xs[b];
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t i = (n0 + r) * s.G + g;
        out[r] += (double)f[r] * a.scales[i] +
                  ((double)a.offsets[i] + (double)a.scales[i] * s.center) * a.xsum[m * s.G + g];
      }
    }
    finish_tile(a, m, n0, rows, out);
  }
}

#if PK_X86
PK_TARGET_AVX2 inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// One row's 32 codes of block `wb` dotted with 32 int16 activations: 8 int32 lanes -> float.
template <int LB>
PK_TARGET_AVX2 inline __m256 wo_dot_avx2(const uint8_t* wb, int r, __m256i x0, __m256i x1, __m256i c) {
  __m256i acc;
  if constexpr (LB == 4) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + r * 16)));
    const __m256i lo = _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x0f)), c);
    const __m256i hi = _mm256_sub_epi16(_mm256_srli_epi16(v, 4), c);
    acc = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
  } else {
    const __m256i v0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + r * 32))), c);
    const __m256i v1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + r * 32 + 16))), c);
    acc = _mm256_add_epi32(_mm256_madd_epi16(v0, x0), _mm256_madd_epi16(v1, x1));
  }
  return _mm256_cvtepi32_ps(acc);
}

template <int LB>
PK_TARGET_AVX2 void wo_tile_avx2(const WoArgs& a, int64_t t) {
  const WoShape& s = a.s;
  const int64_t n0 = t * RT;
  const int rows = (int)std::min<int64_t>(RT, s.N - n0);
  constexpr int bw = LB == 4 ? 16 : 32;
  const uint8_t* wt = a.w + t * s.tile_bytes();
  const __m256i cv = _mm256_set1_epi16((int16_t)s.center);
  for (int64_t m = 0; m < s.M; ++m) {
    const int16_t* xq = a.xq + m * s.Kp;
    const float* xs = a.xs + m * s.B;
    __m256 tot0 = _mm256_setzero_ps(), tot1 = tot0, tot2 = tot0, tot3 = tot0;
    double off[RT] = {0, 0, 0, 0};
    for (int64_t g = 0; g < s.G; ++g) {
      int64_t b0, b1;
      block_range(s, g, &b0, &b1);
      __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* wb = wt + b * RT * bw;
        PK_PREFETCH_R(wb + 8 * RT * bw);
        const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + b * KB));
        const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + b * KB + 16));
        const __m256 xsb = _mm256_broadcast_ss(xs + b);
        f0 = _mm256_fmadd_ps(wo_dot_avx2<LB>(wb, 0, x0, x1, cv), xsb, f0);
        f1 = _mm256_fmadd_ps(wo_dot_avx2<LB>(wb, 1, x0, x1, cv), xsb, f1);
        f2 = _mm256_fmadd_ps(wo_dot_avx2<LB>(wb, 2, x0, x1, cv), xsb, f2);
        f3 = _mm256_fmadd_ps(wo_dot_avx2<LB>(wb, 3, x0, x1, cv), xsb, f3);
      }
      float sc[RT] = {0, 0, 0, 0};
      for (int r = 0; r < rows; ++r) {
        const int64_t i = (n0 + r) * s.G + g;
        sc[r] = a.scales[i];
        off[r] += ((double)a.offsets[i] + (double)a.scales[i] * s.center) * a.xsum[m * s.G + g];
      }
      tot0 = _mm256_fmadd_ps(f0, _mm256_set1_ps(sc[0]), tot0);
      tot1 = _mm256_fmadd_ps(f1, _mm256_set1_ps(sc[1]), tot1);
      tot2 = _mm256_fmadd_ps(f2, _mm256_set1_ps(sc[2]), tot2);
      tot3 = _mm256_fmadd_ps(f3, _mm256_set1_ps(sc[3]), tot3);
    }
    double out[RT] = {off[0] + hsum256(tot0), off[1] + hsum256(tot1), off[2] + hsum256(tot2),
                      off[3] + hsum256(tot3)};
    finish_tile(a, m, n0, rows, out);
  }
}
#endif

// At most one thread per ~2^16 multiply-adds (plus one): a small GEMV (64x64: 4096) costs less than
// waking and joining a second pool thread, which measured slower on 2 threads than on 1.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 16;
inline int threads_for_work(int num_threads, int64_t work) {
  return (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, work / kMinWorkPerThread + 1));
}

// Splits the N tiles into `nthreads` contiguous ranges. `m_block` tokens run per pass over a tile range
// so that a block of activations stays in cache while the weights stream (the GEMM tiling for M > 1).
void wo_gemm(uintptr_t x, int x_dtype, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
             uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int y_dtype,
             int num_threads, int64_t m_block, int64_t n_block, bool force_portable) {
  const char* op = "qmatmul";
  if (bits < 1 || bits > 8) pk::fail_value(op, "bits must be in 1..8");
  if (M < 0 || N < 0 || K < 0) pk::fail_value(op, "negative size");
  WoShape s{};
  s.M = M; s.N = N; s.K = K;
  s.Kp = (std::max<int64_t>(K, 1) + KB - 1) / KB * KB;
  s.B = s.Kp / KB;
  s.gsize = group_size == -1 ? std::max<int64_t>(K, 1) : group_size;
  if (group_size != -1 && (group_size <= 0 || group_size % KB != 0))
    pk::fail_value(op, "group_size must be -1 or a multiple of 32");
  s.G = K == 0 ? 0 : (K + s.gsize - 1) / s.gsize;
  s.lbits = bits <= 4 ? 4 : 8;
  // Centred codes: sum(x*u) would cancel against m*sum(x) when the offset is large (sym: m = -s*2^(b-1)),
  // losing the int16 activations' accuracy; sum(x*(u-c)) stays of the size of sum(|x*w|).
  s.center = 1 << (bits - 1);
  const pk::DType xdt = float_dtype(x_dtype, op, "x"), ydt = float_dtype(y_dtype, op, "out");
  if (M == 0 || N == 0) return;
  std::vector<int16_t> xq(M * s.Kp);
  std::vector<float> xs(M * s.B), xsum(std::max<int64_t>(M * s.G, 1));
  py::gil_scoped_release release;
  const void* xp = reinterpret_cast<const void*>(x);
  pk::parallel_ranges(M, threads_for_work(num_threads, M * K), [&](int, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_act_int16(xp, xdt, m, s, &xq[m * s.Kp], &xs[m * s.B], &xsum[m * s.G]);
  });
  const int64_t T = (N + RT - 1) / RT;
  m_block = std::max<int64_t>(1, m_block);
  n_block = std::max<int64_t>(1, n_block);  // tiles per chunk handed to a thread
  void (*tile_fn)(const WoArgs&, int64_t) = wo_tile_portable;
#if PK_X86
  if (!force_portable && pk::cpu_has_avx2()) tile_fn = s.lbits == 4 ? wo_tile_avx2<4> : wo_tile_avx2<8>;
#endif
  for (int64_t mb = 0; mb < M; mb += m_block) {
    WoArgs a{};
    a.s = s;
    a.s.M = std::min(m_block, M - mb);
    a.w = reinterpret_cast<const uint8_t*>(w);
    a.scales = reinterpret_cast<const float*>(scales);
    a.offsets = reinterpret_cast<const float*>(offsets);
    a.xq = xq.data() + mb * s.Kp;
    a.xs = xs.data() + mb * s.B;
    a.xsum = xsum.data() + mb * s.G;
    a.bias = bias ? reinterpret_cast<const float*>(bias) : nullptr;
    a.ydt = ydt;
    const int esize = ydt == pk::DType::Float32 ? 4 : 2;
    a.y = reinterpret_cast<char*>(y) + mb * N * esize;
    const int64_t chunks = (T + n_block - 1) / n_block;
    pk::parallel_ranges(chunks, threads_for_work(num_threads, a.s.M * N * K), [&](int, int64_t c0, int64_t c1) {
      for (int64_t t = c0 * n_block; t < std::min(T, c1 * n_block); ++t) tile_fn(a, t);
    });
  }
}

// Codes of a packed tile layout -> float weights [N, K] (dequantize on the CPU without torch ops).
#if PK_X86
// One row of a tile layout -> fp32 (vectorized widening + FMA), then optionally fp32 -> bf16 (RNE).
PK_TARGET_AVX2 void dequant_row_avx2(const uint8_t* wt, int64_t r, int64_t B, int bw, const float* sc,
                                     const float* of, int64_t G, int64_t gsize, float* row) {
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = wt + (b * RT + r) * bw;
    const int64_t g = std::min<int64_t>(G - 1, b * KB / gsize);
    const __m256 s = _mm256_set1_ps(sc[g]), m = _mm256_set1_ps(of[g]);
    __m128i c0, c1;  // 32 codes as bytes, in k order
    if (bw == 16) {
      const __m128i v = _mm_loadu_si128((const __m128i*)wb);
      c0 = _mm_and_si128(v, low);
      c1 = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    } else {
      c0 = _mm_loadu_si128((const __m128i*)wb);
      c1 = _mm_loadu_si128((const __m128i*)(wb + 16));
    }
    float* o = row + b * KB;
    _mm256_storeu_ps(o + 0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c0)), s, m));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c0, 8))), s, m));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c1)), s, m));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c1, 8))), s, m));
  }
}

PK_TARGET_AVX2 void f32_to_bf16_avx2(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  const __m256i round = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  for (; i + 16 <= n; i += 16) {
    __m256i a = _mm256_castps_si256(_mm256_loadu_ps(in + i));
    __m256i b = _mm256_castps_si256(_mm256_loadu_ps(in + i + 8));
    a = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(a, 16), one))), 16);
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256((__m256i*)(out + i), packed);
  }
  for (; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}
#endif

void dequant_tiles(uintptr_t w, int bits, uintptr_t scales, uintptr_t offsets, int64_t N, int64_t K,
                   int64_t group_size, uintptr_t out, int out_dtype, int num_threads) {
  const pk::DType odt = float_dtype(out_dtype, "dequantize", "out");
  const int64_t Kp = (std::max<int64_t>(K, 1) + KB - 1) / KB * KB, B = Kp / KB;
  const int bw = bits <= 4 ? 16 : 32;
  const int64_t gsize = group_size == -1 ? std::max<int64_t>(K, 1) : group_size;
  const int64_t G = K == 0 ? 0 : (K + gsize - 1) / gsize;
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w);
  const float* sc = reinterpret_cast<const float*>(scales);
  const float* of = reinterpret_cast<const float*>(offsets);
  void* o = reinterpret_cast<void*>(out);
  py::gil_scoped_release release;
  // Per block the group (hence scale and offset) is fixed: group sizes are multiples of 32 or -1.
  pk::parallel_ranges(N, threads_for_work(num_threads, N * K), [&](int, int64_t n0, int64_t n1) {
    std::vector<float> row(Kp);
    const bool avx2 = pk::cpu_has_avx2();
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t t = n / RT, r = n % RT;
#if PK_X86
      if (avx2) {
        dequant_row_avx2(wp + t * B * RT * bw, r, B, bw, sc + n * G, of + n * G, G, gsize, row.data());
        if (odt == pk::DType::BFloat16) {
          f32_to_bf16_avx2(row.data(), static_cast<uint16_t*>(o) + n * K, K);
          continue;
        }
        if (odt == pk::DType::Float32) {
          std::memcpy(static_cast<float*>(o) + n * K, row.data(), K * sizeof(float));
          continue;
        }
      }
#endif
      for (int64_t b = 0; b < B; ++b) {
        const uint8_t* wb = wp + ((t * B + b) * RT + r) * bw;
        const int64_t g = std::min<int64_t>(G - 1, b * KB / gsize);
        const float s = sc[n * G + g], m = of[n * G + g];
        float* o = &row[b * KB];
        if (bw == 16) {
          for (int j = 0; j < 16; ++j) {
            o[j] = (float)(wb[j] & 0x0f) * s + m;
            o[j + 16] = (float)(wb[j] >> 4) * s + m;
          }
        } else {
          for (int j = 0; j < 32; ++j) o[j] = (float)wb[j] * s + m;
        }
      }
      if (odt == pk::DType::Float32 && !avx2) {
        std::memcpy(static_cast<float*>(o) + n * K, row.data(), K * sizeof(float));
      } else {
        for (int64_t k = 0; k < K; ++k) store_elem(o, odt, n * K + k, row[k]);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Bit-serial GEMM (bipolar-INT, arbitrary precision)
// ---------------------------------------------------------------------------------------------
struct BsShape {
  int64_t M, N, K, G, gsize, gw;
  int p, q;
};

struct ActPlanes {
  std::vector<uint64_t> planes;  // [M, G, p, gw]
  std::vector<int32_t> usum;     // [M, G]
  std::vector<double> sa, ma;    // per token: A = sa * u_a + ma
  std::vector<uint8_t> bad;      // token had NaN/inf
  std::vector<uint8_t> codes;    // [M, K] (only for the integer check)
};

// Per-token p-bit quantization of the activations (the bipolar-INT scheme: A = (sa/2) A' + za with
// A' = 2 u_a - (2^p - 1), i.e. A = sa * u_a + min), then bit-plane packing.
void quantize_act_planes(const void* x, pk::DType dt, int64_t m, const BsShape& s, ActPlanes& A, bool keep_codes) {
  const int64_t K = s.K;
  const int qmax = (1 << s.p) - 1;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  bool finite = true;
  std::vector<float> xr(K);
  for (int64_t k = 0; k < K; ++k) {
    xr[k] = load_elem(x, dt, m * K + k);
    finite &= std::isfinite(xr[k]);
    lo = std::min(lo, xr[k]);
    hi = std::max(hi, xr[k]);
  }
  uint64_t* pl = &A.planes[m * s.G * s.p * s.gw];
  std::fill(pl, pl + s.G * s.p * s.gw, 0ull);
  if (!finite || K == 0) {
    A.bad[m] = !finite;
    A.sa[m] = 1.0;
    A.ma[m] = 0.0;
    for (int64_t g = 0; g < s.G; ++g) A.usum[m * s.G + g] = 0;
    return;
  }
  double sa = ((double)hi - (double)lo) / qmax;
  if (!(sa > 0)) sa = 1.0;
  A.sa[m] = sa;
  A.ma[m] = lo;
  for (int64_t g = 0; g < s.G; ++g) {
    int32_t us = 0;
    const int64_t k0 = g * s.gsize, k1 = std::min(K, k0 + s.gsize);
    for (int64_t k = k0; k < k1; ++k) {
      int u = (int)std::nearbyint(((double)xr[k] - lo) / sa);
      u = std::min(qmax, std::max(0, u));
      us += u;
      if (keep_codes) A.codes[m * K + k] = (uint8_t)u;
      const int64_t t = k - k0;
      for (int i = 0; i < s.p; ++i)
        if ((u >> i) & 1) pl[(g * s.p + i) * s.gw + t / 64] |= 1ull << (t % 64);
    }
    A.usum[m * s.G + g] = us;
  }
}

// Integer sums I[g][r] = sum_k u_a[k] u_w[r][k] over every group g of one token and the 4 rows of a tile
// (one call per (tile, token): the per-call overhead is paid once for all groups).
inline void bs_group_portable_one(const uint64_t* ap, const uint64_t* wp, const BsShape& s, int64_t* out) {
  for (int r = 0; r < RT; ++r) out[r] = 0;
  for (int i = 0; i < s.p; ++i)
    for (int j = 0; j < s.q; ++j) {
      const uint64_t* a = ap + i * s.gw;
      const uint64_t* w = wp + j * s.gw * RT;
      int64_t c[RT] = {0, 0, 0, 0};
      for (int64_t k = 0; k < s.gw; ++k)
        for (int r = 0; r < RT; ++r) c[r] += __builtin_popcountll(a[k] & w[k * RT + r]);
      for (int r = 0; r < RT; ++r) out[r] += c[r] << (i + j);
    }
}
void bs_groups_portable(const uint64_t* ap, const uint64_t* wp, const BsShape& s, int64_t* out) {
  for (int64_t g = 0; g < s.G; ++g)
    bs_group_portable_one(ap + g * s.p * s.gw, wp + g * s.q * s.gw * RT, s, out + g * RT);
}

#if PK_X86
// AVX2 popcount of each 64-bit lane's AND via the vpshufb nibble table; byte counts are summed with
// vpaddb for up to 31 words (31 * 8 < 256) before one vpsadbw folds them into 64-bit lanes.
PK_TARGET_AVX2 void bs_groups_avx2(const uint64_t* ap0, const uint64_t* wp0, const BsShape& s, int64_t* out0) {
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4,
                                         0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
  for (int64_t g = 0; g < s.G; ++g) {
  const uint64_t* ap = ap0 + g * s.p * s.gw;
  const uint64_t* wp = wp0 + g * s.q * s.gw * RT;
  int64_t* out = out0 + g * RT;
  __m256i total = zero;
  for (int i = 0; i < s.p; ++i)
    for (int j = 0; j < s.q; ++j) {
      const uint64_t* a = ap + i * s.gw;
      const uint64_t* w = wp + j * s.gw * RT;
      __m256i acc = zero, bytes = zero;
      int pending = 0;
      for (int64_t k = 0; k < s.gw; ++k) {
        const __m256i v = _mm256_and_si256(_mm256_set1_epi64x((long long)a[k]),
                                           _mm256_loadu_si256((const __m256i*)(w + k * RT)));
        const __m256i c = _mm256_add_epi8(_mm256_shuffle_epi8(table, _mm256_and_si256(v, low)),
                                          _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low)));
        bytes = _mm256_add_epi8(bytes, c);
        if (++pending == 31) {
          acc = _mm256_add_epi64(acc, _mm256_sad_epu8(bytes, zero));
          bytes = zero;
          pending = 0;
        }
      }
      acc = _mm256_add_epi64(acc, _mm256_sad_epu8(bytes, zero));
      total = _mm256_add_epi64(total, _mm256_sll_epi64(acc, _mm_cvtsi32_si128(i + j)));
    }
  _mm256_storeu_si256((__m256i*)out, total);
  }
}

// Scalar 64-bit POPCNT (the instruction, through the target attribute) for tiny groups.
PK_TARGET_AVX2 void bs_groups_popcnt(const uint64_t* ap0, const uint64_t* wp0, const BsShape& s, int64_t* out0) {
  for (int64_t g = 0; g < s.G; ++g) {
  const uint64_t* ap = ap0 + g * s.p * s.gw;
  const uint64_t* wp = wp0 + g * s.q * s.gw * RT;
  int64_t* out = out0 + g * RT;
  for (int r = 0; r < RT; ++r) out[r] = 0;
  for (int i = 0; i < s.p; ++i)
    for (int j = 0; j < s.q; ++j) {
      const uint64_t* a = ap + i * s.gw;
      const uint64_t* w = wp + j * s.gw * RT;
      int64_t c0 = 0, c1 = 0, c2 = 0, c3 = 0;
      for (int64_t k = 0; k < s.gw; ++k) {
        const uint64_t av = a[k];
        c0 += _mm_popcnt_u64(av & w[k * RT + 0]);
        c1 += _mm_popcnt_u64(av & w[k * RT + 1]);
        c2 += _mm_popcnt_u64(av & w[k * RT + 2]);
        c3 += _mm_popcnt_u64(av & w[k * RT + 3]);
      }
      out[0] += c0 << (i + j); out[1] += c1 << (i + j); out[2] += c2 << (i + j); out[3] += c3 << (i + j);
    }
  }
}
#endif

// mode: 0 portable, 1 scalar POPCNT, 2 AVX2 vpshufb (1 and 2 need AVX2 hardware; else portable).
void bitserial_gemm(uintptr_t x, int x_dtype, int64_t M, int64_t K, int act_bits, uintptr_t wplanes, int bits,
                    uintptr_t scales, uintptr_t offsets, uintptr_t wsum, int64_t N, int64_t group_size,
                    uintptr_t bias, uintptr_t y, int y_dtype, uintptr_t int_out, uintptr_t act_codes,
                    int num_threads, int mode) {
  const char* op = "qmatmul";
  if (act_bits < 1 || act_bits > 8) pk::fail_value(op, "act_bits must be in 1..8");
  if (bits < 1 || bits > 8) pk::fail_value(op, "bits must be in 1..8");
  BsShape s{};
  s.M = M; s.N = N; s.K = K; s.p = act_bits; s.q = bits;
  s.gsize = group_size == -1 ? std::max<int64_t>(K, 1) : group_size;
  if (s.gsize <= 0) pk::fail_value(op, "bad group_size");
  s.G = K == 0 ? 0 : (K + s.gsize - 1) / s.gsize;
  s.gw = std::max<int64_t>(1, (s.gsize + 63) / 64);
  const pk::DType xdt = float_dtype(x_dtype, op, "x");
  const pk::DType ydt = int_out ? pk::DType::Float32 : float_dtype(y_dtype, op, "out");
  if (M == 0 || N == 0) return;
  ActPlanes A;
  A.planes.resize(std::max<int64_t>(1, M * s.G * s.p * s.gw));
  A.usum.resize(std::max<int64_t>(1, M * s.G));
  A.sa.resize(M); A.ma.resize(M); A.bad.assign(M, 0);
  if (act_codes) A.codes.assign(M * K, 0);
  py::gil_scoped_release release;
  const void* xp = reinterpret_cast<const void*>(x);
  for (int64_t m = 0; m < M; ++m) quantize_act_planes(xp, xdt, m, s, A, act_codes != 0);
  if (act_codes) std::memcpy(reinterpret_cast<void*>(act_codes), A.codes.data(), M * K);
  const uint64_t* W = reinterpret_cast<const uint64_t*>(wplanes);
  const float* sc = reinterpret_cast<const float*>(scales);
  const float* of = reinterpret_cast<const float*>(offsets);
  const int32_t* ws = reinterpret_cast<const int32_t*>(wsum);
  const float* bs = bias ? reinterpret_cast<const float*>(bias) : nullptr;
  int64_t* iout = reinterpret_cast<int64_t*>(int_out);
  void (*groups_fn)(const uint64_t*, const uint64_t*, const BsShape&, int64_t*) = bs_groups_portable;
#if PK_X86
  if (pk::cpu_has_avx2() && mode == 1) groups_fn = bs_groups_popcnt;
  if (pk::cpu_has_avx2() && mode == 2) groups_fn = bs_groups_avx2;
#endif
  const int64_t T = (N + RT - 1) / RT;
  const int64_t tile_words = s.G * s.q * s.gw * RT;
  // Per token and group: sa * sum(u_a) + ma * len, the activation side of the affine recombination.
  std::vector<double> act_terms(std::max<int64_t>(1, M * s.G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < s.G; ++g)
      act_terms[m * s.G + g] = A.sa[m] * (double)A.usum[m * s.G + g] +
                               A.ma[m] * (double)(std::min(K, (g + 1) * s.gsize) - g * s.gsize);
  pk::parallel_ranges(T, num_threads, [&](int, int64_t t0, int64_t t1) {
    std::vector<int64_t> Iall(std::max<int64_t>(1, s.G) * RT);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * RT;
      const int rows = (int)std::min<int64_t>(RT, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        double acc[RT] = {0, 0, 0, 0};
        const double sa = A.sa[m], ma = A.ma[m];
        groups_fn(&A.planes[m * s.G * s.p * s.gw], W + t * tile_words, s, Iall.data());
        if (iout) {
          for (int r = 0; r < rows; ++r)
            for (int64_t g = 0; g < s.G; ++g) iout[(m * N + n0 + r) * s.G + g] = Iall[g * RT + r];
          continue;
        }
        // Row by row, groups innermost: the weight-side terms are contiguous in g.
        const double* c1 = &act_terms[m * s.G];
        for (int r = 0; r < rows; ++r) {
          const int64_t n = n0 + r;
          const float* swr = sc + n * s.G;
          const float* mwr = of + n * s.G;
          const int32_t* uwr = ws + n * s.G;
          double a = 0;
          for (int64_t g = 0; g < s.G; ++g)
            a += (double)swr[g] * (sa * (double)Iall[g * RT + r] + ma * (double)uwr[g]) + (double)mwr[g] * c1[g];
          acc[r] = a;
        }
        if (iout) continue;
        for (int r = 0; r < rows; ++r) {
          double v = A.bad[m] ? std::numeric_limits<double>::quiet_NaN() : acc[r] + (bs ? bs[n0 + r] : 0.f);
          store_elem(reinterpret_cast<void*>(y), ydt, m * N + n0 + r, (float)v);
        }
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(_cpu_qgemm, m) {
  m.doc() = "pykernels quantized GEMMs on the CPU (weight-only int16-activation kernels, bit-serial bipolar-INT)";
  m.def("cpu_has_avx2", &pk::cpu_has_avx2);
  m.def("wo_gemm", &wo_gemm, py::arg("x"), py::arg("x_dtype"), py::arg("M"), py::arg("K"), py::arg("w"),
        py::arg("bits"), py::arg("scales"), py::arg("offsets"), py::arg("N"), py::arg("group_size"),
        py::arg("bias"), py::arg("y"), py::arg("y_dtype"), py::arg("num_threads"), py::arg("m_block"),
        py::arg("n_block"), py::arg("force_portable"),
        "y[M,N] = x[M,K] @ dequant(W).T (+ bias): weight-only quantized GEMM on packed tiles");
  m.def("dequant_tiles", &dequant_tiles, py::arg("w"), py::arg("bits"), py::arg("scales"), py::arg("offsets"),
        py::arg("N"), py::arg("K"), py::arg("group_size"), py::arg("out"), py::arg("out_dtype"),
        py::arg("num_threads"), "out[N,K] = dequantized weights of a packed tile layout");
  m.def("bitserial_gemm", &bitserial_gemm, py::arg("x"), py::arg("x_dtype"), py::arg("M"), py::arg("K"),
        py::arg("act_bits"), py::arg("wplanes"), py::arg("bits"), py::arg("scales"), py::arg("offsets"),
        py::arg("wsum"), py::arg("N"), py::arg("group_size"), py::arg("bias"), py::arg("y"), py::arg("y_dtype"),
        py::arg("int_out"), py::arg("act_codes"), py::arg("num_threads"), py::arg("mode"),
        "bit-serial bipolar-INT GEMM; with int_out != 0 writes the integer sums I[M,N,G] instead of y");
}
