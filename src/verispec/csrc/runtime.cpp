// verispec compiled CPU runtime: weight repacking, the Llama forward, ISA dispatch, and the
// C ABI that Python calls through ctypes (which releases the GIL for the call).
//
// The forward reads like llama2.c's run.c: embed, then per layer
//   x += Wo @ attention(rope(Wqkv @ norm(x)))          (the K/V cache is written first)
//   x += W2 @ (silu(W1 @ norm(x)) * (W3 @ norm(x)))
// then the final norm and the LM head over the rows that want logits. Every stage is
// row-local or reduces in a fixed order (vs.h), so a token's logits do not depend on the
// other tokens of the forward, the thread count or the ISA.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "threads.h"
#include "vs.h"

namespace vs {

// ---------------------------------------------------------------- fp16

float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      e++;
      mant <<= 1;
    } while (!(mant & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even, like F16C's vcvtps2ph
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xFF;
  uint32_t mant = x & 0x7FFFFF;
  if (exp == 0xFF) return (uint16_t)(sign | 0x7C00 | (mant ? 0x200 : 0));  // inf / nan
  const int e = (int)exp - 127 + 15;
  if (e >= 31) return (uint16_t)(sign | 0x7C00);  // overflow: inf
  if (e <= 0) {  // a half subnormal (or zero)
    if (e < -10) return (uint16_t)sign;
    mant |= 0x800000;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1))) h++;
    return (uint16_t)(sign | h);
  }
  uint32_t h = sign | ((uint32_t)e << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;  // a carry rounds up into the exponent
  return (uint16_t)h;
}

// ---------------------------------------------------------------- ISA dispatch

static bool cpu_has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

static bool cpu_has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// "auto" picks the widest ISA the CPU has; a named ISA must be supported.
static const Kernels* select_kernels(const char* want, std::string& err) {
  const std::string w = want && *want ? want : "auto";
  if (w == "scalar") return &kernels_scalar;
  if (w == "avx2" || (w == "auto" && !cpu_has_avx512() && cpu_has_avx2())) {
    if (!cpu_has_avx2()) {
      err = "ISA avx2 is not supported by this CPU (needs AVX2, FMA, F16C)";
      return nullptr;
    }
    return &kernels_avx2;
  }
  if (w == "avx512" || w == "auto") {
    if (cpu_has_avx512()) return &kernels_avx512;
    if (w == "auto") return &kernels_scalar;
    err = "ISA avx512 is not supported by this CPU (needs AVX-512 F/BW/VL/VNNI, FMA, F16C)";
    return nullptr;
  }
  err = "unknown ISA '" + w + "': use auto, avx512, avx2 or scalar";
  return nullptr;
}

// ---------------------------------------------------------------- weights

// Source formats: GGUF block layouts (ggml's block_q4_0 / block_q4_1 / block_q8_0) or fp32.
enum Source : int { SRC_F32 = 0, SRC_Q4_0 = 2, SRC_Q4_1 = 3, SRC_Q8_0 = 8 };

static size_t src_row_bytes(int src, int cols) {
  switch (src) {
    case SRC_F32: return (size_t)cols * 4;
    case SRC_Q4_0: return (size_t)cols / QK * 18;
    case SRC_Q4_1: return (size_t)cols / QK * 20;
    case SRC_Q8_0: return (size_t)cols / QK * 34;
    default: return 0;
  }
}

static void* aligned_zeroed(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return p;
}

