// pykernels._cuda_qgemm: quantized GEMMs on NVIDIA (nvcc, sm_80/sm_90) and AMD (hipcc, gfx90a) GPUs.
//
// Weights come in the packed layouts of pykernels/quant/_format.py (made once at quantize time):
// w = s[n,g] * u + m[n,g]. For every 4-row tile and 32-element block the 4 rows' codes are one 64-byte
// line (bits <= 4: byte j = code j | code (16+j) << 4), so a tile's K range is one contiguous stream.
//
// 1. wo_gemm_kernel — weight-only, Marlin-style for the memory-bound regime (M up to ~64):
//    each CTA takes TILES 4-row tiles x a K slice of SLICE_BLOCKS*32 (striped split-K, so small M still
//    fills every SM), stages the slice of activations once in shared memory as fp32 (with per-block
//    sums for the offset term), and streams the weight lines through a STAGES-deep cp.async pipeline
//    (sm_80+; a plain 16-byte load elsewhere). Codes are dequantized in registers (fp32 FMA), partial
//    sums reduce in shared memory and meet in the fp32 output with atomics (Python adds bias, casts).
// 2. Bit-serial bipolar-INT (act_bits): act_quant_kernel quantizes each token to p bits and packs its bit
//    planes; bs_mma_kernel (sm_80+, CUDA) runs every (i, j) plane pair as 1-bit tensor-core MMAs
//    mma.m16n8k256 .b1 AND+POPC (weights = the 16-row A operand, tokens = the 8-column B operand),
//    recombines by shifts 2^(i+j) per group and applies the affine terms of ALGORITHMS.md;
//    bs_popc_kernel is the portable path (HIP, other archs): 32-bit __popc of AND.
// 3. wo_mma_kernel — weight-only on tensor cores (CUDA sm_80+, fp16/bf16 x, codes of <= 4 bits, up to 16
//    tokens per grid row): the default of the CUDA backend where it applies (see the kernel).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "pk_gpu.h"
#include "qgemm_act_fit.h"
#if PK_HIP
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

