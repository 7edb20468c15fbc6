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
//    On AVX-512 VNNI CPUs a third tier splits the int16 activations into two bytes for `vpdpbusd`
//    (64 byte products per instruction): the GEMV kernel (wo_tiles_avx512, ~7 vector ops per 128
//    weights, up to M=11) and a panel GEMM (gemm_pair_avx512, from M=12) that decodes each 8-row panel
//    once and feeds it to 16 tokens per vector. Activation scales are per weight group there.
//    Threads split the output rows (N), never K, so no reduction is needed.
// 2. Bit-serial (act_bits, bipolar-INT), `bitserial_gemm`:
//    activations are quantized per token to p-bit codes and split into bit planes; every (i, j) pair of
//    activation/weight planes gives a one-bit GEMM  popcount(a_i AND w_j)  (64-bit POPCNT, AVX2
//    vpshufb nibble counts + vpsadbw on 4 weight rows at once, or AVX-512 vpopcntq on 2 words x 4 rows),
//    recombined by shifts 2^(i+j) into the
//    exact integer sum(u_a*u_w) per group, then the affine recombination of ALGORITHMS.md:
//      sum_k A W = sa*s*I + sa*m*sum(u_a) + ma*s*sum(u_w) + ma*m*len   (per group, A = sa*u_a + ma).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <limits>
#include <vector>

#include "pk_common.h"
#include "pk_avx2.h"
#include "pk_float.h"
#include "pk_threads.h"
#include "qgemm_act_fit.h"
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
using pk::bf16_to_f32;
using pk::f16_to_f32;
using pk::f32_to_bf16;
using pk::f32_to_f16;

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

// The shape of one weight-only GEMM (wo_gemm, wo_gemm_amx), its arguments checked.
WoShape wo_shape(const char* op, int64_t M, int64_t N, int64_t K, int bits, int64_t group_size) {
  if (bits < 1 || bits > 8) pk::fail_value(op, "bits must be in 1..8");
  if (M < 0 || N < 0 || K < 0) pk::fail_value(op, "negative size");
  if (group_size != -1 && (group_size <= 0 || group_size % KB != 0))
    pk::fail_value(op, "group_size must be -1 or a multiple of 32");
  WoShape s{};
  s.M = M; s.N = N; s.K = K;
  s.Kp = (std::max<int64_t>(K, 1) + KB - 1) / KB * KB;
  s.B = s.Kp / KB;
  s.gsize = group_size == -1 ? std::max<int64_t>(K, 1) : group_size;
  s.G = K == 0 ? 0 : (K + s.gsize - 1) / s.gsize;
  s.lbits = bits <= 4 ? 4 : 8;
  // Centred codes: sum(x*u) would cancel against m*sum(x) when the offset is large (sym: m = -s*2^(b-1)),
  // losing accuracy; sum(x*(u-c)) stays of the size of sum(|x*w|).
  s.center = 1 << (bits - 1);
  return s;
}

// Exact (double) per-group sums of one token's activations: the offset term m * sum(x) of each group.
void group_sums(const float* xr, const WoShape& s, float* gsum) {
  for (int64_t g = 0; g < s.G; ++g) {
    double acc = 0;
    const int64_t k1 = std::min(s.K, (g + 1) * s.gsize);
    for (int64_t k = g * s.gsize; k < k1; ++k) acc += xr[k];
    gsum[g] = (float)acc;
  }
}

// Rows the int16 activation path would get wrong (qmatmul's split, pykernels/quant/_ops.py).
// The int16 path scales a block by its max|x|, so every element of the block moves by up to 2^-16 of that
// max: y then differs from the fp32 product by ~2-4e-5 of max|y| on typical rows, and by ~1e-4 with LLM
// outlier features up to ~1000x (their own products dominate max|y|). What it cannot carry is an outlier
// whose weights are ~0 (a pruned channel): its block's other elements then lose ~R times their precision,
// unseen in y (1e-2 of max|y| at R = 3000, K = 512; fuzz finding). flag 1: max|x| above 2^8 times the mean
// |x| of the row's other nonzero elements (Gaussian, uniform or ReLU rows: 2-6 times; LLM outlier
// features: 50-200), which qmatmul then splits into the outliers, multiplied exactly (split_outliers;
// ~0.2 ms for 8 outliers of a 4096 x 4096 layer, so not for every LLM row), and the rest. flag 2: a NaN
// or an inf (the int16 path would give NaN for the whole row; torch gives inf where the product is inf).
// Returns the number of flagged rows.
// One row's flag, on the fp32 bit patterns of |x| (sign cleared): for non-negative floats the bit
// patterns order like the values (inf above every finite value, NaN above inf), so the max is an
// integer operation the compiler vectorizes (a float max is not, for NaN's sake).
template <class Bits>
static uint8_t act_row_flag(Bits bits_of, int64_t K, uint32_t* abits) {
  uint32_t amax = 0;
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t a = bits_of(k) & 0x7fffffffu;
    abits[k] = a;
    amax = std::max(amax, a);
  }
  if (amax >= 0x7f800000u) return 2;  // inf or NaN
  if (amax == 0) return 0;
  // a row max below 2^-96 or above 2^64: the int16 block scale (32767 / max) or the fp32 sums of the
  // block products could overflow; such rows take the exact fp32 route too
  if (amax < 0x0F800000u || amax > 0x5F800000u) return 2;
  float am;
  std::memcpy(&am, &amax, 4);
  float ps[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int32_t pn[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int j = 0; j < 8; ++j) {
      const uint32_t a = abits[k + j];
      float v;
      std::memcpy(&v, &a, 4);
      ps[j] += v;
      pn[j] += a != 0;
    }
  }
  for (; k < K; ++k) {
    const uint32_t a = abits[k];
    float v;
    std::memcpy(&v, &a, 4);
    ps[0] += v;
    pn[0] += a != 0;
  }
  double sum = 0.0;
  int64_t n = 0;
  for (int j = 0; j < 8; ++j) sum += ps[j], n += pn[j];
  sum -= am, n -= 1;  // the others: a lone outlier must not raise its own yardstick
  return n > 0 && (double)am > 256.0 * sum / (double)n ? 1 : 0;
}

// Every row's flag into `out` (when not null); returns how many rows are flagged. Call without the GIL.
int64_t flag_rows(uintptr_t x, pk::DType dt, int64_t M, int64_t K, uint8_t* out, int num_threads) {
  std::vector<int64_t> counts(std::max(1, num_threads), 0);
  pk::parallel_ranges(M, std::max(1, std::min<int>(num_threads, (int)(M * K / 262144 + 1))),
                      [&](int t, int64_t m0, int64_t m1) {
    std::vector<uint32_t> abits(std::max<int64_t>(K, 1));
    for (int64_t m = m0; m < m1; ++m) {
      uint8_t f;
      if (dt == pk::DType::Float32) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(x) + m * K;
        f = act_row_flag([row](int64_t k) { return row[k]; }, K, abits.data());
      } else if (dt == pk::DType::BFloat16) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(x) + m * K;
        f = act_row_flag([row](int64_t k) { return (uint32_t)row[k] << 16; }, K, abits.data());
      } else {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(x) + m * K;
        f = act_row_flag([row](int64_t k) {
          const float v = f16_to_f32(row[k]);
          uint32_t b;
          std::memcpy(&b, &v, 4);
          return b;
        }, K, abits.data());
      }
      if (out) out[m] = f;
      counts[t] += f != 0;
    }
  });
  int64_t total = 0;
  for (auto c : counts) total += c;
  return total;
}

int64_t act_range_flags(uintptr_t x, int x_dtype, int64_t M, int64_t K, uintptr_t flags, int num_threads) {
  const pk::DType dt = float_dtype(x_dtype, "qmatmul", "x");
  py::gil_scoped_release release;
  return flag_rows(x, dt, M, K, reinterpret_cast<uint8_t*>(flags), num_threads);
}

// The outliers of flag-1 rows (LLM.int8()'s decomposition, Dettmers et al. 2022): in each row, the
// elements above `factor` times the mean |x| of its nonzero elements (again on what is left, while any
// stands out), if there are at most `max_out` of them, are multiplied exactly (double) by their columns
// of the dequantized weight, read straight from the tile layout, into y_exact[M, N] (+=); rest[M, K]
// (float32) gets the row without them, for the int16 kernel. A row with more such elements (heavy
// tails) is copied to rest whole. Returns how many elements were taken out.
int64_t split_outliers(uintptr_t x, int x_dtype, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                       uintptr_t offsets, int64_t N, int64_t group_size, double factor, int64_t max_out,
                       uintptr_t rest, uintptr_t y_exact) {
  const pk::DType dt = float_dtype(x_dtype, "qmatmul", "x");
  const int64_t gsize = group_size == -1 ? std::max<int64_t>(K, 1) : group_size;
  const int64_t G = K > 0 ? (K + gsize - 1) / gsize : 0;
  const int64_t nblocks = (std::max<int64_t>(K, 1) + KB - 1) / KB;
  const int width = bits <= 4 ? 16 : 32;  // bytes per tile row per 32-code block (nibbles or bytes)
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w);
  const float* sc = reinterpret_cast<const float*>(scales);
  const float* of = reinterpret_cast<const float*>(offsets);
  float* rp = reinterpret_cast<float*>(rest);
  double* yp = reinterpret_cast<double*>(y_exact);
  int64_t taken = 0;
  py::gil_scoped_release release;
  std::vector<int64_t> out_k;
  std::vector<double> xv;
  for (int64_t m = 0; m < M; ++m) {
    float* r = rp + m * K;
    for (int64_t k = 0; k < K; ++k) r[k] = load_elem(reinterpret_cast<const void*>(x), dt, m * K + k);
    // rounds: the outliers of what is left, until nothing stands out (a row of three scales, 1e9, 1e6
    // and 1e4 next to values ~1, takes three rounds); more than max_out in all: the row stays whole
    out_k.clear();
    xv.clear();
    // An element is an outlier above `factor` times the mean |x| of the row's OTHER nonzero elements,
    // the yardstick act_row_flag flags a row by. With the element itself in the mean, an outlier A with
    // n <= 7 nonzero neighbours a (A > 8 (A + n a) / (n + 1) never holds) stayed in the row, whose
    // neighbours then rounded to 0 in its int16 block (review finding: error 100% of y).
    //   |x_k| > factor * (sum - |x_k|) / (nz - 1)  <=>  |x_k| * (nz - 1 + factor) > factor * sum
    for (int round = 0; round < 16; ++round) {
      double sum = 0.0;
      int64_t nz = 0;
      for (int64_t k = 0; k < K; ++k) sum += std::fabs(r[k]), nz += r[k] != 0.f;
      if (nz < 2) break;  // no other element whose precision an outlier could take
      const double lim = factor * sum / ((double)(nz - 1) + factor);
      const size_t before = out_k.size();
      for (int64_t k = 0; k < K && (int64_t)out_k.size() <= max_out; ++k)
        if (std::fabs((double)r[k]) > lim) out_k.push_back(k), xv.push_back(r[k]), r[k] = 0.f;
      if (out_k.size() == before || (int64_t)out_k.size() > max_out) break;
    }
    if ((int64_t)out_k.size() > max_out) {  // put them back
      for (size_t i = 0; i < out_k.size(); ++i) r[out_k[i]] = (float)xv[i];
      continue;
    }
    if (out_k.empty()) continue;
    // n outer, outliers inner: a weight row's scales and offsets (G floats each) are read once per row
    // for all its outliers (they are the cache misses here: ~3x faster than one pass per outlier)
    const int mask = width == 16 ? 0xF : 0xFF;
    const size_t no = out_k.size();
    std::vector<int64_t> grp(no), at(no);  // per outlier: its group, its byte in a tile row
    std::vector<int> shift(no);
    for (size_t i = 0; i < no; ++i) {
      const int64_t k = out_k[i], j = k % KB;
      grp[i] = k / gsize;
      at[i] = (k / KB) * (RT * width) + j % width;
      shift[i] = width == 16 ? 4 * (int)(j / 16) : 0;
    }
    double* y = yp + m * N;
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* tile = wp + (n / RT) * (nblocks * RT * width) + (n % RT) * width;
      const float* srow = sc + n * G;
      const float* orow = of + n * G;
      double acc = 0.0;
      for (size_t i = 0; i < no; ++i) {
        const int code = (tile[at[i]] >> shift[i]) & mask;
        acc += xv[i] * ((double)srow[grp[i]] * code + (double)orow[grp[i]]);
      }
      y[n] += acc;
    }
    taken += (int64_t)out_k.size();
  }
  return taken;
}

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
  group_sums(xr.data(), s, gsum);
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

template <class Args>  // WoArgs or WoArgs16
inline void finish_tile(const Args& a, int64_t m, int64_t n0, int rows, const double* out) {
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
using pk::hsum256;

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

// The end of group g for token m of a tile: the rows' weight scales (sc) and the offset term of the
// affine form, m * sum(x) with the centre folded in, added to off (double).
inline void wo_group_scales(const WoArgs& a, int64_t n0, int rows, int64_t m, int64_t g, float* sc, double* off) {
  const WoShape& s = a.s;
  for (int r = 0; r < rows; ++r) {
    const int64_t i = (n0 + r) * s.G + g;
    sc[r] = a.scales[i];
    off[r] += ((double)a.offsets[i] + (double)a.scales[i] * s.center) * a.xsum[m * s.G + g];
  }
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
      wo_group_scales(a, n0, rows, m, g, sc, off);
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

// The same tile for a pass of M >= 2 tokens: the tile's codes (4 rows) are decoded once per pass, a chunk
// of whole groups at a time (centred int16, 64 bytes per row and block, up to PANEL_CHUNK_BLOCKS blocks:
// 8 KiB, in L1), and every token of the pass is dotted with the chunk, instead of the codes being widened
// again for each token (the load, widen, mask, shift and two subtractions per row and block of
// wo_tile_avx2: ~11 vector ops per 32 multiply-adds of a row, ~7 here). Each token's running totals wait
// in a small per-thread buffer between chunks. Every (token, row) sum sees the same operations in the same
// order as in wo_tile_avx2, so the results are bit-identical. Measured (K=N=4096 W4 g128, fp32 tokens, 2
// threads, same process, ms, wo_tile_avx2 -> this): M=2 1.8 -> 1.2, M=16 7.1 -> 6.3, M=64 28.7 -> 23.4,
// M=128 56.7 -> 46.3. (Decoding the whole tile first, 32 KiB at K=4096, read back from L2: 10% less; a
// loop over tokens inside each group of 4 blocks: 1.6x slower than wo_tile_avx2.)
constexpr int64_t PANEL_CHUNK_BLOCKS = 32;  // wo_tile_avx2_panel decodes up to 32 blocks (8 KiB) at a time
// Row r's 32 decoded codes of a block (wo_tile_avx2_panel's buffer) dotted with 32 int16 activations.
PK_TARGET_AVX2 inline __m256 wo_dot_decoded_avx2(const int16_t* d, int r, __m256i x0, __m256i x1) {
  const __m256i lo = _mm256_loadu_si256((const __m256i*)(d + r * KB));
  const __m256i hi = _mm256_loadu_si256((const __m256i*)(d + r * KB + 16));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1)));
}