// Repack a row-major source matrix into 16-row panels (layouts in vs.h). Q4_0 becomes Q4
// with min m = -8 d (exact in fp16: a power-of-two multiple).
static void repack(Matrix& m, int src, const uint8_t* data, int rows, int cols) {
  m.rows = rows;
  m.cols = cols;
  m.panels = (rows + PANEL - 1) / PANEL;
  const int nb = cols / QK;
  m.fmt = src == SRC_F32 ? F32 : (src == SRC_Q8_0 ? Q8 : Q4);
  m.panel_bytes = m.fmt == F32 ? (size_t)cols * PANEL * 4 : (size_t)nb * (m.fmt == Q4 ? Q4_PANEL_BLOCK : Q8_PANEL_BLOCK);
  m.data = (uint8_t*)aligned_zeroed(m.panel_bytes * m.panels);
  const size_t rb = src_row_bytes(src, cols);
  for (int row = 0; row < rows; row++) {
    const int p = row / PANEL, r = row % PANEL;
    uint8_t* pw = m.data + (size_t)p * m.panel_bytes;
    const uint8_t* s = data + (size_t)row * rb;
    if (m.fmt == F32) {
      const float* x = (const float*)s;
      float* wp = (float*)pw;
      for (int k = 0; k < cols; k++) wp[k * PANEL + r] = x[k];
      continue;
    }
    for (int b = 0; b < nb; b++) {
      if (m.fmt == Q8) {
        const uint8_t* sb = s + (size_t)b * 34;  // fp16 d, int8 q[32]
        uint8_t* blk = pw + (size_t)b * Q8_PANEL_BLOCK;
        std::memcpy(blk + 2 * r, sb, 2);
        for (int k = 0; k < QK; k++) blk[32 + (k >> 2) * 64 + r * 4 + (k & 3)] = (uint8_t)((int)(int8_t)sb[2 + k] + 128);
        continue;
      }
      uint8_t* blk = pw + (size_t)b * Q4_PANEL_BLOCK;
      const uint8_t* qs;
      if (src == SRC_Q4_1) {  // fp16 d, fp16 m, nibbles: qs[j] = q[j] | q[j + 16] << 4
        const uint8_t* sb = s + (size_t)b * 20;
        std::memcpy(blk + 2 * r, sb, 2);
        std::memcpy(blk + 32 + 2 * r, sb + 2, 2);
        qs = sb + 4;
      } else {  // Q4_0: fp16 d, nibbles; w = d * (q - 8)
        const uint8_t* sb = s + (size_t)b * 18;
        uint16_t d;
        std::memcpy(&d, sb, 2);
        std::memcpy(blk + 2 * r, &d, 2);
        // m = -8 d in fp16: flip the sign and add 3 to the exponent (exact for normal d)
        const int e = (d >> 10) & 0x1F;
        if ((d & 0x7FFF) && (e == 0 || e > 27)) throw std::runtime_error("Q4_0 scale out of the supported fp16 range");
        const uint16_t md = (d & 0x7FFF) ? (uint16_t)((d ^ 0x8000) + (3 << 10)) : 0;
        std::memcpy(blk + 32 + 2 * r, &md, 2);
        qs = sb + 2;
      }
      for (int j = 0; j < 16; j++) {  // nibble j (low) and j + 16 (high) share byte j
        const int c = j >> 2, t = j & 3;
        blk[64 + c * 64 + r * 4 + t] = qs[j];
      }
    }
  }
}

// One row of a repacked matrix as fp32 (the embedding lookup: tied or not).
static void matrix_row(const Matrix& m, int row, float* out) {
  const int p = row / PANEL, r = row % PANEL, nb = m.cols / QK;
  const uint8_t* pw = m.data + (size_t)p * m.panel_bytes;
  if (m.fmt == F32) {
    for (int k = 0; k < m.cols; k++) out[k] = ((const float*)pw)[k * PANEL + r];
    return;
  }
  for (int b = 0; b < nb; b++) {
    if (m.fmt == Q8) {
      const uint8_t* blk = pw + (size_t)b * Q8_PANEL_BLOCK;
      const float d = half_to_float(((const uint16_t*)blk)[r]);
      for (int k = 0; k < QK; k++) out[b * QK + k] = d * (float)((int)blk[32 + (k >> 2) * 64 + r * 4 + (k & 3)] - 128);
    } else {
      const uint8_t* blk = pw + (size_t)b * Q4_PANEL_BLOCK;
      const float d = half_to_float(((const uint16_t*)blk)[r]), mn = half_to_float(((const uint16_t*)blk)[PANEL + r]);
      for (int k = 0; k < QK; k++) {
        const uint8_t byte = blk[64 + ((k & 15) >> 2) * 64 + r * 4 + (k & 3)];
        out[b * QK + k] = d * (float)(k < 16 ? (byte & 15) : (byte >> 4)) + mn;
      }
    }
  }
}

