// The elementwise work of a served layer on CPU, each in one pass over its rows (fp32):
// - rms_norm(x, weight, eps): weight * (x * rsqrt(mean(x^2) + eps)) per row of x [..., D];
// - rope_(q, k, cos, sin): rotary embedding of q [B, S, H, D] and k [B, S, G, D] in place,
//   x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1) over the two halves of D,
//   cos / sin [B or 1, S, D];
// - silu_mul(gate, up): silu(gate) * up for gate, up [..., F] (rows may be strided views of one
//   fused product), into a new contiguous [..., F].
// PyTorch computes each of these as five to ten ops, each a pass over the rows and a dispatch (a
// decode step of a small model calls about two thousand of them); here each is one call. Sums are
// fp32 in another order than PyTorch's, so results differ from its ops by float rounding.
// Rows are split over threads only where each thread gets enough work to pay for waking it
// (`grain`: about 16k elements of a norm or rotation, 8k of the activation, whose exp costs more).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec_math.h"

namespace {

// The rows a thread takes at least, for rows of `width` elements and `per_thread` elements a thread.
int64_t grain(int64_t width, int64_t per_thread) { return std::max<int64_t>(1, per_thread / std::max<int64_t>(width, 1)); }

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be an fp32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " needs a contiguous last dimension");
}

// ---- RMSNorm ------------------------------------------------------------------------------------

void norm_row(const float* x, const float* w, float* out, int64_t D, float eps) {
  int64_t d = 0;
  float ss = 0.f;
#ifdef TESSERA_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + d), v1 = _mm256_loadu_ps(x + d + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  ss = tessera_vec::hsum(_mm256_add_ps(a0, a1));
#endif
  for (; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  d = 0;
#ifdef TESSERA_AVX2
  const __m256 vr = _mm256_set1_ps(r);
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(x + d), vr)));
#endif
  for (; d < D; ++d) out[d] = w[d] * (x[d] * r);
}

}  // namespace

at::Tensor tessera_cpu::rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_float_cpu(x_in, "x");
  check_float_cpu(weight, "weight");
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "weight must be [", D, "], got ", weight.sizes());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t rows = D > 0 ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(D, 16384), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * D, wp, op + r * D, D, e);
  });
  return out;
}

// ---- rotary embedding ---------------------------------------------------------------------------

namespace {

// One head vector x [D] in place: (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2) over the halves.
void rotate(float* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
#ifdef TESSERA_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 n1 = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                    _mm256_mul_ps(x2, _mm256_loadu_ps(s + i)));
    const __m256 n2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                    _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i)));
    _mm256_storeu_ps(x + i, n1);
    _mm256_storeu_ps(x + half + i, n2);
  }
#endif
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] - x2 * s[i];
    x[half + i] = x2 * c[half + i] + x1 * s[half + i];
  }
}

}  // namespace

void tessera_cpu::rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_cpu(q, "q");
  check_float_cpu(k, "k");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "q and k must be [B, S, heads, D]");
  const int64_t B = q.size(0), S = q.size(1), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == S && k.size(3) == D && D % 2 == 0,
              "q ", q.sizes(), " and k ", k.sizes(), " must share B, S and an even head dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && (cos.size(0) == B || cos.size(0) == 1) &&
                  cos.size(1) == S && cos.size(2) == D,
              "cos and sin must be [B or 1, S, D] = [", B, ", ", S, ", ", D, "], got ", cos.sizes(), " and ",
              sin.sizes());
  TORCH_CHECK(cos.stride(2) == 1 && sin.stride(2) == 1 && cos.strides() == sin.strides(),
              "cos and sin need the same strides and a contiguous last dimension");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t H = q.size(2), G = k.size(2), half = D / 2;
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), cs = cos.stride(1);
  at::parallel_for(0, B * S, grain((H + G) * D, 16384), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / S, s = t % S;
      const float* c = cp + b * cb + s * cs;
      const float* sn = sp + b * cb + s * cs;
      for (int64_t h = 0; h < H; ++h) rotate(qp + b * q.stride(0) + s * q.stride(1) + h * q.stride(2), c, sn, half);
      for (int64_t g = 0; g < G; ++g) rotate(kp + b * k.stride(0) + s * k.stride(1) + g * k.stride(2), c, sn, half);
    }
  });
}

