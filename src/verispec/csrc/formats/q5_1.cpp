// Q5_1 (GGUF type 7): 32-weight blocks of 5-bit weights, w = d * q + m, q in 0..31.
//   source, 24 B: fp16 d, fp16 m, qh (uint32 LE), qs[16]; q[j] = (qs[j] & 15) | (bit j of qh) << 4,
//   q[j + 16] = (qs[j] >> 4) | (bit j + 16 of qh) << 4   (j < 16)
// Panel block (16 rows x 32 columns, 384 B): HALF16 d | HALF16 m | N4 | H1 (layout.h).
// Dot with int8 activations (dx, s = dx * sum(x)), as Q4_1:  acc = fmaf(d * dx, sum(q * x), acc);
//                                                           acc = fmaf(m, s, acc)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace q5_1 {
using namespace layout;

constexpr int N4_AT = 2 * HALF16_BYTES, H1_AT = N4_AT + N4_BYTES;
constexpr size_t PB = H1_AT + H1_BYTES;  // 384

static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* s = src + (size_t)b * 24;
    uint8_t* blk = panel + (size_t)b * PB;
    uint32_t qh;
    std::memcpy(&qh, s + 4, 4);
    put_half(blk, r, s);
    put_half(blk + HALF16_BYTES, r, s + 2);
    for (int k = 0; k < QK; k++) {
      const int q = ((s[8 + k % 16] >> (4 * (k / 16))) & 15) | (int)((qh >> k) & 1) << 4;
      n4_put(blk + N4_AT, r, k, q);
      h1_put(blk + H1_AT, r, k, q);
    }
  }
}

static inline int q_at(const uint8_t* blk, int r, int k) { return n4_get(blk + N4_AT, r, k) | h1_get(blk + H1_AT, r, k); }

static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* blk = panel + (size_t)b * PB;
    const float d = get_half(blk, r), m = get_half(blk + HALF16_BYTES, r);
    for (int k = 0; k < QK; k++) out[b * QK + k] = d * (float)q_at(blk, r, k) + m;
  }
}

struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    float acc = 0.0f;
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * PB;
      const int8_t* xq = act_q(a, t, b);
      int32_t isum = 0;
      for (int k = 0; k < QK; k++) isum += q_at(blk, r, k) * xq[k];
      acc = fmaf(get_half(blk, r) * a.d[(size_t)t * a.nb + b], (float)isum, acc);
      acc = fmaf(get_half(blk + HALF16_BYTES, r), a.s[(size_t)t * a.nb + b], acc);
    }
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
struct K {
  template <int TT>
  static inline void half(const uint8_t* pw, int h, int cols, const QAct& a, int t0, __m256* acc) {
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * PB;
      if (h == 0) prefetch(blk + PREFETCH_AHEAD, 6);  // the block's every line, once per panel pass pair
      const __m256 dw = half8(blk + 16 * h), mw = half8(blk + HALF16_BYTES + 16 * h);
      __m256i w[8];
      n4_unpack(blk + N4_AT, h, w);
      h1_add(blk + H1_AT, h, w);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        const size_t row = (size_t)(t0 + t);
        // 4 pair sums of <= 2 * 31 * 127 per int16 lane stay below 32767: exact
        const __m256i isum = dot_groups<0, 8, 4>(w, act_q(a, (int)row, b));
        const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]), sx = _mm256_set1_ps(a.s[row * a.nb + b]);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum), acc[t]);
        acc[t] = _mm256_fmadd_ps(mw, sx, acc[t]);
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
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * PB;
      prefetch(blk + PREFETCH_AHEAD, 6);
      const __m512 dw = half16(blk), mw = half16(blk + HALF16_BYTES);
      __m512i w[8];
      n4_unpack(blk + N4_AT, w);
      h1_add(blk + H1_AT, w);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        const size_t row = (size_t)(t0 + t);
        const __m512i isum = dot_n4(w, act_q(a, (int)row, b));
        const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + b]), sx = _mm512_set1_ps(a.s[row * a.nb + b]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), acc[t]);
        acc[t] = _mm512_fmadd_ps(mw, sx, acc[t]);
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace q5_1

extern const Format format_q5_1 = {"q5_1", 7, QK, 24, q5_1::PB, q5_1::repack_row, q5_1::dequant_row,
                                   {layout::matmul_ref<q5_1::Ref>, q5_1::avx2::matmul<q5_1::avx2::K>,
                                    q5_1::avx512::matmul<q5_1::avx512::K>}};

}  // namespace vs
