// y = x W^T + b with W kept in a GGUF file's block format (tessera/models/gguf_blocks.py describes the
// layouts), multiplied without dequantizing the matrix: gguf_linear(x [M, K], blocks [N, row bytes],
// kind, N, bias, portable) -> [M, N], fp32.
//
// Activations are quantized first, per row and per 32 inputs (a "sub-block"): d = max|x| / 32767,
// q = round(x / d) in int16, and s = d * sum(q). (llama.cpp rounds them to int8, for maddubs; on
// SmolLM2's Q4_1 file that moved the perplexity of a held-out text by +1.4%, so int16 it is, at
// about the same count of instructions: madd on int16 pairs.) Every block type is then read 32
// weights at a time as small integers w (unsigned 0..31, or signed for Q8_0 and Q6_K) with
// per-sub-block float factors:
// weight = f * w + c (f per 16 values for Q6_K, c = 0 for Q8_0 and Q6_K). A sub-block contributes
//   sum_i weight_i * d q_i = (f d) * sum_i w_i q_i + c * s,
// the first sum exact in integers, so the only rounding beyond fp32's is that of the activations
// (|x - d q| <= d / 2 per input, max|x| / 65534).
//
// Each output element is computed by one thread, in one fixed order: eight fp32 accumulators, one
// per four consecutive inputs of a sub-block (lane l: inputs LANE[l] .. LANE[l] + 3, the order of AVX2's
// hadd; acc_l = fma(f d, dot_l, acc_l), sub-blocks in order),
// the constant terms in a ninth (fma(c, s, acc)), reduced at the end as ((a0+a4)+(a2+a6)) +
// ((a1+a5)+(a3+a7)), then + the ninth, then + bias. The AVX2 path (weights widened to int16, madd, hadd;
// chosen at run time with __builtin_cpu_supports) and the portable loops compute those same operations, so
// they agree bit for bit, and so do any thread counts (threads split the output columns). Rows of x
// go four at a time over each weight row, which is unpacked once per four rows. A single row of x (a
// batch-1 decode step) goes over two weight rows per pass for Q4_0 and Q4_1 (block_dot.h's dot_pair_avx2:
// two independent fma chains, each output's operations unchanged, row i of each half of a thread's rows),
// which took 0.93-0.97x the CPU time of SmolLM2's 30 Q4_1 layer ops streamed from memory; for Q8_0 it took
// 2.8x (its 49152 x 576 head), so the other types keep one row per pass
// (docs/benchmarks/2026-11-30-gguf-layer-stack.md). Four per pass took 1.02-1.14x the CPU time of one
// (1536 x 576 and 576 x 1536, Q4_1 and Q8_0; docs/benchmarks.md).
// AVX-512: where the CPU has F, BW, VL and VNNI (chosen at run time, block_dot.h's isa; `block_isa` caps it), one
// row of x on the sub-block types (pairs of Q4_0 / Q4_1 rows, single rows of the others) and the wide head take
// block_dot_avx512.h's loops: two parts (two rows' sub-block, or one row's two sub-blocks) in a zmm register,
// their sixteen four-input sums in LANE order by two permutations, a madd and VNNI's dpwssd, the fp32 part the
// same operations in the same order (Q4_0 / Q4_1's and Q8_0's fp16 factors converted a vector at a time, the
// same values), so the bits are the AVX2 and portable loops'. SmolLM2's 30 Q4_1 layer ops took 0.745-0.761x the
// CPU time of AVX2's, its Q8_0 head 0.53-0.77x (docs/benchmarks/2026-11-30-gguf-avx512.md); four rows a pass
// (two zmm chains, rows i of each quarter of a thread's rows) took 0.747x, the same, so not kept. More rows of x and the
// K-quants keep the AVX2 loops; the library builds and runs where AVX-512 is absent (target attributes).
// The loops shared with quant_matmul_cpu.cpp are in block_dot.h. Besides the GGML types, two of Tessera's
// own (I8, I4: fp32 factors per 32 values, below): its int8 / int4 and compressed-tensors layers' weights
// repacked, which quant_matmul_cpu.cpp's product by the codes where they lie equals bit for bit.

#include <optional>
#include <string>
#include <type_traits>

#include "block_dot.h"
#include "kernels.h"

