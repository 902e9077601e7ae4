// Attention of short queries over their own contexts, read in place from the paged KV cache (CPU).
//
// One call per layer. Row r of `rows` [R, 4] is (q_row, S, L, table_at): its S queries sit at rows
// q_row .. q_row + S - 1 of q / out and are the last S positions of a context of L positions, whose
// blocks are blocks[table_at ..] (position j lives in slot blocks[table_at + j / bs] * bs + j % bs of
// the cache). Query s (position L - S + s) sees keys j <= L - S + s, and with a sliding window only
// those with (L - S + s) - j < window. Work is split over (row, kv head) pairs; each pair reads its
// keys and values for the queries of its head group one query at a time (they stay in the core's
// caches between queries): scores, softmax, then the weighted sum of values, in fp32 whatever the
// storage type. fp32 with head dims a multiple of 8 (of 64 for values) takes AVX2 loops where the
// build has AVX2 and FMA; everything else the portable loops, which compute the same sums.
// Shapes: q [T, H, Dk], out [T, H, Dv] (last dim contiguous), k_cache [slots, G, Dk], v_cache
// [slots, G, Dv] (contiguous); H a multiple of G (grouped-query attention).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TESSERA_AVX2 1
#endif

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

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

#ifdef TESSERA_AVX2
// fp32 with head dims a multiple of 8: the scores of four keys for one query at a time (four
// independent accumulators, so the FMAs do not wait on each other), and the weighted sum of values
// one query at a time with its output held in registers across the keys.
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

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

// exp(x) for x <= 0 (scores minus their maximum), written so that the compiler vectorizes the loop
// around it (the C library's expf is one call per element): Cody-Waite reduction by ln 2 and a
// degree-6 polynomial on [-ln 2 / 2, ln 2 / 2] (the coefficients of the Cephes library's expf),
// within 2 ulp of expf; inputs below -87 (e^-87 ~ 1.6e-38, the smallest normal float) give 0.
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

template <typename scalar_t>
void attend(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const int64_t* rows, const int64_t* blocks, int64_t R, int64_t bs, double scale, int64_t window) {
  const int64_t H = q.size(1), Dk = q.size(2), G = k_cache.size(1), Dv = v_cache.size(2);
  const int64_t per_group = H / G;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, R * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Dk), scores, acc(Dv);
    std::vector<const scalar_t*> kptr, vptr;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / G, g = w % G;
      const int64_t q_row = rows[4 * r], S = rows[4 * r + 1], L = rows[4 * r + 2], table_at = rows[4 * r + 3];
      // Query s (position L - S + s) sees keys [first(s), L - S + s]: one contiguous range each.
      auto first = [&](int64_t s) { return window > 0 ? std::max<int64_t>(0, L - S + s - window + 1) : 0; };
      const int64_t lo = first(0);  // the first key any query of the row sees
      const int64_t n_keys = L - lo;
      kptr.resize(n_keys);
      vptr.resize(n_keys);
      for (int64_t j = lo; j < L; ++j) {  // where each key and value of this head lies in the cache
        const int64_t slot = blocks[table_at + j / bs] * bs + j % bs;
        kptr[j - lo] = kp + (slot * G + g) * Dk;
        vptr[j - lo] = vp + (slot * G + g) * Dv;
      }
      scores.resize(n_keys);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t a = first(s) - lo, n = L - S + s + 1 - first(s);
        for (int64_t h = 0; h < per_group; ++h) {
          const int64_t head = g * per_group + h;
          const scalar_t* src = qp + (q_row + s) * qs0 + head * qs1;
          for (int64_t d = 0; d < Dk; ++d) qf[d] = static_cast<float>(src[d]) * fscale;
          float* sc = scores.data();
          score_keys(qf.data(), kptr.data() + a, n, Dk, sc);
          float m = sc[0];
          for (int64_t j = 1; j < n; ++j) m = std::max(m, sc[j]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            sc[j] = exp_nonpositive(sc[j] - m);
            sum += sc[j];
          }
          const float inv = 1.f / sum;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) sc[j] *= inv;
          weigh_values(sc, vptr.data() + a, n, Dv, acc.data());
          scalar_t* dst = op + (q_row + s) * os0 + head * os1;
          for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(acc[d]);
        }
      }
    }
  });
}

void paged_attention(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& rows, const at::Tensor& blocks, int64_t block_size, double scale,
                     int64_t window) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "expected 3-d tensors");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dimension");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache tensors must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(), "q, out and the cache must share one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of the cache's heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && out.size(2) == v_cache.size(2), "head dims differ");
  TORCH_CHECK(rows.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong && rows.is_contiguous() &&
                  blocks.is_contiguous() && rows.dim() == 2 && rows.size(1) == 4, "rows [R, 4] and blocks: int64");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q, out, k_cache, v_cache, rp, bp, rows.size(0), block_size, scale, window);
  });
}

}  // namespace

TORCH_LIBRARY(tessera_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor blocks, "
        "int block_size, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