// ---------------------------------------------------------------- the model

struct Config {  // mirrors the Python ctypes struct (models/cpu.py)
  int32_t vocab, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn, max_pos;
  float eps;
  int32_t kv16;  // the KV cache holds fp16 values (else fp32)
  int32_t embed_rows;  // rows of the input embedding (token ids < this); a tied model has vocab
};

struct Layer {
  std::vector<float> attn_norm, ffn_norm;
  Matrix wqkv, wo, w13, w2;  // w13 rows: gate (ffn) then up (ffn)
};

struct Model {
  Config cfg{};
  std::vector<Layer> layers;
  std::vector<float> norm, rope_cos, rope_sin;  // rope tables [max_pos][head_dim / 2]
  Matrix embed, head;
  // Feature input (EAGLE heads): x = in_proj @ [in_norm(feat) ; embed(id)], used when a
  // batch carries features; in_norm empty = features as given.
  Matrix in_proj;
  std::vector<float> in_norm;
  bool tied = false;
  const Kernels* k = nullptr;
  std::unique_ptr<ThreadPool> pool;
  std::mutex busy;  // one forward (or thread-count change) at a time: the pool runs one job

  ~Model() {
    auto free_m = [](Matrix& m) { std::free(m.data); std::free(m.bias); m.data = nullptr; m.bias = nullptr; };
    for (auto& l : layers) {
      free_m(l.wqkv);
      free_m(l.wo);
      free_m(l.w13);
      free_m(l.w2);
    }
    free_m(embed);
    free_m(in_proj);
    if (!tied) free_m(head);
  }
  const Matrix& embedding() const { return tied ? head : embed; }
};

// A batch of new tokens over rows of one cache pool (mirrors the ctypes struct).
//  K cache [layers][rows][kv_heads][slots / 64][head_dim][64] (64-slot tiles, transposed)
//  V cache [layers][rows][kv_heads][slots][head_dim]; elements fp32, or fp16 if Config::kv16
struct Batch {
  int32_t T;               // new tokens
  const int32_t* ids;      // [T]
  const int32_t* pos;      // [T] RoPE positions
  const int32_t* seq;      // [T] sequence of each token
  const int32_t* slot;     // [T] cache slot its K/V go to
  const int32_t* vis_off;  // [T + 1] offsets into vis
  const int32_t* vis;      // new-token slots each token sees after the cached ones, itself last
  int32_t n_seqs;
  const int32_t* seq_row;     // [n_seqs] cache row
  const int32_t* seq_cached;  // [n_seqs] visible cached slots 0 .. n-1
  void* kcache;
  void* vcache;
  int32_t cache_rows, cache_slots;
  int32_t n_logits;
  const int32_t* logit_tokens;  // [n_logits] tokens whose logits are wanted
  float* logits;                // [n_logits][vocab]
  float* hidden;                // [T][dim] final-normed hidden states, or null
  int32_t n_layer_out;          // layers whose output residual stream is copied out (EAGLE-3 features)
  const int32_t* layer_ids;     // [n_layer_out] ascending decoder-layer indices
  float* layer_out;             // [T][n_layer_out][dim], or null
  const float* feat;            // [T][dim] input features (a model with in_proj: EAGLE heads), or null = embed ids
};

// Scratch for T token rows of width `cols`: fp32 input and its int8 quantization.
struct Act {
  std::vector<float> x, d, s;
  std::vector<int8_t> q;
  std::vector<int32_t> qsum;
  int cols = 0;
  Act(int T, int c) : x((size_t)T * c), d((size_t)T * c / QK), s((size_t)T * c / QK), q((size_t)T * c), qsum((size_t)T * c / QK), cols(c) {}
  void quantize(const Kernels* k, int t) { k->quantize_row(&x[(size_t)t * cols], cols, &q[(size_t)t * cols], &d[(size_t)t * cols / QK], &s[(size_t)t * cols / QK], &qsum[(size_t)t * cols / QK]); }
  QAct view() const { return QAct{cols, cols / QK, x.data(), q.data(), d.data(), s.data(), qsum.data()}; }
};

