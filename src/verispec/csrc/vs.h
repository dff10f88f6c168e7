// verispec compiled CPU runtime: shared types of the forward, its kernels and its weight formats.
//
// Bit-exactness by construction (docs/cpu.md): every output element is produced by one
// fixed sequence of IEEE operations that depends only on that token's own inputs, never on
// how many tokens share the forward, their order, the tree layout, the thread count or the
// ISA. Matrix products are vectorised ACROSS output rows (16-row panels: lane r = row r),
// never inside one output's reduction; integer block dots are exact; blocks are accumulated
// in order with explicit fmaf. Built with -ffp-contract=off so the compiler never fuses
// a*b+c on its own.
//
// The weight format is the unit (formats/): each format has one file with its panel layout,
// repack, row dequantization, scalar reference and AVX2 / AVX-512 kernels, and one row in
// the table of formats (formats/table.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

namespace vs {

constexpr int ABI_VERSION = 6;  // bump when Config, Batch, the slots or the formats change
constexpr int PANEL = 16;       // output rows per weight panel (one AVX-512 register of fp32 lanes)
constexpr int QK = 32;          // elements per activation quantization block (and per small weight block)
constexpr int QK_K = 256;       // elements per K-quant super-block
constexpr int KV_TILE_LOG2 = 6;  // K cache slots per transposed tile: [slots / KV_TILE][head_dim][KV_TILE];
constexpr int KV_TILE = 1 << KV_TILE_LOG2;  // 64. Slot s: tile s >> KV_TILE_LOG2, lane s & (KV_TILE - 1)
constexpr int MAX_GROUP = 64;   // query heads per kv head at most (attention keeps one sum per head on the stack)

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, N_ISA = 3 };

// Tensor slots of a model (vs_model_set). models/cpu.py mirrors this list and checks it at load.
enum Slot : int {
  SLOT_ATTN_NORM = 0, SLOT_FFN_NORM, SLOT_WQKV, SLOT_WO, SLOT_W13, SLOT_W2,  // per layer
  SLOT_NORM, SLOT_EMBED, SLOT_HEAD, SLOT_IN_PROJ, SLOT_IN_NORM, N_SLOTS       // per model
};

// Activations of T token rows, quantized per 32-block like llama.cpp's Q8_1:
// x ~= d * q, s = d * sum(q) (min terms), qsum = sum(q) (offset terms), qsum16 = the sums of
// each 16-element half (Q6_K's 16-weight sub-blocks).
struct QAct {
  int cols = 0, nb = 0;
  const float* x = nullptr;        // [T, cols] fp32 (F32 weights read this)
  const int8_t* q = nullptr;       // [T, cols]
  const float* d = nullptr;        // [T, nb]
  const float* s = nullptr;        // [T, nb]
  const int32_t* qsum = nullptr;   // [T, nb]
  const int32_t* qsum16 = nullptr; // [T, 2 nb]
};

struct Format;

// One weight matrix in one format, repacked into 16-row panels: out = W @ x.
struct Matrix {
  const Format* fmt = nullptr;
  int rows = 0, cols = 0;   // logical shape [rows, cols]
  int panels = 0;           // ceil(rows / 16); padding rows are zero
  size_t panel_bytes = 0;   // bytes of one panel: (cols / block_cols) * panel_block_bytes
  uint8_t* data = nullptr;  // panels * panel_bytes, 64-byte aligned
  float* bias = nullptr;    // [rows] or null
};

// out[t * ldo + row] for rows of panels [p0, p1) and tokens [0, T)
using MatmulFn = void (*)(const Matrix& w, int p0, int p1, const QAct& a, int T, float* out, int ldo);

// A weight format: a GGUF block type and how it is repacked and multiplied.
struct Format {
  const char* name;          // ggml's name, lower case: "q4_k"
  int ggml_type;             // GGML_TYPE_* id in GGUF files
  int block_cols;            // weights per source block (1 for f32)
  size_t src_block_bytes;    // bytes per source block
  size_t panel_block_bytes;  // bytes per block of 16 rows in the panel layout
  // write source row `src` (cols / block_cols blocks) into lane r of `panel`
  void (*repack_row)(const uint8_t* src, int cols, uint8_t* panel, int r);
  // lane r of `panel` as fp32 [cols] (embedding lookups)
  void (*dequant_row)(const uint8_t* panel, int cols, int r, float* out);
  MatmulFn matmul[N_ISA];    // scalar reference, AVX2, AVX-512 VNNI: bitwise equal
  // fp32 [cols] -> source blocks of this format (vs_requantize: a draft re-encoded at load);
  // null: not a re-quantization target
  void (*quantize_row)(const float* x, int cols, uint8_t* out) = nullptr;
};

const Format* format_by_type(int ggml_type);  // null if unsupported
extern const Format* const FORMATS[];
extern const int N_FORMATS;

// One (token, kv head) attention task for its G query heads: keys are the cache slots
// 0..n_cached-1, then `n_path` slots listed in `path` (the token's visible new tokens,
// root first, itself last; ascending).
struct AttnTask {
  const float* q;       // [G][head_dim], unscaled
  const void* kt;       // K cache of its kv head: [slots / KV_TILE][head_dim][KV_TILE] (transposed tiles)
  const void* v;        // V cache of its kv head: [slots][head_dim]; fp32 or fp16 (Kernels::attend)
  int n_cached;
  int n_path;
  const int32_t* path;  // [n_path] slots
  float* out;           // [G][head_dim]
};

// The per-ISA kernels other than matrix products (those belong to the formats).
struct Kernels {
  const char* name;
  Isa isa;
  // scratch: G * stride floats, stride >= KV_TILE * ceil((last path slot + 1) / KV_TILE);
  // kv16: the cache holds fp16 (IEEE half) values, else fp32
  void (*attend)(const AttnTask& task, int head_dim, int G, float scale, float* scratch, int stride, bool kv16);
  // two tasks over the same K cache (AttnTask::kt), the same bits as attend on each;
  // scratch: 2 G * stride floats (a's G rows, then b's)
  void (*attend_pair)(const AttnTask& a, const AttnTask& b, int head_dim, int G, float scale, float* scratch, int stride,
                      bool kv16);
  void (*silu_mul)(const float* g, const float* u, float* out, int n);  // out = silu(g) * u
  void (*quantize_row)(const float* x, int cols, int8_t* q, float* d, float* s, int32_t* qsum, int32_t* qsum16);
  void (*rms_norm)(const float* x, const float* w, int n, float eps, float* out);
};

extern const Kernels kernels_scalar;
extern const Kernels kernels_avx2;
extern const Kernels kernels_avx512;

// fp16 <-> fp32 (exact widening; round-to-nearest-even narrowing, as F16C does)
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

}  // namespace vs
