// Attention for a few query rows against a long KV cache on CPU (decode steps, speculative verification,
// small chunks): flash-decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference",
// 2023) with the online softmax of FlashAttention (Dao et al. 2022; Milakov & Gimelshein 2018).
//
// Why not aten's CPU flash kernel (what flash_attention's "flash" impl wraps): for one query row it
// parallelizes over query blocks and heads, reads K/V once per *query* head (GQA: H/Hkv times the cache),
// and converts bf16/fp16 through a generic path: a 32-head (8 KV heads) decode step over 1024 keys took
// 0.79 ms in fp32 and 4.9 ms in bf16 (2-core Zen 2), where reading the cache once takes ~0.3 / 0.15 ms.
//
// The work: per (batch b, KV head hk) a group of R = (H / Hkv) * Sq query rows (every query head that
// reads this KV head, every query position), so K and V are streamed ONCE per group. Keys are split into
// chunks when there are fewer than two groups per thread (flash-decoding's split-K); each (group, chunk) item
// keeps, per row, the running max m, the running sum l of exp(s - m) and the unnormalized output acc,
// over blocks of KB keys:
//   s[r][j] = (scale q_r) . k_j                  (masked keys: bottom-right causal, j <= i + Sk - Sq)
//   m' = max(m, max_j s[r][j]); p = exp(s - m'); l = l exp(m - m') + sum_j p; acc = acc exp(m - m') + p V
// Items of one group are merged at the end (M = max m, L = sum l e^(m - M), out = sum acc e^(m - M) / L),
// lse = M + log L. Everything accumulates in float32; inputs are float32, bfloat16 or float16.
//
// Non-finite inputs: a row that sees keys and ends with a non-finite lse (NaN/inf in q or k) is counted
// and the caller recomputes the problem on its exact path; NaN/inf in v reach the rows that see it, as
// the math says.
//
// Also here, below: the bf16dot kernels, FlashAttention-2's forward and backward for bfloat16 with AVX-512
// BF16 dot products (prefill, training and other many-row problems).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "pk_avx2.h"
#include "pk_common.h"
#include "pk_float.h"
#include "pk_threads.h"

#if PK_X86
#include <immintrin.h>
#ifdef PK_EMULATE_AVX512
#include "avx512_emu.h"  // (see PK_TARGET_AVX512BF16)
#endif
#endif

namespace py = pybind11;

namespace {

constexpr int KB = 32;                 // keys per block: a block's scores (R x KB floats) stay in L1
constexpr int64_t kMinChunkKeys = 256;  // split-K: at most one chunk per this many keys (chunks > 128 keys)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  int64_t B, H, Hkv, Sq, Sk, D;
  int64_t qs[3], ks[3], vs[3], os[3], ls[3];  // element strides of dims b, h, s (the head dim is dense)
  float scale;
  bool causal;
  pk::DType dt;

  int64_t group_rows() const { return (H / Hkv) * Sq; }
  // row r of KV head hk's group: query head hk * (H / Hkv) + r / Sq, query position r % Sq
  int64_t head_of(int64_t hk, int r) const { return hk * (H / Hkv) + r / Sq; }
  // keys [0, visible) are seen by query position i
  int64_t visible(int64_t i) const { return causal ? std::min(Sk, std::max<int64_t>(0, i + Sk - Sq + 1)) : Sk; }
};

inline float load_f32(const void* base, pk::DType dt, int64_t i) {
  switch (dt) {
    case pk::DType::BFloat16: return pk::bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case pk::DType::Float16: return pk::f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

inline void store_from_f32(void* base, pk::DType dt, int64_t i, float v) {
  switch (dt) {
    case pk::DType::BFloat16: static_cast<uint16_t*>(base)[i] = pk::f32_to_bf16(v); break;
    case pk::DType::Float16: static_cast<uint16_t*>(base)[i] = pk::f32_to_f16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

// ---------------------------------------------------------------------------------------------
// The three inner loops, portable and AVX2 (FMA, F16C): scores of a block, exp, and P V.
// ---------------------------------------------------------------------------------------------
// s[r * KB + j] = q[r] . rows[j] for r < R, j < nb (q rows and key rows of D floats). `ahead` (the AVX2
// kernels'; 0: none): floats from a row to the row whose lines to prefetch as this one is read (the same key
// of the next block; in the kernels' main loops only, a line per 16 floats from the row's start: see
// attend_chunk).
void scores_portable(const float* q, int R, int D, const float* const* rows, int nb, int64_t ahead, float* s) {
  (void)ahead;
  for (int r = 0; r < R; ++r) {
    const float* qr = q + (int64_t)r * D;
    for (int j = 0; j < nb; ++j) {
      const float* kr = rows[j];
      float acc = 0.f;
      for (int d = 0; d < D; ++d) acc += qr[d] * kr[d];
      s[r * KB + j] = acc;
    }
  }
}

// x[j] = exp(x[j] - m) for j < n, returns the sum
float exp_sum_portable(float* x, int n, float m) {
  float sum = 0.f;
  for (int j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}

// max of x[0..n) (-inf for n = 0); a NaN never wins (it reaches the row's sum through exp instead)
float row_max_portable(const float* x, int n) {
  float m = kNegInf;
  for (int j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// acc[r] += sum_{j < n[r]} p[r * KB + j] * rows[j] for r < R: a row reads only the values of the keys it
// sees (a NaN in a masked key's value never reaches it, not even as 0 * NaN)
void pv_portable(const float* p, int R, int D, const float* const* rows, const int* n, int64_t ahead, float* acc) {
  (void)ahead;
  for (int r = 0; r < R; ++r) {
    float* ar = acc + (int64_t)r * D;
    for (int j = 0; j < n[r]; ++j) {
      const float pj = p[r * KB + j];
      const float* vr = rows[j];
      for (int d = 0; d < D; ++d) ar[d] += pj * vr[d];
    }
  }
}

// the 16-bit rows of a block as float32 (nb rows of D)
void widen_portable(const void* const* src, pk::DType dt, int nb, int D, int64_t ahead, float* dst) {
  (void)ahead;
  for (int j = 0; j < nb; ++j)
    for (int d = 0; d < D; ++d) dst[(int64_t)j * D + d] = load_f32(src[j], dt, d);
}

#if PK_X86
using pk::hsum256;

// The four sums of a0..a3 (lanes 0..3).
PK_TARGET_AVX2 inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// RB query rows (q, s: rows D and KB apart) x four keys per step: 4 RB independent accumulators (one
// chain per row and key was bound by the FMA latency), 8 floats of each key loaded once for RB FMAs; the
// four sums of a row come out of one hadd tree. ahead != 0: a line per 16 floats of the four keys at `ahead`
// floats from them prefetched as the step reads theirs (see attend_chunk).
template <int RB>
PK_TARGET_AVX2 inline void scores_rows_avx2(const float* q, int D, const float* const* rows, int nb, int64_t ahead,
                                            float* s) {
  const int D8 = D & ~7;
  int j = 0;
  for (; j + 4 <= nb; j += 4) {
    __m256 a[RB][4];
#pragma GCC unroll 8
    for (int u = 0; u < RB; ++u)
      for (int c = 0; c < 4; ++c) a[u][c] = _mm256_setzero_ps();
    for (int d = 0; d < D8; d += 8) {
      __m256 kc[4];
      if (ahead && (d & 15) == 0)
        for (int c = 0; c < 4; ++c) PK_PREFETCH_R(rows[j + c] + ahead + d);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) kc[c] = _mm256_loadu_ps(rows[j + c] + d);
#pragma GCC unroll 2
      for (int u = 0; u < RB; ++u) {
        const __m256 x = _mm256_loadu_ps(q + (int64_t)u * D + d);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) a[u][c] = _mm256_fmadd_ps(x, kc[c], a[u][c]);
      }
    }
    for (int u = 0; u < RB; ++u) {
      alignas(16) float t[4];
      _mm_store_ps(t, hsum4(a[u][0], a[u][1], a[u][2], a[u][3]));
      for (int d = D8; d < D; ++d)
        for (int c = 0; c < 4; ++c) t[c] += q[(int64_t)u * D + d] * rows[j + c][d];
      for (int c = 0; c < 4; ++c) s[u * KB + j + c] = t[c];
    }
  }
  for (; j < nb; ++j) {  // the block's last nb % 4 keys
    __m256 a[RB];
    for (int u = 0; u < RB; ++u) a[u] = _mm256_setzero_ps();
    for (int d = 0; d < D8; d += 8) {
      const __m256 kc = _mm256_loadu_ps(rows[j] + d);
      for (int u = 0; u < RB; ++u) a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (int64_t)u * D + d), kc, a[u]);
    }
    for (int u = 0; u < RB; ++u) {
      alignas(16) float t[4];
      _mm_store_ps(t, hsum4(a[u], _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()));
      for (int d = D8; d < D; ++d) t[0] += q[(int64_t)u * D + d] * rows[j][d];
      s[u * KB + j] = t[0];
    }
  }
}

// (the prefetches with the first rows only: the later ones read the same keys)
PK_TARGET_AVX2 void scores_avx2(const float* q, int R, int D, const float* const* rows, int nb, int64_t ahead,
                                float* s) {
  int r = 0;
  for (; r + 2 <= R; r += 2) scores_rows_avx2<2>(q + (int64_t)r * D, D, rows, nb, r == 0 ? ahead : 0, s + r * KB);
  if (r < R) scores_rows_avx2<1>(q + (int64_t)r * D, D, rows, nb, r == 0 ? ahead : 0, s + r * KB);
}

// exp(x): x = n ln2 + f, |f| <= ln2 / 2, e^f by a degree-6 polynomial (Cephes expf's coefficients;
// relative error ~1e-7, as std::exp in float), times 2^n built in the exponent bits. x < -87.3 (e^x below
// float's normal range) gives 0, and -inf exactly 0; NaN stays NaN. The constants of exp256 and exp512:
namespace expf_c {
constexpr float kHi = 88.3762626647949f, kLo = -87.3365478515625f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts (exact n * kLn2Hi)
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expf_c

PK_TARGET_AVX2 inline __m256 exp256(__m256 x) {  // 8 floats
  using namespace expf_c;
  const __m256 hi = _mm256_set1_ps(kHi), lo = _mm256_set1_ps(kLo);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(hi, x);  // min/max(c, x): NaN in x stays (the second operand is returned)
  x = _mm256_max_ps(lo, x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), f);
  __m256 y = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kP[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, r);
}

// row_max_portable's result, 8 lanes at a time: max_ps(x, m) returns m where x is NaN, so a NaN never wins
// (one dependent scalar maxss per key was ~15% of a decode step's time)
PK_TARGET_AVX2 float row_max_avx2(const float* x, int n) {
  __m256 m = _mm256_set1_ps(kNegInf);
  int j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + j), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  float r = _mm_cvtss_f32(h);
  for (; j < n; ++j) r = x[j] > r ? x[j] : r;
  return r;
}

PK_TARGET_AVX2 float exp_sum_avx2(float* x, int n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
    _mm256_storeu_ps(x + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (j < n) {  // the tail through the same polynomial (one rounding behaviour for every lane)
    alignas(32) float t[8];
    for (int i = 0; i < 8; ++i) t[i] = j + i < n ? x[j + i] : kNegInf;
    const __m256 p = exp256(_mm256_sub_ps(_mm256_load_ps(t), vm));
    _mm256_store_ps(t, p);
    sum = _mm256_add_ps(sum, p);
    for (int i = 0; j + i < n; ++i) x[j + i] = t[i];
  }
  return hsum256(sum);
}

// RB rows of acc (D apart) += P V over keys [0, nb) (p: rows KB apart), 32 floats of acc per row held in 4
// registers across the keys (4 RB independent FMA chains; one chain of 8 floats per row was bound by the
// FMA latency), each 32 floats of a value row loaded once for RB rows; ahead: as scores_rows_avx2's.
template <int RB>
PK_TARGET_AVX2 inline void pv_rows_avx2(const float* p, int D, const float* const* rows, int nb, int64_t ahead,
                                        float* acc) {
  const int D32 = D & ~31, D8 = D & ~7;
  for (int d = 0; d < D32; d += 32) {
    __m256 a[RB][4];
    for (int u = 0; u < RB; ++u)
      for (int c = 0; c < 4; ++c) a[u][c] = _mm256_loadu_ps(acc + (int64_t)u * D + d + 8 * c);
    for (int j = 0; j < nb; ++j) {
      __m256 vc[4];
      if (ahead) {  // (the two lines of these 32 floats of the row `ahead` on)
        PK_PREFETCH_R(rows[j] + ahead + d);
        PK_PREFETCH_R(rows[j] + ahead + d + 16);
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) vc[c] = _mm256_loadu_ps(rows[j] + d + 8 * c);
#pragma GCC unroll 2
      for (int u = 0; u < RB; ++u) {
        const __m256 x = _mm256_broadcast_ss(p + u * KB + j);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) a[u][c] = _mm256_fmadd_ps(x, vc[c], a[u][c]);
      }
    }
    for (int u = 0; u < RB; ++u)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + (int64_t)u * D + d + 8 * c, a[u][c]);
  }
  for (int u = 0; u < RB; ++u) {  // the head dim's last D % 32
    const float* pr = p + u * KB;
    float* ar = acc + (int64_t)u * D;
    for (int d = D32; d < D8; d += 8) {
      __m256 a = _mm256_loadu_ps(ar + d);
      for (int j = 0; j < nb; ++j) a = _mm256_fmadd_ps(_mm256_broadcast_ss(pr + j), _mm256_loadu_ps(rows[j] + d), a);
      _mm256_storeu_ps(ar + d, a);
    }
    for (int d = D8; d < D; ++d) {
      float a = ar[d];
      for (int j = 0; j < nb; ++j) a += pr[j] * rows[j][d];
      ar[d] = a;
    }
  }
}

// Two rows at a time when they see the same keys (every pair but a causal block's edge), else one.
PK_TARGET_AVX2 void pv_avx2(const float* p, int R, int D, const float* const* rows, const int* n, int64_t ahead,
                            float* acc) {
  for (int r = 0; r < R;) {
    // (the prefetches with the last rows only: they see the most keys under a causal mask)
    const bool pair = r + 1 < R && n[r + 1] == n[r];
    const int64_t a = r + (pair ? 2 : 1) >= R ? ahead : 0;
    if (pair) {
      pv_rows_avx2<2>(p + r * KB, D, rows, n[r], a, acc + (int64_t)r * D);
      r += 2;
    } else {
      pv_rows_avx2<1>(p + r * KB, D, rows, n[r], a, acc + (int64_t)r * D);
      r += 1;
    }
  }
}

PK_TARGET_AVX2 void widen_avx2(const void* const* src, pk::DType dt, int nb, int D, int64_t ahead, float* dst) {
  const int D8 = D & ~7;
  for (int j = 0; j < nb; ++j) {
    const uint16_t* s = static_cast<const uint16_t*>(src[j]);
    float* o = dst + (int64_t)j * D;
    for (int d = 0; d < D8; d += 8) {
      if (ahead && (d & 31) == 0) PK_PREFETCH_R(s + ahead + d);  // (a 64-byte line: 32 elements)
      _mm256_storeu_ps(o + d, pk::load8_f32(s, dt, d));
    }
    for (int d = D8; d < D; ++d) o[d] = load_f32(s, dt, d);
  }
}
#endif

struct Kernels {
  void (*scores)(const float*, int, int, const float* const*, int, int64_t, float*);
  float (*exp_sum)(float*, int, float);
  float (*row_max)(const float*, int);
  void (*pv)(const float*, int, int, const float* const*, const int*, int64_t, float*);
  void (*widen)(const void* const*, pk::DType, int, int, int64_t, float*);
};

Kernels pick_kernels() {
#if PK_X86
  if (pk::cpu_has_avx2()) return {scores_avx2, exp_sum_avx2, row_max_avx2, pv_avx2, widen_avx2};
#endif
  return {scores_portable, exp_sum_portable, row_max_portable, pv_portable, widen_portable};
}

// One thread's buffers: the group's scaled query rows, a block's scores, widened K/V rows, and the running
// state of the item in progress.
struct Scratch {
  std::vector<float> q, s, kw, vw, acc, m, l;
  std::vector<int> n;  // per row, the keys of the current block it sees
  std::vector<const float*> krow, vrow;
  std::vector<const void*> raw;
  void size_for(int R, int D) {
    q.resize((size_t)R * D);
    s.resize((size_t)R * KB);
    kw.resize((size_t)KB * D);
    vw.resize((size_t)KB * D);
    acc.resize((size_t)R * D);
    m.resize(R);
    l.resize(R);
    n.resize(R);
    krow.resize(KB);
    vrow.resize(KB);
    raw.resize(KB);
  }
};

// Rows of key/value block [j0, j0 + nb) of (b, hk) as float32 pointers: straight into a float32 tensor,
// else widened into buf (prefetching, as it reads each line, the line of the next block's row unless this is
// the chunk's last block: see attend_chunk).
inline void block_rows(const Problem& P, const Kernels& K, const void* base, const int64_t* st, int64_t b,
                       int64_t hk, int64_t j0, int nb, bool last, Scratch& sc, std::vector<float>& buf,
                       std::vector<const float*>& rows) {
  const int64_t off = b * st[0] + hk * st[1];
  if (P.dt == pk::DType::Float32) {
    const float* p = static_cast<const float*>(base) + off;
    for (int j = 0; j < nb; ++j) rows[j] = p + (j0 + j) * st[2];
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + off;
  for (int j = 0; j < nb; ++j) sc.raw[j] = p + (j0 + j) * st[2];
  K.widen(sc.raw.data(), P.dt, nb, (int)P.D, last ? 0 : KB * st[2], buf.data());
  for (int j = 0; j < nb; ++j) rows[j] = buf.data() + (int64_t)j * P.D;
}

// The running state (sc.m, sc.l, sc.acc) of group (b, hk) over keys [c0, c1).
void attend_chunk(const Problem& P, const Kernels& K, int64_t b, int64_t hk, int64_t c0, int64_t c1, Scratch& sc) {
  const int R = (int)P.group_rows(), D = (int)P.D;
  for (int r = 0; r < R; ++r) {  // q rows, scaled once: s = (scale q) . k
    const int64_t h = P.head_of(hk, r), i = r % P.Sq;
    const int64_t off = b * P.qs[0] + h * P.qs[1] + i * P.qs[2];
    for (int d = 0; d < D; ++d) sc.q[(size_t)r * D + d] = load_f32(P.q, P.dt, off + d) * P.scale;
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + (size_t)R * D, 0.f);
  int64_t lim_max = 0;  // the chunk's keys any row sees
  for (int r = 0; r < R; ++r) lim_max = std::max(lim_max, std::min(c1, P.visible(r % P.Sq)));
  // The next block's keys and values, one block (16 KiB of each at D = 128 in float32) ahead, interleaved with
  // the reads of this block: the kernels prefetch the lines of the key (row) KB on as they read a key's
  // (float32: the rows they read are K's and V's own, `ahead` on; 16-bit: as block_rows widens them). The
  // scores and P V loops do it in their main loops (4-key steps, 32-column chunks): a block's last nb % 4
  // keys and the columns past the last multiple of 32 are left to the hardware prefetcher. The whole block at
  // once, before its scores, left no overlap of the loads with the arithmetic (a burst of 512 prefetches
  // stalled the thread ahead of each block): a decode step out of cache took its time in cache plus the
  // time to read the cache (32/8 heads x 1024 keys x D=128 fp32, one thread: 1.0-1.25 ms where the loop in
  // cache took 0.56 and a plain read of the 8 MiB 0.45), now 0.63-0.72 ms (two threads 0.54-0.82 ->
  // 0.38-0.41). None on the chunk's last block: the rows past it are unused cache rows (a slice of a
  // preallocated cache), another chunk's or masked keys.
  const bool direct = P.dt == pk::DType::Float32;
  for (int64_t j0 = c0; j0 < lim_max; j0 += KB) {
    const int nb = (int)std::min<int64_t>(KB, lim_max - j0);
    const bool last = j0 + KB >= lim_max;
    const int64_t k_ahead = direct && !last ? KB * P.ks[2] : 0, v_ahead = direct && !last ? KB * P.vs[2] : 0;
    block_rows(P, K, P.k, P.ks, b, hk, j0, nb, last, sc, sc.kw, sc.krow);
    K.scores(sc.q.data(), R, D, sc.krow.data(), nb, k_ahead, sc.s.data());
    bool any = false;
    for (int r = 0; r < R; ++r) {
      float* sr = sc.s.data() + r * KB;
      const int n = (int)std::clamp<int64_t>(P.visible(r % P.Sq) - j0, 0, nb);
      sc.n[r] = n;
      if (n == 0) continue;
      const float m_new = std::max(sc.m[r], K.row_max(sr, n));  // NaN never wins: it reaches l below
      if (m_new == kNegInf) {  // every score NaN (or -inf): poison the row, the caller recomputes it
        sc.l[r] = std::numeric_limits<float>::quiet_NaN();
        sc.n[r] = 0;
        continue;
      }
      const float alpha = std::exp(sc.m[r] - m_new);  // 0 on the first block (m = -inf)
      const float sum = K.exp_sum(sr, n, m_new);
      sc.l[r] = sc.l[r] * alpha + sum;
      if (alpha != 1.f) {
        float* ar = sc.acc.data() + (size_t)r * D;
        for (int d = 0; d < D; ++d) ar[d] *= alpha;
      }
      sc.m[r] = m_new;
      any = true;
    }
    if (!any) continue;
    block_rows(P, K, P.v, P.vs, b, hk, j0, nb, last, sc, sc.vw, sc.vrow);
    K.pv(sc.s.data(), R, D, sc.vrow.data(), sc.n.data(), v_ahead, sc.acc.data());
  }
}

// Row r of group (b, hk): its output and lse from (m, l, acc); rows that see no key: 0 and -inf.
// Returns 1 when a row that sees keys got a non-finite lse (the caller recomputes).
int write_row(const Problem& P, int64_t b, int64_t hk, int r, float m, float l, const float* acc) {
  const int64_t h = P.head_of(hk, r), i = r % P.Sq;
  const int64_t off = b * P.os[0] + h * P.os[1] + i * P.os[2];
  const bool sees = P.visible(i) > 0;
  const float inv = sees && l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = 0; d < P.D; ++d) store_from_f32(P.out, P.dt, off + d, sees ? acc[d] * inv : 0.f);
  const float lse = sees ? m + std::log(l) : kNegInf;
  P.lse[b * P.ls[0] + h * P.ls[1] + i * P.ls[2]] = lse;
  return sees && !std::isfinite(lse) ? 1 : 0;
}

// Returns the number of rows that see keys whose lse came out non-finite (NaN/inf in q or k).
int64_t decode_forward(const Problem& P, int num_threads, int64_t grain) {
  const int R = (int)P.group_rows(), D = (int)P.D;
  const int64_t groups = P.B * P.Hkv;
  if (groups == 0 || R == 0) return 0;
  const Kernels K = pick_kernels();
  // threads: one per `grain` multiply-adds of the whole problem (waking a thread costs more than a
  // small step); chunks: split-K only when there are fewer groups than threads
  const double work = (double)groups * R * P.Sk * D;
  int T = (int)std::max<double>(1, std::min<double>(num_threads, std::ceil(work / (double)std::max<int64_t>(1, grain))));
  int64_t chunks = 1;
  if (T > 1 && groups < 2 * T && P.Sk > kMinChunkKeys)
    chunks = std::min<int64_t>((2 * T + groups - 1) / groups, (P.Sk + kMinChunkKeys - 1) / kMinChunkKeys);
  const int64_t chunk_keys = std::max<int64_t>(1, (P.Sk + chunks - 1) / chunks);  // S_k = 0: rows see no key
  chunks = std::max<int64_t>(1, (P.Sk + chunk_keys - 1) / chunk_keys);
  const int64_t items = groups * chunks;
  T = (int)std::min<int64_t>(T, items);
  std::vector<Scratch> scratch(T);
  for (auto& sc : scratch) sc.size_for(R, D);
  // split-K partials: per item and row, m, l and acc[D]
  std::vector<float> part(chunks > 1 ? (size_t)items * R * (D + 2) : 0);
  std::atomic<int64_t> bad{0};
  pk::parallel_chunks(items, T, 1, [&](int t, int64_t it0, int64_t it1) {
    Scratch& sc = scratch[t];
    int64_t nbad = 0;
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t g = it / chunks, c = it % chunks, b = g / P.Hkv, hk = g % P.Hkv;
      attend_chunk(P, K, b, hk, c * chunk_keys, std::min(P.Sk, (c + 1) * chunk_keys), sc);
      if (chunks == 1) {
        for (int r = 0; r < R; ++r) nbad += write_row(P, b, hk, r, sc.m[r], sc.l[r], sc.acc.data() + (size_t)r * D);
        continue;
      }
      float* dst = part.data() + (size_t)it * R * (D + 2);
      for (int r = 0; r < R; ++r) {
        float* pr = dst + (size_t)r * (D + 2);
        pr[0] = sc.m[r];
        pr[1] = sc.l[r];
        std::memcpy(pr + 2, sc.acc.data() + (size_t)r * D, sizeof(float) * D);
      }
    }
    bad += nbad;
  });
  if (chunks > 1) {
    pk::parallel_chunks(groups, T, 1, [&](int t, int64_t g0, int64_t g1) {
      std::vector<float> acc(D);
      int64_t nbad = 0;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t b = g / P.Hkv, hk = g % P.Hkv;
        for (int r = 0; r < R; ++r) {
          auto row = [&](int64_t c) { return part.data() + ((size_t)(g * chunks + c) * R + r) * (D + 2); };
          float M = kNegInf;
          bool nan = false;
          for (int64_t c = 0; c < chunks; ++c) {
            M = std::max(M, row(c)[0]);
            nan |= std::isnan(row(c)[1]);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          float L = nan ? std::numeric_limits<float>::quiet_NaN() : 0.f;
          if (M != kNegInf && !nan) {
            for (int64_t c = 0; c < chunks; ++c) {
              const float* pr = row(c);
              if (pr[0] == kNegInf) continue;  // a chunk this row sees no key of
              const float w = std::exp(pr[0] - M);
              L += pr[1] * w;
              for (int d = 0; d < D; ++d) acc[d] += pr[2 + d] * w;
            }
          }
          nbad += write_row(P, b, hk, r, M, L, acc.data());
        }
      }
      bad += nbad;
    });
  }
  return bad.load();
}

