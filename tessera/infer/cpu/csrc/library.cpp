// The tessera_cpu library (torch.ops.tessera_cpu, built by tessera/infer/cpu/attention.py): every op's
// schema and its CPU kernel (kernels.h), in one place.
#include <torch/library.h>

#include "kernels.h"

TORCH_LIBRARY(tessera_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor blocks, "
        "int block_size, float scale, int window, Tensor? k_scale=None, Tensor? v_scale=None, bool portable=False) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int N) -> Tensor");
  m.def("panel_swiglu(Tensor x, Tensor panels, int F) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor blocks, str kind, int N, Tensor? bias, bool portable=False) -> Tensor");
  m.def("gguf_linear_group(Tensor x, Tensor[] blocks, str kind, int[] N, Tensor? bias, bool portable=False) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, str kind, int N, int K) -> Tensor");
  m.def("gguf_linear_wide(Tensor x, Tensor blocks, str kind, int N, Tensor? bias) -> Tensor");
  m.def("block_isa(str? want=None) -> str", &tessera_cpu::block_isa);  // no tensor: one kernel for all keys
  m.def("delta_chunk_terms(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int chunk, float q_scale, "
        "float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("quant_linear(Tensor x, Tensor codes, str layout, Tensor scale, Tensor? shift, float offset, int N, "
        "Tensor? bias, bool portable=False) -> Tensor");
  m.def("gguf_dense_layer(Tensor x, Tensor[] norms, float eps, Tensor[] mats, str qkv_kind, str o_kind, "
        "str gate_up_kind, str down_kind, int[] sizes, Tensor? qkv_bias, Tensor cos, Tensor sin, int head_dim, "
        "Tensor(a!)[] cache, Tensor slots, Tensor rows, Tensor blocks, int block_size, float scale, int window) -> Tensor");
  m.def("gguf_dense_stack(Tensor x, Tensor[] norms, float[] eps, Tensor[] mats, str[] kinds, int[] sizes, "
        "Tensor?[] qkv_bias, Tensor cos, Tensor sin, int head_dim, Tensor(a!)[] cache, Tensor slots, Tensor rows, "
        "Tensor blocks, int block_size, float[] scale, int[] window) -> Tensor");
  m.def("logit_checks(Tensor logits, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) {
  m.impl("paged_attention", &tessera_cpu::paged_attention);
  m.impl("rms_norm", &tessera_cpu::rms_norm);
  m.impl("rope_", &tessera_cpu::rope_);
  m.impl("silu_mul", &tessera_cpu::silu_mul);
  m.impl("pack_panels", &tessera_cpu::pack_panels);
  m.impl("panel_linear", &tessera_cpu::panel_linear);
  m.impl("panel_swiglu", &tessera_cpu::panel_swiglu);
  m.impl("gguf_linear", &tessera_cpu::gguf_linear);
  m.impl("gguf_linear_group", &tessera_cpu::gguf_linear_group);
  m.impl("gguf_dequantize", &tessera_cpu::gguf_dequantize);
  m.impl("gguf_linear_wide", &tessera_cpu::gguf_linear_wide);
  m.impl("delta_chunk_terms", &tessera_cpu::delta_chunk_terms);
  m.impl("quant_linear", &tessera_cpu::quant_linear);
  m.impl("gguf_dense_layer", &tessera_cpu::gguf_dense_layer);
  m.impl("gguf_dense_stack", &tessera_cpu::gguf_dense_stack);
  m.impl("logit_checks", &tessera_cpu::logit_checks);
}