namespace {

using namespace tessera_cpu::blocks;

// fp16 -> fp32 is exact: F16C's instruction (a build with -mf16c) and c10's bit operations agree.
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 bytes at s.
inline void scale_min_k4(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Each type: VALUES per block, BYTES per block, SIGNED weights or not; values(block, j, w) writes the
// 32 integers of sub-block j, factors(block, j) its factors. OFFSET (Q4_0, Q5_0): c = -OFFSET * f,
// which gguf_dequantize applies as f * (w - OFFSET), the reference's operations.
struct Q8_0 {
  static constexpr int VALUES = 32, BYTES = 34;
  static constexpr bool SIGNED = true;
  static void values(const uint8_t* b, int, int16_t* w) {
    for (int i = 0; i < QK; ++i) w[i] = static_cast<int8_t>(b[2 + i]);
  }
  static Factors factors(const uint8_t* b, int) { return {f16(b), f16(b), 0.0f}; }
};

inline void nibbles(const uint8_t* qs, int16_t* w) {
  for (int i = 0; i < 16; ++i) {
    w[i] = qs[i] & 0xF;
    w[i + 16] = qs[i] >> 4;
  }
}

inline void fifth_bits(const uint8_t* qh, int16_t* w) {
  for (int i = 0; i < QK; ++i) w[i] |= ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

struct Q4_0 {
  static constexpr int VALUES = 32, BYTES = 18, OFFSET = 8;
  static constexpr bool SIGNED = false;
  static void values(const uint8_t* b, int, int16_t* w) { nibbles(b + 2, w); }
  static Factors factors(const uint8_t* b, int) { return {f16(b), f16(b), -8.0f * f16(b)}; }
};

struct Q4_1 {
  static constexpr int VALUES = 32, BYTES = 20;
  static constexpr bool SIGNED = false;
  static void values(const uint8_t* b, int, int16_t* w) { nibbles(b + 4, w); }
  static Factors factors(const uint8_t* b, int) { return {f16(b), f16(b), f16(b + 2)}; }
};

struct Q5_0 {
  static constexpr int VALUES = 32, BYTES = 22, OFFSET = 16;
  static constexpr bool SIGNED = false;
  static void values(const uint8_t* b, int, int16_t* w) {
    nibbles(b + 6, w);
    fifth_bits(b + 2, w);
  }
  static Factors factors(const uint8_t* b, int) { return {f16(b), f16(b), -16.0f * f16(b)}; }
};

struct Q5_1 {
  static constexpr int VALUES = 32, BYTES = 24;
  static constexpr bool SIGNED = false;
  static void values(const uint8_t* b, int, int16_t* w) {
    nibbles(b + 8, w);
    fifth_bits(b + 4, w);
  }
  static Factors factors(const uint8_t* b, int) { return {f16(b), f16(b), f16(b + 2)}; }
};

inline Factors k4_factors(const uint8_t* b, int j) {
  int scale, min;
  scale_min_k4(b + 4, j, scale, min);
  const float f = f16(b) * static_cast<float>(scale);
  return {f, f, -(f16(b + 2) * static_cast<float>(min))};
}

struct Q4_K {
  static constexpr int VALUES = 256, BYTES = 144;
  static constexpr bool SIGNED = false;
  static void values(const uint8_t* b, int j, int16_t* w) {
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    for (int i = 0; i < QK; ++i) w[i] = j % 2 ? qs[i] >> 4 : qs[i] & 0xF;
  }
  static Factors factors(const uint8_t* b, int j) { return k4_factors(b, j); }
};

struct Q5_K {
  static constexpr int VALUES = 256, BYTES = 176;
  static constexpr bool SIGNED = false;
  static void values(const uint8_t* b, int j, int16_t* w) {
    const uint8_t* qs = b + 48 + 32 * (j / 2);
    for (int i = 0; i < QK; ++i) w[i] = (j % 2 ? qs[i] >> 4 : qs[i] & 0xF) | (((b[16 + i] >> j) & 1) << 4);
  }
  static Factors factors(const uint8_t* b, int j) { return k4_factors(b, j); }
};

struct Q6_K {
  static constexpr int VALUES = 256, BYTES = 210;
  static constexpr bool SIGNED = true;
  static void values(const uint8_t* b, int j, int16_t* w) {
    const int half = j / 4, k = j % 4;
    const uint8_t* ql = b + 64 * half + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * half;
    for (int i = 0; i < QK; ++i)
      w[i] = ((k >> 1 ? ql[i] >> 4 : ql[i] & 0xF) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32;
  }
  static Factors factors(const uint8_t* b, int j) {
    const float d = f16(b + 208);
    return {d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * j])),
            d * static_cast<float>(static_cast<int8_t>(b[193 + 2 * j])), 0.0f};
  }
};

// Tessera's own formats, repacked at load (tessera/infer/cpu/quant_matmul.py): 32 values, then the
// sub-block's factors as two fp32 (f, c; weight = f * w + c), so a per-channel or per-group fp32 scale
// and a zero point are kept exactly. I8: signed int8 values (int8 codes, compressed-tensors' 8-bit);
// I4: unsigned nibbles in GGUF's order (value i in the low nibble of byte i, value i + 16 in its high one).
inline float f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

struct I8 {
  static constexpr int VALUES = 32, BYTES = 40;
  static constexpr bool SIGNED = true, CONST = true;
  static void values(const uint8_t* b, int, int16_t* w) {
    for (int i = 0; i < QK; ++i) w[i] = static_cast<int8_t>(b[i]);
  }
  static Factors factors(const uint8_t* b, int) { return {f32(b + 32), f32(b + 32), f32(b + 36)}; }
};

struct I4 {
  static constexpr int VALUES = 32, BYTES = 24;
  static constexpr bool SIGNED = false;
  static void values(const uint8_t* b, int, int16_t* w) { nibbles(b, w); }
  static Factors factors(const uint8_t* b, int) { return {f32(b + 16), f32(b + 16), f32(b + 20)}; }
};

// Whether a type's weights carry a constant term c: the unsigned types, and I8 (its zero points).
template <class T>
constexpr bool has_const() {
  if constexpr (requires { T::CONST; }) return T::CONST;
  return !T::SIGNED;
}

template <class T>
constexpr int offset_of() {
  if constexpr (requires { T::OFFSET; }) return T::OFFSET;
  return 0;
}

#ifdef TESSERA_X86

// The 32 weights of a sub-block in bytes, in order (unsigned, or signed for the SIGNED types).
template <class T>
TESSERA_AVX2_TARGET inline __m256i vec_values(const uint8_t* b, int j);

TESSERA_AVX2_TARGET inline __m256i vec_nibbles(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// Bit i of the little-endian word at qh as 0x10 in byte i.
TESSERA_AVX2_TARGET inline __m256i vec_fifth_bits(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(h)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q8_0>(const uint8_t* b, int) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
}
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<I8>(const uint8_t* b, int) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
}
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<I4>(const uint8_t* b, int) { return vec_nibbles(b); }
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q4_0>(const uint8_t* b, int) { return vec_nibbles(b + 2); }
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q4_1>(const uint8_t* b, int) { return vec_nibbles(b + 4); }
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q5_0>(const uint8_t* b, int) {
  return _mm256_or_si256(vec_nibbles(b + 6), vec_fifth_bits(b + 2));
}
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q5_1>(const uint8_t* b, int) {
  return _mm256_or_si256(vec_nibbles(b + 8), vec_fifth_bits(b + 4));
}

TESSERA_AVX2_TARGET inline __m256i vec_k_nibbles(const uint8_t* qs, int j) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
  return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0xF));
}

