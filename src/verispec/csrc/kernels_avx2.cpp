// AVX2 + FMA + F16C kernels other than matrix products (those are in formats/): attention,
// SiLU, activation quantization, RMSNorm; each lane's fmaf chain is the scalar reference's.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "vs.h"

namespace vs {
namespace avx2 {
#include "kernels_generic.inc"

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// Scores of whole KV_TILE-slot tiles: lanes are keys, and each lane is the fmaf chain over d.
// All G heads of the kv head share the key loads; 16 keys per pass (two registers) keep the
// G * 2 accumulators in AVX2's 16 registers.
template <int G, class KV>
static void score_tiles_g(const AttnTask& t, int D, int tiles, float* sc, int stride) {
  for (int tile = 0; tile < tiles; tile++) {
    const KV* kt = (const KV*)t.kt + (size_t)tile * D * KV_TILE;
    for (int part = 0; part < KV_TILE / 16; part++) {
      __m256 acc[G][2];
      for (int h = 0; h < G; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
      for (int d = 0; d < D; d++) {
        const KV* kd = kt + d * KV_TILE + 16 * part;
        const __m256 k0 = load8(kd), k1 = load8(kd + 8);
        for (int h = 0; h < G; h++) {
          const __m256 q = _mm256_set1_ps(t.q[(size_t)h * D + d]);
          acc[h][0] = _mm256_fmadd_ps(q, k0, acc[h][0]);
          acc[h][1] = _mm256_fmadd_ps(q, k1, acc[h][1]);
        }
      }
      for (int h = 0; h < G; h++)
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(sc + (size_t)h * stride + tile * KV_TILE + 16 * part + 8 * i, acc[h][i]);
    }
  }
}

template <class KV>
static void score_tiles(const AttnTask& t, int D, int G, int tiles, float* sc, int stride) {
  switch (G) {
    case 1: return score_tiles_g<1, KV>(t, D, tiles, sc, stride);
    case 2: return score_tiles_g<2, KV>(t, D, tiles, sc, stride);
    case 3: return score_tiles_g<3, KV>(t, D, tiles, sc, stride);
    case 4: return score_tiles_g<4, KV>(t, D, tiles, sc, stride);
    case 5: return score_tiles_g<5, KV>(t, D, tiles, sc, stride);
    case 6: return score_tiles_g<6, KV>(t, D, tiles, sc, stride);  // Qwen2.5-1.5B: 12 heads over 2
    case 7: return score_tiles_g<7, KV>(t, D, tiles, sc, stride);  // Qwen2.5-0.5B: 14 heads over 2
    case 8: return score_tiles_g<8, KV>(t, D, tiles, sc, stride);
    default: return score_tiles_ref<KV>(t, D, G, tiles, sc, stride);
  }
}

// out[h] = sum_j p[h][j] * v[j] and sum[h] = sum_j p[h][j], both in key order; lanes are
// value dimensions, 16 per pass over the keys (G * 2 accumulators fit AVX2's registers).
template <int G, class KV>
static void weigh_values_g(const AttnTask& t, int D, const float* sc, int stride, float* sum) {
  const int nc = t.n_cached, n = nc + t.n_path;
  for (int part = 0; part < D / 16; part++) {
    __m256 acc[G][2];
    float s[G];
    for (int h = 0; h < G; h++) {
      s[h] = 0.0f;
      acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    }
    for (int j = 0; j < n; j++) {
      const KV* v = (const KV*)t.v + (size_t)(j < nc ? j : t.path[j - nc]) * D + 16 * part;
      const __m256 v0 = load8(v), v1 = load8(v + 8);
      for (int h = 0; h < G; h++) {
        const float p = sc[(size_t)h * stride + j];
        s[h] += p;
        const __m256 pb = _mm256_set1_ps(p);
        acc[h][0] = _mm256_fmadd_ps(pb, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(pb, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < G; h++) {
      sum[h] = s[h];  // the same sequential sum in every part
      _mm256_storeu_ps(t.out + (size_t)h * D + 16 * part, acc[h][0]);
      _mm256_storeu_ps(t.out + (size_t)h * D + 16 * part + 8, acc[h][1]);
    }
  }
}

template <class KV>
static void weigh_values(const AttnTask& t, int D, int G, const float* sc, int stride, float* sum) {
  if (D % 16 == 0) {
    switch (G) {
      case 1: return weigh_values_g<1, KV>(t, D, sc, stride, sum);
      case 2: return weigh_values_g<2, KV>(t, D, sc, stride, sum);
      case 3: return weigh_values_g<3, KV>(t, D, sc, stride, sum);
      case 4: return weigh_values_g<4, KV>(t, D, sc, stride, sum);
      case 5: return weigh_values_g<5, KV>(t, D, sc, stride, sum);
      case 6: return weigh_values_g<6, KV>(t, D, sc, stride, sum);
      case 7: return weigh_values_g<7, KV>(t, D, sc, stride, sum);
      case 8: return weigh_values_g<8, KV>(t, D, sc, stride, sum);
      default: break;
    }
  }
  return weigh_values_ref<KV>(t, D, G, sc, stride, sum);
}
VS_ATTEND(score_tiles, weigh_values)

}  // namespace avx2

const Kernels kernels_avx2 = {"avx2", ISA_AVX2, avx2::attend, avx2::silu_mul, avx2::quantize_row, avx2::rms_norm};

}  // namespace vs
