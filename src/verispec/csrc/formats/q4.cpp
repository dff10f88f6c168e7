// Q4_0 (GGUF type 2) and Q4_1 (type 3): 32-weight blocks of 4-bit weights, w = d * q + m.
//   source Q4_0, 18 B: fp16 d, qs[16]; w = d * (q - 8)     (repacked with m = -8 d, exact)
//   source Q4_1, 20 B: fp16 d, fp16 m, qs[16]; w = d * q + m
//   qs[j] holds q[j] in its low nibble and q[j + 16] in its high nibble.
// Panel block (16 rows x 32 columns, 320 B): HALF16 d | HALF16 m | N4 (layout.h).
// quantize_row_q4_0 writes source Q4_0 blocks from fp32 (ggml's quantize_row_q4_0_ref rule):
// a draft model requantized at load to stream fewer bytes (models/cpu.py requantize).
// Dot with int8 activations (dx, s = dx * sum(x)):  acc = fmaf(d * dx, sum(q * x), acc);
//                                                   acc = fmaf(m, s, acc)
#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "layout.h"

namespace vs {
namespace q4 {
using namespace layout;

constexpr size_t PB = 2 * HALF16_BYTES + N4_BYTES;  // 320

static void put_nibbles(uint8_t* blk, int r, const uint8_t* qs) {
  for (int j = 0; j < 16; j++) {
    n4_put(blk + 64, r, j, qs[j] & 15);
    n4_put(blk + 64, r, j + 16, qs[j] >> 4);
  }
}

static void repack_q4_0(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* s = src + (size_t)b * 18;
    uint8_t* blk = panel + (size_t)b * PB;
    const uint16_t d = get_u16(s);
    // m = -8 d in fp16: flip the sign and add 3 to the exponent (exact for normal d)
    const int e = (d >> 10) & 0x1F;
    if ((d & 0x7FFF) && (e == 0 || e > 27)) throw std::runtime_error("Q4_0 scale out of the supported fp16 range");
    const uint16_t md = (d & 0x7FFF) ? (uint16_t)((d ^ 0x8000) + (3 << 10)) : 0;
    put_half(blk, r, s);
    put_half(blk + HALF16_BYTES, r, (const uint8_t*)&md);
    put_nibbles(blk, r, s + 2);
  }
}

static void repack_q4_1(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* s = src + (size_t)b * 20;
    uint8_t* blk = panel + (size_t)b * PB;
    put_half(blk, r, s);
    put_half(blk + HALF16_BYTES, r, s + 2);
    put_nibbles(blk, r, s + 4);
  }
}

}  // namespace q4

// fp32 [cols] -> Q4_0 blocks: d = max / -8 with max the value of largest magnitude,
// q = min(15, (int)(x / d + 8.5)). A scale below fp16's normal range (a block of weights all
// under ~5e-4) is written as +0, so the repack's range check holds; no scale can exceed it.
void quantize_row_q4_0(const float* x, int cols, uint8_t* out) {
  for (int b = 0; b < cols / QK; b++) {
    const float* xb = x + (size_t)b * QK;
    uint8_t* o = out + (size_t)b * 18;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK; j++)
      if (amax < std::fabs(xb[j])) amax = std::fabs(xb[j]), max = xb[j];
    float d = max / -8.0f;
    uint16_t dh = float_to_half(d);
    if (((dh >> 10) & 0x1F) == 0 && (dh & 0x3FF)) d = 0.0f, dh = 0;  // subnormal in fp16 (a zero keeps its sign)
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    std::memcpy(o, &dh, 2);
    for (int j = 0; j < QK / 2; j++) {
      const int q0 = std::min(15, (int)(int8_t)(xb[j] * id + 8.5f));
      const int q1 = std::min(15, (int)(int8_t)(xb[j + QK / 2] * id + 8.5f));
      o[2 + j] = (uint8_t)(q0 | (q1 << 4));
    }
  }
}

namespace q4 {

static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* blk = panel + (size_t)b * PB;
    const float d = get_half(blk, r), m = get_half(blk + HALF16_BYTES, r);
    for (int k = 0; k < QK; k++) out[b * QK + k] = d * (float)n4_get(blk + 64, r, k) + m;
  }
}

struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    float acc = 0.0f;
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * PB;
      const int8_t* xq = act_q(a, t, b);
      int32_t isum = 0;
      for (int k = 0; k < QK; k++) isum += n4_get(blk + 64, r, k) * xq[k];
      const float dw = get_half(blk, r), mw = get_half(blk + HALF16_BYTES, r);
      acc = fmaf(dw * a.d[(size_t)t * a.nb + b], (float)isum, acc);
      acc = fmaf(mw, a.s[(size_t)t * a.nb + b], acc);
    }
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
struct K {
  // TT tokens, both halves in one pass over the panel (each output's operations Ref::dot's, in its order)
  static constexpr int BOTH_TOKENS = 4;
  template <int TT>
  static inline void both(const uint8_t* pw, int cols, const QAct& a, int t0, __m256* acc) {
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * PB;
      prefetch(blk + PREFETCH_AHEAD, 5);
      const int8_t* xq[TT];
      for (int t = 0; t < TT; t++) xq[t] = act_q(a, t0 + t, b);
      __m256i isum[TT][2];
      dot_n4_both<8, TT>(blk + 64, xq, isum);
      const __m256 dw[2] = {half8(blk), half8(blk + 16)}, mw[2] = {half8(blk + HALF16_BYTES), half8(blk + HALF16_BYTES + 16)};
      for (int t = 0; t < TT; t++) {
        const size_t row = (size_t)(t0 + t);
        const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]), sx = _mm256_set1_ps(a.s[row * a.nb + b]);
        for (int h = 0; h < 2; h++) {
          acc[2 * t + h] = _mm256_fmadd_ps(_mm256_mul_ps(dw[h], dx), _mm256_cvtepi32_ps(isum[t][h]), acc[2 * t + h]);
          acc[2 * t + h] = _mm256_fmadd_ps(mw[h], sx, acc[2 * t + h]);
        }
      }
    }
  }
};
}  // namespace avx2
VS_END_TARGET

VS_BEGIN_AVX512
namespace avx512 {
#include "simd_avx512.h"
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    const ActRows<TT> x(a, t0);
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * PB;
      prefetch(blk + PREFETCH_AHEAD, 5);
      const __m512 dw = half16(blk), mw = half16(blk + HALF16_BYTES);
      __m512i w[8];
      n4_unpack(blk + 64, w);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        const __m512i isum = dot_n4(w, x.q[t] + b * QK);
        const __m512 dx = _mm512_set1_ps(x.d[t][b]), sx = _mm512_set1_ps(x.s[t][b]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), acc[t]);
        acc[t] = _mm512_fmadd_ps(mw, sx, acc[t]);
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace q4

extern const Format format_q4_0 = {"q4_0", 2, QK, 18, q4::PB, q4::repack_q4_0, q4::dequant_row,
                                   {layout::matmul_ref<q4::Ref>, q4::avx2::matmul<q4::avx2::K>, q4::avx512::matmul<q4::avx512::K>},
                                   quantize_row_q4_0};
extern const Format format_q4_1 = {"q4_1", 3, QK, 20, q4::PB, q4::repack_q4_1, q4::dequant_row,
                                   {layout::matmul_ref<q4::Ref>, q4::avx2::matmul<q4::avx2::K>, q4::avx512::matmul<q4::avx512::K>}};

}  // namespace vs
