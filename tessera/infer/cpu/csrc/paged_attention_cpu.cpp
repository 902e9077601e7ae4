// Attention over contexts read in place from the paged KV cache (CPU): the decode rows, the
// speculative tokens to verify and the prompt chunks of one serving step, in one call per layer.
//
// Row r of `rows` [R, 4] is (q_row, S, L, table_at): its S queries sit at rows
// q_row .. q_row + S - 1 of q / out and are the last S positions of a context of L positions, whose
// blocks are blocks[table_at ..] (position j lives in slot blocks[table_at + j / bs] * bs + j % bs of
// the cache). Query s (position L - S + s) sees keys j <= L - S + s, and with a sliding window only
// those with (L - S + s) - j < window. Scores, softmax and the weighted sum of values are fp32
// whatever the storage type.
//
// Two ways of working, chosen per row:
// - short rows (S <= SHORT_ROW: decodes, tokens to verify) are split over (row, kv head) pairs; each
//   pair reads its keys and values where they lie, the bytes of the context once, which is what a
//   decode step is bound by. fp32 with AVX2 scores the queries of the whole head group together,
//   eight keys at a time (the key from memory for the first query, from L1 for the others), and
//   weighs the values the same way; other types go one query head at a time (the context stays in
//   L2 between heads). While a pair scores, it requests the next pair's keys and values into L2 a
//   few lines at a time (memory would otherwise sit idle while it computes, then stall it when the
//   next pair starts; scoring the heads together pays only with the prefetch feeding it:
//   docs/benchmarks.md, "decode attention with prefetch and head groups").
// - long rows (prompt chunks) are split over (row, query head) pairs, which the threads take costliest
//   first, each the next one left as it finishes (a chunk's time grows with the square of its
//   length, so an even split in order would leave a thread idle); each pair copies the keys
//   any of its queries sees (transposed, in blocks of KT) and their values into fp32 buffers once,
//   then each tile of QT queries walks its visible keys KT at a time, flash-attention style: the
//   scores of QT x KT come from register-blocked products (four queries by sixteen keys), an online
//   softmax (running maximum and sum per query) rescales the tile's output, and the values are added
//   in four queries by sixteen dimensions. Each block of four queries stops at the last key the
//   fourth of them sees (rounded up to sixteen for the scores): a chunk at position 0 does half the
//   products of the whole square, where a mask would do them all, and a tile's diagonal costs a few
//   keys per query, not up to a block of 64 plus the tile's 32 (docs/benchmarks.md, "32-request
//   prompt burst in process": the notebook measures this stop and the costliest-first order apart).
// fp32 with head dims a multiple of 8 (of 64 for a short row's values, of 16 for a long row's) takes
// AVX2 loops where the build has AVX2 and FMA; everything else the portable loops, which compute the
// same sums.
// An int8 cache (PagedKVCache with int8=True: k = k_scale * kq per (slot, head), the same for v) is read
// as it lies: a short row's score of key j is k_scale[j] * (q . kq[j]), the int8 lanes widened to fp32
// in registers, and its values are weighed as sum_j (p[j] * v_scale[j]) * vq[j]; no block is
// dequantized into memory. A long row copies the keys and values its queries see into its fp32 tile
// buffers as every type does, multiplied by their scales there (a prompt chunk reads each key many
// times, so the copy is paid once for all of them). Those int8 products run AVX2 loops chosen at run
// time (__builtin_cpu_supports) or portable loops of the same operations in the same order (`portable`,
// which tests use), so both give the same bits; the result is attention over the dequantized cache
// to fp32 rounding.
// Shapes: q [T, H, Dk], out [T, H, Dv] (last dim contiguous), k_cache [slots, G, Dk], v_cache
// [slots, G, Dv] (contiguous), k_scale [slots, G] and v_scale [slots, G] fp32 for an int8 cache; H a
// multiple of G (grouped-query attention).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TESSERA_INT8_X86 1
#define TESSERA_INT8_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

using tessera_vec::exp_nonpositive;
#ifdef TESSERA_AVX2
using tessera_vec::hsum;
#endif

template <typename scalar_t>
inline float dot(const scalar_t* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += static_cast<float>(a[i]) * b[i];
  return s;
}

template <typename scalar_t>
inline void axpy(float w, const scalar_t* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * static_cast<float>(x[i]);
}

// An int8 cache's products, two ways that give the same bits: q . k with eight fp32 lanes (lane l takes
// d = l mod 8 of the first Dk / 8 * 8 inputs, fma in order), summed ((l0 + l4) + (l2 + l6)) + ((l1 + l5)
// + (l3 + l7)) as the AVX2 horizontal sum does, then the last Dk % 8 inputs by fma in order; and
// acc[d] = fma(w[j], v[j][d], acc[d]) over the keys j in order, for every d.
inline float dot_i8_portable(const float* q, const int8_t* k, int64_t n) {
  float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) a[l] = std::fma(q[d + l], static_cast<float>(k[d + l]), a[l]);
  float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  for (; d < n; ++d) s = std::fma(q[d], static_cast<float>(k[d]), s);
  return s;
}

