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

// Lane operations of exp_lanes / silu_mul_lanes / exp_shifted_lanes (kernels_generic.inc): 8 floats
struct F8 {
  using V = __m256;
  static constexpr int W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V negate(V x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }  // a sign flip, as the scalar -x
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};
static void exp_shifted(float* s, int n, float mx) { exp_shifted_lanes<F8>(s, n, mx); }

// quantize_row_ref on 8 lanes: max |x| (order-free: no NaN enters it, as in the reference), x * id
// rounded to nearest even, the clamps as the scalar selects, truncation to int32 then to its low
// byte (the reference's conversions), exact integer sums.
static inline __m256 clamp127(__m256 v) {
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  v = _mm256_blendv_ps(v, hi, _mm256_cmp_ps(v, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(v, lo, _mm256_cmp_ps(v, lo, _CMP_LT_OQ));
}
static inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
static void quantize_row(const float* x, int cols, int8_t* q, float* d, float* s, int32_t* qsum, int32_t* qsum16) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i low_byte = _mm256_set1_epi32(0xFF), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int b = 0; b < cols / QK; b++) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
      m = _mm256_max_ps(_mm256_and_ps(v[i], absmask), m);  // a NaN |x| leaves m (second operand)
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.0f, id = db != 0.0f ? 127.0f / amax : 0.0f;
    __m256i iq[4];
    for (int i = 0; i < 4; i++) {
      const __m256 x_id = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
      const __m256 r = _mm256_round_ps(x_id, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // nearbyint
      iq[i] = _mm256_cvttps_epi32(clamp127(r));
    }
    const __m256i p01 = _mm256_packus_epi32(_mm256_and_si256(iq[0], low_byte), _mm256_and_si256(iq[1], low_byte));
    const __m256i p23 = _mm256_packus_epi32(_mm256_and_si256(iq[2], low_byte), _mm256_and_si256(iq[3], low_byte));
    // bytes per 128-bit lane: 0-3 of each vector, then 4-7: put each vector's 8 bytes back in order
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(p01, p23), order);
    _mm256_storeu_si256((__m256i*)(q + b * QK), bytes);
    const int32_t h0 = hsum8(_mm256_add_epi32(iq[0], iq[1])), h1 = hsum8(_mm256_add_epi32(iq[2], iq[3]));
    const int32_t sum = h0 + h1;
    d[b] = db;
    qsum[b] = sum;
    qsum16[2 * b] = h0;
    qsum16[2 * b + 1] = h1;
    s[b] = db * (float)sum;
  }
}

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
VS_SCORE_PAIR_BY_ONE(score_tiles)
VS_ATTEND(score_tiles, weigh_values, score_pair_by_one)

}  // namespace avx2

const Kernels kernels_avx2 = {"avx2", ISA_AVX2, avx2::attend, avx2::attend_pair, avx2::silu_mul_lanes<avx2::F8>, avx2::quantize_row, avx2::rms_norm};

}  // namespace vs
