// Q6_K (GGUF type 14): 256-weight super-blocks of 16 sub-blocks of 16 weights,
// w = d * sc[j] * (q - 32), q in 0..63, int8 sub-block scales sc[j].
//   source, 210 B: ql[128], qh[64], int8 scales[16], fp16 d (last). Half h (128 weights)
//   uses ql[64h..], qh[32h..]; for l < 32: weight l = (ql[l] & 15) | (qh[l] & 3) << 4,
//   l + 32 = (ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4, l + 64 = (ql[l] >> 4) | (qh[l] >> 4 & 3) << 4,
//   l + 96 = (ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4.
// Panel super-block (16 rows x 256 columns, 3360 B):
//   HALF16 d | i8 sc[16][16] | 8 x (N4 | H2)   (one N4 + H2 per 32 columns, layout.h)
// Dot with int8 activations, per 32-block (two sub-blocks a, b: columns 0..15 and 16..31),
// the integer part exact (|isum| < 2^24, so its conversion to float is exact too):
//   isum = sc[a] * (sum_lo(q * x) - 32 * sum_lo(x)) + sc[b] * (sum_hi(q * x) - 32 * sum_hi(x))
//   acc = fmaf(d * dx, isum, acc)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace q6_k {
using namespace layout;

constexpr int SC_AT = HALF16_BYTES, SUB_AT = SC_AT + 16 * PANEL;  // 32, 288
constexpr size_t SUB = N4_BYTES + H2_BYTES;                       // 384
constexpr size_t PB = SUB_AT + 8 * SUB;                           // 3360

static inline const uint8_t* sub(const uint8_t* sb, int j) { return sb + SUB_AT + j * SUB; }

