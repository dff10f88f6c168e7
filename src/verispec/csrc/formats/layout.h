// Building blocks of the panel layouts (ISA-independent): how 16 rows of one 32-column
// block sit in memory so that SIMD lane r is output row r, and the scalar reference's
// matmul driver. Every format file composes its panel block from these pieces.
//
//   HALF16 (32 B)   fp16 value of each lane: [16] IEEE halves (d, dmin, Q4_1's m, ...).
//   N4    (256 B)   low 4 bits of 16 x 32 weights: 4 chunks of 64 bytes; chunk c, lane r,
//                   byte t holds q[r][4c+t] in its low nibble and q[r][16+4c+t] in its high
//                   nibble. So chunk c unpacks to two registers: columns 4c..4c+3 and
//                   16+4c..16+4c+3, each lane holding 4 consecutive weights (vpdpbusd order).
//   H1     (64 B)   bit 4 (5-bit formats): byte 4r+t, bit c = bit 4 of q[r][4c+t], bit 4+c =
//                   bit 4 of q[r][16+4c+t]. A 16-bit shift and a mask move bit c to bit 4.
//   H2    (128 B)   bits 4-5 (6-bit formats): two 64-byte vectors, columns 0..15 then 16..31;
//                   byte 4r+t, bits 2c..2c+1 = bits 4-5 of q[r][4c+t] (resp. q[r][16+4c+t]).
//   Q8G   (512 B)   8 groups of 64 bytes: group g, lane r, byte t = q[r][4g+t] + 128 (u8).
//   N2    (128 B)   low 2 bits of 16 x 32 weights (2- and 3-bit formats): 2 chunks of 64 bytes;
//                   chunk c, lane r, byte t, bits 2s..2s+1 = q[r][8s+4c+t] (s = 0..3). So chunk
//                   c unpacks to four registers, group g = c + 2s holding columns 4g..4g+3.
#pragma once
#include <cstring>
#include <type_traits>

#include "../vs.h"