// ---------------------------------------------------------------------------------------------------------
// Prefill forward in bfloat16 with AVX-512 BF16 dot products (the "bf16dot" impl of flash_attention).
//
// Why: aten's CPU flash kernel computes a bfloat16 problem at the fp32 rate (2-core Zen 4: ~180 GFLOP/s
// for both dtypes at S = 2048, D = 128), while vdpbf16ps does 32 bfloat16 multiply-adds into 16 fp32
// lanes per instruction, twice the fp32 FMA rate (torch's own bf16 GEMM: ~420 GFLOP/s on that machine).
// The arithmetic is FlashAttention-2's (Dao 2023) with aten's precision choices for reduced types: scores
// and the online softmax in fp32, the probabilities rounded to bfloat16 (round to nearest even) for the
// P V product, which accumulates in fp32, out rounded once at the end; lse = m + log(l) in fp32.
//
// Layout: K and V of a (batch, KV head) are packed once per call into the operand order vdpbf16ps wants
// (every query head of a GQA group reads the same packed copy):
//   Kp: keys in groups of 16: [Skp / 16][D / 2][16] 32-bit words, word (g, t, l) = (k[16g + l][2t],
//       k[16g + l][2t + 1]): S[i][16g + l] = sum_t dot2(q[i] pair t, word (g, t, l)) -- a lane per key;
//   Vp: key pairs: [Skp / 2][D] words, word (u, d) = (v[2u][d], v[2u + 1][d]): out[i][d] += sum_u
//       dot2(p[i] pair u, word (u, d)) -- a lane per output column;
// padded with zero keys up to Skp (a multiple of PF_BN; their scores are masked, their p is 0).
// vdpbf16ps reads subnormal bf16 inputs as 0 and flushes subnormal results (products and running sums) to 0,
// whatever MXCSR says: calls whose q, k, v (or dout) hold a tiny value (tiny_bf16), or whose |scale| * D
// exceeds 2^80 (kMaxScaledD), take an exact path instead. Probabilities below 2^-126 (scores ~87 below their row's maximum) are 0 here,
// as in aten's kernels: only a value near float32's range could make such a term count.
// Work items: (batch, query head, block of PF_BM query rows), heaviest (last, under a causal mask) first;
// each streams the key blocks its rows see (bottom-right causal: row i sees keys j <= i + Sk - Sq).
// ---------------------------------------------------------------------------------------------------------
constexpr int PF_BM = 64;  // query rows per work item
constexpr int PF_BN = 64;  // keys per block: 4 groups of 16 lanes
constexpr int PF_RQ = 6;   // query rows per register tile (6 x 4 accumulators of 16 lanes)
constexpr int64_t kTinyInput = -2;  // prefill_forward / prefill_backward: an input holds a tiny value, or the
                                    // scale is too large (see tiny_bf16): nothing computed, an exact path follows
// |scale| * D above this takes an exact path: a dot product whose running sum cancels below 2^-126 loses
// under 2^-126 per flushed add (at most D of them), so a score is off by under |scale| * D * 2^-126 <= 2^-46,
// far below float32's rounding of a score that matters (audit finding: q ~1e-19, k ~1e-20 at scale 3e38,
// whose products vdpbf16ps flushed, gave uniform probabilities for scores from -11 to 10).
constexpr double kMaxScaledD = 0x1p80;

// D values the kernel takes: the P V tile holds 64 output columns (4 registers) per row
inline bool prefill_head_dim_ok(int64_t D) { return D > 0 && D % 64 == 0 && D <= 512; }

#if PK_X86
#ifdef PK_EMULATE_AVX512
// A test build (tests/test_attention_avx512_emulated.py): the AVX-512 intrinsics below become the scalar
// versions of tests/avx512_emulation/avx512_emu.h, so the bf16dot kernels' logic runs and is tested on
// CPUs without AVX-512 BF16 (CI's machines may lack it); never a build users get.
#define PK_TARGET_AVX512BF16
inline bool bf16dot_cpu() { return true; }
#else
#define PK_TARGET_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,bmi,bmi2,popcnt,f16c")))
inline bool bf16dot_cpu() { return pk::cpu_has_avx512bf16(); }
#endif

// Whether bf16 x[0, n) (n a multiple of 32) holds a tiny value: |x| < 2^-50, not 0. vdpbf16ps reads subnormal
// inputs as 0 and flushes subnormal products to 0 whatever MXCSR says; products of two values of at least
// 2^-50 are at least 2^-100, normal, so with every nonzero input that large only sums that cancel below
// 2^-126 lose anything (bounded by kMaxScaledD). A call with a tiny value takes an exact path (audit
// findings: a subnormal q component times a key component near 1e38 is an ordinary score; q ~1e-19 times k
// ~1e-20 flushed at scale 3e38). Real activations and gradients in bf16 are far above 2^-50 (~9e-16).
constexpr uint16_t kTinyBits = (127 - 50) << 7;  // bf16 magnitude bits of 2^-50
PK_TARGET_AVX512BF16 inline __mmask32 tiny_lanes(__m512i x) {  // 32 bf16 values
  const __m512i a = _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF));
  return _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(a, a), a, _mm512_set1_epi16(kTinyBits));
}
PK_TARGET_AVX512BF16 inline __mmask16 tiny_lanes(__m256i x) {  // 16 bf16 values
  const __m256i a = _mm256_and_si256(x, _mm256_set1_epi16(0x7FFF));
  return _mm256_mask_cmplt_epu16_mask(_mm256_test_epi16_mask(a, a), a, _mm256_set1_epi16(kTinyBits));
}
PK_TARGET_AVX512BF16 inline bool tiny_bf16(const uint16_t* x, int64_t n) {
  __mmask32 any = 0;
  for (int64_t i = 0; i < n; i += 32) any |= tiny_lanes(_mm512_loadu_si512(x + i));
  return any != 0;
}