namespace {

constexpr int RT = 4;            // rows per tile
constexpr int KB = 32;           // codes per block
constexpr int THREADS = 128;     // one thread per (row, block) of a tile slice: 4 rows x 32 blocks
constexpr int SLICE_BLOCKS = 32; // K slice per CTA: 1024 elements
constexpr int TILES = 8;         // tiles per CTA (activations staged once, reused 8x)
constexpr int MT = 8;            // tokens per CTA (gridDim.z covers the rest)
constexpr int XSTRIDE = KB + 1;  // padded row of the staged activations: no bank conflicts across blocks

__device__ __forceinline__ float load_act(const void* x, int dt, int64_t i) {
  if (dt == 11) return static_cast<const float*>(x)[i];
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  if (dt == 10) return __uint_as_float((uint32_t)h << 16);  // bf16: the top half of an fp32
  __half hv;
  *reinterpret_cast<uint16_t*>(&hv) = h;
  return __half2float(hv);
}

// 16-byte global -> shared copy: cp.async (Ampere+) so the next tiles' lines are in flight while
// this one is dequantized; a synchronous copy on other targets.
__device__ __forceinline__ void copy16(void* smem, const void* gmem) {
#if !PK_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}
__device__ __forceinline__ void copy_commit() {
#if !PK_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void copy_wait() {
#if !PK_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// LB = 4: nibble layout (16 bytes per row per block); LB = 8: byte layout (32 bytes).
template <int LB>
__global__ void __launch_bounds__(THREADS) wo_gemm_kernel(const void* __restrict__ x, int xdt, int64_t M, int64_t N,
                                                          int64_t K, const uint8_t* __restrict__ w,
                                                          const float* __restrict__ scales,
                                                          const float* __restrict__ offsets, int64_t G, int64_t gsize,
                                                          int64_t NB, int64_t slice0, float* __restrict__ y) {
  constexpr int CHUNK = LB == 4 ? 16 : 32;
  constexpr int VEC = CHUNK / 16;
  constexpr int STAGES = LB == 4 ? 3 : 2;  // cp.async pipeline depth (fits 48 KiB of static smem)
  __shared__ float xs[MT][SLICE_BLOCKS * XSTRIDE];
  __shared__ float xsum[MT][SLICE_BLOCKS];
  __shared__ float red[MT][THREADS];
  __shared__ uint4 stage[STAGES][VEC][THREADS];

  const int tid = threadIdx.x;
  const int64_t T = (N + RT - 1) / RT;
  const int64_t b0 = (slice0 + (int64_t)blockIdx.y) * SLICE_BLOCKS;  // K slices go in launches of <= 65535
  const int64_t m0 = (int64_t)blockIdx.z * MT;
  const int64_t t0 = (int64_t)blockIdx.x * TILES;

  // Stage this K slice of MT tokens (fp32), then the per-block sums of the offset term.
  for (int i = tid; i < MT * SLICE_BLOCKS * KB; i += THREADS) {
    const int m = i / (SLICE_BLOCKS * KB), kk = i % (SLICE_BLOCKS * KB);
    const int64_t k = b0 * KB + kk;
    xs[m][(kk / KB) * XSTRIDE + kk % KB] = (m0 + m < M && k < K) ? load_act(x, xdt, (m0 + m) * K + k) : 0.f;
  }
  __syncthreads();
  for (int i = tid; i < MT * SLICE_BLOCKS; i += THREADS) {
    const int m = i / SLICE_BLOCKS, b = i % SLICE_BLOCKS;
    float s = 0.f;
    for (int j = 0; j < KB; ++j) s += xs[m][b * XSTRIDE + j];
    xsum[m][b] = s;
  }

  const int r = tid % RT, bl = tid / RT;  // this thread's row of each tile and block of the slice
  const int64_t b = b0 + bl;
  const bool valid_b = b < NB;
  auto line = [&](int64_t t) { return w + ((t * NB + b) * RT + r) * CHUNK; };
  for (int s = 0; s < STAGES - 1; ++s) {
    if (t0 + s < T && s < TILES && valid_b)
      for (int v = 0; v < VEC; ++v) copy16(&stage[s][v][tid], line(t0 + s) + 16 * v);
    copy_commit();
  }
  __syncthreads();

  for (int i = 0; i < TILES && t0 + i < T; ++i) {
    const int nx = i + STAGES - 1;
    if (nx < TILES && t0 + nx < T && valid_b)
      for (int v = 0; v < VEC; ++v) copy16(&stage[nx % STAGES][v][tid], line(t0 + nx) + 16 * v);
    copy_commit();
    copy_wait<STAGES - 1>();
    const int64_t n = (t0 + i) * RT + r;
    float acc[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = 0.f;
    if (valid_b && n < N) {
      const int64_t g = G == 1 ? 0 : min(G - 1, b * KB / gsize);
      const float sc = scales[n * G + g], of = offsets[n * G + g];
      uint32_t words[VEC * 4];
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const uint4 q = stage[i % STAGES][v][tid];
        words[4 * v + 0] = q.x; words[4 * v + 1] = q.y; words[4 * v + 2] = q.z; words[4 * v + 3] = q.w;
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float* xm = &xs[m][bl * XSTRIDE];
        float d = 0.f;
        if (LB == 4) {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const uint32_t byte = (words[j / 4] >> (8 * (j % 4))) & 0xffu;
            d = fmaf((float)(byte & 15u), xm[j], d);
            d = fmaf((float)(byte >> 4), xm[16 + j], d);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 32; ++j) d = fmaf((float)((words[j / 4] >> (8 * (j % 4))) & 0xffu), xm[j], d);
        }
        acc[m] = fmaf(sc, d, of * xsum[m][bl]);
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) red[m][tid] = acc[m];
    __syncthreads();
    if (tid < RT * MT) {
      const int m = tid / RT, rr = tid % RT;
      float s = 0.f;
      for (int j = 0; j < SLICE_BLOCKS; ++j) s += red[m][j * RT + rr];
      const int64_t nn = (t0 + i) * RT + rr;
      if (nn < N && m0 + m < M) atomicAdd(&y[(m0 + m) * N + nn], s);
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Bit-serial
// ---------------------------------------------------------------------------------------------
// The block's sums of a (kActThreads threads, a power of two), in every thread's a: the same totals in
// every thread, so each one's copy of the fit (qgemm_act_fit.h) takes the same decisions.
constexpr int kActThreads = 256;
__device__ __forceinline__ void block_sum_stats(pkq::ActStats& a, double (*red)[kActThreads]) {
  const int tid = threadIdx.x;
  red[0][tid] = a.err;
  red[1][tid] = a.su;
  red[2][tid] = a.suu;
  red[3][tid] = a.sux;
  red[4][tid] = a.dev;
  __syncthreads();
  for (int s = kActThreads / 2; s > 0; s >>= 1) {
    if (tid < s)
      for (int j = 0; j < 5; ++j) red[j][tid] += red[j][tid + s];
    __syncthreads();
  }
  a.err = red[0][0];
  a.su = red[1][0];
  a.suu = red[2][0];
  a.sux = red[3][0];
  a.dev = red[4][0];
  __syncthreads();  // every thread has read the totals before the next pass writes red
}

// One block of kActThreads per token: min/max/sum, the fitted scale and offset (qgemm_act_fit.h, in
// fp64 as on the CPU), p-bit codes u = clamp(round((x - ma)/sa)), their per-group sums and the bit planes
// as 32-bit halves [G][p][2*gw] (bit t of half h = element 32h + t of the group).
__global__ void act_quant_kernel(const void* __restrict__ x, int xdt, int64_t K, int p, int64_t G, int64_t gsize,
                                 int64_t gw, uint32_t* __restrict__ planes, int32_t* __restrict__ usum,
                                 float* __restrict__ sa_out, float* __restrict__ ma_out) {
  __shared__ float lo_s[kActThreads], hi_s[kActThreads];
  __shared__ double red[5][kActThreads];
  __shared__ int bad_s;
  const int64_t m = blockIdx.x;
  const int tid = threadIdx.x;
  float lo = INFINITY, hi = -INFINITY;
  double sum = 0;
  int bad = 0;
  if (tid == 0) bad_s = 0;
  for (int64_t k = tid; k < K; k += kActThreads) {
    const float v = load_act(x, xdt, m * K + k);
    bad |= !isfinite(v);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
    sum += (double)v;
  }
  lo_s[tid] = lo;
  hi_s[tid] = hi;
  red[0][tid] = sum;
  __syncthreads();
  if (bad) atomicOr(&bad_s, 1);
  for (int s = kActThreads / 2; s > 0; s >>= 1) {
    if (tid < s) {
      lo_s[tid] = fminf(lo_s[tid], lo_s[tid + s]);
      hi_s[tid] = fmaxf(hi_s[tid], hi_s[tid + s]);
      red[0][tid] += red[0][tid + s];
    }
    __syncthreads();
  }
  lo = lo_s[0];
  hi = hi_s[0];
  sum = red[0][0];
  const bool row_bad = bad_s != 0;
  __syncthreads();  // red is written again by the fit's first pass
  const int qmax = (1 << p) - 1;
  double sa = 1.0, ma = 0.0;
  if (!row_bad) {  // (uniform across the block)
    pkq::ActFit f = pkq::act_fit_begin(p, K, lo, hi, sum);
    for (int stage = 0; stage < pkq::kActFitStages; ++stage) {
      double s, mm;
      if (!pkq::candidate(f, stage, s, mm)) continue;  // the same decision in every thread
      pkq::ActStats a;
      const double inv = 1.0 / s;
      for (int64_t k = tid; k < K; k += kActThreads)
        pkq::accumulate(a, (double)load_act(x, xdt, m * K + k), s, inv, mm, (double)qmax, f.mean);
      block_sum_stats(a, red);
      pkq::offer(f, stage, s, mm, a);
    }
    sa = f.s;
    ma = f.m;
  }
  if (tid == 0) {
    sa_out[m] = row_bad ? NAN : (float)sa;
    ma_out[m] = (float)ma;
  }
  const int64_t halves = 2 * gw;
  for (int64_t idx = tid; idx < G * halves; idx += kActThreads) {
    const int64_t g = idx / halves, h = idx % halves;
    // One plane at a time (codes recomputed per plane): no dynamically indexed local array, which
    // would live in scratch memory on AMD.
    int32_t partial = 0;
    for (int i = 0; i < p; ++i) {
      uint32_t word = 0;
      for (int t = 0; t < 32; ++t) {
        const int64_t e = h * 32 + t, k = g * gsize + e;
        if (e < gsize && k < K) {
          // fp64 as on the CPU; clamped before the conversion (a fitted grid clips the tails, so an
          // outlier's quotient may be far out of int range; NaN of a bad row -> 0)
          double q = ((double)load_act(x, xdt, m * K + k) - ma) / sa;
          q = q > 0 ? (q < (double)qmax ? q : (double)qmax) : 0.0;
          const int u = (int)rint(q);
          if (i == 0) partial += u;
          word |= (uint32_t)((u >> i) & 1) << t;
        }
      }
      planes[((m * G + g) * p + i) * halves + h] = word;
    }
    atomicAdd(&usum[m * G + g], partial);  // usum is zeroed by the caller
  }
}

__device__ __forceinline__ uint32_t wplane_half(const uint32_t* wp, int64_t n, int64_t G, int q, int64_t gw,
                                                int64_t g, int j, int64_t h) {
  const int64_t t = n / RT, r = n % RT;
  return wp[(((((t * G + g) * q + j) * gw + h / 2) * RT + r) * 2) + (h & 1)];
}

// Portable bit-serial GEMM: one thread per (token, output row).
__global__ void bs_popc_kernel(const uint32_t* __restrict__ ap, const uint32_t* __restrict__ wp,
                               const float* __restrict__ scales, const float* __restrict__ offsets,
                               const int32_t* __restrict__ wsum, const int32_t* __restrict__ usum,
                               const float* __restrict__ sa_, const float* __restrict__ ma_, int64_t M, int64_t N,
                               int64_t K, int64_t G, int64_t gsize, int64_t gw, int p, int q, float* __restrict__ y) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t m = blockIdx.y;
  if (n >= N || m >= M) return;
  const float sa = sa_[m], ma = ma_[m];
  float acc = 0.f;
  const int64_t halves = 2 * gw;
  for (int64_t g = 0; g < G; ++g) {
    int64_t isum = 0;
    for (int i = 0; i < p; ++i)
      for (int j = 0; j < q; ++j) {
        int32_t c = 0;
        for (int64_t h = 0; h < halves; ++h)
          c += __popc(ap[((m * G + g) * p + i) * halves + h] & wplane_half(wp, n, G, q, gw, g, j, h));
        isum += (int64_t)c << (i + j);
      }
    const float len = (float)(min(K, (g + 1) * gsize) - g * gsize);
    const float s = scales[n * G + g], mo = offsets[n * G + g];
    // sa and ma factored out: sa * mo * sum(u_a) alone overflowed float for activations near FLT_MAX whose
    // terms cancel to a finite result (the Triton kernel's audit finding; the CPU sums in double)
    acc += sa * (s * (float)isum + mo * (float)usum[m * G + g]) + ma * (s * (float)wsum[n * G + g] + mo * len);
  }
  y[m * N + n] = acc;
}

#if !PK_HIP
// 1-bit tensor-core path: one warp computes 16 output rows x 8 tokens. Fragment layouts of
// mma.m16n8k256.row.col.s32.b1.b1.s32.and.popc (PTX ISA, "Matrix fragments for mma.m16n8k256"):
// lane = 4*groupID + tig; A (16x256 bits, row-major): a0 = row groupID, bits [32 tig, +32); a1 = row
// groupID+8; a2/a3 = the same rows at bit offset 128. B (256x8, column-major): b0 = column groupID,
// bits [32 tig, +32); b1 at +128. D: d0/d1 = row groupID, columns 2 tig and 2 tig + 1; d2/d3 = row +8.
// Groups shorter than 256 bits feed zero words beyond the group (AND makes them count nothing).
__global__ void bs_mma_kernel(const uint32_t* __restrict__ ap, const uint32_t* __restrict__ wp,
                              const float* __restrict__ scales, const float* __restrict__ offsets,
                              const int32_t* __restrict__ wsum, const int32_t* __restrict__ usum,
                              const float* __restrict__ sa_, const float* __restrict__ ma_, int64_t M, int64_t N,
                              int64_t K, int64_t G, int64_t gsize, int64_t gw, int p, int q, float* __restrict__ y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gid = lane / 4, tig = lane % 4;
  const int64_t n0 = ((int64_t)blockIdx.x * (blockDim.x / 32) + warp) * 16;
  const int64_t m0 = (int64_t)blockIdx.y * 8;
  if (n0 >= N) return;  // whole warp leaves together
  const int64_t halves = 2 * gw;
  const int64_t na = n0 + gid, nb = n0 + gid + 8;  // A rows of this lane
  const int64_t mb = m0 + gid;                      // B column of this lane
  const int64_t mc0 = m0 + 2 * tig, mc1 = mc0 + 1;  // D columns
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t g = 0; g < G; ++g) {
    // int64: a group's sum reaches (2^p - 1)(2^q - 1) * gsize, past 2^31 at 8 x 8 bits from gsize 33K
    // (group_size=-1: gsize = K); each MMA result alone is at most 256 per chunk
    int64_t isum[4] = {0, 0, 0, 0};
    for (int64_t c = 0; c < (halves + 7) / 8; ++c) {
      const int64_t h0 = 8 * c + tig, h1 = h0 + 4;
      for (int i = 0; i < p; ++i) {
        const uint32_t* arow = ap + ((mb * G + g) * p + i) * halves;
        const uint32_t b0 = (mb < M && h0 < halves) ? arow[h0] : 0u;
        const uint32_t b1 = (mb < M && h1 < halves) ? arow[h1] : 0u;
        for (int j = 0; j < q; ++j) {
          const uint32_t a0 = (na < N && h0 < halves) ? wplane_half(wp, na, G, q, gw, g, j, h0) : 0u;
          const uint32_t a1 = (nb < N && h0 < halves) ? wplane_half(wp, nb, G, q, gw, g, j, h0) : 0u;
          const uint32_t a2 = (na < N && h1 < halves) ? wplane_half(wp, na, G, q, gw, g, j, h1) : 0u;
          const uint32_t a3 = (nb < N && h1 < halves) ? wplane_half(wp, nb, G, q, gw, g, j, h1) : 0u;
          int32_t d0 = 0, d1 = 0, d2 = 0, d3 = 0;
          asm volatile(
              "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
              "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
              : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3)
              : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
          isum[0] += (int64_t)d0 << (i + j);
          isum[1] += (int64_t)d1 << (i + j);
          isum[2] += (int64_t)d2 << (i + j);
          isum[3] += (int64_t)d3 << (i + j);
        }
      }
    }
    const float len = (float)(min(K, (g + 1) * gsize) - g * gsize);
    const int64_t rows[4] = {na, na, nb, nb};
    const int64_t cols[4] = {mc0, mc1, mc0, mc1};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t n = rows[e], m = cols[e];
      if (n >= N || m >= M) continue;
      const float s = scales[n * G + g], mo = offsets[n * G + g], sa = sa_[m], ma = ma_[m];
      acc[e] += sa * (s * (float)isum[e] + mo * (float)usum[m * G + g]) + ma * (s * (float)wsum[n * G + g] + mo * len);
    }
  }
  const int64_t rows[4] = {na, na, nb, nb};
  const int64_t cols[4] = {mc0, mc1, mc0, mc1};
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (rows[e] < N && cols[e] < M) y[cols[e] * N + rows[e]] = acc[e];
#endif
}
#endif

#if !PK_HIP
// 3. wo_mma_kernel — weight-only codes of 4 bits or fewer x fp16/bf16 activations on tensor cores
//    (mma.m16n8k16, fp32 accumulate; sm_80+), the memory-bound regime of M <= 16 tokens per grid row.
//    A = 16 weight rows x 16 k of raw codes u (exact in fp16/bf16), B = 16 k x 8 tokens of x. The MMA's
//    k order is free as long as A and B agree (Marlin's trick), so each lane reads ONE 32-bit word of
//    a row's 16-byte line per 32-element block and feeds it as it lies: lane (g = lane/4, c = lane%4)
//    reads bytes [4c, 4c+4) of rows g and g+8; nibble half h of those bytes is MMA step h, bytes
//    (0, 2) give the slots 2c, 2c+1 and bytes (1, 3) the slots 2c+8, 2c+9 (PTX ISA, "Matrix fragments
//    for mma.m16n8k16"); the lane's B fragment is x at the same k. Codes become 16-bit floats without
//    a conversion instruction: (nibbles | exponent bits) is 1024 + u in fp16 (128 + u in bf16), minus
//    that bias in one fma.
//    Per group, the affine form sum_k x (s u + m) = s * sum_k x u + m * sum_k x: a second MMA with an
//    all-ones A gives sum_k x per token. Each CTA takes 16*RG rows and 8*NT tokens; its 8 warps split
//    K and meet in shared memory; the CTA writes y in x's dtype (+ bias) directly: no zero fill, no
//    atomics, no cast afterwards.
constexpr int MMA_WARPS = 8;
constexpr int MMA_UNROLL = 4;  // blocks whose weight words are loaded before any is used

template <bool BF16>
__device__ __forceinline__ uint32_t codes_to_pair(uint32_t word, int shift) {
  // nibbles at bits [shift, shift + 4) and [16 + shift, 20 + shift) -> (float16/bfloat16 u_lo, u_hi)
  const uint32_t biased = ((word >> shift) & 0x000F000Fu) | (BF16 ? 0x43004300u : 0x64006400u);
  uint32_t out;
  if (BF16)  // 1.0 * (128 + u) - 128
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(biased), "r"(0x3F803F80u), "r"(0xC300C300u));
  else       // 1.0 * (1024 + u) - 1024
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(biased), "r"(0x3C003C00u), "r"(0xE400E400u));
  return out;
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if (BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x[k .. k+3] of one token as two 32-bit words (zeros past K or for a missing token).
__device__ __forceinline__ void load_x4(const uint16_t* row, bool ok, int64_t k, int64_t K, bool vec, uint32_t& lo,
                                        uint32_t& hi) {
  if (!ok) { lo = hi = 0u; return; }
  if (vec && k + 3 < K) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + k);
    lo = v.x; hi = v.y;
    return;
  }
  uint32_t e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = k + i < K ? row[k + i] : 0u;
  lo = e[0] | (e[1] << 16);
  hi = e[2] | (e[3] << 16);
}

template <bool BF16, int NT, int RG, bool PIPE>
__global__ void __launch_bounds__(MMA_WARPS * 32, 1) wo_mma_kernel(
    const uint16_t* __restrict__ x, int64_t M, int64_t N, int64_t K, const uint8_t* __restrict__ w,
    const float* __restrict__ scales, const float* __restrict__ offsets, int64_t G, int64_t gsize, int64_t NB,
    const float* __restrict__ bias, uint16_t* __restrict__ y, bool x_vec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float red[MMA_WARPS][RG * NT * 4][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gid = lane / 4, c = lane % 4;
  const int64_t n0 = (int64_t)blockIdx.x * 16 * RG;
  const int64_t m0 = (int64_t)blockIdx.y * 8 * NT;
  const int64_t T = (N + 3) / 4;  // 4-row tiles in the packed layout
  const uint32_t ONE = BF16 ? 0x3F803F80u : 0x3C003C00u;

  // This warp's share of K, in whole 32-element blocks.
  const int64_t per = (NB + MMA_WARPS - 1) / MMA_WARPS;
  const int64_t b_begin = warp * per, b_end = min(NB, b_begin + per);

  // Weight words: rows n0 + 16q + gid (+8), bytes [4c, 4c+4) of each block's 16-byte row line.
  const uint8_t* wrow[RG][2];
  bool wok[RG][2];
  int64_t rows[RG][2];
#pragma unroll
  for (int q = 0; q < RG; ++q)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t R = n0 + 16 * q + gid + 8 * hf;
      rows[q][hf] = R;
      wok[q][hf] = R / 4 < T;
      wrow[q][hf] = w + ((R / 4) * NB * RT + R % 4) * 16 + 4 * c;  // + b * 64 for block b
    }
  const uint16_t* xrow[NT];
  bool xok[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int64_t m = m0 + 8 * t + gid;
    xok[t] = m < M;
    xrow[t] = x + (xok[t] ? m : 0) * K;
  }

  float total[RG][NT][4], cg[RG][NT][4], cx[NT][4];
#pragma unroll
  for (int q = 0; q < RG; ++q)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) total[q][t][i] = cg[q][t][i] = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) cx[t][i] = 0.f;

  // A group's scales and offsets for this lane's rows (0 past N).
  auto load_scales = [&](int64_t grp, float (&sc)[RG][2], float (&of)[RG][2]) {
#pragma unroll
    for (int q = 0; q < RG; ++q)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const bool ok = rows[q][hf] < N;
        sc[q][hf] = ok ? scales[rows[q][hf] * G + grp] : 0.f;
        of[q][hf] = ok ? offsets[rows[q][hf] * G + grp] : 0.f;
      }
  };
  // total += s * sum(x u) + m * sum(x) for the group just finished, then restart its sums.
  auto apply = [&](const float (&sc)[RG][2], const float (&of)[RG][2]) {
#pragma unroll
    for (int q = 0; q < RG; ++q)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          total[q][t][i] = fmaf(sc[q][i / 2], cg[q][t][i], fmaf(of[q][i / 2], cx[t][i % 2], total[q][t][i]));
          cg[q][t][i] = 0.f;
        }
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) cx[t][i] = 0.f;
  };
  // Weight words of blocks [base, base + MMA_UNROLL) (zeros past this warp's share or the packed tiles).
  auto load_w = [&](uint32_t (&wv)[MMA_UNROLL][RG][2], int64_t base) {
#pragma unroll
    for (int u = 0; u < MMA_UNROLL; ++u)
#pragma unroll
      for (int q = 0; q < RG; ++q)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          wv[u][q][hf] = (base + u < b_end && wok[q][hf])
                             ? __ldg(reinterpret_cast<const uint32_t*>(wrow[q][hf] + (base + u) * RT * 16))
                             : 0u;
  };
  // This lane's B fragments of block b, nibble half h: (x[k], x[k+2]) for slots 2c, 2c+1 and
  // (x[k+1], x[k+3]) for slots 2c+8, 2c+9.
  auto load_b = [&](uint32_t (&bx)[NT][2], int64_t b, int h) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      uint32_t lo, hi;
      load_x4(xrow[t], xok[t], b * KB + 16 * h + 4 * c, K, x_vec, lo, hi);
      bx[t][0] = __byte_perm(lo, hi, 0x5410);
      bx[t][1] = __byte_perm(lo, hi, 0x7632);
    }
  };
  // The two MMA steps of block u of wv (nibble half h) for every row group and token tile, and the
  // all-ones MMA that sums x.
  auto mma_block = [&](const uint32_t (&wv)[MMA_UNROLL][RG][2], int u, int h, const uint32_t (&bx)[NT][2]) {
#pragma unroll
    for (int q = 0; q < RG; ++q) {
      const uint32_t a0 = codes_to_pair<BF16>(wv[u][q][0], 4 * h);      // row g, bytes 0/2
      const uint32_t a1 = codes_to_pair<BF16>(wv[u][q][1], 4 * h);      // row g+8, bytes 0/2
      const uint32_t a2 = codes_to_pair<BF16>(wv[u][q][0], 8 + 4 * h);  // row g, bytes 1/3
      const uint32_t a3 = codes_to_pair<BF16>(wv[u][q][1], 8 + 4 * h);  // row g+8, bytes 1/3
#pragma unroll
      for (int t = 0; t < NT; ++t) mma16816<BF16>(cg[q][t], a0, a1, a2, a3, bx[t][0], bx[t][1]);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) mma16816<BF16>(cx[t], ONE, ONE, ONE, ONE, bx[t][0], bx[t][1]);
  };

  auto group_of = [&](int64_t b) -> int64_t { return G == 1 ? 0 : min(G - 1, b * KB / gsize); };
  int64_t cur = -1;  // the group whose sums cg/cx hold
  float sc[RG][2], of[RG][2];
  if constexpr (!PIPE) {
    // Each iteration loads its blocks' weight words, then per block its x fragments, and per group its
    // scales when the group ends: simple, but each of those is a dependent round trip.
    for (int64_t b0 = b_begin; b0 < b_end; b0 += MMA_UNROLL) {
      uint32_t wv[MMA_UNROLL][RG][2];
      load_w(wv, b0);
#pragma unroll
      for (int u = 0; u < MMA_UNROLL; ++u) {
        const int64_t b = b0 + u;
        if (b >= b_end) break;
        const int64_t grp = group_of(b);
        if (grp != cur) {
          if (cur >= 0) {
            load_scales(cur, sc, of);
            apply(sc, of);
          }
          cur = grp;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t bx[NT][2];
          load_b(bx, b, h);
          mma_block(wv, u, h, bx);
        }
      }
    }
    if (cur >= 0) {
      load_scales(cur, sc, of);
      apply(sc, of);
    }
  } else {
    // Loads ahead of use: the next iteration's weight words are in flight while this one's MMAs run,
    // this iteration's x fragments are all loaded before the first MMA, and a group's scales are
    // loaded when the group starts (used when it ends).
    uint32_t wv[MMA_UNROLL][RG][2], wn[MMA_UNROLL][RG][2];
    load_w(wv, b_begin);
    for (int64_t b0 = b_begin; b0 < b_end; b0 += MMA_UNROLL) {
      load_w(wn, b0 + MMA_UNROLL);
      uint32_t bx[MMA_UNROLL][2][NT][2];
#pragma unroll
      for (int u = 0; u < MMA_UNROLL; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) load_b(bx[u][h], b0 + u < b_end ? b0 + u : b0, h);
#pragma unroll
      for (int u = 0; u < MMA_UNROLL; ++u) {
        const int64_t b = b0 + u;
        if (b >= b_end) break;
        const int64_t grp = group_of(b);
        if (grp != cur) {
          if (cur >= 0) apply(sc, of);
          cur = grp;
          load_scales(cur, sc, of);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) mma_block(wv, u, h, bx[u][h]);
      }
#pragma unroll
      for (int u = 0; u < MMA_UNROLL; ++u)
#pragma unroll
        for (int q = 0; q < RG; ++q)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) wv[u][q][hf] = wn[u][q][hf];
    }
    if (cur >= 0) apply(sc, of);
  }

  // The warps' K shares meet in shared memory; every thread then writes some of the outputs.