template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q4_K>(const uint8_t* b, int j) { return vec_k_nibbles(b + 16, j); }
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q5_K>(const uint8_t* b, int j) {
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
  const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(0x10));
  return _mm256_or_si256(vec_k_nibbles(b + 48, j), high);
}
template <>
TESSERA_AVX2_TARGET inline __m256i vec_values<Q6_K>(const uint8_t* b, int j) {
  const int half = j / 4, k = j % 4;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (k & 1)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  const __m256i low = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0xF));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}

// The 32 weights of sub-block j as int16 (values 0..15 in lo, 16..31 in hi). Q4_0 and Q4_1 widen their 16
// bytes once and take the nibbles apart in int16 lanes: one shuffle where the bytes' way takes four
// (shuffles, not arithmetic, bound this loop: a 1536 x 576 Q4_1 product by one row took 0.75x the CPU
// time), the same values.
template <class T>
TESSERA_AVX2_TARGET inline void vec_weights(const uint8_t* blk, int j, __m256i& lo, __m256i& hi) {
  if constexpr (std::is_same_v<T, Q4_0> || std::is_same_v<T, Q4_1>) {
    const int at = std::is_same_v<T, Q4_0> ? 2 : 4;
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + at)));
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
    hi = _mm256_srli_epi16(v, 4);
  } else {
    vec_widen<T::SIGNED>(vec_values<T>(blk, j), lo, hi);
  }
}

// The AVX-512 loops' loads (block_dot_avx512.h): sub-block j0 of block b0 and j1 of b1 as int16, values 0..15 in
// lo (b0's in its low half), 16..31 in hi. Q4_0 and Q4_1 widen both blocks' 16 bytes in one instruction and take
// the nibbles apart in int16 lanes, as vec_weights does; the others split vec_values' bytes.
template <class T>
TESSERA_AVX512_TARGET inline void vec_weights512(const uint8_t* b0, int j0, const uint8_t* b1, int j1, __m512i& lo,
                                                 __m512i& hi) {
  if constexpr (std::is_same_v<T, Q4_0> || std::is_same_v<T, Q4_1>) {
    const int at = std::is_same_v<T, Q4_0> ? 2 : 4;
    const __m256i bytes = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + at))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + at)), 1);
    const __m512i v = _mm512_cvtepu8_epi16(bytes);
    lo = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
    hi = _mm512_srli_epi16(v, 4);
  } else {
    const __m256i v0 = vec_values<T>(b0, j0), v1 = vec_values<T>(b1, j1);
    const __m256i first = _mm256_permute2x128_si256(v0, v1, 0x20), second = _mm256_permute2x128_si256(v0, v1, 0x31);
    lo = T::SIGNED ? _mm512_cvtepi8_epi16(first) : _mm512_cvtepu8_epi16(first);
    hi = T::SIGNED ? _mm512_cvtepi8_epi16(second) : _mm512_cvtepu8_epi16(second);
  }
}

#endif

// A weight row of block type T as a source of block_dot.h.
template <class T>
struct BlockRow {
  static constexpr int SUBS = T::VALUES / QK;
  static constexpr bool CONST = has_const<T>(), HALVES = std::is_same_v<T, Q6_K>;
  static constexpr bool PAIR = std::is_same_v<T, Q4_0> || std::is_same_v<T, Q4_1>;  // (file comment)
  const uint8_t* row;
  const uint8_t* block(int64_t b) const { return row + (b / SUBS) * T::BYTES; }
  void values(int64_t b, int16_t* w) const { T::values(block(b), static_cast<int>(b % SUBS), w); }
  Factors factors(int64_t b) const { return T::factors(block(b), static_cast<int>(b % SUBS)); }
#ifdef TESSERA_X86
  TESSERA_AVX2_TARGET void vec(int64_t b, __m256i& lo, __m256i& hi) const {
    vec_weights<T>(block(b), static_cast<int>(b % SUBS), lo, hi);
  }
  static constexpr bool V512 = !HALVES;  // (the K-quants' own loops go first: multiply_rows)
  TESSERA_AVX512_TARGET void vec512(const BlockRow& other, int64_t b, int64_t b_other, __m512i& lo,
                                    __m512i& hi) const {
    vec_weights512<T>(block(b), static_cast<int>(b % SUBS), other.block(b_other), static_cast<int>(b_other % SUBS), lo,
                      hi);
  }
  // Q4_0 / Q4_1: sub-block b's factors and other's as [f0.lo, f0.c, f1.lo, f1.c], converted from fp16 in one
  // instruction (the values factors() gives: Q4_0's c = -8 f, exact)
  TESSERA_AVX512_TARGET __m128 pair_factors(const BlockRow& other, int64_t b) const
    requires(std::is_same_v<T, Q4_0> || std::is_same_v<T, Q4_1>)
  {
    uint32_t h0, h1;
    std::memcpy(&h0, block(b), 4);  // Q4_0: d and its first two nibble bytes (replaced below)
    std::memcpy(&h1, other.block(b), 4);
    const __m128 f = _mm_cvtph_ps(_mm_setr_epi32(static_cast<int>(h0), static_cast<int>(h1), 0, 0));
    if constexpr (std::is_same_v<T, Q4_1>) return f;
    const __m128 d = _mm_shuffle_ps(f, f, _MM_SHUFFLE(2, 2, 0, 0));
    return _mm_mul_ps(d, _mm_setr_ps(1.0f, -8.0f, 1.0f, -8.0f));
  }
#endif
};

