// AVX2 + FMA + F16C building blocks of the format kernels and their matmul driver.
// Include between VS_BEGIN_AVX2 and VS_END_TARGET (formats/layout.h), in a namespace of the format's own.
// A 16-row panel is two 8-lane halves h; lane r of a half is output row 8h + r, so one
// output's reduction is the same fmaf sequence as the scalar reference. Integer block dots:
// vpmaddubsw (u8 x s8 pairs into int16) then vpmaddwd into int32; each format says how many
// int16 pair sums it may add before widening so that no int16 sum can overflow.

static inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline __m256 u8x8(const uint8_t* p) {  // 8 unsigned bytes -> 8 floats (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline __m256i i8x8_epi32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256 negate(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// An optimization barrier on one register: GCC's reassociation would otherwise rewrite a running
// sum of vpmaddubsw products into a tree over all of them, keeping every product live (spilled
// to the stack: 76 extra moves per Q4_K block of 4 tokens). The sum's value is the same.
static inline void in_register(__m256i& x) { asm("" : "+x"(x)); }
static inline void prefetch(const uint8_t* p, int lines) {
  for (int i = 0; i < lines; i++) _mm_prefetch((const char*)p + 64 * i, _MM_HINT_T0);
}

// N4 block, half h -> w[c] = columns 4c..4c+3, w[4+c] = columns 16+4c.. (u8 0..15)
static inline void n4_unpack(const uint8_t* n4, int h, __m256i* w) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; c++) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(n4 + 64 * c + 32 * h));
    w[c] = _mm256_and_si256(raw, m4);
    w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  }
}
static inline void h1_add(const uint8_t* h1, int h, __m256i* w) {
  const __m256i b4 = _mm256_set1_epi8(0x10), x = _mm256_loadu_si256((const __m256i*)(h1 + 32 * h));
  w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(x, 4), b4));
  w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(x, 3), b4));
  w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(x, 2), b4));
  w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(x, 1), b4));
  w[4] = _mm256_or_si256(w[4], _mm256_and_si256(x, b4));
  w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(x, 1), b4));
  w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(x, 2), b4));
  w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(x, 3), b4));
}
static inline void h2_add(const uint8_t* h2, int h, __m256i* w) {
  const __m256i b45 = _mm256_set1_epi8(0x30);
  for (int half = 0; half < 2; half++) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(h2 + 64 * half + 32 * h));
    __m256i* o = w + 4 * half;
    o[0] = _mm256_or_si256(o[0], _mm256_and_si256(_mm256_slli_epi16(x, 4), b45));
    o[1] = _mm256_or_si256(o[1], _mm256_and_si256(_mm256_slli_epi16(x, 2), b45));
    o[2] = _mm256_or_si256(o[2], _mm256_and_si256(x, b45));
    o[3] = _mm256_or_si256(o[3], _mm256_and_si256(_mm256_srli_epi16(x, 2), b45));
  }
}
// N2 block, half h -> w[g] = columns 4g..4g+3 (u8 0..3)
static inline void n2_unpack(const uint8_t* n2, int h, __m256i* w) {
  const __m256i m2 = _mm256_set1_epi8(0x03);
  for (int c = 0; c < 2; c++) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(n2 + 64 * c + 32 * h));
    w[c] = _mm256_and_si256(raw, m2);
    w[c + 2] = _mm256_and_si256(_mm256_srli_epi16(raw, 2), m2);
    w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m2);
    w[c + 6] = _mm256_and_si256(_mm256_srli_epi16(raw, 6), m2);
  }
}

// sum over groups [G0, G0 + N) of w[g] (u8) x activations 4g..4g+3 (s8), int32 per lane;
// PER16 groups' pair sums are added in int16 before widening (the caller's overflow bound).
template <int G0, int N, int PER16>
static inline __m256i dot_groups(const __m256i* w, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i isum = _mm256_setzero_si256();
  for (int g = G0; g < G0 + N; g += PER16) {
    __m256i s16 = _mm256_maddubs_epi16(w[g], bcast4(xq + 4 * g));
    for (int i = 1; i < PER16; i++) {
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g + i], bcast4(xq + 4 * (g + i))));
      in_register(s16);
    }
    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, ones));
  }
  return isum;
}