template <int LB>
PK_TARGET_AVX2 void wo_tile_avx2_panel(const WoArgs& a, int64_t t) {
  const WoShape& s = a.s;
  const int64_t n0 = t * RT;
  const int rows = (int)std::min<int64_t>(RT, s.N - n0);
  constexpr int bw = LB == 4 ? 16 : 32;
  const uint8_t* wt = a.w + t * s.tile_bytes();
  const __m256i cv = _mm256_set1_epi16((int16_t)s.center);
  static thread_local std::vector<int16_t> dec;  // [block of the chunk][row][32 codes]
  static thread_local std::vector<float> tot;    // [token][row][8 lanes], between chunks
  static thread_local std::vector<double> off;   // [token][row]
  tot.assign((size_t)s.M * RT * 8, 0.f);
  off.assign((size_t)s.M * RT, 0.0);
  for (int64_t g0 = 0; g0 < s.G;) {
    // a chunk of whole groups of up to CHUNK_BLOCKS blocks (at least one group): 8 KiB decoded, in L1
    int64_t cb0, cb1, g1 = g0;
    block_range(s, g0, &cb0, &cb1);
    for (int64_t b0, b1; g1 + 1 < s.G; ++g1) {
      block_range(s, g1 + 1, &b0, &b1);
      if (b1 - cb0 > PANEL_CHUNK_BLOCKS) break;
      cb1 = b1;
    }
    ++g1;
    dec.resize((size_t)(cb1 - cb0) * RT * KB);
    int16_t* const dp = dec.data();
    for (int64_t b = cb0; b < cb1; ++b) {
      const uint8_t* wb = wt + b * RT * bw;
      PK_PREFETCH_R(wb + 8 * RT * bw);
      int16_t* d = dp + (b - cb0) * RT * KB;
      for (int r = 0; r < RT; ++r) {
        __m256i lo, hi;
        if constexpr (LB == 4) {
          const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + r * 16)));
          lo = _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x0f)), cv);
          hi = _mm256_sub_epi16(_mm256_srli_epi16(v, 4), cv);
        } else {
          lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + r * 32))), cv);
          hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + r * 32 + 16))), cv);
        }
        _mm256_storeu_si256((__m256i*)(d + r * KB), lo);
        _mm256_storeu_si256((__m256i*)(d + r * KB + 16), hi);
      }
    }
    for (int64_t m = 0; m < s.M; ++m) {
      const int16_t* xq = a.xq + m * s.Kp;
      const float* xs = a.xs + m * s.B;
      float* tm = tot.data() + m * RT * 8;
      double* om = off.data() + m * RT;
      __m256 tot0 = _mm256_loadu_ps(tm), tot1 = _mm256_loadu_ps(tm + 8), tot2 = _mm256_loadu_ps(tm + 16),
             tot3 = _mm256_loadu_ps(tm + 24);
      for (int64_t g = g0; g < g1; ++g) {
        int64_t b0, b1;
        block_range(s, g, &b0, &b1);
        __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
        for (int64_t b = b0; b < b1; ++b) {
          const int16_t* d = dp + (b - cb0) * RT * KB;
          const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + b * KB));
          const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + b * KB + 16));
          const __m256 xsb = _mm256_broadcast_ss(xs + b);
          f0 = _mm256_fmadd_ps(wo_dot_decoded_avx2(d, 0, x0, x1), xsb, f0);
          f1 = _mm256_fmadd_ps(wo_dot_decoded_avx2(d, 1, x0, x1), xsb, f1);
          f2 = _mm256_fmadd_ps(wo_dot_decoded_avx2(d, 2, x0, x1), xsb, f2);
          f3 = _mm256_fmadd_ps(wo_dot_decoded_avx2(d, 3, x0, x1), xsb, f3);
        }
        float sc[RT] = {0, 0, 0, 0};
        wo_group_scales(a, n0, rows, m, g, sc, om);
        tot0 = _mm256_fmadd_ps(f0, _mm256_set1_ps(sc[0]), tot0);
        tot1 = _mm256_fmadd_ps(f1, _mm256_set1_ps(sc[1]), tot1);
        tot2 = _mm256_fmadd_ps(f2, _mm256_set1_ps(sc[2]), tot2);
        tot3 = _mm256_fmadd_ps(f3, _mm256_set1_ps(sc[3]), tot3);
      }
      _mm256_storeu_ps(tm, tot0);
      _mm256_storeu_ps(tm + 8, tot1);
      _mm256_storeu_ps(tm + 16, tot2);
      _mm256_storeu_ps(tm + 24, tot3);
    }
    g0 = g1;
  }
  for (int64_t m = 0; m < s.M; ++m) {
    const float* tm = tot.data() + m * RT * 8;
    const double* om = off.data() + m * RT;
    double out[RT] = {om[0] + hsum256(_mm256_loadu_ps(tm)), om[1] + hsum256(_mm256_loadu_ps(tm + 8)),
                      om[2] + hsum256(_mm256_loadu_ps(tm + 16)), om[3] + hsum256(_mm256_loadu_ps(tm + 24))};
    finish_tile(a, m, n0, rows, out);
  }
}

// GCC 12 warns "__Y may be used uninitialized" inside its own AVX-512 intrinsic headers (the
// _mm512_undefined_* placeholders of unmasked forms): a known false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI weight-only kernel (Zen 4 / Ice Lake and newer), on the same packed tiles.
//
// Count per 64-byte line of the nibble layout (4 rows x 32 codes = 128 weights): 1 load, 3 ops to
// split the nibbles (and, shift, and), 4 `vpdpbusd` (64 u8 x s8 products each) = 7 vector ops, against
// ~16 for the AVX2 path's widen + vpmaddwd chain; the two multiply pipes bound it at ~4 cycles/line.
// Activations keep 16 bits: x = 256*xh + xl with xh signed and xl unsigned bytes, so
//   sum x*u = 256 * dpbusd(u as u8, xh as s8) + dpbusd(xl as u8, u as s8)
// (codes < 16 are valid s8; 8-bit codes enter the second product as u - 128, corrected per block).
// The zero point is factored out of the inner loop (sum x (u - c) = sum x u - c sum x): the integer
// correction -c * sum(xq) seeds one lane per row, so each block's integer sum is exact and centred.
// Activation scales are per block of one weight group ("sblock", <= 2048 codes so int32 cannot
// overflow; group_size=-1 uses blocks of up to 1024), so one float scale per (row, sblock) remains:
// 4 sblocks' 4x4 partial sums are transposed and reduced in registers into one vector of 16
// (row, sblock) lanes, converted once and scaled by w_scale * x_scale with one FMA.
// ---------------------------------------------------------------------------------------------
// acc += u8 x s8 dot products of 4 bytes per int32 lane (vpdpbusd). GCC 12 allocates the intrinsic's
// tied accumulator badly in loops (a register copy around every instruction and spills to the stack:
// measured 1.5x slower); the one-line asm accumulates in place.
PK_TARGET_AVX512 inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, u8, s8);
#endif
}

struct Act16 {
  std::vector<int8_t> xh;     // [M, Kp] high bytes (signed)
  std::vector<uint8_t> xl;    // [M, Kp] low bytes (unsigned)
  std::vector<float> xs;      // [M, NS4] per-sblock scale (NaN: the sblock had NaN/inf)
  std::vector<int32_t> corr;  // [M, NS4] integer correction seeded into each sblock's sums
  std::vector<int32_t> sumq;  // [M, NS4] sum of the int16 codes
  std::vector<float> gsum;    // [M, G] exact per-group sums of x (the offset term)
};

struct Vnni {
  int64_t d;    // blocks of 32 per sblock
  int64_t NS;   // sblocks
  int64_t NS4;  // NS rounded up to a multiple of 4 (padded with zero scales)
};

// Largest sblock (in 32-blocks) whose centred per-row integer sum fits int32:
// |x| <= 32767, |u - c| <= 128 (8-bit layout) or 8 (nibbles).
inline int64_t vnni_dmax(int lbits) { return lbits == 4 ? 64 : 8; }

inline bool vnni_geometry(const WoShape& s, Vnni* v) {
  const int64_t dmax = vnni_dmax(s.lbits);
  if (s.G > 1) {
    if (s.gsize / KB > dmax) return false;  // a huge group (8-bit, > 256 codes): the AVX2 kernel
    v->d = s.gsize / KB;
  } else {
    v->d = std::min<int64_t>(s.B, s.lbits == 4 ? 32 : dmax);
  }
  v->NS = (s.B + v->d - 1) / v->d;
  v->NS4 = (v->NS + 3) / 4 * 4;
  return true;
}

// One token -> int16 codes split into bytes, per-sblock scales and integer sums, exact group sums; all
// 16 lanes wide (a scalar loop here cost ~18 us per 4096-element token, 10% of a 4096^2 GEMV).
PK_TARGET_AVX512 inline __m512 load16_f32(const void* x, pk::DType dt, int64_t i, __mmask16 m) {
  if (dt == pk::DType::Float32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(x) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(x) + i);
  if (dt == pk::DType::BFloat16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

PK_TARGET_AVX512 void quantize_act16(const void* x, pk::DType dt, int64_t row, const WoShape& s, const Vnni& v,
                                     float* xr, int8_t* xh, uint8_t* xl, float* xs, int32_t* corr, int32_t* sumq,
                                     float* gsum) {
  const int64_t K = s.K;
  for (int64_t k = 0; k < s.Kp; k += 16) {  // fp32 copy of the row, zero-padded to Kp
    const int64_t left = K - k;
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    _mm512_storeu_ps(xr + k, load16_f32(x, dt, row * K + k, m));
  }
  const __m512i lim = _mm512_set1_epi32(32767), nlim = _mm512_set1_epi32(-32767), ff = _mm512_set1_epi32(0xff);
  for (int64_t sb = 0; sb < v.NS4; ++sb) {
    xs[sb] = 0.f;
    corr[sb] = sumq[sb] = 0;
    if (sb >= v.NS) continue;
    const int64_t k0 = sb * v.d * KB, k1 = std::min(s.Kp, k0 + v.d * KB);
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = k0; k < k1; k += 16) {
      const __m512 xv = _mm512_loadu_ps(xr + k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(xv));
      bad |= _mm512_fpclass_ps_mask(xv, 0x99);  // QNaN | +inf | -inf | SNaN
    }
    const float am = _mm512_reduce_max_ps(amax);
    const bool finite = bad == 0;
    const float inv = am > 0.f && finite ? 32767.f / am : 0.f;
    xs[sb] = !finite ? std::numeric_limits<float>::quiet_NaN() : am / 32767.f;
    __m512i sq = _mm512_setzero_si512(), sl = sq;
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t k = k0; k < k1; k += 16) {
      // round to nearest even (MXCSR default), like nearbyint
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + k), iv));
      q = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, q));
      const __m512i lo = _mm512_and_si512(q, ff);
      _mm_storeu_si128((__m128i*)(xh + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8)));  // q = 256 xh + xl
      _mm_storeu_si128((__m128i*)(xl + k), _mm512_cvtepi32_epi8(lo));
      sq = _mm512_add_epi32(sq, q);
      sl = _mm512_add_epi32(sl, lo);
    }
    const int64_t tq = _mm512_reduce_add_epi32(sq), tl = _mm512_reduce_add_epi32(sl);
    corr[sb] = (int32_t)(-(int64_t)s.center * tq + (s.lbits == 8 ? 128 * tl : 0));
    sumq[sb] = (int32_t)tq;
  }
  for (int64_t g = 0; g < s.G; ++g) {  // groups start at multiples of 32; xr is zero past K
    const int64_t k0 = g * s.gsize, k1 = std::min(s.Kp, (g + 1) * s.gsize);
    __m512d acc = _mm512_setzero_pd();
    for (int64_t k = k0; k < k1; k += 16) {
      const __m512 xv = _mm512_loadu_ps(xr + k);
      acc = _mm512_add_pd(acc, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(xv)),
                                             _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(xv), 1)))));
    }
    gsum[g] = (float)_mm512_reduce_add_pd(acc);
  }
}

struct WoArgs16 {
  WoShape s;
  Vnni v;
  const uint8_t* w;
  const float* scales;   // [N, G]
  const float* offsets;  // [N, G]
  const int8_t* xh;      // [M, Kp]
  const uint8_t* xl;     // [M, Kp]
  const float* xs;       // [M, NS4]
  const int32_t* corr;   // [M, NS4]
  const float* gsum;     // [M, G]
  const float* bias;
  void* y;
  pk::DType ydt;
};

// Integer sums of one sblock for one token and NT consecutive tiles (the activation broadcasts are
// shared: loads were the bound with one tile), lanes (row r = 128-bit lane, 4 partials).
template <int LB, int NT>
PK_TARGET_AVX512 inline void vnni_sblock(const uint8_t* wt, int64_t tstride, const int8_t* xh, const uint8_t* xl,
                                         int64_t b0, int64_t b1, int32_t corr, __m512i* out) {
  if constexpr (LB == 4) {
    // per tile 4 independent accumulators: one vpdpbusd per chain per line (its latency is 4+ cycles)
    __m512i ah[NT], ah2[NT], al[NT], al2[NT];
    for (int i = 0; i < NT; ++i) {
      ah[i] = ah2[i] = al2[i] = _mm512_setzero_si512();
      al[i] = _mm512_maskz_set1_epi32(0x1111, corr);
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = b0; b < b1; ++b) {
      // byte j of a row: code k=j (low nibble) and k=16+j (high nibble); every row reads x[0..15], x[16..31]
      const __m512i h0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xh + b * KB)));
      const __m512i h1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xh + b * KB + 16)));
      const __m512i l0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xl + b * KB)));
      const __m512i l1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xl + b * KB + 16)));
      for (int i = 0; i < NT; ++i) {
        // The same line of the tile NT ahead (what the next call reads: NT tiles of 2K bytes ahead).
        // The hardware prefetcher alone left this loop at ~55% of the read bandwidth (1.20 -> 0.95 ms
        // for 4096 x 4096 cold with a prefetch 4 KB ahead in the same stream); but a tile is only 2K
        // bytes (8 KiB at K=4096): from the middle of a tile that prefetch pointed into the tile beside
        // it, already being read, and the first half of every second tile of a pair was never
        // prefetched. A tile ahead measured 1.25-1.5x faster again on one thread (483-503 vs 635-770 us
        // for 4096 x 4096, L3-resident; 895-955 vs 1078-1243 us per layer rotating through 90 MiB).
        PK_PREFETCH_R(wt + (i + NT) * tstride + b * 64);
        const __m512i v = _mm512_loadu_si512(wt + i * tstride + b * 64);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        ah[i] = dpbusd(ah[i], lo, h0);
        ah2[i] = dpbusd(ah2[i], hi, h1);
        al[i] = dpbusd(al[i], l0, lo);
        al2[i] = dpbusd(al2[i], l1, hi);
      }
    }
    for (int i = 0; i < NT; ++i)
      out[i] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(ah[i], ah2[i]), 8), _mm512_add_epi32(al[i], al2[i]));
  } else {
    // byte layout: a block is 2 lines, rows (0,1) then (2,3), 32 codes each; lanes (row, 8 partials)
    __m512i ah[NT], ah2[NT], al[NT], al2[NT];
    for (int i = 0; i < NT; ++i) {
      ah[i] = ah2[i] = _mm512_setzero_si512();
      al[i] = al2[i] = _mm512_maskz_set1_epi32(0x0101, corr);
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = b0; b < b1; ++b) {
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xh + b * KB)));
      const __m512i l = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xl + b * KB)));
      for (int i = 0; i < NT; ++i) {
        PK_PREFETCH_R(wt + (i + NT) * tstride + b * 128);  // a tile ahead, as for nibbles
        PK_PREFETCH_R(wt + (i + NT) * tstride + b * 128 + 64);
        const __m512i v0 = _mm512_loadu_si512(wt + i * tstride + b * 128);
        const __m512i v1 = _mm512_loadu_si512(wt + i * tstride + b * 128 + 64);
        ah[i] = dpbusd(ah[i], v0, h);
        ah2[i] = dpbusd(ah2[i], v1, h);
        al[i] = dpbusd(al[i], l, _mm512_xor_si512(v0, flip));  // xl * (u - 128)
        al2[i] = dpbusd(al2[i], l, _mm512_xor_si512(v1, flip));
      }
    }
    for (int i = 0; i < NT; ++i) {
      const __m512i a = _mm512_add_epi32(_mm512_slli_epi32(ah[i], 8), al[i]);    // rows 0,1 (2 lanes each)
      const __m512i c = _mm512_add_epi32(_mm512_slli_epi32(ah2[i], 8), al2[i]);  // rows 2,3
      // 128-bit lanes [r0a r0b r1a r1b] + [r2a r2b r3a r3b] -> [r0 r1 r2 r3] (4 partials each)
      out[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(a, c, 0x88), _mm512_shuffle_i32x4(a, c, 0xDD));
    }
  }
}

