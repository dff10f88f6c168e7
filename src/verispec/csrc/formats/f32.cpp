// F32 (GGUF type 0): unquantized weights (tiny test models, fp32 checkpoints).
// Panel (16 rows x cols): float w[cols][16], w[k][r] = W[row r][k]; no blocks (block_cols 1).
// Dot with the fp32 activations x (never quantized):  acc = fmaf(w[k][r], x[k], acc), k ascending.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layout.h"

namespace vs {
namespace f32 {
using namespace layout;

constexpr size_t PB = 4 * PANEL;  // one column of 16 rows

static void repack_row(const uint8_t* src, int cols, uint8_t* panel, int r) {
  const float* x = (const float*)src;
  float* wp = (float*)panel;
  for (int k = 0; k < cols; k++) wp[(size_t)k * PANEL + r] = x[k];
}

static void dequant_row(const uint8_t* panel, int cols, int r, float* out) {
  for (int k = 0; k < cols; k++) out[k] = ((const float*)panel)[(size_t)k * PANEL + r];
}

struct Ref {
  static float dot(const uint8_t* pw, int cols, int r, const QAct& a, int t) {
    const float* wp = (const float*)pw;
    const float* x = a.x + (size_t)t * a.cols;
    float acc = 0.0f;
    for (int k = 0; k < cols; k++) acc = fmaf(wp[(size_t)k * PANEL + r], x[k], acc);
    return acc;
  }
};

VS_BEGIN_AVX2
namespace avx2 {
#include "simd_avx2.h"
struct K {
  template <int TT>
  static inline void half(const uint8_t* pw, int h, int cols, const QAct& a, int t0, __m256* acc) {
    const float* wp = (const float*)pw + 8 * h;
    for (int k = 0; k < cols; k++) {
      const __m256 wk = _mm256_loadu_ps(wp + (size_t)k * PANEL);
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
struct K {
  template <int TT>
  static inline void panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
    const float* wp = (const float*)pw;
    for (int k = 0; k < cols; k++) {
      const __m512 wk = _mm512_loadu_ps(wp + (size_t)k * PANEL);
      #pragma GCC unroll 8
      for (int t = 0; t < TT; t++) acc[t] = _mm512_fmadd_ps(wk, _mm512_set1_ps(a.x[(size_t)(t0 + t) * a.cols + k]), acc[t]);
    }
  }
};
}  // namespace avx512
VS_END_TARGET

}  // namespace f32

extern const Format format_f32 = {"f32", 0, 1, 4, f32::PB, f32::repack_row, f32::dequant_row,
                                  {layout::matmul_ref<f32::Ref>, f32::avx2::matmul<f32::avx2::K>,
                                   f32::avx512::matmul<f32::avx512::K>}};

}  // namespace vs
