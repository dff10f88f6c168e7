// AVX-512 (F, BW, VL, VNNI) building blocks of the format kernels and their matmul driver.
// Include between VS_BEGIN_AVX512 and VS_END_TARGET (formats/layout.h), in a namespace of the format's own.
// Lane r of a register is output row r of a 16-row panel, so one output's reduction is the
// same fmaf sequence as the scalar reference. Integer block dots: vpdpbusd (u8 x s8), exact.

static inline __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512 u8x16(const uint8_t* p) {  // 16 unsigned bytes -> 16 floats (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512i i8x16_epi32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline __m512 negate(__m512 x) {  // sign flip, as the scalar -(x)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}
static inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
static inline void prefetch(const uint8_t* p, int lines) {
  for (int i = 0; i < lines; i++) _mm_prefetch((const char*)p + 64 * i, _MM_HINT_T0);
}

// N4 block -> w[c] = columns 4c..4c+3, w[4+c] = columns 16+4c.. (u8 0..15)
static inline void n4_unpack(const uint8_t* n4, __m512i* w) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; c++) {
    const __m512i raw = _mm512_loadu_si512((const void*)(n4 + 64 * c));
    w[c] = _mm512_and_si512(raw, m4);
    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
  }
}
// H1 plane: bit 4 of each weight (layout.h)
static inline void h1_add(const uint8_t* h1, __m512i* w) {
  const __m512i b4 = _mm512_set1_epi8(0x10), h = _mm512_loadu_si512((const void*)h1);
  w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), b4));
  w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(h, 3), b4));
  w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(h, 2), b4));
  w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(h, 1), b4));
  w[4] = _mm512_or_si512(w[4], _mm512_and_si512(h, b4));
  w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(h, 1), b4));
  w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(h, 2), b4));
  w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(h, 3), b4));
}
// H2 plane: bits 4-5 of each weight (layout.h)
static inline void h2_add(const uint8_t* h2, __m512i* w) {
  const __m512i b45 = _mm512_set1_epi8(0x30);
  for (int half = 0; half < 2; half++) {
    const __m512i h = _mm512_loadu_si512((const void*)(h2 + 64 * half));
    __m512i* o = w + 4 * half;
    o[0] = _mm512_or_si512(o[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), b45));
    o[1] = _mm512_or_si512(o[1], _mm512_and_si512(_mm512_slli_epi16(h, 2), b45));
    o[2] = _mm512_or_si512(o[2], _mm512_and_si512(h, b45));
    o[3] = _mm512_or_si512(o[3], _mm512_and_si512(_mm512_srli_epi16(h, 2), b45));
  }
}
// N2 plane: bits 0-1 of each weight (layout.h) -> w[g] = columns 4g..4g+3 (u8 0..3)
static inline void n2_unpack(const uint8_t* n2, __m512i* w) {
  const __m512i m2 = _mm512_set1_epi8(0x03);
  for (int c = 0; c < 2; c++) {
    const __m512i raw = _mm512_loadu_si512((const void*)(n2 + 64 * c));
    w[c] = _mm512_and_si512(raw, m2);
    w[c + 2] = _mm512_and_si512(_mm512_srli_epi16(raw, 2), m2);
    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m2);
    w[c + 6] = _mm512_and_si512(_mm512_srli_epi16(raw, 6), m2);
  }
}

// sum over the 32 columns of a block: w[c] (columns 4c..) x activations, int32 per lane
static inline __m512i dot_n4(const __m512i* w, const int8_t* xq) {
  __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xq));
  __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4(xq + 4));
  s0 = _mm512_dpbusd_epi32(s0, w[2], bcast4(xq + 8));
  s1 = _mm512_dpbusd_epi32(s1, w[3], bcast4(xq + 12));
  s0 = _mm512_dpbusd_epi32(s0, w[4], bcast4(xq + 16));
  s1 = _mm512_dpbusd_epi32(s1, w[5], bcast4(xq + 20));
  s0 = _mm512_dpbusd_epi32(s0, w[6], bcast4(xq + 24));
  s1 = _mm512_dpbusd_epi32(s1, w[7], bcast4(xq + 28));
  return _mm512_add_epi32(s0, s1);  // integer: any grouping is exact
}
// the same, split into columns 0..15 (lo) and 16..31 (hi)
static inline void dot_n4_halves(const __m512i* w, const int8_t* xq, __m512i& lo, __m512i& hi) {
  lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xq));
  hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], bcast4(xq + 16));
  lo = _mm512_dpbusd_epi32(lo, w[1], bcast4(xq + 4));
  hi = _mm512_dpbusd_epi32(hi, w[5], bcast4(xq + 20));
  lo = _mm512_dpbusd_epi32(lo, w[2], bcast4(xq + 8));
  hi = _mm512_dpbusd_epi32(hi, w[6], bcast4(xq + 24));
  lo = _mm512_dpbusd_epi32(lo, w[3], bcast4(xq + 12));
  hi = _mm512_dpbusd_epi32(hi, w[7], bcast4(xq + 28));
}

// The driver: K::panel<TT>(panel, cols, a, t0, acc) accumulates TT tokens from t0; one
// weight unpack serves up to 8 tokens.
template <class K, int TT>
static inline void tile(const Matrix& w, int p, const QAct& a, int t0, float* out, int ldo) {
  __m512 acc[TT];
  for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
  K::template panel<TT>(w.data + (size_t)p * w.panel_bytes, w.cols, a, t0, acc);
  const int row0 = p * PANEL;
  const int valid = w.rows - row0 < PANEL ? w.rows - row0 : PANEL;
  const __mmask16 m = (__mmask16)((1u << valid) - 1u);
  for (int t = 0; t < TT; t++) {
    __m512 y = acc[t];
    if (w.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, w.bias + row0));
    _mm512_mask_storeu_ps(out + (size_t)(t0 + t) * ldo + row0, m, y);
  }
}

template <class K>
static void matmul(const Matrix& w, int p0, int p1, const QAct& a, int T, float* out, int ldo) {
  const int chunk = chunk_tokens(a.cols, 16);  // tokens per chunk (layout.h): their activations stay in L2
  for (int c0 = 0; c0 < T; c0 += chunk)
  for (int p = p0; p < p1; p++) {
    const int c1 = T - c0 < chunk ? T : c0 + chunk;
    int t = c0;  // tiles of 16 and 8 tokens, then one tile of the rest: a verify of k + 1 <= 8 tokens unpacks once
    for (; t + 16 <= c1; t += 16) tile<K, 16>(w, p, a, t, out, ldo);
    for (; t + 8 <= c1; t += 8) tile<K, 8>(w, p, a, t, out, ldo);
    switch (c1 - t) {
      case 7: tile<K, 7>(w, p, a, t, out, ldo); break;
      case 6: tile<K, 6>(w, p, a, t, out, ldo); break;
      case 5: tile<K, 5>(w, p, a, t, out, ldo); break;
      case 4: tile<K, 4>(w, p, a, t, out, ldo); break;
      case 3: tile<K, 3>(w, p, a, t, out, ldo); break;
      case 2: tile<K, 2>(w, p, a, t, out, ldo); break;
      case 1: tile<K, 1>(w, p, a, t, out, ldo); break;
      default: break;
    }
  }
}
