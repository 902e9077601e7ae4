// A dense llama-style layer whose projections are GGUF block matrices, for the few rows of a decode step
// or a short prompt chunk, in one call (tessera/infer/cpu/gguf_layer.py calls it):
//   gguf_dense_layer(x [T, D], norms, eps, mats, qkv_kind, o_kind, gate_up_kind, down_kind, sizes, qkv_bias, cos, sin, head_dim, cache, slots,
//                    rows, blocks, block_size, scale, window) -> x after the layer [T, D]
// norms: (attention_norm, ffn_norm) weights; mats: (wq, wk, wv, wo, w1, w3, w2) blocks [out, row bytes];
// the block types of q/k/v, o, gate/up and down; sizes: each matrix's outputs; cache: (k, v) of the
// layer, fp32 [slots, G, Dh], or (k, v, k_scale, v_scale) of an int8 cache; slots [T]: where each row's key
// and value go; rows, blocks, block_size, scale, window: the paged attention kernel's arguments.
//
// It runs what the modules run one by one, in the same order and with the same kernels, so the result is
// their bits: RMSNorm, the grouped q/k/v block product, RoPE in place, the cache write (int8: the
// operations of PagedKVCache.write / quantize_int8, element for element), paged attention over each row's
// blocks, the o product plus the residual, RMSNorm, the grouped gate/up product, SiLU * up, the down
// product plus the residual. What it saves is the Python between them: about a dozen module calls, their
// checks and their views per layer, and the cache write's eight PyTorch ops.
//
// gguf_dense_stack runs the layers of a whole decode step in one call (infer/cpu/gguf_layer.py's
// GgufDenseStack): gguf_dense_layer for each layer in turn, each layer's own arguments taken from lists
// (norms 2 a layer, eps, mats 7, kinds 4, sizes 7, qkv_bias, cache 2 or 4, scale, window), the step's own
// (cos, sin, slots, rows, blocks) shared: the same calls, so the same bits, without the Python between layers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace {

// One head vector's keys or values (n values, contiguous) into the int8 cache: quantize_int8's
// operations, scale = max(max|x|, 1e-8) / 127, q = round-half-even(x / scale) clamped to +-127.
void write_int8(const float* x, int64_t n, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = std::max(amax, 1e-8f) / 127.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(x[i] / s);
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  *scale = s;
}

// k [T, G, Dk] and v [T, G, Dv] (views with a contiguous last dimension) into the cache's slots.
void write_cache(const at::Tensor& k, const at::Tensor& v, at::TensorList cache, const at::Tensor& slots) {
  const int64_t T = k.size(0), G = k.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool int8 = cache.size() == 4;
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& src = which == 0 ? k : v;
    const at::Tensor& dst = cache[which];
    const int64_t Dh = src.size(2), nslots = dst.size(0);
    const float* xp = src.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "gguf_dense_layer: slot ", sp[t], " outside the cache's ", nslots);
      for (int64_t g = 0; g < G; ++g) {
        const float* row = xp + t * src.stride(0) + g * src.stride(1);
        const int64_t at = sp[t] * G + g;
        if (int8)
          write_int8(row, Dh, dst.data_ptr<int8_t>() + at * Dh, cache[2 + which].data_ptr<float>() + at);
        else
          std::copy(row, row + Dh, dst.data_ptr<float>() + at * Dh);
      }
    }
  }
}

void check_cache(at::TensorList cache, int64_t G, int64_t Dh) {
  TORCH_CHECK(cache.size() == 2 || cache.size() == 4, "gguf_dense_layer: cache is (k, v) or (k, v, k_scale, v_scale)");
  const bool int8 = cache.size() == 4;
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& c = cache[i];
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.dim() == 3 && c.size(1) == G && c.size(2) == Dh &&
                    c.scalar_type() == (int8 ? at::kChar : at::kFloat),
                "gguf_dense_layer: the cache must be contiguous [slots, ", G, ", ", Dh, "], ",
                int8 ? "int8" : "fp32", "; got ", c.scalar_type(), " ", c.sizes());
    if (int8)
      TORCH_CHECK(cache[2 + i].scalar_type() == at::kFloat && cache[2 + i].is_contiguous() &&
                      cache[2 + i].numel() == c.size(0) * G,
                  "gguf_dense_layer: an int8 cache's scales are fp32 [slots, ", G, "]");
  }
}

}  // namespace