// The K-quants, a super-block of 8 sub-blocks at a time, for up to 8 rows of x per pass (Q6_K: 4), with what
// the sub-block loop did per sub-block done once per super-block: the factors decoded in vector registers
// (Q4_K / Q5_K's 6-bit scales and mins and the fp16 d and dmin; Q6_K's 16 int8 scales and d) and multiplied
// by each row's eight activation scales at once, and the bytes two sub-blocks share loaded and widened once
// (Q4_K / Q5_K: the low nibbles one sub-block's, the high ones the next's; Q5_K's fifth bits widened once per
// super-block; Q6_K: a half's low and high bits). Each has its own order of sums, the same in its AVX2 loop
// and its portable one (dot_rows_k4_portable, dot_rows_k6_portable), without the sub-block loop's hadd
// and scalar constant terms (half the time of a row there): Q4_K / Q5_K's accumulator lane l sums inputs
// 2l, 2l + 1, 16 + 2l and 17 + 2l of each sub-block (the two madd results added: a sub-block has one
// factor), and the constant terms c * s go to eight lanes, one per sub-block of a super-block (one fma per
// super-block and row), reduced as the accumulators are, before them; Q6_K, whose halves of 16 have
// factors of their own, keeps two accumulators, one per half (dot_rows_k6).
#ifdef TESSERA_X86
// Sub-blocks j and j + 1 (j even) of K-quant super-block b as int16: w[t][0] values 0..15, w[t][1] 16..31.
template <class T>
TESSERA_AVX2_TARGET inline void k_pair(const uint8_t* b, int j, __m256i w[2][2], const __m256i* qh) {
  {
    const int at = std::is_same_v<T, Q4_K> ? 16 : 48;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + at + 16 * j));
    const __m256i v0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
    const __m256i v1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
    const __m256i m = _mm256_set1_epi16(0xF);
    w[0][0] = _mm256_and_si256(v0, m);
    w[0][1] = _mm256_and_si256(v1, m);
    w[1][0] = _mm256_srli_epi16(v0, 4);
    w[1][1] = _mm256_srli_epi16(v1, 4);
    if constexpr (std::is_same_v<T, Q5_K>) {  // bit j of qh[i] is value i's fifth bit in sub-block j
      const __m256i one = _mm256_set1_epi16(1);
      for (int t = 0; t < 2; ++t)
        for (int h = 0; h < 2; ++h) {
          const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh[h], _mm_cvtsi32_si128(j + t)), one);
          w[t][h] = _mm256_or_si256(w[t][h], _mm256_slli_epi16(bit, 4));
        }
    }
  }
}

// Q4_K / Q5_K super-block b's eight sub-block factors f = d * scale and constants c = -(dmin * min) (k4_factors'
// values), the 6-bit fields taken apart four at a time in 32-bit words.
TESSERA_AVX2_TARGET inline void k4_table(const uint8_t* b, __m256& f, __m256& c) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, top2 = 0x03030303;
  const uint32_t scales[2] = {u[0] & low6, (u[2] & low4) | (((u[0] >> 6) & top2) << 4)};
  const uint32_t mins[2] = {u[1] & low6, ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4)};
  uint64_t s8, m8;
  std::memcpy(&s8, scales, 8);
  std::memcpy(&m8, mins, 8);
  const __m256 sf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(s8))));
  const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(m8))));
  f = _mm256_mul_ps(_mm256_set1_ps(f16(b)), sf);
  c = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), mf), _mm256_set1_ps(-0.0f));
}

TESSERA_AVX2_TARGET inline float reduce_vec(__m256 v, float c) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return reduce(lanes, c);
}

// Q4_K / Q5_K: rows m0 .. m0 + R of x against weight row `row` in their own order (comment above).
template <class T, int R>
TESSERA_AVX2_TARGET void dot_rows_k4(const uint8_t* row, const Activations& a, int64_t m0, float* out) {
  __m256 acc[R], cst[R];
  for (int r = 0; r < R; ++r) acc[r] = cst[r] = _mm256_setzero_ps();
  alignas(32) float scale[R][8];  // f_j * d of row r's sub-block j
  for (int64_t sb = 0; sb < a.nb / 8; ++sb) {
    const uint8_t* blk = row + sb * T::BYTES;
    __m256 f, c;
    k4_table(blk, f, c);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * a.nb + sb * 8;
      _mm256_store_ps(scale[r], _mm256_mul_ps(f, _mm256_loadu_ps(a.d + at)));
      cst[r] = _mm256_fmadd_ps(c, _mm256_loadu_ps(a.s + at), cst[r]);
    }
    __m256i qh[2];
    if constexpr (std::is_same_v<T, Q5_K>) {
      qh[0] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
      qh[1] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32)));
    }
    for (int j = 0; j < 8; j += 2) {
      __m256i w[2][2];
      k_pair<T>(blk, j, w, qh);
      for (int t = 0; t < 2; ++t)
        for (int r = 0; r < R; ++r) {
          const int16_t* q = a.q + ((m0 + r) * a.nb + sb * 8 + j + t) * QK;
          const __m256i dot = _mm256_add_epi32(
              _mm256_madd_epi16(w[t][0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
              _mm256_madd_epi16(w[t][1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16))));
          acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[r][j + t]), _mm256_cvtepi32_ps(dot), acc[r]);
        }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce_vec(acc[r], reduce_vec(cst[r], 0.0f));
}

