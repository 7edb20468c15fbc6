// Per-token activation scale and offset for the bit-serial product (act_bits), shared by the CPU
// (qgemm_cpu.cpp) and CUDA/HIP (qgemm.cu) kernels; pykernels/quant/_format.py:act_fit is the same fit
// in torch (the Triton path and the tests' reference).
//
// A token x[0..K) is coded as A = sa * u + ma, u = clamp(round((x - ma) / sa), 0, 2^p - 1). The range
// alone (sa = (max - min) / (2^p - 1), ma = min) spent 1-bit codes on {min, max}: a relative error of 2.9
// on Gaussian tokens, worse than zeros (audit). The fit, as quantize() does for bipolar weights: the
// best (lowest squared error) of two starts, the range and the Gaussian optimum for the token's mean and
// deviation (the step of Max's least-squares uniform quantizer, IRE Trans. Inf. Theory 1960), and of two
// rounds of Lloyd's algorithm on the uniform grid from each (the least-squares line sa * u + ma through
// the codes, then each value's nearest code): never worse than the range. Gaussian tokens: 1 bit 0.60,
// 2 bits 0.35 (range 0.71), 4 bits 0.108 (0.140); within 5% of a brute-force search's best grid on
// most tokens (tests/test_quant.py).
//
// A caller runs the stages in order: candidate(stage) gives (s, m) or false (skip it), the caller sums
// accumulate() over the token for it (in any order: the sums' last bits differ between kernels; ties
// between candidates resolve to the earlier stage (kActFitTie), and two kernels' codes can still differ
// where a value lies within rounding of a code boundary, ~1e-15 of it), then offer().
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PKQ_HD __host__ __device__ __forceinline__
#else
#define PKQ_HD inline
#endif

namespace pkq {

// Steps of the least-squares uniform quantizer of a unit Gaussian with 2^b levels (Max 1960, Table II)
// (the same table as pykernels/quant/_format.py's _GAUSS_STEP).
PKQ_HD double gauss_step(int bits) {
  switch (bits) {
    case 1: return 1.596;
    case 2: return 0.9957;
    case 3: return 0.5860;
    case 4: return 0.3352;
    case 5: return 0.1881;
    case 6: return 0.1041;
    case 7: return 0.0569;
    default: return 0.0308;
  }
}

// Round half to even of q in [0, 255] (the codes' rounding, nearbyint's default mode) without a libm call
// on CPUs whose baseline ISA has no round instruction: adding 1.5 * 2^52 leaves no fraction bits.
PKQ_HD double round_even(double q) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return rint(q);
#else
  return (q + 0x1.8p52) - 0x1.8p52;
#endif
}

// What one candidate's codes give over the token: squared error, sum u, sum u^2, sum u (x - mean), and
// sum (x - mean)^2 (the deviation the Gaussian start needs; from the first stage's pass).
struct ActStats {
  double err = 0, su = 0, suu = 0, sux = 0, dev = 0;
  PKQ_HD void add(const ActStats& o) {
    err += o.err; su += o.su; suu += o.suu; sux += o.sux; dev += o.dev;
  }
};

PKQ_HD void accumulate(ActStats& a, double x, double s, double inv_s, double m, double qmax, double mean) {
  double q = (x - m) * inv_s;
  q = q > 0 ? (q < qmax ? q : qmax) : 0.0;
  const double u = round_even(q);
  const double d = u * s + m - x, c = x - mean;
  a.err += d * d;
  a.su += u;
  a.suu += u * u;
  a.sux += u * c;
  a.dev += c * c;
}

// Two chains of candidates, each a start then kActFitRounds Lloyd rounds: stage 0 the range, stages
// 1..R its rounds, stage R + 1 the Gaussian start, the rest its rounds. From either start alone, the
// best grid a brute-force search finds was missed by up to 6x (a token with one large outlier at 1 bit:
// the Gaussian start led to levels near +-0.8 sigma, the range's to {mean of the rest, the outlier}).
constexpr int kActFitRounds = 2;
constexpr int kActFitStages = 2 * (1 + kActFitRounds);

struct ActFit {
  int bits = 1;
  int64_t K = 0;
  double lo = 0, hi = 0, mean = 0;
  double dev = 0;           // sum (x - mean)^2 (from stage 0)
  double s = 1, m = 0;      // the best candidate so far
  ActStats best;
  ActStats chain;           // the current chain's last candidate
  bool chain_alive = false;
  PKQ_HD double qmax() const { return (double)((1 << bits) - 1); }
};

// lo, hi, sum: the token's min, max and sum (a finite token, K > 0).
PKQ_HD ActFit act_fit_begin(int bits, int64_t K, double lo, double hi, double sum) {
  ActFit f;
  f.bits = bits;
  f.K = K;
  f.lo = lo;
  f.hi = hi;
  f.mean = sum / (double)K;
  return f;
}

// Whether a fitted grid's levels m .. m + qmax s are float32 values (the GPU kernels store sa and ma in
// fp32; a Lloyd line may reach past the token's own range: a token holding +-3.4e38 gave ma = -4e38, -inf in
// fp32; review). The range (stage 0) is always kept, as before the fit.
PKQ_HD bool fp32_grid(double s, double m, double qmax) {
  const double big = 3.4028234663852886e38;
  return s <= big && m >= -big && m <= big && m + s * qmax <= big && m + s * qmax >= -big;
}

// The stage's (s, m), or false: the stage is skipped (and so are the rest of its chain).
PKQ_HD bool candidate(ActFit& f, int stage, double& s, double& m) {
  const double qmax = f.qmax(), n = (double)f.K;
  if (stage == 0) {  // the range
    s = f.hi > f.lo ? (f.hi - f.lo) / qmax : 1.0;
    // one bit over a range past float32's max: the step itself is no float32 (the GPU stores it as one:
    // inf, and NaN products; review finding), so it is capped there (levels lo and lo + FLT_MAX)
    if (s > 3.4028234663852886e38) s = 3.4028234663852886e38;
    m = f.lo;
    return f.chain_alive = true;
  }
  if (stage == 1 + kActFitRounds) {  // the Gaussian optimum for the token's mean and deviation
    s = gauss_step(f.bits) * sqrt(f.dev / n);
    m = f.mean - s * (qmax * 0.5);
    return f.chain_alive = s > 0 && fp32_grid(s, m, qmax);
  }
  if (!f.chain_alive) return false;
  // a Lloyd round: the least-squares line through the chain's last codes
  const double var_u = f.chain.suu - f.chain.su * (f.chain.su / n);
  f.chain_alive = var_u > 0 && f.chain.sux > 0;
  if (!f.chain_alive) return false;
  s = f.chain.sux / var_u;
  m = f.mean - s * (f.chain.su / n);
  return f.chain_alive = fp32_grid(s, m, qmax);
}

// A candidate replaces the best only if clearly better (by more than kActFitTie of it): candidates whose
// errors tie in exact arithmetic (integer-valued tokens, mirror-image 1-bit grids) differ in the last
// bits of their sums, which each kernel adds in its own order; a plain `<` let the CPU tiers, CUDA and
// torch keep different grids for the same token (review: 66 of 20000 rounded tokens at 2 bits).
constexpr double kActFitTie = 1e-9;

PKQ_HD void offer(ActFit& f, int stage, double s, double m, const ActStats& a) {
  if (stage == 0) f.dev = a.dev;
  f.chain = a;
  if (stage == 0 || a.err < f.best.err * (1.0 - kActFitTie)) {
    f.s = s;
    f.m = m;
    f.best = a;
  }
}

}  // namespace pkq
