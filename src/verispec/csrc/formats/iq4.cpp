// IQ4_NL (GGUF type 20) and IQ4_XS (type 23): 4-bit indices into ggml's non-linear table
// KVALUES (int8, kvalues_iq4nl in ggml-common.h), w = d * KVALUES[q].
//   source IQ4_NL, 18 B per 32: fp16 d, qs[16]; qs[l] holds q[l] (low nibble) and q[l + 16].
//   source IQ4_XS, 136 B per 256: fp16 d, scales_h (uint16 LE), scales_l[4], qs[128]; sub-block
//   j of 32 has w = d * sc[j] * KVALUES[q], sc[j] = ((scales_l[j / 2] >> 4 (j % 2)) & 15 |
//   ((scales_h >> 2j) & 3) << 4) - 32, and qs[16j..16j + 15] as one IQ4_NL block's qs.
// Panel block (16 rows): IQ4_NL per 32 columns, 288 B: HALF16 d | N4 (the indices);
//   IQ4_XS per 256 columns, 2208 B: HALF16 d | i8 sc[8][16] | 8 x N4.
// Dot with int8 activations, the table values looked up in registers (a byte shuffle):
//   isum = sum(KVALUES[q] * x)   (|isum| <= 32 * 127 * 127 < 2^24, exact)
//   acc = fmaf((d * sc) * dx, isum, acc)   (IQ4_NL: sc = 1; d * sc is exact in fp32)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace iq4 {
using namespace layout;

alignas(16) constexpr int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

template <bool XS>  // XS: IQ4_XS's super-blocks of 8 blocks with 6-bit scales
struct Layout {
  static constexpr int SC_AT = HALF16_BYTES, N4_AT = XS ? SC_AT + 8 * PANEL : HALF16_BYTES;  // 32 | 160, 32
  static constexpr int COLS = XS ? QK_K : QK;                                                // columns per block
  static constexpr size_t PB = N4_AT + (COLS / QK) * N4_BYTES;                               // 2208 | 288
  static constexpr size_t SRC = XS ? 136 : 18;
  static const uint8_t* n4(const uint8_t* blk, int j) { return blk + N4_AT + j * N4_BYTES; }
};

template <bool XS>
static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  using L = Layout<XS>;
  for (int sb = 0; sb < cols / L::COLS; sb++) {
    const uint8_t* s = src + (size_t)sb * L::SRC;
    uint8_t* blk = panel + (size_t)sb * L::PB;
    put_half(blk, r, s);
    const uint8_t* qs = s + (XS ? 8 : 2);
    for (int j = 0; j < L::COLS / QK; j++) {
      if (XS) {
        const int low = (s[4 + j / 2] >> (4 * (j % 2))) & 15, high = (get_u16(s + 2) >> (2 * j)) & 3;
        blk[L::SC_AT + j * PANEL + r] = (uint8_t)(int8_t)((low | high << 4) - 32);
      }
      for (int l = 0; l < 16; l++) {
        n4_put(blk + L::N4_AT + j * N4_BYTES, r, l, qs[16 * j + l] & 15);
        n4_put(blk + L::N4_AT + j * N4_BYTES, r, l + 16, qs[16 * j + l] >> 4);
      }
    }
  }
}

template <bool XS>
static inline int scale(const uint8_t* blk, int j, int r) {
  return XS ? (int)(int8_t)blk[Layout<XS>::SC_AT + j * PANEL + r] : 1;
}

template <bool XS>
static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  using L = Layout<XS>;
  for (int sb = 0; sb < cols / L::COLS; sb++) {
    const uint8_t* blk = panel + (size_t)sb * L::PB;
    const float d = get_half(blk, r);
    for (int j = 0; j < L::COLS / QK; j++) {
      const float dl = XS ? d * (float)scale<XS>(blk, j, r) : d;
      for (int k = 0; k < QK; k++) out[sb * L::COLS + j * QK + k] = dl * (float)KVALUES[n4_get(L::n4(blk, j), r, k)];
    }
  }
}