// Rows [0, n) of a bf16 matrix (row stride `stride` elements, D columns) in the "lane per row" layout of
// Kp: groups of 16 rows, [npad / 16][D / 2][16] 32-bit words, word (g, t, l) = (x[16g + l][2t],
// x[16g + l][2t + 1]); rows n..npad are zero. A full group's words t are one gather of 16 rows (byte
// offsets in 32 bits; the scalar loop where they do not fit or the group is partial).
PK_TARGET_AVX512BF16 bool pack_lanes(const uint16_t* x, int64_t stride, int64_t n, int64_t npad, int64_t D,
                                     uint32_t* dst) {
  const int64_t D2 = D / 2;
  __mmask32 tiny = 0;  // (returned: some row holds a tiny value)
  const bool gather = stride >= 0 && stride * 2 * 15 < (int64_t(1) << 31);
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(gather ? stride * 2 : 0)));
  for (int64_t g = 0; g < npad / 16; ++g) {
    uint32_t* out = dst + g * D2 * 16;
    if (gather && g * 16 + 16 <= n) {
      const char* base = reinterpret_cast<const char*>(x + g * 16 * stride);
      for (int64_t t = 0; t < D2; ++t) {
        const __m512i words = _mm512_i32gather_epi32(rows16, base + 4 * t, 1);
        tiny |= tiny_lanes(words);
        _mm512_storeu_si512(out + t * 16, words);
      }
      continue;
    }
    for (int l = 0; l < 16; ++l) {
      const int64_t j = g * 16 + l;
      if (j < n) {
        const uint16_t* row = x + j * stride;
        tiny |= tiny_bf16(row, D) ? 1 : 0;
        for (int64_t t = 0; t < D2; ++t) std::memcpy(out + t * 16 + l, row + 2 * t, 4);
      } else {
        for (int64_t t = 0; t < D2; ++t) out[t * 16 + l] = 0;
      }
    }
  }
  return tiny != 0;
}

// Rows [0, n) of a bf16 matrix in the "row pairs" layout of Vp: [npad / 2][D] words, word (u, d) =
// (x[2u][d], x[2u + 1][d]); rows n..npad are zero. Two rows widened to 32-bit lanes and merged, 16 columns
// at a time (D a multiple of 16).
PK_TARGET_AVX512BF16 bool pack_pairs(const uint16_t* x, int64_t stride, int64_t n, int64_t npad, int64_t D,
                                     uint32_t* dst) {
  __mmask16 tiny = 0;  // (returned: some row holds a tiny value)
  for (int64_t u = 0; u < npad / 2; ++u) {
    uint32_t* out = dst + u * D;
    const uint16_t* r0 = 2 * u < n ? x + 2 * u * stride : nullptr;
    const uint16_t* r1 = 2 * u + 1 < n ? x + (2 * u + 1) * stride : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i a = r0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d)) : _mm256_setzero_si256();
      const __m256i b = r1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d)) : _mm256_setzero_si256();
      tiny |= tiny_lanes(a) | tiny_lanes(b);
      _mm512_storeu_si512(out + d, _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                                   _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
  }
  return tiny != 0;
}

// Kp and Vp of (b, hk) (layout above); true where K or V holds a tiny value.
PK_TARGET_AVX512BF16 bool pack_kv(const Problem& P, int64_t b, int64_t hk, int64_t Skp, uint32_t* kp, uint32_t* vp) {
  const bool sk = pack_lanes(static_cast<const uint16_t*>(P.k) + b * P.ks[0] + hk * P.ks[1], P.ks[2], P.Sk, Skp,
                             P.D, kp);
  return pack_pairs(static_cast<const uint16_t*>(P.v) + b * P.vs[0] + hk * P.vs[1], P.vs[2], P.Sk, Skp, P.D, vp) || sk;
}

// f(std::integral_constant<int, n>) for n in 1..4 (a tile's 16-lane groups or column vectors)
template <class F>
inline void fma512_width(int n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// R rows of scores s[r][0..16 NG) = scale * q_r . k_j for the first NG 16-key groups of a block (64 keys: a
// causal diagonal block's first tiles need fewer): q32 rows of D/2 words (D2 apart), kp the block's first
// 16-key group (groups gstride words apart).
template <int R, int NG = 4>
PK_TARGET_AVX512BF16 inline void pf_scores(const uint32_t* q32, int D2, const uint32_t* kp, int64_t gstride,
                                           float scale, float* s) {
  __m512 acc[R][NG];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NG; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int t = 0; t < D2; ++t) {
    __m512bh kv[NG];
#pragma GCC unroll 4
    for (int c = 0; c < NG; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + c * gstride + t * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q32[r * D2 + t]);
#pragma GCC unroll 4
      for (int c = 0; c < NG; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NG; ++c) _mm512_storeu_ps(s + r * PF_BN + 16 * c, _mm512_mul_ps(acc[r][c], vs));
}

// pf_scores of the groups that hold the first n keys of the block (n >= 1)
template <int R>
PK_TARGET_AVX512BF16 inline void pf_scores_n(const uint32_t* q32, int D2, const uint32_t* kp, int64_t gstride,
                                             float scale, int n, float* s) {
  fma512_width((n + 15) / 16, [&](auto NG) { pf_scores<R, decltype(NG)::value>(q32, D2, kp, gstride, scale, s); });
}

// R rows of o[r][d0..d0+64) += sum over pairs u < nu of word p32[r * rs + u * us] . v pair u (vp: the block's
// first pair, pairs D words apart; o: rows D floats apart). The forward's P V (rs = PF_BN / 2, us = 1: a
// row's probabilities of key pairs); the backward's P^T dO and dS^T Q (rs = 1, us = PF_BN: pairs of query
// rows of a key's column) and dS K.
// acc[r][0..4) += word p32[r * rs] . (v pair vu, 64 columns, ANDed with `keep`) for R rows
template <int R>
PK_TARGET_AVX512BF16 inline void pf_pv_pair(__m512 (&acc)[R][4], const uint32_t* p32, int64_t rs, const uint32_t* vu,
                                            __m512i keep) {
  const __m512bh v0 = (__m512bh)_mm512_and_si512(_mm512_loadu_si512(vu), keep);  // (ones: the AND folds away)
  const __m512bh v1 = (__m512bh)_mm512_and_si512(_mm512_loadu_si512(vu + 16), keep);
  const __m512bh v2 = (__m512bh)_mm512_and_si512(_mm512_loadu_si512(vu + 32), keep);
  const __m512bh v3 = (__m512bh)_mm512_and_si512(_mm512_loadu_si512(vu + 48), keep);
  for (int r = 0; r < R; ++r) {
    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p32[r * rs]);
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pb, v2);
    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pb, v3);
  }
}

// `first_of_last`: the last pair's second row is read as 0 (a key no row of the tile sees: its p is 0, and
// 0 * NaN would be NaN).
template <int R>
PK_TARGET_AVX512BF16 inline void pf_pv(const uint32_t* p32, int64_t rs, int64_t us, const uint32_t* vp, int64_t D,
                                       int nu, float* o, bool first_of_last = false) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  const int full = first_of_last ? nu - 1 : nu;
  for (int u = 0; u < full; ++u) pf_pv_pair<R>(acc, p32 + u * us, rs, vp + u * D, _mm512_set1_epi32(-1));
  if (full < nu) pf_pv_pair<R>(acc, p32 + full * us, rs, vp + full * D, _mm512_set1_epi32(0xFFFF));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// exp256 16 lanes at a time (the same range reduction and polynomial, NaN and underflow behaviour).
PK_TARGET_AVX512BF16 inline __m512 exp512(__m512 x) {
  using namespace expf_c;
  const __m512 hi = _mm512_set1_ps(kHi), lo = _mm512_set1_ps(kLo);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(hi, x);  // min/max(c, x): NaN in x stays (the second operand is returned)
  x = _mm512_max_ps(lo, x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), f);
  __m512 y = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kP[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps((__mmask16)~underflow, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

// The lanes of 16 scores from j that lie before n.
inline __mmask16 pf_live(int j, int n) {
  return j >= n ? 0 : n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
}

// max of s[0, n) (n <= PF_BN); a NaN never wins (max_ps(x, m) returns m where x is NaN), -inf for n = 0
PK_TARGET_AVX512BF16 inline float pf_row_max(const float* s, int n) {
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int j = 0; j < n; j += 16)  // (the groups that hold live lanes)
    m = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), pf_live(j, n), s + j), m);
  return _mm512_reduce_max_ps(m);
}

// p[0, width) = bf16(exp(s[j] - m)) for j < n, 0 beyond (keys the row does not see, and the padding), two
// keys a word; returns the sum of the fp32 exponentials (the softmax's denominator is not rounded to bf16).
// width: the block's keys rounded up to 16, all that the P V tiles read.
PK_TARGET_AVX512BF16 inline float pf_exp_row(const float* s, int n, int width, float m, uint32_t* p) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < width; j += 16) {
    const __mmask16 live = pf_live(j, n);
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), vm)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j / 2), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

// The scalar part of one row's online-softmax update for a key block (FlashAttention-2): from the maximum
// of the block's n visible scores (NaN never wins it: a NaN reaches l through its exponential), the new
// running max and alpha = exp(m - m_new), the factor of the row's sum and output so far (0 on its first
// block). False where the row takes nothing from the block (the caller clears its p): no visible key, or a
// poisoned row (every score so far -inf or NaN: l = NaN, and the caller recomputes the row exactly).
inline bool softmax_takes(float& l, int n, float m_new) {
  if (n == 0 || std::isnan(l) || m_new == kNegInf) {
    if (n > 0 && m_new == kNegInf) l = std::numeric_limits<float>::quiet_NaN();
    return false;
  }
  return true;
}
inline bool softmax_step(float m, float& l, int n, float block_max, float* m_new, float* alpha) {
  *m_new = n > 0 ? std::max(m, block_max) : m;
  if (!softmax_takes(l, n, *m_new)) return false;
  *alpha = std::exp(m - *m_new);
  return true;
}

// Rows [0, rows) in register tiles of PF_RQ (a shorter last tile).
template <class F>
inline void pf_row_tiles(int rows, F&& f) {
  int r = 0;
  for (; r + PF_RQ <= rows; r += PF_RQ) f(r, std::integral_constant<int, PF_RQ>{});
  switch (rows - r) {
    case 5: f(r, std::integral_constant<int, 5>{}); break;
    case 4: f(r, std::integral_constant<int, 4>{}); break;
    case 3: f(r, std::integral_constant<int, 3>{}); break;
    case 2: f(r, std::integral_constant<int, 2>{}); break;
    case 1: f(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// A buffer of the calling thread kept between calls while it is at most `keep` bytes: a fresh one per call
// cost its page faults every time (the bf16dot forward: ~1 ms of a ~3 ms call at 32/8 heads x 1024 keys x
// D = 128); a larger call's compute dwarfs them (and a thread that made one keeps nothing of it).
template <class T>
struct KeptBuffer {
  std::unique_ptr<T[]> data;  // (not value-initialized: callers write every element they read)
  size_t size = 0;
  T* get(size_t n) {
    if (size < n) {
      data.reset();
      size = 0;  // (a failed new leaves an empty buffer, not a null one of the old size: review finding)
      data.reset(new T[n]);
      size = n;
    }
    return data.get();
  }
  struct Trim {  // at the end of the call: releases the buffer where it grew past `keep` bytes
    KeptBuffer& buf;
    size_t keep;
    ~Trim() {
      if (buf.size * sizeof(T) > keep) {
        buf.data.reset();
        buf.size = 0;
      }
    }
  };
};

// A prefill forward's work items, (batch, query head, block of PF_BM query rows), heaviest (last, under a
// causal mask) first, on up to T threads, each with a Scratch of its own (scratch: made here, sized by
// size_for(D), left to the caller to read); item(scratch, KV group, b, h, first row, rows) returns the rows
// it found bad. Returns their sum.
template <class Scratch, class Item>
int64_t run_prefill_items(const Problem& P, int T, std::vector<Scratch>& scratch, Item&& item) {
  const int64_t qblocks = (P.Sq + PF_BM - 1) / PF_BM, items = P.B * P.H * qblocks;
  scratch.resize((size_t)std::min<int64_t>(T, items));
  for (auto& sc : scratch) sc.size_for(P.D);
  std::atomic<int64_t> bad{0};
  pk::parallel_chunks(items, (int)scratch.size(), 1, [&](int t, int64_t it0, int64_t it1) {
    int64_t nbad = 0;
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t qb = qblocks - 1 - it % qblocks, bh = it / qblocks, b = bh / P.H, h = bh % P.H;
      const int64_t g = b * P.Hkv + h / (P.H / P.Hkv), i0 = qb * PF_BM;
      nbad += item(scratch[t], g, b, h, i0, (int)std::min<int64_t>(PF_BM, P.Sq - i0));
    }
    bad += nbad;
  });
  return bad.load();
}

struct PrefillScratch {
  std::vector<uint32_t> q32;  // the item's query rows, bf16 pairs [PF_BM][D/2]
  std::vector<float> s, o, m, l;
  std::vector<uint32_t> p;    // probabilities in bf16 [PF_BM][PF_BN] (pairs of keys per word)
  bool tiny = false;  // a query row of this thread's items held a tiny value (tiny_bf16)
  void size_for(int64_t D) {
    q32.resize((size_t)PF_BM * D / 2);
    s.resize((size_t)PF_BM * PF_BN);
    o.resize((size_t)PF_BM * D);
    m.resize(PF_BM);
    l.resize(PF_BM);
    p.resize((size_t)PF_BM * PF_BN / 2);
  }
};

// One work item: query rows [i0, i0 + rows) of head h (batch b). Returns the rows that see keys but got a
// non-finite lse.
PK_TARGET_AVX512BF16 int64_t prefill_item(const Problem& P, const uint32_t* kp, const uint32_t* vp, int64_t b,
                                          int64_t h, int64_t i0, int rows, PrefillScratch& sc) {
  const int64_t D = P.D, D2 = D / 2;
  const uint16_t* qb = static_cast<const uint16_t*>(P.q) + b * P.qs[0] + h * P.qs[1];
  for (int r = 0; r < rows; ++r) std::memcpy(sc.q32.data() + (size_t)r * D2, qb + (i0 + r) * P.qs[2], D * 2);
  sc.tiny = sc.tiny || tiny_bf16(reinterpret_cast<const uint16_t*>(sc.q32.data()), rows * D);
  std::fill(sc.o.begin(), sc.o.begin() + (size_t)rows * D, 0.f);
  for (int r = 0; r < rows; ++r) {
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
  const int64_t hi = P.visible(i0 + rows - 1);  // the keys the item's last (most seeing) row sees
  const int64_t gstride = D2 * 16;
  for (int64_t j0 = 0; j0 < hi; j0 += PF_BN) {
    const int nb = (int)std::min<int64_t>(PF_BN, hi - j0), width = (nb + 15) / 16 * 16;
    const uint32_t* kblk = kp + (j0 / 16) * gstride;
    // the keys a tile's rows see (its last row sees the most): a causal diagonal block's first tiles skip the
    // rest, in the scores (left as they were: never used) and in P V below
    const auto tile_keys = [&](int r0, int R) {
      return (int)std::clamp<int64_t>(P.visible(i0 + r0 + R - 1) - j0, 0, nb);
    };
    pf_row_tiles(rows, [&](int r0, auto R) {
      const int n = tile_keys(r0, decltype(R)::value);
      if (n > 0)
        pf_scores_n<decltype(R)::value>(sc.q32.data() + (size_t)r0 * D2, (int)D2, kblk, gstride, P.scale, n,
                                        sc.s.data() + (size_t)r0 * PF_BN);
    });
    for (int r = 0; r < rows; ++r) {
      const float* sr = sc.s.data() + (size_t)r * PF_BN;
      uint32_t* pr = sc.p.data() + (size_t)r * (PF_BN / 2);
      const int n = (int)std::clamp<int64_t>(P.visible(i0 + r) - j0, 0, nb);
      float m_new, alpha;
      if (!softmax_step(sc.m[r], sc.l[r], n, n > 0 ? pf_row_max(sr, n) : kNegInf, &m_new, &alpha)) {
        std::memset(pr, 0, sizeof(uint32_t) * (width / 2));
        continue;
      }
      sc.l[r] = sc.l[r] * alpha + pf_exp_row(sr, n, width, m_new, pr);
      if (alpha != 1.f) {
        float* orow = sc.o.data() + (size_t)r * D;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
      }
      sc.m[r] = m_new;
    }
    const uint32_t* vblk = vp + (j0 / 2) * D;
    pf_row_tiles(rows, [&](int r0, auto R) {
      // (so a tile never multiplies a value none of its rows sees by p = 0)
      const int n = tile_keys(r0, decltype(R)::value);
      if (n == 0) return;
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        pf_pv<decltype(R)::value>(sc.p.data() + (size_t)r0 * (PF_BN / 2), PF_BN / 2, 1,
                                  vblk + d0, D, (n + 1) / 2, sc.o.data() + (size_t)r0 * D + d0, n % 2 == 1);
    });
  }
  // out = o / l in bf16 (round to nearest even), lse = m + log(l); rows that see no key: 0 and -inf
  int64_t bad = 0;
  uint16_t* ob = static_cast<uint16_t*>(P.out) + b * P.os[0] + h * P.os[1];
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    const bool sees = P.visible(i) > 0;
    const float l = sc.l[r], inv = sees && l > 0.f ? 1.f / l : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const float* orow = sc.o.data() + (size_t)r * D;
    uint16_t* dst = ob + i * P.os[2];
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = sees ? _mm512_mul_ps(_mm512_loadu_ps(orow + d), vinv) : _mm512_setzero_ps();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
    }
    const float lse = sees ? sc.m[r] + std::log(l) : kNegInf;
    P.lse[b * P.ls[0] + h * P.ls[1] + i * P.ls[2]] = lse;
    bad += sees && !std::isfinite(lse) ? 1 : 0;
  }
  return bad;
}
#endif

// Returns the number of rows that see keys whose lse came out non-finite; -1 when this CPU lacks the
// instructions or D is not a multiple of 64 (the caller takes another impl); kTinyInput when q, k or v
// holds a tiny value or |scale| * D > kMaxScaledD (nothing computed: the caller takes an exact path).
int64_t prefill_forward(const Problem& P, int num_threads) {
#if PK_X86
  if (!bf16dot_cpu() || P.dt != pk::DType::BFloat16 || !prefill_head_dim_ok(P.D)) return -1;
  const int64_t D = P.D;
  if (P.B * P.H == 0 || P.Sq == 0) return 0;
  if (!(std::fabs((double)P.scale) * (double)D <= kMaxScaledD)) return kTinyInput;
  const int64_t Skp = std::max<int64_t>(PF_BN, (P.Sk + PF_BN - 1) / PF_BN * PF_BN);
  const int64_t kv_words = Skp * D / 2;  // per (b, hk), each of Kp and Vp
  const int64_t groups = P.B * P.Hkv;
  // the packed copies: in a buffer of the calling thread kept up to 16 MiB (see KeptBuffer)
  thread_local KeptBuffer<uint32_t> packed;
  uint32_t* const kp = packed.get((size_t)(2 * groups * kv_words));
  const typename KeptBuffer<uint32_t>::Trim trim{packed, size_t(16) << 20};
  uint32_t* const vp = kp + groups * kv_words;
  const int T = std::max(1, num_threads);
  std::atomic<bool> tiny{false};
  pk::parallel_chunks(groups, std::min<int64_t>(T, groups), 1, [&](int, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g / P.Hkv, hk = g % P.Hkv;
      if (pack_kv(P, b, hk, Skp, kp + g * kv_words, vp + g * kv_words)) tiny = true;
    }
  });
  if (tiny) return kTinyInput;
  std::vector<PrefillScratch> scratch;
  const int64_t bad = run_prefill_items(P, T, scratch, [&](PrefillScratch& sc, int64_t g, int64_t b, int64_t h,
                                                           int64_t i0, int rows) {
    return prefill_item(P, kp + g * kv_words, vp + g * kv_words, b, h, i0, rows, sc);
  });
  for (const auto& sc : scratch)
    if (sc.tiny) return kTinyInput;
  return bad;
#else
  (void)P;
  (void)num_threads;
  return -1;
#endif
}