// 4 vectors of (row, 4 partials) -> one vector of (row, j) sums: an in-lane 4x4 transpose-and-add.
PK_TARGET_AVX512 inline __m512i reduce4x4(__m512i i0, __m512i i1, __m512i i2, __m512i i3) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(i0, i1), _mm512_unpackhi_epi32(i0, i1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(i2, i3), _mm512_unpackhi_epi32(i2, i3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// Tiles t .. t+NT-1 for every token of the pass.
template <int LB, int NT>
PK_TARGET_AVX512 void wo_tiles_avx512(const WoArgs16& a, int64_t t) {
  const WoShape& s = a.s;
  const Vnni& v = a.v;
  const uint8_t* wt = a.w + t * s.tile_bytes();
  int rows[NT];
  __m512 ws1[NT];  // per-row weight scale of every (row, j) lane when there is one group
  for (int i = 0; i < NT; ++i) {
    const int64_t n0 = (t + i) * RT;
    rows[i] = (int)std::min<int64_t>(RT, s.N - n0);
    ws1[i] = _mm512_setzero_ps();
    if (s.G == 1) {
      const __m128 s4 = _mm_maskz_loadu_ps((__mmask8)((1u << rows[i]) - 1), a.scales + n0);
      ws1[i] = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                     _mm512_castps128_ps512(s4));
    }
  }
  for (int64_t m = 0; m < s.M; ++m) {
    const int8_t* xh = a.xh + m * s.Kp;
    const uint8_t* xl = a.xl + m * s.Kp;
    const float* xs = a.xs + m * v.NS4;
    const int32_t* corr = a.corr + m * v.NS4;
    __m512 tot[NT];
    for (int i = 0; i < NT; ++i) tot[i] = _mm512_setzero_ps();
    for (int64_t q = 0; q < v.NS4; q += 4) {
      __m512i I[4][NT];
      for (int j = 0; j < 4; ++j) {
        const int64_t sb = q + j;
        if (sb >= v.NS) {
          for (int i = 0; i < NT; ++i) I[j][i] = _mm512_setzero_si512();
          continue;
        }
        vnni_sblock<LB, NT>(wt, s.tile_bytes(), xh, xl, sb * v.d, std::min(s.B, (sb + 1) * v.d), corr[sb], I[j]);
      }
      const __m512 xq = _mm512_broadcast_f32x4(_mm_loadu_ps(xs + q));
      for (int i = 0; i < NT; ++i) {
        // (I * xs) * ws, not I * (xs * ws): the two scales' product underflowed into denormals for tiny
        // weights (|w| ~ 1e-38: 2% error, 1e-40: all of it; audit finding), the integer sum times one
        // scale does not; the same two instructions
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(reduce4x4(I[0][i], I[1][i], I[2][i], I[3][i])), xq);
        __m512 sv = ws1[i];
        if (s.G > 1) {  // sblock == group: row r's 4 scales are contiguous at scales[n, q..q+3]
          const __mmask8 jm = (__mmask8)((1u << std::min<int64_t>(4, v.NS - q)) - 1);
          const float* s0 = a.scales + (t + i) * RT * s.G + q;  // rows past N: mask 0 (never faults)
          const int rw = rows[i];
          __m512 w4 = _mm512_castps128_ps512(_mm_maskz_loadu_ps(jm, s0));
          w4 = _mm512_insertf32x4(w4, _mm_maskz_loadu_ps(rw > 1 ? jm : 0, s0 + s.G), 1);
          w4 = _mm512_insertf32x4(w4, _mm_maskz_loadu_ps(rw > 2 ? jm : 0, s0 + 2 * s.G), 2);
          w4 = _mm512_insertf32x4(w4, _mm_maskz_loadu_ps(rw > 3 ? jm : 0, s0 + 3 * s.G), 3);
          sv = w4;
        }
        tot[i] = _mm512_fmadd_ps(f, sv, tot[i]);
      }
    }
    const float* gs = a.gsum + m * s.G;
    for (int i = 0; i < NT; ++i) {
      const int64_t n0 = (t + i) * RT;
      // (row, j) lanes -> row sums
      __m512 tt = _mm512_add_ps(tot[i], _mm512_permute_ps(tot[i], 0x4E));
      tt = _mm512_add_ps(tt, _mm512_permute_ps(tt, 0xB1));
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, tt);
      double out[RT] = {0, 0, 0, 0};
      for (int r = 0; r < rows[i]; ++r) {
        // offset term sum_g (m + c s)[n, g] * sum_g(x), vectorized over groups
        const float* sr = a.scales + (n0 + r) * s.G;
        const float* mr = a.offsets + (n0 + r) * s.G;
        __m512 am = _mm512_setzero_ps(), as = _mm512_setzero_ps();
        for (int64_t g = 0; g < s.G; g += 16) {
          const __mmask16 gm = (__mmask16)(s.G - g >= 16 ? 0xffff : (1u << (s.G - g)) - 1);
          const __m512 xg = _mm512_maskz_loadu_ps(gm, gs + g);
          am = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(gm, mr + g), xg, am);
          as = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(gm, sr + g), xg, as);
        }
        out[r] = (double)lanes[4 * r] + (double)_mm512_reduce_add_ps(am) +
                 (double)s.center * (double)_mm512_reduce_add_ps(as);
      }
      finish_tile(a, m, n0, rows[i], out);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI GEMM for M > 1 (the GEMV kernel above decodes every nibble once per token).
// The roles of the operands swap: 16 tokens sit in the 16 int32 lanes, and each weight dword (4 codes)
// comes straight from memory as an embedded broadcast ({1to16}) operand of vpdpbusd. A tile pair (8
// rows) is decoded once into a byte panel (8 x Kp, L1/L2-resident) and reused by every token group, so
// the inner loop is 2 activation loads + 16 vpdpbusd per 4 codes x 8 rows x 16 tokens (like unpacking
// a Marlin tile once into registers and feeding it to all of a block's rows).
// Both products need the activation as the unsigned operand: xh' = xh + 128 (xor 0x80), corrected by
// -32768 * sum(u') per (row, sblock); codes enter as u' = u (nibbles) or u - 128 (bytes), corrected by
// (o - c) * sum(xq) per (token, sblock) with o = 0 or 128, so every sblock's integer sum is the exact
// centred sum(xq * (u - c)), as in the GEMV kernel.
// ---------------------------------------------------------------------------------------------
constexpr int TG = 16;  // tokens per group (the int32 lanes)
constexpr int PR = 8;   // rows per panel (two tiles)

struct GemmArgs16 {
  WoShape s;
  Vnni v;
  const uint8_t* w;
  const float* scales;
  const float* offsets;
  const uint8_t* xh16;  // [MG, Kp/4, 16 tokens, 4]: xh + 128
  const uint8_t* xl16;  // [MG, Kp/4, 16, 4]
  const float* xs16;    // [MG, NS, 16]
  const int32_t* tc16;  // [MG, NS, 16]: (o - c) * sum(xq)
  const float* gs16;    // [MG, G, 16]: exact group sums
  int64_t MG;           // token groups
  const float* bias;
  void* y;
  pk::DType ydt;
};

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Tile pair p -> the panel of u' codes, usum[r][sb] = sum of u' over sblock sb. The panel keeps the
// packed tile order, only unpacked: per 32-code block 256 bytes, tile h at 128 h: nibbles as two lines
// (low nibbles: row r's codes 0..15 at 16 r; high nibbles: codes 16..31 at 64 + 16 r), bytes as they
// are (row r at 32 r) minus 128. Two 64-byte stores per line (a row-major panel cost 8 extracts).
constexpr int PANEL_BLOCK = 256;

template <int LB>
PK_TARGET_AVX512 inline int64_t panel_off(int R, int cc) {  // row R of the pair, 4-code chunk cc of a block
  const int h = R / 4, r = R % 4;
  return LB == 4 ? h * 128 + (cc / 4) * 64 + r * 16 + (cc % 4) * 4 : h * 128 + r * 32 + cc * 4;
}

template <int LB>
PK_TARGET_AVX512 void decode_panel(const GemmArgs16& a, int64_t p, uint8_t* panel, int32_t* usum) {
  const WoShape& s = a.s;
  const Vnni& v = a.v;
  const __m512i zero = _mm512_setzero_si512();
  alignas(64) int64_t q0[8], q1[8];
  for (int h = 0; h < 2; ++h) {
    const int64_t t = 2 * p + h;
    const uint8_t* wt = a.w + t * s.tile_bytes();
    const bool present = t * RT < s.N;  // the second tile of the last pair may not exist: codes 0
    for (int64_t sb = 0; sb < v.NS; ++sb) {
      __m512i s0 = zero, s1 = zero;  // vpsadbw sums, 64-bit lanes
      const int64_t b0 = sb * v.d, b1 = std::min(s.B, (sb + 1) * v.d);
      for (int64_t b = b0; b < b1; ++b) {
        uint8_t* d = panel + b * PANEL_BLOCK + h * 128;
        if constexpr (LB == 4) {  // 128-bit lane r = row r
          PK_PREFETCH_R(wt + (b + 64) * 64);  // 4 KB ahead: here each tile is read whole, in order
          const __m512i raw = present ? _mm512_loadu_si512(wt + b * 64) : zero;
          const __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi8(0x0f));
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0f));
          s0 = _mm512_add_epi64(s0, _mm512_add_epi64(_mm512_sad_epu8(lo, zero), _mm512_sad_epu8(hi, zero)));
          _mm512_storeu_si512(d, lo);
          _mm512_storeu_si512(d + 64, hi);
        } else {  // two lines: rows (0, 1) then (2, 3), 32 codes each; u' = u - 128
          const __m512i flip = _mm512_set1_epi8((char)0x80);
          PK_PREFETCH_R(wt + (b + 32) * 128);
          PK_PREFETCH_R(wt + (b + 32) * 128 + 64);
          const __m512i r01 = present ? _mm512_loadu_si512(wt + b * 128) : zero;
          const __m512i r23 = present ? _mm512_loadu_si512(wt + b * 128 + 64) : zero;
          s0 = _mm512_add_epi64(s0, _mm512_sad_epu8(r01, zero));
          s1 = _mm512_add_epi64(s1, _mm512_sad_epu8(r23, zero));
          _mm512_storeu_si512(d, _mm512_xor_si512(r01, flip));
          _mm512_storeu_si512(d + 64, _mm512_xor_si512(r23, flip));
        }
      }
      _mm512_store_si512(q0, s0);
      _mm512_store_si512(q1, s1);
      int32_t* us = usum + (int64_t)(4 * h) * v.NS + sb;
      if constexpr (LB == 4) {
        for (int r = 0; r < 4; ++r) us[r * v.NS] = (int32_t)(q0[2 * r] + q0[2 * r + 1]);
      } else {
        const int64_t len = 128 * (b1 - b0) * KB;
        us[0] = (int32_t)(q0[0] + q0[1] + q0[2] + q0[3] - len);
        us[v.NS] = (int32_t)(q0[4] + q0[5] + q0[6] + q0[7] - len);
        us[2 * v.NS] = (int32_t)(q1[0] + q1[1] + q1[2] + q1[3] - len);
        us[3 * v.NS] = (int32_t)(q1[4] + q1[5] + q1[6] + q1[7] - len);
      }
    }
  }
}

// The inner loop of gemm_pair_avx512 over blocks [b0, b1): 16 accumulators in named registers (GCC
// copies and spills an array of them around every vpdpbusd), one broadcast weight dword shared by the
// two products; the 8 chunks of a block unrolled so every panel offset is a constant.
template <int LB>
PK_TARGET_AVX512 inline void panel_dot(const uint8_t* panel, const uint8_t* xh, const uint8_t* xl, int64_t b0,
                                       int64_t b1, __m512i* ah, __m512i* al) {
  __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, h4 = h0, h5 = h0, h6 = h0, h7 = h0;
  __m512i l0 = h0, l1 = h0, l2 = h0, l3 = h0, l4 = h0, l5 = h0, l6 = h0, l7 = h0;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* pb = panel + b * PANEL_BLOCK;
#pragma GCC unroll 8
    for (int cc = 0; cc < 8; ++cc) {
      const int64_t c = b * 8 + cc;
      const __m512i h = _mm512_loadu_si512(xh + c * 64), l = _mm512_loadu_si512(xl + c * 64);
#define PK_PANEL_ROW(r)                                                            \
  {                                                                                \
    const __m512i wv = _mm512_set1_epi32(load_u32(pb + panel_off<LB>(r, cc)));    \
    h##r = dpbusd(h##r, h, wv);                                                    \
    l##r = dpbusd(l##r, l, wv);                                                    \
  }
      PK_PANEL_ROW(0) PK_PANEL_ROW(1) PK_PANEL_ROW(2) PK_PANEL_ROW(3)
      PK_PANEL_ROW(4) PK_PANEL_ROW(5) PK_PANEL_ROW(6) PK_PANEL_ROW(7)
#undef PK_PANEL_ROW
    }
  }
  ah[0] = h0; ah[1] = h1; ah[2] = h2; ah[3] = h3; ah[4] = h4; ah[5] = h5; ah[6] = h6; ah[7] = h7;
  al[0] = l0; al[1] = l1; al[2] = l2; al[3] = l3; al[4] = l4; al[5] = l5; al[6] = l6; al[7] = l7;
}

template <int LB>
PK_TARGET_AVX512 void gemm_pair_avx512(const GemmArgs16& a, int64_t p, int64_t mg0, int64_t mg1, uint8_t* panel,
                                       int32_t* usum) {
  const WoShape& s = a.s;
  const Vnni& v = a.v;
  decode_panel<LB>(a, p, panel, usum);
  const int64_t n0 = p * PR;
  const int rows = (int)std::min<int64_t>(PR, s.N - n0);
  const int64_t chunks = s.Kp / 4;
  for (int64_t mg = mg0; mg < mg1; ++mg) {
    const uint8_t* xh = a.xh16 + mg * chunks * 64;
    const uint8_t* xl = a.xl16 + mg * chunks * 64;
    __m512 tot[PR];
    for (int r = 0; r < PR; ++r) tot[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < v.NS; ++sb) {
      __m512i ah[PR], al[PR];
      panel_dot<LB>(panel, xh, xl, sb * v.d, std::min(s.B, (sb + 1) * v.d), ah, al);
      const __m512i tc = _mm512_loadu_si512(a.tc16 + (mg * v.NS + sb) * TG);
      const __m512 xs = _mm512_loadu_ps(a.xs16 + (mg * v.NS + sb) * TG);
      const int64_t g = s.G > 1 ? sb : 0;
      for (int r = 0; r < PR; ++r) {
        const __m512i I = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(ah[r], 8), al[r]),
                                           _mm512_sub_epi32(tc, _mm512_set1_epi32(32768 * usum[r * v.NS + sb])));
        const float wsc = r < rows ? a.scales[(n0 + r) * s.G + g] : 0.f;
        // (I * xs) * ws: the scales' product alone underflows for tiny weights (as in the GEMV above)
        tot[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(I), xs), _mm512_set1_ps(wsc), tot[r]);
      }
    }
    // offset term and output: per row, a vector over the 16 tokens
    const float* gs = a.gs16 + mg * s.G * TG;
    const int64_t m0 = mg * TG;
    const int toks = (int)std::min<int64_t>(TG, a.s.M - m0);
    for (int r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      __m512 off = _mm512_setzero_ps();
      for (int64_t gg = 0; gg < s.G; ++gg) {
        const float mc = a.offsets[n * s.G + gg] + (float)s.center * a.scales[n * s.G + gg];
        off = _mm512_fmadd_ps(_mm512_set1_ps(mc), _mm512_loadu_ps(gs + gg * TG), off);
      }
      alignas(64) float o1[TG], o2[TG];
      _mm512_store_ps(o1, tot[r]);
      _mm512_store_ps(o2, off);
      const double bb = a.bias ? a.bias[n] : 0.0;
      for (int t = 0; t < toks; ++t) store_elem(a.y, a.ydt, (m0 + t) * s.N + n, (float)((double)o1[t] + o2[t] + bb));
    }
  }
}
#pragma GCC diagnostic pop
#endif

// At most one thread per ~2^16 elements (plus one) for the per-element passes (activation quantizing,
// regrouping, dequantizing): a small GEMV (64x64: 4096) costs less than waking and joining a second pool
// thread, which measured slower on 2 threads than on 1.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 16;
inline int threads_for_work(int num_threads, int64_t work) {
  return (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, work / kMinWorkPerThread + 1));
}

// The GEMM loops themselves: a thread per 2^20 multiply-adds (~10-25 us of kernel time), none added
// below that. Every parallel region ends at the OpenMP team's barrier, which waits for a worker the OS
// has not run yet (2 busy cores, other processes beside ours: 1-8 ms), and for a few us of work a second
// thread saves less than its wake-up and join. 2^16 + 1 gave 256 x 256 at M=1 (65536 multiply-adds, ~4 us)
// two threads. Measured (raw kernel, same process, 2-core Zen 4 shared with other jobs; min / median us,
// 1 thread vs 2): M=4 K=N=128 6.2/6.5 vs 24/7981; M=1 K=N=1024 24/55 vs 51/174; M=4 K=N=512 30/82 vs
// 38/232; M=16 K=N=256 22/42 vs 18/72; from 4M two threads pay: M=4 K=N=1024 89/192 vs 51/696, M=64
// K=N=1024 949/1062 vs 500/1315. Bit-serial (parallel_ranges, a static split: it waited for the late
// worker) at M=1 K=N=256 W2A2: 7.4/7.9 vs 3736/10364.
constexpr int64_t kMinMacsPerThread = int64_t(1) << 20;
inline int threads_for_macs(int num_threads, int64_t macs) {
  return (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, macs / kMinMacsPerThread));
}

