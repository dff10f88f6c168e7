// AVX-512 (F, BW, VL, VNNI) + F16C kernels. Lane r of a register is output row r of a
// 16-row panel, so one output's reduction is the same fmaf sequence as the scalar
// reference (kernels_generic.inc: matmul_ref). Integer block dots: vpdpbusd (u8 x s8).
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

static inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int TT>
static inline void q4_panel(const uint8_t* pw, const QAct& a, int t0, __m512* acc) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int b = 0; b < a.nb; b++) {
    const uint8_t* blk = pw + (size_t)b * Q4_PANEL_BLOCK;
    _mm_prefetch((const char*)blk + 2048, _MM_HINT_T0);
    _mm_prefetch((const char*)blk + 2048 + 64, _MM_HINT_T0);
    _mm_prefetch((const char*)blk + 2048 + 128, _MM_HINT_T0);
    _mm_prefetch((const char*)blk + 2048 + 192, _MM_HINT_T0);
    _mm_prefetch((const char*)blk + 2048 + 256, _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
    __m512i w[8];
    for (int c = 0; c < 4; c++) {
      const __m512i raw = _mm512_loadu_si512((const void*)(blk + 64 + 64 * c));
      w[c] = _mm512_and_si512(raw, m4);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
    for (int t = 0; t < TT; t++) {
      const size_t row = (size_t)(t0 + t);
      const int8_t* xq = a.q + row * a.cols + b * QK;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xq));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4(xq + 4));
      s0 = _mm512_dpbusd_epi32(s0, w[2], bcast4(xq + 8));
      s1 = _mm512_dpbusd_epi32(s1, w[3], bcast4(xq + 12));
      s0 = _mm512_dpbusd_epi32(s0, w[4], bcast4(xq + 16));
      s1 = _mm512_dpbusd_epi32(s1, w[5], bcast4(xq + 20));
      s0 = _mm512_dpbusd_epi32(s0, w[6], bcast4(xq + 24));
      s1 = _mm512_dpbusd_epi32(s1, w[7], bcast4(xq + 28));
      const __m512i isum = _mm512_add_epi32(s0, s1);  // integer: any grouping is exact
      const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + b]), sx = _mm512_set1_ps(a.s[row * a.nb + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), acc[t]);
      acc[t] = _mm512_fmadd_ps(mw, sx, acc[t]);
    }
  }
}

template <int TT>
static inline void q8_panel(const uint8_t* pw, const QAct& a, int t0, __m512* acc) {
  for (int b = 0; b < a.nb; b++) {
    const uint8_t* blk = pw + (size_t)b * Q8_PANEL_BLOCK;
    for (int i = 0; i < 9; i++) _mm_prefetch((const char*)blk + 4096 + 64 * i, _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    __m512i w[8];
    for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void*)(blk + 32 + 64 * g));
    for (int t = 0; t < TT; t++) {
      const size_t row = (size_t)(t0 + t);
      const int8_t* xq = a.q + row * a.cols + b * QK;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[g], bcast4(xq + 4 * g));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], bcast4(xq + 4 * g + 4));
      }
      // weights are stored + 128: subtract 128 * sum(x) to get sum(w * x) exactly
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * a.qsum[row * a.nb + b]));
      const __m512 dx = _mm512_set1_ps(a.d[row * a.nb + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), acc[t]);
    }
  }
}

template <int TT>
static inline void f32_panel(const uint8_t* pw, int cols, const QAct& a, int t0, __m512* acc) {
  const float* wp = (const float*)pw;
  for (int k = 0; k < cols; k++) {
    const __m512 wk = _mm512_loadu_ps(wp + (size_t)k * PANEL);
    for (int t = 0; t < TT; t++) acc[t] = _mm512_fmadd_ps(wk, _mm512_set1_ps(a.x[(size_t)(t0 + t) * a.cols + k]), acc[t]);
  }
}

template <int TT>
static void tile(const Matrix& w, int p, const QAct& a, int t0, float* out, int ldo) {
  const uint8_t* pw = w.data + (size_t)p * w.panel_bytes;
  __m512 acc[TT];
  for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
  if (w.fmt == Q4) q4_panel<TT>(pw, a, t0, acc);
  else if (w.fmt == Q8) q8_panel<TT>(pw, a, t0, acc);
  else f32_panel<TT>(pw, w.cols, a, t0, acc);
  const int row0 = p * PANEL;
  const int valid = w.rows - row0 < PANEL ? w.rows - row0 : PANEL;
  const __mmask16 m = (__mmask16)((1u << valid) - 1u);
  for (int t = 0; t < TT; t++) {
    __m512 y = acc[t];
    if (w.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, w.bias + row0));
    _mm512_mask_storeu_ps(out + (size_t)(t0 + t) * ldo + row0, m, y);
  }
}

