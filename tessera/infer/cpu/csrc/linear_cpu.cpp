// y = x W^T + b for a served model's projections on CPU (fp32), with W packed once into panels.
//
// pack_panels(W [N, K]) -> [ceil(N / 16), K, 16]: panel p holds output columns 16p .. 16p + 15, each
// row k of it the sixteen weights that input k contributes to them (zeros past column N). A product
// then reads every panel from start to end exactly once, the order the hardware prefetcher streams.
//
// panel_linear(x [..., K], panels, bias, N) -> [..., N]: each thread takes whole panels; for a
// panel, the rows of x go up to six at a time (split evenly) through a register block of 6 rows by
// 16 columns (twelve accumulators; per input k two loads of weights, one broadcast per row, two FMAs
// per row). The few rows of a decode step are bound by reading the weights: up to 96 rows, a thread
// working on one panel prefetches the next into L2, a line every few inputs k, so that the panel
// is in the cache when its first block starts instead of being waited on; a prompt chunk of
// hundreds of rows re-reads each panel from the core's cache for every six rows. Sums run over k in
// order, in fp32; the portable loops (no AVX2) compute the same sums one column at a time.
//
// panel_swiglu(x [..., K], panels, F) -> [..., F]: silu(x W1^T) * (x W3^T) for panels packed from
// [W1; W3] (2F rows, F a multiple of 16): gate panel j and up panel F / 16 + j cover the same
// sixteen columns, so a thread computes the pair over all rows into two small buffers and writes
// their SwiGLU: the [rows, 2F] product is never stored and read back (the layer kernel's silu_mul
// pass), and the values are the bits of panel_linear then silu_mul.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

constexpr int64_t NB = 16;  // output columns of a panel
constexpr int MB = 6;       // rows of x in one register block
// Products of up to this many row blocks (96 rows) prefetch the next panel into L2 as they go: a
// block of 6 rows takes 6 cycles per input k, so the first block over a panel read from memory
// would wait on it. The gain is largest at a few rows and gone by 96; past that a panel is reread
// from L2 for every block anyway and the prefetch only costs (docs/benchmarks.md, "next panel
// prefetched vs not").
constexpr int64_t PREFETCH_MAX_BLOCKS = 16;

}  // namespace

at::Tensor tessera_cpu::pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_panels takes an fp32 CPU weight [out, in], got ", weight.scalar_type(), " ", weight.sizes(),
              " on ", weight.device());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NB - 1) / NB;
  at::Tensor out = at::zeros({P, K, NB}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < NB && p * NB + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NB + c] = src[(p * NB + c) * K + k];
  });
  return out;
}

namespace {

// Rows [0, R) of x (row stride ldx) against one panel p [K, 16] into y (row stride ldy): all 16
// columns (the caller gives a scratch block for a panel past column N); `pf`: where to prefetch
// one line every `pf_every` inputs k, or null.
template <int R>
inline void panel_rows(const float* x, int64_t ldx, const float* p, int64_t K, float* y, int64_t ldy,
                       const float* pf, int64_t pf_every) {
#ifdef TESSERA_AVX2
  static_assert(R >= 1 && R <= MB);
  int64_t count = 0;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  for (int64_t k = 0; k < K; ++k, p += NB) {
    if (pf != nullptr && ++count == pf_every) {  // one line (one k row) of the next panel into L2
      count = 0;
      _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T1);
      pf += NB;
    }
    const __m256 b0 = _mm256_loadu_ps(p), b1 = _mm256_loadu_ps(p + 8);
    // one row's two FMAs; named registers, not an array, which the compiler kept partly in memory
    const auto row = [&](const float* xr, __m256& lo, __m256& hi) {
      const __m256 a = _mm256_broadcast_ss(xr + k);
      lo = _mm256_fmadd_ps(a, b0, lo);
      hi = _mm256_fmadd_ps(a, b1, hi);
    };
    row(x0, c00, c01);
    if constexpr (R > 1) row(x1, c10, c11);
    if constexpr (R > 2) row(x2, c20, c21);
    if constexpr (R > 3) row(x3, c30, c31);
    if constexpr (R > 4) row(x4, c40, c41);
    if constexpr (R > 5) row(x5, c50, c51);
  }
  const __m256 acc[2 * MB] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[2 * r]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[2 * r + 1]);
  }
#else
  (void)pf;
  (void)pf_every;
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < NB; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[r * ldx + k] * p[k * NB + c];
      y[r * ldy + c] = s;
    }
#endif
}

