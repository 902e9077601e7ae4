// y = x W^T + b with W kept as Tessera's own int8 / int4 layers keep it (tessera/infer/cpu/quant_matmul.py):
// the layer's codes read where they lie, no copy of them made. quant_linear(x [M, K], codes [N, row bytes]
// (any dtype; its bytes), layout, scale [N or 1, G] fp32, shift [N or 1, G] fp32 or none, offset, N, bias,
// portable) -> [M, N] fp32.
//
// Weight (o, i) = f * w + c, w the integer code of input i, f = scale[o, g], g = i / (K / G) its group
// (G groups of whole sub-blocks of 32), c = shift[o, g], or -offset * f without a shift. Code layouts:
// - "I8": signed int8 codes, one byte per input (Int8Linear's qweight, W8A8's int8 weight).
// - "U8": unsigned bytes holding code + 128 (compressed-tensors' 8-bit codes packed in int32 words:
//   little-endian, so input i is byte i); read as the signed code (the byte xor 0x80).
// - "P4": unsigned nibbles, input 2k in the low nibble of byte k and 2k + 1 in its high one (Tessera's int4
//   and compressed-tensors' 4-bit words alike).
// The arithmetic is block_dot.h's, sub-block by sub-block with that sub-block's f and c, so a product is
// the bits of the same weights repacked into the I8 / I4 blocks of gguf_matmul_cpu.cpp (what a layer was
// multiplied by before it was read in place; tests/infer/test_quant_matmul.py compares them).

#include <optional>
#include <string>

#include "block_dot.h"
#include "kernels.h"

namespace {

using namespace tessera_cpu::blocks;

enum class Layout { I8, U8, P4 };

template <Layout L>
struct CodeRow {
  static constexpr bool CONST = true, HALVES = false;
  static constexpr int BYTES = L == Layout::P4 ? 16 : 32;  // a sub-block's
  const uint8_t* codes;
  const float* f;
  const float* c;  // nullptr: c = -offset * f
  float offset;
  int64_t per_group;  // sub-blocks per group
  int shift;          // b >> shift is b's group (62: one group), or -1: b / per_group

  int64_t group(int64_t b) const { return shift >= 0 ? b >> shift : b / per_group; }
  Factors factors(int64_t b) const {
    const int64_t g = group(b);
    const float scale = f[g];
    return {scale, scale, c ? c[g] : -offset * scale};
  }
  void values(int64_t b, int16_t* w) const {
    const uint8_t* p = codes + b * BYTES;
    for (int i = 0; i < BYTES; ++i) {
      if constexpr (L == Layout::I8) w[i] = static_cast<int8_t>(p[i]);
      if constexpr (L == Layout::U8) w[i] = static_cast<int16_t>(p[i]) - 128;
      if constexpr (L == Layout::P4) {
        w[2 * i] = p[i] & 0xF;
        w[2 * i + 1] = p[i] >> 4;
      }
    }
  }
#ifdef TESSERA_X86
  // 8 bytes of nibble pairs as 16 int16 values in order: byte k's low nibble in lane 2k, its high in 2k + 1.
  TESSERA_AVX2_TARGET static __m256i pairs(const uint8_t* p) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_and_si256(_mm256_or_si256(x, _mm256_slli_epi32(x, 12)), _mm256_set1_epi32(0x000F000F));
  }
  TESSERA_AVX2_TARGET void vec(int64_t b, __m256i& lo, __m256i& hi) const {
    const uint8_t* p = codes + b * BYTES;
    if constexpr (L == Layout::P4) {
      lo = pairs(p);
      hi = pairs(p + 8);
    } else {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if constexpr (L == Layout::U8) v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
      vec_widen<true>(v, lo, hi);
    }
  }
#endif
};

template <Layout L>
at::Tensor multiply(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                    const std::optional<at::Tensor>& shift, double offset, int64_t N, const float* bias,
                    bool portable) {
  const int64_t K = x.size(1), nb = K / QK;
  const int64_t row_bytes = nb * CodeRow<L>::BYTES;
  TORCH_CHECK(codes.nbytes() == static_cast<size_t>(N * row_bytes), "quant_linear: codes hold ", codes.nbytes(),
              " bytes, [", N, ", ", K, "] needs ", N * row_bytes);
  const int64_t rows = scale.dim() == 2 ? scale.size(0) : scale.numel(), G = scale.numel() / std::max<int64_t>(rows, 1);
  TORCH_CHECK((rows == N || rows == 1) && G > 0 && nb % G == 0, "quant_linear: scale ", scale.sizes(), " is not [",
              N, " or 1, G] with G groups of whole blocks of ", QK, " over ", K, " inputs");
  const int64_t shift_rows = shift ? shift->numel() / G : 0;
  TORCH_CHECK(!shift || ((shift_rows == N || shift_rows == 1) && shift->numel() == shift_rows * G),
              "quant_linear: shift ", shift ? shift->sizes() : scale.sizes(), " is not [", N, " or 1, ", G, "]");
  const int64_t per_group = nb / G;
  // the group of sub-block b without a division where it can (a division per sub-block took a per-channel
  // int8 layer's product by one row to 1.25-1.36x the CPU time of the repacked blocks'): one group, or a
  // power of two sub-blocks per group
  int pow2 = G == 1 ? 62 : -1;
  for (int s = 0; s < 40 && G > 1; ++s)
    if ((int64_t{1} << s) == per_group) pow2 = s;
  const uint8_t* w = static_cast<const uint8_t*>(codes.data_ptr());
  const float* f = scale.data_ptr<float>();
  const float* c = shift ? shift->data_ptr<float>() : nullptr;
  const int64_t step = rows == N ? G : 0, shift_step = shift_rows == N ? G : 0;
  return multiply_rows(
      x, N,
      [&](int64_t n) {
        return CodeRow<L>{w + n * row_bytes, f + n * step, c ? c + n * shift_step : nullptr, static_cast<float>(offset),
                          per_group, pow2};
      },
      bias, portable);
}

}  // namespace

at::Tensor tessera_cpu::quant_linear(const at::Tensor& x_in, const at::Tensor& codes, c10::string_view layout,
                                     const at::Tensor& scale, const std::optional<at::Tensor>& shift, double offset,
                                     int64_t N, const std::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "quant_linear takes fp32 CPU activations [M, K], got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK(x_in.size(1) % QK == 0, "quant_linear: ", x_in.size(1), " inputs are not whole blocks of ", QK);
  TORCH_CHECK(codes.device().is_cpu() && codes.is_contiguous(), "quant_linear takes contiguous CPU codes");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && (!shift || shift->scalar_type() == at::kFloat),
              "quant_linear: scale and shift must be fp32");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N), "quant_linear: bias must be fp32 [",
              N, "]");
  const at::Tensor x = x_in.contiguous(), s = scale.contiguous();
  const std::optional<at::Tensor> c = shift ? std::optional<at::Tensor>(shift->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  const float* bp = b ? b->data_ptr<float>() : nullptr;
  const std::string l(layout);
  if (l == "I8") return multiply<Layout::I8>(x, codes, s, c, offset, N, bp, portable);
  if (l == "U8") return multiply<Layout::U8>(x, codes, s, c, offset, N, bp, portable);
  if (l == "P4") return multiply<Layout::P4>(x, codes, s, c, offset, N, bp, portable);
  TORCH_CHECK(false, "quant_linear: no code layout ", l, "; layouts: I8, U8, P4");
}
