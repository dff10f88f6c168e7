// Q3_K (GGUF type 11): 256-weight super-blocks of 16 sub-blocks of 16 weights,
// w = d * sc[j] * (q - 4), q in 0..7, 6-bit signed sub-block scales sc[j] in -32..31.
//   source, 110 B: hmask[32], qs[64], scales[12], fp16 d (last).
//   Weight k = 128h + 32s + l: low 2 bits (qs[32h + l] >> 2s) & 3, bit 2 = bit k / 32 of hmask[l]
//   (a set bit means no -4 offset: q - 4 = low - 4 * (1 - bit)).
//   scales[12]: sc[j] = (low 4 bits | 2 high bits << 4) - 32; low bits: byte j & 15 (j < 8),
//   byte j - 8 >> 4 (j >= 8); high bits: byte 8 + j % 4 >> 2 (j / 4) & 3.
// Panel super-block (16 rows x 256 columns, 1824 B: 114 B per row):
//   HALF16 d | i8 sc[16][16] | 8 x (N2 | H1)   (H1 holds bit 2 of q in its bit-4 place, layout.h)
// Dot with int8 activations, per 32-block (two sub-blocks a, b: columns 0..15 and 16..31),
// the integer part exact (|isum| <= 2 * 32 * 16 * (7 + 4) * 127 < 2^24):
//   isum = sc[a] * (sum_lo(q * x) - 4 * sum_lo(x)) + sc[b] * (sum_hi(q * x) - 4 * sum_hi(x))
//   acc = fmaf(d * dx, isum, acc)
// quantize_row_q3_k writes source Q3_K blocks from fp32 (a draft requantized at load,
// models/cpu_weights.py requantize), by ggml's first-pass rule without its error search
// (make_q3_quants / make_qx_quants with rmse off): each sub-block's step s = max / -4 (max:
// its value of largest magnitude, which lands on code -4), d = smax / -32 over the 16 steps,
// sc = round(s / d) in -32..31, q = round(x / (d * sc)) in -4..3.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace q3_k {
using namespace layout;

constexpr int SC_AT = HALF16_BYTES, SUB_AT = SC_AT + 16 * PANEL;  // 32, 288
constexpr size_t SUB = N2_BYTES + H1_BYTES;                       // 192
constexpr size_t PB = SUB_AT + 8 * SUB;                           // 1824
constexpr size_t SRC = 110;

static inline const uint8_t* sub(const uint8_t* sb, int j) { return sb + SUB_AT + j * SUB; }

// the value of largest magnitude of x[0..n) (the first on ties), 0 for none
static inline float signed_max(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; i++)
    if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), max = x[i];
  return max;
}

}  // namespace q3_k

void quantize_row_q3_k(const float* x, int cols, uint8_t* out) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const float* xb = x + (size_t)sb * QK_K;
    uint8_t* o = out + (size_t)sb * q3_k::SRC;
    std::memset(o, 0, q3_k::SRC);
    float step[16];
    for (int j = 0; j < 16; j++) step[j] = q3_k::signed_max(xb + 16 * j, 16) / -4.0f;
    const uint16_t dh = float_to_half(q3_k::signed_max(step, 16) / -32.0f);
    std::memcpy(o + 108, &dh, 2);
    const float d = half_to_float(dh), id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 16; j++) {
      const int sc = std::clamp((int)std::nearbyint(step[j] * id), -32, 31), code = sc + 32;
      o[96 + j % 8] |= (uint8_t)((code & 15) << (4 * (j / 8)));
      o[104 + j % 4] |= (uint8_t)((code >> 4) << (2 * (j / 4)));
      const float dl = d * (float)sc, il = dl != 0.0f ? 1.0f / dl : 0.0f;
      for (int i = 0; i < 16; i++) {
        const int k = 16 * j + i, l = k % 32, q = std::clamp((int)std::nearbyint(xb[k] * il), -4, 3) + 4;
        o[32 + 32 * (k / 128) + l] |= (uint8_t)((q & 3) << (2 * ((k % 128) / 32)));
        o[l] |= (uint8_t)((q >> 2) << (k / 32));
      }
    }
  }
}

namespace q3_k {

static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* s = src + (size_t)sb * SRC;
    const uint8_t* hmask = s;
    const uint8_t* qs = s + 32;
    const uint8_t* scales = s + 96;
    uint8_t* blk = panel + (size_t)sb * PB;
    put_half(blk, r, s + 108);
    for (int j = 0; j < 16; j++) {
      const int low = j < 8 ? scales[j] & 15 : scales[j - 8] >> 4, high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
      blk[SC_AT + j * PANEL + r] = (uint8_t)(int8_t)((low | high << 4) - 32);
    }
    for (int k = 0; k < QK_K; k++) {
      const int l = k % 32;
      const int q = ((qs[32 * (k / 128) + l] >> (2 * ((k % 128) / 32))) & 3) | ((hmask[l] >> (k / 32)) & 1) << 2;
      uint8_t* blk32 = blk + SUB_AT + (k / QK) * SUB;
      n2_put(blk32, r, l, q);
      h1_put(blk32 + N2_BYTES, r, l, q << 2);
    }
  }
}

static inline int q_at(const uint8_t* blk32, int r, int k) {
  return n2_get(blk32, r, k) | h1_get(blk32 + N2_BYTES, r, k) >> 2;
}
static inline int scale(const uint8_t* blk, int j, int r) { return (int)(int8_t)blk[SC_AT + j * PANEL + r]; }