// Q6_K super-block b's sub-block factors, d times each int8 scale: lo[j] of values 0..15, hi[j] of 16..31.
TESSERA_AVX2_TARGET inline void k6_table(const uint8_t* b, __m256& lo, __m256& hi) {
  const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), even_odd);
  const __m256 d = _mm256_set1_ps(f16(b + 208));
  lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
  hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
}

// Q6_K sub-blocks j and j + 1 (j even) as int16 (as k_pair), the bytes of their half loaded once.
TESSERA_AVX2_TARGET inline void k6_pair(const uint8_t* b, int j, __m256i w[2][2]) {
  const int half = j / 4, k = j % 4;  // k: 0 or 2
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  __m256i v[2];
  if (k == 0) {
    v[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2));
    v[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2));
  } else {
    v[0] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m2));
    v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2));
  }
  for (int t = 0; t < 2; ++t) vec_widen<true>(_mm256_sub_epi8(v[t], off), w[t][0], w[t][1]);
}

// Q6_K in its own order (comment above), no hadd: two accumulators a row, `lo` lane l summing inputs 2l and
// 2l + 1 of each sub-block times its factor of values 0..15, `hi` inputs 16 + 2l and 17 + 2l times the other.
template <int R>
TESSERA_AVX2_TARGET void dot_rows_k6(const uint8_t* row, const Activations& a, int64_t m0, float* out) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  alignas(32) float scale[R][2][8];  // f_j * d of row r's sub-block j, values 0..15 and 16..31
  for (int64_t sb = 0; sb < a.nb / 8; ++sb) {
    const uint8_t* blk = row + sb * Q6_K::BYTES;
    __m256 f_lo, f_hi;
    k6_table(blk, f_lo, f_hi);
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_loadu_ps(a.d + (m0 + r) * a.nb + sb * 8);
      _mm256_store_ps(scale[r][0], _mm256_mul_ps(f_lo, d));
      _mm256_store_ps(scale[r][1], _mm256_mul_ps(f_hi, d));
    }
    for (int j = 0; j < 8; j += 2) {
      __m256i w[2][2];
      k6_pair(blk, j, w);
      for (int t = 0; t < 2; ++t)
        for (int r = 0; r < R; ++r) {
          const int16_t* q = a.q + ((m0 + r) * a.nb + sb * 8 + j + t) * QK;
          const __m256i p = _mm256_madd_epi16(w[t][0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
          const __m256i u = _mm256_madd_epi16(w[t][1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16)));
          lo[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[r][0][j + t]), _mm256_cvtepi32_ps(p), lo[r]);
          hi[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[r][1][j + t]), _mm256_cvtepi32_ps(u), hi[r]);
        }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce_vec(lo[r], reduce_vec(hi[r], 0.0f));
}
#endif