#pragma unroll
  for (int q = 0; q < RG; ++q)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][(q * NT + t) * 4 + i][lane] = total[q][t][i];
  __syncthreads();
  for (int e = threadIdx.x; e < RG * NT * 4 * 32; e += MMA_WARPS * 32) {
    const int slot = e / 32, ln = e % 32;
    const int q = slot / (NT * 4), t = (slot / 4) % NT, i = slot % 4;
    const int64_t n = n0 + 16 * q + ln / 4 + 8 * (i / 2);
    const int64_t m = m0 + 8 * t + 2 * (ln % 4) + (i % 2);
    if (n >= N || m >= M) continue;
    float v = 0.f;
#pragma unroll
    for (int wp = 0; wp < MMA_WARPS; ++wp) v += red[wp][slot][ln];
    if (bias) v += bias[n];
    uint16_t out;
    if (BF16)
      asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(out) : "f"(v));
    else
      asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(out) : "f"(v));
    y[m * N + n] = out;
  }
#endif
}
#endif

}  // namespace

// Host entry points (no CUDA types in the signatures: the binding file includes no CUDA headers).
// Grid dimensions y and z hold at most 65535 blocks: tokens (M) go in chunks of at most this many blocks, and so
// do pk_qgemm_wo's K slices (y: ceil(K / 1024) passed 65535 at K > 67,107,840; the slices add into y atomically).
constexpr int64_t kMaxGridYZ = 65535;

