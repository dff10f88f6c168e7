// Q4_K (GGUF type 12) and Q5_K (type 13): 256-weight super-blocks of 8 sub-blocks of 32,
// w = d * sc[j] * q - dmin * m[j], with 6-bit sub-block scales sc[j] and mins m[j];
// q in 0..15 (Q4_K) or 0..31 (Q5_K: Q4_K plus one high bit per weight).
//   source Q4_K, 144 B: fp16 d, fp16 dmin, scales[12], qs[128]
//   source Q5_K, 176 B: fp16 d, fp16 dmin, scales[12], qh[32], qs[128]
//   scales[12] packs sc[0..7], m[0..7] (ggml's get_scale_min_k4, see scale_min below);
//   qs: chunk c (64 weights), byte l: low nibble = weight 64c + l, high = weight 64c + 32 + l;
//   Q5_K: weight 64c + l takes bit 2c of qh[l] as bit 4, weight 64c + 32 + l bit 2c + 1.
// Panel super-block (16 rows x 256 columns; Q4_K 2368 B, Q5_K 2880 B):
//   HALF16 d | HALF16 dmin | u8 sc[8][16] | u8 m[8][16] | 8 x (N4 [| H1 for Q5_K])
// Dot with int8 activations, per 32-block j (the activations' own blocks: one activation
// quantization serves every format), d * sc[j] and dmin * m[j] being exact in fp32:
//   acc = fmaf((d * sc[j]) * dx, sum(q * x), acc);   acc = fmaf(-(dmin * m[j]), s, acc)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace qk45 {
using namespace layout;

constexpr int SC_AT = 2 * HALF16_BYTES, M_AT = SC_AT + 8 * PANEL, SUB_AT = M_AT + 8 * PANEL;  // 64, 192, 320

template <bool HIGH>  // HIGH: Q5_K's fifth bit (an H1 plane per sub-block)
struct Layout {
  static constexpr size_t SUB = N4_BYTES + (HIGH ? H1_BYTES : 0);
  static constexpr size_t PB = SUB_AT + 8 * SUB;
  static constexpr size_t SRC = HIGH ? 176 : 144;
  static const uint8_t* sub(const uint8_t* sb, int j) { return sb + SUB_AT + j * SUB; }
};

// ggml's get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 packed bytes
static inline void scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <bool HIGH>
static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  using L = Layout<HIGH>;
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* s = src + (size_t)sb * L::SRC;
    uint8_t* blk = panel + (size_t)sb * L::PB;
    put_half(blk, r, s);
    put_half(blk + HALF16_BYTES, r, s + 2);
    for (int j = 0; j < 8; j++) {
      int sc, m;
      scale_min(s + 4, j, sc, m);
      blk[SC_AT + j * PANEL + r] = (uint8_t)sc;
      blk[M_AT + j * PANEL + r] = (uint8_t)m;
    }
    const uint8_t* qh = s + 16;
    const uint8_t* qs = s + (HIGH ? 48 : 16);
    for (int c = 0; c < 4; c++)
      for (int l = 0; l < 32; l++) {
        const int lo = (qs[32 * c + l] & 15) | (HIGH ? ((qh[l] >> (2 * c)) & 1) << 4 : 0);
        const int hi = (qs[32 * c + l] >> 4) | (HIGH ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0);
        for (int half = 0; half < 2; half++) {
          uint8_t* sub = blk + SUB_AT + (2 * c + half) * L::SUB;
          const int q = half ? hi : lo;
          n4_put(sub, r, l, q);
          if (HIGH) h1_put(sub + N4_BYTES, r, l, q);
        }
      }
  }
}

template <bool HIGH>
static inline int q_at(const uint8_t* sub, int r, int k) {
  return n4_get(sub, r, k) | (HIGH ? h1_get(sub + N4_BYTES, r, k) : 0);
}

template <bool HIGH>
static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  using L = Layout<HIGH>;
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* blk = panel + (size_t)sb * L::PB;
    const float d = get_half(blk, r), dmin = get_half(blk + HALF16_BYTES, r);
    for (int j = 0; j < 8; j++) {
      const float dsc = d * (float)blk[SC_AT + j * PANEL + r], nm = -(dmin * (float)blk[M_AT + j * PANEL + r]);
      for (int k = 0; k < QK; k++) out[sb * QK_K + j * QK + k] = dsc * (float)q_at<HIGH>(L::sub(blk, j), r, k) + nm;
    }
  }
}