static void matmul(Model& m, const Matrix& w, const Act& a, int T, float* out, int ldo) {
  const QAct qa = a.view();
  const Kernels* k = m.k;
  m.pool->parallel_for(w.panels, [&](int p0, int p1) { k->matmul(w, p0, p1, qa, T, out, ldo); }, 2);
}

static void rope(float* x, const float* cos, const float* sin, int half) {  // rotate_half convention
  for (int i = 0; i < half; i++) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

static void forward(Model& m, const Batch& bt) {
  const Config& c = m.cfg;
  const int T = bt.T, D = c.head_dim, H = c.n_heads, KVH = c.n_kv_heads, dim = c.dim;
  const int qkv_w = (H + 2 * KVH) * D, half = D / 2;
  const size_t k_layer = (size_t)bt.cache_rows * KVH * bt.cache_slots * D;  // floats per layer (K and V alike)
  const float scale = 1.0f / std::sqrt((float)D);
  const size_t esize = c.kv16 ? 2 : 4;  // bytes per cache element
  int max_slot = 0;
  for (int t = 0; t < T; t++) max_slot = bt.slot[t] > max_slot ? bt.slot[t] : max_slot;
  const int stride = ((max_slot >> 6) + 1) * 64;  // attention scratch per head: whole tiles up to any token's slot
  ThreadPool& pool = *m.pool;
  // row-local phases: one chunk per thread, of at least 4 tokens (fewer do not pay a wake-up)
  const int tok_grain = std::max(4, (T + pool.size() - 1) / pool.size());

  std::vector<float> x((size_t)T * dim), qkv((size_t)T * qkv_w), tmp((size_t)T * dim), gu((size_t)T * 2 * c.ffn);
  Act xn(T, dim), att(T, H * D), hid(T, c.ffn);

  if (bt.feat) {  // EAGLE head input: x = in_proj @ [in_norm(feat) ; embed(id)]
    Act fe(T, 2 * dim);
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) {
        float* row = &fe.x[(size_t)t * 2 * dim];
        const float* f = bt.feat + (size_t)t * dim;
        if (m.in_norm.empty()) std::memcpy(row, f, dim * sizeof(float));
        else m.k->rms_norm(f, m.in_norm.data(), dim, c.eps, row);
        matrix_row(m.embedding(), bt.ids[t], row + dim);
        fe.quantize(m.k, t);
      }
    }, tok_grain);
    matmul(m, m.in_proj, fe, T, x.data(), dim);
  } else {
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) matrix_row(m.embedding(), bt.ids[t], &x[(size_t)t * dim]);
    }, tok_grain);
  }

  for (int l = 0; l < c.n_layers; l++) {
    Layer& L = m.layers[l];
    char* kc = (char*)bt.kcache + (size_t)l * k_layer * esize;
    char* vc = (char*)bt.vcache + (size_t)l * k_layer * esize;
    // attention: norm, QKV, RoPE, cache write
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) {
        m.k->rms_norm(&x[(size_t)t * dim], L.attn_norm.data(), dim, c.eps, &xn.x[(size_t)t * dim]);
        xn.quantize(m.k, t);
      }
    }, tok_grain);
    matmul(m, L.wqkv, xn, T, qkv.data(), qkv_w);
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) {
        float* q = &qkv[(size_t)t * qkv_w];
        const float* cs = &m.rope_cos[(size_t)bt.pos[t] * half];
        const float* sn = &m.rope_sin[(size_t)bt.pos[t] * half];
        for (int h = 0; h < H + KVH; h++) rope(q + h * D, cs, sn, half);  // q heads, then k heads
        const int row = bt.seq_row[bt.seq[t]], s = bt.slot[t];
        for (int g = 0; g < KVH; g++) {
          const size_t base = ((size_t)row * KVH + g) * bt.cache_slots * D;
          const size_t kt = base + (size_t)(s >> 6) * D * 64 + (s & 63), vt = base + (size_t)s * D;
          const float* k = q + (H + g) * D;
          const float* v = q + (H + KVH + g) * D;
          for (int d = 0; d < D; d++) {
            if (c.kv16) {
              ((uint16_t*)kc)[kt + d * 64] = float_to_half(k[d]);
              ((uint16_t*)vc)[vt + d] = float_to_half(v[d]);
            } else {
              ((float*)kc)[kt + d * 64] = k[d];
              ((float*)vc)[vt + d] = v[d];
            }
          }
        }
      }
    }, tok_grain);
    const int G = H / KVH;
    pool.parallel_for(T * KVH, [&](int i0, int i1) {
      static thread_local std::vector<float> scores;  // grown, never zeroed: every read score is written first
      if (scores.size() < (size_t)G * stride) scores.resize((size_t)G * stride);
      for (int i = i0; i < i1; i++) {
        const int g = i / T, t = i % T, sq = bt.seq[t];  // kv head outer: a sequence's tokens reuse its K/V in cache
        const size_t base = ((size_t)bt.seq_row[sq] * KVH + g) * bt.cache_slots * D;
        AttnTask task{&qkv[(size_t)t * qkv_w + g * G * D], kc + base * esize, vc + base * esize, bt.seq_cached[sq],
                      bt.vis_off[t + 1] - bt.vis_off[t], bt.vis + bt.vis_off[t], &att.x[(size_t)t * H * D + g * G * D]};
        m.k->attend(task, D, G, scale, scores.data(), stride, c.kv16 != 0);
      }
    });
    pool.parallel_for(T, [&](int t0, int t1) { for (int t = t0; t < t1; t++) att.quantize(m.k, t); }, tok_grain);
    matmul(m, L.wo, att, T, tmp.data(), dim);
    // MLP: residual, norm, gate/up, SiLU, down
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) {
        float* xt = &x[(size_t)t * dim];
        for (int i = 0; i < dim; i++) xt[i] = xt[i] + tmp[(size_t)t * dim + i];
        m.k->rms_norm(xt, L.ffn_norm.data(), dim, c.eps, &xn.x[(size_t)t * dim]);
        xn.quantize(m.k, t);
      }
    }, tok_grain);
    matmul(m, L.w13, xn, T, gu.data(), 2 * c.ffn);
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) {
        const float* g = &gu[(size_t)t * 2 * c.ffn];
        m.k->silu_mul(g, g + c.ffn, &hid.x[(size_t)t * c.ffn], c.ffn);
        hid.quantize(m.k, t);
      }
    }, tok_grain);
    matmul(m, L.w2, hid, T, tmp.data(), dim);
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++)
        for (int i = 0; i < dim; i++) x[(size_t)t * dim + i] = x[(size_t)t * dim + i] + tmp[(size_t)t * dim + i];
    }, tok_grain);
    for (int j = 0; j < bt.n_layer_out; j++)  // a copy of this layer's output only when asked: decode path unchanged
      if (bt.layer_ids[j] == l)
        for (int t = 0; t < T; t++)
          std::memcpy(bt.layer_out + ((size_t)t * bt.n_layer_out + j) * dim, &x[(size_t)t * dim], dim * sizeof(float));
  }
  // final norm: all rows if hidden states are wanted, else only the logit rows
  const int n_out = bt.n_logits;
  Act fin(n_out > 0 ? n_out : 1, dim);
  if (bt.hidden)
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) m.k->rms_norm(&x[(size_t)t * dim], m.norm.data(), dim, c.eps, bt.hidden + (size_t)t * dim);
    }, tok_grain);
  for (int i = 0; i < n_out; i++) {
    const int t = bt.logit_tokens[i];
    if (bt.hidden) std::memcpy(&fin.x[(size_t)i * dim], bt.hidden + (size_t)t * dim, dim * sizeof(float));
    else m.k->rms_norm(&x[(size_t)t * dim], m.norm.data(), dim, c.eps, &fin.x[(size_t)i * dim]);
    fin.quantize(m.k, i);
  }
  if (n_out > 0) matmul(m, m.head, fin, n_out, bt.logits, c.vocab);
}