void pk_qgemm_wo(uintptr_t x, int xdt, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                 uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t y, uintptr_t stream) {
  const pk::GpuScope gpu_scope("qmatmul", x);
  if (M <= 0 || N <= 0 || K <= 0) return;
  const int64_t NB = (K + KB - 1) / KB;
  const int64_t gsize = group_size == -1 ? K : group_size;
  const int64_t G = (K + gsize - 1) / gsize;
  const int64_t T = (N + RT - 1) / RT;
  const int64_t x_bytes = xdt == 11 ? 4 : 2;  // fp32, or bf16/fp16 (load_act)
  auto s = (pk_stream_t)stream;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxGridYZ * MT) {
    const int64_t mc = std::min<int64_t>(M - m0, kMaxGridYZ * MT);
    const void* xc = (const void*)(x + (uintptr_t)(m0 * K * x_bytes));
    float* yc = (float*)y + m0 * N;
    const int64_t slices = (NB + SLICE_BLOCKS - 1) / SLICE_BLOCKS;
    for (int64_t sl0 = 0; sl0 < slices; sl0 += kMaxGridYZ) {
      dim3 grid((unsigned)((T + TILES - 1) / TILES), (unsigned)std::min<int64_t>(slices - sl0, kMaxGridYZ),
                (unsigned)((mc + MT - 1) / MT));
      if (bits <= 4)
        wo_gemm_kernel<4><<<grid, THREADS, 0, s>>>(xc, xdt, mc, N, K, (const uint8_t*)w, (const float*)scales,
                                                   (const float*)offsets, G, gsize, NB, sl0, yc);
      else
        wo_gemm_kernel<8><<<grid, THREADS, 0, s>>>(xc, xdt, mc, N, K, (const uint8_t*)w, (const float*)scales,
                                                   (const float*)offsets, G, gsize, NB, sl0, yc);
      PK_GPU_CHECK("qmatmul", pkGetLastError());
    }
  }
}