// Rows [0, M) against panel p, in blocks of up to MB rows; `next`: the panel after it (or null).
// Where prefetching, block b of the `blocks` takes lines [b, b + 1) * (K / blocks) of the next panel
// (a panel's row k is one 64-byte line), one every `blocks` inputs k.
void panel(const float* x, int64_t M, int64_t K, const float* p, float* y, int64_t ldy, const float* next) {
  const int64_t blocks = (M + MB - 1) / MB;
  const bool prefetch = next != nullptr && blocks <= PREFETCH_MAX_BLOCKS;
  int64_t m = 0;
  const float* ahead = next;
  const auto pf = [&]() -> const float* {
    if (!prefetch) return nullptr;
    const float* at = ahead;
    ahead += K / blocks * NB;
    return at;
  };
  // The rows split evenly over the blocks (sizes differ by at most one): a block of one or two
  // rows has too few accumulators to keep both FMA units busy, so 32 rows go as 6+6+5+5+5+5,
  // not 6+6+6+6+6+2.
  const int64_t base = M / blocks, extra = M % blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rows = base + (b < extra ? 1 : 0);
    const float* xm = x + m * K;
    float* ym = y + m * ldy;
    switch (rows) {
      case 6: panel_rows<6>(xm, K, p, K, ym, ldy, pf(), blocks); break;
      case 5: panel_rows<5>(xm, K, p, K, ym, ldy, pf(), blocks); break;
      case 4: panel_rows<4>(xm, K, p, K, ym, ldy, pf(), blocks); break;
      case 3: panel_rows<3>(xm, K, p, K, ym, ldy, pf(), blocks); break;
      case 2: panel_rows<2>(xm, K, p, K, ym, ldy, pf(), blocks); break;
      default: panel_rows<1>(xm, K, p, K, ym, ldy, pf(), blocks); break;
    }
    m += rows;
  }
}

// What panel_linear and panel_swiglu check and prepare: x (fp32, CPU) made contiguous, its rows M,
// the panels' inputs K and count P, and y with x's leading dims and `cols` columns.
struct Operands {
  at::Tensor x, y;
  int64_t M, K, P;
};

Operands operands(const at::Tensor& x_in, const at::Tensor& panels, int64_t cols) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "x must be an fp32 CPU tensor, got ",
              x_in.scalar_type(), " on ", x_in.device());
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.size(2) == NB &&
                  panels.is_contiguous(), "panels must come from pack_panels");
  const int64_t P = panels.size(0), K = panels.size(1);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "x's last dim must be ", K, ", got ", x_in.sizes());
  at::Tensor x = x_in.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = std::max<int64_t>(cols, 0);
  at::Tensor y = at::empty(sizes, x.options());
  return {x, y, K > 0 ? x.numel() / K : 0, K, P};
}

}  // namespace

at::Tensor tessera_cpu::panel_linear(const at::Tensor& x_in, const at::Tensor& panels,
                                     const std::optional<at::Tensor>& bias, int64_t N) {
  const Operands o = operands(x_in, panels, N);
  const at::Tensor &x = o.x, &y = o.y;
  const int64_t M = o.M, K = o.K, P = o.P;
  TORCH_CHECK(N > 0 && (N + NB - 1) / NB == P, "N = ", N, " does not match ", P, " panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(), "bias must be fp32 [", N, "]");
    bp = bias->data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tail;  // the last panel's block when it runs past column N
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c0 = p * NB, nc = std::min(NB, N - c0);
      if (nc == NB) {
        panel(xp, M, K, pp + p * K * NB, yp + c0, N, p + 1 < end ? pp + (p + 1) * K * NB : nullptr);
      } else {
        tail.resize(M * NB);
        panel(xp, M, K, pp + p * K * NB, tail.data(), NB, nullptr);
        for (int64_t m = 0; m < M; ++m) std::copy_n(tail.data() + m * NB, nc, yp + m * N + c0);
      }
      if (bp != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = 0; c < nc; ++c) yp[m * N + c0 + c] += bp[c0 + c];
    }
  });
  return y;
}

at::Tensor tessera_cpu::panel_swiglu(const at::Tensor& x_in, const at::Tensor& panels, int64_t F) {
  const Operands o = operands(x_in, panels, F);
  const at::Tensor &x = o.x, &y = o.y;
  const int64_t M = o.M, K = o.K, P = o.P;
  TORCH_CHECK(F > 0 && F % NB == 0 && 2 * F / NB == P, "F = ", F, " must be a multiple of ", NB,
              " and half the ", P * NB, " packed columns");
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t half = P / 2;
  at::parallel_for(0, half, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(M * NB), up(M * NB);
    for (int64_t j = begin; j < end; ++j) {
      const float* g = pp + j * K * NB;
      const float* u = pp + (half + j) * K * NB;
      panel(xp, M, K, g, gate.data(), NB, u);
      panel(xp, M, K, u, up.data(), NB, j + 1 < end ? pp + (j + 1) * K * NB : nullptr);
      for (int64_t m = 0; m < M; ++m)
        tessera_vec::silu_mul_row(gate.data() + m * NB, up.data() + m * NB, yp + m * F + j * NB, NB);
    }
  });
  return y;
}