// ---------------------------------------------------------------- validation

static std::string check_batch(const Model& m, const Batch& b) {
  const Config& c = m.cfg;
  char buf[256];
  auto fail = [&](const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return std::string(buf);
  };
  if (b.T < 1) return fail("forward needs at least one token, got %d", b.T);
  if (b.cache_slots < 64 || b.cache_slots % 64) return fail("cache slots must be a positive multiple of 64, got %d", b.cache_slots);
  if (b.n_seqs < 1) return fail("forward needs at least one sequence");
  for (int s = 0; s < b.n_seqs; s++) {
    if (b.seq_row[s] < 0 || b.seq_row[s] >= b.cache_rows) return fail("cache row %d out of [0, %d)", b.seq_row[s], b.cache_rows);
    if (b.seq_cached[s] < 0 || b.seq_cached[s] > b.cache_slots) return fail("cached length %d out of [0, %d]", b.seq_cached[s], b.cache_slots);
  }
  if (b.feat && !m.in_proj.data) return fail("this model takes token ids, not features (no input projection)");
  for (int t = 0; t < b.T; t++) {
    if (b.ids[t] < 0 || b.ids[t] >= c.embed_rows) return fail("token ids must be in [0, %d), got %d", c.embed_rows, b.ids[t]);
    if (b.pos[t] < 0 || b.pos[t] >= c.max_pos) return fail("positions must be in [0, %d), got %d", c.max_pos, b.pos[t]);
    if (b.seq[t] < 0 || b.seq[t] >= b.n_seqs) return fail("token %d: sequence %d out of [0, %d)", t, b.seq[t], b.n_seqs);
    if (b.slot[t] < b.seq_cached[b.seq[t]] || b.slot[t] >= b.cache_slots)
      return fail("token %d: slot %d would overwrite a cached slot or overflow the cache (%d slots)", t, b.slot[t], b.cache_slots);
    if (b.vis_off[t + 1] < b.vis_off[t] || b.vis_off[t + 1] - b.vis_off[t] < 1) return fail("tree_mask must let each token see itself and only earlier tokens (token %d sees none)", t);
    for (int i = b.vis_off[t]; i < b.vis_off[t + 1]; i++)
      if (b.vis[i] < b.seq_cached[b.seq[t]] || b.vis[i] >= b.cache_slots) return fail("token %d: visible slot %d is not a new slot", t, b.vis[i]);
    if (b.vis[b.vis_off[t + 1] - 1] != b.slot[t]) return fail("tree_mask must let each token see itself and only earlier tokens (token %d)", t);
  }
  for (int i = 0; i < b.n_logits; i++)
    if (b.logit_tokens[i] < 0 || b.logit_tokens[i] >= b.T) return fail("logit token %d out of [0, %d)", b.logit_tokens[i], b.T);
  if (b.n_layer_out < 0 || (b.n_layer_out > 0 && !b.layer_out)) return fail("layer outputs need a buffer");
  for (int j = 0; j < b.n_layer_out; j++)
    if (b.layer_ids[j] < 0 || b.layer_ids[j] >= c.n_layers) return fail("hidden layer %d out of [0, %d)", b.layer_ids[j], c.n_layers);
  return "";
}

}  // namespace vs

