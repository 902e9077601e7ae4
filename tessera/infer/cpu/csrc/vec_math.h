// Small vector helpers shared by the CPU kernels (paged_attention_cpu.cpp, layer_ops_cpu.cpp,
// linear_cpu.cpp): a horizontal sum, exp(x) for x <= 0, scalar and eight lanes at a time, and SwiGLU's
// activation.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TESSERA_AVX2 1
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace tessera_vec {

// exp(x) for x <= 0 (scores minus their maximum, -|x| of an activation), written so that the
// compiler vectorizes the loop around it (the C library's expf is one call per element): Cody-Waite
// reduction by ln 2 and a degree-6 polynomial on [-ln 2 / 2, ln 2 / 2] (the coefficients of the
// Cephes library's expf), within 2 ulp of expf; inputs below -87 (e^-87 ~ 1.6e-38, the smallest
// normal float) give 0.
inline float exp_nonpositive(float x) {
  const float below = x < -87.0f ? 0.0f : 1.0f;
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return p * two_n * below;
}

#ifdef TESSERA_AVX2
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// exp_nonpositive on eight lanes: the same reduction and polynomial (the compiler does not
// vectorize the scalar version's loops itself).
inline __m256 exp_nonpositive(__m256 v) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(v, lo, _CMP_GE_OQ);  // below -87: 0
  v = _mm256_max_ps(v, lo);
  const __m256 nf = _mm256_floor_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(nf, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), v));
  __m256 poly = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
  poly = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(poly, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nf), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(poly, _mm256_castsi256_ps(e)), keep);
}
#endif

// out[0 .. F) = silu(g) * u, silu(x) = x * sigmoid(x) with sigmoid from e = exp(-|x|) (never
// overflows): 1 / (1 + e) for x >= 0, e / (1 + e) below. One function for the layer kernel's
// silu_mul and the panel kernel's SwiGLU epilogue, so the two give the same bits.
inline void silu_mul_row(const float* g, const float* u, float* out, int64_t F) {
  int64_t i = 0;
#ifdef TESSERA_AVX2
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= F; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));  // exp(-|x|)
    const __m256 num = _mm256_blendv_ps(one, e, x);            // sign bit set: e
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < F; ++i) {
    const float x = g[i], e = exp_nonpositive(-std::fabs(x));
    out[i] = x * ((std::signbit(x) ? e : 1.f) / (1.f + e)) * u[i];
  }
}

}  // namespace tessera_vec
