// Scalar versions of the AVX-512 (F, BW, DQ, VL, BF16) intrinsics that csrc/attention/attention_cpu.cpp's
// bf16dot kernels use, for a test build (-DPK_EMULATE_AVX512; tests/test_attention_avx512_emulated.py) on
// CPUs without AVX-512 BF16: the kernels' logic (packing, tiling, masking, the shared-group backward, the
// subnormal checks) then runs where the real instructions cannot. Semantics follow Intel's SDM, including
// what the kernels rely on: vdpbf16ps reads subnormal bf16 inputs as 0 and flushes subnormal results
// (whatever MXCSR says), adding the odd product first; vcvtneps2bf16 rounds to nearest even and keeps NaN
// quiet. Each emulated intrinsic is a macro over the real name, so an intrinsic the kernels start to use
// without a version here fails to compile (the real one needs a target attribute the test build drops).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <climits>
#include <cstdlib>
typedef float emu_m512 __attribute__((vector_size(64), may_alias));
typedef long long emu_m512i __attribute__((vector_size(64), may_alias));
typedef short emu_m512bh __attribute__((vector_size(64), may_alias));
typedef short emu_m256bh __attribute__((vector_size(32), may_alias));
#define __m512 emu_m512
#define __m512i emu_m512i
#define __m512bh emu_m512bh
#define __m256bh emu_m256bh
namespace emu {
template <class T, class S> inline T bc(const S& s) { static_assert(sizeof(T) == sizeof(S), ""); T t; std::memcpy(&t, &s, sizeof t); return t; }
struct F { float v[16]; }; struct I { int32_t v[16]; }; struct H { uint16_t v[32]; }; struct H16 { uint16_t v[16]; };
inline F f(emu_m512 x) { return bc<F>(x); } inline emu_m512 f(const F& x) { return bc<emu_m512>(x); }
inline I i(emu_m512i x) { return bc<I>(x); } inline emu_m512i i(const I& x) { return bc<emu_m512i>(x); }
inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; if ((u & 0x7F800000u) == 0) u &= 0x80000000u; return bc<float>(u); }
inline float ftz(float x) { uint32_t u = bc<uint32_t>(x); if ((u & 0x7F800000u) == 0) u &= 0x80000000u; return bc<float>(u); }
inline uint16_t f2bf(float x) {
  uint32_t u = bc<uint32_t>(x);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return (uint16_t)((u >> 16) | 0x40);
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
}
#define EMU_MAP1(op) emu::F r; for (int j = 0; j < 16; ++j) r.v[j] = (op); return emu::f(r)
inline emu_m512 emu_set1_ps(float a) { emu::F r; for (int j = 0; j < 16; ++j) r.v[j] = a; return emu::f(r); }
inline emu_m512 emu_setzero_ps() { return emu_set1_ps(0.f); }
inline emu_m512 emu_loadu_ps(const void* p) { emu::F r; std::memcpy(&r, p, 64); return emu::f(r); }
inline void emu_storeu_ps(void* p, emu_m512 a) { std::memcpy(p, &a, 64); }
inline void emu_mask_storeu_ps(void* p, __mmask16 k, emu_m512 a) { auto A = emu::f(a); float* q = (float*)p; for (int j = 0; j < 16; ++j) if ((k >> j) & 1) q[j] = A.v[j]; }
inline emu_m512i emu_loadu_si512(const void* p) { emu_m512i r; std::memcpy(&r, p, 64); return r; }
inline void emu_storeu_si512(void* p, emu_m512i a) { std::memcpy(p, &a, 64); }
inline emu_m512i emu_set1_epi32(int a) { emu::I r; for (int j = 0; j < 16; ++j) r.v[j] = a; return emu::i(r); }
inline emu_m512i emu_set1_epi16(short a) { emu::H r; for (int j = 0; j < 32; ++j) r.v[j] = (uint16_t)a; return emu::bc<emu_m512i>(r); }
inline emu_m512i emu_setr_epi32(int a0,int a1,int a2,int a3,int a4,int a5,int a6,int a7,int a8,int a9,int a10,int a11,int a12,int a13,int a14,int a15) {
  emu::I r{{a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,a10,a11,a12,a13,a14,a15}}; return emu::i(r); }