// The cache slot move of vs_cache_move, per element type.
template <class KV>
static void cache_move(const vs::Config* c, KV* kcache, KV* vcache, int rows, int slots, int row, const int32_t* src,
                       int count, int dst) {
  const int D = c->head_dim, KVH = c->n_kv_heads;
  const size_t layer = (size_t)rows * KVH * slots * D;
  for (int l = 0; l < c->n_layers; l++)
    for (int g = 0; g < KVH; g++) {
      const size_t base = (size_t)l * layer + ((size_t)row * KVH + g) * slots * D;
      for (int i = 0; i < count; i++) {
        const int s = src[i], t = dst + i;
        if (s == t) continue;
        KV* k = kcache + base;
        for (int d = 0; d < D; d++)
          k[(size_t)(t >> 6) * D * 64 + d * 64 + (t & 63)] = k[(size_t)(s >> 6) * D * 64 + d * 64 + (s & 63)];
        std::memmove(vcache + base + (size_t)t * D, vcache + base + (size_t)s * D, D * sizeof(KV));
      }
    }
}

// ---------------------------------------------------------------- C ABI (ctypes)

using vs::Model;

static void set_err(char* err, int n, const std::string& msg) {
  if (err && n > 0) std::snprintf(err, n, "%s", msg.c_str());
}

