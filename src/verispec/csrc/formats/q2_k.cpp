// Q2_K (GGUF type 10): 256-weight super-blocks of 16 sub-blocks of 16 weights,
// w = d * sc[j] * q - dmin * m[j], q in 0..3, 4-bit sub-block scales sc[j] and mins m[j].
//   source, 84 B: scales[16] (low nibble sc[j], high nibble m[j]), qs[64], fp16 d, fp16 dmin.
//   Half h (128 weights) uses qs[32h..32h+31]: weight 128h + 32s + l = (qs[32h + l] >> 2s) & 3.
// Panel super-block (16 rows x 256 columns, 1344 B: the source's 84 B per row):
//   HALF16 d | HALF16 dmin | u8 scm[16][16] (the source's scale bytes) | 8 x N2 (layout.h)
// Dot with int8 activations, per 32-block (two sub-blocks a, b: columns 0..15 and 16..31),
// the integer parts exact (|isum| <= 2 * 15 * 16 * 3 * 127, |msum| <= 2 * 15 * 16 * 127):
//   isum = sc[a] * sum_lo(q * x) + sc[b] * sum_hi(q * x);   msum = m[a] * sum_lo(x) + m[b] * sum_hi(x)
//   acc = fmaf(d * dx, isum, acc);   acc = fmaf(-(dmin * dx), msum, acc)
// quantize_row_q2_k writes source Q2_K blocks from fp32 (a draft requantized at load,
// models/cpu_weights.py requantize), by a min/max rule without ggml's error search
// (make_qkx2_quants): each sub-block's min m = -min(x, 0) and step s = (max(x) + m) / 3,
// d = max(s) / 15, dmin = max(m) / 15, sc = round(s / d), mc = round(m / dmin) in 0..15,
// q = round((x + dmin * mc) / (d * sc)) in 0..3.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace q2_k {
using namespace layout;

constexpr int SCM_AT = 2 * HALF16_BYTES, SUB_AT = SCM_AT + 16 * PANEL;  // 64, 320
constexpr size_t PB = SUB_AT + 8 * N2_BYTES;                             // 1344
constexpr size_t SRC = 84;

}  // namespace q2_k

void quantize_row_q2_k(const float* x, int cols, uint8_t* out) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const float* xb = x + (size_t)sb * QK_K;
    uint8_t* o = out + (size_t)sb * q2_k::SRC;
    std::memset(o, 0, q2_k::SRC);
    float step[16], mins[16], smax = 0.0f, mmax = 0.0f;
    for (int j = 0; j < 16; j++) {
      float lo = 0.0f, hi = xb[16 * j];
      for (int i = 0; i < 16; i++) lo = std::min(lo, xb[16 * j + i]), hi = std::max(hi, xb[16 * j + i]);
      mins[j] = -lo;
      step[j] = (hi - lo) / 3.0f;
      smax = std::max(smax, step[j]);
      mmax = std::max(mmax, mins[j]);
    }
    const uint16_t dh = float_to_half(smax / 15.0f), mh = float_to_half(mmax / 15.0f);
    std::memcpy(o + 80, &dh, 2);
    std::memcpy(o + 82, &mh, 2);
    const float d = half_to_float(dh), dmin = half_to_float(mh);
    const float id = d != 0.0f ? 1.0f / d : 0.0f, imin = dmin != 0.0f ? 1.0f / dmin : 0.0f;
    for (int j = 0; j < 16; j++) {
      const int sc = std::clamp((int)std::nearbyint(step[j] * id), 0, 15);
      const int mc = std::clamp((int)std::nearbyint(mins[j] * imin), 0, 15);
      o[j] = (uint8_t)(sc | mc << 4);
      const float dl = d * (float)sc, ml = dmin * (float)mc, il = dl != 0.0f ? 1.0f / dl : 0.0f;
      for (int i = 0; i < 16; i++) {
        const int k = 16 * j + i, q = std::clamp((int)std::nearbyint((xb[k] + ml) * il), 0, 3);
        o[16 + 32 * (k / 128) + k % 32] |= (uint8_t)(q << (2 * ((k % 128) / 32)));
      }
    }
  }
}

namespace q2_k {

static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* s = src + (size_t)sb * SRC;
    uint8_t* blk = panel + (size_t)sb * PB;
    put_half(blk, r, s + 80);
    put_half(blk + HALF16_BYTES, r, s + 82);
    for (int j = 0; j < 16; j++) blk[SCM_AT + j * PANEL + r] = s[j];
    for (int k = 0; k < QK_K; k++) {
      const int q = (s[16 + 32 * (k / 128) + k % 32] >> (2 * ((k % 128) / 32))) & 3;
      n2_put(blk + SUB_AT + (k / QK) * N2_BYTES, r, k % QK, q);
    }
  }
}

static inline int q_at(const uint8_t* blk, int b, int r, int k) { return n2_get(blk + SUB_AT + b * N2_BYTES, r, k); }
static inline int sc(const uint8_t* blk, int j, int r) { return blk[SCM_AT + j * PANEL + r] & 15; }
static inline int mn(const uint8_t* blk, int j, int r) { return blk[SCM_AT + j * PANEL + r] >> 4; }