static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* s = src + (size_t)sb * 210;
    uint8_t* blk = panel + (size_t)sb * PB;
    put_half(blk, r, s + 208);
    for (int j = 0; j < 16; j++) blk[SC_AT + j * PANEL + r] = s[192 + j];
    for (int h = 0; h < 2; h++) {
      const uint8_t* ql = s + 64 * h;
      const uint8_t* qh = s + 128 + 32 * h;
      for (int l = 0; l < 32; l++) {
        const int q[4] = {(ql[l] & 15) | (qh[l] & 3) << 4, (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4,
                          (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4, (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4};
        for (int i = 0; i < 4; i++) {  // weight 128h + 32i + l: 32-column block 4h + i, column l
          uint8_t* blk32 = blk + SUB_AT + (4 * h + i) * SUB;
          n4_put(blk32, r, l, q[i]);
          h2_put(blk32 + N4_BYTES, r, l, q[i]);
        }
      }
    }
  }
}

static inline int q_at(const uint8_t* blk32, int r, int k) { return n4_get(blk32, r, k) | h2_get(blk32 + N4_BYTES, r, k); }
static inline int scale(const uint8_t* blk, int j, int r) { return (int)(int8_t)blk[SC_AT + j * PANEL + r]; }

static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int sb = 0; sb < cols / QK_K; sb++) {
    const uint8_t* blk = panel + (size_t)sb * PB;
    const float d = get_half(blk, r);
    for (int k = 0; k < QK_K; k++)
      out[sb * QK_K + k] = (d * (float)scale(blk, k / 16, r)) * (float)(q_at(sub(blk, k / QK), r, k % QK) - 32);
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
      const int32_t isum = scale(blk, 2 * j, r) * (lo - 32 * xs[0]) + scale(blk, 2 * j + 1, r) * (hi - 32 * xs[1]);
      acc = fmaf(get_half(blk, r) * a.d[(size_t)t * a.nb + b], (float)isum, acc);
    }
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
struct K {
  // Group g (columns 4g..4g+3) of half h of a 32-block as u8 0..63: its N4 nibble and H2 bits
  // (q_at's values).
  static inline __m256i group(const uint8_t* blk32, int g, int h) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b45 = _mm256_set1_epi8(0x30);
    const int c = g & 3;
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk32 + 64 * c + 32 * h));
    const __m256i x = _mm256_loadu_si256((const __m256i*)(blk32 + N4_BYTES + 64 * (g >> 2) + 32 * h));
    const __m256i nib = _mm256_and_si256(g < 4 ? raw : _mm256_srli_epi16(raw, 4), m4);
    const __m256i high = c == 0 ? _mm256_slli_epi16(x, 4) : c == 1 ? _mm256_slli_epi16(x, 2) : c == 2 ? x : _mm256_srli_epi16(x, 2);
    return _mm256_or_si256(nib, _mm256_and_si256(high, b45));
  }
  // each int16 of lane r = the int8 scale of row r (vpmaddwd's multiplier for both pair sums)
  static inline __m256i pair(__m256i s32) { return _mm256_blend_epi16(s32, _mm256_slli_epi32(s32, 16), 0xAA); }

  // TT tokens, both halves of each 32-block in one pass over the panel: two groups of both halves
  // unpacked at a time serve every token, and the sub-block scale is applied by vpmaddwd to each
  // pair of groups, so the integer is sa * lo + sb * hi - 32 * (sa * xs0 + sb * xs1) = Ref::dot's
  // isum (exact: |sa * lo| < 2^24); then Ref::dot's one fmaf per output.
  static constexpr int BOTH_TOKENS = 4;
  template <int TT>
  static inline void both(const uint8_t* pw, int cols, const QAct& a, int t0, __m256* acc) {
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * PB;
      const __m256 d[2] = {half8(blk), half8(blk + 16)};
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* blk32 = sub(blk, j);
        prefetch(blk32 + PREFETCH_AHEAD, 6);
        __m256i scale[2][2], sasb[2];  // [h][columns 0..15 / 16..31]; sasb: int16 pair (sa, sb) of each row
        for (int h = 0; h < 2; h++) {
          const __m256i sa = i8x8_epi32(blk + SC_AT + 2 * j * PANEL + 8 * h);
          const __m256i sb2 = i8x8_epi32(blk + SC_AT + (2 * j + 1) * PANEL + 8 * h);
          scale[h][0] = pair(sa);
          scale[h][1] = pair(sb2);
          sasb[h] = _mm256_blend_epi16(sa, _mm256_slli_epi32(sb2, 16), 0xAA);
        }
        const int8_t* xq[TT];
        __m256i isum[TT][2];
        for (int t = 0; t < TT; t++) {
          xq[t] = act_q(a, t0 + t, b);
          isum[t][0] = isum[t][1] = _mm256_setzero_si256();
        }
        #pragma GCC unroll 4
        for (int g = 0; g < 8; g += 2) {
          for (int h = 0; h < 2; h++) {
            const __m256i w0 = group(blk32, g, h), w1 = group(blk32, g + 1, h);
            #pragma GCC unroll 4
            for (int t = 0; t < TT; t++) {
              // int16 pair sums: 2 of <= 2 * 63 * 127 per lane stay below 32767: exact
              const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(xq[t] + 4 * g)),
                                                   _mm256_maddubs_epi16(w1, bcast4(xq[t] + 4 * g + 4)));
              isum[t][h] = _mm256_add_epi32(isum[t][h], _mm256_madd_epi16(s16, scale[h][g >> 2]));
              in_register(isum[t][h]);
            }
          }
        }
        for (int t = 0; t < TT; t++) {
          const size_t row = (size_t)(t0 + t);
          const int32_t* xs = a.qsum16 + row * 2 * a.nb + 2 * b;  // |xs| <= 16 * 127: an int16 each
          const __m256i xs01 = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)xs[0] | (uint32_t)(uint16_t)xs[1] << 16));
          const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]);
          for (int h = 0; h < 2; h++) {
            const __m256i isum_h = _mm256_sub_epi32(isum[t][h], _mm256_slli_epi32(_mm256_madd_epi16(sasb[h], xs01), 5));
            acc[2 * t + h] = _mm256_fmadd_ps(_mm256_mul_ps(d[h], dx), _mm256_cvtepi32_ps(isum_h), acc[2 * t + h]);
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
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    const ActRows<TT> x(a, t0);
    for (int sb = 0; sb < cols / QK_K; sb++) {
      const uint8_t* blk = pw + (size_t)sb * PB;
      const __m512 d = half16(blk);
      for (int j = 0; j < 8; j++) {
        const int b = sb * 8 + j;
        const uint8_t* blk32 = sub(blk, j);
        prefetch(blk32 + PREFETCH_AHEAD, 6);
        const __m512i sa = i8x16_epi32(blk + SC_AT + 2 * j * PANEL), sb2 = i8x16_epi32(blk + SC_AT + (2 * j + 1) * PANEL);
        __m512i w[8];
        n4_unpack(blk32, w);
        h2_add(blk32 + N4_BYTES, w);
        #pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
          __m512i lo, hi;
          dot_n4_halves(w, x.q[t] + b * QK, lo, hi);
          const int32_t* xs = x.qsum16[t] + 2 * b;  // 32 sum(x) of each half: a shift, no overflow (|xs| <= 16 * 127)
          const __m512i isum =
              _mm512_add_epi32(_mm512_mullo_epi32(sa, _mm512_sub_epi32(lo, _mm512_slli_epi32(_mm512_set1_epi32(xs[0]), 5))),
                               _mm512_mullo_epi32(sb2, _mm512_sub_epi32(hi, _mm512_slli_epi32(_mm512_set1_epi32(xs[1]), 5))));
          const __m512 dx = _mm512_set1_ps(x.d[t][b]);
          acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc[t]);
        }
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace q6_k

extern const Format format_q6_k = {"q6_k", 14, QK_K, 210, q6_k::PB, q6_k::repack_row, q6_k::dequant_row,
                                   {layout::matmul_ref<q6_k::Ref>, q6_k::avx2::matmul<q6_k::avx2::K>,
                                    q6_k::avx512::matmul<q6_k::avx512::K>}};

}  // namespace vs
