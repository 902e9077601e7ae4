// The integer dot products shared by the block kernels (gguf_matmul_cpu.cpp: a GGUF file's blocks;
// quant_matmul_cpu.cpp: Tessera's own int8 / int4 codes where they lie): the activations quantized per
// row and per 32 inputs, a weight row read 32 values at a time through a "source" (below), and the fixed
// order of every output's sums (gguf_matmul_cpu.cpp's file comment says why and which order).
//
// A source is one weight row: `values(b, w)` writes the 32 integers of its sub-block b (inputs 32 b ..
// 32 b + 31), `factors(b)` their factors (weight = lo * w + c for the first 16, hi * w + c for the others),
// `vec(b, lo, hi)` the same integers as int16 in two AVX2 registers (values 0..15, 16..31); CONST: whether
// c may be nonzero, HALVES: whether lo and hi differ (Q6_K); PAIR (optional): whether a single row of x goes
// two weight rows per pass (dot_pair_avx2); V512 (optional): the AVX-512 loads of block_dot_avx512.h, whose
// loops take one row of x where the CPU has AVX-512 VNNI (isa, below).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TESSERA_X86 1
#define TESSERA_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define TESSERA_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

namespace tessera_cpu::blocks {

constexpr int QK = 32;
constexpr int LANE[8] = {0, 4, 16, 20, 8, 12, 24, 28};  // first input of each accumulator's four

// A sub-block's factors: weight = lo * w + c for its first 16 values, hi * w + c for the others.
struct Factors {
  float lo, hi, c;
};

// x quantized per row and sub-block: q [M, K], d and s [M, K / 32] (gguf_matmul_cpu.cpp's file comment).
struct Activations {
  const int16_t* q;
  const float* d;
  const float* s;
  int64_t K, nb;
  const int16_t* x_y = nullptr;  // q in the AVX-512 loops' order (x_y_order), where they run
};

struct Quantized {
  std::vector<int16_t> q;
  std::vector<float> d, s;
};

inline Quantized quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  Quantized a{std::vector<int16_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t r = m0 * nb; r < m1 * nb; ++r) {
      const float* v = x + r * QK;
      float amax = 0.0f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
      int sum = 0;
      for (int i = 0; i < QK; ++i) {
        const int q = static_cast<int>(std::nearbyint(v[i] * inv));
        a.q[r * QK + i] = static_cast<int16_t>(q);
        sum += q;
      }
      a.d[r] = d;
      a.s[r] = d * static_cast<float>(sum);
    }
  });
  return a;
}

// The fixed reduction of gguf_matmul_cpu.cpp's file comment.
inline float reduce(const float* a, float c) {
  return (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) + c;
}