// ---------------------------------------------------------------------------------------------------------
// Prefill forward with fp32 FMAs on AVX2 (the "fma" impl of flash_attention): FlashAttention-2's forward
// (Dao 2023, Algorithm 1) for float32 inputs, and bfloat16 / float16 inputs widened to fp32 as they are packed.
//
// Why: aten's CPU flash kernel multiplies its blocks with the BLAS's sgemm, and MKL's sgemm ran at about half
// of the FMA peak on a 2-core Zen 2 (~100 of the 200 GFLOP/s that FMA chains reach there; see
// runtime_cpu.cpp's fma_peak_gflops), in small blocks less. Register tiles of 6 query rows x 16 keys (scores)
// and 6 rows x 16 output columns (P V), 12 ymm accumulators each, keep both products at the FMA rate.
//
// Everything is fp32: scores (scaled after the dot product, as aten does), the online softmax (exp256), P,
// the P V accumulation; out = o / l rounded once to the output dtype, lse = m + log(l).
// Layout, per (batch, KV head), packed once per call (every query head of a GQA group reads the same copy):
//   Kf: keys in groups of 8, [Skp / 8][D][8] floats, (g, d, l) = k[8g + l][d]: S[i][8g + l] accumulates
//       q[i][d] * (g, d, l) over d -- a lane per key, q broadcast;
//   Vf: [Skp][D] floats, v's rows: o[i][d] accumulates p[i][j] * Vf[j][d] -- a lane per output column.
// Padded with zero keys up to Skp (a multiple of FM_BN). Work items as the bf16dot forward's (64 query rows of
// one head, heaviest first); the caller checks the rows' lse and recomputes non-finite problems exactly.
// ---------------------------------------------------------------------------------------------------------
constexpr int FM_BN = 64;  // keys per block (8 groups of 8 lanes); register tiles of PF_RQ query rows

inline bool fma_head_dim_ok(int64_t D) { return D > 0 && D % 16 == 0 && D <= 512; }

#if PK_X86
// Rows [0, n) of one (batch, head) slice of x (dtype dt, from element `base`, rows `stride` apart, D columns)
// as fp32 keys in groups of `lanes` (8 or 16: the AVX2 or the AVX-512 tier), [npad / lanes][D][lanes] floats,
// (g, d, l) = x[g lanes + l][d] (Kf's layout); rows n..npad are zero.
PK_TARGET_AVX2 void fma_pack_lanes(const void* x, pk::DType dt, int64_t base, int64_t stride, int64_t n, int64_t npad,
                                   int64_t D, int lanes, float* out) {
  for (int64_t g = 0; g < npad / lanes; ++g) {
    float* og = out + g * D * lanes;
    for (int half = 0; half < lanes; half += 8)  // 8 rows at a time: one 8 x 8 transpose per 8 columns
      for (int64_t d = 0; d < D; d += 8) {
        __m256 r[8];
        for (int l = 0; l < 8; ++l) {
          const int64_t j = g * lanes + half + l;
          r[l] = j < n ? pk::load8_f32(x, dt, base + j * stride + d) : _mm256_setzero_ps();
        }
        pk::transpose8_ps(r);
        for (int t = 0; t < 8; ++t) _mm256_storeu_ps(og + (d + t) * lanes + half, r[t]);
      }
  }
}

// The same rows as fp32 rows, [npad][D] floats (Vf's layout); rows n..npad are zero.
PK_TARGET_AVX2 void fma_pack_rows(const void* x, pk::DType dt, int64_t base, int64_t stride, int64_t n, int64_t npad,
                                  int64_t D, float* out) {
  for (int64_t j = 0; j < npad; ++j)
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + j * D + d, j < n ? pk::load8_f32(x, dt, base + j * stride + d) : _mm256_setzero_ps());
}

// Kf and Vf of (b, hk) (layout above; keys in groups of `lanes`)
PK_TARGET_AVX2 void fma_pack_kv(const Problem& P, int64_t b, int64_t hk, int64_t Skp, int lanes, float* kf,
                                float* vf) {
  fma_pack_lanes(P.k, P.dt, b * P.ks[0] + hk * P.ks[1], P.ks[2], P.Sk, Skp, P.D, lanes, kf);
  fma_pack_rows(P.v, P.dt, b * P.vs[0] + hk * P.vs[1], P.vs[2], P.Sk, Skp, P.D, vf);
}

// R rows of s[r][16c .. 16c + 16) = scale * q_r . k_j for the 16 keys of groups kg, kg + 1 (q rows D apart)
// (the row loops unrolled: with a loop left over rows GCC kept the 12 accumulators in memory, a store
// per FMA: 22 GFLOP/s)
template <int R>
PK_TARGET_AVX2 inline void fma_scores16(const float* q, int64_t D, const float* kg, float scale, float* s) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* kg1 = kg + D * 8;
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kg + d * 8), k1 = _mm256_loadu_ps(kg1 + d * 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
    }
  }
  const __m256 vs = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * FM_BN, _mm256_mul_ps(acc[r][0], vs));
    _mm256_storeu_ps(s + r * FM_BN + 8, _mm256_mul_ps(acc[r][1], vs));
  }
}

// R rows of o[r][d0 .. d0 + 16) += sum over j < n of p[r * rs + j * us] * v[j][d0 ..] (v and o rows D apart, v at
// its first row and column d0; the forward's P V: rs = FM_BN, us = 1; the backward's: see fma512_pv)
template <int R>
PK_TARGET_AVX2 inline void fma_pv16(const float* p, int64_t rs, int64_t us, const float* v, int64_t D, int n,
                                    float* o) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(o + r * D);
    acc[r][1] = _mm256_loadu_ps(o + r * D + 8);
  }
  for (int j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * D), v1 = _mm256_loadu_ps(v + j * D + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p + r * rs + j * us);
      acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * D, acc[r][0]);
    _mm256_storeu_ps(o + r * D + 8, acc[r][1]);
  }
}

// p[0, width) = exp(s[j] - m) for j < n, 0 beyond (keys the row does not see, the padding: whatever their
// scores, even NaN); returns the sum. width: the block's keys rounded up to the lanes (8 here, 16 in
// fma512_exp_row), all that the P V tiles read (a block of 32 keys, a short sequence or the last block, took
// the exponentials of 64)
PK_TARGET_AVX2 inline float fma_exp_row(const float* s, int n, int width, float m, float* p) {
  const __m256 vm = _mm256_set1_ps(m);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < width; j += 8) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), lane));
    const __m256 e = _mm256_and_ps(live, exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(p + j, e);
  }
  return hsum256(sum);
}

struct FmaScratch {
  std::vector<float> q, s, p, o, m, l;
  std::vector<float> m_new, alpha;  // (the AVX-512 tier's softmax passes)
  std::vector<int> n;
  void size_for(int64_t D) {
    m_new.resize(PF_BM);
    alpha.resize(PF_BM);
    n.resize(PF_BM);
    q.resize((size_t)PF_BM * D);
    s.resize((size_t)PF_BM * FM_BN);
    p.resize((size_t)PF_BM * FM_BN);
    o.resize((size_t)PF_BM * D);
    m.resize(PF_BM);
    l.resize(PF_BM);
  }
};

// The start of a work item: query rows [i0, i0 + rows) of head h (batch b) as fp32 into sc.q, o = 0, m = -inf,
// l = 0 (both tiers).
PK_TARGET_AVX2 inline void fma_start_item(const Problem& P, int64_t b, int64_t h, int64_t i0, int rows,
                                          FmaScratch& sc) {
  const int64_t D = P.D;
  const int64_t qbase = b * P.qs[0] + h * P.qs[1];
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(sc.q.data() + r * D + d, pk::load8_f32(P.q, P.dt, qbase + (i0 + r) * P.qs[2] + d));
  std::fill(sc.o.begin(), sc.o.begin() + (size_t)rows * D, 0.f);
  for (int r = 0; r < rows; ++r) {
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
}

// The end of a work item: out = o / l in the output dtype, lse = m + log(l); rows that see no key: 0 and -inf.
// Returns the rows that see keys but got a non-finite lse (both tiers).
PK_TARGET_AVX2 inline int64_t fma_finish_item(const Problem& P, int64_t b, int64_t h, int64_t i0, int rows,
                                              const FmaScratch& sc) {
  const int64_t D = P.D;
  int64_t bad = 0;
  const int64_t obase = b * P.os[0] + h * P.os[1];
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    const bool sees = P.visible(i) > 0;
    const float l = sc.l[r], inv = sees && l > 0.f ? 1.f / l : 0.f;
    const float* orow = sc.o.data() + (size_t)r * D;
    const int64_t dst = obase + i * P.os[2];
    if (P.dt == pk::DType::Float32) {
      float* o32 = static_cast<float*>(P.out) + dst;
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(o32 + d, sees ? _mm256_mul_ps(_mm256_loadu_ps(orow + d), vinv) : _mm256_setzero_ps());
    } else {
      for (int64_t d = 0; d < D; ++d) store_from_f32(P.out, P.dt, dst + d, sees ? orow[d] * inv : 0.f);
    }
    const float lse = sees ? sc.m[r] + std::log(l) : kNegInf;
    P.lse[b * P.ls[0] + h * P.ls[1] + i * P.ls[2]] = lse;
    bad += sees && !std::isfinite(lse) ? 1 : 0;
  }
  return bad;
}

// ---------------------------------------------------------------------------------------------------------
// The AVX-512 tier of the fma kernel, where the bf16dot kernels run (the same target, so the same emulation
// build tests it on CPUs without AVX-512: tests/test_attention_avx512_emulated.py). Same arithmetic and
// layout but keys in groups of 16 lanes, register tiles of 6 rows x 64 keys (scores) and 6 rows x 64 output
// columns (P V) in 24 zmm accumulators, and the softmax 16 lanes at a time. Why: on a 2-core Zen 4 the AVX2
// tier ran its two products at ~82% of the FMA peak and its softmax took ~22% of the time (one thread,
// 8 heads x S=1024 x D=64); a 6 x 64 tile loads each key / value vector once per 6 rows and each broadcast
// once per 64 lanes (against once per 16), and the softmax has half the instructions.
// ---------------------------------------------------------------------------------------------------------
// R rows of s[r][0, 16 NG) = scale * q_r . k_j for the keys of the NG 16-key groups from kg (each D x 16
// floats; q rows D apart, s rows FM_BN apart)
template <int R, int NG>
PK_TARGET_AVX512BF16 inline void fma512_scores(const float* q, int64_t D, const float* kg, float scale, float* s) {
  __m512 acc[R][NG];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NG; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[NG];
#pragma GCC unroll 4
    for (int c = 0; c < NG; ++c) kv[c] = _mm512_loadu_ps(kg + (c * D + d) * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r * D + d]);
#pragma GCC unroll 4
      for (int c = 0; c < NG; ++c) acc[r][c] = _mm512_fmadd_ps(qb, kv[c], acc[r][c]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NG; ++c) _mm512_storeu_ps(s + r * FM_BN + 16 * c, _mm512_mul_ps(acc[r][c], vs));
}

