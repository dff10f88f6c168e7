// verispec compiled CPU runtime: shared types of the forward and its kernels.
//
// Bit-exactness by construction (docs/cpu.md): every output element is produced by one
// fixed sequence of IEEE operations that depends only on that token's own inputs, never on
// how many tokens share the forward, their order, the tree layout, the thread count or the
// ISA. Matrix products are vectorised ACROSS output rows (16-row panels: lane r = row r),
// never inside one output's reduction; integer block dots are exact; blocks are accumulated
// in order with two explicit fmaf each. Built with -ffp-contract=off so the compiler never
// fuses a*b+c on its own.
#pragma once
#include <cstddef>
#include <cstdint>

namespace vs {

constexpr int PANEL = 16;  // output rows per weight panel (one AVX-512 register of fp32 lanes)
constexpr int QK = 32;     // elements per quantization block

// Weight formats of a repacked matrix.
enum Format : int { F32 = 0, Q4 = 1, Q8 = 2 };

// Bytes of one 16-row panel of one 32-column block.
//   Q4: fp16 d[16], fp16 m[16] (w = d*q + m), then 4 chunks of 64 bytes. Chunk c, lane r,
//       byte t holds q[r][4c+t] in its low nibble and q[r][16+4c+t] in its high nibble.
//   Q8: fp16 d[16] (w = d*q), then 8 groups of 64 bytes; group g, lane r, byte t holds
//       q[r][4g+t] + 128 as an unsigned byte.
//   F32: no blocks: panel = float w[cols][16] (w[k][r] = W[row r][k]).
constexpr int Q4_PANEL_BLOCK = 64 + 256;
constexpr int Q8_PANEL_BLOCK = 32 + 512;

struct Matrix {
  int fmt = F32;
  int rows = 0, cols = 0;  // logical shape [rows, cols]: out = W @ x
  int panels = 0;          // ceil(rows / 16); padding rows are zero
  size_t panel_bytes = 0;
  uint8_t* data = nullptr;  // panels * panel_bytes, 64-byte aligned
  float* bias = nullptr;    // [rows] or null
};

// Activations of T token rows, quantized per 32-block like llama.cpp's Q8_1:
// x ~= d * q, and s = d * sum(q) (for Q4's min term), qsum = sum(q) (for Q8's +128 offset).
struct QAct {
  int cols = 0, nb = 0;
  const float* x = nullptr;   // [T, cols] fp32 (F32 weights read this)
  const int8_t* q = nullptr;  // [T, cols]
  const float* d = nullptr;   // [T, nb]
  const float* s = nullptr;   // [T, nb]
  const int32_t* qsum = nullptr;  // [T, nb]
};

// One (token, kv head) attention task for its G query heads: keys are the cache slots
// 0..n_cached-1, then `n_path` slots listed in `path` (the token's visible new tokens,
// root first, itself last; ascending).
struct AttnTask {
  const float* q;       // [G][head_dim], unscaled
  const void* kt;       // K cache of its kv head: [slots / 64][head_dim][64] (transposed tiles)
  const void* v;        // V cache of its kv head: [slots][head_dim]; fp32 or fp16 (Kernels::attend)
  int n_cached;
  int n_path;
  const int32_t* path;  // [n_path] slots
  float* out;           // [G][head_dim]
};

// The per-ISA kernel table.
struct Kernels {
  const char* name;
  // out[t * ldo + row] for rows of panels [p0, p1), tokens [0, T)
  void (*matmul)(const Matrix& w, int p0, int p1, const QAct& a, int T, float* out, int ldo);
  // scratch: G * stride floats, stride >= 64 * ceil((last path slot + 1) / 64);
  // kv16: the cache holds fp16 (IEEE half) values, else fp32
  void (*attend)(const AttnTask& task, int head_dim, int G, float scale, float* scratch, int stride, bool kv16);
  void (*silu_mul)(const float* g, const float* u, float* out, int n);  // out = silu(g) * u
  void (*quantize_row)(const float* x, int cols, int8_t* q, float* d, float* s, int32_t* qsum);
  void (*rms_norm)(const float* x, const float* w, int n, float eps, float* out);
};

extern const Kernels kernels_scalar;
extern const Kernels kernels_avx2;
extern const Kernels kernels_avx512;

// fp16 <-> fp32 (exact widening; round-to-nearest-even narrowing, as F16C does)
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

}  // namespace vs