// Rows m0 .. m0 + R (R <= 8) of x against the weight row `src`: out[r] = the reduced sums, portable loops.
template <class Src>
void dot_rows_portable(const Src& src, const Activations& a, int64_t m0, int R, float* out) {
  float acc[8][8] = {}, cst[8] = {};
  int16_t w[QK];
  for (int64_t b = 0; b < a.nb; ++b) {
    src.values(b, w);
    const Factors f = src.factors(b);
    for (int r = 0; r < R; ++r) {
      const int16_t* q = a.q + (m0 + r) * a.K + b * QK;
      const float da = a.d[(m0 + r) * a.nb + b], lo = f.lo * da, hi = f.hi * da;
      for (int l = 0; l < 8; ++l) {
        int dot = 0;
        for (int i = LANE[l]; i < LANE[l] + 4; ++i) dot += w[i] * q[i];
        acc[r][l] = std::fma(LANE[l] < 16 ? lo : hi, static_cast<float>(dot), acc[r][l]);
      }
      if (Src::CONST) cst[r] = std::fma(f.c, a.s[(m0 + r) * a.nb + b], cst[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(acc[r], cst[r]);
}

#ifdef TESSERA_X86

// The 32 weights' bytes as int16: values 0..15, then 16..31.
template <bool SIGNED>
TESSERA_AVX2_TARGET inline void vec_widen(__m256i w, __m256i& lo, __m256i& hi) {
  const __m128i a = _mm256_castsi256_si128(w), b = _mm256_extracti128_si256(w, 1);
  lo = SIGNED ? _mm256_cvtepi8_epi16(a) : _mm256_cvtepu8_epi16(a);
  hi = SIGNED ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

// The eight four-input sums of w . q (exact int32), lane l over inputs LANE[l] .. LANE[l] + 3.
TESSERA_AVX2_TARGET inline __m256i vec_dot(__m256i w_lo, __m256i w_hi, const int16_t* q) {
  const __m256i p = _mm256_madd_epi16(w_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m256i r = _mm256_madd_epi16(w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16)));
  return _mm256_hadd_epi32(p, r);
}

template <class Src, int R>
TESSERA_AVX2_TARGET void dot_rows_avx2(const Src& src, const Activations& a, int64_t m0, float* out) {
  __m256 acc[R];
  float cst[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    cst[r] = 0.0f;
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i w_lo, w_hi;
    src.vec(b, w_lo, w_hi);
    const Factors f = src.factors(b);
    const __m256 lohi = Src::HALVES ? _mm256_setr_ps(f.lo, f.lo, f.hi, f.hi, f.lo, f.lo, f.hi, f.hi)  // as LANE
                                    : _mm256_set1_ps(f.lo);  // (lo == hi)
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * a.nb + b;
      const __m256 scale = _mm256_mul_ps(lohi, _mm256_set1_ps(a.d[at]));
      acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(vec_dot(w_lo, w_hi, a.q + at * QK)), acc[r]);
      if (Src::CONST) cst[r] = std::fma(f.c, a.s[at], cst[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    out[r] = reduce(lanes, cst[r]);
  }
}

// Two weight rows against row m0 of x: for each, dot_rows_avx2<Src, 1>'s operations in its order (the same
// bits), the two interleaved in one loop. One row's loop is a chain of dependent fmas (its accumulator, and the
// constant terms' scalar), one per sub-block, so it waits on the fma's latency; two independent chains fill
// those waits. Used for a single row of x (a batch-1 decode step).
template <class Src>
TESSERA_AVX2_TARGET void dot_pair_avx2(const Src& s0, const Src& s1, const Activations& a, int64_t m0, float* out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float cst0 = 0.0f, cst1 = 0.0f;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i w0_lo, w0_hi, w1_lo, w1_hi;
    s0.vec(b, w0_lo, w0_hi);
    s1.vec(b, w1_lo, w1_hi);
    const Factors f0 = s0.factors(b), f1 = s1.factors(b);
    const __m256 lohi0 = Src::HALVES ? _mm256_setr_ps(f0.lo, f0.lo, f0.hi, f0.hi, f0.lo, f0.lo, f0.hi, f0.hi)
                                     : _mm256_set1_ps(f0.lo);
    const __m256 lohi1 = Src::HALVES ? _mm256_setr_ps(f1.lo, f1.lo, f1.hi, f1.hi, f1.lo, f1.lo, f1.hi, f1.hi)
                                     : _mm256_set1_ps(f1.lo);
    const int64_t at = m0 * a.nb + b;
    const __m256 d = _mm256_set1_ps(a.d[at]);
    const int16_t* q = a.q + at * QK;
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(lohi0, d), _mm256_cvtepi32_ps(vec_dot(w0_lo, w0_hi, q)), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(lohi1, d), _mm256_cvtepi32_ps(vec_dot(w1_lo, w1_hi, q)), acc1);
    if (Src::CONST) {
      cst0 = std::fma(f0.c, a.s[at], cst0);
      cst1 = std::fma(f1.c, a.s[at], cst1);
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc0);
  out[0] = reduce(lanes, cst0);
  _mm256_store_ps(lanes, acc1);
  out[1] = reduce(lanes, cst1);
}

template <class Src>
void dot_rows_avx2(const Src& src, const Activations& a, int64_t m0, int R, float* out) {
  switch (R) {
    case 4: return dot_rows_avx2<Src, 4>(src, a, m0, out);
    case 3: return dot_rows_avx2<Src, 3>(src, a, m0, out);
    case 2: return dot_rows_avx2<Src, 2>(src, a, m0, out);
    default: return dot_rows_avx2<Src, 1>(src, a, m0, out);
  }
}

inline bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
inline bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#else
inline bool has_avx2() { return false; }
inline bool has_avx512() { return false; }
#endif

// The loops the block products take: the widest this CPU has, at most the cap set_isa set (tests and benches
// compare them in one process: block_isa, gguf_matmul_cpu.cpp).
enum Isa : int { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
inline std::atomic<int> isa_cap{AVX512};
inline int isa(bool portable) {
  if (portable) return PORTABLE;
  const int best = has_avx512() ? AVX512 : has_avx2() ? AVX2 : PORTABLE;
  return std::min(best, isa_cap.load(std::memory_order_relaxed));
}

// Rows of x a source takes per pass over its weight row: its PASS, else 4.
template <class Src>
constexpr int pass_of() {
  if constexpr (requires { Src::PASS; }) return Src::PASS;
  return 4;
}

// Rows [n0, n1) of one row of x two a pass, row i of each half with row i + half (two sequential streams: rows n
// and n + 1 side by side made the stream jump a row ahead at every pair, which the hardware's prefetch did not
// follow): pair(i, i + half, two) computes both, written to out with bias (or nullptr); returns the first row left.
template <class Pair>
int64_t by_halves(int64_t n0, int64_t n1, const float* bias, float* out, Pair pair) {
  const int64_t half = (n1 - n0) / 2;
  for (int64_t i = n0; i < n0 + half; ++i) {
    float two[2];
    pair(i, i + half, two);
    out[i] = bias ? two[0] + bias[i] : two[0];
    out[i + half] = bias ? two[1] + bias[i + half] : two[1];
  }
  return n0 + 2 * half;
}

// Whether a source's single row of x goes two weight rows per pass (dot_pair_avx2): its PAIR, else not.
template <class Src>
constexpr bool pair_of() {
  if constexpr (requires { Src::PAIR; }) return Src::PAIR;
  return false;
}

}  // namespace tessera_cpu::blocks

#include "block_dot_avx512.h"

namespace tessera_cpu::blocks {

// y [M, N] = x [M, K] times the N weight rows `source(n)` transposed, + bias (or nullptr): x quantized
// once, threads splitting the outputs, each output computed by one thread in one order (the same bits
// for any thread count), rows of x `pass_of<Src>()` at a time over each weight row. A source with loops of
// its own (`dot_avx2(a, m0, R, out)`, `dot_portable(...)`: the same operations as each other) takes them
// instead of dot_rows_avx2 / dot_rows_portable.
template <class Source>
at::Tensor multiply_rows(const at::Tensor& x, int64_t N, Source source, const float* bias, bool portable) {
  using Src = decltype(source(0));
  constexpr int PASS = pass_of<Src>();
  const int64_t M = x.size(0), K = x.size(1);
  const Quantized q = quantize_rows(x.data_ptr<float>(), M, K);
  const Activations a{q.q.data(), q.d.data(), q.s.data(), K, K / QK};
  const int path = isa(portable);
  const bool vec = path >= AVX2;
#ifdef TESSERA_X86
  // one row of x on AVX-512 (a source with its loads, V512): block_dot_avx512.h's loops, the same bits
  if constexpr (v512_of<Src>())
    if (path == AVX512 && M == 1) return multiply_row_avx512(x, N, source, bias, a);
#endif
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    float part[PASS];
    int64_t n = n0;
#ifdef TESSERA_X86
    if constexpr (pair_of<Src>())  // one row of x: two weight rows per pass (dot_pair_avx2), the same bits
      if (vec && M == 1)
        n = by_halves(n0, n1, bias, out,
                      [&](int64_t i, int64_t j, float* two) { dot_pair_avx2(source(i), source(j), a, 0, two); });
#endif
    for (; n < n1; ++n) {
      const Src src = source(n);
      for (int64_t m = 0; m < M; m += PASS) {
        const int R = static_cast<int>(std::min<int64_t>(PASS, M - m));
#ifdef TESSERA_X86
        if (vec) {
          if constexpr (requires { src.dot_avx2(a, m, R, part); })
            src.dot_avx2(a, m, R, part);
          else
            dot_rows_avx2(src, a, m, R, part);
        } else
#endif
          if constexpr (requires { src.dot_portable(a, m, R, part); })
            src.dot_portable(a, m, R, part);
          else
            dot_rows_portable(src, a, m, R, part);
        for (int r = 0; r < R; ++r) out[(m + r) * N + n] = bias ? part[r] + bias[n] : part[r];
      }
    }
  });
  return y;
}

}  // namespace tessera_cpu::blocks