// R rows of o[r][0, 16 NC) += sum over j < n of p[r * rs + j * us] * v[j][0, 16 NC) (v and o rows D apart, v
// at its first row and the tile's first column). The forward's P V (rs = FM_BN, us = 1: a row's
// probabilities of the block's keys); the backward's P^T dO and dS^T Q (rs = 1, us = FM_BN: a key's column
// over the block's query rows) and dS K.
template <int R, int NC>
PK_TARGET_AVX512BF16 inline void fma512_pv(const float* p, int64_t rs, int64_t us, const float* v, int64_t D, int n,
                                           float* o) {
  __m512 acc[R][NC];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  for (int j = 0; j < n; ++j) {
    __m512 vv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + j * D + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r * rs + j * us]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// fma_exp_row's p[0, width) 16 lanes at a time
PK_TARGET_AVX512BF16 inline float fma512_exp_row(const float* s, int n, int width, float m, float* p) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < width; j += 16) {
    const __mmask16 live = pf_live(j, n);
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), vm)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(p + j, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// The reduction range [j1, j2) of a register tile of rows [r0, r0 + R) in the P V-style products: all of
// [0, total) without a causal mask; with one, from r0 + c on (the backward's dV, dK: the tile's rows are keys,
// reduced over the query rows that see its first key) or up to r0 + R + c (the forward's P V and the
// backward's dQ: query rows, over the keys the tile's last row sees).
struct TileSpan {
  bool causal, from;  // from: the range starts at r0 + c, else it ends at r0 + R + c
  int64_t c;
  int total;
  void of(int r0, int R, int* j1, int* j2) const {
    *j1 = causal && from ? (int)std::clamp<int64_t>(r0 + c, 0, total) : 0;
    *j2 = causal && !from ? (int)std::clamp<int64_t>(r0 + R + c, 0, total) : total;
  }
};

// The fma kernel's block kernels on the AVX-512 tier (fma_item<Tier> and fma_bwd_group<Tier> call them per
// 64 x 64 block: a call's cost is nothing beside a block's 8K-20K D multiply-adds).
struct FmaTier512 {
  static constexpr int kLanes = 16;  // K and V packed lane-per-key in groups of 16
  // The forward's online softmax over a block's scores (sc.s) for rows [0, rows) of the item from i0, keys
  // from j0 (nb of them): p (sc.p), and the running m, l and o. In three passes over the rows (each row's max
  // -> exp -> sum is one dependent chain: row by row, with a scalar exp between, it ran at ~1 instruction a
  // cycle): the rows' maxima and new running maxima; their rescale factors alpha = exp(m - m_new), 16 rows at
  // a time; the exponentials.
  PK_TARGET_AVX512BF16 static void softmax(const Problem& P, FmaScratch& sc, int rows, int64_t i0, int64_t j0,
                                           int nb) {
    const int64_t D = P.D;
    const int width = (nb + 15) / 16 * 16;  // (p beyond: never read)
    for (int r = 0; r < rows; ++r) {
      const int n = (int)std::clamp<int64_t>(P.visible(i0 + r) - j0, 0, nb);
      const float* sr = sc.s.data() + (size_t)r * FM_BN;
      sc.n[r] = n;
      sc.m_new[r] = n > 0 ? std::max(sc.m[r], pf_row_max(sr, n)) : sc.m[r];
    }
    for (int r = 0; r < rows; r += 16) {
      const __mmask16 live = pf_live(r, rows);
      const __m512 m_old = _mm512_maskz_loadu_ps(live, sc.m.data() + r);
      const __m512 m_new = _mm512_maskz_loadu_ps(live, sc.m_new.data() + r);
      // (-inf - -inf = NaN where a row has no score yet: such rows take nothing below)
      _mm512_mask_storeu_ps(sc.alpha.data() + r, live, exp512(_mm512_sub_ps(m_old, m_new)));
    }
    for (int r = 0; r < rows; ++r) {
      const float* sr = sc.s.data() + (size_t)r * FM_BN;
      float* pr = sc.p.data() + (size_t)r * FM_BN;
      const int n = sc.n[r];
      const float m_new = sc.m_new[r];
      if (!softmax_takes(sc.l[r], n, m_new)) {
        std::memset(pr, 0, sizeof(float) * width);
        continue;
      }
      const float alpha = sc.alpha[r];
      sc.l[r] = sc.l[r] * alpha + fma512_exp_row(sr, n, width, m_new, pr);
      if (alpha != 1.f) {
        float* orow = sc.o.data() + (size_t)r * D;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
      }
      sc.m[r] = m_new;
    }
  }
  // s[r][0, nb) = scale * q_r . k_j for rows [0, rows) of q (D apart), keys of kblk (s rows FM_BN apart); a
  // register tile's keys only up to its span's end (the keys its last row sees: a causal diagonal block's
  // first tiles compute a quarter to half of the block; the scores beyond are left as they were: loaded by
  // some loops, masked away, never used)
  PK_TARGET_AVX512BF16 static void scores(const float* q, int rows, int64_t D, const float* kblk, float scale, int nb,
                                          float* s, const TileSpan& span) {
    (void)nb;  // (the span's total)
    pf_row_tiles(rows, [&](int r0, auto R) {
      int j1, j2;
      span.of(r0, decltype(R)::value, &j1, &j2);
      if (j2 <= 0) return;
      fma512_width((j2 + 15) / 16, [&](auto NG) {
        fma512_scores<decltype(R)::value, decltype(NG)::value>(q + r0 * D, D, kblk, scale, s + r0 * FM_BN);
      });
    });
  }
  // row r: p = exp(s - lse_r) and ds = p (dp - delta_r) in place of s and dp, for its n[r] keys; 0 beyond, up to
  // the block's nb keys rounded up to the lanes (all that the products read)
  PK_TARGET_AVX512BF16 static void p_ds(float* s, float* dp, int rows, int nb, const int* n, const float* lse,
                                        int64_t lse_stride, const float* delta, int64_t delta_stride) {
    const int width = (nb + 15) / 16 * 16;
    for (int r = 0; r < rows; ++r) {
      const __m512 vlse = _mm512_set1_ps(lse[r * lse_stride]), vd = _mm512_set1_ps(delta[r * delta_stride]);
      float* sr = s + (size_t)r * FM_BN;
      float* dpr = dp + (size_t)r * FM_BN;
      for (int j = 0; j < width; j += 16) {
        const __mmask16 live = pf_live(j, n[r]);
        const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sr + j), vlse)));
        const __mmask16 nz = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        _mm512_storeu_ps(sr + j, p);
        _mm512_storeu_ps(dpr + j, _mm512_maskz_mul_ps(nz, p, _mm512_sub_ps(_mm512_maskz_loadu_ps(live, dpr + j), vd)));
      }
    }
  }
  // rows [0, rows) of o (D apart) += sum over j in a tile's span of p[r * rs + j * us] v[j] (fma512_pv)
  PK_TARGET_AVX512BF16 static void pv(int rows, const float* p, int64_t rs, int64_t us, const float* v, int64_t D,
                                      float* o, const TileSpan& span) {
    pf_row_tiles(rows, [&](int r0, auto R) {
      int j1, j2;
      span.of(r0, decltype(R)::value, &j1, &j2);
      if (j2 <= j1) return;
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        fma512_width((int)std::min<int64_t>(4, (D - d0) / 16), [&](auto NC) {
          fma512_pv<decltype(R)::value, decltype(NC)::value>(p + r0 * rs + j1 * us, rs, us, v + j1 * D + d0, D,
                                                             j2 - j1, o + (size_t)r0 * D + d0);
        });
    });
  }
};

// The same block kernels on the AVX2 tier (fma_scores16, fma_pv16, exp256; K and V in groups of 8).
struct FmaTier256 {
  static constexpr int kLanes = 8;
  // (FmaTier512::softmax, row by row)
  PK_TARGET_AVX2 static void softmax(const Problem& P, FmaScratch& sc, int rows, int64_t i0, int64_t j0, int nb) {
    const int64_t D = P.D;
    const int width = (nb + 7) / 8 * 8;
    for (int r = 0; r < rows; ++r) {
      const float* sr = sc.s.data() + (size_t)r * FM_BN;
      float* pr = sc.p.data() + (size_t)r * FM_BN;
      const int n = (int)std::clamp<int64_t>(P.visible(i0 + r) - j0, 0, nb);
      float m_new, alpha;
      if (!softmax_step(sc.m[r], sc.l[r], n, n > 0 ? row_max_avx2(sr, n) : kNegInf, &m_new, &alpha)) {
        std::memset(pr, 0, sizeof(float) * width);
        continue;
      }
      sc.l[r] = sc.l[r] * alpha + fma_exp_row(sr, n, width, m_new, pr);
      if (alpha != 1.f) {
        float* orow = sc.o.data() + (size_t)r * D;
        const __m256 va = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(orow + d), va));
      }
      sc.m[r] = m_new;
    }
  }
  PK_TARGET_AVX2 static void scores(const float* q, int rows, int64_t D, const float* kblk, float scale, int nb,
                                    float* s, const TileSpan& span) {
    (void)nb;
    pf_row_tiles(rows, [&](int r0, auto R) {
      int j1, j2;
      span.of(r0, decltype(R)::value, &j1, &j2);
      for (int c = 0; c < (j2 + 15) / 16; ++c)
        fma_scores16<decltype(R)::value>(q + r0 * D, D, kblk + c * 16 * D, scale, s + r0 * FM_BN + 16 * c);
    });
  }
  PK_TARGET_AVX2 static void p_ds(float* s, float* dp, int rows, int nb, const int* n, const float* lse,
                                  int64_t lse_stride, const float* delta, int64_t delta_stride) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int width = (nb + 7) / 8 * 8;
    for (int r = 0; r < rows; ++r) {
      const __m256 vlse = _mm256_set1_ps(lse[r * lse_stride]), vd = _mm256_set1_ps(delta[r * delta_stride]);
      float* sr = s + (size_t)r * FM_BN;
      float* dpr = dp + (size_t)r * FM_BN;
      for (int j = 0; j < width; j += 8) {
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n[r] - j), lane));
        // (a lane beyond the row's keys: its score and dP are whatever the buffers held, ANDed away to +0)
        const __m256 p = _mm256_and_ps(live, exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), vlse)));
        const __m256 nz = _mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_NEQ_UQ);
        _mm256_storeu_ps(sr + j, p);
        _mm256_storeu_ps(dpr + j, _mm256_and_ps(nz, _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dpr + j), vd))));
      }
    }
  }
  PK_TARGET_AVX2 static void pv(int rows, const float* p, int64_t rs, int64_t us, const float* v, int64_t D, float* o,
                                const TileSpan& span) {
    pf_row_tiles(rows, [&](int r0, auto R) {
      int j1, j2;
      span.of(r0, decltype(R)::value, &j1, &j2);
      if (j2 <= j1) return;
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        fma_pv16<decltype(R)::value>(p + r0 * rs + j1 * us, rs, us, v + j1 * D + d0, D, j2 - j1, o + (size_t)r0 * D + d0);
    });
  }
};

// One work item: query rows [i0, i0 + rows) of head h (batch b), on either tier (its block kernels: Tier;
// generic code, no intrinsics here). Returns the rows that see keys but got a non-finite lse.
template <class Tier>
int64_t fma_item(const Problem& P, const float* kf, const float* vf, int64_t b, int64_t h, int64_t i0, int rows,
                 FmaScratch& sc) {
  const int64_t D = P.D, off = P.Sk - P.Sq;
  fma_start_item(P, b, h, i0, rows, sc);
  const int64_t hi = P.visible(i0 + rows - 1);  // the keys the item's last (most seeing) row sees
  for (int64_t j0 = 0; j0 < hi; j0 += FM_BN) {
    const int nb = (int)std::min<int64_t>(FM_BN, hi - j0);
    // the keys a tile's rows see (its last row sees the most): a causal diagonal block's first tiles skip
    // the rest; a key some rows of the tile do not see has p = 0 there, so a NaN or inf in its value makes
    // those rows' output NaN too (0 * NaN), as in bf16dot and the float64 oracle: documented, not checked
    const TileSpan span{P.causal, false, i0 + off - j0, nb};
    Tier::scores(sc.q.data(), rows, D, kf + j0 * D, P.scale, nb, sc.s.data(), span);
    Tier::softmax(P, sc, rows, i0, j0, nb);
    Tier::pv(rows, sc.p.data(), FM_BN, 1, vf + j0 * D, D, sc.o.data(), span);
  }
  return fma_finish_item(P, b, h, i0, rows, sc);
}
#endif

// Returns the number of rows that see keys whose lse came out non-finite; -1 where this CPU lacks AVX2 or D
// is not a multiple of 16 (up to 512): the caller takes another impl.
int64_t fma_forward(const Problem& P, int num_threads) {
#if PK_X86
  if (!pk::cpu_has_avx2() || !fma_head_dim_ok(P.D)) return -1;
  const int64_t D = P.D;
  if (P.B * P.H == 0 || P.Sq == 0) return 0;
  const int64_t Skp = std::max<int64_t>(FM_BN, (P.Sk + FM_BN - 1) / FM_BN * FM_BN);
  const int64_t kv_floats = Skp * D;  // per (b, hk), each of Kf and Vf
  const int64_t groups = P.B * P.Hkv;
  thread_local KeptBuffer<float> packed;  // (see KeptBuffer)
  float* const kf = packed.get((size_t)(2 * groups * kv_floats));
  const typename KeptBuffer<float>::Trim trim{packed, size_t(16) << 20};
  float* const vf = kf + groups * kv_floats;
  const int T = std::max(1, num_threads);
  const bool wide = bf16dot_cpu();  // the AVX-512 tier
  pk::parallel_chunks(groups, std::min<int64_t>(T, groups), 1, [&](int, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      fma_pack_kv(P, g / P.Hkv, g % P.Hkv, Skp, wide ? 16 : 8, kf + g * kv_floats, vf + g * kv_floats);
  });
  std::vector<FmaScratch> scratch;
  return run_prefill_items(P, T, scratch, [&](FmaScratch& sc, int64_t g, int64_t b, int64_t h, int64_t i0, int rows) {
    return wide ? fma_item<FmaTier512>(P, kf + g * kv_floats, vf + g * kv_floats, b, h, i0, rows, sc)
                : fma_item<FmaTier256>(P, kf + g * kv_floats, vf + g * kv_floats, b, h, i0, rows, sc);
  });
#else
  (void)P;
  (void)num_threads;
  return -1;
#endif
}

// ---------------------------------------------------------------------------------------------------------
// bf16dot backward: FlashAttention-2's backward (Dao 2023, Algorithm 2) on the same dot products. Given the
// forward's lse and D_i = rowsum(dO_i * O_i) - dlse_i (computed by the caller), per key block of PF_BN keys
// and query block of PF_BM rows that sees it:
//   S = scale Q K^T, P = exp(S - lse), dP = dO V^T, dS = P * (dP - D)       (fp32; dS = 0 where P is)
//   dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K                       (P, dS rounded to bf16)
// Work items are whole (batch, KV head) groups, so dK/dV (of the group's keys) and dQ (of its G query
// heads) stay in one thread's fp32 accumulators: no atomics, no reduction pass. Operands packed once per
// group: K and V in the lane-per-key layout (S, dP), K in row pairs (dQ), Q and dO of each head in row
// pairs (dK, dV); P^T and dS^T are written as pairs of query rows per key (16 keys a vector).
// ---------------------------------------------------------------------------------------------------------
struct BwdProblem {
  Problem P;  // q, k, v, sizes, scale, causal, dtype (P.out and P.lse unused)
  const void* dout;
  const float* lse;
  const float* delta;
  void* dq;
  void* dk;
  void* dv;
  int64_t dos[3], lss[3], dls[3], dqs[3], dks[3], dvs[3];  // element strides of dims b, h, s
};