static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* blk = panel + (size_t)sb * PB;
    const float d = get_half(blk, r), dmin = get_half(blk + HALF16_BYTES, r);
    for (int k = 0; k < QK_K; k++) {
      const float dl = d * (float)sc(blk, k / 16, r), ml = dmin * (float)mn(blk, k / 16, r);
      out[sb * QK_K + k] = dl * (float)q_at(blk, k / QK, r, k % QK) - ml;
    }
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
      for (int k = 0; k < 16; k++) lo += q_at(blk, j, r, k) * xq[k];
      for (int k = 16; k < QK; k++) hi += q_at(blk, j, r, k) * xq[k];
      const int32_t* xs = a.qsum16 + (size_t)t * 2 * a.nb + 2 * b;
      const int32_t isum = sc(blk, 2 * j, r) * lo + sc(blk, 2 * j + 1, r) * hi;
      const int32_t msum = mn(blk, 2 * j, r) * xs[0] + mn(blk, 2 * j + 1, r) * xs[1];
      const float dx = a.d[(size_t)t * a.nb + b];
      acc = fmaf(get_half(blk, r) * dx, (float)isum, acc);
      acc = fmaf(-(get_half(blk + HALF16_BYTES, r) * dx), (float)msum, acc);
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
    const __m256i m4 = _mm256_set1_epi32(15);
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * PB;
      const __m256 d = half8(blk + 16 * h), dmin = half8(blk + HALF16_BYTES + 16 * h);
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* n2 = blk + SUB_AT + j * N2_BYTES;
        if (h == 0) prefetch(n2 + PREFETCH_AHEAD, 2);  // the block's every line, once per panel pass pair
        const __m256i ra = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(blk + SCM_AT + 2 * j * PANEL + 8 * h)));
        const __m256i rb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(blk + SCM_AT + (2 * j + 1) * PANEL + 8 * h)));
        const __m256i sa = _mm256_and_si256(ra, m4), sb2 = _mm256_and_si256(rb, m4);
        const __m256i ma = _mm256_srli_epi32(ra, 4), mb = _mm256_srli_epi32(rb, 4);
        __m256i w[8];
        n2_unpack(n2, h, w);
        #pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
          const size_t row = (size_t)(t0 + t);
          const int8_t* xq = act_q(a, (int)row, b);
          // int16 pair sums: 4 of <= 2 * 3 * 127 per lane: exact
          const __m256i lo = dot_groups<0, 4, 4>(w, xq), hi = dot_groups<4, 4, 4>(w, xq);
          const int32_t* xs = a.qsum16 + row * 2 * a.nb + 2 * b;
          const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(sa, lo), _mm256_mullo_epi32(sb2, hi));
          const __m256i msum = _mm256_add_epi32(_mm256_mullo_epi32(ma, _mm256_set1_epi32(xs[0])),
                                                _mm256_mullo_epi32(mb, _mm256_set1_epi32(xs[1])));
          const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]);
          acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum), acc[t]);
          acc[t] = _mm256_fmadd_ps(negate(_mm256_mul_ps(dmin, dx)), _mm256_cvtepi32_ps(msum), acc[t]);
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
    const __m512i m4 = _mm512_set1_epi32(15);
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * PB;
      const __m512 d = half16(blk), dmin = half16(blk + HALF16_BYTES);
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* n2 = blk + SUB_AT + j * N2_BYTES;
        prefetch(n2 + PREFETCH_AHEAD, 2);
        const __m512i ra = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + SCM_AT + 2 * j * PANEL)));
        const __m512i rb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + SCM_AT + (2 * j + 1) * PANEL)));
        const __m512i sa = _mm512_and_si512(ra, m4), sb2 = _mm512_and_si512(rb, m4);
        const __m512i ma = _mm512_srli_epi32(ra, 4), mb = _mm512_srli_epi32(rb, 4);
        __m512i w[8];
        n2_unpack(n2, w);
        #pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
          const size_t row = (size_t)(t0 + t);
          __m512i lo, hi;
          dot_n4_halves(w, act_q(a, (int)row, b), lo, hi);
          const int32_t* xs = a.qsum16 + row * 2 * a.nb + 2 * b;
          const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(sa, lo), _mm512_mullo_epi32(sb2, hi));
          const __m512i msum = _mm512_add_epi32(_mm512_mullo_epi32(ma, _mm512_set1_epi32(xs[0])),
                                                _mm512_mullo_epi32(mb, _mm512_set1_epi32(xs[1])));
          const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + b]);
          acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc[t]);
          acc[t] = _mm512_fmadd_ps(negate(_mm512_mul_ps(dmin, dx)), _mm512_cvtepi32_ps(msum), acc[t]);
        }
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace q2_k

extern const Format format_q2_k = {"q2_k", 10, QK_K, q2_k::SRC, q2_k::PB, q2_k::repack_row, q2_k::dequant_row,
                                   {layout::matmul_ref<q2_k::Ref>, q2_k::avx2::matmul<q2_k::avx2::K>,
                                    q2_k::avx512::matmul<q2_k::avx512::K>},
                                   quantize_row_q2_k};

}  // namespace vs
