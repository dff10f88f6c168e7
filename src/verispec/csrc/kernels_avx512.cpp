// AVX-512 (F, BW, VL, VNNI) + F16C kernels other than matrix products (those are in
// formats/): attention, SiLU, activation quantization, RMSNorm; each lane's fmaf chain is
// the scalar reference's.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "vs.h"

namespace vs {
namespace avx512 {
#include "kernels_generic.inc"

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// Lane operations of exp_lanes / silu_mul_lanes / exp_shifted_lanes (kernels_generic.inc): 16 floats
struct F16 {
  using V = __m512;
  static constexpr int W = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V negate(V x) {  // a sign flip, as the scalar -x
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
  }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
static void exp_shifted(float* s, int n, float mx) { exp_shifted_lanes<F16>(s, n, mx); }

// quantize_row_ref on 16 lanes (as kernels_avx2.cpp's): max |x| with no NaN in it, x * id rounded to
// nearest even, the clamps as the scalar selects, truncation to int32 then to its low byte, exact sums.
static void quantize_row(const float* x, int cols, int8_t* q, float* d, float* s, int32_t* qsum, int32_t* qsum16) {
  const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (int b = 0; b < cols / QK; b++) {
    const __m512 v[2] = {_mm512_loadu_ps(x + b * QK), _mm512_loadu_ps(x + b * QK + 16)};
    __m512 m = _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps());  // a NaN |x| leaves m (second operand)
    m = _mm512_max_ps(_mm512_abs_ps(v[1]), m);
    const float amax = _mm512_reduce_max_ps(m);
    const float db = amax / 127.0f, id = db != 0.0f ? 127.0f / amax : 0.0f;
    int32_t half[2];
    for (int i = 0; i < 2; i++) {
      const __m512 x_id = _mm512_mul_ps(v[i], _mm512_set1_ps(id));
      __m512 r = _mm512_roundscale_ps(x_id, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // nearbyint
      r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, hi, _CMP_GT_OQ), r, hi);
      r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, lo, _CMP_LT_OQ), r, lo);
      const __m512i iq = _mm512_cvttps_epi32(r);
      _mm_storeu_si128((__m128i*)(q + b * QK + 16 * i), _mm512_cvtepi32_epi8(iq));  // low bytes
      half[i] = _mm512_reduce_add_epi32(iq);
    }
    const int32_t sum = half[0] + half[1];
    d[b] = db;
    qsum[b] = sum;
    qsum16[2 * b] = half[0];
    qsum16[2 * b + 1] = half[1];
    s[b] = db * (float)sum;
  }
}

// Scores of whole KV_TILE-slot tiles: lanes are keys, and each lane is the fmaf chain over d.
// All G heads of the kv head share the key loads (G a template argument: registers); a tile
// row is four registers of 16 keys.
static_assert(KV_TILE == 4 * 16, "score_tiles_g loads a K tile row as four 16-lane registers");
template <int G, class KV>
static void score_tiles_g(const AttnTask& t, int D, int tile0, int tiles, float* sc, int stride) {
  for (int tile = tile0; tile < tiles; tile++) {
    const KV* kt = (const KV*)t.kt + (size_t)tile * D * KV_TILE;
    __m512 acc[G][4];
    for (int h = 0; h < G; h++)
      for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
      const __m512 k0 = load16(kt + d * KV_TILE), k1 = load16(kt + d * KV_TILE + 16);
      const __m512 k2 = load16(kt + d * KV_TILE + 32), k3 = load16(kt + d * KV_TILE + 48);
      for (int h = 0; h < G; h++) {
        const __m512 q = _mm512_set1_ps(t.q[(size_t)h * D + d]);
        acc[h][0] = _mm512_fmadd_ps(q, k0, acc[h][0]);
        acc[h][1] = _mm512_fmadd_ps(q, k1, acc[h][1]);
        acc[h][2] = _mm512_fmadd_ps(q, k2, acc[h][2]);
        acc[h][3] = _mm512_fmadd_ps(q, k3, acc[h][3]);
      }
    }
    for (int h = 0; h < G; h++)
      for (int i = 0; i < 4; i++) _mm512_storeu_ps(sc + (size_t)h * stride + tile * KV_TILE + 16 * i, acc[h][i]);
  }
}