#if PK_X86
struct BwdScratch {
  // kl, vl: K and V lane-per-key; k2, q2, do2: K, Q, dO in row pairs; pt, dst: P^T and dS^T as query-row
  // pairs per key
  std::vector<uint32_t> kl, vl, k2, q2, do2, q32, do32, pt, dst_pairs;
  std::vector<float> s, dp, dq, dk, dv;
  std::vector<uint32_t> ds2;  // dS in bf16, [PF_BM][PF_BN] (pairs of keys per word)
  // group_rows = false: q2, do2 and dq are the group's shared buffers (BwdPart), not this scratch's
  void size_for(int64_t G, int64_t Sqp, int64_t Skp, int64_t D, bool group_rows = true) {
    const int64_t rows = group_rows ? G * Sqp : 0;
    kl.resize((size_t)(Skp * D / 2));
    vl.resize((size_t)(Skp * D / 2));
    k2.resize((size_t)(Skp * D / 2));
    q2.resize((size_t)(rows * D / 2));
    do2.resize((size_t)(rows * D / 2));
    q32.resize((size_t)PF_BM * D / 2);
    do32.resize((size_t)PF_BM * D / 2);
    pt.resize((size_t)PF_BM / 2 * PF_BN);
    dst_pairs.resize((size_t)PF_BM / 2 * PF_BN);
    s.resize((size_t)PF_BM * PF_BN);
    dp.resize((size_t)PF_BM * PF_BN);
    ds2.resize((size_t)PF_BM * PF_BN / 2);
    dq.resize((size_t)(rows * D));
    dk.resize((size_t)PF_BN * D);
    dv.resize((size_t)PF_BN * D);
  }
};

// rows of fp32 x (D apart) times `mul` into bf16 rows (stride apart)
PK_TARGET_AVX512BF16 inline void pf_store_rows(const float* x, int rows, int64_t D, float mul, uint16_t* dst,
                                               int64_t stride) {
  const __m512 vm = _mm512_set1_ps(mul);
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * stride + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + (size_t)r * D + d), vm)));
}

// words (bf16(a[j]), bf16(b[j])) for 16 values of two fp32 rows
PK_TARGET_AVX512BF16 inline __m512i pf_pair_words(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// A group's share of the backward when there are fewer groups than threads: `parts` threads share it,
// part p taking the (head, 64-row query block) pairs numbered p, p + parts, ... (round robin: with a
// causal mask later query blocks see more keys). Q and dO in row pairs and the fp32 dQ are the group's
// buffers (q2, do2: [G][Sqp / 2][D] words; dq: [G][Sqp][D]), shared by its parts, each packing, zeroing and
// reading only the blocks it owns (so no part waits for another, and the group's rows are packed once:
// a scratch per part held G heads of them, threads x 4 x the size of q in all). dK/dV become per-part fp32
// sums over all keys (dk, dv: [Skp][D], zeroed), added up by the caller. parts == 1: the whole group in
// the scratch's buffers, dK/dV stored here per key block (all pointers null).
struct BwdPart {
  int part = 0, parts = 1;
  float* dk = nullptr;
  float* dv = nullptr;
  uint32_t* q2 = nullptr;
  uint32_t* do2 = nullptr;
  float* dq = nullptr;
  // set when any item of the call met a tiny value (the whole call then takes an exact path): read per key
  // block, so the other items stop early (a part checks only its own blocks of Q and dO)
  const std::atomic<bool>* stop = nullptr;
  bool owns(int64_t g, int64_t i0, int64_t qblocks) const { return (g * qblocks + i0 / PF_BM) % parts == part; }
};

// false (nothing computed) where an input of the group holds a tiny value
PK_TARGET_AVX512BF16 bool bwd_group(const BwdProblem& BP, int64_t b, int64_t hk, BwdScratch& sc,
                                    const BwdPart& part = BwdPart()) {
  const Problem& P = BP.P;
  const int64_t D = P.D, D2 = D / 2, G = P.H / P.Hkv, Sq = P.Sq, Sk = P.Sk;
  const int64_t Sqp = (Sq + PF_BM - 1) / PF_BM * PF_BM, Skp = (Sk + PF_BN - 1) / PF_BN * PF_BN;
  const int64_t gstride = D2 * 16;
  const uint16_t* kb = static_cast<const uint16_t*>(P.k) + b * P.ks[0] + hk * P.ks[1];
  const uint16_t* vb = static_cast<const uint16_t*>(P.v) + b * P.vs[0] + hk * P.vs[1];
  bool sub = pack_lanes(kb, P.ks[2], Sk, Skp, D, sc.kl.data());
  sub = pack_lanes(vb, P.vs[2], Sk, Skp, D, sc.vl.data()) || sub;
  pack_pairs(kb, P.ks[2], Sk, Skp, D, sc.k2.data());
  const int64_t qblocks = Sqp / PF_BM;
  const bool shared = part.parts > 1;
  uint32_t* const q2s = shared ? part.q2 : sc.q2.data();
  uint32_t* const do2s = shared ? part.do2 : sc.do2.data();
  float* const dqs = shared ? part.dq : sc.dq.data();
  for (int64_t g = 0; g < G; ++g) {  // the Q and dO blocks (every one is some part's: all rows checked)
    const int64_t h = hk * G + g;
    const uint16_t* qh = static_cast<const uint16_t*>(P.q) + b * P.qs[0] + h * P.qs[1];
    const uint16_t* doh = static_cast<const uint16_t*>(BP.dout) + b * BP.dos[0] + h * BP.dos[1];
    for (int64_t i0 = 0; i0 < Sq; i0 += PF_BM) {
      if (shared && !part.owns(g, i0, qblocks)) continue;
      const int64_t rows = std::min<int64_t>(PF_BM, Sq - i0), at = g * Sqp * D2 + (i0 / 2) * D;
      sub = pack_pairs(qh + i0 * P.qs[2], P.qs[2], rows, PF_BM, D, q2s + at) || sub;
      sub = pack_pairs(doh + i0 * BP.dos[2], BP.dos[2], rows, PF_BM, D, do2s + at) || sub;
      std::fill(dqs + (g * Sqp + i0) * D, dqs + (g * Sqp + i0 + PF_BM) * D, 0.f);
    }
  }
  if (sub) return false;
  const int64_t off = Sk - Sq;  // bottom-right causal: row i sees keys j <= i + off
  for (int64_t j0 = 0; j0 < Sk; j0 += PF_BN) {
    if (part.stop && part.stop->load(std::memory_order_relaxed)) return false;
    const int nb = (int)std::min<int64_t>(PF_BN, Sk - j0);
    float* const dk_acc = shared ? part.dk + j0 * D : sc.dk.data();
    float* const dv_acc = shared ? part.dv + j0 * D : sc.dv.data();
    if (!shared) {
      std::fill(sc.dk.begin(), sc.dk.end(), 0.f);
      std::fill(sc.dv.begin(), sc.dv.end(), 0.f);
    }
    const int64_t i_first = P.causal ? std::max<int64_t>(0, j0 - off) : 0;  // the first row that sees key j0
    for (int64_t g = 0; g < G && i_first < Sq; ++g) {
      const int64_t h = hk * G + g;
      const uint16_t* qh = static_cast<const uint16_t*>(P.q) + b * P.qs[0] + h * P.qs[1];
      const uint16_t* doh = static_cast<const uint16_t*>(BP.dout) + b * BP.dos[0] + h * BP.dos[1];
      const float* lseh = BP.lse + b * BP.lss[0] + h * BP.lss[1];
      const float* deltah = BP.delta + b * BP.dls[0] + h * BP.dls[1];
      for (int64_t i0 = i_first / PF_BM * PF_BM; i0 < Sq; i0 += PF_BM) {
        if (shared && !part.owns(g, i0, qblocks)) continue;
        const int rows = (int)std::min<int64_t>(PF_BM, Sq - i0);
        for (int r = 0; r < rows; ++r) {
          std::memcpy(sc.q32.data() + (size_t)r * D2, qh + (i0 + r) * P.qs[2], D * 2);
          std::memcpy(sc.do32.data() + (size_t)r * D2, doh + (i0 + r) * BP.dos[2], D * 2);
        }
        // S and dP of the keys the tile's last row sees (the rest: never used)
        pf_row_tiles(rows, [&](int r0, auto R) {
          const int n = (int)std::clamp<int64_t>(P.visible(i0 + r0 + decltype(R)::value - 1) - j0, 0, nb);
          if (n == 0) return;
          pf_scores_n<decltype(R)::value>(sc.q32.data() + (size_t)r0 * D2, (int)D2, sc.kl.data() + (j0 / 16) * gstride,
                                          gstride, P.scale, n, sc.s.data() + (size_t)r0 * PF_BN);
          pf_scores_n<decltype(R)::value>(sc.do32.data() + (size_t)r0 * D2, (int)D2, sc.vl.data() + (j0 / 16) * gstride,
                                          gstride, 1.f, n, sc.dp.data() + (size_t)r0 * PF_BN);
        });
        // P = exp(S - lse) and dS = P (dP - D) in place of S and dP (0 beyond the keys a row sees), dS in bf16
        // row pairs of keys for dQ
        for (int r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          const int n = (int)std::clamp<int64_t>(P.visible(i) - j0, 0, nb);
          const __m512 vlse = _mm512_set1_ps(lseh[i * BP.lss[2]]), vd = _mm512_set1_ps(deltah[i * BP.dls[2]]);
          float* sr = sc.s.data() + (size_t)r * PF_BN;
          float* dpr = sc.dp.data() + (size_t)r * PF_BN;
          for (int j = 0; j < PF_BN; j += 16) {
            const __mmask16 live = pf_live(j, n);
            const __m512 s_minus_lse = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, sr + j), vlse);
            const __m512 p = _mm512_maskz_mov_ps(live, exp512(s_minus_lse));
            const __mmask16 nz = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);
            const __m512 ds = _mm512_maskz_mul_ps(nz, p, _mm512_sub_ps(_mm512_loadu_ps(dpr + j), vd));
            _mm512_storeu_ps(sr + j, p);
            _mm512_storeu_ps(dpr + j, ds);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc.ds2.data() + (size_t)r * (PF_BN / 2) + j / 2),
                                (__m256i)_mm512_cvtneps_pbh(ds));
          }
        }
        // P^T and dS^T as pairs of query rows per key: word (u, j) = (x[2u][j], x[2u + 1][j])
        const int pairs = (rows + 1) / 2;
        for (int u = 0; u < pairs; ++u) {
          const float* a = sc.s.data() + (size_t)(2 * u) * PF_BN;
          const float* da = sc.dp.data() + (size_t)(2 * u) * PF_BN;
          const bool odd = 2 * u + 1 >= rows;
          for (int j = 0; j < PF_BN; j += 16) {
            const __m512 b1 = odd ? _mm512_setzero_ps() : _mm512_loadu_ps(a + PF_BN + j);
            const __m512 db1 = odd ? _mm512_setzero_ps() : _mm512_loadu_ps(da + PF_BN + j);
            _mm512_storeu_si512(sc.pt.data() + (size_t)u * PF_BN + j, pf_pair_words(_mm512_loadu_ps(a + j), b1));
            _mm512_storeu_si512(sc.dst_pairs.data() + (size_t)u * PF_BN + j,
                                pf_pair_words(_mm512_loadu_ps(da + j), db1));
          }
        }
        const uint32_t* q2 = q2s + g * Sqp * D2 + (i0 / 2) * D;
        const uint32_t* do2 = do2s + g * Sqp * D2 + (i0 / 2) * D;
        pf_row_tiles(nb, [&](int r0, auto R) {  // dV and dK rows: the block's keys
          for (int64_t d0 = 0; d0 < D; d0 += 64) {
            pf_pv<decltype(R)::value>(sc.pt.data() + r0, 1, PF_BN, do2 + d0, D, pairs, dv_acc + (size_t)r0 * D + d0);
            pf_pv<decltype(R)::value>(sc.dst_pairs.data() + r0, 1, PF_BN, q2 + d0, D, pairs,
                                      dk_acc + (size_t)r0 * D + d0);
          }
        });
        const uint32_t* k2 = sc.k2.data() + (j0 / 2) * D;
        float* dqb = dqs + (g * Sqp + i0) * D;
        pf_row_tiles(rows, [&](int r0, auto R) {  // dQ rows: the block's query rows, over its key pairs
          for (int64_t d0 = 0; d0 < D; d0 += 64)
            pf_pv<decltype(R)::value>(sc.ds2.data() + (size_t)r0 * (PF_BN / 2), PF_BN / 2, 1,
                                      k2 + d0, D, (nb + 1) / 2, dqb + (size_t)r0 * D + d0);
        });
      }
    }
    if (shared) continue;  // (the caller adds up the parts)
    pf_store_rows(sc.dk.data(), nb, D, P.scale,
                  static_cast<uint16_t*>(BP.dk) + b * BP.dks[0] + hk * BP.dks[1] + j0 * BP.dks[2], BP.dks[2]);
    pf_store_rows(sc.dv.data(), nb, D, 1.f,
                  static_cast<uint16_t*>(BP.dv) + b * BP.dvs[0] + hk * BP.dvs[1] + j0 * BP.dvs[2], BP.dvs[2]);
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hk * G + g;
    uint16_t* dqh = static_cast<uint16_t*>(BP.dq) + b * BP.dqs[0] + h * BP.dqs[1];
    for (int64_t i0 = 0; i0 < Sq; i0 += PF_BM)
      if (!shared || part.owns(g, i0, qblocks))  // (a shared group's other rows are another part's)
        pf_store_rows(dqs + (g * Sqp + i0) * D, (int)std::min<int64_t>(PF_BM, Sq - i0), D,
                      P.scale, dqh + i0 * BP.dqs[2], BP.dqs[2]);
  }
  return true;
}
#endif