at::Tensor tessera_cpu::gguf_dense_layer(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList mats,
                                         c10::string_view qkv_kind, c10::string_view o_kind,
                                         c10::string_view gate_up_kind, c10::string_view down_kind, at::IntArrayRef sizes,
                                         const std::optional<at::Tensor>& qkv_bias, const at::Tensor& cos,
                                         const at::Tensor& sin, int64_t head_dim, at::TensorList cache,
                                         const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& blocks,
                                         int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "gguf_dense_layer takes fp32 CPU rows [T, D], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(norms.size() == 2 && mats.size() == 7 && sizes.size() == 7,
              "gguf_dense_layer: 2 norms, 7 matrices (q, k, v, o, gate, up, down) and their 7 sizes");
  const int64_t T = x.size(0), nq = sizes[0], nk = sizes[1], nv = sizes[2], F = sizes[4];
  TORCH_CHECK(head_dim > 0 && nq % head_dim == 0 && nk % head_dim == 0 && nv % head_dim == 0 && sizes[5] == F,
              "gguf_dense_layer: q, k, v widths ", nq, ", ", nk, ", ", nv, " are not whole heads of ", head_dim);
  const int64_t H = nq / head_dim, G = nk / head_dim;
  check_cache(cache, G, head_dim);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "gguf_dense_layer: slots must be int64 [", T, "]");
  // attention: x + o(attend(rope(q), rope(k) -> cache, v -> cache))
  const at::Tensor h = rms_norm(x, norms[0], eps);
  const at::Tensor qkv = gguf_linear_group(h, mats.slice(0, 3), qkv_kind, sizes.slice(0, 3), qkv_bias, false);
  const at::Tensor q = qkv.narrow(1, 0, nq).view({1, T, H, head_dim});
  const at::Tensor k = qkv.narrow(1, nq, nk).view({1, T, G, head_dim});
  rope_(q, k, cos, sin);
  write_cache(k[0], qkv.narrow(1, nq + nk, nv).view({T, G, head_dim}), cache, slots);
  at::Tensor out = at::empty({T, H, head_dim}, x.options());
  const bool int8 = cache.size() == 4;
  paged_attention(q[0], out, cache[0], cache[1], rows, blocks, block_size, scale, window,
                  int8 ? std::optional<at::Tensor>(cache[2]) : std::nullopt,
                  int8 ? std::optional<at::Tensor>(cache[3]) : std::nullopt, false);
  const at::Tensor x2 = x + gguf_linear(out.view({T, H * head_dim}), mats[3], o_kind, sizes[3], std::nullopt, false);
  // feed-forward: x2 + down(silu(gate) * up)
  const at::Tensor gate_up = gguf_linear_group(rms_norm(x2, norms[1], eps), mats.slice(4, 2), gate_up_kind,
                                               sizes.slice(4, 2), std::nullopt, false);
  const at::Tensor act = silu_mul(gate_up.narrow(1, 0, F), gate_up.narrow(1, F, F));
  return x2 + gguf_linear(act, mats[6], down_kind, sizes[6], std::nullopt, false);
}

at::Tensor tessera_cpu::gguf_dense_stack(const at::Tensor& x, at::TensorList norms, at::ArrayRef<double> eps,
                                         at::TensorList mats, const c10::List<std::string>& kinds, at::IntArrayRef sizes,
                                         const c10::List<std::optional<at::Tensor>>& qkv_bias, const at::Tensor& cos,
                                         const at::Tensor& sin, int64_t head_dim, at::TensorList cache,
                                         const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& blocks,
                                         int64_t block_size, at::ArrayRef<double> scale, at::IntArrayRef window) {
  const int64_t L = static_cast<int64_t>(eps.size());
  const int64_t per = L > 0 ? static_cast<int64_t>(cache.size()) / L : 0;  // 2, or 4 for an int8 cache
  TORCH_CHECK(L > 0 && static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(mats.size()) == 7 * L &&
                  static_cast<int64_t>(kinds.size()) == 4 * L && static_cast<int64_t>(sizes.size()) == 7 * L &&
                  static_cast<int64_t>(qkv_bias.size()) == L && (per == 2 || per == 4) &&
                  static_cast<int64_t>(cache.size()) == per * L && static_cast<int64_t>(scale.size()) == L &&
                  static_cast<int64_t>(window.size()) == L,
              "gguf_dense_stack: per layer 2 norms, 1 eps, 7 matrices, 4 kinds, 7 sizes, 1 qkv bias, 2 or 4 cache "
              "tensors, 1 scale and 1 window; got ", L, " eps, ", norms.size(), " norms, ", mats.size(), " matrices, ",
              kinds.size(), " kinds, ", sizes.size(), " sizes, ", qkv_bias.size(), " biases, ", cache.size(),
              " cache tensors, ", scale.size(), " scales, ", window.size(), " windows");
  at::Tensor y = x;
  for (int64_t i = 0; i < L; ++i) {
    const std::optional<at::Tensor> bias = qkv_bias.get(i);
    y = gguf_dense_layer(y, norms.slice(2 * i, 2), eps[i], mats.slice(7 * i, 7), kinds.get(4 * i), kinds.get(4 * i + 1),
                         kinds.get(4 * i + 2), kinds.get(4 * i + 3), sizes.slice(7 * i, 7), bias, cos, sin, head_dim,
                         cache.slice(per * i, per), slots, rows, blocks, block_size, scale[i], window[i]);
  }
  return y;
}