template <bool XS>
struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    using L = Layout<XS>;
    constexpr int PER = L::COLS / QK;  // 32-blocks per panel block
    float acc = 0.0f;
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)(b / PER) * L::PB;
      const int8_t* xq = act_q(a, t, b);
      int32_t isum = 0;
      for (int k = 0; k < QK; k++) isum += KVALUES[n4_get(L::n4(blk, b % PER), r, k)] * xq[k];
      const float dsc = get_half(blk, r) * (float)scale<XS>(blk, b % PER, r);
      acc = fmaf(dsc * a.d[(size_t)t * a.nb + b], (float)isum, acc);
    }
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
template <bool XS>
struct K {
  template <int TT>
  static inline void half(const uint8_t* pw, int h, int cols, const QAct& a, int t0, __m256* acc) {
    using L = Layout<XS>;
    constexpr int PER = L::COLS / QK;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)KVALUES)), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)(b / PER) * L::PB;
      const uint8_t* n4 = L::n4(blk, b % PER);
      if (h == 0) prefetch(n4 + PREFETCH_AHEAD, 4);  // the block's every line, once per panel pass pair
      const __m256 d = half8(blk + 16 * h);
      const __m256 dsc = XS ? _mm256_mul_ps(d, _mm256_cvtepi32_ps(i8x8_epi32(blk + L::SC_AT + (b % PER) * PANEL + 8 * h))) : d;
      __m256i wa[8], ws[8];  // |w| and w (signed table values), for vpmaddubsw(|w|, sign(x, w))
      n4_unpack(n4, h, ws);
      for (int g = 0; g < 8; g++) {
        ws[g] = _mm256_shuffle_epi8(table, ws[g]);
        wa[g] = _mm256_abs_epi8(ws[g]);
      }
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        const size_t row = (size_t)(t0 + t);
        const int8_t* xq = act_q(a, (int)row, b);
        __m256i isum = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {  // pair sums <= 2 * 127 * 127 < 32768: exact
          const __m256i p = _mm256_maddubs_epi16(wa[g], _mm256_sign_epi8(bcast4(xq + 4 * g), ws[g]));
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
        }
        const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, dx), _mm256_cvtepi32_ps(isum), acc[t]);
      }
    }
  }
};
}  // namespace avx2
VS_END_TARGET

VS_BEGIN_AVX512
namespace avx512 {
#include "simd_avx512.h"
template <bool XS>
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    using L = Layout<XS>;
    constexpr int PER = L::COLS / QK;
    // the table + 128 as u8 (1..241) for vpdpbusd; the 128 * sum(x) it adds is taken out exactly
    const __m512i table = _mm512_xor_si512(_mm512_maskz_broadcast_i32x4((__mmask16)0xFFFF, _mm_load_si128((const __m128i*)KVALUES)),
                                           _mm512_set1_epi8((char)0x80));
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)(b / PER) * L::PB;
      const uint8_t* n4 = L::n4(blk, b % PER);
      prefetch(n4 + PREFETCH_AHEAD, 4);
      const __m512 d = half16(blk);
      const __m512 dsc = XS ? _mm512_mul_ps(d, _mm512_cvtepi32_ps(i8x16_epi32(blk + L::SC_AT + (b % PER) * PANEL))) : d;
      __m512i w[8];
      n4_unpack(n4, w);
      for (int g = 0; g < 8; g++) w[g] = _mm512_shuffle_epi8(table, w[g]);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        const size_t row = (size_t)(t0 + t);
        const __m512i isum = _mm512_sub_epi32(dot_n4(w, act_q(a, (int)row, b)), _mm512_set1_epi32(128 * a.qsum[row * a.nb + b]));
        const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + b]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dsc, dx), _mm512_cvtepi32_ps(isum), acc[t]);
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace iq4

extern const Format format_iq4_nl = {"iq4_nl", 20, QK, iq4::Layout<false>::SRC, iq4::Layout<false>::PB,
                                     iq4::repack_row<false>, iq4::dequant_row<false>,
                                     {layout::matmul_ref<iq4::Ref<false>>, iq4::avx2::matmul<iq4::avx2::K<false>>,
                                      iq4::avx512::matmul<iq4::avx512::K<false>>}};
extern const Format format_iq4_xs = {"iq4_xs", 23, QK_K, iq4::Layout<true>::SRC, iq4::Layout<true>::PB,
                                     iq4::repack_row<true>, iq4::dequant_row<true>,
                                     {layout::matmul_ref<iq4::Ref<true>>, iq4::avx2::matmul<iq4::avx2::K<true>>,
                                      iq4::avx512::matmul<iq4::avx512::K<true>>}};

}  // namespace vs