// TT tokens' block dots for BOTH halves of an N4 block (16 rows x 32 columns) in one pass over
// its bytes: each 64-byte chunk is unpacked once into four registers (two halves x low/high
// nibbles) that serve every token, and each activation group is broadcast once for the two
// halves. isum[t][h] is the integer of n4_unpack(h) + dot_groups<0, 8, PER16> for token t (an
// integer sum whose partial sums never overflow: any order gives the same value). With
// PER16 = 8 and TT <= 4, the 2 * TT int16 sums, 4 weights and 2 activations fit 16 registers.
// With an H1 plane h1 (5-bit formats), each weight gets its bit 4 from it (h1_add's values).
template <int PER16, int TT>
static inline void dot_n4_both(const uint8_t* n4, const int8_t* const* xq, __m256i (*isum)[2], const uint8_t* h1 = nullptr) {
  static_assert(PER16 % 2 == 0 && 8 % PER16 == 0, "two groups (a chunk's low and high nibbles) per step");
  const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  __m256i s[TT][2];
  for (int t = 0; t < TT; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();
  #pragma GCC unroll 4
  for (int c = 0; c < 4; c++) {
    const __m256i r0 = _mm256_loadu_si256((const __m256i*)(n4 + 64 * c));
    const __m256i r1 = _mm256_loadu_si256((const __m256i*)(n4 + 64 * c + 32));
    // [h]: columns 4c.. (low nibbles) and 16 + 4c.. (high nibbles) of half h
    __m256i lo[2] = {_mm256_and_si256(r0, m4), _mm256_and_si256(r1, m4)};
    __m256i hi[2] = {_mm256_and_si256(_mm256_srli_epi16(r0, 4), m4), _mm256_and_si256(_mm256_srli_epi16(r1, 4), m4)};
    if (h1) {  // bit c of an H1 byte -> bit 4 of column 4c + t, bit 4 + c -> bit 4 of column 16 + 4c + t
      for (int h = 0; h < 2; h++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(h1 + 32 * h));
        lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(_mm256_slli_epi16(x, 4 - c), b4));
        hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(_mm256_srli_epi16(x, c), b4));
      }
    }
    #pragma GCC unroll 4
    for (int t = 0; t < TT; t++) {
      const __m256i xl = bcast4(xq[t] + 4 * c), xh = bcast4(xq[t] + 16 + 4 * c);
      for (int h = 0; h < 2; h++) {
        s[t][h] = _mm256_add_epi16(s[t][h], _mm256_maddubs_epi16(lo[h], xl));
        s[t][h] = _mm256_add_epi16(s[t][h], _mm256_maddubs_epi16(hi[h], xh));
        in_register(s[t][h]);
      }
    }
    if ((2 * c + 2) % PER16 == 0) {  // widen before an int16 sum could overflow
      for (int t = 0; t < TT; t++)
        for (int h = 0; h < 2; h++) {
          const __m256i wide = _mm256_madd_epi16(s[t][h], ones);
          isum[t][h] = 2 * c + 2 == PER16 ? wide : _mm256_add_epi32(isum[t][h], wide);
          s[t][h] = _mm256_setzero_si256();
        }
    }
  }
}

// A format kernel K with BOTH_TOKENS = n > 0 has K::both<TT>(panel, cols, a, t0, acc) for
// TT <= n: TT tokens from t0, both halves of the panel in one pass over its bytes, acc[2t + h]
// (each output's operations the format's scalar reference's, in its order); matmul() then tiles the
// tokens n at a time. Otherwise tile<K, TT> runs K::half<TT> once per half, 4 tokens a tile.
template <class K, class = void>
struct BothTokens : std::integral_constant<int, 0> {};
template <class K>
struct BothTokens<K, std::void_t<decltype(K::BOTH_TOKENS)>> : std::integral_constant<int, K::BOTH_TOKENS> {};

// out rows 8h..8h+7 of panel p for token t: acc (+ bias), the last panel's missing rows left out
static inline void store_half(const Matrix& w, int p, int h, __m256 acc, float* o) {
  const int row0 = p * PANEL + 8 * h;
  if (row0 + 8 <= w.rows) {
    if (w.bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(w.bias + row0));
    _mm256_storeu_ps(o + row0, acc);
  } else {  // the matrix's last, partial panel
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc);
    for (int r = 0; r < 8 && row0 + r < w.rows; r++) o[row0 + r] = w.bias ? tmp[r] + w.bias[row0 + r] : tmp[r];
  }
}

// The driver: K::half<TT>(panel, h, cols, a, t0, acc) accumulates TT tokens from t0 for
// rows 8h..8h+7 of the panel (or K::both<TT>, both halves).
template <class K, int TT>
static inline void tile(const Matrix& w, int p, const QAct& a, int t0, float* out, int ldo) {
  const uint8_t* pw = w.data + (size_t)p * w.panel_bytes;
  if constexpr (TT <= BothTokens<K>::value) {
    __m256 acc[2 * TT];
    for (int i = 0; i < 2 * TT; i++) acc[i] = _mm256_setzero_ps();
    K::template both<TT>(pw, w.cols, a, t0, acc);
    for (int t = 0; t < TT; t++)
      for (int h = 0; h < 2 && p * PANEL + 8 * h < w.rows; h++) store_half(w, p, h, acc[2 * t + h], out + (size_t)(t0 + t) * ldo);
  } else {
    for (int h = 0; h < 2; h++) {
      if (p * PANEL + 8 * h >= w.rows) break;
      __m256 acc[TT];
      for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
      K::template half<TT>(pw, h, w.cols, a, t0, acc);
      for (int t = 0; t < TT; t++) store_half(w, p, h, acc[t], out + (size_t)(t0 + t) * ldo);
    }
  }
}

template <class K>
static void matmul(const Matrix& w, int p0, int p1, const QAct& a, int T, float* out, int ldo) {
  // tokens per tile: K::both's register budget, else 4 (8 weight and 4 accumulator registers of 16)
  constexpr int N = BothTokens<K>::value >= 2 ? BothTokens<K>::value : 4;
  static_assert(N <= 4, "the remainder's cases below");
  const int chunk = chunk_tokens(a.cols, N);  // tokens per chunk (layout.h): their activations stay in L2
  for (int c0 = 0; c0 < T; c0 += chunk)
  for (int p = p0; p < p1; p++) {
    const int c1 = T - c0 < chunk ? T : c0 + chunk;
    int t = c0;
    for (; t + N <= c1; t += N) tile<K, N>(w, p, a, t, out, ldo);
    switch (c1 - t) {
      case 3: tile<K, 3>(w, p, a, t, out, ldo); break;
      case 2: tile<K, 2>(w, p, a, t, out, ldo); break;
      case 1: tile<K, 1>(w, p, a, t, out, ldo); break;
      default: break;
    }
  }
}
