// The CPU kernels of the tessera_cpu library, one declaration each: library.cpp registers them (the
// op schemas), the files named beside them define them and say what they compute.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace tessera_cpu {

// paged_attention_cpu.cpp
void paged_attention(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& rows, const at::Tensor& blocks, int64_t block_size, double scale,
                     int64_t window, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, bool portable);

// layer_ops_cpu.cpp
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps);
void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// linear_cpu.cpp
at::Tensor pack_panels(const at::Tensor& weight);
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t N);
at::Tensor panel_swiglu(const at::Tensor& x_in, const at::Tensor& panels, int64_t F);

// gguf_matmul_cpu.cpp
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& blocks, c10::string_view kind, int64_t N,
                       const std::optional<at::Tensor>& bias, bool portable);
at::Tensor gguf_linear_group(const at::Tensor& x_in, at::TensorList blocks, c10::string_view kind, at::IntArrayRef N,
                             const std::optional<at::Tensor>& bias, bool portable);
at::Tensor gguf_dequantize(const at::Tensor& blocks, c10::string_view kind, int64_t N, int64_t K);
at::Tensor gguf_linear_wide(const at::Tensor& x, const at::Tensor& blocks, c10::string_view kind, int64_t N,
                            const std::optional<at::Tensor>& bias);
std::string block_isa(const std::optional<c10::string_view>& want);

// delta_rule_cpu.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
delta_chunk_terms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, int64_t chunk, double q_scale, double eps);
// quant_matmul_cpu.cpp
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& codes, c10::string_view layout,
                        const at::Tensor& scale, const std::optional<at::Tensor>& shift, double offset, int64_t N,
                        const std::optional<at::Tensor>& bias, bool portable);
// gguf_layer_cpu.cpp
at::Tensor gguf_dense_layer(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList mats,
                            c10::string_view qkv_kind, c10::string_view o_kind, c10::string_view gate_up_kind,
                            c10::string_view down_kind, at::IntArrayRef sizes, const std::optional<at::Tensor>& qkv_bias,
                            const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim, at::TensorList cache,
                            const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& blocks,
                            int64_t block_size, double scale, int64_t window);
at::Tensor gguf_dense_stack(const at::Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList mats,
                            const c10::List<std::string>& kinds, at::IntArrayRef sizes,
                            const c10::List<std::optional<at::Tensor>>& qkv_bias, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t head_dim, at::TensorList cache, const at::Tensor& slots,
                            const at::Tensor& rows, const at::Tensor& blocks, int64_t block_size,
                            at::ArrayRef<double> scale, at::IntArrayRef window);
at::Tensor logit_checks(const at::Tensor& logits, const at::Tensor& rows);

}  // namespace tessera_cpu