// The same for G > 4 heads, 32 keys per pass (G * 2 accumulators stay in registers).
template <int G, class KV>
static void score_tiles_wide_g(const AttnTask& t, int D, int tile0, int tiles, float* sc, int stride) {
  for (int tile = tile0; tile < tiles; tile++) {
    const KV* kt = (const KV*)t.kt + (size_t)tile * D * KV_TILE;
    for (int part = 0; part < KV_TILE / 32; part++) {
      __m512 acc[G][2];
      for (int h = 0; h < G; h++) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
      for (int d = 0; d < D; d++) {
        const __m512 k0 = load16(kt + d * KV_TILE + 32 * part), k1 = load16(kt + d * KV_TILE + 32 * part + 16);
        for (int h = 0; h < G; h++) {
          const __m512 q = _mm512_set1_ps(t.q[(size_t)h * D + d]);
          acc[h][0] = _mm512_fmadd_ps(q, k0, acc[h][0]);
          acc[h][1] = _mm512_fmadd_ps(q, k1, acc[h][1]);
        }
      }
      for (int h = 0; h < G; h++)
        for (int i = 0; i < 2; i++) _mm512_storeu_ps(sc + (size_t)h * stride + tile * KV_TILE + 32 * part + 16 * i, acc[h][i]);
    }
  }
}

// Tiles [tile0, tiles) of one task's scores.
template <class KV>
static void score_tiles_range(const AttnTask& t, int D, int G, int tile0, int tiles, float* sc, int stride) {
  switch (G) {
    case 1: return score_tiles_g<1, KV>(t, D, tile0, tiles, sc, stride);
    case 2: return score_tiles_g<2, KV>(t, D, tile0, tiles, sc, stride);
    case 3: return score_tiles_g<3, KV>(t, D, tile0, tiles, sc, stride);
    case 4: return score_tiles_g<4, KV>(t, D, tile0, tiles, sc, stride);
    case 5: return score_tiles_wide_g<5, KV>(t, D, tile0, tiles, sc, stride);
    case 6: return score_tiles_wide_g<6, KV>(t, D, tile0, tiles, sc, stride);  // Qwen2.5-1.5B: 12 heads over 2
    case 7: return score_tiles_wide_g<7, KV>(t, D, tile0, tiles, sc, stride);  // Qwen2.5-0.5B: 14 heads over 2
    case 8: return score_tiles_wide_g<8, KV>(t, D, tile0, tiles, sc, stride);
    default: return score_tiles_ref<KV>(t, D, G, tiles, sc, stride);  // every key (the same bits again)
  }
}

template <class KV>
static void score_tiles(const AttnTask& t, int D, int G, int tiles, float* sc, int stride) {
  score_tiles_range<KV>(t, D, G, 0, tiles, sc, stride);
}

