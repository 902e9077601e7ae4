// The AVX-512 loops of block_dot.h's products, for one row of x (a batch-1 decode step), chosen at run time
// (block_dot.h's isa: AVX-512 F, BW, VL and VNNI). Each output is computed with dot_rows_avx2's operations in
// its order (gguf_matmul_cpu.cpp's file comment), so the bits are the AVX2 loops' and the portable ones':
// the eight four-input sums of a sub-block are the same integers (exact), and the fp32 part (the scale f * d,
// one fma per sub-block into the eight accumulators, the constant terms' scalar fma, the reduction) is the
// same operations in the same order. What changes is the integer work: a zmm register holds two "parts" (two
// weight rows' sub-block b, or one row's sub-blocks b and b + 1), 64 weights, and their sixteen four-input
// sums take two permutations, one madd and one VNNI dpwssd (`fours`) where AVX2 takes, per 32 weights, two
// madds and a hadd; the two parts' fmas are one zmm fma (two rows) or two dependent ymm ones (one row).
//
// A source's AVX-512 loads: V512 (true), and vec512(other, b, b_other, lo, hi): lo its sub-block b's values
// 0..15 as int16 in the low half and `other`'s sub-block b_other's in the high one, hi their values 16..31.
#pragma once

namespace tessera_cpu::blocks {

// Whether a source has the AVX-512 loads: its V512, else not.
template <class Src>
constexpr bool v512_of() {
  if constexpr (requires { Src::V512; }) return Src::V512;
  return false;
}

#ifdef TESSERA_X86

// The activations of n sub-blocks in the order `fours` takes them: per sub-block X (inputs LANE[l] and
// LANE[l] + 1 for l = 0..7), then Y (LANE[l] + 2 and LANE[l] + 3).
inline std::vector<int16_t> x_y_order(const int16_t* q, int64_t n) {
  std::vector<int16_t> o(n * QK);
  for (int64_t b = 0; b < n; ++b)
    for (int l = 0; l < 8; ++l)
      for (int t = 0; t < 2; ++t) {
        o[b * QK + 2 * l + t] = q[b * QK + LANE[l] + t];
        o[b * QK + 16 + 2 * l + t] = q[b * QK + LANE[l] + 2 + t];
      }
  return o;
}

// Two parts' eight four-input sums each in LANE order (lanes 0..7 part 0's, 8..15 part 1's), exact int32: the
// values put in X and Y's order (dword l of X: the part's values LANE[l], LANE[l] + 1, of lo or hi), then
// X . qx + Y . qy pairwise (madd, then VNNI's dpwssd adding the second pair to the first).
TESSERA_AVX512_TARGET inline __m512i fours(__m512i lo, __m512i hi, __m512i qx, __m512i qy) {
  const __m512i ix = _mm512_setr_epi32(0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30);
  const __m512i iy = _mm512_add_epi32(ix, _mm512_set1_epi32(1));
  const __m512i x = _mm512_permutex2var_epi32(lo, ix, hi), y = _mm512_permutex2var_epi32(lo, iy, hi);
  return _mm512_dpwssd_epi32(_mm512_madd_epi16(x, qx), y, qy);
}

// a in lanes 0..7, b in 8..15.
TESSERA_AVX512_TARGET inline __m512 halves(float a, float b) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}
TESSERA_AVX512_TARGET inline __m256 upper(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
// Sub-block b's X (or Y) activations in both halves.
TESSERA_AVX512_TARGET inline __m512i both(const int16_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Weight rows s0 and s1 against row m0 of x: dot_pair_avx2's outputs (each dot_rows_avx2<Src, 1>'s bits), the
// two rows' accumulators in one zmm register.
template <class Src>
TESSERA_AVX512_TARGET void dot_pair_avx512(const Src& s0, const Src& s1, const Activations& a, int64_t m0, float* out) {
  static_assert(!Src::HALVES, "one factor per sub-block");
  __m512 acc = _mm512_setzero_ps();
  __m128 cst = _mm_setzero_ps();  // lanes 1 and 3: the two rows' constant terms (with pair_factors)
  float cst0 = 0.0f, cst1 = 0.0f;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i lo, hi;
    s0.vec512(s1, b, b, lo, hi);
    const int64_t at = m0 * a.nb + b;
    const int16_t* q = a.x_y + at * QK;
    __m512 f;
    if constexpr (requires { s0.pair_factors(s1, b); }) {  // the factors of both rows in vector registers
      const __m128 ff = s0.pair_factors(s1, b);  // [f0.lo, f0.c, f1.lo, f1.c]
      f = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                                _mm512_castps128_ps512(ff));
      if (Src::CONST) cst = _mm_fmadd_ps(ff, _mm_set1_ps(a.s[at]), cst);  // (the scalar fmas, lane by lane)
    } else {
      const Factors f0 = s0.factors(b), f1 = s1.factors(b);
      f = halves(f0.lo, f1.lo);
      if (Src::CONST) {
        cst0 = std::fma(f0.c, a.s[at], cst0);
        cst1 = std::fma(f1.c, a.s[at], cst1);
      }
    }
    const __m512 scale = _mm512_mul_ps(f, _mm512_set1_ps(a.d[at]));
    acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(fours(lo, hi, both(q), both(q + 16))), acc);
  }
  if constexpr (requires { s0.pair_factors(s1, 0); }) {
    alignas(16) float c[4];
    _mm_store_ps(c, cst);
    cst0 = c[1];
    cst1 = c[3];
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  out[0] = reduce(lanes, cst0);
  out[1] = reduce(lanes + 8, cst1);
}