inline void weigh_i8_portable(const float* w, const int8_t* const* v, int64_t n, int64_t Dv, float* acc) {
  std::fill(acc, acc + Dv, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < Dv; ++d) acc[d] = std::fma(w[j], static_cast<float>(v[j][d]), acc[d]);
}

#ifdef TESSERA_INT8_X86
bool int8_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

TESSERA_INT8_AVX2 inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

TESSERA_INT8_AVX2 inline float dot_i8_avx2(const float* q, const int8_t* k, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen8(k + d), a);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  float s = _mm_cvtss_f32(x);
  for (; d < n; ++d) s = std::fma(q[d], static_cast<float>(k[d]), s);
  return s;
}

// Dv a multiple of 8: four registers of outputs held across the keys where Dv allows, else one.
TESSERA_INT8_AVX2 inline void weigh_i8_avx2(const float* w, const int8_t* const* v, int64_t n, int64_t Dv,
                                            float* acc) {
  int64_t c = 0;
  for (; c + 32 <= Dv; c += 32) {
    __m256 r0 = _mm256_setzero_ps(), r1 = r0, r2 = r0, r3 = r0;
    for (int64_t j = 0; j < n; ++j) {
      const __m256 x = _mm256_set1_ps(w[j]);
      const int8_t* vj = v[j] + c;
      r0 = _mm256_fmadd_ps(x, widen8(vj), r0);
      r1 = _mm256_fmadd_ps(x, widen8(vj + 8), r1);
      r2 = _mm256_fmadd_ps(x, widen8(vj + 16), r2);
      r3 = _mm256_fmadd_ps(x, widen8(vj + 24), r3);
    }
    _mm256_storeu_ps(acc + c, r0);
    _mm256_storeu_ps(acc + c + 8, r1);
    _mm256_storeu_ps(acc + c + 16, r2);
    _mm256_storeu_ps(acc + c + 24, r3);
  }
  for (; c < Dv; c += 8) {
    __m256 r = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) r = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), widen8(v[j] + c), r);
    _mm256_storeu_ps(acc + c, r);
  }
}
#else
bool int8_avx2() { return false; }
#endif

inline float dot_i8(bool vec, const float* q, const int8_t* k, int64_t n) {
#ifdef TESSERA_INT8_X86
  if (vec) return dot_i8_avx2(q, k, n);
#endif
  (void)vec;
  return dot_i8_portable(q, k, n);
}

inline void weigh_i8(bool vec, const float* w, const int8_t* const* v, int64_t n, int64_t Dv, float* acc) {
#ifdef TESSERA_INT8_X86
  if (vec && Dv % 8 == 0) return weigh_i8_avx2(w, v, n, Dv, acc);
#endif
  (void)vec;
  weigh_i8_portable(w, v, n, Dv, acc);
}

#ifdef TESSERA_AVX2
// fp32 with head dims a multiple of 8: the scores of four keys for one query at a time (four
// independent accumulators, so the FMAs do not wait on each other), and the weighted sum of values
// one query at a time with its output held in registers across the keys.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t n,
                 float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + d), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + d), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + d), a3);
  }
  out[0] = hsum(a0);
  out[1] = hsum(a1);
  out[2] = hsum(a2);
  out[3] = hsum(a3);
}

inline float dot1(const float* q, const float* k, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
  return hsum(a);
}
#endif

// The largest of x[0 .. n) (n >= 1).
inline float max_of(const float* x, int64_t n) {
  int64_t j = 0;
  float m = x[0];
#ifdef TESSERA_AVX2
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (j = 8; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    m = _mm_cvtss_f32(h);
  }
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// x[j] = exp(x[j] - m) for j in [0, n); returns their sum. With AVX2 eight at a time by the same
// reduction and polynomial (vec_math.h).
inline float exp_shifted(float* x, int64_t n, float m) {
  int64_t j = 0;
  float sum = 0.f;
#ifdef TESSERA_AVX2
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 y = tessera_vec::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
    _mm256_storeu_ps(x + j, y);
    acc = _mm256_add_ps(acc, y);
  }
  sum = hsum(acc);
#endif
  for (; j < n; ++j) {
    x[j] = exp_nonpositive(x[j] - m);
    sum += x[j];
  }
  return sum;
}

// The scores of query `qf` (scaled, fp32) against keys kptr[0 .. n) into out[0 .. n).
template <typename scalar_t>
inline void score_keys(const float* qf, const scalar_t* const* kptr, int64_t n, int64_t Dk, float* out) {
#ifdef TESSERA_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (Dk % 8 == 0) {
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) dot4(qf, kptr[j], kptr[j + 1], kptr[j + 2], kptr[j + 3], Dk, out + j);
      for (; j < n; ++j) out[j] = dot1(qf, kptr[j], Dk);
      return;
    }
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = dot(kptr[j], qf, Dk);
}