// Scores of whole 64-slot tiles: lanes are keys, and each lane is the fmaf chain over d.
// All G heads of the kv head share the key loads (G a template argument: registers).
template <int G, class KV>
static void score_tiles_g(const AttnTask& t, int D, int tiles, float* sc, int stride) {
  for (int tile = 0; tile < tiles; tile++) {
    const KV* kt = (const KV*)t.kt + (size_t)tile * D * 64;
    __m512 acc[G][4];
    for (int h = 0; h < G; h++)
      for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
      const __m512 k0 = load16(kt + d * 64), k1 = load16(kt + d * 64 + 16);
      const __m512 k2 = load16(kt + d * 64 + 32), k3 = load16(kt + d * 64 + 48);
      for (int h = 0; h < G; h++) {
        const __m512 q = _mm512_set1_ps(t.q[(size_t)h * D + d]);
        acc[h][0] = _mm512_fmadd_ps(q, k0, acc[h][0]);
        acc[h][1] = _mm512_fmadd_ps(q, k1, acc[h][1]);
        acc[h][2] = _mm512_fmadd_ps(q, k2, acc[h][2]);
        acc[h][3] = _mm512_fmadd_ps(q, k3, acc[h][3]);
      }
    }
    for (int h = 0; h < G; h++)
      for (int i = 0; i < 4; i++) _mm512_storeu_ps(sc + (size_t)h * stride + tile * 64 + 16 * i, acc[h][i]);
  }
}

template <class KV>
static void score_tiles(const AttnTask& t, int D, int G, int tiles, float* sc, int stride) {
  switch (G) {
    case 1: return score_tiles_g<1, KV>(t, D, tiles, sc, stride);
    case 2: return score_tiles_g<2, KV>(t, D, tiles, sc, stride);
    case 3: return score_tiles_g<3, KV>(t, D, tiles, sc, stride);
    case 4: return score_tiles_g<4, KV>(t, D, tiles, sc, stride);
    default: return score_tiles_ref<KV>(t, D, G, tiles, sc, stride);
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

template <class KV>
static void weigh_values(const AttnTask& t, int D, int G, const float* sc, int stride, float* sum) {
  if (D == 64 && G == 3) return weigh_values_g<3, 4, KV>(t, sc, stride, sum);
  if (D == 64 && G == 1) return weigh_values_g<1, 4, KV>(t, sc, stride, sum);
  if (D == 64 && G == 2) return weigh_values_g<2, 4, KV>(t, sc, stride, sum);
  if (D == 64 && G == 4) return weigh_values_g<4, 4, KV>(t, sc, stride, sum);
  if (D == 128 && G == 4) return weigh_values_g<4, 8, KV>(t, sc, stride, sum);
  if (D == 128 && G == 2) return weigh_values_g<2, 8, KV>(t, sc, stride, sum);
  if (D == 16 && G == 2) return weigh_values_g<2, 1, KV>(t, sc, stride, sum);
  return weigh_values_ref<KV>(t, D, G, sc, stride, sum);
}
VS_ATTEND(score_tiles, weigh_values)

static void matmul(const Matrix& w, int p0, int p1, const QAct& a, int T, float* out, int ldo) {
  for (int p = p0; p < p1; p++) {
    int t = 0;
    for (; t + 8 <= T; t += 8) tile<8>(w, p, a, t, out, ldo);  // one weight unpack serves 8 tokens
    for (; t + 4 <= T; t += 4) tile<4>(w, p, a, t, out, ldo);
    switch (T - t) {
      case 3: tile<3>(w, p, a, t, out, ldo); break;
      case 2: tile<2>(w, p, a, t, out, ldo); break;
      case 1: tile<1>(w, p, a, t, out, ldo); break;
      default: break;
    }
  }
}
}  // namespace avx512

const Kernels kernels_avx512 = {"avx512", avx512::matmul, avx512::attend, avx512::silu_mul, avx512::quantize_row,
                                avx512::rms_norm};

}  // namespace vs
