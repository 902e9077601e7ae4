// A chunk's own terms for the chunked gated delta rule (tessera/models/linear_attention/delta_rule.py),
// each chunk of each head computed whole in cache (fp32, no gradients: prompt processing and serving):
//
// delta_chunk_terms(q, k, v, g, beta, chunk, q_scale, eps) -> (qd, W, U, scores, kinv, decay, span)
//   q, k [B, S, H, K], v [B, S, H, V], beta [B, S, H], g [B, S, H] (a log-decay per head, Gated DeltaNet)
//   or [B, S, H, K] (one per key channel, Kimi delta attention); any strides (a row whose last dimension
//   is strided, as the mixers' views of the convolution's output are, is gathered first).
//   With q^, k^ L2-normalised (times q_scale for q; eps inside the root) and c the log-decay summed
//   within each chunk of `chunk` tokens (per channel; the sequence padded to whole chunks with tokens
//   that write nothing and do not decay), kb = beta k^ exp(c) and vb = beta v, each [N, B H, ., .]
//   (N chunks, C = chunk):
//     qd [C, K] = q^ exp(c), kinv [C, K] = k^ exp(-c), decay [K, 1] = exp(c_C),
//     A = kb kinv^T below the diagonal, T = (I + A)^-1 (forward substitution),
//     W [C, K] = T kb, U [C, V] = T vb, scores [C, C] = qd kinv^T on and below the diagonal (0 above),
//   and span, the largest |c| met (a 0-dim tensor): the caller uses these only where it is small enough
//   for exp(-c) (delta_rule.SPAN_LIMIT). The chunk's state update is then
//   diag(decay) (S0 + kinv^T (U - W S0)), its output qd S0 + scores (U - W S0).
// PyTorch computes the same as a dozen passes over the prompt (norms, re-layouts, a cumulative sum,
// exps, scalings, a transposed copy) and five batched products of small matrices, which run far below
// the machine's matrix speed and compute both triangles; here each input is read once, each output
// written once, and the products (their lower triangles only) run on the chunk while it is in cache.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

void check_input(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be an fp32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.sizes());
}

// row x [n] with stride `step`: itself where it is contiguous, else gathered into `buffer`
const float* row(const float* x, int64_t step, int64_t n, std::vector<float>& buffer) {
  if (step == 1) return x;
  for (int64_t d = 0; d < n; ++d) buffer[d] = x[d * step];
  return buffer.data();
}

float sum_of_squares(const float* x, int64_t n) {
  int64_t d = 0;
  float ss = 0.f;
#ifdef TESSERA_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = tessera_vec::hsum(acc);
#endif
  for (; d < n; ++d) ss += x[d] * x[d];
  return ss;
}

struct Inputs {
  const float *q, *k, *v, *g, *beta;
  int64_t S, H, K, V, C, gK;  // gK: 1 (a decay per head) or K
  int64_t sq[4], sk[4], sv[4], sg[4], sb[3];  // strides of B, S, H (and the last dimension)
  float q_scale, eps;
};

struct Outputs {
  float *qd, *W, *U, *scores, *kinv, *decay;
};

struct Scratch {
  // the running log-decay; strided rows gathered; the chunk's kb, vb, A and T
  std::vector<float> c, q, k, v, g, kb, vb, A, T;
  Scratch(int64_t K, int64_t V, int64_t gK, int64_t C)
      : c(gK), q(K), k(K), v(V), g(gK), kb(C * K), vb(C * V), A(C * C), T(C * C) {}
};