// Q4_K / Q5_K's order (comment above) in portable loops: the AVX2 loop's bits.
template <class T>
void dot_rows_k4_portable(const BlockRow<T>& src, const Activations& a, int64_t m0, int R, float* out) {
  float acc[8][8] = {}, cst[8][8] = {};
  int16_t w[QK];
  for (int64_t b = 0; b < a.nb; ++b) {
    src.values(b, w);
    const Factors f = src.factors(b);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * a.nb + b;
      const int16_t* q = a.q + at * QK;
      const float scale = f.lo * a.d[at];
      for (int l = 0; l < 8; ++l) {
        const int dot = w[2 * l] * q[2 * l] + w[2 * l + 1] * q[2 * l + 1] + w[16 + 2 * l] * q[16 + 2 * l] +
                        w[17 + 2 * l] * q[17 + 2 * l];
        acc[r][l] = std::fma(scale, static_cast<float>(dot), acc[r][l]);
      }
      cst[r][b % 8] = std::fma(f.c, a.s[at], cst[r][b % 8]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(acc[r], reduce(cst[r], 0.0f));
}

// Q6_K's order (dot_rows_k6) in portable loops: the AVX2 loop's bits.
inline void dot_rows_k6_portable(const BlockRow<Q6_K>& src, const Activations& a, int64_t m0, int R, float* out) {
  float lo[8][8] = {}, hi[8][8] = {};
  int16_t w[QK];
  for (int64_t b = 0; b < a.nb; ++b) {
    src.values(b, w);
    const Factors f = src.factors(b);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * a.nb + b;
      const int16_t* q = a.q + at * QK;
      const float s_lo = f.lo * a.d[at], s_hi = f.hi * a.d[at];
      for (int l = 0; l < 8; ++l) {
        lo[r][l] = std::fma(s_lo, static_cast<float>(w[2 * l] * q[2 * l] + w[2 * l + 1] * q[2 * l + 1]), lo[r][l]);
        hi[r][l] = std::fma(s_hi, static_cast<float>(w[16 + 2 * l] * q[16 + 2 * l] + w[17 + 2 * l] * q[17 + 2 * l]),
                            hi[r][l]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(lo[r], reduce(hi[r], 0.0f));
}

template <class T>
constexpr bool is_k() {
  return std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K> || std::is_same_v<T, Q6_K>;
}

// A K-quant weight row: block_dot.h's source with loops of its own, 8 rows of x per pass.
template <class T>
struct KRow : BlockRow<T> {
  static constexpr bool K4 = !std::is_same_v<T, Q6_K>;
  static constexpr int PASS = K4 ? 8 : 4;  // Q6_K's two accumulators a row: four rows fill the registers
  static constexpr bool V512 = false;      // (their own order of sums: AVX2 and portable loops only)
#ifdef TESSERA_X86
  template <int R>
  void dot_r(const Activations& a, int64_t m0, float* out) const {
    if constexpr (K4)
      dot_rows_k4<T, R>(this->row, a, m0, out);
    else
      dot_rows_k6<R>(this->row, a, m0, out);
  }
  void dot_avx2(const Activations& a, int64_t m0, int R, float* out) const {
    switch (R) {  // at most PASS
      case 8: return dot_r<8>(a, m0, out);
      case 7: return dot_r<7>(a, m0, out);
      case 6: return dot_r<6>(a, m0, out);
      case 5: return dot_r<5>(a, m0, out);
      case 4: return dot_r<4>(a, m0, out);
      case 3: return dot_r<3>(a, m0, out);
      case 2: return dot_r<2>(a, m0, out);
      default: return dot_r<1>(a, m0, out);
    }
  }
#endif
  void dot_portable(const Activations& a, int64_t m0, int R, float* out) const {
    if constexpr (K4)
      dot_rows_k4_portable<T>(*this, a, m0, R, out);
    else
      dot_rows_k6_portable(*this, a, m0, R, out);
  }
};

// Several matrices over the same x (a layer's q, k and v, or its gate and up), their outputs side by side:
// y [M, sum N], matrix i's columns after those of the matrices before it. x is quantized once and one
// parallel region splits all their rows; each output is computed as by the product by its matrix alone
// (the same bits).
template <class T>
at::Tensor multiply(const at::Tensor& x, const std::vector<at::Tensor>& parts, at::IntArrayRef Ns,
                    const std::optional<at::Tensor>& bias, bool portable) {
  const int64_t K = x.size(1);
  TORCH_CHECK(K % T::VALUES == 0, "gguf_linear: ", K, " inputs are not whole blocks of ", T::VALUES);
  const int64_t row_bytes = (K / T::VALUES) * T::BYTES;
  std::vector<const uint8_t*> rows;  // every output column's weight row, in order
  for (size_t i = 0; i < parts.size(); ++i) {
    TORCH_CHECK(parts[i].numel() == Ns[i] * row_bytes, "gguf_linear: blocks hold ", parts[i].numel(),
                " bytes, [", Ns[i], ", ", K, "] needs ", Ns[i] * row_bytes);
    const uint8_t* w = parts[i].data_ptr<uint8_t>();
    for (int64_t n = 0; n < Ns[i]; ++n) rows.push_back(w + n * row_bytes);
  }
  const int64_t N = static_cast<int64_t>(rows.size());
  TORCH_CHECK(!bias || bias->numel() == N, "gguf_linear: bias must be fp32 [", N, "]");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if constexpr (is_k<T>())
    return multiply_rows(x, N, [&](int64_t n) { return KRow<T>{{rows[n]}}; }, b, portable);
  else
    return multiply_rows(x, N, [&](int64_t n) { return BlockRow<T>{rows[n]}; }, b, portable);
}

// One sub-block's 32 values; a product then a sum, never contracted into an fma (GCC contracts in C++).
template <bool CONST, int OFF>
__attribute__((optimize("fp-contract=off"))) void dequantize_sub(const int16_t* v, const Factors& f, float* o) {
  for (int i = 0; i < QK; ++i) {
    const float scale = i < 16 ? f.lo : f.hi;
    if constexpr (!CONST) o[i] = scale * static_cast<float>(v[i]);
    else if constexpr (OFF != 0) o[i] = scale * static_cast<float>(v[i] - OFF);
    else o[i] = scale * static_cast<float>(v[i]) + f.c;
  }
}

// [N, K] fp32 from the blocks, the values (and bits) of tessera/models/gguf_blocks.py: the same
// fp32 operations in the same order.
template <class T>
at::Tensor dequantize_rows(const at::Tensor& blocks, int64_t N, int64_t K) {
  constexpr int SUBS = T::VALUES / QK, OFF = offset_of<T>();
  TORCH_CHECK(K % T::VALUES == 0 && blocks.numel() == N * (K / T::VALUES) * T::BYTES, "gguf_dequantize: blocks hold ",
              blocks.numel(), " bytes, not those of [", N, ", ", K, "]");
  at::Tensor y = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = (K / T::VALUES) * T::BYTES;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int16_t v[QK];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < K / QK; ++b) {
        const uint8_t* blk = w + n * row_bytes + (b / SUBS) * T::BYTES;
        const int j = static_cast<int>(b % SUBS);
        T::values(blk, j, v);
        const Factors f = T::factors(blk, j);
        dequantize_sub<has_const<T>(), OFF>(v, f, out + n * K + b * QK);
      }
  });
  return y;
}

template <template <class> class F, class... Args>
auto by_kind(const std::string& k, Args&&... args) {
  if (k == "Q8_0") return F<Q8_0>::run(args...);
  if (k == "Q4_0") return F<Q4_0>::run(args...);
  if (k == "Q4_1") return F<Q4_1>::run(args...);
  if (k == "Q5_0") return F<Q5_0>::run(args...);
  if (k == "Q5_1") return F<Q5_1>::run(args...);
  if (k == "Q4_K") return F<Q4_K>::run(args...);
  if (k == "Q5_K") return F<Q5_K>::run(args...);
  if (k == "Q6_K") return F<Q6_K>::run(args...);
  if (k == "I8") return F<I8>::run(args...);
  if (k == "I4") return F<I4>::run(args...);
  TORCH_CHECK(false, "gguf_linear: no kernel for GGML type ", k,
              "; kernels: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, I8, I4");
}

template <class T>
struct Multiply {
  static at::Tensor run(const at::Tensor& x, const std::vector<at::Tensor>& w, at::IntArrayRef N,
                        const std::optional<at::Tensor>& b, bool portable) {
    return multiply<T>(x, w, N, b, portable);
  }
};

template <class T>
struct Dequantize {
  static at::Tensor run(const at::Tensor& w, int64_t N, int64_t K) { return dequantize_rows<T>(w, N, K); }
};


// A wide matrix by one row of x (gguf_linear_wide): an LM head, SmolLM2's 49,152 rows of 576 (30 MB of Q8_0
// read per token). multiply_rows takes one weight row at a time, and an output's fmas form a chain (each waits
// on the last: 18 of them for 576 inputs) whose row's loop about fills the core's window, so the rows hardly
// overlap and the product ran well below the speed of a plain read of its bytes (docs/benchmarks.md). Here
// WIDE_PASS rows go together, their sub-blocks interleaved (independent chains), and the rows WIDE_AHEAD
// ahead are prefetched (rows read interleaved hide their stream from the hardware prefetcher: several times
// slower without). Each output is computed with
// dot_rows_avx2's operations in its order for one row of x (the scale f * d, the fma per sub-block, the
// constant terms, the reduction, + bias): the same bits. AVX2 (AVX-512 where isa says: wide_rows512) and the sub-block types only (the K-quants and
// the portable loops keep multiply's way); threads split the rows, each output computed by one.
constexpr int WIDE_PASS = 4, WIDE_AHEAD = 16;  // rows a pass; rows ahead prefetched

#ifdef TESSERA_X86
template <class T, int R>
TESSERA_AVX2_TARGET void wide_rows(const uint8_t* w, int64_t row_bytes, const Activations& a, const float* bias,
                                   float* out) {
  __m256 acc[R];
  float cst[R] = {};
  for (__m256& v : acc) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const __m256 d = _mm256_set1_ps(a.d[b]);
    for (int r = 0; r < R; ++r) {
      const BlockRow<T> src{w + r * row_bytes};
      __m256i lo, hi;
      src.vec(b, lo, hi);
      const Factors f = src.factors(b);
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(f.lo), d);
      acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(vec_dot(lo, hi, a.q + b * QK)), acc[r]);
      if constexpr (BlockRow<T>::CONST) cst[r] = std::fma(f.c, a.s[b], cst[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    const float y = reduce(lanes, cst[r]);
    out[r] = bias ? y + bias[r] : y;
  }
}

// wide_rows<T, WIDE_PASS> on AVX-512 (block_dot_avx512.h): rows 0 and 1 in one zmm accumulator, 2 and 3 in
// another, each output dot_pair_avx512's (so dot_rows_avx2's) bits.
template <class T>
TESSERA_AVX512_TARGET void wide_rows512(const uint8_t* w, int64_t row_bytes, const Activations& a, const float* bias,
                                        float* out) {
  static_assert(WIDE_PASS == 4);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  float cst[4] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    const __m512 d = _mm512_set1_ps(a.d[b]);
    const __m512i qx = both(a.x_y + b * QK), qy = both(a.x_y + b * QK + 16);
    __m128 f8;  // Q8_0 (an LM head's type): the four rows' fp16 factors converted in one instruction
    if constexpr (std::is_same_v<T, Q8_0>) {
      const uint8_t* at = w + b * T::BYTES;
      uint16_t h[4];
      for (int r = 0; r < 4; ++r) std::memcpy(&h[r], at + r * row_bytes, 2);
      f8 = _mm_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], 0, 0, 0, 0));
    }
    for (int p = 0; p < 2; ++p) {
      const BlockRow<T> s0{w + 2 * p * row_bytes}, s1{w + (2 * p + 1) * row_bytes};
      __m512i lo, hi;
      s0.vec512(s1, b, b, lo, hi);
      const Factors f0 = s0.factors(b), f1 = s1.factors(b);
      __m512 f;
      if constexpr (std::is_same_v<T, Q8_0>)
        f = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(2 * p), _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0,
                                                                                              1, 1, 1, 1, 1, 1, 1, 1)),
                                  _mm512_castps128_ps512(f8));
      else
        f = halves(f0.lo, f1.lo);
      acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(f, d), _mm512_cvtepi32_ps(fours(lo, hi, qx, qy)), acc[p]);
      if constexpr (BlockRow<T>::CONST) {
        cst[2 * p] = std::fma(f0.c, a.s[b], cst[2 * p]);
        cst[2 * p + 1] = std::fma(f1.c, a.s[b], cst[2 * p + 1]);
      }
    }
  }
  for (int p = 0; p < 2; ++p) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[p]);
    for (int t = 0; t < 2; ++t) {
      const float y = reduce(lanes + 8 * t, cst[2 * p + t]);
      out[2 * p + t] = bias ? y + bias[2 * p + t] : y;
    }
  }
}