namespace vs {
namespace layout {

constexpr int HALF16_BYTES = 2 * PANEL, N4_BYTES = 256, H1_BYTES = 64, H2_BYTES = 128, Q8G_BYTES = 512;

// How far ahead of the block being multiplied the kernels prefetch its matrix: 8 KB. At 2 KB the
// lines of a verify's compute-bound tile (T = 4..8 tokens) arrived after they were needed, so
// its compute never overlapped the weight stream (Qwen2.5-Coder 1.5B, AVX-512 Zen 5, 2 threads,
// context 512: t(1) 32.2 -> 29.5 ms, t(4) 50.0 -> 36.4, t(8) 76.7 -> 59.3; 16 KB was no better).
constexpr int PREFETCH_AHEAD = 8192;

inline uint16_t get_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void put_half(uint8_t* h16, int r, const uint8_t* src) { std::memcpy(h16 + 2 * r, src, 2); }
inline float get_half(const uint8_t* h16, int r) { return half_to_float(get_u16(h16 + 2 * r)); }

inline int n4_byte(int r, int k) { return ((k & 15) >> 2) * 64 + r * 4 + (k & 3); }
inline void n4_put(uint8_t* n4, int r, int k, int q) {
  uint8_t& b = n4[n4_byte(r, k)];
  b = k < 16 ? (uint8_t)((b & 0xF0) | (q & 15)) : (uint8_t)((b & 0x0F) | ((q & 15) << 4));
}
inline int n4_get(const uint8_t* n4, int r, int k) {
  const uint8_t b = n4[n4_byte(r, k)];
  return k < 16 ? (b & 15) : (b >> 4);
}

inline int h1_shift(int k) { return (k < 16 ? 0 : 4) + ((k & 15) >> 2); }
inline void h1_put(uint8_t* h1, int r, int k, int q) { h1[r * 4 + (k & 3)] |= (uint8_t)(((q >> 4) & 1) << h1_shift(k)); }
inline int h1_get(const uint8_t* h1, int r, int k) { return ((h1[r * 4 + (k & 3)] >> h1_shift(k)) & 1) << 4; }

inline int h2_byte(int r, int k) { return (k < 16 ? 0 : 64) + r * 4 + (k & 3); }
inline void h2_put(uint8_t* h2, int r, int k, int q) { h2[h2_byte(r, k)] |= (uint8_t)(((q >> 4) & 3) << (2 * ((k & 15) >> 2))); }
inline int h2_get(const uint8_t* h2, int r, int k) { return ((h2[h2_byte(r, k)] >> (2 * ((k & 15) >> 2))) & 3) << 4; }

inline int q8g_byte(int r, int k) { return (k >> 2) * 64 + r * 4 + (k & 3); }

constexpr int N2_BYTES = 128;
inline int n2_byte(int r, int k) { return ((k >> 2) & 1) * 64 + r * 4 + (k & 3); }
inline void n2_put(uint8_t* n2, int r, int k, int q) { n2[n2_byte(r, k)] |= (uint8_t)((q & 3) << (2 * (k >> 3))); }
inline int n2_get(const uint8_t* n2, int r, int k) { return (n2[n2_byte(r, k)] >> (2 * (k >> 3))) & 3; }

// The scalar reference driver: K::dot(panel, cols, r, a, t) is the fp32 accumulation of
// lane r of the panel against token t, in the format's one fixed order of operations.
template <class K>
void matmul_ref(const Matrix& w, int p0, int p1, const QAct& a, int T, float* out, int ldo) {
  for (int p = p0; p < p1; p++) {
    const uint8_t* pw = w.data + (size_t)p * w.panel_bytes;
    for (int t = 0; t < T; t++)
      for (int r = 0; r < PANEL && p * PANEL + r < w.rows; r++) {
        const int row = p * PANEL + r;
        const float acc = K::dot(pw, w.cols, r, a, t);
        out[(size_t)t * ldo + row] = w.bias ? acc + w.bias[row] : acc;
      }
  }
}

// Tokens per chunk of a long product (a prefill): the drivers run a chunk of tokens through all their
// panels before the next chunk, so the chunk's int8 activations (tokens x cols bytes, at most
// CHUNK_ACT_BYTES) stay in the core's L2 while the weight panels stream past; token-outer order
// would read every token's activations once per 16-row panel from the last-level cache instead.
// A multiple of `tile` tokens, so a chunk splits into the same tiles as before. Order of work only:
// every output is the same sequence of operations.
constexpr int CHUNK_ACT_BYTES = 256 * 1024;
inline int chunk_tokens(int cols, int tile) {
  const int n = CHUNK_ACT_BYTES / cols / tile * tile;
  return n > tile ? n : tile;
}

// The int8 activations of token t, block b.
inline const int8_t* act_q(const QAct& a, int t, int b) { return a.q + (size_t)t * a.cols + (size_t)b * QK; }
// The activation rows of TT tokens from t0, found once per tile: a kernel's block loop then indexes
// them by block, with no multiply by the row strides per block and token (the scalar work of those
// multiplies held the 8-token AVX-512 tiles below the multiply pipes' rate)
template <int TT>
struct ActRows {
  const int8_t* q[TT];
  const float* d[TT];
  const float* s[TT];
  const int32_t* qsum[TT];
  const int32_t* qsum16[TT];  // [2 nb]
  ActRows(const QAct& a, int t0) {
    for (int t = 0; t < TT; t++) {
      const size_t row = (size_t)(t0 + t);
      q[t] = a.q + row * a.cols;
      d[t] = a.d + row * a.nb;
      s[t] = a.s + row * a.nb;
      qsum[t] = a.qsum + row * a.nb;
      qsum16[t] = a.qsum16 + row * 2 * a.nb;
    }
  }
};

}  // namespace layout
}  // namespace vs

// Target regions of the SIMD kernels inside a format file (the file itself is compiled for
// baseline x86-64; only these regions may use AVX2 / AVX-512 instructions).
#define VS_BEGIN_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define VS_BEGIN_AVX512 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c\")")
#define VS_END_TARGET _Pragma("GCC pop_options")