// One row of a decay per channel: c += g, then qd = q nq exp(c), kb = k kf exp(c), kinv = k nk / exp(c);
// returns the largest |c| of the row.
float per_channel_row(const float* q, const float* k, const float* g, float* c, float* qd, float* kb, float* kinv,
                      int64_t K, float nq, float kf, float nk) {
  int64_t d = 0;
  float span = 0.f;
#ifdef TESSERA_AVX2
  const __m256 vq = _mm256_set1_ps(nq), vkf = _mm256_set1_ps(kf), vnk = _mm256_set1_ps(nk), sign = _mm256_set1_ps(-0.f);
  __m256 vspan = _mm256_setzero_ps();
  for (; d + 8 <= K; d += 8) {
    const __m256 vc = _mm256_add_ps(_mm256_loadu_ps(c + d), _mm256_loadu_ps(g + d));
    _mm256_storeu_ps(c + d, vc);
    vspan = _mm256_max_ps(vspan, _mm256_andnot_ps(sign, vc));
    const __m256 e = tessera_vec::exp_nonpositive(vc);
    const __m256 kv = _mm256_loadu_ps(k + d);
    _mm256_storeu_ps(qd + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(q + d), vq), e));
    _mm256_storeu_ps(kb + d, _mm256_mul_ps(_mm256_mul_ps(kv, vkf), e));
    _mm256_storeu_ps(kinv + d, _mm256_div_ps(_mm256_mul_ps(kv, vnk), e));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vspan);
  for (float x : lanes) span = std::max(span, x);
#endif
  for (; d < K; ++d) {
    c[d] += g[d];
    span = std::max(span, std::fabs(c[d]));
    const float e = tessera_vec::exp_nonpositive(c[d]);
    qd[d] = q[d] * nq * e;
    kb[d] = k[d] * kf * e;
    kinv[d] = k[d] * nk / e;
  }
  return span;
}

// out[0 .. n) = x[0 .. n) * f
void scaled(const float* x, float f, float* out, int64_t n) {
  int64_t d = 0;
#ifdef TESSERA_AVX2
  const __m256 vf = _mm256_set1_ps(f);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(x + d), vf));
#endif
  for (; d < n; ++d) out[d] = x[d] * f;
}

// acc[0 .. n) += x * row[0 .. n)
inline void axpy(float* __restrict acc, float x, const float* __restrict row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += x * row[j];
}

// a . b over n
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef TESSERA_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  sum = tessera_vec::hsum(_mm256_add_ps(s0, s1));
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

#ifdef TESSERA_AVX2
// the sums of the eight lanes of each of a[0 .. 8): one vector of eight dot products
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: [0 1 2 3 | 0 1 2 3] halves of the first four, [4 5 6 7 | 4 5 6 7] of the last four
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}
#endif

// Row i of A (columns j < i) and of the scores (j <= i): kb_i . kinv_j and qd_i . kinv_j, four columns
// at a time (eight sums in flight, kinv's rows loaded once for both).
void score_rows(const float* qd_i, const float* kb_i, const float* kinv, float* a_i, float* s_i, int64_t i,
                int64_t K) {
  int64_t j = 0;
#ifdef TESSERA_AVX2
  if (K % 8 == 0) {
    for (; j + 4 <= i + 1; j += 4) {
      __m256 acc[8];
      for (auto& x : acc) x = _mm256_setzero_ps();
      for (int64_t d = 0; d < K; d += 8) {
        const __m256 kv = _mm256_loadu_ps(kb_i + d), qv = _mm256_loadu_ps(qd_i + d);
        for (int r = 0; r < 4; ++r) {
          const __m256 x = _mm256_loadu_ps(kinv + (j + r) * K + d);
          acc[r] = _mm256_fmadd_ps(kv, x, acc[r]);
          acc[4 + r] = _mm256_fmadd_ps(qv, x, acc[4 + r]);
        }
      }
      alignas(32) float sums[8];
      _mm256_store_ps(sums, hsum8(acc));
      for (int r = 0; r < 4; ++r) {
        if (j + r < i) a_i[j + r] = sums[r];
        s_i[j + r] = sums[4 + r];
      }
    }
  }
#endif
  for (; j <= i; ++j) {
    if (j < i) a_i[j] = dot(kb_i, kinv + j * K, K);
    s_i[j] = dot(qd_i, kinv + j * K, K);
  }
}

