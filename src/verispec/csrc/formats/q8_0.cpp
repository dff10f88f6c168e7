// Q8_0 (GGUF type 8): 32-weight blocks of int8 weights, w = d * q.
//   source, 34 B: fp16 d, int8 qs[32]
// Panel block (16 rows x 32 columns, 544 B): HALF16 d | Q8G (q + 128 as u8, layout.h).
// Dot with int8 activations:  acc = fmaf(d * dx, sum(q * x), acc), where the stored +128
// is taken out exactly as sum((q + 128) * x) - 128 * sum(x).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace q8_0 {
using namespace layout;

constexpr size_t PB = HALF16_BYTES + Q8G_BYTES;  // 544

static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* s = src + (size_t)b * 34;
    uint8_t* blk = panel + (size_t)b * PB;
    put_half(blk, r, s);
    for (int k = 0; k < QK; k++) blk[HALF16_BYTES + q8g_byte(r, k)] = (uint8_t)((int)(int8_t)s[2 + k] + 128);
  }
}

static inline int q_at(const uint8_t* blk, int r, int k) { return (int)blk[HALF16_BYTES + q8g_byte(r, k)] - 128; }

static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int b = 0; b < cols / QK; b++) {
    const uint8_t* blk = panel + (size_t)b * PB;
    const float d = get_half(blk, r);
    for (int k = 0; k < QK; k++) out[b * QK + k] = d * (float)q_at(blk, r, k);
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
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < cols / QK; b++) {
      const uint8_t* blk = pw + (size_t)b * PB;
      if (h == 0) prefetch(blk + PREFETCH_AHEAD, 9);  // the block's every line, once per panel pass pair
      const __m256 dw = half8(blk + 16 * h);
      __m256i wa[8], ws[8];  // |w| and w (signed), for vpmaddubsw(|w|, sign(x, w))
      for (int g = 0; g < 8; g++) {
        ws[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + HALF16_BYTES + 64 * g + 32 * h)), flip);
        wa[g] = _mm256_abs_epi8(ws[g]);
      }
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        const size_t row = (size_t)(t0 + t);
        const int8_t* xq = act_q(a, (int)row, b);
        __m256i isum = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {  // pair sums <= 2 * 128 * 127 < 32768: exact
          const __m256i p = _mm256_maddubs_epi16(wa[g], _mm256_sign_epi8(bcast4(xq + 4 * g), ws[g]));
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
        }
        const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum), acc[t]);
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
      prefetch(blk + PREFETCH_AHEAD, 9);
      const __m512 dw = half16(blk);
      __m512i w[8];
      for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void*)(blk + HALF16_BYTES + 64 * g));
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        const int8_t* xq = x.q[t] + b * QK;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int g = 0; g < 8; g += 2) {
          s0 = _mm512_dpbusd_epi32(s0, w[g], bcast4(xq + 4 * g));
          s1 = _mm512_dpbusd_epi32(s1, w[g + 1], bcast4(xq + 4 * g + 4));
        }
        // weights are stored + 128: subtract 128 * sum(x) to get sum(w * x) exactly
        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_slli_epi32(_mm512_set1_epi32(x.qsum[t][b]), 7));
        const __m512 dx = _mm512_set1_ps(x.d[t][b]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), acc[t]);
      }
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace q8_0

extern const Format format_q8_0 = {"q8_0", 8, QK, 34, q8_0::PB, q8_0::repack_row, q8_0::dequant_row,
                                   {layout::matmul_ref<q8_0::Ref>, q8_0::avx2::matmul<q8_0::avx2::K>,
                                    q8_0::avx512::matmul<q8_0::avx512::K>}};

}  // namespace vs