// acc[0 .. Dv) = sum over j of p[j] * vptr[j][0 .. Dv).
template <typename scalar_t>
inline void weigh_values(const float* p, const scalar_t* const* vptr, int64_t n, int64_t Dv, float* acc) {
  std::fill(acc, acc + Dv, 0.f);
#ifdef TESSERA_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (Dv % 64 == 0) {  // eight registers of outputs held across the keys
      for (int64_t c = 0; c < Dv; c += 64) {
        __m256 r0 = _mm256_setzero_ps(), r1 = r0, r2 = r0, r3 = r0, r4 = r0, r5 = r0, r6 = r0, r7 = r0;
        for (int64_t j = 0; j < n; ++j) {
          const __m256 w = _mm256_set1_ps(p[j]);
          const float* v = vptr[j] + c;
          r0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), r0);
          r1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), r1);
          r2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), r2);
          r3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), r3);
          r4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), r4);
          r5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), r5);
          r6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), r6);
          r7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), r7);
        }
        float* o = acc + c;
        _mm256_storeu_ps(o, r0);
        _mm256_storeu_ps(o + 8, r1);
        _mm256_storeu_ps(o + 16, r2);
        _mm256_storeu_ps(o + 24, r3);
        _mm256_storeu_ps(o + 32, r4);
        _mm256_storeu_ps(o + 40, r5);
        _mm256_storeu_ps(o + 48, r6);
        _mm256_storeu_ps(o + 56, r7);
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < n; ++j) axpy(p[j], vptr[j], acc, Dv);
}

#ifdef TESSERA_AVX2
// Eight registers' sums as the eight lanes of one (lane i: the sum of a[i]'s lanes).
inline __m256 hsum8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// sc[h * ld + i] = q[h] . k[i] for the nh queries q [nh, Dk] of one head group and eight keys k[0 .. 8)
// (Dk a multiple of 8): the keys come from memory for the first query, from L1 for the others.
inline void group_scores8(const float* q, int64_t nh, const float* const* k, int64_t Dk, float* sc, int64_t ld) {
  for (int64_t h = 0; h < nh; ++h) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    const float* qh = q + h * Dk;
    for (int64_t d = 0; d < Dk; d += 8) {
      const __m256 x = _mm256_loadu_ps(qh + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[i] + d), a[i]);
    }
    _mm256_storeu_ps(sc + h * ld, hsum8(a));
  }
}

// acc[h * Dv + c] += sum over j < n of p[h * ld + j] * v[j][c] for the nh queries of one head group
// (Dv a multiple of 8 * W): W registers of one query's output held across the n values, which come
// from memory for the first query and from L1 for the others.
template <int W>
inline void group_values(const float* p, int64_t ld, int64_t nh, const float* const* v, int64_t n, int64_t Dv,
                         float* acc) {
  for (int64_t c = 0; c < Dv; c += 8 * W) {
    for (int64_t h = 0; h < nh; ++h) {
      float* o = acc + h * Dv + c;
      const float* ph = p + h * ld;
      __m256 r[W];
      for (int i = 0; i < W; ++i) r[i] = _mm256_loadu_ps(o + 8 * i);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 w = _mm256_broadcast_ss(ph + j);
        const float* vj = v[j] + c;
        for (int i = 0; i < W; ++i) r[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * i), r[i]);
      }
      for (int i = 0; i < W; ++i) _mm256_storeu_ps(o + 8 * i, r[i]);
    }
  }
}
#endif

constexpr int64_t SHORT_ROW = 16;  // rows of up to this many queries take the per-query loop
constexpr int64_t PF_KEYS = 16;    // a short row requests some of the next unit's lines every this many keys scored
constexpr int64_t VB = 32;         // values a grouped short row weighs at a time (they stay in L1 across its heads)
constexpr int64_t QT = 32;         // queries of a long row's tile
constexpr int64_t KT = 64;         // keys walked at a time by a tile (16 per register block)

#ifdef TESSERA_AVX2
// The register block of both tile products: four rows by sixteen columns in eight registers.
using Block4x16 = __m256[4][2];

inline void load_4x16(Block4x16& a, const float* o, int64_t ld) {
  for (int r = 0; r < 4; ++r) {
    a[r][0] = _mm256_loadu_ps(o + r * ld);
    a[r][1] = _mm256_loadu_ps(o + r * ld + 8);
  }
}

inline void store_4x16(float* o, int64_t ld, const Block4x16& a) {
  for (int r = 0; r < 4; ++r) {
    _mm256_storeu_ps(o + r * ld, a[r][0]);
    _mm256_storeu_ps(o + r * ld + 8, a[r][1]);
  }
}