template <bool HIGH>
struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    using L = Layout<HIGH>;
    float acc = 0.0f;
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)(b / 8) * L::PB;
      const int j = b % 8;
      const int8_t* xq = act_q(a, t, b);
      int32_t isum = 0;
      for (int k = 0; k < QK; k++) isum += q_at<HIGH>(L::sub(blk, j), r, k) * xq[k];
      const float dsc = get_half(blk, r) * (float)blk[SC_AT + j * PANEL + r];
      const float nm = -(get_half(blk + HALF16_BYTES, r) * (float)blk[M_AT + j * PANEL + r]);
      acc = fmaf(dsc * a.d[(size_t)t * a.nb + b], (float)isum, acc);
      acc = fmaf(nm, a.s[(size_t)t * a.nb + b], acc);
    }
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
template <bool HIGH>
struct K {
  // TT tokens, both halves in one pass over the panel (each output's operations Ref::dot's, in its order)
  static constexpr int BOTH_TOKENS = 4;
  template <int TT>
  static inline void both(const uint8_t* pw, int cols, const QAct& a, int t0, __m256* acc) {
    using L = Layout<HIGH>;
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * L::PB;
      const __m256 d[2] = {half8(blk), half8(blk + 16)}, dmin[2] = {half8(blk + HALF16_BYTES), half8(blk + HALF16_BYTES + 16)};
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* sub = L::sub(blk, j);
        prefetch(sub + PREFETCH_AHEAD, HIGH ? 5 : 4);
        const int8_t* xq[TT];
        for (int t = 0; t < TT; t++) xq[t] = act_q(a, t0 + t, b);
        __m256i isum[TT][2];
        // int16 pair sums: 8 of <= 2 * 15 * 127 (Q4_K), 4 of <= 2 * 31 * 127 (Q5_K): exact
        dot_n4_both<HIGH ? 4 : 8, TT>(sub, xq, isum, HIGH ? sub + N4_BYTES : nullptr);
        __m256 dsc[2], nm[2];
        for (int h = 0; h < 2; h++) {
          dsc[h] = _mm256_mul_ps(d[h], u8x8(blk + SC_AT + j * PANEL + 8 * h));
          nm[h] = negate(_mm256_mul_ps(dmin[h], u8x8(blk + M_AT + j * PANEL + 8 * h)));
        }
        for (int t = 0; t < TT; t++) {
          const size_t row = (size_t)(t0 + t);
          const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]), sx = _mm256_set1_ps(a.s[row * a.nb + b]);
          for (int h = 0; h < 2; h++) {
            acc[2 * t + h] = _mm256_fmadd_ps(_mm256_mul_ps(dsc[h], dx), _mm256_cvtepi32_ps(isum[t][h]), acc[2 * t + h]);
            acc[2 * t + h] = _mm256_fmadd_ps(nm[h], sx, acc[2 * t + h]);
          }
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
template <bool HIGH>
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    using L = Layout<HIGH>;
    const ActRows<TT> x(a, t0);
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * L::PB;
      const __m512 d = half16(blk), dmin = half16(blk + HALF16_BYTES);
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* sub = L::sub(blk, j);
        prefetch(sub + PREFETCH_AHEAD, HIGH ? 5 : 4);
        const __m512 dsc = _mm512_mul_ps(d, u8x16(blk + SC_AT + j * PANEL));
        const __m512 nm = negate(_mm512_mul_ps(dmin, u8x16(blk + M_AT + j * PANEL)));
        __m512i w[8];
        n4_unpack(sub, w);
        if (HIGH) h1_add(sub + N4_BYTES, w);
        #pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
          const __m512i isum = dot_n4(w, x.q[t] + b * QK);
          const __m512 dx = _mm512_set1_ps(x.d[t][b]), sx = _mm512_set1_ps(x.s[t][b]);
          acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dsc, dx), _mm512_cvtepi32_ps(isum), acc[t]);
          acc[t] = _mm512_fmadd_ps(nm, sx, acc[t]);
        }
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace qk45

extern const Format format_q4_k = {"q4_k", 12, QK_K, qk45::Layout<false>::SRC, qk45::Layout<false>::PB,
                                   qk45::repack_row<false>, qk45::dequant_row<false>,
                                   {layout::matmul_ref<qk45::Ref<false>>, qk45::avx2::matmul<qk45::avx2::K<false>>,
                                    qk45::avx512::matmul<qk45::avx512::K<false>>}};
extern const Format format_q5_k = {"q5_k", 13, QK_K, qk45::Layout<true>::SRC, qk45::Layout<true>::PB,
                                   qk45::repack_row<true>, qk45::dequant_row<true>,
                                   {layout::matmul_ref<qk45::Ref<true>>, qk45::avx2::matmul<qk45::avx2::K<true>>,
                                    qk45::avx512::matmul<qk45::avx512::K<true>>}};

}  // namespace vs