// Two tasks' scores over the same K cache (attend_pair): the 2 G query heads of tokens a and b
// share each K load, 32 keys a pass (2 G * 2 accumulators in registers), over the tiles both
// need; the longer task's last tiles alone. Each lane is the same fmaf chain over d as above.
template <int G, class KV>
static void score_pair_g(const AttnTask& a, const AttnTask& b, int D, int ta, int tb, float* sa, float* sb, int stride) {
  const int common = ta < tb ? ta : tb;
  for (int tile = 0; tile < common; tile++) {
    const KV* kt = (const KV*)a.kt + (size_t)tile * D * KV_TILE;
    for (int part = 0; part < KV_TILE / 32; part++) {
      __m512 acc[2 * G][2];
      for (int h = 0; h < 2 * G; h++) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
      for (int d = 0; d < D; d++) {
        const __m512 k0 = load16(kt + d * KV_TILE + 32 * part), k1 = load16(kt + d * KV_TILE + 32 * part + 16);
        for (int h = 0; h < 2 * G; h++) {
          const __m512 q = _mm512_set1_ps(h < G ? a.q[(size_t)h * D + d] : b.q[(size_t)(h - G) * D + d]);
          acc[h][0] = _mm512_fmadd_ps(q, k0, acc[h][0]);
          acc[h][1] = _mm512_fmadd_ps(q, k1, acc[h][1]);
        }
      }
      for (int h = 0; h < 2 * G; h++) {
        float* row = (h < G ? sa + (size_t)h * stride : sb + (size_t)(h - G) * stride) + tile * KV_TILE + 32 * part;
        _mm512_storeu_ps(row, acc[h][0]);
        _mm512_storeu_ps(row + 16, acc[h][1]);
      }
    }
  }
  if (ta > common) score_tiles_range<KV>(a, D, G, common, ta, sa, stride);
  if (tb > common) score_tiles_range<KV>(b, D, G, common, tb, sb, stride);
}

template <class KV>
static void score_pair(const AttnTask& a, const AttnTask& b, int D, int G, int ta, int tb, float* sa, float* sb,
                       int stride) {
  switch (G) {
    case 1: return score_pair_g<1, KV>(a, b, D, ta, tb, sa, sb, stride);
    case 2: return score_pair_g<2, KV>(a, b, D, ta, tb, sa, sb, stride);
    case 3: return score_pair_g<3, KV>(a, b, D, ta, tb, sa, sb, stride);
    case 4: return score_pair_g<4, KV>(a, b, D, ta, tb, sa, sb, stride);
    case 5: return score_pair_g<5, KV>(a, b, D, ta, tb, sa, sb, stride);
    case 6: return score_pair_g<6, KV>(a, b, D, ta, tb, sa, sb, stride);
    case 7: return score_pair_g<7, KV>(a, b, D, ta, tb, sa, sb, stride);
    default:  // 2 G * 2 accumulators would not fit the 32 registers
      score_tiles<KV>(a, D, G, ta, sa, stride);
      score_tiles<KV>(b, D, G, tb, sb, stride);
  }
}

// out[h] = sum_j p[h][j] * v[j] and sum[h] = sum_j p[h][j], both in key order; lanes are
// value dimensions. G heads share the value loads; D / 16 = NV registers per head.
template <int G, int NV, class KV>
static void weigh_values_g(const AttnTask& t, const float* sc, int stride, float* sum) {
  const int nc = t.n_cached, n = nc + t.n_path, D = 16 * NV;
  __m512 acc[G][NV];
  float s[G];
  for (int h = 0; h < G; h++) {
    s[h] = 0.0f;
    for (int i = 0; i < NV; i++) acc[h][i] = _mm512_setzero_ps();
  }
  for (int j = 0; j < n; j++) {
    const KV* v = (const KV*)t.v + (size_t)(j < nc ? j : t.path[j - nc]) * D;
    __m512 vr[NV];
    for (int i = 0; i < NV; i++) vr[i] = load16(v + 16 * i);
    for (int h = 0; h < G; h++) {
      const float p = sc[(size_t)h * stride + j];
      s[h] += p;
      const __m512 pb = _mm512_set1_ps(p);
      for (int i = 0; i < NV; i++) acc[h][i] = _mm512_fmadd_ps(pb, vr[i], acc[h][i]);
    }
  }
  for (int h = 0; h < G; h++) {
    sum[h] = s[h];
    for (int i = 0; i < NV; i++) _mm512_storeu_ps(t.out + (size_t)h * D + 16 * i, acc[h][i]);
  }
}