// The tensor-core path (wo_mma_kernel): x fp16 (xdt 9) or bf16 (xdt 10), codes of at most 4 bits, y in x's
// dtype written whole (bias: fp32 [N] or 0). rg: 16-row groups per CTA (1, 2 or 4); pipe: loads issued
// an iteration ahead (the PIPE variant). CUDA sm_80+ only.
void pk_qgemm_wo_mma(uintptr_t x, int xdt, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                     uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int rg,
                     bool pipe, uintptr_t stream) {
  const pk::GpuScope gpu_scope("qmatmul", x);
  if (bits > 4) throw std::invalid_argument("pykernels.qmatmul: the 'mma' kernel takes codes of at most 4 bits");
  if (xdt != 9 && xdt != 10)
    throw std::invalid_argument("pykernels.qmatmul: the 'mma' kernel takes float16 or bfloat16 activations");
  if (rg != 1 && rg != 2 && rg != 4)
    throw std::invalid_argument("pykernels.qmatmul: expected config 'rg' in {1, 2, 4}, got " + std::to_string(rg));
  if (M <= 0 || N <= 0) return;
  // y comes uninitialised and the kernel writes all of it: with K = 0 it would write nothing (the Python
  // op returns bias or zeros itself before calling)
  if (K <= 0) throw std::invalid_argument("pykernels.qmatmul: the 'mma' kernel needs K > 0");
#if PK_HIP
  (void)w; (void)scales; (void)offsets; (void)group_size; (void)bias; (void)y; (void)pipe; (void)stream;
  throw std::invalid_argument("pykernels.qmatmul: the 'mma' kernel is CUDA-only (use kernel='simt')");
#else
  const int64_t NB = (K + KB - 1) / KB;
  const int64_t gsize = group_size == -1 ? K : group_size;
  const int64_t G = (K + gsize - 1) / gsize;
  const bool bf16 = xdt == 10;
  const bool x_vec = K % 4 == 0 && x % 8 == 0;
  const int nt = M <= 8 ? 1 : 2;
  const int64_t chunk = kMaxGridYZ * 8 * nt;
  auto s = (pk_stream_t)stream;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t mc = std::min<int64_t>(M - m0, chunk);
    const uint16_t* xc = (const uint16_t*)x + m0 * K;
    uint16_t* yc = (uint16_t*)y + m0 * N;
    dim3 grid((unsigned)((N + 16 * rg - 1) / (16 * rg)), (unsigned)((mc + 8 * nt - 1) / (8 * nt)));
#define PK_WO_MMA(B, NT_, RG_, P_)                                                                       \
  wo_mma_kernel<B, NT_, RG_, P_><<<grid, MMA_WARPS * 32, 0, s>>>(xc, mc, N, K, (const uint8_t*)w,                 \
                                                                (const float*)scales, (const float*)offsets, G,   \
                                                                gsize, NB, (const float*)bias, yc, x_vec)
#define PK_WO_MMA_P(B, NT_, RG_) \
  if (pipe) PK_WO_MMA(B, NT_, RG_, true); else PK_WO_MMA(B, NT_, RG_, false);
#define PK_WO_MMA_RG(B, NT_)                  \
  if (rg == 1) { PK_WO_MMA_P(B, NT_, 1) }      \
  else if (rg == 2) { PK_WO_MMA_P(B, NT_, 2) } \
  else { PK_WO_MMA_P(B, NT_, 4) }
    if (bf16) {
      if (nt == 1) { PK_WO_MMA_RG(true, 1) } else { PK_WO_MMA_RG(true, 2) }
    } else {
      if (nt == 1) { PK_WO_MMA_RG(false, 1) } else { PK_WO_MMA_RG(false, 2) }
    }
#undef PK_WO_MMA_RG
#undef PK_WO_MMA_P
#undef PK_WO_MMA
    PK_GPU_CHECK("qmatmul", pkGetLastError());
  }