// dq, dk, dv of a bfloat16 problem (the caller checked that dout, out and the lse of rows that see keys are
// finite, and passes no rows that see no key); -1 where the kernel does not
// apply (as prefill_forward), kTinyInput where q, k, v or dout holds a tiny value or |scale| * D > kMaxScaledD (dq, dk, dv then
// partly written: the caller takes an exact path), else 0.
int64_t prefill_backward(const BwdProblem& BP, int num_threads) {
#if PK_X86
  const Problem& P = BP.P;
  if (!bf16dot_cpu() || P.dt != pk::DType::BFloat16 || !prefill_head_dim_ok(P.D)) return -1;
  const int64_t groups = P.B * P.Hkv;
  if (groups == 0 || P.Sq == 0 || P.Sk == 0) return 0;  // (the caller returns zeros)
  if (!(std::fabs((double)P.scale) * (double)P.D <= kMaxScaledD)) return kTinyInput;
  const int64_t G = P.H / P.Hkv;
  const int64_t Sqp = (P.Sq + PF_BM - 1) / PF_BM * PF_BM, Skp = (P.Sk + PF_BN - 1) / PF_BN * PF_BN;
  const int threads = std::max(1, num_threads);
  std::atomic<bool> tiny{false};
  // (no more parts than the group's (head, query block) pairs: a part without one would only pack K/V)
  const int parts = (int)std::clamp<int64_t>(threads / groups, 1, G * (Sqp / PF_BM));
  if (parts == 1) {  // a whole group per work item: dK/dV of its keys in one thread, no reduction
    std::vector<BwdScratch> scratch(std::min<int64_t>(threads, groups));
    pk::parallel_chunks(groups, (int)scratch.size(), 1, [&](int t, int64_t g0, int64_t g1) {
      BwdScratch& sc = scratch[t];
      sc.size_for(G, Sqp, Skp, P.D);
      BwdPart whole;
      whole.stop = &tiny;
      for (int64_t g = g0; g < g1 && !tiny; ++g)
        if (!bwd_group(BP, g / P.Hkv, g % P.Hkv, sc, whole)) tiny = true;
    });
    return tiny ? kTinyInput : 0;
  }
  // Fewer groups than threads (MQA, a batch of one): each group shared by `parts` threads (BwdPart), which
  // split its query blocks; their fp32 dK/dV sums are then added up and stored, in parallel over key rows.
  // (FlashAttention-2 splits the keys instead, with dQ added atomically; here dK/dV are the smaller sums
  // where a KV head serves several query heads.)
  const int64_t items = groups * parts, part_elems = Skp * P.D, group_rows = G * Sqp * P.D;
  std::vector<float> dkv((size_t)(2 * items * part_elems), 0.f);  // [item][dk, dv][Skp][D]
  // each group's Q, dO (row pairs) and fp32 dQ, written block by block by the parts that own the blocks
  std::vector<uint32_t> q2((size_t)(groups * group_rows / 2)), do2((size_t)(groups * group_rows / 2));
  std::vector<float> dq((size_t)(groups * group_rows));
  std::vector<BwdScratch> scratch((size_t)items);
  pk::parallel_chunks(items, (int)items, 1, [&](int, int64_t it0, int64_t it1) {
    for (int64_t it = it0; it < it1 && !tiny; ++it) {
      BwdScratch& sc = scratch[(size_t)it];
      sc.size_for(G, Sqp, Skp, P.D, false);
      const int64_t g = it / parts;
      BwdPart part;
      part.part = (int)(it % parts);
      part.parts = parts;
      part.dk = dkv.data() + (size_t)(2 * it * part_elems);
      part.dv = part.dk + part_elems;
      part.q2 = q2.data() + (size_t)(g * group_rows / 2);
      part.do2 = do2.data() + (size_t)(g * group_rows / 2);
      part.dq = dq.data() + (size_t)(g * group_rows);
      part.stop = &tiny;
      if (!bwd_group(BP, g / P.Hkv, g % P.Hkv, sc, part)) tiny = true;
    }
  });
  if (tiny) return kTinyInput;
  const int64_t row_blocks = (P.Sk + PF_BN - 1) / PF_BN;
  pk::parallel_chunks(groups * row_blocks, threads, 1, [&](int, int64_t w0, int64_t w1) {
    std::vector<float> sum((size_t)(2 * PF_BN * P.D));
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / row_blocks, b = g / P.Hkv, hk = g % P.Hkv, j0 = (w % row_blocks) * PF_BN;
      const int nb = (int)std::min<int64_t>(PF_BN, P.Sk - j0);
      const size_t n = (size_t)(nb * P.D);
      for (int which = 0; which < 2; ++which) {  // dk, dv
        float* acc = sum.data() + which * PF_BN * P.D;
        const float* first = dkv.data() + (size_t)((2 * g * parts + which) * part_elems + j0 * P.D);
        std::copy(first, first + n, acc);
        for (int p = 1; p < parts; ++p) {
          const float* src = dkv.data() + (size_t)((2 * (g * parts + p) + which) * part_elems + j0 * P.D);
          for (size_t e = 0; e < n; ++e) acc[e] += src[e];
        }
      }
      pf_store_rows(sum.data(), nb, P.D, P.scale,
                    static_cast<uint16_t*>(BP.dk) + b * BP.dks[0] + hk * BP.dks[1] + j0 * BP.dks[2], BP.dks[2]);
      pf_store_rows(sum.data() + PF_BN * P.D, nb, P.D, 1.f,
                    static_cast<uint16_t*>(BP.dv) + b * BP.dvs[0] + hk * BP.dvs[1] + j0 * BP.dvs[2], BP.dvs[2]);
    }
  });
  return 0;
#else
  (void)BP;
  (void)num_threads;
  return -1;
#endif
}

// ---------------------------------------------------------------------------------------------------------
// The fma backward: FlashAttention-2's backward (Dao 2023, Algorithm 2) in fp32 on either tier of the fma
// kernel (its block kernels: FmaTier512, FmaTier256), float32 inputs (bfloat16 / float16 widened as packed, the
// gradients rounded once). The bf16dot backward's work split (a whole (batch, KV head) group per work item:
// dK/dV of its keys and dQ of its G heads in one thread's fp32 accumulators, no atomics, no reduction pass;
// with fewer groups than threads, threads share a group and their dK/dV are added up: FmaBwdPart) and
// arithmetic (given the forward's lse and D_i = rowsum(dO_i O_i) - dlse_i from the caller):
//   S = scale Q K^T, P = exp(S - lse), dP = dO V^T, dS = P (dP - D)          (dS = 0 where P is)
//   dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K                      (all fp32)
// S comes from the forward's own score tiles (fma512_scores or fma_scores16, K packed the same way), so P is
// exp of the very scores the forward's lse summed. Operands packed once per group as fp32: K and V
// lane-per-key (S and dP tiles), K, Q and dO of each head as rows (dQ, dK, dV, whose tiles broadcast P, dS or
// their transposes straight from the score blocks: fma512_pv's / fma_pv16's strides, no transposed copies);
// float32 Q and dO with dense rows are read where they lie and dQ sums into the output (FmaBwdInPlace).
// Why: aten's fp32 backward ran at ~60% of the FMA peak without a mask and ~40% with a causal one (its
// 256 x 512 blocks computed the masked half of the diagonal ones) on a 2-core Zen 4.
// ---------------------------------------------------------------------------------------------------------
#if PK_X86
// Which of Q, dO and dQ the backward reads or sums where they lie: float32 tensors whose rows are dense (row
// stride D), as the wrapper's dq always is; the others are copied into fp32 rows (3x q's memory where all were).
struct FmaBwdInPlace {
  bool q, dout, dq;
  explicit FmaBwdInPlace(const BwdProblem& BP)
      : q(BP.P.dt == pk::DType::Float32 && BP.P.qs[2] == BP.P.D),
        dout(BP.P.dt == pk::DType::Float32 && BP.dos[2] == BP.P.D),
        dq(BP.P.dt == pk::DType::Float32 && BP.dqs[2] == BP.P.D) {}
};

struct FmaBwdScratch {
  // kl, vl: K and V lane-per-key; kr: K rows; qr, dor, dq: the group's Q, dO rows and fp32 dQ sums
  // ([G][Sqp][D]; empty where FmaBwdInPlace says so, or where the group's shared buffers of FmaBwdPart serve
  // instead: group_rows false); s, dp: a block's P and dS ([PF_BM][FM_BN]); dk, dv: a key block's sums
  // ([FM_BN][D])
  std::vector<float> kl, vl, kr, qr, dor, dq, s, dp, dk, dv;
  std::vector<int> n;  // the keys each row of a block sees
  void size_for(int64_t G, int64_t Sqp, int64_t Skp, int64_t D, const FmaBwdInPlace& in_place, bool group_rows) {
    n.resize(PF_BM);
    for (auto* x : {&kl, &vl, &kr}) x->resize((size_t)(Skp * D));
    const size_t rows = group_rows ? (size_t)(G * Sqp * D) : 0;
    qr.resize(in_place.q ? 0 : rows);
    dor.resize(in_place.dout ? 0 : rows);
    dq.resize(in_place.dq ? 0 : rows);
    for (auto* x : {&s, &dp}) x->resize((size_t)PF_BM * FM_BN);
    for (auto* x : {&dk, &dv}) x->resize((size_t)FM_BN * D);
  }
};

// rows [0, rows) of fp32 x (D apart) times `mul` into dst's rows (dtype dt, from element `base`, `stride` apart)
inline void fma_store_rows(const float* x, int64_t rows, int64_t D, float mul, void* dst, pk::DType dt, int64_t base,
                           int64_t stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) store_from_f32(dst, dt, base + r * stride + d, x[r * D + d] * mul);
}

// A group's share when there are fewer groups than threads: part p of `parts` takes the group's (head,
// PF_BM-row query block) pairs numbered p, p + parts, ... (round robin: under a causal mask later blocks see
// more keys), packing, zeroing and reading only those blocks of the group's Q, dO and fp32 dQ rows (qr, dor,
// dq: [G][Sqp][D], one per group, shared by its parts), and adds its dK/dV into fp32 sums over all keys (dk,
// dv: [Skp][D], zeroed), which the caller adds up over the parts (so dK/dV's bits depend on the thread
// count there, as bf16dot's). parts == 1: the whole group in the scratch's buffers, dK/dV stored per key
// block (all pointers null).
struct FmaBwdPart {
  int part = 0, parts = 1;
  float* dk = nullptr;
  float* dv = nullptr;
  float* qr = nullptr;
  float* dor = nullptr;
  float* dq = nullptr;
  bool owns(int64_t g, int64_t i0, int64_t qblocks) const { return (g * qblocks + i0 / PF_BM) % parts == part; }
};

// One group (b, hk), or a part of it, on either tier (its block kernels: Tier). Generic code: no intrinsics
// here, so one body serves both targets.
template <class Tier>
void fma_bwd_group(const BwdProblem& BP, int64_t b, int64_t hk, FmaBwdScratch& sc, const FmaBwdPart& part) {
  const Problem& P = BP.P;
  const int64_t D = P.D, G = P.H / P.Hkv, Sq = P.Sq, Sk = P.Sk;
  const int64_t Sqp = (Sq + PF_BM - 1) / PF_BM * PF_BM, Skp = (Sk + FM_BN - 1) / FM_BN * FM_BN;
  const int64_t kbase = b * P.ks[0] + hk * P.ks[1];
  fma_pack_lanes(P.k, P.dt, kbase, P.ks[2], Sk, Skp, D, Tier::kLanes, sc.kl.data());
  fma_pack_lanes(P.v, P.dt, b * P.vs[0] + hk * P.vs[1], P.vs[2], Sk, Skp, D, Tier::kLanes, sc.vl.data());
  fma_pack_rows(P.k, P.dt, kbase, P.ks[2], Sk, Skp, D, sc.kr.data());
  const bool shared = part.parts > 1;
  const int64_t qblocks = Sqp / PF_BM;
  const FmaBwdInPlace in_place(BP);
  float* const qr = shared ? part.qr : sc.qr.data();
  float* const dor = shared ? part.dor : sc.dor.data();
  float* const dqr = shared ? part.dq : sc.dq.data();
  // rows [i0, ...) of head g of Q, dO and the dQ sums (D floats apart): where they lie, or their fp32 copies
  const auto q_rows = [&](int64_t g, int64_t i0) -> const float* {
    return in_place.q ? static_cast<const float*>(P.q) + b * P.qs[0] + (hk * G + g) * P.qs[1] + i0 * D
                      : qr + (g * Sqp + i0) * D;
  };
  const auto do_rows = [&](int64_t g, int64_t i0) -> const float* {
    return in_place.dout ? static_cast<const float*>(BP.dout) + b * BP.dos[0] + (hk * G + g) * BP.dos[1] + i0 * D
                         : dor + (g * Sqp + i0) * D;
  };
  const auto dq_rows = [&](int64_t g, int64_t i0) -> float* {
    return in_place.dq ? static_cast<float*>(BP.dq) + b * BP.dqs[0] + (hk * G + g) * BP.dqs[1] + i0 * D
                       : dqr + (g * Sqp + i0) * D;
  };
  for (int64_t g = 0; g < G; ++g) {  // the group's Q and dO rows as fp32, block by block (a part: its own)
    const int64_t h = hk * G + g;
    for (int64_t i0 = 0; i0 < Sq; i0 += PF_BM) {
      if (shared && !part.owns(g, i0, qblocks)) continue;
      const int64_t rows = std::min<int64_t>(PF_BM, Sq - i0), at = (g * Sqp + i0) * D;
      if (!in_place.q)
        fma_pack_rows(P.q, P.dt, b * P.qs[0] + h * P.qs[1] + i0 * P.qs[2], P.qs[2], rows, PF_BM, D, qr + at);
      if (!in_place.dout)
        fma_pack_rows(BP.dout, P.dt, b * BP.dos[0] + h * BP.dos[1] + i0 * BP.dos[2], BP.dos[2], rows, PF_BM, D,
                      dor + at);
      std::fill(dq_rows(g, i0), dq_rows(g, i0) + rows * D, 0.f);  // (the kernels read and write real rows only)
    }
  }
  const int64_t off = Sk - Sq;  // bottom-right causal: row i sees keys j <= i + off
  for (int64_t j0 = 0; j0 < Sk; j0 += FM_BN) {
    const int nb = (int)std::min<int64_t>(FM_BN, Sk - j0);
    float* const dk_acc = shared ? part.dk + j0 * D : sc.dk.data();
    float* const dv_acc = shared ? part.dv + j0 * D : sc.dv.data();
    if (!shared) {
      std::fill(sc.dk.begin(), sc.dk.end(), 0.f);
      std::fill(sc.dv.begin(), sc.dv.end(), 0.f);
    }
    const int64_t i_first = P.causal ? std::max<int64_t>(0, j0 - off) : 0;  // the first row that sees key j0
    for (int64_t g = 0; g < G && i_first < Sq; ++g) {
      const int64_t h = hk * G + g;
      const float* lseh = BP.lse + b * BP.lss[0] + h * BP.lss[1];
      const float* deltah = BP.delta + b * BP.dls[0] + h * BP.dls[1];
      for (int64_t i0 = i_first / PF_BM * PF_BM; i0 < Sq; i0 += PF_BM) {
        if (shared && !part.owns(g, i0, qblocks)) continue;
        const int rows = (int)std::min<int64_t>(PF_BM, Sq - i0);
        const float* qrows = q_rows(g, i0);
        const float* dorows = do_rows(g, i0);
        // S and dP of the keys a tile's last row sees (the rest of the block: left as it was, never used; masked
        // away where a loop loads it)
        const TileSpan keys_span{P.causal, true, j0 - off - i0, rows}, rows_span{P.causal, false, i0 + off - j0, nb};
        Tier::scores(qrows, rows, D, sc.kl.data() + j0 * D, P.scale, nb, sc.s.data(), rows_span);
        Tier::scores(dorows, rows, D, sc.vl.data() + j0 * D, 1.f, nb, sc.dp.data(), rows_span);
        // P = exp(S - lse) and dS = P (dP - D) in place of S and dP, 0 beyond the keys a row sees
        for (int r = 0; r < rows; ++r) sc.n[r] = (int)std::clamp<int64_t>(P.visible(i0 + r) - j0, 0, nb);
        Tier::p_ds(sc.s.data(), sc.dp.data(), rows, nb, sc.n.data(), lseh + i0 * BP.lss[2], BP.lss[2],
                   deltah + i0 * BP.dls[2], BP.dls[2]);
        // dV += P^T dO and dK += dS^T Q over the block's rows (a tile of keys from the first row that sees its
        // first key); dQ += dS K over the keys a tile's last row sees
        Tier::pv(nb, sc.s.data(), 1, FM_BN, dorows, D, dv_acc, keys_span);
        Tier::pv(nb, sc.dp.data(), 1, FM_BN, qrows, D, dk_acc, keys_span);
        Tier::pv(rows, sc.dp.data(), FM_BN, 1, sc.kr.data() + j0 * D, D, dq_rows(g, i0), rows_span);
      }
    }
    if (shared) continue;  // (the caller adds up the parts)
    fma_store_rows(sc.dk.data(), nb, D, P.scale, BP.dk, P.dt, b * BP.dks[0] + hk * BP.dks[1] + j0 * BP.dks[2],
                   BP.dks[2]);
    fma_store_rows(sc.dv.data(), nb, D, 1.f, BP.dv, P.dt, b * BP.dvs[0] + hk * BP.dvs[1] + j0 * BP.dvs[2], BP.dvs[2]);
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hk * G + g;
    for (int64_t i0 = 0; i0 < Sq; i0 += PF_BM)
      if (!shared || part.owns(g, i0, qblocks))
        fma_store_rows(dq_rows(g, i0), std::min<int64_t>(PF_BM, Sq - i0), D, P.scale, BP.dq, P.dt,
                       b * BP.dqs[0] + h * BP.dqs[1] + i0 * BP.dqs[2], BP.dqs[2]);  // (in place: scaled)
  }
}
#endif