// One weight row by the AVX-512 loop (wide_product's last rows).
template <class T>
void wide_one512(const uint8_t* w, const Activations& a, const float* bias, float* out) {
  dot_one_avx512(BlockRow<T>{w}, a, 0, out);
  if (bias) out[0] += bias[0];
}

template <class T>
at::Tensor wide_product(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const float* bias) {
  const int64_t K = x.size(1), row_bytes = (K / T::VALUES) * T::BYTES;
  TORCH_CHECK(K % T::VALUES == 0, "gguf_linear_wide: ", K, " inputs are not whole blocks of ", T::VALUES);
  TORCH_CHECK(blocks.numel() == N * row_bytes, "gguf_linear_wide: blocks hold ", blocks.numel(), " bytes, [", N, ", ",
              K, "] needs ", N * row_bytes);
  const Quantized q = quantize_rows(x.data_ptr<float>(), 1, K);
  Activations a{q.q.data(), q.d.data(), q.s.data(), K, K / QK};
  const bool v512 = isa(false) == AVX512;
  const std::vector<int16_t> x_y = v512 ? x_y_order(a.q, a.nb) : std::vector<int16_t>();
  a.x_y = x_y.data();
  at::Tensor y = at::empty({1, N}, x.options());
  float* out = y.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, N, 1024, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + WIDE_PASS <= n1; n += WIDE_PASS) {
      if (n + WIDE_AHEAD + WIDE_PASS <= n1)
        for (int64_t c = 0; c < WIDE_PASS * row_bytes; c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + (n + WIDE_AHEAD) * row_bytes + c), _MM_HINT_T0);
      if (v512)
        wide_rows512<T>(w + n * row_bytes, row_bytes, a, bias ? bias + n : nullptr, out + n);
      else
        wide_rows<T, WIDE_PASS>(w + n * row_bytes, row_bytes, a, bias ? bias + n : nullptr, out + n);
    }
    for (; n < n1; ++n)
      if (v512)
        wide_one512<T>(w + n * row_bytes, a, bias ? bias + n : nullptr, out + n);
      else
        wide_rows<T, 1>(w + n * row_bytes, row_bytes, a, bias ? bias + n : nullptr, out + n);
  });
  return y;
}
#endif

