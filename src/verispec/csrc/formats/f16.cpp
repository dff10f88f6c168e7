// F16 (GGUF type 1) and BF16 (type 30): 16-bit float weights (small drafts, embeddings).
// Both widen to fp32 exactly (IEEE half: F16C's conversion; bfloat16: the top half of an fp32).
// Panel (16 rows x cols): uint16 w[cols][16], w[k][r] = W[row r][k]; no blocks (block_cols 1).
// Dot with the fp32 activations x (never quantized), as F32:  acc = fmaf(float(w[k][r]), x[k], acc), k ascending.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace f16 {
using namespace layout;

constexpr size_t PB = 2 * PANEL;  // one column of 16 rows

static inline float bf16_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <bool BF>
static inline float widen(uint16_t h) { return BF ? bf16_to_float(h) : half_to_float(h); }

static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  for (int k = 0; k < cols; k++) std::memcpy(panel + (size_t)k * PB + 2 * r, src + 2 * (size_t)k, 2);
}

template <bool BF>
static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int k = 0; k < cols; k++) out[k] = widen<BF>(get_u16(panel + (size_t)k * PB + 2 * r));
}

template <bool BF>
struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    const float* x = a.x + (size_t)t * a.cols;
    float acc = 0.0f;
    for (int k = 0; k < cols; k++) acc = fmaf(widen<BF>(get_u16(pw + (size_t)k * PB + 2 * r)), x[k], acc);
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
template <bool BF>
static inline __m256 load8(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return BF ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
template <bool BF>
struct K {
  template <int TT>
  static inline void half(const uint8_t* pw, int h, int cols, const QAct& a, int t0, __m256* acc) {
    for (int k = 0; k < cols; k++) {
      const __m256 wk = load8<BF>(pw + (size_t)k * PB + 16 * h);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) acc[t] = _mm256_fmadd_ps(wk, _mm256_set1_ps(a.x[(size_t)(t0 + t) * a.cols + k]), acc[t]);
    }
  }
};
}  // namespace avx2
VS_END_TARGET

VS_BEGIN_AVX512
namespace avx512 {
#include "simd_avx512.h"
template <bool BF>
static inline __m512 load16(const uint8_t* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return BF ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}
template <bool BF>
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    for (int k = 0; k < cols; k++) {
      const __m512 wk = load16<BF>(pw + (size_t)k * PB);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) acc[t] = _mm512_fmadd_ps(wk, _mm512_set1_ps(a.x[(size_t)(t0 + t) * a.cols + k]), acc[t]);
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace f16

extern const Format format_f16 = {"f16", 1, 1, 2, f16::PB, f16::repack_row, f16::dequant_row<false>,
                                  {layout::matmul_ref<f16::Ref<false>>, f16::avx2::matmul<f16::avx2::K<false>>,
                                   f16::avx512::matmul<f16::avx512::K<false>>}};
extern const Format format_bf16 = {"bf16", 30, 1, 2, f16::PB, f16::repack_row, f16::dequant_row<true>,
                                   {layout::matmul_ref<f16::Ref<true>>, f16::avx2::matmul<f16::avx2::K<true>>,
                                    f16::avx512::matmul<f16::avx512::K<true>>}};

}  // namespace vs