#if PK_X86
// M >= gemm_min_m on AVX-512: activations regrouped 16 tokens to a vector, then one panel per tile pair.
void wo_gemm_panel512(const WoShape& s, const Vnni& v, const Act16& A, const uint8_t* w, const float* scales,
                      const float* offsets, const float* bias, void* y, pk::DType ydt, int num_threads,
                      int64_t m_block) {
  const int64_t M = s.M, MG = (M + TG - 1) / TG, chunks = s.Kp / 4;
  std::vector<uint8_t> xh16(MG * chunks * 64, 0x80), xl16(MG * chunks * 64, 0);
  std::vector<float> xs16(MG * v.NS * TG, 0.f), gs16(std::max<int64_t>(1, MG * s.G * TG), 0.f);
  std::vector<int32_t> tc16(MG * v.NS * TG, 0);
  const int32_t oc = (s.lbits == 8 ? 128 : 0) - s.center;
  pk::parallel_ranges(M, threads_for_work(num_threads, M * s.K), [&](int, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t mg = m / TG, t = m % TG;
      uint8_t* dh = &xh16[mg * chunks * 64 + 4 * t];
      uint8_t* dl = &xl16[mg * chunks * 64 + 4 * t];
      const int8_t* sh = &A.xh[m * s.Kp];
      const uint8_t* sl = &A.xl[m * s.Kp];
      for (int64_t c = 0; c < chunks; ++c) {
        uint32_t hv, lv;
        std::memcpy(&hv, sh + 4 * c, 4);
        std::memcpy(&lv, sl + 4 * c, 4);
        hv ^= 0x80808080u;  // xh + 128 as unsigned bytes
        std::memcpy(dh + c * 64, &hv, 4);
        std::memcpy(dl + c * 64, &lv, 4);
      }
      for (int64_t sb = 0; sb < v.NS; ++sb) {
        xs16[(mg * v.NS + sb) * TG + t] = A.xs[m * v.NS4 + sb];
        tc16[(mg * v.NS + sb) * TG + t] = (int32_t)((int64_t)oc * A.sumq[m * v.NS4 + sb]);
      }
      for (int64_t g = 0; g < s.G; ++g) gs16[(mg * s.G + g) * TG + t] = A.gsum[m * s.G + g];
    }
  });
  GemmArgs16 a{};
  a.s = s; a.v = v; a.w = w; a.scales = scales; a.offsets = offsets;
  a.xh16 = xh16.data(); a.xl16 = xl16.data(); a.xs16 = xs16.data(); a.tc16 = tc16.data(); a.gs16 = gs16.data();
  a.MG = MG; a.bias = bias; a.y = y; a.ydt = ydt;
  const int64_t T = (s.N + RT - 1) / RT, P = (T + 1) / 2;
  auto fn = s.lbits == 4 ? gemm_pair_avx512<4> : gemm_pair_avx512<8>;
  // m_block tokens per pass over the weights (each pass decodes every panel again; measured: one pass
  // for all 128 tokens beats 8 passes of 16, though 128 tokens' activations, 1 MB, outgrow L2).
  const int64_t gb = std::max<int64_t>(1, m_block / TG);
  for (int64_t mg0 = 0; mg0 < MG; mg0 += gb) {
    const int64_t mg1 = std::min(MG, mg0 + gb);
    pk::parallel_ranges(P, threads_for_macs(num_threads, M * s.N * s.K), [&](int, int64_t p0, int64_t p1) {
      std::vector<uint8_t> panel(s.B * PANEL_BLOCK);
      std::vector<int32_t> usum(PR * v.NS);
      for (int64_t p = p0; p < p1; ++p) fn(a, p, mg0, mg1, panel.data(), usum.data());
    });
  }
}
#endif

// Splits the N tiles into `nthreads` contiguous ranges. `m_block` tokens run per pass over a tile range
// so that a block of activations stays in cache while the weights stream (the GEMM tiling for M > 1).
// isa: 0 portable, 1 AVX2, 2 AVX-512 VNNI (each capped by what the CPU has and the PYKERNELS_DISABLE_*
// flags; the AVX-512 kernel also needs groups of <= 2048 codes, <= 256 for the byte layout).
// check_rows: first count the rows the int16 activations cannot carry (act_range_flags); if there are
// any, return that count with y untouched (the caller routes those rows), else compute y and return 0.
// One native call for the common case instead of two plus a flags tensor (~15 us of a ~0.5 ms GEMV when
// the GEMV has just pushed the interpreter's data out of the caches).
int64_t wo_gemm(uintptr_t x, int x_dtype, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int y_dtype,
                int num_threads, int64_t m_block, int64_t n_block, int isa, int64_t gemm_min_m, bool check_rows) {
  const char* op = "qmatmul";
  const WoShape s = wo_shape(op, M, N, K, bits, group_size);
  const pk::DType xdt = float_dtype(x_dtype, op, "x"), ydt = float_dtype(y_dtype, op, "out");
  if (M == 0 || N == 0) return 0;
  if (check_rows) {
    py::gil_scoped_release release;
    const int64_t flagged = flag_rows(x, xdt, M, K, nullptr, num_threads);
    if (flagged) return flagged;
  }
  const int64_t T = (N + RT - 1) / RT;
  m_block = std::max<int64_t>(1, m_block);
  n_block = std::max<int64_t>(1, n_block);  // tiles per chunk handed to a thread
  const int64_t chunks = (T + n_block - 1) / n_block;
  const void* xp = reinterpret_cast<const void*>(x);
  const int esize = ydt == pk::DType::Float32 ? 4 : 2;
#if PK_X86
  Vnni v{};
  if (isa >= 2 && pk::cpu_has_avx512() && vnni_geometry(s, &v)) {
    Act16 A;
    A.xh.resize(M * s.Kp); A.xl.resize(M * s.Kp);
    A.xs.resize(M * v.NS4); A.corr.resize(M * v.NS4); A.sumq.resize(M * v.NS4);
    A.gsum.resize(std::max<int64_t>(M * s.G, 1));
    py::gil_scoped_release release;
    pk::parallel_ranges(M, threads_for_work(num_threads, M * K), [&](int, int64_t m0, int64_t m1) {
      std::vector<float> xr(s.Kp);
      for (int64_t m = m0; m < m1; ++m)
        quantize_act16(xp, xdt, m, s, v, xr.data(), &A.xh[m * s.Kp], &A.xl[m * s.Kp], &A.xs[m * v.NS4],
                       &A.corr[m * v.NS4], &A.sumq[m * v.NS4], &A.gsum[m * s.G]);
    });
    if (M >= std::max<int64_t>(2, gemm_min_m)) {
      wo_gemm_panel512(s, v, A, reinterpret_cast<const uint8_t*>(w), reinterpret_cast<const float*>(scales),
                       reinterpret_cast<const float*>(offsets), bias ? reinterpret_cast<const float*>(bias) : nullptr,
                       reinterpret_cast<void*>(y), ydt, num_threads, m_block);
      return 0;
    }
    void (*tile_fn)(const WoArgs16&, int64_t) = s.lbits == 4 ? wo_tiles_avx512<4, 1> : wo_tiles_avx512<8, 1>;
    void (*pair_fn)(const WoArgs16&, int64_t) = s.lbits == 4 ? wo_tiles_avx512<4, 2> : wo_tiles_avx512<8, 2>;
    for (int64_t mb = 0; mb < M; mb += m_block) {
      WoArgs16 a{};
      a.s = s;
      a.s.M = std::min(m_block, M - mb);
      a.v = v;
      a.w = reinterpret_cast<const uint8_t*>(w);
      a.scales = reinterpret_cast<const float*>(scales);
      a.offsets = reinterpret_cast<const float*>(offsets);
      a.xh = A.xh.data() + mb * s.Kp;
      a.xl = A.xl.data() + mb * s.Kp;
      a.xs = A.xs.data() + mb * v.NS4;
      a.corr = A.corr.data() + mb * v.NS4;
      a.gsum = A.gsum.data() + mb * s.G;
      a.bias = bias ? reinterpret_cast<const float*>(bias) : nullptr;
      a.ydt = ydt;
      a.y = reinterpret_cast<char*>(y) + mb * N * esize;
      pk::parallel_chunks(chunks, threads_for_macs(num_threads, a.s.M * N * K), 1, [&](int, int64_t c0, int64_t c1) {
        const int64_t t1 = std::min(T, c1 * n_block);
        int64_t t = c0 * n_block;
        for (; t + 2 <= t1; t += 2) pair_fn(a, t);
        if (t < t1) tile_fn(a, t);
      });
    }
    return 0;
  }
#endif
  std::vector<int16_t> xq(M * s.Kp);
  std::vector<float> xs(M * s.B), xsum(std::max<int64_t>(M * s.G, 1));
  py::gil_scoped_release release;
  pk::parallel_ranges(M, threads_for_work(num_threads, M * K), [&](int, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_act_int16(xp, xdt, m, s, &xq[m * s.Kp], &xs[m * s.B], &xsum[m * s.G]);
  });
  void (*tile_fn)(const WoArgs&, int64_t) = wo_tile_portable;
  void (*panel_fn)(const WoArgs&, int64_t) = wo_tile_portable;
#if PK_X86
  if (isa >= 1 && pk::cpu_has_avx2()) {
    tile_fn = s.lbits == 4 ? wo_tile_avx2<4> : wo_tile_avx2<8>;
    panel_fn = s.lbits == 4 ? wo_tile_avx2_panel<4> : wo_tile_avx2_panel<8>;
  }
#endif
  for (int64_t mb = 0; mb < M; mb += m_block) {
    WoArgs a{};
    a.s = s;
    a.s.M = std::min(m_block, M - mb);
    // from two tokens a pass, the codes decoded once for all of them (wo_tile_avx2_panel)
    void (*fn)(const WoArgs&, int64_t) = a.s.M >= 2 ? panel_fn : tile_fn;
    a.w = reinterpret_cast<const uint8_t*>(w);
    a.scales = reinterpret_cast<const float*>(scales);
    a.offsets = reinterpret_cast<const float*>(offsets);
    a.xq = xq.data() + mb * s.Kp;
    a.xs = xs.data() + mb * s.B;
    a.xsum = xsum.data() + mb * s.G;
    a.bias = bias ? reinterpret_cast<const float*>(bias) : nullptr;
    a.ydt = ydt;
    a.y = reinterpret_cast<char*>(y) + mb * N * esize;
    pk::parallel_chunks(chunks, threads_for_macs(num_threads, a.s.M * N * K), 1, [&](int, int64_t c0, int64_t c1) {
      for (int64_t t = c0 * n_block; t < std::min(T, c1 * n_block); ++t) fn(a, t);
    });
  }
  return 0;
}

// Codes of a packed tile layout -> float weights [N, K] (dequantize on the CPU without torch ops).
#if PK_X86
// One row's 32 codes of a block (bw bytes: nibbles or bytes) -> o[0..32) = s * u + m (one fp32 FMA each).
PK_TARGET_AVX2 inline void dequant_block_avx2(const uint8_t* wb, int bw, float scale, float offset, float* o) {
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(offset);
  __m128i c0, c1;  // 32 codes as bytes, in k order
  if (bw == 16) {
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m128i v = _mm_loadu_si128((const __m128i*)wb);
    c0 = _mm_and_si128(v, low);
    c1 = _mm_and_si128(_mm_srli_epi16(v, 4), low);
  } else {
    c0 = _mm_loadu_si128((const __m128i*)wb);
    c1 = _mm_loadu_si128((const __m128i*)(wb + 16));
  }
  _mm256_storeu_ps(o + 0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c0)), s, m));
  _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c0, 8))), s, m));
  _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c1)), s, m));
  _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c1, 8))), s, m));
}

// One row of a tile layout -> fp32 (vectorized widening + FMA), then optionally fp32 -> bf16 (RNE).
PK_TARGET_AVX2 void dequant_row_avx2(const uint8_t* wt, int64_t r, int64_t B, int bw, const float* sc,
                                     const float* of, int64_t G, int64_t gsize, float* row) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = std::min<int64_t>(G - 1, b * KB / gsize);
    dequant_block_avx2(wt + (b * RT + r) * bw, bw, sc[g], of[g], row + b * KB);
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
        // one rounding (fma), as the AVX2 path and QuantizedWeight.dequantize(): with two, a zero point's
        // weight came out exactly 0 and an inf activation gave NaN instead of torch's inf (audit finding)
        if (bw == 16) {
          for (int j = 0; j < 16; ++j) {
            o[j] = std::fma((float)(wb[j] & 0x0f), s, m);
            o[j + 16] = std::fma((float)(wb[j] >> 4), s, m);
          }
        } else {
          for (int j = 0; j < 32; ++j) o[j] = std::fma((float)wb[j], s, m);
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
// Weight-only GEMM through fp32 FMAs for compute-bound M (impl "sgemm"): y[M,N] = x @ dequant(W)^T.
// A blocked GEMM after Goto & van de Geijn ("Anatomy of high-performance matrix multiplication", TOMS
// 2008) and BLIS (Van Zee & van de Geijn, TOMS 2015):
//   - x is packed once per chunk of rows into slivers of SG_MR rows (k-major: MR floats per k,
//     converted to fp32, zero-padded past M and K), each KC block of a sliver contiguous;
//   - the weights are dequantized straight into the packed B panel (KC x NC: NR floats per k), the copy a
//     GEMM makes anyway, so dequantization costs no pass over memory of its own (the "dequant_mm" route
//     writes the fp32 weights out and torch's GEMM reads them back);
//   - a 6x16 micro-kernel (sg_kernel) keeps its C tile in 12 ymm accumulators: per k 2 loads of B, 6 broadcasts of
//     x and 12 FMAs (the shape of BLIS's Haswell/Zen sgemm kernel), the B sliver (KC x 16) in L1 and the
//     x block (MC x KC) in L2.
// Each weight is the same fp32 FMA of dequant_row_avx2 (s * u + m), so only the order of the fp32 sums
// differs from dequant_mm. Threads split N by slivers of 16 columns, never K (no reduction).
// Why: torch's fp32 GEMM (MKL) ran at ~100 GFLOP/s of the 200 two Zen 2 cores can do (measured with an
// FMA loop), so at M=128 dequantize + torch lost to torch's dense matmul (0.92x).
// ---------------------------------------------------------------------------------------------
constexpr int SG_MR = 6, SG_NR = 16;
constexpr int64_t SG_M_CHUNK = 768;  // rows of x packed at a time (12 MiB at K=4096), a multiple of SG_MR

// A float buffer on 64-byte boundaries (the micro-kernel's aligned loads of B; whole cache lines).
struct AlignedFloats {
  float* p;
  explicit AlignedFloats(size_t n) : p(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64))) {
    if (!p) throw pk::AllocError((n * sizeof(float) + 63) / 64 * 64, "qmatmul packing scratch");
  }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  ~AlignedFloats() { std::free(p); }
  float* data() { return p; }
};

#if PK_X86
// The 4 rows x 16 codes (one byte each) of in[] k-major: out[q] holds k = 4q .. 4q + 3, each as the 4 rows'
// bytes (two byte and two word interleaves).
PK_TARGET_AVX2 static inline void codes_4x16_k_major(const __m128i* in, __m128i* out) {
  const __m128i r01lo = _mm_unpacklo_epi8(in[0], in[1]), r01hi = _mm_unpackhi_epi8(in[0], in[1]);
  const __m128i r23lo = _mm_unpacklo_epi8(in[2], in[3]), r23hi = _mm_unpackhi_epi8(in[2], in[3]);
  out[0] = _mm_unpacklo_epi16(r01lo, r23lo);
  out[1] = _mm_unpackhi_epi16(r01lo, r23lo);
  out[2] = _mm_unpacklo_epi16(r01hi, r23hi);
  out[3] = _mm_unpackhi_epi16(r01hi, r23hi);
}