// ---- SwiGLU's activation ------------------------------------------------------------------------

at::Tensor tessera_cpu::silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float_cpu(gate, "gate");
  check_float_cpu(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  const int64_t F = gate.size(-1);
  const int64_t rows = F > 0 ? gate.numel() / F : 0;
  // rows of each: one stride apart (a 2-d view, or any shape whose leading dims flatten to one)
  const at::Tensor g2 = gate.reshape({rows, F}), u2 = up.reshape({rows, F});
  TORCH_CHECK(g2.stride(1) == 1 && u2.stride(1) == 1, "gate and up need a contiguous last dimension");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  const float* gp = g2.data_ptr<float>();
  const float* up_ = u2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = g2.stride(0), us = u2.stride(0);
  at::parallel_for(0, rows, grain(F, 8192), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) tessera_vec::silu_mul_row(gp + r * gs, up_ + r * us, op + r * F, F);
  });
  return out;
}

// ---- the logits' checks of a step ----------------------------------------------------------------
// logit_checks(logits [T, V], rows [R]) -> [2, R] int64: for logits row rows[r], whether all of it is
// finite (torch.isfinite(row).all()) and its argmax (the first index of its maximum: torch.argmax's answer
// for a row without NaN). One pass over each row (a product by zero is NaN for an inf or a NaN: their sum
// says whether any was), the rows split over threads only in batches large enough to pay for waking one:
// PyTorch's isfinite and all are five ops over the rows, each its own parallel region.

namespace {

void check_row(const float* x, int64_t V, int64_t& finite, int64_t& argmax) {
  int64_t i = 0;
  float best = -INFINITY, zero = 0.0f;
#ifdef TESSERA_AVX2
  __m256 vbest = _mm256_set1_ps(-INFINITY), vzero = _mm256_setzero_ps();
  const __m256 z = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vbest = _mm256_max_ps(vbest, v);
    vzero = _mm256_add_ps(vzero, _mm256_mul_ps(v, z));
  }
  alignas(32) float lanes[8], zeros[8];
  _mm256_store_ps(lanes, vbest);
  _mm256_store_ps(zeros, vzero);
  for (int l = 0; l < 8; ++l) {
    best = lanes[l] > best ? lanes[l] : best;
    zero += zeros[l];
  }
#endif
  for (; i < V; ++i) {
    best = x[i] > best ? x[i] : best;
    zero += x[i] * 0.0f;
  }
  finite = zero == 0.0f ? 1 : 0;
  argmax = 0;
  if (!finite) {  // torch.argmax takes a NaN for the largest: the first one, else the first maximum
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) {
        argmax = j;
        return;
      }
    best = -INFINITY;
    for (int64_t j = 0; j < V; ++j) best = x[j] > best ? x[j] : best;
  }
  for (int64_t j = 0; j < V; ++j)
    if (x[j] == best) {
      argmax = j;
      return;
    }
}

}  // namespace

at::Tensor tessera_cpu::logit_checks(const at::Tensor& logits, const at::Tensor& rows) {
  check_float_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be [T, V], got ", logits.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be int64 [R]");
  const at::Tensor r = rows.contiguous();
  const int64_t R = r.numel(), T = logits.size(0), V = logits.size(1);
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < T, "logit_checks: row ", rp[i], " of ", T);
  at::Tensor out = at::empty({2, R}, rows.options());
  int64_t* op = out.data_ptr<int64_t>();
  const float* lp = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, R, grain(V, 262144), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) check_row(lp + rp[i] * stride, V, op[i], op[R + i]);
  });
  return out;
}