// a[r] += x[r * xs] * v (v: sixteen columns at v16) for the four rows r.
inline void fma_4x16(Block4x16& a, const float* x, int64_t xs, const float* v16) {
  const __m256 v0 = _mm256_loadu_ps(v16), v1 = _mm256_loadu_ps(v16 + 8);
  for (int r = 0; r < 4; ++r) {
    const __m256 w = _mm256_broadcast_ss(x + r * xs);
    a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
    a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
  }
}
#endif

// Row i of a tile (query position pos0 + i) sees keys up to pos0 + i: of a block that starts at key
// k0, columns [0, seen(i)), with seen(i) = clamp(pos0 + i + 1 - k0, 0, nk) (nk: the block's keys). A
// product for rows [i, i + 4) stops at the last of those columns (the scores at the next multiple of
// 16, the register block's width), so the keys past a tile's diagonal cost nothing but that rounding.
inline int64_t seen(int64_t i, int64_t pos0, int64_t k0, int64_t nk) {
  return std::clamp<int64_t>(pos0 + i + 1 - k0, 0, nk);
}

// sc[i][0 .. c) = sum over d of qf[i][d] * kt[d][0 .. c) for the tile's nq queries (qf: [nq, Dk],
// kt: [Dk, KT], sc: [nq, KT]), with c at least seen(i) (above); columns past it are left unwritten.
inline void tile_scores(const float* qf, int64_t nq, const float* kt, int64_t Dk, float* sc, int64_t pos0, int64_t k0,
                        int64_t nk) {
  int64_t i = 0;
#ifdef TESSERA_AVX2
  for (; i + 4 <= nq; i += 4) {
    const int64_t cols = seen(i + 3, pos0, k0, nk);
    for (int64_t j = 0; j < cols; j += 16) {
      Block4x16 a;
      for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < Dk; ++d) fma_4x16(a, qf + i * Dk + d, Dk, kt + d * KT + j);
      store_4x16(sc + i * KT + j, KT, a);
    }
  }
#endif
  for (; i < nq; ++i) {
    float* o = sc + i * KT;
    const int64_t cols = seen(i, pos0, k0, nk);
    std::fill(o, o + cols, 0.f);
    for (int64_t d = 0; d < Dk; ++d) {
      const float x = qf[i * Dk + d];
      const float* k = kt + d * KT;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) o[j] += x * k[j];
    }
  }
}

// acc[i][0 .. Dv) += sum over j < seen(i) of p[i][j] * vt[j][0 .. Dv) (p: [nq, KT], vt: [KT, Dv],
// acc: [nq, Dv]); the rows of a register block go to the last of their seen(i), where p is zero for
// the keys a row does not see.
inline void tile_values(const float* p, int64_t nq, const float* vt, int64_t Dv, float* acc, int64_t pos0,
                        int64_t k0, int64_t nk) {
  int64_t i = 0;
#ifdef TESSERA_AVX2
  if (Dv % 16 == 0) {
    for (; i + 4 <= nq; i += 4) {
      const int64_t keys = seen(i + 3, pos0, k0, nk);
      if (keys == 0) continue;
      for (int64_t c = 0; c < Dv; c += 16) {
        Block4x16 a;
        load_4x16(a, acc + i * Dv + c, Dv);
        for (int64_t j = 0; j < keys; ++j) fma_4x16(a, p + i * KT + j, KT, vt + j * Dv + c);
        store_4x16(acc + i * Dv + c, Dv, a);
      }
    }
  }
#endif
  for (; i < nq; ++i)
    for (int64_t j = 0, e = seen(i, pos0, k0, nk); j < e; ++j) axpy(p[i * KT + j], vt + j * Dv, acc + i * Dv, Dv);
}

// scalar_t: the queries' and outputs' type; cache_t: the cache's (scalar_t, or int8_t with scales).
template <typename scalar_t, typename cache_t = scalar_t>
struct Attention {
  static constexpr bool INT8 = std::is_same_v<cache_t, int8_t>;
  const scalar_t* qp;
  const cache_t *kp, *vp;
  scalar_t* op;
  const int64_t *rows, *blocks;
  int64_t H, Dk, G, Dv, per_group, qs0, qs1, os0, os1, bs, window;
  float scale;
  const float *ksp = nullptr, *vsp = nullptr;  // an int8 cache's scales [slots, G]
  bool vec = false;                             // an int8 cache's products by the AVX2 loops

  // The cache slot of position j of the context whose block table starts at blocks[table_at].
  int64_t slot(int64_t table_at, int64_t j) const { return blocks[table_at + j / bs] * bs + j % bs; }