// dq, dk, dv (in the inputs' dtype, rounded once from fp32), on the AVX-512 tier where bf16dot runs, else on AVX2;
// -1 where this CPU lacks AVX2, the dtype is not float32, bfloat16 or float16 (widened as packed) or D is not a
// multiple of 16 (up to 512): the caller takes another impl. Work items: whole (batch, KV head) groups, or their
// (head, query block) pairs split over threads (FmaBwdPart).
int64_t fma_backward(const BwdProblem& BP, int num_threads) {
#if PK_X86
  const Problem& P = BP.P;
  const bool dtype_ok = P.dt == pk::DType::Float32 || P.dt == pk::DType::BFloat16 || P.dt == pk::DType::Float16;
  if (!pk::cpu_has_avx2() || !dtype_ok || !fma_head_dim_ok(P.D)) return -1;
  const bool wide = bf16dot_cpu();  // the AVX-512 tier
  const int64_t groups = P.B * P.Hkv;
  if (groups == 0 || P.Sq == 0 || P.Sk == 0) return 0;  // (the caller returns zeros)
  const int64_t G = P.H / P.Hkv;
  const int64_t Sqp = (P.Sq + PF_BM - 1) / PF_BM * PF_BM, Skp = (P.Sk + FM_BN - 1) / FM_BN * FM_BN;
  const int threads = std::max(1, num_threads);
  // (no more parts than the group's (head, query block) pairs: a part without one would only pack K/V)
  const int parts = (int)std::clamp<int64_t>(threads / groups, 1, G * (Sqp / PF_BM));
  if (parts == 1) {
    std::vector<FmaBwdScratch> scratch((size_t)std::min<int64_t>(threads, groups));
    pk::parallel_chunks(groups, (int)scratch.size(), 1, [&](int t, int64_t g0, int64_t g1) {
      FmaBwdScratch& sc = scratch[(size_t)t];
      sc.size_for(G, Sqp, Skp, P.D, FmaBwdInPlace(BP), true);
      for (int64_t g = g0; g < g1; ++g) {
        if (wide) fma_bwd_group<FmaTier512>(BP, g / P.Hkv, g % P.Hkv, sc, FmaBwdPart());
        else fma_bwd_group<FmaTier256>(BP, g / P.Hkv, g % P.Hkv, sc, FmaBwdPart());
      }
    });
    return 0;
  }
  // Fewer groups than threads (MQA, a batch of one): each group's (head, query block) pairs split over
  // `parts` threads (FmaBwdPart), whose fp32 dK/dV sums are then added up and stored, in parallel over key
  // blocks. (One thread per group ran MQA 16/1 x 1024 x D=128 causal at 0.86x aten's time on 2 threads.)
  const int64_t items = groups * parts, part_elems = Skp * P.D, group_rows = G * Sqp * P.D;
  std::vector<float> dkv((size_t)(2 * items * part_elems), 0.f);  // [item][dk, dv][Skp][D]
  // each group's Q, dO and fp32 dQ rows (those not read or summed in place), written block by block by the
  // parts that own the blocks
  const FmaBwdInPlace in_place(BP);
  const size_t all_rows = (size_t)(groups * group_rows);
  std::vector<float> rows_qr(in_place.q ? 0 : all_rows), rows_dor(in_place.dout ? 0 : all_rows),
      rows_dq(in_place.dq ? 0 : all_rows);
  std::vector<FmaBwdScratch> scratch((size_t)items);
  pk::parallel_chunks(items, (int)items, 1, [&](int, int64_t it0, int64_t it1) {
    for (int64_t it = it0; it < it1; ++it) {
      FmaBwdScratch& sc = scratch[(size_t)it];
      sc.size_for(G, Sqp, Skp, P.D, in_place, false);
      const int64_t g = it / parts;
      FmaBwdPart part;
      part.part = (int)(it % parts);
      part.parts = parts;
      part.dk = dkv.data() + (size_t)(2 * it * part_elems);
      part.dv = part.dk + part_elems;
      part.qr = in_place.q ? nullptr : rows_qr.data() + (size_t)(g * group_rows);
      part.dor = in_place.dout ? nullptr : rows_dor.data() + (size_t)(g * group_rows);
      part.dq = in_place.dq ? nullptr : rows_dq.data() + (size_t)(g * group_rows);
      if (wide) fma_bwd_group<FmaTier512>(BP, g / P.Hkv, g % P.Hkv, sc, part);
      else fma_bwd_group<FmaTier256>(BP, g / P.Hkv, g % P.Hkv, sc, part);
    }
  });
  const int64_t row_blocks = Skp / FM_BN;
  pk::parallel_chunks(groups * row_blocks, threads, 1, [&](int, int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / row_blocks, b = g / P.Hkv, hk = g % P.Hkv, j0 = (w % row_blocks) * FM_BN;
      const int64_t nb = std::min<int64_t>(FM_BN, P.Sk - j0), n = nb * P.D;
      float* first = dkv.data() + (size_t)(2 * g * parts * part_elems + j0 * P.D);  // (part 0's sums, added to)
      for (int which = 0; which < 2; ++which) {  // dk, dv
        float* acc = first + which * part_elems;
        for (int p = 1; p < parts; ++p) {
          const float* src = acc + 2 * p * part_elems;
          for (int64_t e = 0; e < n; ++e) acc[e] += src[e];
        }
      }
      fma_store_rows(first, nb, P.D, P.scale, BP.dk, P.dt, b * BP.dks[0] + hk * BP.dks[1] + j0 * BP.dks[2],
                     BP.dks[2]);
      fma_store_rows(first + part_elems, nb, P.D, 1.f, BP.dv, P.dt, b * BP.dvs[0] + hk * BP.dvs[1] + j0 * BP.dvs[2],
                     BP.dvs[2]);
    }
  });
  return 0;
#else
  (void)BP;
  (void)num_threads;
  return -1;
#endif
}

// A Python tuple of 3 strides (dims b, h, s) into dst.
void read_strides(py::tuple t, int64_t* dst, const char* name) {
  if (t.size() != 3) pk::fail_value("flash_attention", std::string("expected 3 strides of ") + name);
  for (int i = 0; i < 3; ++i) dst[i] = t[i].cast<int64_t>();
}

// The Problem of a Python call's pointers, sizes and strides, checked.
Problem problem_of(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, int64_t B, int64_t H,
                   int64_t Hkv, int64_t Sq, int64_t Sk, int64_t D, py::tuple qs, py::tuple ks, py::tuple vs,
                   py::tuple os, py::tuple ls, double scale, bool causal, int dtype, const char* what) {
  const char* op = "flash_attention";
  const auto dt = static_cast<pk::DType>(dtype);
  if (dt != pk::DType::Float32 && dt != pk::DType::BFloat16 && dt != pk::DType::Float16)
    pk::fail_value(op, std::string("the ") + what + " kernel takes float32, bfloat16 or float16 inputs");
  if (B < 0 || H < 0 || Hkv <= 0 || Sq < 0 || Sk < 0 || D <= 0 || H % Hkv != 0)
    pk::fail_value(op, std::string("the ") + what + " kernel needs H a multiple of Hkv >= 1 and D >= 1");
  Problem P{reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k), reinterpret_cast<const void*>(v),
            reinterpret_cast<void*>(out), reinterpret_cast<float*>(lse), B, H, Hkv, Sq, Sk, D, {}, {}, {}, {}, {},
            (float)scale, causal, dt};
  read_strides(qs, P.qs, "q");
  read_strides(ks, P.ks, "k");
  read_strides(vs, P.vs, "v");
  read_strides(os, P.os, "out");
  read_strides(ls, P.ls, "lse");
  return P;
}

int64_t decode_forward_py(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, int64_t B, int64_t H,
                          int64_t Hkv, int64_t Sq, int64_t Sk, int64_t D, py::tuple qs, py::tuple ks, py::tuple vs,
                          py::tuple os, py::tuple ls, double scale, bool causal, int dtype, int num_threads,
                          int64_t grain) {
  const Problem P = problem_of(q, k, v, out, lse, B, H, Hkv, Sq, Sk, D, qs, ks, vs, os, ls, scale, causal, dtype,
                               "decode");
  py::gil_scoped_release release;
  return decode_forward(P, std::max(1, num_threads), grain);
}

int64_t prefill_forward_py(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, int64_t B,
                           int64_t H, int64_t Hkv, int64_t Sq, int64_t Sk, int64_t D, py::tuple qs, py::tuple ks,
                           py::tuple vs, py::tuple os, py::tuple ls, double scale, bool causal, int dtype,
                           int num_threads) {
  const Problem P = problem_of(q, k, v, out, lse, B, H, Hkv, Sq, Sk, D, qs, ks, vs, os, ls, scale, causal, dtype,
                               "bf16dot");
  py::gil_scoped_release release;
  return prefill_forward(P, std::max(1, num_threads));
}

int64_t fma_forward_py(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, int64_t B, int64_t H,
                       int64_t Hkv, int64_t Sq, int64_t Sk, int64_t D, py::tuple qs, py::tuple ks, py::tuple vs,
                       py::tuple os, py::tuple ls, double scale, bool causal, int dtype, int num_threads) {
  const Problem P = problem_of(q, k, v, out, lse, B, H, Hkv, Sq, Sk, D, qs, ks, vs, os, ls, scale, causal, dtype,
                               "fma");
  py::gil_scoped_release release;
  return fma_forward(P, std::max(1, num_threads));
}

// The bf16dot or the fma backward (`kernel`), from Python's arguments.
template <int64_t (*kernel)(const BwdProblem&, int)>
int64_t backward_py(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t dout, uintptr_t lse, uintptr_t delta,
                    uintptr_t dq, uintptr_t dk, uintptr_t dv, int64_t B, int64_t H, int64_t Hkv, int64_t Sq,
                    int64_t Sk, int64_t D, py::tuple qs, py::tuple ks, py::tuple vs, py::tuple dos,
                    py::tuple ls, py::tuple dls, py::tuple dqs, py::tuple dks, py::tuple dvs, double scale,
                    bool causal, int dtype, int num_threads) {
  const char* name = kernel == &fma_backward ? "fma" : "bf16dot";
  BwdProblem BP{problem_of(q, k, v, 0, 0, B, H, Hkv, Sq, Sk, D, qs, ks, vs, dqs, ls, scale, causal, dtype, name),
                reinterpret_cast<const void*>(dout), reinterpret_cast<const float*>(lse),
                reinterpret_cast<const float*>(delta), reinterpret_cast<void*>(dq), reinterpret_cast<void*>(dk),
                reinterpret_cast<void*>(dv), {}, {}, {}, {}, {}, {}};
  read_strides(dos, BP.dos, "dout");
  read_strides(ls, BP.lss, "lse");
  read_strides(dls, BP.dls, "delta");
  read_strides(dqs, BP.dqs, "dq");
  read_strides(dks, BP.dks, "dk");
  read_strides(dvs, BP.dvs, "dv");
  py::gil_scoped_release release;
  return kernel(BP, std::max(1, num_threads));
}

bool prefill_available() {
#if PK_X86
  return bf16dot_cpu();
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(_cpu_attention, m) {
  pk::def_mark_forked(m);
  pk::def_native_errors("flash_attention");
  m.doc() = "pykernels CPU attention kernels: decode (few query rows against a long KV cache), bf16dot "
            "(bfloat16 prefill with AVX-512 BF16 dot products) and fma (prefill forward and backward in fp32 with AVX2 or "
            "AVX-512 FMAs)";
  m.def("decode_forward", &decode_forward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("B"), py::arg("H"), py::arg("Hkv"), py::arg("Sq"), py::arg("Sk"), py::arg("D"),
        py::arg("q_strides"), py::arg("k_strides"), py::arg("v_strides"), py::arg("out_strides"),
        py::arg("lse_strides"), py::arg("scale"), py::arg("causal"), py::arg("dtype"), py::arg("num_threads"),
        py::arg("grain"),
        "Attention of q [B, H, Sq, D] over k, v [B, Hkv, Sk, D] (strides of dims b, h, s in elements, head dim "
        "dense) into out (q's dtype) and lse (float32); bottom-right causal. Returns how many rows that see "
        "keys got a non-finite lse (NaN/inf in q or k: recompute those problems on an exact path).");
  m.def("prefill_forward", &prefill_forward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("B"), py::arg("H"), py::arg("Hkv"), py::arg("Sq"), py::arg("Sk"), py::arg("D"),
        py::arg("q_strides"), py::arg("k_strides"), py::arg("v_strides"), py::arg("out_strides"),
        py::arg("lse_strides"), py::arg("scale"), py::arg("causal"), py::arg("dtype"), py::arg("num_threads"),
        "bfloat16 attention of q [B, H, Sq, D] over k, v [B, Hkv, Sk, D] with AVX-512 BF16 dot products (strides "
        "as decode_forward; D a multiple of 64, D <= 512); bottom-right causal. Returns how many rows that see "
        "keys got a non-finite lse, -1 where the kernel does not apply (no AVX-512 BF16, another dtype or D), or -2 "
        "where an input holds a nonzero value below 2^-50 or |scale| * D > 2^80 (the dot products would flush terms to 0; "
        "nothing computed).");
#define PK_BACKWARD_ARGS                                                                                          \
  py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dout"), py::arg("lse"), py::arg("delta"), py::arg("dq"),       \
      py::arg("dk"), py::arg("dv"), py::arg("B"), py::arg("H"), py::arg("Hkv"), py::arg("Sq"), py::arg("Sk"),       \
      py::arg("D"), py::arg("q_strides"), py::arg("k_strides"), py::arg("v_strides"), py::arg("dout_strides"),      \
      py::arg("lse_strides"), py::arg("delta_strides"), py::arg("dq_strides"), py::arg("dk_strides"),               \
      py::arg("dv_strides"), py::arg("scale"), py::arg("causal"), py::arg("dtype"), py::arg("num_threads")
  m.def("prefill_backward", &backward_py<prefill_backward>, PK_BACKWARD_ARGS,
        "bfloat16 flash-attention backward with AVX-512 BF16 dot products: dq, dk, dv (bf16, every element written "
        "where S_q, S_k > 0) from "
        "q, k, v, dout, the forward's lse and delta = rowsum(dout * out) - dlse (float32); finite inputs. Returns "
        "-1 where the kernel does not apply (as prefill_forward), -2 where an input holds a nonzero value below 2^-50 or |scale| * D > 2^80 (outputs "
        "partly written), else 0.");
  m.def("fma_backward", &backward_py<fma_backward>, PK_BACKWARD_ARGS,
        "flash-attention backward in fp32 with AVX2 or AVX-512 FMAs: dq, dk, dv (the inputs' dtype, every element "
        "written where S_q, S_k > 0) from q, k, v, dout (float32, bfloat16 or float16), the forward's lse and delta = "
        "rowsum(dout * out) - dlse (float32); finite inputs. Returns -1 where the kernel does not apply (no AVX2, "
        "another dtype, D not a multiple of 16 up to 512), else 0.");
#undef PK_BACKWARD_ARGS
  m.def("fma_forward", &fma_forward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("B"), py::arg("H"), py::arg("Hkv"), py::arg("Sq"), py::arg("Sk"), py::arg("D"),
        py::arg("q_strides"), py::arg("k_strides"), py::arg("v_strides"), py::arg("out_strides"),
        py::arg("lse_strides"), py::arg("scale"), py::arg("causal"), py::arg("dtype"), py::arg("num_threads"),
        "attention of q [B, H, Sq, D] over k, v [B, Hkv, Sk, D] in fp32 with AVX2 or AVX-512 FMAs (float32, or bfloat16 / "
        "float16 widened; strides as decode_forward; D a multiple of 16, D <= 512); bottom-right causal. Returns "
        "how many rows that see keys got a non-finite lse, -1 where the kernel does not apply (no AVX2, or D).");
  m.def("fma_available", &pk::cpu_has_avx2, "True when this CPU runs the fma kernel (AVX2 + FMA)");
  m.def("prefill_available", &prefill_available, "True when this CPU runs the bf16dot kernel (AVX-512 BF16)");
}