// out_i [n] = sum_{j <= i} t_i[j] x_j (rows of x [., n]), 64 columns at a time in registers.
void lower_row_times(const float* t_i, const float* x, float* out_i, int64_t i, int64_t n) {
  int64_t d = 0;
#ifdef TESSERA_AVX2
  for (; d + 64 <= n; d += 64) {
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t j = 0; j <= i; ++j) {
      const __m256 t = _mm256_set1_ps(t_i[j]);
      const float* row = x + j * n + d;
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(t, _mm256_loadu_ps(row + 8 * r), acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out_i + d + 8 * r, acc[r]);
  }
#endif
  if (d < n) {
    std::fill(out_i + d, out_i + n, 0.f);
    for (int64_t j = 0; j <= i; ++j) axpy(out_i + d, t_i[j], x + j * n + d, n - d);
  }
}

// The chunk's products (the header's A, T, W, U and scores), its rows in cache: A's and the scores'
// entries up to the diagonal as dot products of kb's (qd's) and kinv's rows; T row by row by forward
// substitution, T_i = e_i - sum_{j<i} A_ij T_j; W's and U's rows as T's lower rows times kb's and vb's rows.
void chunk_products(const float* qd, const float* kb, const float* kinv, const float* vb, float* W, float* U,
                    float* scores, Scratch& w, int64_t C, int64_t K, int64_t V) {
  float* A = w.A.data();
  float* T = w.T.data();
  for (int64_t i = 0; i < C; ++i) {
    score_rows(qd + i * K, kb + i * K, kinv, A + i * C, scores + i * C, i, K);
    std::fill(scores + i * C + i + 1, scores + (i + 1) * C, 0.f);
  }
  std::fill(T, T + C * C, 0.f);
  for (int64_t i = 0; i < C; ++i) {
    float* t = T + i * C;
    t[i] = 1.f;
    for (int64_t j = 0; j < i; ++j) axpy(t, -A[i * C + j], T + j * C, j + 1);
  }
  for (int64_t i = 0; i < C; ++i) {
    lower_row_times(T + i * C, kb, W + i * K, i, K);
    lower_row_times(T + i * C, vb, U + i * V, i, V);
  }
}