template <class T>
struct Wide {
  static std::optional<at::Tensor> run(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const float* bias) {
#ifdef TESSERA_X86
    if constexpr (!is_k<T>()) return wide_product<T>(x, blocks, N, bias);
#endif
    return std::nullopt;
  }
};

}  // namespace

at::Tensor tessera_cpu::gguf_dequantize(const at::Tensor& blocks, c10::string_view kind, int64_t N, int64_t K) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte, "gguf_dequantize takes uint8 CPU blocks");
  return by_kind<Dequantize>(std::string(kind), blocks.contiguous(), N, K);
}

at::Tensor tessera_cpu::gguf_linear_group(const at::Tensor& x_in, at::TensorList blocks, c10::string_view kind,
                                          at::IntArrayRef N, const std::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "gguf_linear takes fp32 CPU activations [M, K], got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK(blocks.size() == N.size() && !blocks.empty(), "gguf_linear_group: ", blocks.size(), " block matrices, ",
              N.size(), " output sizes");
  std::vector<at::Tensor> w;
  for (const at::Tensor& t : blocks) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte, "gguf_linear takes uint8 CPU blocks");
    w.push_back(t.contiguous());
  }
  TORCH_CHECK(!bias || bias->scalar_type() == at::kFloat, "gguf_linear: bias must be fp32");
  const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  return by_kind<Multiply>(std::string(kind), x_in.contiguous(), w, N, b, portable);
}

at::Tensor tessera_cpu::gguf_linear(const at::Tensor& x_in, const at::Tensor& blocks, c10::string_view kind,
                                    int64_t N, const std::optional<at::Tensor>& bias, bool portable) {
  return gguf_linear_group(x_in, {blocks}, kind, {N}, bias, portable);
}

// gguf_linear's product by the wide loop (above) where it applies: one row of fp32 x, AVX2, a sub-block type;
// elsewhere gguf_linear's own (the same bits either way).
at::Tensor tessera_cpu::gguf_linear_wide(const at::Tensor& x, const at::Tensor& blocks, c10::string_view kind,
                                         int64_t N, const std::optional<at::Tensor>& bias) {
  if (isa(false) >= AVX2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
      x.size(0) == 1 && blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
      (!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N))) {
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    std::optional<at::Tensor> y = by_kind<Wide>(std::string(kind), x.contiguous(), blocks.contiguous(), N,
                                                bias ? b.data_ptr<float>() : static_cast<const float*>(nullptr));
    if (y) return *y;
  }
  return gguf_linear(x, blocks, kind, N, bias, false);
}

// The widest loops the block products take from now on (block_dot.h's isa), at most `want` ("avx512", "avx2",
// "portable"; none: unchanged), as its name: tests and benches compare the paths in one process.
std::string tessera_cpu::block_isa(const std::optional<c10::string_view>& want) {
  static const char* const NAMES[] = {"portable", "avx2", "avx512"};
  if (want) {
    int cap = -1;
    for (int i = 0; i < 3; ++i)
      if (*want == c10::string_view(NAMES[i])) cap = i;
    TORCH_CHECK(cap >= 0, "block_isa: no path ", std::string(*want), "; paths: avx512, avx2, portable");
    isa_cap.store(cap, std::memory_order_relaxed);
  }
  return NAMES[isa(false)];
}
