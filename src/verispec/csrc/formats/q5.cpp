// Q5_0 (GGUF type 6) and Q5_1 (type 7): 32-weight blocks of 5-bit weights, q in 0..31,
//   Q5_0: w = d * (q - 16)   source, 22 B: fp16 d, qh (uint32 LE), qs[16]
//   Q5_1: w = d * q + m      source, 24 B: fp16 d, fp16 m, qh (uint32 LE), qs[16]
//   q[j] = (qs[j] & 15) | (bit j of qh) << 4, q[j + 16] = (qs[j] >> 4) | (bit j + 16 of qh) << 4   (j < 16)
// Panel block (16 rows x 32 columns): HALF16 d [| HALF16 m for Q5_1] | N4 | H1 (layout.h); 352 / 384 B.
// Dot with int8 activations (dx, s = dx * sum(x), qsum = sum(x)):
//   Q5_0: acc = fmaf(d * dx, sum(q * x) - 16 * qsum, acc)
//   Q5_1: acc = fmaf(d * dx, sum(q * x), acc);  acc = fmaf(m, s, acc)   (as Q4_1)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace q5 {
using namespace layout;

template <bool MIN>  // MIN: Q5_1's per-block minimum m (a second HALF16 plane); else Q5_0's offset 16
struct Layout {
  static constexpr size_t SRC = MIN ? 24 : 22;
  static constexpr int QH_AT = MIN ? 4 : 2;  // source offset of qh; qs follows it
  static constexpr int N4_AT = (MIN ? 2 : 1) * HALF16_BYTES, H1_AT = N4_AT + N4_BYTES;
  static constexpr size_t PB = H1_AT + H1_BYTES;  // 352 / 384
};

template <bool MIN>
static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  using L = Layout<MIN>;
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* s = src + (size_t)b * L::SRC;
    uint8_t* blk = panel + (size_t)b * L::PB;
    uint32_t qh;
    std::memcpy(&qh, s + L::QH_AT, 4);
    put_half(blk, r, s);
    if (MIN) put_half(blk + HALF16_BYTES, r, s + 2);
    const uint8_t* qs = s + L::QH_AT + 4;
    for (int k = 0; k < QK; k++) {
      const int q = ((qs[k % 16] >> (4 * (k / 16))) & 15) | (int)((qh >> k) & 1) << 4;
      n4_put(blk + L::N4_AT, r, k, q);
      h1_put(blk + L::H1_AT, r, k, q);
    }
  }
}

template <bool MIN>
static inline int q_at(const uint8_t* blk, int r, int k) {
  return n4_get(blk + Layout<MIN>::N4_AT, r, k) | h1_get(blk + Layout<MIN>::H1_AT, r, k);
}

template <bool MIN>
static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* blk = panel + (size_t)b * Layout<MIN>::PB;
    const float d = get_half(blk, r);
    if (MIN) {
      const float m = get_half(blk + HALF16_BYTES, r);
      for (int k = 0; k < QK; k++) out[b * QK + k] = d * (float)q_at<MIN>(blk, r, k) + m;
    } else {
      for (int k = 0; k < QK; k++) out[b * QK + k] = d * (float)(q_at<MIN>(blk, r, k) - 16);
    }
  }
}

template <bool MIN>
struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    float acc = 0.0f;
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * Layout<MIN>::PB;
      const int8_t* xq = act_q(a, t, b);
      int32_t isum = 0;
      for (int k = 0; k < QK; k++) isum += q_at<MIN>(blk, r, k) * xq[k];
      if (!MIN) isum -= 16 * a.qsum[(size_t)t * a.nb + b];
      acc = fmaf(get_half(blk, r) * a.d[(size_t)t * a.nb + b], (float)isum, acc);
      if (MIN) acc = fmaf(get_half(blk + HALF16_BYTES, r), a.s[(size_t)t * a.nb + b], acc);
    }
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
template <bool MIN>
struct K {
  // TT tokens, both halves in one pass over the panel (each output's operations Ref::dot's, in its order)
  static constexpr int BOTH_TOKENS = 4;
  template <int TT>
  static inline void both(const uint8_t* pw, int cols, const QAct& a, int t0, __m256* acc) {
    using L = Layout<MIN>;
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * L::PB;
      prefetch(blk + PREFETCH_AHEAD, 6);
      const int8_t* xq[TT];
      for (int t = 0; t < TT; t++) xq[t] = act_q(a, t0 + t, b);
      __m256i isum[TT][2];
      // 4 pair sums of <= 2 * 31 * 127 per int16 lane stay below 32767: exact
      dot_n4_both<4, TT>(blk + L::N4_AT, xq, isum, blk + L::H1_AT);
      const __m256 dw[2] = {half8(blk), half8(blk + 16)};
      for (int t = 0; t < TT; t++) {
        const size_t row = (size_t)(t0 + t);
        const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]);
        for (int h = 0; h < 2; h++) {
          __m256i i = isum[t][h];
          if (!MIN) i = _mm256_sub_epi32(i, _mm256_set1_epi32(16 * a.qsum[row * a.nb + b]));
          acc[2 * t + h] = _mm256_fmadd_ps(_mm256_mul_ps(dw[h], dx), _mm256_cvtepi32_ps(i), acc[2 * t + h]);
          if (MIN) acc[2 * t + h] = _mm256_fmadd_ps(half8(blk + HALF16_BYTES + 16 * h), _mm256_set1_ps(a.s[row * a.nb + b]), acc[2 * t + h]);
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
template <bool MIN>
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    using L = Layout<MIN>;
    const ActRows<TT> x(a, t0);
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * L::PB;
      prefetch(blk + PREFETCH_AHEAD, 6);
      const __m512 dw = half16(blk), mw = MIN ? half16(blk + HALF16_BYTES) : _mm512_setzero_ps();
      __m512i w[8];
      n4_unpack(blk + L::N4_AT, w);
      h1_add(blk + L::H1_AT, w);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        __m512i isum = dot_n4(w, x.q[t] + b * QK);
        if (!MIN) isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_set1_epi32(x.qsum[t][b]), 4));  // 16 sum(x)
        const __m512 dx = _mm512_set1_ps(x.d[t][b]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), acc[t]);
        if (MIN) acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[t][b]), acc[t]);
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace q5

extern const Format format_q5_0 = {"q5_0", 6, QK, q5::Layout<false>::SRC, q5::Layout<false>::PB, q5::repack_row<false>,
                                   q5::dequant_row<false>,
                                   {layout::matmul_ref<q5::Ref<false>>, q5::avx2::matmul<q5::avx2::K<false>>,
                                    q5::avx512::matmul<q5::avx512::K<false>>}};
extern const Format format_q5_1 = {"q5_1", 7, QK, q5::Layout<true>::SRC, q5::Layout<true>::PB, q5::repack_row<true>,
                                   q5::dequant_row<true>,
                                   {layout::matmul_ref<q5::Ref<true>>, q5::avx2::matmul<q5::avx2::K<true>>,
                                    q5::avx512::matmul<q5::avx512::K<true>>}};

}  // namespace vs