// Weight row `src` against row m0 of x: dot_rows_avx2<Src, 1>'s output, two sub-blocks a pass (their sums in
// one zmm register, their fmas one after the other).
template <class Src>
TESSERA_AVX512_TARGET void dot_one_avx512(const Src& src, const Activations& a, int64_t m0, float* out) {
  static_assert(!Src::HALVES, "one factor per sub-block");
  __m256 acc = _mm256_setzero_ps();
  float cst = 0.0f;
  for (int64_t b = 0; b < a.nb; b += 2) {
    const int64_t b1 = std::min(b + 1, a.nb - 1);  // (an odd count's last pass: its second part unused)
    __m512i lo, hi;
    src.vec512(src, b, b1, lo, hi);
    const Factors f0 = src.factors(b), f1 = src.factors(b1);
    const int64_t at = m0 * a.nb + b, at1 = m0 * a.nb + b1;
    const __m512i p0 = _mm512_loadu_si512(a.x_y + at * QK), p1 = _mm512_loadu_si512(a.x_y + at1 * QK);
    const __m512i qx = _mm512_shuffle_i64x2(p0, p1, 0x44), qy = _mm512_shuffle_i64x2(p0, p1, 0xEE);
    const __m512 scale = _mm512_mul_ps(halves(f0.lo, f1.lo), halves(a.d[at], a.d[at1]));
    const __m512 dots = _mm512_cvtepi32_ps(fours(lo, hi, qx, qy));
    acc = _mm256_fmadd_ps(_mm512_castps512_ps256(scale), _mm512_castps512_ps256(dots), acc);
    if (Src::CONST) cst = std::fma(f0.c, a.s[at], cst);
    if (b1 == b) break;
    acc = _mm256_fmadd_ps(upper(scale), upper(dots), acc);
    if (Src::CONST) cst = std::fma(f1.c, a.s[at1], cst);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  out[0] = reduce(lanes, cst);
}

// multiply_rows for one row of x (q, a: its quantized activations) on AVX-512: weight rows two a pass for the
// PAIR sources (rows i of each half of a thread's rows, as multiply_rows' AVX2 loop), one for the others.
template <class Source>
at::Tensor multiply_row_avx512(const at::Tensor& x, int64_t N, Source source, const float* bias, Activations a) {
  using Src = decltype(source(0));
  const std::vector<int16_t> x_y = x_y_order(a.q, a.nb);
  a.x_y = x_y.data();
  at::Tensor y = at::empty({1, N}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    if constexpr (pair_of<Src>())
      n = by_halves(n0, n1, bias, out,
                    [&](int64_t i, int64_t j, float* two) { dot_pair_avx512(source(i), source(j), a, 0, two); });
    for (; n < n1; ++n) {
      float one;
      dot_one_avx512(source(n), a, 0, &one);
      out[n] = bias ? one + bias[n] : one;
    }
  });
  return y;
}

#endif

}  // namespace tessera_cpu::blocks