// One (chunk n, sequence b, head h): its C rows, returning the largest |c| met.
float one_chunk(const Inputs& in, const Outputs& out, int64_t n, int64_t b, int64_t h, int64_t unit, Scratch& w) {
  float* c = w.c.data();
  const int64_t K = in.K, V = in.V, C = in.C;
  float* qd = out.qd + unit * C * K;
  float* kb = w.kb.data();
  float* kinv = out.kinv + unit * C * K;
  float* vb = w.vb.data();
  std::fill(w.c.begin(), w.c.end(), 0.f);
  float span = 0.f;
  for (int64_t i = 0; i < C; ++i) {
    const int64_t t = n * C + i;
    if (t >= in.S) {  // padding: writes nothing, does not decay
      std::fill(qd + i * K, qd + (i + 1) * K, 0.f);
      std::fill(kb + i * K, kb + (i + 1) * K, 0.f);
      std::fill(kinv + i * K, kinv + (i + 1) * K, 0.f);
      std::fill(vb + i * V, vb + (i + 1) * V, 0.f);
      continue;
    }
    const float* q = row(in.q + b * in.sq[0] + t * in.sq[1] + h * in.sq[2], in.sq[3], K, w.q);
    const float* k = row(in.k + b * in.sk[0] + t * in.sk[1] + h * in.sk[2], in.sk[3], K, w.k);
    const float* v = row(in.v + b * in.sv[0] + t * in.sv[1] + h * in.sv[2], in.sv[3], V, w.v);
    const float* g = row(in.g + b * in.sg[0] + t * in.sg[1] + h * in.sg[2], in.sg[3], in.gK, w.g);
    const float beta = in.beta[b * in.sb[0] + t * in.sb[1] + h * in.sb[2]];
    const float nq = in.q_scale / std::sqrt(sum_of_squares(q, K) + in.eps);
    const float nk = 1.f / std::sqrt(sum_of_squares(k, K) + in.eps);
    if (in.gK == 1) {  // one decay for the head's row
      c[0] += g[0];
      span = std::max(span, std::fabs(c[0]));
      const float e = tessera_vec::exp_nonpositive(c[0]);
      scaled(q, nq * e, qd + i * K, K);
      scaled(k, nk * beta * e, kb + i * K, K);
      scaled(k, nk / e, kinv + i * K, K);
    } else {
      span = std::max(span, per_channel_row(q, k, g, c, qd + i * K, kb + i * K, kinv + i * K, K, nq, nk * beta, nk));
    }
    scaled(v, beta, vb + i * V, V);
  }
  // the chunk's decay to its end, exp(c_C) per channel (the state's rows after its writes: the caller's)
  float* decay = out.decay + unit * K;
  for (int64_t d = 0; d < K; ++d) decay[d] = tessera_vec::exp_nonpositive(c[in.gK == 1 ? 0 : d]);
  chunk_products(qd, kb, kinv, vb, out.W + unit * C * K, out.U + unit * C * V, out.scores + unit * C * C, w, C, K, V);
  return span;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
tessera_cpu::delta_chunk_terms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, int64_t chunk, double q_scale, double eps) {
  check_input(q, "q", 4);
  check_input(k, "k", 4);
  check_input(v, "v", 4);
  check_input(beta, "beta", 3);
  TORCH_CHECK(g.dim() == 3 || g.dim() == 4, "g must be [B, S, H] or [B, S, H, K], got ", g.sizes());
  check_input(g, "g", g.dim());
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == B && v.size(1) == S && v.size(2) == H,
              "q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(), " must share B, S and H (and q, k K)");
  TORCH_CHECK(beta.size(0) == B && beta.size(1) == S && beta.size(2) == H, "beta must be [B, S, H], got ", beta.sizes());
  TORCH_CHECK(g.size(0) == B && g.size(1) == S && g.size(2) == H && (g.dim() == 3 || g.size(3) == K),
              "g must be [B, S, H] or [B, S, H, K] of q's, got ", g.sizes());
  TORCH_CHECK(chunk >= 1, "chunk must be at least 1, got ", chunk);
  const int64_t C = chunk, N = (S + C - 1) / C, BH = B * H;
  Inputs in{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
            beta.data_ptr<float>(), S, H, K, V, C, g.dim() == 4 ? K : 1,
            {q.stride(0), q.stride(1), q.stride(2), q.stride(3)}, {k.stride(0), k.stride(1), k.stride(2), k.stride(3)},
            {v.stride(0), v.stride(1), v.stride(2), v.stride(3)},
            {g.stride(0), g.stride(1), g.stride(2), g.dim() == 4 ? g.stride(3) : 1},
            {beta.stride(0), beta.stride(1), beta.stride(2)}, static_cast<float>(q_scale), static_cast<float>(eps)};
  const auto opts = q.options();
  at::Tensor qd = at::empty({N, BH, C, K}, opts), W = at::empty({N, BH, C, K}, opts),
             U = at::empty({N, BH, C, V}, opts), scores = at::empty({N, BH, C, C}, opts),
             kinv = at::empty({N, BH, C, K}, opts), decay = at::empty({N, BH, K, 1}, opts);
  Outputs out{qd.data_ptr<float>(), W.data_ptr<float>(), U.data_ptr<float>(), scores.data_ptr<float>(),
              kinv.data_ptr<float>(), decay.data_ptr<float>()};
  std::vector<float> spans(N * BH, 0.f);
  at::parallel_for(0, N * BH, 1, [&](int64_t begin, int64_t end) {
    Scratch w(K, V, in.gK, C);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t n = unit / BH, bh = unit % BH;
      spans[unit] = one_chunk(in, out, n, bh / H, bh % H, unit, w);
    }
  });
  const float span = spans.empty() ? 0.f : *std::max_element(spans.begin(), spans.end());
  return {qd, W, U, scores, kinv, decay, at::scalar_tensor(span, opts)};
}