// The same for G > 4 heads: value dimensions in parts of NP registers (G * NP accumulators
// stay in registers); every part runs the same sequential sum.
template <int G, int NP, class KV>
static void weigh_values_parts_g(const AttnTask& t, int D, const float* sc, int stride, float* sum) {
  const int nc = t.n_cached, n = nc + t.n_path;
  for (int part = 0; part < D / (16 * NP); part++) {
    __m512 acc[G][NP];
    float s[G];
    for (int h = 0; h < G; h++) {
      s[h] = 0.0f;
      for (int i = 0; i < NP; i++) acc[h][i] = _mm512_setzero_ps();
    }
    for (int j = 0; j < n; j++) {
      const KV* v = (const KV*)t.v + (size_t)(j < nc ? j : t.path[j - nc]) * D + 16 * NP * part;
      __m512 vr[NP];
      for (int i = 0; i < NP; i++) vr[i] = load16(v + 16 * i);
      for (int h = 0; h < G; h++) {
        const float p = sc[(size_t)h * stride + j];
        s[h] += p;
        const __m512 pb = _mm512_set1_ps(p);
        for (int i = 0; i < NP; i++) acc[h][i] = _mm512_fmadd_ps(pb, vr[i], acc[h][i]);
      }
    }
    for (int h = 0; h < G; h++) {
      sum[h] = s[h];
      for (int i = 0; i < NP; i++) _mm512_storeu_ps(t.out + (size_t)h * D + 16 * NP * part + 16 * i, acc[h][i]);
    }
  }
}

template <class KV>
static void weigh_values(const AttnTask& t, int D, int G, const float* sc, int stride, float* sum) {
  if (D % 64 == 0 && (G == 5 || G == 6)) return G == 5 ? weigh_values_parts_g<5, 4, KV>(t, D, sc, stride, sum)
                                                        : weigh_values_parts_g<6, 4, KV>(t, D, sc, stride, sum);
  if (D % 32 == 0 && (G == 7 || G == 8)) return G == 7 ? weigh_values_parts_g<7, 2, KV>(t, D, sc, stride, sum)
                                                        : weigh_values_parts_g<8, 2, KV>(t, D, sc, stride, sum);
  if (D == 64 && G == 3) return weigh_values_g<3, 4, KV>(t, sc, stride, sum);
  if (D == 64 && G == 1) return weigh_values_g<1, 4, KV>(t, sc, stride, sum);
  if (D == 64 && G == 2) return weigh_values_g<2, 4, KV>(t, sc, stride, sum);
  if (D == 64 && G == 4) return weigh_values_g<4, 4, KV>(t, sc, stride, sum);
  if (D == 128 && G == 4) return weigh_values_g<4, 8, KV>(t, sc, stride, sum);
  if (D == 128 && G == 2) return weigh_values_g<2, 8, KV>(t, sc, stride, sum);
  if (D == 16 && G == 2) return weigh_values_g<2, 1, KV>(t, sc, stride, sum);
  if (D % 64 == 0 && G <= 4)  // other head sizes in 64-dimension parts (Gemma 3: D 256, G 4)
    switch (G) {
      case 1: return weigh_values_parts_g<1, 4, KV>(t, D, sc, stride, sum);
      case 2: return weigh_values_parts_g<2, 4, KV>(t, D, sc, stride, sum);
      case 3: return weigh_values_parts_g<3, 4, KV>(t, D, sc, stride, sum);
      default: return weigh_values_parts_g<4, 4, KV>(t, D, sc, stride, sum);
    }
  return weigh_values_ref<KV>(t, D, G, sc, stride, sum);
}
VS_ATTEND(score_tiles, weigh_values, score_pair)

}  // namespace avx512

const Kernels kernels_avx512 = {"avx512", ISA_AVX512, avx512::attend, avx512::attend_pair, avx512::silu_mul_lanes<avx512::F16>, avx512::quantize_row,
                                avx512::rms_norm};

}  // namespace vs