inline emu_m512 emu_mul_ps(emu_m512 a, emu_m512 b) { auto A = emu::f(a), B = emu::f(b); EMU_MAP1(A.v[j] * B.v[j]); }
inline emu_m512 emu_add_ps(emu_m512 a, emu_m512 b) { auto A = emu::f(a), B = emu::f(b); EMU_MAP1(A.v[j] + B.v[j]); }
inline emu_m512 emu_sub_ps(emu_m512 a, emu_m512 b) { auto A = emu::f(a), B = emu::f(b); EMU_MAP1(A.v[j] - B.v[j]); }
inline emu_m512 emu_max_ps(emu_m512 a, emu_m512 b) { auto A = emu::f(a), B = emu::f(b); EMU_MAP1(A.v[j] > B.v[j] ? A.v[j] : B.v[j]); }
inline emu_m512 emu_min_ps(emu_m512 a, emu_m512 b) { auto A = emu::f(a), B = emu::f(b); EMU_MAP1(A.v[j] < B.v[j] ? A.v[j] : B.v[j]); }
inline emu_m512 emu_fmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) { auto A = emu::f(a), B = emu::f(b), C = emu::f(c); EMU_MAP1(std::fma(A.v[j], B.v[j], C.v[j])); }
inline emu_m512 emu_fnmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) { auto A = emu::f(a), B = emu::f(b), C = emu::f(c); EMU_MAP1(std::fma(-A.v[j], B.v[j], C.v[j])); }
inline emu_m512 emu_maskz_mov_ps(__mmask16 k, emu_m512 a) { auto A = emu::f(a); EMU_MAP1(((k >> j) & 1) ? A.v[j] : 0.f); }
inline emu_m512 emu_maskz_mul_ps(__mmask16 k, emu_m512 a, emu_m512 b) { auto A = emu::f(a), B = emu::f(b); EMU_MAP1(((k >> j) & 1) ? A.v[j] * B.v[j] : 0.f); }
inline emu_m512 emu_maskz_loadu_ps(__mmask16 k, const void* p) { const float* q = (const float*)p; EMU_MAP1(((k >> j) & 1) ? q[j] : 0.f); }
inline emu_m512 emu_mask_loadu_ps(emu_m512 s, __mmask16 k, const void* p) { const float* q = (const float*)p; auto S = emu::f(s); EMU_MAP1(((k >> j) & 1) ? q[j] : S.v[j]); }
inline __mmask16 emu_cmp_ps_mask(emu_m512 a, emu_m512 b, int pred) {
  auto A = emu::f(a), B = emu::f(b); __mmask16 m = 0;
  for (int j = 0; j < 16; ++j) {
    bool t;
    if (pred == _CMP_LT_OQ) t = A.v[j] < B.v[j];
    else if (pred == _CMP_NEQ_UQ) t = !(A.v[j] == B.v[j]);
    else std::abort();
    if (t) m |= (__mmask16)(1u << j);
  }
  return m;
}
inline emu_m512 emu_roundscale_ps(emu_m512 a, int imm) { if ((imm & 3) != 0 || (imm >> 4)) std::abort(); auto A = emu::f(a); EMU_MAP1(std::nearbyint(A.v[j])); }
inline emu_m512i emu_cvtps_epi32(emu_m512 a) { auto A = emu::f(a); emu::I r; for (int j = 0; j < 16; ++j) { float x = std::nearbyint(A.v[j]); r.v[j] = (x != x || x >= 2147483648.f || x < -2147483648.f) ? INT_MIN : (int32_t)x; } return emu::i(r); }
inline emu_m512 emu_castsi512_ps(emu_m512i a) { return emu::bc<emu_m512>(a); }
inline emu_m512i emu_add_epi32(emu_m512i a, emu_m512i b) { auto A = emu::i(a), B = emu::i(b); emu::I r; for (int j = 0; j < 16; ++j) r.v[j] = (int32_t)((uint32_t)A.v[j] + (uint32_t)B.v[j]); return emu::i(r); }
inline emu_m512i emu_mullo_epi32(emu_m512i a, emu_m512i b) { auto A = emu::i(a), B = emu::i(b); emu::I r; for (int j = 0; j < 16; ++j) r.v[j] = (int32_t)((uint32_t)A.v[j] * (uint32_t)B.v[j]); return emu::i(r); }
inline emu_m512i emu_slli_epi32(emu_m512i a, unsigned imm) { auto A = emu::i(a); emu::I r; for (int j = 0; j < 16; ++j) r.v[j] = imm > 31 ? 0 : (int32_t)((uint32_t)A.v[j] << imm); return emu::i(r); }
inline emu_m512i emu_and_si512(emu_m512i a, emu_m512i b) { return a & b; }
inline emu_m512i emu_or_si512(emu_m512i a, emu_m512i b) { return a | b; }
inline emu_m512i emu_cvtepu16_epi32(__m256i a) { auto A = emu::bc<emu::H16>(a); emu::I r; for (int j = 0; j < 16; ++j) r.v[j] = A.v[j]; return emu::i(r); }
inline emu_m512i emu_i32gather_epi32(emu_m512i idx, const void* base, int scale) { auto X = emu::i(idx); emu::I r; for (int j = 0; j < 16; ++j) std::memcpy(&r.v[j], (const char*)base + (int64_t)X.v[j] * scale, 4); return emu::i(r); }
inline __mmask32 emu_test_epi16_mask(emu_m512i a, emu_m512i b) { auto A = emu::bc<emu::H>(a), B = emu::bc<emu::H>(b); __mmask32 m = 0; for (int j = 0; j < 32; ++j) if (A.v[j] & B.v[j]) m |= (1u << j); return m; }
inline __mmask32 emu_mask_cmplt_epu16_mask(__mmask32 k, emu_m512i a, emu_m512i b) { auto A = emu::bc<emu::H>(a), B = emu::bc<emu::H>(b); __mmask32 m = 0; for (int j = 0; j < 32; ++j) if (((k >> j) & 1) && A.v[j] < B.v[j]) m |= (1u << j); return m; }
inline __mmask16 emu_test_epi16_mask256(__m256i a, __m256i b) { auto A = emu::bc<emu::H16>(a), B = emu::bc<emu::H16>(b); __mmask16 m = 0; for (int j = 0; j < 16; ++j) if (A.v[j] & B.v[j]) m |= (__mmask16)(1u << j); return m; }
inline __mmask16 emu_mask_cmplt_epu16_mask256(__mmask16 k, __m256i a, __m256i b) { auto A = emu::bc<emu::H16>(a), B = emu::bc<emu::H16>(b); __mmask16 m = 0; for (int j = 0; j < 16; ++j) if (((k >> j) & 1) && A.v[j] < B.v[j]) m |= (__mmask16)(1u << j); return m; }
inline float emu_reduce_add_ps(emu_m512 a) { auto A = emu::f(a); float t[16]; std::memcpy(t, A.v, 64); for (int w = 8; w >= 1; w /= 2) for (int j = 0; j < w; ++j) t[j] = t[j] + t[j + w]; return t[0]; }
inline float emu_reduce_max_ps(emu_m512 a) { auto A = emu::f(a); float t[16]; std::memcpy(t, A.v, 64); for (int w = 8; w >= 1; w /= 2) for (int j = 0; j < w; ++j) t[j] = t[j] > t[j + w] ? t[j] : t[j + w]; return t[0]; }
inline emu_m512 emu_dpbf16_ps(emu_m512 src, emu_m512bh a, emu_m512bh b) {
  auto S = emu::f(src); auto A = emu::bc<emu::H>(a), B = emu::bc<emu::H>(b); emu::F r;
  for (int j = 0; j < 16; ++j) {
    float acc = emu::ftz(S.v[j]);
    // each step one fp32 FMA (the SDM), not left to the compiler's contraction of acc + a * b
    acc = emu::ftz(std::fma(emu::bf2f(A.v[2 * j + 1]), emu::bf2f(B.v[2 * j + 1]), acc));
    acc = emu::ftz(std::fma(emu::bf2f(A.v[2 * j]), emu::bf2f(B.v[2 * j]), acc));
    r.v[j] = acc;
  }
  return emu::f(r);
}
inline emu_m256bh emu_cvtneps_pbh(emu_m512 a) { auto A = emu::f(a); emu::H16 r; for (int j = 0; j < 16; ++j) r.v[j] = emu::f2bf(A.v[j]); return emu::bc<emu_m256bh>(r); }
#define _mm512_set1_ps emu_set1_ps
#define _mm512_setzero_ps emu_setzero_ps
#define _mm512_loadu_ps emu_loadu_ps
#define _mm512_storeu_ps emu_storeu_ps
#define _mm512_mask_storeu_ps emu_mask_storeu_ps
#define _mm512_loadu_si512 emu_loadu_si512
#define _mm512_storeu_si512 emu_storeu_si512
#define _mm512_set1_epi32 emu_set1_epi32
#define _mm512_set1_epi16 emu_set1_epi16
#define _mm512_setr_epi32 emu_setr_epi32
#define _mm512_mul_ps emu_mul_ps
#define _mm512_add_ps emu_add_ps
#define _mm512_sub_ps emu_sub_ps
#define _mm512_max_ps emu_max_ps
#define _mm512_min_ps emu_min_ps
#define _mm512_fmadd_ps emu_fmadd_ps
#define _mm512_fnmadd_ps emu_fnmadd_ps
#define _mm512_maskz_mov_ps emu_maskz_mov_ps
#define _mm512_maskz_mul_ps emu_maskz_mul_ps
#define _mm512_maskz_loadu_ps emu_maskz_loadu_ps
#define _mm512_mask_loadu_ps emu_mask_loadu_ps
#define _mm512_cmp_ps_mask emu_cmp_ps_mask
#define _mm512_roundscale_ps emu_roundscale_ps
#define _mm512_cvtps_epi32 emu_cvtps_epi32
#define _mm512_castsi512_ps emu_castsi512_ps
#define _mm512_add_epi32 emu_add_epi32
#define _mm512_mullo_epi32 emu_mullo_epi32
#define _mm512_slli_epi32 emu_slli_epi32
#define _mm512_and_si512 emu_and_si512
#define _mm512_or_si512 emu_or_si512
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#define _mm512_i32gather_epi32 emu_i32gather_epi32
#define _mm512_test_epi16_mask emu_test_epi16_mask
#define _mm512_mask_cmplt_epu16_mask emu_mask_cmplt_epu16_mask
#define _mm256_test_epi16_mask emu_test_epi16_mask256
#define _mm256_mask_cmplt_epu16_mask emu_mask_cmplt_epu16_mask256
#define _mm512_reduce_add_ps emu_reduce_add_ps
#define _mm512_reduce_max_ps emu_reduce_max_ps
#define _mm512_dpbf16_ps emu_dpbf16_ps
#define _mm512_cvtneps_pbh emu_cvtneps_pbh