  // kptr[j - lo] and vptr[j - lo]: where key and value j of kv head g lie, for j in [lo, L), walked
  // block by block (one division per block, not two per key); an int8 cache's scales of key and value
  // j into ks[j - lo] and vs[j - lo].
  void locate(int64_t table_at, int64_t lo, int64_t L, int64_t g, const cache_t** kptr, const cache_t** vptr,
              float* ks = nullptr, float* vs = nullptr) const {
    for (int64_t j = lo; j < L;) {
      const int64_t end = std::min(L, (j / bs + 1) * bs), at = slot(table_at, j);
      const cache_t* k = kp + (at * G + g) * Dk;
      const cache_t* v = vp + (at * G + g) * Dv;
      int64_t si = at * G + g;
      for (; j < end; ++j, k += G * Dk, v += G * Dv, si += G) {
        kptr[j - lo] = k;
        vptr[j - lo] = v;
        if constexpr (INT8) {
          ks[j - lo] = ksp[si];
          vs[j - lo] = vsp[si];
        }
      }
    }
  }
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }

  // The lines of a short (row r, kv head g) unit's keys and values, requested into L2 a few at a
  // time while the unit before it on the same thread computes, so that they are there when it starts.
  struct Prefetch {
    const Attention* at = nullptr;
    int64_t table_at = 0, j = 0, L = 0, g = 0, line = 0, kl = 0, vl = 0;
    const char* k = nullptr;
    const char* v = nullptr;

    void seek() {
      const int64_t s = at->slot(table_at, j);
      k = reinterpret_cast<const char*>(at->kp + (s * at->G + g) * at->Dk);
      v = reinterpret_cast<const char*>(at->vp + (s * at->G + g) * at->Dv);
    }
    // Starts on unit (r, g); returns how many lines it will request.
    int64_t start(const Attention& a, int64_t r, int64_t g_) {
      at = &a;
      g = g_;
      L = a.rows[4 * r + 2];
      table_at = a.rows[4 * r + 3];
      j = a.first_key(L - a.rows[4 * r + 1]);
      line = 0;
      kl = (a.Dk * static_cast<int64_t>(sizeof(cache_t)) + 63) / 64;
      vl = (a.Dv * static_cast<int64_t>(sizeof(cache_t)) + 63) / 64;
      if (j < L) seek();
      return (L - j) * (kl + vl);
    }
    void step(int64_t n) {
#ifdef TESSERA_AVX2
      for (; n > 0 && j < L; --n) {
        _mm_prefetch(line < kl ? k + 64 * line : v + 64 * (line - kl), _MM_HINT_T1);
        if (++line == kl + vl) {
          line = 0;
          if (++j < L) {
            if (j % at->bs == 0) {
              seek();
            } else {
              k += at->G * at->Dk * static_cast<int64_t>(sizeof(cache_t));
              v += at->G * at->Dv * static_cast<int64_t>(sizeof(cache_t));
            }
          }
        }
      }
#else
      (void)n;
#endif
    }
  };

  struct ShortBuffers {
    Prefetch next;
    int64_t pf_per_chunk = 0;  // lines of the next unit to request per chunk of PF_KEYS keys scored
    std::vector<float> qf, scores, acc, ks, vs, w;  // ks, vs, w: an int8 cache's scales and value weights
    std::vector<const cache_t*> kptr, vptr;
  };

#ifdef TESSERA_AVX2
  // short_row for fp32 with Dk a multiple of 8 and Dv of 32: the queries of the whole head group at
  // once, so each key and value is read from memory once per query position, not once per head.
  void short_row_group(int64_t r, int64_t g, ShortBuffers& b) const {
    const int64_t q_row = rows[4 * r], S = rows[4 * r + 1], L = rows[4 * r + 2], table_at = rows[4 * r + 3];
    const int64_t lo = first_key(L - S), n_keys = L - lo, nh = per_group;
    const int64_t ld = (n_keys + 7) / 8 * 8;  // a head's scores: whole blocks of eight keys
    b.qf.resize(nh * Dk);
    b.acc.resize(nh * Dv);
    b.kptr.resize(n_keys);
    b.vptr.resize(n_keys);
    locate(table_at, lo, L, g, b.kptr.data(), b.vptr.data());
    b.scores.resize(nh * ld);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t a = first_key(L - S + s) - lo, n = L - S + s + 1 - first_key(L - S + s);
      for (int64_t h = 0; h < nh; ++h) {
        const float* src = qp + (q_row + s) * qs0 + (g * nh + h) * qs1;
        for (int64_t d = 0; d < Dk; ++d) b.qf[h * Dk + d] = src[d] * scale;
      }
      // keys a .. a + n in blocks of eight; the last block's missing keys repeat its last one
      float* sc = b.scores.data();
      int64_t j8 = 0;
      for (; j8 + 8 <= n; j8 += 8) {
        group_scores8(b.qf.data(), nh, b.kptr.data() + a + j8, Dk, sc + j8, ld);
        if (j8 % PF_KEYS == 0) b.next.step(b.pf_per_chunk);
      }
      if (j8 < n) {
        const float* tail[8];
        for (int64_t i = 0; i < 8; ++i) tail[i] = b.kptr[a + std::min(j8 + i, n - 1)];
        group_scores8(b.qf.data(), nh, tail, Dk, sc + j8, ld);
      }
      for (int64_t h = 0; h < nh; ++h) {
        float* sh = sc + h * ld;
        const float m = max_of(sh, n);
        const float inv = 1.f / exp_shifted(sh, n, m);
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) sh[j] *= inv;
      }
      std::fill(b.acc.begin(), b.acc.end(), 0.f);
      for (int64_t j = 0; j < n; j += VB) {
        const int64_t nb = std::min(VB, n - j);
        if (Dv % 64 == 0) {
          group_values<8>(sc + j, ld, nh, b.vptr.data() + a + j, nb, Dv, b.acc.data());
        } else {
          group_values<4>(sc + j, ld, nh, b.vptr.data() + a + j, nb, Dv, b.acc.data());
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        float* dst = op + (q_row + s) * os0 + (g * nh + h) * os1;
        std::copy(b.acc.begin() + h * Dv, b.acc.begin() + (h + 1) * Dv, dst);
      }
    }
  }