// Rows [n0, n0 + 16) of W (rows >= N read as zeros), k in [k0, k0 + kc) (whole 32-blocks), dequantized
// into dst[kc][16]. The codes are put in k order while still bytes: per tile (4 rows) a 4 x 16 byte
// interleave, then two tiles' words per k side by side (8 rows), widened, and s * u + m with the 8 rows'
// scale and offset vectors (one fp32 FMA per weight, as dequant_row_avx2). Transposing the dequantized fp32
// rows instead (8 x 8 transposes) took ~1.6 ms of a 4.5 ms M=16 GEMM at K=N=4096.
PK_TARGET_AVX2 static void sg_pack_b_sliver(const WoShape& s, const uint8_t* w, const float* sc, const float* of,
                                            int64_t n0, int64_t k0, int64_t kc, float* __restrict dst) {
  const int bw = s.lbits == 4 ? 16 : 32;
  const int64_t valid = std::min<int64_t>(SG_NR, s.N - n0), tiles = (s.N + RT - 1) / RT;
  const __m128i low = _mm_set1_epi8(0x0f);
  alignas(32) float sv[SG_NR], mv[SG_NR];
  int64_t g_in = -1;  // the group whose scales sv / mv hold
  for (int64_t b = k0 / KB; b < (k0 + kc) / KB; ++b) {
    const int64_t g = std::min<int64_t>(s.G - 1, b * KB / s.gsize);
    if (g != g_in) {
      for (int i = 0; i < SG_NR; ++i) {
        sv[i] = i < valid ? sc[(n0 + i) * s.G + g] : 0.f;  // (rows past N: 0 * u + 0)
        mv[i] = i < valid ? of[(n0 + i) * s.G + g] : 0.f;
      }
      g_in = g;
    }
    __m128i kq[4][8];  // [tile of the sliver][q]: k = 4q .. 4q + 3 of the block, the tile's 4 rows each
    for (int tl = 0; tl < SG_NR / RT; ++tl) {
      const int64_t t = n0 / RT + tl;
      if (t >= tiles) {
        for (int q = 0; q < 8; ++q) kq[tl][q] = _mm_setzero_si128();
        continue;
      }
      const uint8_t* wb = w + t * s.tile_bytes() + b * RT * bw;
      __m128i lo[RT], hi[RT];  // row r's codes of k 0..15 and 16..31
      for (int r = 0; r < RT; ++r) {
        if (bw == 16) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + r * 16));
          lo[r] = _mm_and_si128(v, low);
          hi[r] = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        } else {
          lo[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + r * 32));
          hi[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + r * 32 + 16));
        }
      }
      codes_4x16_k_major(lo, kq[tl]);
      codes_4x16_k_major(hi, kq[tl] + 4);
    }
    float* d = dst + (b * KB - k0) * SG_NR;
    for (int h = 0; h < 2; ++h) {  // sliver rows 8h .. 8h + 7: tiles 2h and 2h + 1
      const __m256 sh = _mm256_load_ps(sv + 8 * h), mh = _mm256_load_ps(mv + 8 * h);
      for (int q = 0; q < 8; ++q) {
        const __m128i k01 = _mm_unpacklo_epi32(kq[2 * h][q], kq[2 * h + 1][q]);  // k = 4q, 4q + 1: 8 rows each
        const __m128i k23 = _mm_unpackhi_epi32(kq[2 * h][q], kq[2 * h + 1][q]);
        const __m128i parts[4] = {k01, _mm_srli_si128(k01, 8), k23, _mm_srli_si128(k23, 8)};
        for (int j = 0; j < 4; ++j)
          _mm256_store_ps(d + (4 * q + j) * SG_NR + 8 * h,
                          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), sh, mh));
      }
    }
  }
}

// C[R x cols] (+)= A sliver (kc x 6, its first R rows) * B sliver (kc x 16) (+ bias on the last K block).
// first: C is written, not added to. R < 6 for the last sliver of x only: its padding rows cost no FMAs
// (M=16 is 6 + 6 + 4 rows, not 18). (The row loops unrolled: GCC keeps the 2R accumulators in registers.)
template <int R>
PK_TARGET_AVX2 static void sg_kernel(int64_t kc, const float* __restrict a, const float* __restrict b, float* c,
                                     int64_t ldc, bool first, const float* bias, int cols) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
    a += SG_MR;
    b += SG_NR;
  }
  if (cols == SG_NR) {
    const __m256 bias0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      float* ci = c + i * ldc;
      __m256 v0 = acc[i][0], v1 = acc[i][1];
      if (!first) {
        v0 = _mm256_add_ps(_mm256_loadu_ps(ci), v0);
        v1 = _mm256_add_ps(_mm256_loadu_ps(ci + 8), v1);
      }
      if (bias) {
        v0 = _mm256_add_ps(v0, bias0);
        v1 = _mm256_add_ps(v1, bias1);
      }
      _mm256_storeu_ps(ci, v0);
      _mm256_storeu_ps(ci + 8, v1);
    }
    return;
  }
  alignas(32) float tile[R][SG_NR];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(tile[i], acc[i][0]);
    _mm256_store_ps(tile[i] + 8, acc[i][1]);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < cols; ++j) {
      float v = first ? tile[i][j] : c[i * ldc + j] + tile[i][j];
      if (bias) v += bias[j];
      c[i * ldc + j] = v;
    }
}

// sg_kernel for the sliver's rows (1..6)
PK_TARGET_AVX2 static void sg_kernel_rows(int rows, int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                                          bool first, const float* bias, int cols) {
  switch (rows) {
    case 6: sg_kernel<6>(kc, a, b, c, ldc, first, bias, cols); break;
    case 5: sg_kernel<5>(kc, a, b, c, ldc, first, bias, cols); break;
    case 4: sg_kernel<4>(kc, a, b, c, ldc, first, bias, cols); break;
    case 3: sg_kernel<3>(kc, a, b, c, ldc, first, bias, cols); break;
    case 2: sg_kernel<2>(kc, a, b, c, ldc, first, bias, cols); break;
    default: sg_kernel<1>(kc, a, b, c, ldc, first, bias, cols); break;
  }
}

// Rows [m0, m0 + mp) of x (mp a multiple of SG_MR; rows >= M and k >= K zero) into ap: for each KC block
// pc of [0, Kp), its slivers of 6 rows one after another, each [kc][6].
template <class T, class Cvt>
static void sg_pack_a(const T* x, int64_t M, int64_t K, int64_t Kp, int64_t m0, int64_t mp, int64_t KC, Cvt cvt,
                      float* __restrict ap, int threads) {
  const int64_t slivers = mp / SG_MR, blocks = (Kp + KC - 1) / KC;
  pk::parallel_ranges(slivers * blocks, threads, [&](int, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t pc = (j / slivers) * KC, sl = j % slivers, kc = std::min(KC, Kp - pc);
      float* d = ap + pc * mp + sl * kc * SG_MR;
      for (int i = 0; i < SG_MR; ++i) {
        const int64_t m = m0 + sl * SG_MR + i;
        const int64_t kend = m < M ? std::min(kc, K - pc) : 0;  // k < kend are x's, the rest zeros
        const T* xr = x + m * K + pc;
        int64_t k = 0;
        for (; k < kend; ++k) d[k * SG_MR + i] = cvt(xr[k]);
        for (; k < kc; ++k) d[k * SG_MR + i] = 0.f;
      }
    }
  });
}
#endif

// y[M,N] (fp32) = x[M,K] @ dequant(W).T (+ bias): see above. kc: the K block (a multiple of 32), mc: the
// rows of x per L2 block (a multiple of 6), nc: the columns per packed B panel (a multiple of 16).
void wo_sgemm(uintptr_t x, int x_dtype, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
              uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int num_threads,
              int64_t kc_cfg, int64_t mc_cfg, int64_t nc_cfg) {
  const WoShape s = wo_shape("qmatmul", M, N, K, bits, group_size);
  const pk::DType xdt = float_dtype(x_dtype, "qmatmul", "x");
  if (kc_cfg <= 0 || kc_cfg % KB != 0) pk::fail_value("qmatmul", "sgemm kc must be a positive multiple of 32");
  if (mc_cfg <= 0 || mc_cfg % SG_MR != 0) pk::fail_value("qmatmul", "sgemm mc must be a positive multiple of 6");
  if (nc_cfg <= 0 || nc_cfg % SG_NR != 0) pk::fail_value("qmatmul", "sgemm nc must be a positive multiple of 16");
#if PK_X86
  if (!pk::cpu_has_avx2()) pk::fail_runtime("qmatmul", "the sgemm kernel needs AVX2 and FMA");
  float* yp = reinterpret_cast<float*>(y);
  const float* bp = reinterpret_cast<const float*>(bias);
  py::gil_scoped_release release;
  if (M == 0 || N == 0) return;
  if (K == 0) {  // no groups, no scales: y = bias (or zeros)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] = bp ? bp[n] : 0.f;
    return;
  }
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w);
  const float* sc = reinterpret_cast<const float*>(scales);
  const float* of = reinterpret_cast<const float*>(offsets);
  const int threads = threads_for_work(num_threads, M * N * K);
  const int64_t KC = kc_cfg, Kp = s.Kp;
  const int64_t chunk_rows = std::min<int64_t>(SG_M_CHUNK, (M + SG_MR - 1) / SG_MR * SG_MR);
  AlignedFloats ap((size_t)(chunk_rows * Kp));
  const int64_t slivers_n = (N + SG_NR - 1) / SG_NR;
  for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
    const int64_t mp = std::min(chunk_rows, (M - m0 + SG_MR - 1) / SG_MR * SG_MR);
    switch (xdt) {
      case pk::DType::Float32:
        sg_pack_a(reinterpret_cast<const float*>(x), M, K, Kp, m0, mp, KC, [](float v) { return v; }, ap.data(), threads);
        break;
      case pk::DType::BFloat16:
        sg_pack_a(reinterpret_cast<const uint16_t*>(x), M, K, Kp, m0, mp, KC, [](uint16_t v) { return bf16_to_f32(v); },
                  ap.data(), threads);
        break;
      default:
        sg_pack_a(reinterpret_cast<const uint16_t*>(x), M, K, Kp, m0, mp, KC, [](uint16_t v) { return f16_to_f32(v); },
                  ap.data(), threads);
        break;
    }
    const int64_t mrows = std::min(mp, M - m0);
    pk::parallel_ranges(slivers_n, threads, [&](int, int64_t s0, int64_t s1) {
      // (as large as this thread's columns and K need: a config's kc and nc may be far bigger)
      const int64_t panel_cols = std::min(nc_cfg, (s1 - s0) * SG_NR);
      AlignedFloats panel((size_t)(std::min(KC, Kp) * panel_cols));
      for (int64_t jc = s0 * SG_NR; jc < std::min(N, s1 * SG_NR); jc += panel_cols) {
        const int64_t nc = std::min(panel_cols, s1 * SG_NR - jc);
        for (int64_t pc = 0; pc < Kp; pc += KC) {
          const int64_t kc = std::min(KC, Kp - pc);
          const bool first = pc == 0, last = pc + kc == Kp;
          for (int64_t jr = 0; jr < nc && jc + jr < N; jr += SG_NR)
            sg_pack_b_sliver(s, wp, sc, of, jc + jr, pc, kc, panel.data() + jr * kc);
          for (int64_t ic = 0; ic < mp; ic += mc_cfg) {
            const int64_t ie = std::min(mp, ic + mc_cfg);
            for (int64_t jr = 0; jr < nc && jc + jr < N; jr += SG_NR) {
              const int cols = (int)std::min<int64_t>(SG_NR, N - jc - jr);
              const float* bsl = panel.data() + jr * kc;
              const float* bias_j = last && bp ? bp + jc + jr : nullptr;
              for (int64_t ir = ic; ir < ie && ir < mrows; ir += SG_MR) {
                const int rows = (int)std::min<int64_t>(SG_MR, mrows - ir);
                sg_kernel_rows(rows, kc, ap.data() + pc * mp + ir * kc, bsl, yp + (m0 + ir) * N + jc + jr, N, first,
                               bias_j, cols);
              }
            }
          }
        }
      }
    });
  }
#else
  (void)s; (void)xdt; (void)x; (void)w; (void)scales; (void)offsets; (void)bias; (void)y; (void)num_threads;
  pk::fail_runtime("qmatmul", "the sgemm kernel needs an x86-64 CPU with AVX2");
#endif
}

// ---------------------------------------------------------------------------------------------
// Bit-serial GEMM (bipolar-INT, arbitrary precision)
// ---------------------------------------------------------------------------------------------
struct BsShape {
  int64_t M, N, K, G, gsize, gw;
  int p, q;
};

// Word pairs per group plane (the AVX-512 kernel takes a group's words two at a time).
inline int64_t bs_pairs(const BsShape& s) { return (s.gw + 1) / 2; }

struct ActPlanes {
  std::vector<uint64_t> planes;  // [M, G, p, gw]
  std::vector<int32_t> usum;     // [M, G]
  std::vector<double> sa, ma;    // per token: A = sa * u_a + ma
  std::vector<uint8_t> bad;      // token had NaN/inf
  std::vector<uint8_t> codes;    // [M, K] (only for the integer check)
};

// One candidate's sums over a token (qgemm_act_fit.h), per instruction set. In four (portable) or
// eight lanes; the lanes' order of summation differs, so tiers may differ in the last bits of sa.
using ActEvalFn = pkq::ActStats (*)(const float* xr, int64_t K, double s, double m, double qmax, double mean);

pkq::ActStats act_eval_portable(const float* xr, int64_t K, double s, double m, double qmax, double mean) {
  pkq::ActStats a[4];
  const double inv = 1.0 / s;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4)
    for (int j = 0; j < 4; ++j) pkq::accumulate(a[j], xr[k + j], s, inv, m, qmax, mean);
  for (; k < K; ++k) pkq::accumulate(a[0], xr[k], s, inv, m, qmax, mean);
  a[0].add(a[1]);
  a[2].add(a[3]);
  a[0].add(a[2]);
  return a[0];
}

#if PK_X86
// The lanes' sums of one accumulator set, added into a (lane order: 0..n-1).
template <int N>
inline void add_lanes(pkq::ActStats& a, const double (&err)[N], const double (&su)[N], const double (&suu)[N],
                      const double (&sux)[N], const double (&dev)[N]) {
  for (int j = 0; j < N; ++j) {
    a.err += err[j]; a.su += su[j]; a.suu += suu[j]; a.sux += sux[j]; a.dev += dev[j];
  }
}

PK_TARGET_AVX2 pkq::ActStats act_eval_avx2(const float* xr, int64_t K, double s, double m, double qmax,
                                           double mean) {
  const double inv = 1.0 / s;
  const __m256d vs = _mm256_set1_pd(s), vinv = _mm256_set1_pd(inv), vm = _mm256_set1_pd(m),
                vq = _mm256_set1_pd(qmax), vmean = _mm256_set1_pd(mean), zero = _mm256_setzero_pd();
  __m256d err = zero, su = zero, suu = zero, sux = zero, dev = zero;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(xr + k));
    const __m256d q = _mm256_min_pd(_mm256_max_pd(_mm256_mul_pd(_mm256_sub_pd(x, vm), vinv), zero), vq);
    const __m256d u = _mm256_round_pd(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256d d = _mm256_sub_pd(_mm256_fmadd_pd(u, vs, vm), x), c = _mm256_sub_pd(x, vmean);
    err = _mm256_fmadd_pd(d, d, err);
    su = _mm256_add_pd(su, u);
    suu = _mm256_fmadd_pd(u, u, suu);
    sux = _mm256_fmadd_pd(u, c, sux);
    dev = _mm256_fmadd_pd(c, c, dev);
  }
  double e[4], a1[4], a2[4], a3[4], a4[4];
  _mm256_storeu_pd(e, err); _mm256_storeu_pd(a1, su); _mm256_storeu_pd(a2, suu);
  _mm256_storeu_pd(a3, sux); _mm256_storeu_pd(a4, dev);
  pkq::ActStats a;
  for (; k < K; ++k) pkq::accumulate(a, xr[k], s, inv, m, qmax, mean);
  add_lanes(a, e, a1, a2, a3, a4);
  return a;
}

#pragma GCC diagnostic push  // see the AVX-512 weight-only section
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PK_TARGET_AVX512 pkq::ActStats act_eval_avx512(const float* xr, int64_t K, double s, double m, double qmax,
                                               double mean) {
  const double inv = 1.0 / s;
  const __m512d vs = _mm512_set1_pd(s), vinv = _mm512_set1_pd(inv), vm = _mm512_set1_pd(m),
                vq = _mm512_set1_pd(qmax), vmean = _mm512_set1_pd(mean), zero = _mm512_setzero_pd();
  __m512d err = zero, su = zero, suu = zero, sux = zero, dev = zero;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(xr + k));
    const __m512d q = _mm512_min_pd(_mm512_max_pd(_mm512_mul_pd(_mm512_sub_pd(x, vm), vinv), zero), vq);
    const __m512d u = _mm512_roundscale_pd(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d d = _mm512_sub_pd(_mm512_fmadd_pd(u, vs, vm), x), c = _mm512_sub_pd(x, vmean);
    err = _mm512_fmadd_pd(d, d, err);
    su = _mm512_add_pd(su, u);
    suu = _mm512_fmadd_pd(u, u, suu);
    sux = _mm512_fmadd_pd(u, c, sux);
    dev = _mm512_fmadd_pd(c, c, dev);
  }
  double e[8], a1[8], a2[8], a3[8], a4[8];
  _mm512_storeu_pd(e, err); _mm512_storeu_pd(a1, su); _mm512_storeu_pd(a2, suu);
  _mm512_storeu_pd(a3, sux); _mm512_storeu_pd(a4, dev);
  pkq::ActStats a;
  for (; k < K; ++k) pkq::accumulate(a, xr[k], s, inv, m, qmax, mean);
  add_lanes(a, e, a1, a2, a3, a4);
  return a;
}
#pragma GCC diagnostic pop
#endif