#endif
}

// workspace: planes [M*G*p*2gw] u32, usum [M*G] i32 (zeroed by the caller), sa [M], ma [M] f32.
void pk_qgemm_bitserial(uintptr_t x, int xdt, int64_t M, int64_t K, int act_bits, uintptr_t wplanes, int bits,
                        uintptr_t scales, uintptr_t offsets, uintptr_t wsum, int64_t N, int64_t group_size,
                        uintptr_t aplanes, uintptr_t usum, uintptr_t sa, uintptr_t ma, uintptr_t y, bool use_mma,
                        uintptr_t stream) {
  const pk::GpuScope gpu_scope("qmatmul", x);
  if (M <= 0 || N <= 0 || K <= 0) return;
  const int64_t gsize = group_size == -1 ? K : group_size;
  const int64_t G = (K + gsize - 1) / gsize;
  const int64_t gw = (gsize + 63) / 64;
  auto s = (pk_stream_t)stream;
  act_quant_kernel<<<(unsigned)M, kActThreads, 0, s>>>((const void*)x, xdt, K, act_bits, G, gsize, gw, (uint32_t*)aplanes,
                                                (int32_t*)usum, (float*)sa, (float*)ma);
  PK_GPU_CHECK("qmatmul", pkGetLastError());
  // Tokens in chunks (grid y holds at most 65535 blocks); the per-token workspaces move with them.
  const int64_t plane_words = G * act_bits * 2 * gw;  // aplanes per token
#if !PK_HIP
  if (use_mma) {
    const int warps = 4;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxGridYZ * 8) {
      const int64_t mc = std::min<int64_t>(M - m0, kMaxGridYZ * 8);
      dim3 grid((unsigned)((N + 16 * warps - 1) / (16 * warps)), (unsigned)((mc + 7) / 8));
      bs_mma_kernel<<<grid, 32 * warps, 0, s>>>((const uint32_t*)aplanes + m0 * plane_words, (const uint32_t*)wplanes,
                                                (const float*)scales, (const float*)offsets, (const int32_t*)wsum,
                                                (const int32_t*)usum + m0 * G, (const float*)sa + m0,
                                                (const float*)ma + m0, mc, N, K, G, gsize, gw, act_bits, bits,
                                                (float*)y + m0 * N);
      PK_GPU_CHECK("qmatmul", pkGetLastError());
    }
    return;
  }
#endif
  (void)use_mma;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxGridYZ) {
    const int64_t mc = std::min<int64_t>(M - m0, kMaxGridYZ);
    dim3 grid((unsigned)((N + 127) / 128), (unsigned)mc);
    bs_popc_kernel<<<grid, 128, 0, s>>>((const uint32_t*)aplanes + m0 * plane_words, (const uint32_t*)wplanes,
                                        (const float*)scales, (const float*)offsets, (const int32_t*)wsum,
                                        (const int32_t*)usum + m0 * G, (const float*)sa + m0, (const float*)ma + m0,
                                        mc, N, K, G, gsize, gw, act_bits, bits, (float*)y + m0 * N);
    PK_GPU_CHECK("qmatmul", pkGetLastError());
  }
}