#endif

  // Every query of row r's head group g, one query at a time over keys read where they lie.
  void short_row(int64_t r, int64_t g, ShortBuffers& b) const {
    const int64_t q_row = rows[4 * r], S = rows[4 * r + 1], L = rows[4 * r + 2], table_at = rows[4 * r + 3];
    // Query s (position L - S + s) sees keys [first_key(L - S + s), L - S + s]: one contiguous range each.
    const int64_t lo = first_key(L - S);  // the first key any query of the row sees
    const int64_t n_keys = L - lo;
    b.qf.resize(Dk);
    b.acc.resize(Dv);
    b.kptr.resize(n_keys);
    b.vptr.resize(n_keys);
    if constexpr (INT8) {
      b.ks.resize(n_keys);
      b.vs.resize(n_keys);
      b.w.resize(n_keys);
    }
    locate(table_at, lo, L, g, b.kptr.data(), b.vptr.data(), b.ks.data(), b.vs.data());
    b.scores.resize(n_keys);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t a = first_key(L - S + s) - lo, n = L - S + s + 1 - first_key(L - S + s);
      for (int64_t h = 0; h < per_group; ++h) {
        const int64_t head = g * per_group + h;
        const scalar_t* src = qp + (q_row + s) * qs0 + head * qs1;
        for (int64_t d = 0; d < Dk; ++d) b.qf[d] = static_cast<float>(src[d]) * scale;
        float* sc = b.scores.data();
        for (int64_t c = 0; c < n; c += PF_KEYS) {
          if constexpr (INT8) {
            for (int64_t j = c, e = std::min(n, c + PF_KEYS); j < e; ++j)
              sc[j] = b.ks[a + j] * dot_i8(vec, b.qf.data(), b.kptr[a + j], Dk);
          } else {
            score_keys(b.qf.data(), b.kptr.data() + a + c, std::min(PF_KEYS, n - c), Dk, sc + c);
          }
          b.next.step(b.pf_per_chunk);
        }
        const float m = max_of(sc, n);
        const float sum = exp_shifted(sc, n, m);
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) sc[j] *= inv;
        if constexpr (INT8) {
          for (int64_t j = 0; j < n; ++j) b.w[j] = sc[j] * b.vs[a + j];
          weigh_i8(vec, b.w.data(), b.vptr.data() + a, n, Dv, b.acc.data());
        } else {
          weigh_values(sc, b.vptr.data() + a, n, Dv, b.acc.data());
        }
        scalar_t* dst = op + (q_row + s) * os0 + head * os1;
        for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(b.acc[d]);
      }
    }
  }

  // Whether short rows take short_row_group (fp32 with AVX2, Dk a multiple of 8, Dv of 32).
  bool grouped() const {
#ifdef TESSERA_AVX2
    if constexpr (std::is_same_v<scalar_t, float> && !INT8) return Dk % 8 == 0 && Dv % 32 == 0;
#endif
    return false;
  }

  void short_row_dispatch(int64_t r, int64_t g, ShortBuffers& b) const {
#ifdef TESSERA_AVX2
    if constexpr (std::is_same_v<scalar_t, float> && !INT8) {
      if (grouped()) return short_row_group(r, g, b);
    }
#endif
    short_row(r, g, b);
  }

  struct TileBuffers {
    std::vector<float> qf, kt, vt, sc, acc, m, l, ks, vs;
    std::vector<const cache_t*> kptr, vptr;
  };

  // Every query of row r for head `head`, flash-attention style: the keys any of them sees are
  // copied once into fp32 buffers, each block of KT keys transposed to [Dk, KT] (one block's rows
  // are contiguous: a whole-context [Dk, L] would put the rows a power of two apart, into the same
  // few sets of the L1 cache), their values as [keys, Dv]; then each tile of QT queries walks its
  // visible keys KT at a time with an online softmax.
  void long_row(int64_t r, int64_t head, TileBuffers& b) const {
    const int64_t q_row = rows[4 * r], S = rows[4 * r + 1], L = rows[4 * r + 2], table_at = rows[4 * r + 3];
    const int64_t g = head / per_group, P = L - S;
    const int64_t lo = first_key(P), n_keys = L - lo, ld = (n_keys + KT - 1) / KT * KT;  // keys [lo, L)
    b.kt.resize(Dk * ld);
    b.vt.resize(ld * Dv);
    b.kptr.resize(n_keys);
    b.vptr.resize(n_keys);
    if constexpr (INT8) {
      b.ks.resize(n_keys);
      b.vs.resize(n_keys);
    }
    locate(table_at, lo, L, g, b.kptr.data(), b.vptr.data(), b.ks.data(), b.vs.data());
    for (int64_t j = 0; j < ld; ++j) {  // zeros past the last key: products of KT keys at a time
      if (j < n_keys) {
        const cache_t* k = b.kptr[j];
        const cache_t* v = b.vptr[j];
        float fk = 1.f, fv = 1.f;  // an int8 cache's scales (the other types' values as they are)
        if constexpr (INT8) {
          fk = b.ks[j];
          fv = b.vs[j];
        }
        for (int64_t d = 0; d < Dk; ++d) b.kt[(j / KT * Dk + d) * KT + j % KT] = static_cast<float>(k[d]) * fk;
        for (int64_t d = 0; d < Dv; ++d) b.vt[j * Dv + d] = static_cast<float>(v[d]) * fv;
      } else {
        for (int64_t d = 0; d < Dk; ++d) b.kt[(j / KT * Dk + d) * KT + j % KT] = 0.f;
        std::fill(b.vt.begin() + j * Dv, b.vt.begin() + (j + 1) * Dv, 0.f);
      }
    }
    b.qf.resize(QT * Dk);
    b.sc.resize(QT * KT);
    for (int64_t s0 = 0; s0 < S; s0 += QT) {
      const int64_t nq = std::min(QT, S - s0);
      b.acc.assign(QT * Dv, 0.f);
      b.m.assign(QT, -INFINITY);
      b.l.assign(QT, 0.f);
      for (int64_t i = 0; i < nq; ++i) {
        const scalar_t* src = qp + (q_row + s0 + i) * qs0 + head * qs1;
        for (int64_t d = 0; d < Dk; ++d) b.qf[i * Dk + d] = static_cast<float>(src[d]) * scale;
      }
      // keys [first_key(P + s0), P + s0 + nq) are seen by some query of the tile; walked from the
      // KT-aligned block (relative to lo) that holds the first
      const int64_t k_end = P + s0 + nq;
      for (int64_t k0 = lo + (first_key(P + s0) - lo) / KT * KT; k0 < k_end; k0 += KT) {
        const int64_t nk = std::min(KT, k_end - k0);
        tile_scores(b.qf.data(), nq, b.kt.data() + (k0 - lo) * Dk, Dk, b.sc.data(), P + s0, k0, nk);
        for (int64_t i = 0; i < nq; ++i) {  // mask, then the online softmax of each query
          float* sc = b.sc.data() + i * KT;
          const int64_t pos = P + s0 + i;
          const int64_t a = std::max<int64_t>(0, first_key(pos) - k0), e = seen(i, P + s0, k0, nk);
          if (a >= e) {  // no key of this block is visible to the query
            std::fill(sc, sc + nk, 0.f);
            continue;
          }
          const float m_new = std::max(b.m[i], max_of(sc + a, e - a));
          const float corr = exp_nonpositive(b.m[i] - m_new);  // 0 for the first block the query sees
          std::fill(sc, sc + a, 0.f);
          const float sum = exp_shifted(sc + a, e - a, m_new);
          std::fill(sc + e, sc + nk, 0.f);  // a register block's rows may weigh keys up to nk
          if (corr != 1.f) {
            float* o = b.acc.data() + i * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) o[d] *= corr;
          }
          b.l[i] = b.l[i] * corr + sum;
          b.m[i] = m_new;
        }
        tile_values(b.sc.data(), nq, b.vt.data() + (k0 - lo) * Dv, Dv, b.acc.data(), P + s0, k0, nk);
      }
      for (int64_t i = 0; i < nq; ++i) {
        const float inv = 1.f / b.l[i];
        scalar_t* dst = op + (q_row + s0 + i) * os0 + head * os1;
        for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(b.acc[i * Dv + d] * inv);
      }
    }
  }
};