// The fitted (sa, ma) of a finite token xr[0..K) with min lo, max hi and sum `sum` (qgemm_act_fit.h).
inline void fit_act(const float* xr, int64_t K, int p, float lo, float hi, double sum, ActEvalFn eval, double& sa,
                    double& ma) {
  pkq::ActFit f = pkq::act_fit_begin(p, K, lo, hi, sum);
  for (int stage = 0; stage < pkq::kActFitStages; ++stage) {
    double s, m;
    if (pkq::candidate(f, stage, s, m)) pkq::offer(f, stage, s, m, eval(xr, K, s, m, f.qmax(), f.mean));
  }
  sa = f.s;
  ma = f.m;
}

// Per-token p-bit quantization of the activations (the bipolar-INT scheme: A = (sa/2) A' + za with
// A' = 2 u_a - (2^p - 1), i.e. A = sa * u_a + ma; sa and ma fitted, fit_act), then bit-plane packing.
// xr: the calling thread's scratch of at least K + 16 floats (the token in fp32, for the fit's passes).
void quantize_act_planes(const void* x, pk::DType dt, int64_t m, const BsShape& s, ActPlanes& A, bool keep_codes,
                         ActEvalFn eval, float* xr) {
  const int64_t K = s.K;
  const int qmax = (1 << s.p) - 1;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  double sum = 0;
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    xr[k] = load_elem(x, dt, m * K + k);
    finite &= std::isfinite(xr[k]);
    lo = std::min(lo, xr[k]);
    hi = std::max(hi, xr[k]);
    sum += xr[k];
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
  double sa, ma;
  fit_act(xr, K, s.p, lo, hi, sum, eval, sa, ma);
  A.sa[m] = sa;
  A.ma[m] = ma;
  for (int64_t g = 0; g < s.G; ++g) {
    int32_t us = 0;
    const int64_t k0 = g * s.gsize, k1 = std::min(K, k0 + s.gsize);
    for (int64_t k = k0; k < k1; ++k) {
      // clamped before the conversion: a fitted grid clips the tails, so q of an outlier may be far out
      // of int range (clamping first gives the same code: the bounds are integers)
      double q = ((double)xr[k] - ma) / sa;
      q = q > 0 ? (q < qmax ? q : qmax) : 0.0;
      const int u = (int)std::nearbyint(q);
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

#if PK_X86
#pragma GCC diagnostic push  // see the AVX-512 weight-only section
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// AVX-512 VPOPCNTDQ: one zmm holds 2 words x 4 rows of a weight plane, ANDed with the 2 activation words
// each broadcast to its 4 lanes, popcounted per 64-bit lane (vpopcntq) and shifted by 2^(i+j).
// The activation side comes spread in advance (bs_spread_avx512: one zmm per group, plane and word pair,
// built once per token for all N / 4 tiles), so the loop is a load of each weight plane, then per plane
// pair and, popcount, shift and add. P, Q > 0: the plane counts as constants (the loops unroll and the
// shifts are immediates); 0: read from s. At group_size 128 (2 words) a group is one zmm per weight
// plane: building the spread inside the tile loop (a permute and a masked load per activation plane and
// group) took ~16 cycles per 64 bytes of weight planes, W2A2 slower than the W4 GEMV reading twice the bytes.
PK_TARGET_AVX512 void bs_spread_avx512(const uint64_t* ap0, const BsShape& s, uint64_t* out) {
  const __m512i spread = _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1);
  const int64_t np = bs_pairs(s);
  for (int64_t g = 0; g < s.G; ++g)
    for (int i = 0; i < s.p; ++i) {
      const uint64_t* a = ap0 + (g * s.p + i) * s.gw;
      for (int64_t w2 = 0; w2 < np; ++w2) {
        const bool pair = 2 * w2 + 1 < s.gw;  // an odd last word: the upper 4 lanes stay 0
        const __m512i v = _mm512_permutexvar_epi64(
            spread, _mm512_castsi128_si512(_mm_maskz_loadu_epi64(pair ? 3 : 1, a + 2 * w2)));
        _mm512_storeu_si512(out + ((g * s.p + i) * np + w2) * 8, v);
      }
    }
}

// One group's popcount total: lanes (word w of the pair, row r), summed over the group's word pairs.
// Always inlined (as a call per group it held 18% of W1A1's samples).
template <int P, int Q>
PK_TARGET_AVX512 __attribute__((always_inline)) inline __m512i bs_group_total(const uint64_t* aspread,
                                                                              const uint64_t* wp0,
                                                                              const BsShape& s, int64_t g) {
  constexpr int kMaxQ = 8;
  const int p = P > 0 ? P : s.p, q = Q > 0 ? Q : s.q;
  const int64_t np = bs_pairs(s);
  const uint64_t* wp = wp0 + g * q * s.gw * RT;
  const uint64_t* ag = aspread + g * p * np * 8;
  __m512i total = _mm512_setzero_si512();
  for (int64_t w2 = 0; w2 < np; ++w2) {
    const __mmask8 wm = 2 * w2 + 1 < s.gw ? 0xff : 0x0f;
    __m512i wv[kMaxQ];
#pragma GCC unroll 8
    for (int j = 0; j < q; ++j) wv[j] = _mm512_maskz_loadu_epi64(wm, wp + (j * s.gw + 2 * w2) * RT);
#pragma GCC unroll 8
    for (int i = 0; i < p; ++i) {
      const __m512i a = _mm512_loadu_si512(ag + (i * np + w2) * 8);
#pragma GCC unroll 8
      for (int j = 0; j < q; ++j) {
        const __m512i c = _mm512_popcnt_epi64(_mm512_and_si512(a, wv[j]));
        total = _mm512_add_epi64(total, (P > 0 && Q > 0) ? _mm512_slli_epi64(c, i + j)
                                                         : _mm512_sll_epi64(c, _mm_cvtsi32_si128(i + j)));
      }
    }
  }
  return total;
}

// Per-group integer sums of one token and one tile, row-major [RT][G] (not [G][RT] like the other
// kernels: bs_combine_avx512 then reads each row's groups contiguously). Four groups at a time go
// through registers: their word halves added and transposed to (row, 4 groups) with two permutes, one
// 256-bit store per row, instead of a store and four scalar moves per group (half the instructions of
// the epilogue; the time it saved on its own was within this machine's noise).
template <int P, int Q>
PK_TARGET_AVX512 void bs_groups_avx512_pq(const uint64_t* aspread, const uint64_t* wp0, const BsShape& s,
                                          int64_t* out0) {
  const __m512i rows01 = _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13);
  const __m512i rows23 = _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15);
  int64_t g = 0;
  for (; g + 4 <= s.G; g += 4) {
    const __m512i t0 = bs_group_total<P, Q>(aspread, wp0, s, g), t1 = bs_group_total<P, Q>(aspread, wp0, s, g + 1);
    const __m512i t2 = bs_group_total<P, Q>(aspread, wp0, s, g + 2), t3 = bs_group_total<P, Q>(aspread, wp0, s, g + 3);
    // (group, row) lanes: the two words of each group added
    const __m512i s01 = _mm512_add_epi64(_mm512_shuffle_i64x2(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_i64x2(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i s23 = _mm512_add_epi64(_mm512_shuffle_i64x2(t2, t3, _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_i64x2(t2, t3, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i r01 = _mm512_permutex2var_epi64(s01, rows01, s23), r23 = _mm512_permutex2var_epi64(s01, rows23, s23);
    _mm256_storeu_si256((__m256i*)(out0 + 0 * s.G + g), _mm512_castsi512_si256(r01));
    _mm256_storeu_si256((__m256i*)(out0 + 1 * s.G + g), _mm512_extracti64x4_epi64(r01, 1));
    _mm256_storeu_si256((__m256i*)(out0 + 2 * s.G + g), _mm512_castsi512_si256(r23));
    _mm256_storeu_si256((__m256i*)(out0 + 3 * s.G + g), _mm512_extracti64x4_epi64(r23, 1));
  }
  for (; g < s.G; ++g) {
    const __m512i total = bs_group_total<P, Q>(aspread, wp0, s, g);
    const __m256i r4 = _mm256_add_epi64(_mm512_castsi512_si256(total), _mm512_extracti64x4_epi64(total, 1));
    alignas(32) int64_t o[RT];
    _mm256_store_si256((__m256i*)o, r4);
    for (int r = 0; r < RT; ++r) out0[r * s.G + g] = o[r];
  }
}

// The instance for (p, q): the plans in common use get their plane counts as constants.
inline void (*bs_groups_avx512_for(int p, int q))(const uint64_t*, const uint64_t*, const BsShape&, int64_t*) {
  if (p == 1 && q == 1) return bs_groups_avx512_pq<1, 1>;
  if (p == 2 && q == 2) return bs_groups_avx512_pq<2, 2>;
  if (p == 4 && q == 4) return bs_groups_avx512_pq<4, 4>;
  if (p <= 8 && q <= 8) return bs_groups_avx512_pq<0, 0>;
  return nullptr;
}

// sum_g sw[g] (sa I[g] + ma uw[g]) + mw[g] c1[g] for one row, 8 groups per step in fp64.
PK_TARGET_AVX512 double bs_combine_avx512(const float* sw, const float* mw, const int32_t* uw, const double* c1,
                                          const int64_t* I, int64_t G, double sa, double ma) {
  const __m512d vsa = _mm512_set1_pd(sa), vma = _mm512_set1_pd(ma);
  __m512d acc = _mm512_setzero_pd();
  for (int64_t g = 0; g < G; g += 8) {
    const __mmask8 m = G - g >= 8 ? (__mmask8)0xff : (__mmask8)((1u << (G - g)) - 1);
    const __m512d iv = _mm512_cvtepi64_pd(_mm512_maskz_loadu_epi64(m, I + g));
    const __m512d s8 = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, sw + g));
    const __m512d m8 = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, mw + g));
    const __m512d u8 = _mm512_cvtepi32_pd(_mm256_maskz_loadu_epi32(m, uw + g));
    const __m512d inner = _mm512_fmadd_pd(vsa, iv, _mm512_mul_pd(vma, u8));
    acc = _mm512_fmadd_pd(s8, inner, _mm512_fmadd_pd(m8, _mm512_maskz_loadu_pd(m, c1 + g), acc));
  }
  return _mm512_reduce_add_pd(acc);
}
#pragma GCC diagnostic pop
#endif

#if PK_X86
#pragma GCC diagnostic push  // see the AVX-512 weight-only section
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// quantize_act_planes 16 elements at a time (the same arithmetic: the double quotient (x - ma) / sa
// rounded half to even, so the codes of one (sa, ma) are bit-identical), each plane's 16 bits from one
// vptestmd; the fit's passes in 8 double lanes (act_eval_avx512). The
// scalar loop took ~20 us per 4096-element token, on one thread before the tiles' parallel loop: as long
// as the whole W2A2 4096 x 4096 GEMV's share of one thread. Groups of a multiple of 16 elements (or one
// group), so that a 16-element chunk never straddles two.
// 8 codes: round((x - ma) / sa) in double, clamped to [0, qmax] first (an outlier's quotient may be out
// of int32 range: the conversion would give INT_MIN), half to even (nearbyint's default mode), as
// 32-bit lanes.
PK_TARGET_AVX512 inline __m256i bs_codes8(__m256 h, __m512d dma, __m512d dsa, __m512d dq) {
  __m512d q = _mm512_div_pd(_mm512_sub_pd(_mm512_cvtps_pd(h), dma), dsa);
  q = _mm512_min_pd(_mm512_max_pd(q, _mm512_setzero_pd()), dq);
  return _mm512_cvtpd_epi32(_mm512_roundscale_pd(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

PK_TARGET_AVX512 void quantize_act_planes_avx512(const void* x, pk::DType dt, int64_t m, const BsShape& s,
                                                 ActPlanes& A, bool keep_codes, ActEvalFn eval, float* xr) {
  const int64_t K = s.K;
  const int qmax = (1 << s.p) - 1;
  uint64_t* pl = &A.planes[m * s.G * s.p * s.gw];
  std::fill(pl, pl + s.G * s.p * s.gw, 0ull);
  auto lanes = [&](int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
  };
  const float inf = std::numeric_limits<float>::infinity();
  __m512 vlo = _mm512_set1_ps(inf), vhi = _mm512_set1_ps(-inf);
  __m512d vsum0 = _mm512_setzero_pd(), vsum1 = _mm512_setzero_pd();
  __mmask16 bad = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = lanes(K - k);
    const __m512 v = load16_f32(x, dt, m * K + k, mk);  // zeros past K
    _mm512_storeu_ps(&xr[k], v);
    bad |= _mm512_mask_fpclass_ps_mask(mk, v, 0x99);  // QNaN | +inf | -inf | SNaN
    vlo = _mm512_mask_min_ps(vlo, mk, vlo, v);
    vhi = _mm512_mask_max_ps(vhi, mk, vhi, v);
    vsum0 = _mm512_add_pd(vsum0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    vsum1 = _mm512_add_pd(vsum1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  if (bad || K == 0) {
    A.bad[m] = bad != 0;
    A.sa[m] = 1.0;
    A.ma[m] = 0.0;
    for (int64_t g = 0; g < s.G; ++g) A.usum[m * s.G + g] = 0;
    return;
  }
  const float lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
  double sa, ma;
  fit_act(xr, K, s.p, lo, hi, _mm512_reduce_add_pd(_mm512_add_pd(vsum0, vsum1)), eval, sa, ma);
  A.sa[m] = sa;
  A.ma[m] = ma;
  const __m512d dma = _mm512_set1_pd(ma), dsa = _mm512_set1_pd(sa), dq = _mm512_set1_pd((double)qmax);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g = 0; g < s.G; ++g) {
    const int64_t k0 = g * s.gsize, k1 = std::min(K, k0 + s.gsize);
    __m512i us = zero;
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 mk = lanes(k1 - k);
      const __m512 v = _mm512_maskz_loadu_ps(mk, &xr[k]);
      const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
      __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(bs_codes8(_mm512_castps512_ps256(v), dma, dsa, dq)),
                                     bs_codes8(upper, dma, dsa, dq), 1);
      u = _mm512_maskz_mov_epi32(mk, u);  // lanes past k1: 0
      us = _mm512_add_epi32(us, u);
      if (keep_codes) _mm_mask_storeu_epi8(&A.codes[m * K + k], mk, _mm512_cvtepi32_epi8(u));
      const int64_t t = k - k0;
      for (int i = 0; i < s.p; ++i) {
        const uint64_t bits = _mm512_test_epi32_mask(u, _mm512_set1_epi32(1 << i));
        pl[(g * s.p + i) * s.gw + t / 64] |= bits << (t % 64);
      }
    }
    A.usum[m * s.G + g] = _mm512_reduce_add_epi32(us);
  }
}
#pragma GCC diagnostic pop
#endif

// mode: 0 portable, 1 scalar POPCNT, 2 AVX2 vpshufb (1 and 2 need AVX2 hardware; else portable),
// 3 AVX-512 VPOPCNTDQ (AVX2 where the CPU has no AVX-512 or PYKERNELS_DISABLE_AVX512=1).
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
  void (*quantize_fn)(const void*, pk::DType, int64_t, const BsShape&, ActPlanes&, bool, ActEvalFn, float*) =
      quantize_act_planes;
  ActEvalFn eval = act_eval_portable;
#if PK_X86
  if (mode == 3 && pk::cpu_has_avx512() && (s.G == 1 || s.gsize % 16 == 0)) quantize_fn = quantize_act_planes_avx512;
  if (mode >= 1 && pk::cpu_has_avx2()) eval = act_eval_avx2;
  if (mode == 3 && pk::cpu_has_avx512()) eval = act_eval_avx512;
#endif
  // Tokens in parallel (each writes only its own planes, sums, sa/ma and codes), in chunks of ~16K
  // elements, so that a few short tokens stay on one thread: a token costs ~5 us per 4096 elements (the
  // fit's passes), which serially took ~0.6 ms of a 128-token W2A2 4096^2 GEMM.
  const int64_t act_grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, K));
  pk::parallel_chunks(M, num_threads, act_grain, [&](int, int64_t m0, int64_t m1) {
    std::vector<float> xr(K + 16);
    for (int64_t m = m0; m < m1; ++m) quantize_fn(xp, xdt, m, s, A, act_codes != 0, eval, xr.data());
  });
  if (act_codes && M * K > 0) std::memcpy(reinterpret_cast<void*>(act_codes), A.codes.data(), M * K);
  const uint64_t* W = reinterpret_cast<const uint64_t*>(wplanes);
  const float* sc = reinterpret_cast<const float*>(scales);
  const float* of = reinterpret_cast<const float*>(offsets);
  const int32_t* ws = reinterpret_cast<const int32_t*>(wsum);
  const float* bs = bias ? reinterpret_cast<const float*>(bias) : nullptr;
  int64_t* iout = reinterpret_cast<int64_t*>(int_out);
  void (*groups_fn)(const uint64_t*, const uint64_t*, const BsShape&, int64_t*) = bs_groups_portable;
  // AVX-512: the activation planes spread once per token (bs_spread_avx512; 4-8x the planes' size), for
  // a chunk of tokens at a time (at most ~8 MiB of spread: review finding, 256 MiB for 4096 tokens at
  // 8 bits and group_size 32); the weights are read once per chunk.
  std::vector<uint64_t> spread;
  int64_t per_token = 0, chunk = std::max<int64_t>(1, M);
#if PK_X86
  if (pk::cpu_has_avx2() && mode == 1) groups_fn = bs_groups_popcnt;
  if (pk::cpu_has_avx2() && mode >= 2) groups_fn = bs_groups_avx2;
  const bool avx512 = mode == 3 && pk::cpu_has_avx512();
  if (avx512) {
    groups_fn = bs_groups_avx512_for(s.p, s.q);
    per_token = s.G * s.p * bs_pairs(s) * 8;
    chunk = std::max<int64_t>(1, std::min<int64_t>(M, (int64_t(1) << 20) / std::max<int64_t>(1, per_token)));
    spread.resize(std::max<int64_t>(1, chunk * per_token));
  }
#else
  const bool avx512 = false;
#endif
  const int64_t T = (N + RT - 1) / RT;
  const int64_t tile_words = s.G * s.q * s.gw * RT;
  // Per token and group: sa * sum(u_a) + ma * len, the activation side of the affine recombination.
  std::vector<double> act_terms(std::max<int64_t>(1, M * s.G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < s.G; ++g)
      act_terms[m * s.G + g] = A.sa[m] * (double)A.usum[m * s.G + g] +
                               A.ma[m] * (double)(std::min(K, (g + 1) * s.gsize) - g * s.gsize);
  for (int64_t mc0 = 0; mc0 < M; mc0 += chunk) {
    const int64_t mc1 = std::min(M, mc0 + chunk);
    // threads as for the weight-only GEMMs, for this chunk's tokens (one parallel region each), a product
    // of p x q one-bit planes counting as p * q / 4 of a multiply-add (W2A2 one)
    const int tile_threads = threads_for_macs(num_threads, std::max<int64_t>(1, (mc1 - mc0) * N * K / 4 * s.p * s.q));
#if PK_X86
    if (avx512)
      for (int64_t m = mc0; m < mc1; ++m)
        bs_spread_avx512(&A.planes[m * s.G * s.p * s.gw], s, &spread[(m - mc0) * per_token]);
#endif
    pk::parallel_ranges(T, tile_threads, [&](int, int64_t t0, int64_t t1) {
      std::vector<int64_t> Iall(std::max<int64_t>(1, s.G) * RT);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * RT;
        const int rows = (int)std::min<int64_t>(RT, N - n0);
        for (int64_t m = mc0; m < mc1; ++m) {
          double acc[RT] = {0, 0, 0, 0};
          const double sa = A.sa[m], ma = A.ma[m];
          const uint64_t* act = avx512 ? &spread[(m - mc0) * per_token] : &A.planes[m * s.G * s.p * s.gw];
          groups_fn(act, W + t * tile_words, s, Iall.data());
          if (iout) {
            for (int r = 0; r < rows; ++r)
              for (int64_t g = 0; g < s.G; ++g)
                iout[(m * N + n0 + r) * s.G + g] = avx512 ? Iall[r * s.G + g] : Iall[g * RT + r];
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
#if PK_X86
            if (avx512) {
              acc[r] = bs_combine_avx512(swr, mwr, uwr, c1, Iall.data() + r * s.G, s.G, sa, ma);
              continue;
            }
#endif
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
}

// ---------------------------------------------------------------------------------------------
// 3. Weight-only GEMM on bf16 dot products, bf16 activations, codes of <= 4 bits: `wo_gemm_amx` on AMX
//    tiles (Sapphire Rapids and newer) and `wo_gemm_bf16dot` on AVX-512 BF16 (Zen 4, Cooper Lake and
//    newer; the same data and math, the tile product as vector loops: see dot_half_tile). Per group,
//    x.w = s * sum(x*u) + m * sum(x) (the affine form above); sum(x*u) is
//    a TDPBF16PS of the bf16 activations against the centred codes u - 2^(bits-1) converted to bf16
//    (small integers: exact), so every product is exact and sums run in fp32 (no int16 rounding of x);
//    centred as in wo_gemm, so that sum(x*u) and m * sum(x) do not cancel.
//    Roles are swapped against the usual y = x W^T tiling so that no weight needs a transpose: the A
//    tile is 16 weight rows x 32 codes (a row's 16 nibble bytes widen to its 32 codes in order, one
//    vpermw through a code -> bf16 table), the B tile 16 k-pairs x 16 tokens of activations (re-laid
//    once per call), and C[n][m] accumulates a group; its per-row scale and offset are then one FMA
//    each per row. One decode of a 16-row x group block of weights serves every 16-token tile.
//    Rows with huge outliers or NaN/inf take the VNNI path's routes (pykernels/quant/_ops.py,
//    _cpu_amx). TDPBF16PS reads subnormal bf16 inputs as zero: a row whose largest |x| is that small
//    is routed like NaN/inf rows (act_range_flags); elsewhere the error is below ~1e-38.
//    VDPBF16PS reads and writes subnormals as zero the same way. Measured at K=N=4096, 2 cores: see
//    pykernels/quant/_ops.py (AMX_MIN_M_BUCKET, BF16DOT_MIN_M_BUCKET).
// ---------------------------------------------------------------------------------------------
#if PK_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

// AMX-TILE + AMX-BF16 in CPUID, enabled by the OS (XCR0 bits 17-18), and this process allowed to use
// the tile data state (Linux asks for it with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
// PYKERNELS_DISABLE_AMX=1 turns it off; it also needs the AVX-512 tier.
bool cpu_has_amx_bf16() {
  static const bool has = [] {
    if (!pk::cpu_has_avx512()) return false;
    const char* off = std::getenv("PYKERNELS_DISABLE_AMX");
    if (off && off[0] == '1') return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;  // XTILECFG, XTILEDATA
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
    return true;
#else
    return false;
#endif
  }();
  return has;
}

#define PK_TARGET_AMX                                                                              \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma," \
                        "bmi,bmi2,popcnt,f16c")))
// The parts both kernels share (decode, activations) and the AVX-512 BF16 kernel: a subset of PK_TARGET_AMX
// (so AMX code inlines them) and of PK_TARGET_AVX512.
#define PK_TARGET_BF16DOT \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,bmi,bmi2,popcnt,f16c")))

template <class T>
T* align64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

struct alignas(64) AmxTileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

struct Bf16Args {  // (both kernels')
  WoShape s;
  const uint8_t* w;
  const float* scales;   // [N, G]
  const float* offsets;  // [N, G]
  const float* bias;     // [N] or null
  const uint32_t* xv;    // bf16 pairs as B tiles [16 k-pairs][16 tokens]: AMX [G][MT][kpg], bf16dot [MT][B]
  int64_t kpg;           // blocks per group
  const float* xsum;     // [MT][G][16]: per-group sums of each token's activations
  int64_t MT;
  uint16_t* y;           // [M, N] bf16
};

// What the decode needs in registers, made once per thread: the bf16 values of the 16 centred codes
// (u - center; lanes 16-31 repeat them), the vpermw table, and the vpermt2w indices that put two rows'
// low nibbles (codes 0..15 of a block) and high nibbles (16..31) in code order: row a takes words 0-15
// of lo then of hi, row b words 16-31 (index bit 5 picks the second source).
struct CodeDecode {
  __m512i table, idx_a, idx_b;
};
PK_TARGET_BF16DOT CodeDecode bf16_decode_consts(const WoShape& s) {
  alignas(64) uint16_t lut[32], ia[32], ib[32];
  for (int c = 0; c < 32; ++c) lut[c] = f32_to_bf16((float)((c & 15) - s.center));  // small integers: exact
  for (int j = 0; j < 16; ++j) {
    ia[j] = (uint16_t)j; ia[16 + j] = (uint16_t)(32 + j);
    ib[j] = (uint16_t)(16 + j); ib[16 + j] = (uint16_t)(48 + j);
  }
  return {_mm512_load_si512(lut), _mm512_load_si512(ia), _mm512_load_si512(ib)};
}

// Rows n0..n0+15 of blocks [kb0, kb1) as A tiles (16 rows x 32 bf16 codes, 1 KiB each) into dst. A
// block of a 4-row tile is one 64-byte line: two rows at a time are widened to words, split into
// low and high nibbles, put in code order (vpermt2w) and mapped to bf16 (vpermw).
PK_TARGET_BF16DOT void bf16_decode_rows(const Bf16Args& a, const CodeDecode& d, int64_t n0, int64_t kb0, int64_t kb1,
                                   uint16_t* dst) {
  const WoShape& s = a.s;
  const __m512i low = _mm512_set1_epi16(0x0f);
  const int64_t tb = s.tile_bytes();
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    uint16_t* tile = dst + (kb - kb0) * 512;
    for (int r = 0; r < 16; r += 2) {
      const int64_t n = n0 + r;  // n0 and r even, RT = 4: rows n, n + 1 share a 4-row tile
      __m512i out_a = _mm512_setzero_si512(), out_b = _mm512_setzero_si512();
      if (n < s.N) {
        const uint8_t* src = a.w + (n / RT) * tb + kb * 64 + (n % RT) * 16;
        const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        const __m512i lo = _mm512_and_si512(w16, low), hi = _mm512_and_si512(_mm512_srli_epi16(w16, 4), low);
        out_a = _mm512_permutexvar_epi16(_mm512_permutex2var_epi16(lo, d.idx_a, hi), d.table);
        if (n + 1 < s.N) out_b = _mm512_permutexvar_epi16(_mm512_permutex2var_epi16(lo, d.idx_b, hi), d.table);
      }
      _mm512_store_si512(tile + r * 32, out_a);
      _mm512_store_si512(tile + (r + 1) * 32, out_b);
    }
  }
}

// One group of one 16-row panel against NM token tiles from mt: C tiles 0..NM-1, A tile 4 (the
// panel's codes, loaded once per block), B tiles 5/6 (activations, alternating); then every C row is
// scaled by its row's group scale and gets its offset times the tokens' group sums.
template <int NM>
PK_TARGET_AMX inline void amx_group_tiles(const Bf16Args& a, const uint16_t* wbuf, int64_t kb0, int64_t kb1,
                                          int64_t mt, int64_t g, const float* sc, const float* of, float* cbuf,
                                          float* accp) {
  const WoShape& s = a.s;
  _tile_zero(0);
  if constexpr (NM > 1) _tile_zero(1);
  if constexpr (NM > 2) _tile_zero(2);
  if constexpr (NM > 3) _tile_zero(3);
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    _tile_loadd(4, wbuf + (kb - kb0) * 512, 64);
    const uint32_t* xb = a.xv + ((g * a.MT + mt) * a.kpg + (kb - kb0)) * 256;
    const int64_t next = a.kpg * 256;  // the same block of the next token tile
    // the next token tiles' blocks (the following 4 KiB of xv per tile) into L1 while these multiply:
    // TILELOADD from L2 stalled every TDPBF16PS (~100 cycles each instead of ~16)
    for (int j = 0; j < NM; ++j) {
      const char* pf = reinterpret_cast<const char*>(xb + (NM + j) * next);
      for (int l = 0; l < 1024; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
    }
    _tile_loadd(5, xb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NM > 1) {
      _tile_loadd(6, xb + next, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NM > 2) {
      _tile_loadd(5, xb + 2 * next, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NM > 3) {
      _tile_loadd(6, xb + 3 * next, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, cbuf, 64);
  if constexpr (NM > 1) _tile_stored(1, cbuf + 256, 64);
  if constexpr (NM > 2) _tile_stored(2, cbuf + 512, 64);
  if constexpr (NM > 3) _tile_stored(3, cbuf + 768, 64);
  for (int j = 0; j < NM; ++j) {
    const __m512 xs = _mm512_loadu_ps(a.xsum + ((mt + j) * s.G + g) * 16);
    float* ac = accp + (mt + j) * 256;
    const float* cb = cbuf + j * 256;
    for (int r = 0; r < 16; ++r) {
      __m512 v = _mm512_load_ps(ac + r * 16);
      v = _mm512_fmadd_ps(_mm512_load_ps(cb + r * 16), _mm512_set1_ps(sc[r]), v);
      v = _mm512_fmadd_ps(xs, _mm512_set1_ps(of[r]), v);
      _mm512_store_ps(ac + r * 16, v);
    }
  }
}

// Row n0 + r's scale and centred offset of group g (w = s * (u - c) + (m + s * c); 0 for "sym"), rows past N
// the last row's (their codes decode to 0 and their outputs are not written).
inline void group_affine(const Bf16Args& a, int64_t n0, int64_t g, float* sc, float* of) {
  const WoShape& s = a.s;
  for (int r = 0; r < 16; ++r) {
    const int64_t n = std::min(n0 + r, s.N - 1);
    sc[r] = a.scales[n * s.G + g];
    of[r] = (float)((double)a.offsets[n * s.G + g] + (double)sc[r] * s.center);
  }
}


#pragma GCC diagnostic push  // see the AVX-512 weight-only section
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// f32_to_bf16 of 16 floats (round to nearest even, NaN stays NaN)
PK_TARGET_BF16DOT inline __m256i f32x16_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// A panel's sums acc[mt][r][t] (y[16 mt + t][n0 + r] before the bias) into y as bf16 (both kernels): a
// token's 16 rows gathered from the sums (16 apart), + bias, rounded as f32_to_bf16.
PK_TARGET_BF16DOT void write_panel(const Bf16Args& a, const float* accp, int64_t n0) {
  const WoShape& s = a.s;
  const int64_t nr = std::min<int64_t>(16, s.N - n0);
  const __mmask16 rows = (__mmask16)((1u << nr) - 1);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(rows, a.bias + n0) : _mm512_setzero_ps();
  const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t m = 0; m < s.M; ++m) {
    const float* ac = accp + (m / 16) * 256 + m % 16;
    const __m256i y = f32x16_to_bf16(_mm512_add_ps(_mm512_i32gather_ps(stride, ac, 4), bias));
    _mm256_mask_storeu_epi16(a.y + m * s.N + n0, rows, y);
  }
}
#pragma GCC diagnostic pop

PK_TARGET_AMX void amx_panels(const Bf16Args& a, int64_t p0, int64_t p1) {
  const WoShape& s = a.s;
  const int64_t kpg = a.kpg;
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  std::vector<uint16_t> wraw(std::max<int64_t>(kpg, 1) * 512 + 32);
  std::vector<float> araw(a.MT * 256 + 16);
  uint16_t* wbuf = align64(wraw.data());
  float* accp = align64(araw.data());
  alignas(64) float cbuf[4 * 256];
  const CodeDecode dec = bf16_decode_consts(s);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * 16;
    std::fill(accp, accp + a.MT * 256, 0.f);
    for (int64_t g = 0; g < s.G; ++g) {
      const int64_t kb0 = g * kpg, kb1 = std::min(s.B, kb0 + kpg);
      bf16_decode_rows(a, dec, n0, kb0, kb1, wbuf);
      float sc[16], of[16];
      group_affine(a, n0, g, sc, of);
      for (int64_t mt = 0; mt < a.MT; mt += 4) {
        // up to 4 token tiles at once: independent accumulators, so the TDPBF16PS run at their
        // throughput (one accumulator chain waited on each one's latency: ~3x slower at M=128)
        switch (std::min<int64_t>(4, a.MT - mt)) {
          case 4: amx_group_tiles<4>(a, wbuf, kb0, kb1, mt, g, sc, of, cbuf, accp); break;
          case 3: amx_group_tiles<3>(a, wbuf, kb0, kb1, mt, g, sc, of, cbuf, accp); break;
          case 2: amx_group_tiles<2>(a, wbuf, kb0, kb1, mt, g, sc, of, cbuf, accp); break;
          default: amx_group_tiles<1>(a, wbuf, kb0, kb1, mt, g, sc, of, cbuf, accp); break;
        }
      }
    }
    write_panel(a, accp, n0);
  }
  _tile_release();
}

struct CodePair {  // two decoded codes (bf16), the dword a VDPBF16PS broadcast reads
  uint16_t v[2];
};

// amx_group_tiles's product as vector loops, for one token tile and 8 rows (half h of a 16-row panel) over
// all groups: acc[r] (a vector over the tile's 16 tokens) gathers a group, one VDPBF16PS per row and k-pair
// (the row's code pair broadcast; the tokens' activation pairs, a B tile row, one load for the 8 rows), then
// tot[r] += acc[r] * sc[g][r]: 16 accumulators in named registers (GCC spilled an array of them around every
// product, see panel_dot), the group's rescale two ops a row, the offsets' terms once at the end.
// wbuf: the panel's decoded blocks (16 rows x 32 codes each), all groups; sc, of: [G][16]; out: [16 rows][16].
PK_TARGET_BF16DOT void dot_half_tile(const Bf16Args& a, const uint16_t* wbuf, int64_t mt, int h, const float* sc,
                                     const float* of, float* out) {
  const WoShape& s = a.s;
  const __m512 zero = _mm512_setzero_ps();
  __m512 t0 = zero, t1 = zero, t2 = zero, t3 = zero, t4 = zero, t5 = zero, t6 = zero, t7 = zero;
  for (int64_t g = 0; g < s.G; ++g) {
    const int64_t kb0 = g * a.kpg, nblk = std::min(s.B, kb0 + a.kpg) - kb0;
    const uint32_t* xg = a.xv + (mt * s.B + kb0) * 256;  // (the tile-major layout: see wo_gemm_bf16)
    __m512 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero;
    for (int64_t kb = 0; kb < nblk; ++kb) {
      const uint16_t* tile = wbuf + (kb0 + kb) * 512 + 8 * h * 32;  // row 8 h + r's codes at 32 r
      const uint32_t* xk = xg + kb * 256;
      // (the product as asm: GCC 12 does not fold the broadcast into VDPBF16PS's {1to16} operand; a
      // separate vpbroadcastd per product measured ~5% slower at M=128, 1 thread)
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const __m512bh x = (__m512bh)_mm512_loadu_si512(xk + 16 * i);
#define PK_DOT_ROW(r)                                                           \
  asm("vdpbf16ps %[w]%{1to16%}, %[x], %[acc]"                                   \
      : [acc] "+v"(a##r)                                                        \
      : [x] "v"(x), [w] "m"(*reinterpret_cast<const CodePair*>(tile + 32 * (r) + 2 * i)));
        PK_DOT_ROW(0) PK_DOT_ROW(1) PK_DOT_ROW(2) PK_DOT_ROW(3) PK_DOT_ROW(4) PK_DOT_ROW(5) PK_DOT_ROW(6) PK_DOT_ROW(7)
#undef PK_DOT_ROW
      }
    }
    const float* sg = sc + g * 16 + 8 * h;
#define PK_DOT_RESCALE(r) t##r = _mm512_fmadd_ps(a##r, _mm512_set1_ps(sg[r]), t##r);
    PK_DOT_RESCALE(0) PK_DOT_RESCALE(1) PK_DOT_RESCALE(2) PK_DOT_RESCALE(3)
    PK_DOT_RESCALE(4) PK_DOT_RESCALE(5) PK_DOT_RESCALE(6) PK_DOT_RESCALE(7)
#undef PK_DOT_RESCALE
  }
  for (int64_t g = 0; g < s.G; ++g) {  // + the offsets times the tokens' group sums
    const __m512 xs = _mm512_loadu_ps(a.xsum + (mt * s.G + g) * 16);
    const float* og = of + g * 16 + 8 * h;
#define PK_DOT_OFFSET(r) t##r = _mm512_fmadd_ps(xs, _mm512_set1_ps(og[r]), t##r);
    PK_DOT_OFFSET(0) PK_DOT_OFFSET(1) PK_DOT_OFFSET(2) PK_DOT_OFFSET(3)
    PK_DOT_OFFSET(4) PK_DOT_OFFSET(5) PK_DOT_OFFSET(6) PK_DOT_OFFSET(7)
#undef PK_DOT_OFFSET
  }
  float* o = out + 8 * h * 16;
  _mm512_store_ps(o, t0); _mm512_store_ps(o + 16, t1); _mm512_store_ps(o + 32, t2); _mm512_store_ps(o + 48, t3);
  _mm512_store_ps(o + 64, t4); _mm512_store_ps(o + 80, t5); _mm512_store_ps(o + 96, t6); _mm512_store_ps(o + 112, t7);
}


// amx_panels on AVX-512 BF16: a 16-row panel decoded whole (16 rows x K bf16 codes: 128 KiB at K = 4096, in
// L2), then every token tile, 8 rows at a time.
PK_TARGET_BF16DOT void dot_panels(const Bf16Args& a, int64_t p0, int64_t p1) {
  const WoShape& s = a.s;
  std::vector<uint16_t> wraw(s.B * 512 + 32);
  std::vector<float> araw(a.MT * 256 + 16), aff(2 * s.G * 16);
  uint16_t* wbuf = align64(wraw.data());
  float* accp = align64(araw.data());
  float *sc = aff.data(), *of = sc + s.G * 16;
  const CodeDecode dec = bf16_decode_consts(s);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * 16;
    bf16_decode_rows(a, dec, n0, 0, s.B, wbuf);
    for (int64_t g = 0; g < s.G; ++g) group_affine(a, n0, g, sc + g * 16, of + g * 16);
    for (int64_t mt = 0; mt < a.MT; ++mt)
      for (int h = 0; h < 2; ++h) dot_half_tile(a, wbuf, mt, h, sc, of, accp + mt * 256);
    write_panel(a, accp, n0);
  }
}

// y (bf16) = x (bf16) @ dequant(W).T (+ bias) on either kernel: the activations laid out as B tiles once,
// then the 16-row panels split over the threads.
void wo_gemm_bf16(bool amx, uintptr_t x, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                  uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int num_threads) {
  const char* op = "qmatmul";
  if (amx && !cpu_has_amx_bf16()) pk::fail_runtime(op, "the AMX kernel needs a CPU with AMX-BF16 (and the OS's leave)");
  if (!amx && !pk::cpu_has_avx512bf16())
    pk::fail_runtime(op, "the bf16dot kernel needs a CPU with AVX-512 BF16 (and PYKERNELS_DISABLE_AVX512 unset)");
  if (bits < 1 || bits > 4) pk::fail_value(op, "the bf16 kernels take codes of 1..4 bits");
  const WoShape s = wo_shape(op, M, N, K, bits, group_size);
  if (M == 0 || N == 0) return;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y);
  if (K == 0) {  // no products: y = bias
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] = f32_to_bf16(bias ? reinterpret_cast<const float*>(bias)[n] : 0.f);
    return;
  }
  Bf16Args a{};
  a.s = s;
  a.w = reinterpret_cast<const uint8_t*>(w);
  a.scales = reinterpret_cast<const float*>(scales);
  a.offsets = reinterpret_cast<const float*>(offsets);
  a.bias = bias ? reinterpret_cast<const float*>(bias) : nullptr;
  a.MT = (M + 15) / 16;
  a.y = yp;
  a.kpg = s.gsize / KB + (s.gsize % KB != 0);  // blocks per group (gsize = K when -1)
  // AMX: a group's B tiles for every token tile side by side, [G][MT][kpg] (streamed in order for each
  // panel; the layout [MT][B] measured slower there: its tiles of one group lie 128 KiB apart at K = 4096);
  // bf16dot: [MT][B], each token tile's K in one run (its loop takes a tile's groups in turn)
  std::vector<uint32_t> xv(s.G * a.MT * a.kpg * 256, 0u);  // TILELOADD takes any alignment
  std::vector<float> xsum(a.MT * s.G * 16, 0.f);
  py::gil_scoped_release release;
  // activations as B tiles: dword [block][i][t] = (x[16 mt + t][32 kb + 2 i], x[..][32 kb + 2 i + 1]), block
  // (g, mt, kb - g kpg) on AMX, (mt, kb) for bf16dot
  pk::parallel_ranges(M, threads_for_work(num_threads, M * K), [&](int, int64_t m0, int64_t m1) {
    std::vector<float> xf(K), gsum(s.G);
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t mt = m / 16, t = m % 16;
      const uint16_t* xr = xp + m * K;
      auto put = [&](int64_t k, uint32_t pair) {
        const int64_t kb = k / KB, g = kb / a.kpg, i = (k % KB) / 2;
        const int64_t block = amx ? (g * a.MT + mt) * a.kpg + kb - g * a.kpg : mt * s.B + kb;
        xv[(block * 16 + i) * 16 + t] = pair;
      };
      for (int64_t k = 0; k + 1 < K; k += 2) put(k, (uint32_t)xr[k] | (uint32_t)xr[k + 1] << 16);
      if (K & 1) put(K - 1, xr[K - 1]);
      for (int64_t k = 0; k < K; ++k) xf[k] = bf16_to_f32(xr[k]);
      group_sums(xf.data(), s, gsum.data());
      for (int64_t g = 0; g < s.G; ++g) xsum[(mt * s.G + g) * 16 + t] = gsum[g];
    }
  });
  a.xv = xv.data();
  a.xsum = xsum.data();
  const int64_t P = (N + 15) / 16;
  pk::parallel_ranges(P, threads_for_work(num_threads, M * N * K), [&](int, int64_t p0, int64_t p1) {
    if (amx)
      amx_panels(a, p0, p1);
    else
      dot_panels(a, p0, p1);
  });
}
#else
bool cpu_has_amx_bf16() { return false; }
void wo_gemm_bf16(bool amx, uintptr_t, int64_t, int64_t, uintptr_t, int, uintptr_t, uintptr_t, int64_t, int64_t,
                  uintptr_t, uintptr_t, int) {
  pk::fail_runtime("qmatmul", amx ? "the AMX kernel needs an x86-64 CPU with AMX-BF16"
                                  : "the bf16dot kernel needs an x86-64 CPU with AVX-512 BF16");
}
#endif

void wo_gemm_amx(uintptr_t x, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales, uintptr_t offsets,
                 int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int num_threads) {
  wo_gemm_bf16(true, x, M, K, w, bits, scales, offsets, N, group_size, bias, y, num_threads);
}

void wo_gemm_bf16dot(uintptr_t x, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales, uintptr_t offsets,
                     int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int num_threads) {
  wo_gemm_bf16(false, x, M, K, w, bits, scales, offsets, N, group_size, bias, y, num_threads);
}

// Whether the CPU multiplies bf16 natively (AVX512-BF16's VDPBF16PS; AMX CPUs have it too), whatever the
// PYKERNELS_DISABLE_* flags say about our own kernels: it answers for torch's bf16 GEMM (oneDNN), which the
// "dequant_mm" route and aten's flash-attention backward call (pykernels._native.torch_bf16_gemm_native).
// Without it oneDNN's bf16 GEMM converts to fp32 on the way and ran 5.7x slower than its fp32 GEMM (Zen 2,
// AVX2: M=128, K=N=4096, 270 vs 47 ms), so both multiply in fp32 there.
bool cpu_has_bf16_dot() {
#if PK_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");  // every AMX CPU has it
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(_cpu_qgemm, m) {
  pk::def_mark_forked(m);
  pk::def_native_errors("qmatmul");
  m.doc() = "pykernels quantized GEMMs on the CPU (weight-only int16-activation kernels, bit-serial bipolar-INT)";
  m.def("cpu_has_avx2", &pk::cpu_has_avx2);
  m.def("cpu_has_avx512", &pk::cpu_has_avx512);
  m.def("wo_gemm", &wo_gemm, py::arg("x"), py::arg("x_dtype"), py::arg("M"), py::arg("K"), py::arg("w"),
        py::arg("bits"), py::arg("scales"), py::arg("offsets"), py::arg("N"), py::arg("group_size"),
        py::arg("bias"), py::arg("y"), py::arg("y_dtype"), py::arg("num_threads"), py::arg("m_block"),
        py::arg("n_block"), py::arg("isa"), py::arg("gemm_min_m"), py::arg("check_rows") = false,
        "y[M,N] = x[M,K] @ dequant(W).T (+ bias): weight-only quantized GEMM on packed tiles; with check_rows, "
        "the number of rows act_range_flags flags, y untouched, when there are any (else 0)");
  m.def("cpu_has_amx_bf16", &cpu_has_amx_bf16, "AMX-BF16 usable here (CPU, OS and process permission)");
  m.def("cpu_has_avx512bf16", &pk::cpu_has_avx512bf16,
        "our AVX-512 BF16 kernels run here (the CPU has it and PYKERNELS_DISABLE_AVX512 was unset at load)");
  m.def("wo_gemm_bf16dot", &wo_gemm_bf16dot, py::arg("x"), py::arg("M"), py::arg("K"), py::arg("w"), py::arg("bits"),
        py::arg("scales"), py::arg("offsets"), py::arg("N"), py::arg("group_size"), py::arg("bias"), py::arg("y"),
        py::arg("num_threads"),
        "wo_gemm_amx's product on AVX-512 BF16 dot products (VDPBF16PS) instead of AMX tiles");
  m.def("cpu_has_bf16_dot", &cpu_has_bf16_dot,
        "the CPU multiplies bf16 natively (AVX512-BF16), whatever the PYKERNELS_DISABLE_* flags say");
  m.def("wo_gemm_amx", &wo_gemm_amx, py::arg("x"), py::arg("M"), py::arg("K"), py::arg("w"), py::arg("bits"),
        py::arg("scales"), py::arg("offsets"), py::arg("N"), py::arg("group_size"), py::arg("bias"), py::arg("y"),
        py::arg("num_threads"),
        "y[M,N] (bf16) = x[M,K] (bf16) @ dequant(W).T (+ fp32 bias) on AMX tiles, codes of <= 4 bits");
  m.def("act_range_flags", &act_range_flags, py::arg("x"), py::arg("x_dtype"), py::arg("M"), py::arg("K"),
        py::arg("flags"), py::arg("num_threads"),
        "per-row flags (uint8[M]): 1 = two scales the int16 activation path would lose, 2 = NaN/inf or a "
        "row max outside [2^-96, 2^64] (exact fp32 route); "
        "returns how many rows are flagged");
  m.def("split_outliers", &split_outliers, py::arg("x"), py::arg("x_dtype"), py::arg("M"), py::arg("K"),
        py::arg("w"), py::arg("bits"), py::arg("scales"), py::arg("offsets"), py::arg("N"), py::arg("group_size"),
        py::arg("factor"), py::arg("max_out"), py::arg("rest"), py::arg("y_exact"),
        "rows' outliers (> factor x mean |x|, at most max_out per row) multiplied exactly into y_exact[M,N] "
        "(+=, float64); rest[M,K] float32 = the rows without them; returns how many were taken out");
  m.def("wo_sgemm", &wo_sgemm, py::arg("x"), py::arg("x_dtype"), py::arg("M"), py::arg("K"), py::arg("w"),
        py::arg("bits"), py::arg("scales"), py::arg("offsets"), py::arg("N"), py::arg("group_size"),
        py::arg("bias"), py::arg("y"), py::arg("num_threads"), py::arg("kc"), py::arg("mc"), py::arg("nc"),
        "y[M,N] (float32) = x[M,K] @ dequant(W).T (+ fp32 bias): a blocked fp32 GEMM that dequantizes the "
        "weights into its packed panels (AVX2 + FMA)");
  m.def("dequant_tiles", &dequant_tiles, py::arg("w"), py::arg("bits"), py::arg("scales"), py::arg("offsets"),
        py::arg("N"), py::arg("K"), py::arg("group_size"), py::arg("out"), py::arg("out_dtype"),
        py::arg("num_threads"), "out[N,K] = dequantized weights of a packed tile layout");
  m.def("bitserial_gemm", &bitserial_gemm, py::arg("x"), py::arg("x_dtype"), py::arg("M"), py::arg("K"),
        py::arg("act_bits"), py::arg("wplanes"), py::arg("bits"), py::arg("scales"), py::arg("offsets"),
        py::arg("wsum"), py::arg("N"), py::arg("group_size"), py::arg("bias"), py::arg("y"), py::arg("y_dtype"),
        py::arg("int_out"), py::arg("act_codes"), py::arg("num_threads"), py::arg("mode"),
        "bit-serial bipolar-INT GEMM; with int_out != 0 writes the integer sums I[M,N,G] instead of y");
}
