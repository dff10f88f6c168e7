// AVX2 + FMA + F16C kernels. A 16-row panel is two 8-lane halves; lane r of a half is
// output row r, so one output's reduction is the same fmaf sequence as the scalar
// reference (kernels_generic.inc: matmul_ref). Integer block dots: vpmaddubsw/vpmaddwd.
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

static inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Q4 panel half (8 rows): acc[t] for TT tokens starting at t0.
template <int TT>
static inline void q4_half(const uint8_t* pw, int h, const QAct& a, int t0, __m256* acc) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int b = 0; b < a.nb; b++) {
    const uint8_t* blk = pw + (size_t)b * Q4_PANEL_BLOCK;
    _mm_prefetch((const char*)blk + 2048, _MM_HINT_T0);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * h)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 32 + 16 * h)));
    __m256i w[8];
    for (int c = 0; c < 4; c++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + 64 + 64 * c + 32 * h));
      w[c] = _mm256_and_si256(raw, m4);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    }
    for (int t = 0; t < TT; t++) {
      const size_t row = (size_t)(t0 + t);
      const int8_t* xq = a.q + row * a.cols + b * QK;
      // 8 products of <= 15 * 127 * 2 per int16 lane stay below 32767: exact
      __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(xq));
      for (int g = 1; g < 8; g++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g], bcast4(xq + 4 * g)));
      const __m256i isum = _mm256_madd_epi16(s16, ones);
      const __m256 dx = _mm256_set1_ps(a.d[row * a.nb + b]), sx = _mm256_set1_ps(a.s[row * a.nb + b]);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum), acc[t]);
      acc[t] = _mm256_fmadd_ps(mw, sx, acc[t]);
    }
  }
}

template <int TT>
static inline void q8_half(const uint8_t* pw, int h, const QAct& a, int t0, __m256* acc) {
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  for (int b = 0; b < a.nb; b++) {
    const uint8_t* blk = pw + (size_t)b * Q8_PANEL_BLOCK;
    _mm_prefetch((const char*)blk + 2048, _MM_HINT_T0);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * h)));
    __m256i wa[8], ws[8];  // |w| and w (signed), for vpmaddubsw(|w|, sign(x, w))
    for (int g = 0; g < 8; g++) {
      ws[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + 32 + 64 * g + 32 * h)), flip);
      wa[g] = _mm256_abs_epi8(ws[g]);
    }
    for (int t = 0; t < TT; t++) {
      const size_t row = (size_t)(t0 + t);
      const int8_t* xq = a.q + row * a.cols + b * QK;
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

template <int TT>
static inline void f32_half(const uint8_t* pw, int h, int cols, const QAct& a, int t0, __m256* acc) {
  const float* wp = (const float*)pw + 8 * h;
  for (int k = 0; k < cols; k++) {
    const __m256 wk = _mm256_loadu_ps(wp + (size_t)k * PANEL);
    for (int t = 0; t < TT; t++) acc[t] = _mm256_fmadd_ps(wk, _mm256_set1_ps(a.x[(size_t)(t0 + t) * a.cols + k]), acc[t]);
  }
}

template <int TT>
static void tile(const Matrix& w, int p, const QAct& a, int t0, float* out, int ldo) {
  const uint8_t* pw = w.data + (size_t)p * w.panel_bytes;
  for (int h = 0; h < 2; h++) {
    __m256 acc[TT];
    for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    if (w.fmt == Q4) q4_half<TT>(pw, h, a, t0, acc);
    else if (w.fmt == Q8) q8_half<TT>(pw, h, a, t0, acc);
    else f32_half<TT>(pw, h, w.cols, a, t0, acc);
    const int row0 = p * PANEL + 8 * h;
    for (int t = 0; t < TT; t++) {
      float* o = out + (size_t)(t0 + t) * ldo + row0;
      __m256 y = acc[t];
      if (w.bias && row0 + 8 <= w.rows) y = _mm256_add_ps(y, _mm256_loadu_ps(w.bias + row0));
      if (row0 + 8 <= w.rows) {
        _mm256_storeu_ps(o, y);
      } else {  // the matrix's last, partial panel
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, y);
        for (int r = 0; r < 8 && row0 + r < w.rows; r++) o[r] = w.bias ? tmp[r] + w.bias[row0 + r] : tmp[r];
      }
    }
  }
}

// Scores of whole 64-slot tiles: lanes are keys, and each lane is the fmaf chain over d.
// All G heads of the kv head share the key loads; 16 keys per pass keep the G * 2
// accumulators in AVX2's 16 registers.
template <int G, class KV>
static void score_tiles_g(const AttnTask& t, int D, int tiles, float* sc, int stride) {
  for (int tile = 0; tile < tiles; tile++) {
    const KV* kt = (const KV*)t.kt + (size_t)tile * D * 64;
    for (int part = 0; part < 4; part++) {
      __m256 acc[G][2];
      for (int h = 0; h < G; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
      for (int d = 0; d < D; d++) {
        const KV* kd = kt + d * 64 + 16 * part;
        const __m256 k0 = load8(kd), k1 = load8(kd + 8);
        for (int h = 0; h < G; h++) {
          const __m256 q = _mm256_set1_ps(t.q[(size_t)h * D + d]);
          acc[h][0] = _mm256_fmadd_ps(q, k0, acc[h][0]);
          acc[h][1] = _mm256_fmadd_ps(q, k1, acc[h][1]);
        }
      }
      for (int h = 0; h < G; h++)
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(sc + (size_t)h * stride + tile * 64 + 16 * part + 8 * i, acc[h][i]);
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
      default: break;
    }
  }
  return weigh_values_ref<KV>(t, D, G, sc, stride, sum);
}
VS_ATTEND(score_tiles, weigh_values)

static void matmul(const Matrix& w, int p0, int p1, const QAct& a, int T, float* out, int ldo) {
  for (int p = p0; p < p1; p++) {
    int t = 0;
    for (; t + 4 <= T; t += 4) tile<4>(w, p, a, t, out, ldo);
    switch (T - t) {
      case 3: tile<3>(w, p, a, t, out, ldo); break;
      case 2: tile<2>(w, p, a, t, out, ldo); break;
      case 1: tile<1>(w, p, a, t, out, ldo); break;
      default: break;
    }
  }
}
}  // namespace avx2

const Kernels kernels_avx2 = {"avx2", avx2::matmul, avx2::attend, avx2::silu_mul, avx2::quantize_row, avx2::rms_norm};

}  // namespace vs