template <typename scalar_t, typename cache_t = scalar_t>
void attend(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const int64_t* rows, const int64_t* blocks, int64_t R, int64_t bs, double scale, int64_t window,
            const float* k_scale = nullptr, const float* v_scale = nullptr, bool vec = false) {
  Attention<scalar_t, cache_t> a{q.data_ptr<scalar_t>(), k_cache.data_ptr<cache_t>(), v_cache.data_ptr<cache_t>(),
                                 out.data_ptr<scalar_t>(), rows, blocks, q.size(1), q.size(2), k_cache.size(1),
                                 v_cache.size(2), q.size(1) / k_cache.size(1), q.stride(0), q.stride(1), out.stride(0),
                                 out.stride(1), bs, window, static_cast<float>(scale), k_scale, v_scale, vec};
  // The work: (row, kv head) for a short row, (row, query head) for a long one.
  struct Unit { int64_t r, head, cost; };  // head: the kv head of a short row, the query head of a long one
  std::vector<Unit> longs, shorts;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t S = rows[4 * r + 1], L = rows[4 * r + 2];
    if (S <= SHORT_ROW) {
      for (int64_t g = 0; g < a.G; ++g) shorts.push_back({r, g, 0});
      continue;
    }
    int64_t keys = 0;  // the keys its queries see, summed: what a long unit's time grows with
    if (a.window > 0) {
      for (int64_t pos = L - S; pos < L; ++pos) keys += pos + 1 - a.first_key(pos);
    } else {
      keys = S * (L - S) + S * (S + 1) / 2;
    }
    for (int64_t h = 0; h < a.H; ++h) longs.push_back({r, h, keys});
  }
  // Long units first, the costliest first, each thread taking the next one left as it finishes: a
  // prompt chunk's time grows with the square of its length, so a chunk of 500 tokens beside three
  // of 150 would keep one thread busy while the other waited at the end of an even split.
  if (!longs.empty()) {
    std::stable_sort(longs.begin(), longs.end(), [](const Unit& x, const Unit& y) { return x.cost > y.cost; });
    std::atomic<int64_t> taken{0};
    const int64_t n = static_cast<int64_t>(longs.size());
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
      typename Attention<scalar_t, cache_t>::TileBuffers tb;
      for (int64_t w = taken.fetch_add(1); w < n; w = taken.fetch_add(1)) a.long_row(longs[w].r, longs[w].head, tb);
    });
  }
  // Short units split evenly in order, so that each thread knows the unit it does next and can
  // request that unit's keys and values while it computes this one.
  at::parallel_for(0, static_cast<int64_t>(shorts.size()), 1, [&](int64_t begin, int64_t end) {
    typename Attention<scalar_t, cache_t>::ShortBuffers sb;
    for (int64_t w = begin; w < end; ++w) {
      const Unit& u = shorts[w];
      sb.pf_per_chunk = 0;  // step(0) requests nothing
      if (w + 1 < end) {
        // the next unit's lines spread over the first half of this unit's scoring: its queries
        // times its heads (one pass of the group for the grouped loop) times its chunks of keys
        const int64_t lines = sb.next.start(a, shorts[w + 1].r, shorts[w + 1].head);
        const int64_t S = rows[4 * u.r + 1], L = rows[4 * u.r + 2], keys = L - a.first_key(L - S);
        const int64_t chunks = S * (a.grouped() ? 1 : a.per_group) * ((keys + PF_KEYS - 1) / PF_KEYS);
        sb.pf_per_chunk = (2 * lines + chunks - 1) / std::max<int64_t>(1, chunks);
      }
      a.short_row_dispatch(u.r, u.head, sb);
    }
  });
}

}  // namespace

void tessera_cpu::paged_attention(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& blocks,
                                  int64_t block_size, double scale, int64_t window,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  bool portable) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "expected 3-d tensors");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dimension");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache tensors must be contiguous");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (int8 || q.scalar_type() == k_cache.scalar_type()),
              "q, out and the cache must share one dtype (or the cache be int8)");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "an int8 cache, and only one, takes scales");
  if (int8) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1),
                  "an int8 cache's scales: fp32 [slots, heads], contiguous");
  }
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of the cache's heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && out.size(2) == v_cache.size(2), "head dims differ");
  TORCH_CHECK(rows.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong && rows.is_contiguous() &&
                  blocks.is_contiguous() && rows.dim() == 2 && rows.size(1) == 4, "rows [R, 4] and blocks: int64");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  if (int8) {
    const bool vec = !portable && int8_avx2();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_int8", [&] {
      attend<scalar_t, int8_t>(q, out, k_cache, v_cache, rp, bp, rows.size(0), block_size, scale, window,
                               k_scale->data_ptr<float>(), v_scale->data_ptr<float>(), vec);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q, out, k_cache, v_cache, rp, bp, rows.size(0), block_size, scale, window);
  });
}