static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* blk = panel + (size_t)sb * PB;
    const float d = get_half(blk, r);
    for (int k = 0; k < QK_K; k++)
      out[sb * QK_K + k] = (d * (float)scale(blk, k / 16, r)) * (float)(q_at(sub(blk, k / QK), r, k % QK) - 4);
  }
}

struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    float acc = 0.0f;
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)(b / 8) * PB;
      const int j = b % 8;
      const int8_t* xq = act_q(a, t, b);
      int32_t lo = 0, hi = 0;
      for (int k = 0; k < 16; k++) lo += q_at(sub(blk, j), r, k) * xq[k];
      for (int k = 16; k < QK; k++) hi += q_at(sub(blk, j), r, k) * xq[k];
      const int32_t* xs = a.qsum16 + (size_t)t * 2 * a.nb + 2 * b;
      const int32_t isum = scale(blk, 2 * j, r) * (lo - 4 * xs[0]) + scale(blk, 2 * j + 1, r) * (hi - 4 * xs[1]);
      acc = fmaf(get_half(blk, r) * a.d[(size_t)t * a.nb + b], (float)isum, acc);
    }
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
// H1 plane, half h: bit g of byte 4r + t is bit 2 of column 4g + t; moved to bit 2 of w[g]
static inline void bit2_add(const uint8_t* h1, int h, __m256i* w) {
  const __m256i b2 = _mm256_set1_epi8(0x04), x = _mm256_loadu_si256((const __m256i*)(h1 + 32 * h));
  w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(x, 2), b2));
  w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(x, 1), b2));
  w[2] = _mm256_or_si256(w[2], _mm256_and_si256(x, b2));
  w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(x, 1), b2));
  w[4] = _mm256_or_si256(w[4], _mm256_and_si256(_mm256_srli_epi16(x, 2), b2));
  w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(x, 3), b2));
  w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(x, 4), b2));
  w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(x, 5), b2));
}
struct K {
  template <int TT>
  static inline void half(const uint8_t* pw, int h, int cols, const QAct& a, int t0, __m256* acc) {
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * PB;
      const __m256 d = half8(blk + 16 * h);
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* blk32 = sub(blk, j);
        if (h == 0) prefetch(blk32 + PREFETCH_AHEAD, 3);  // the block's every line, once per panel pass pair
        const __m256i sa = i8x8_epi32(blk + SC_AT + 2 * j * PANEL + 8 * h);
        const __m256i sb2 = i8x8_epi32(blk + SC_AT + (2 * j + 1) * PANEL + 8 * h);
        __m256i w[8];
        n2_unpack(blk32, h, w);
        bit2_add(blk32 + N2_BYTES, h, w);
        #pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
          const size_t row = (size_t)(t0 + t);
          const int8_t* xq = act_q(a, (int)row, b);
          // int16 pair sums: 4 of <= 2 * 7 * 127 per lane: exact
          const __m256i lo = dot_groups<0, 4, 4>(w, xq), hi = dot_groups<4, 4, 4>(w, xq);
          const int32_t* xs = a.qsum16 + row * 2 * a.nb + 2 * b;
          const __m256i isum =
              _mm256_add_epi32(_mm256_mullo_epi32(sa, _mm256_sub_epi32(lo, _mm256_set1_epi32(4 * xs[0]))),
                               _mm256_mullo_epi32(sb2, _mm256_sub_epi32(hi, _mm256_set1_epi32(4 * xs[1]))));
          const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]);
          acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum), acc[t]);
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
// H1 plane: bit g of byte 4r + t is bit 2 of column 4g + t; moved to bit 2 of w[g]
static inline void bit2_add(const uint8_t* h1, __m512i* w) {
  const __m512i b2 = _mm512_set1_epi8(0x04), x = _mm512_loadu_si512((const void*)h1);
  w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(x, 2), b2));
  w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(x, 1), b2));
  w[2] = _mm512_or_si512(w[2], _mm512_and_si512(x, b2));
  w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_srli_epi16(x, 1), b2));
  w[4] = _mm512_or_si512(w[4], _mm512_and_si512(_mm512_srli_epi16(x, 2), b2));
  w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(x, 3), b2));
  w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(x, 4), b2));
  w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(x, 5), b2));
}
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * PB;
      const __m512 d = half16(blk);
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* blk32 = sub(blk, j);
        prefetch(blk32 + PREFETCH_AHEAD, 3);
        const __m512i sa = i8x16_epi32(blk + SC_AT + 2 * j * PANEL), sb2 = i8x16_epi32(blk + SC_AT + (2 * j + 1) * PANEL);
        __m512i w[8];
        n2_unpack(blk32, w);
        bit2_add(blk32 + N2_BYTES, w);
        #pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
          const size_t row = (size_t)(t0 + t);
          __m512i lo, hi;
          dot_n4_halves(w, act_q(a, (int)row, b), lo, hi);
          const int32_t* xs = a.qsum16 + row * 2 * a.nb + 2 * b;
          const __m512i isum =
              _mm512_add_epi32(_mm512_mullo_epi32(sa, _mm512_sub_epi32(lo, _mm512_set1_epi32(4 * xs[0]))),
                               _mm512_mullo_epi32(sb2, _mm512_sub_epi32(hi, _mm512_set1_epi32(4 * xs[1]))));
          const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + b]);
          acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc[t]);
        }
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace q3_k

extern const Format format_q3_k = {"q3_k", 11, QK_K, q3_k::SRC, q3_k::PB, q3_k::repack_row, q3_k::dequant_row,
                                   {layout::matmul_ref<q3_k::Ref>, q3_k::avx2::matmul<q3_k::avx2::K>,
                                    q3_k::avx512::matmul<q3_k::avx512::K>},
                                   quantize_row_q3_k};

}  // namespace vs
