// Small AVX2 helpers shared by the CPU kernels (compiled with PK_TARGET_AVX2, called only when
// pk::cpu_has_avx2()).
#pragma once
#include "pk_common.h"

#if PK_X86
#include <immintrin.h>

namespace pk {

// The sum of a vector's 8 floats.
PK_TARGET_AVX2 inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

}  // namespace pk
#endif