extern "C" {

const char* vs_isa_name(const char* want, char* err, int n) {
  std::string e;
  const vs::Kernels* k = vs::select_kernels(want, e);
  if (!k) set_err(err, n, e);
  return k ? k->name : nullptr;
}

void* vs_model_new(const vs::Config* cfg, const float* rope_cos, const float* rope_sin, const char* isa, int threads,
                   char* err, int n) {
  try {
    std::string e;
    const vs::Kernels* k = vs::select_kernels(isa, e);
    if (!k) {
      set_err(err, n, e);
      return nullptr;
    }
    if (cfg->dim % vs::QK || cfg->ffn % vs::QK || (cfg->n_heads * cfg->head_dim) % vs::QK || cfg->head_dim % 2 ||
        cfg->n_kv_heads < 1 || cfg->n_heads % cfg->n_kv_heads || cfg->n_heads / cfg->n_kv_heads > 64) {
      set_err(err, n, "unsupported shape: dim, ffn and heads * head_dim must be multiples of 32, heads a multiple of kv heads (at most 64 per kv head)");
      return nullptr;
    }
    auto* m = new Model();
    m->cfg = *cfg;
    if (m->cfg.embed_rows <= 0) m->cfg.embed_rows = cfg->vocab;  // 0: a model embedding its own vocabulary
    m->k = k;
    m->layers.resize(cfg->n_layers);
    const size_t table = (size_t)cfg->max_pos * (cfg->head_dim / 2);
    m->rope_cos.assign(rope_cos, rope_cos + table);
    m->rope_sin.assign(rope_sin, rope_sin + table);
    m->pool = std::make_unique<vs::ThreadPool>(threads);
    return m;
  } catch (const std::exception& ex) {
    set_err(err, n, std::string("cannot create the model: ") + ex.what());
    return nullptr;
  }
}

void vs_model_free(void* m) { delete (Model*)m; }

const char* vs_model_isa(void* m) { return ((Model*)m)->k->name; }

int vs_model_threads(void* m) { return ((Model*)m)->pool->size(); }

int vs_model_set_threads(void* mp, int threads) {
  auto* m = (Model*)mp;
  if (threads < 1) return -1;
  std::lock_guard<std::mutex> lock(m->busy);
  if (threads != m->pool->size()) m->pool = std::make_unique<vs::ThreadPool>(threads);
  return 0;
}

// which: 0 attn_norm, 1 ffn_norm, 2 wqkv, 3 wo, 4 w13, 5 w2 (per layer); 6 final norm, 7 embed, 8 head,
// 9 in_proj [dim, 2 dim] and 10 in_norm [dim] (feature input, optional).
// Vectors (norms) are fp32 [cols]. A tied model sets only the head (the embedding reads it).
int vs_model_set(void* mp, int layer, int which, int src, const void* data, int rows, int cols, const float* bias,
                 char* err, int n) {
  auto* m = (Model*)mp;
  try {
    if (which < 0 || which > 10 || (which < 6 && (layer < 0 || layer >= m->cfg.n_layers))) {
      set_err(err, n, "bad tensor slot");
      return -1;
    }
    if (which == 0 || which == 1 || which == 6 || which == 10) {
      if (src != vs::SRC_F32 || cols != m->cfg.dim) {
        set_err(err, n, "norm weights must be fp32 [dim]");
        return -1;
      }
      const float* f = (const float*)data;
      std::vector<float>& dst = which == 0 ? m->layers[layer].attn_norm : which == 1 ? m->layers[layer].ffn_norm
                              : which == 10 ? m->in_norm : m->norm;
      dst.assign(f, f + cols);
      return 0;
    }
    if (vs::src_row_bytes(src, cols) == 0 || cols % vs::QK || rows < 1) {
      set_err(err, n, "unsupported weight format or shape (formats: F32, Q4_0, Q4_1, Q8_0; columns a multiple of 32)");
      return -1;
    }
    vs::Matrix* dst = which == 7 ? &m->embed : which == 8 ? &m->head : which == 9 ? &m->in_proj
                    : which == 2 ? &m->layers[layer].wqkv : which == 3 ? &m->layers[layer].wo
                    : which == 4 ? &m->layers[layer].w13 : &m->layers[layer].w2;
    std::free(dst->data);
    std::free(dst->bias);
    *dst = vs::Matrix();
    vs::repack(*dst, src, (const uint8_t*)data, rows, cols);
    if (bias) {
      dst->bias = (float*)vs::aligned_zeroed((size_t)rows * 4);
      std::memcpy(dst->bias, bias, (size_t)rows * 4);
    }
    return 0;
  } catch (const std::exception& ex) {
    set_err(err, n, std::string("out of memory repacking weights: ") + ex.what());
    return -1;
  }
}

// Check that every tensor has the shape the config says; tie the embedding to the head if unset.
int vs_model_finish(void* mp, char* err, int n) {
  auto* m = (Model*)mp;
  const vs::Config& c = m->cfg;
  auto bad = [&](const char* what, const vs::Matrix& w, int rows, int cols) {
    if (w.data && w.rows == rows && w.cols == cols) return false;
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s: expected [%d, %d], got %s[%d, %d]", what, rows, cols, w.data ? "" : "nothing ", w.rows, w.cols);
    set_err(err, n, buf);
    return true;
  };
  for (int l = 0; l < c.n_layers; l++) {
    const vs::Layer& L = m->layers[l];
    if ((int)L.attn_norm.size() != c.dim || (int)L.ffn_norm.size() != c.dim) {
      set_err(err, n, "missing layer norm weights");
      return -1;
    }
    if (bad("wqkv", L.wqkv, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim) || bad("wo", L.wo, c.dim, c.n_heads * c.head_dim) ||
        bad("w13", L.w13, 2 * c.ffn, c.dim) || bad("w2", L.w2, c.dim, c.ffn))
      return -1;
  }
  if ((int)m->norm.size() != c.dim) {
    set_err(err, n, "missing final norm");
    return -1;
  }
  if (bad("lm_head", m->head, c.vocab, c.dim)) return -1;
  m->tied = m->embed.data == nullptr;
  if (m->tied && c.embed_rows != c.vocab) {
    set_err(err, n, "a tied model embeds with its LM head: embed_rows must equal vocab");
    return -1;
  }
  if (!m->tied && bad("embedding", m->embed, c.embed_rows, c.dim)) return -1;
  if (m->in_proj.data && bad("in_proj", m->in_proj, c.dim, 2 * c.dim)) return -1;
  return 0;
}

size_t vs_model_weight_bytes(void* mp) {
  auto* m = (Model*)mp;
  size_t total = m->head.panel_bytes * m->head.panels + m->in_proj.panel_bytes * m->in_proj.panels;
  for (auto& L : m->layers)
    for (const vs::Matrix* w : {&L.wqkv, &L.wo, &L.w13, &L.w2}) total += w->panel_bytes * w->panels;
  return total;
}

int vs_forward(void* mp, const vs::Batch* b, char* err, int n) {
  auto* m = (Model*)mp;
  const std::string e = vs::check_batch(*m, *b);
  if (!e.empty()) {
    set_err(err, n, e);
    return -1;
  }
  try {
    std::lock_guard<std::mutex> lock(m->busy);
    vs::forward(*m, *b);
  } catch (const std::exception& ex) {
    set_err(err, n, std::string("forward failed: ") + ex.what());
    return -1;
  }
  return 0;
}

// Move slots src[0..n) of one cache row to dst, dst+1, ... (the accepted tree path).
void vs_cache_move(const vs::Config* c, void* kcache, void* vcache, int rows, int slots, int row, const int32_t* src,
                   int count, int dst) {
  if (c->kv16) cache_move(c, (uint16_t*)kcache, (uint16_t*)vcache, rows, slots, row, src, count, dst);
  else cache_move(c, (float*)kcache, (float*)vcache, rows, slots, row, src, count, dst);
}

}  // extern "C"
