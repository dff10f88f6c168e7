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
#include <chrono>
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

static void* aligned_zeroed(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return p;
}

// Repack a row-major source matrix (GGUF blocks of `f`, or fp32) into 16-row panels; with a
// pool, threads split the panels (each panel's bytes are written by one thread).
static void repack(Matrix& m, const Format* f, const uint8_t* data, int rows, int cols, ThreadPool* pool = nullptr) {
  m.fmt = f;
  m.rows = rows;
  m.cols = cols;
  m.panels = (rows + PANEL - 1) / PANEL;
  m.panel_bytes = (size_t)(cols / f->block_cols) * f->panel_block_bytes;
  m.data = (uint8_t*)aligned_zeroed(m.panel_bytes * m.panels);
  const size_t rb = (size_t)(cols / f->block_cols) * f->src_block_bytes;
  std::mutex mu;
  std::string error;  // a format's repack may refuse a block (Q4_0 scales out of range): never throw in a worker
  auto panels = [&](int p0, int p1) {
    try {
      for (int row = p0 * PANEL; row < std::min(rows, p1 * PANEL); row++)
        f->repack_row(data + (size_t)row * rb, cols, m.data + (size_t)(row / PANEL) * m.panel_bytes, row % PANEL);
    } catch (const std::exception& ex) {
      std::lock_guard<std::mutex> lock(mu);
      error = ex.what();
    }
  };
  if (pool) pool->parallel_for(m.panels, panels, 4);
  else panels(0, m.panels);
  if (!error.empty()) {
    std::free(m.data);
    m.data = nullptr;
    throw std::runtime_error(error);
  }
}

// A linear layer: row blocks ("parts") stacked on top of each other, each in its own format
// (a fused QKV whose V is Q6_K while Q and K are Q4_K). Part i computes output rows
// [row0_i, row0_i + rows_i); each part's panels are its own, padded to 16 rows.
struct Linear {
  std::vector<Matrix> parts;
  std::vector<int> row0;
  int rows = 0, cols = 0, panels = 0;
  // By reference (an input embedding read one row per token): the caller's source blocks,
  // e.g. a memory-mapped GGUF, instead of panels; rows are repacked one at a time on lookup.
  const Format* ref_fmt = nullptr;
  const uint8_t* ref = nullptr;
  size_t ref_row_bytes = 0;

  bool empty() const { return parts.empty() && !ref; }
  void clear() {
    for (Matrix& m : parts) {
      std::free(m.data);
      std::free(m.bias);
    }
    parts.clear();
    row0.clear();
    rows = cols = panels = 0;
    ref = nullptr;
  }
  size_t bytes() const {
    size_t b = 0;
    for (const Matrix& m : parts) b += m.panel_bytes * m.panels;
    return b;
  }
  // One row as fp32 (the embedding lookup: tied or not). A row by reference goes through a
  // one-row panel, so its values are bitwise those of the repacked matrix.
  void row(int r, float* out) const {
    if (ref) {
      static thread_local std::vector<uint8_t> panel;
      const size_t bytes = (size_t)(cols / ref_fmt->block_cols) * ref_fmt->panel_block_bytes;
      panel.assign(bytes, 0);
      ref_fmt->repack_row(ref + (size_t)r * ref_row_bytes, cols, panel.data(), 0);
      ref_fmt->dequant_row(panel.data(), cols, 0, out);
      return;
    }
    size_t i = 0;
    while (i + 1 < parts.size() && r >= row0[i + 1]) i++;
    const Matrix& m = parts[i];
    const int lr = r - row0[i];
    m.fmt->dequant_row(m.data + (size_t)(lr / PANEL) * m.panel_bytes, m.cols, lr % PANEL, out);
  }
};

// ---------------------------------------------------------------- the model

struct Config {  // mirrors the Python ctypes struct (models/cpu.py)
  int32_t vocab, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn, max_pos;
  float eps;
  int32_t kv16;  // the KV cache holds fp16 values (else fp32)
  int32_t embed_rows;  // rows of the input embedding (token ids < this); a tied model has vocab
};

struct Layer {
  std::vector<float> attn_norm, ffn_norm;
  Linear wqkv, wo, w13, w2;  // wqkv rows: q, k, v; w13 rows: gate (ffn) then up (ffn)
};

struct Model {
  Config cfg{};
  std::vector<Layer> layers;
  std::vector<float> norm, rope_cos, rope_sin;  // rope tables [max_pos][head_dim / 2]
  Linear embed, head;
  // Feature input (EAGLE heads): x = in_proj @ [in_norm(feat) ; embed(id)], used when a
  // batch carries features; in_norm empty = features as given.
  Linear in_proj;
  std::vector<float> in_norm;
  bool tied = false;
  const Kernels* k = nullptr;
  std::shared_ptr<ThreadPool> pool;  // ThreadPool::shared: one pool per thread count in the process
  std::mutex busy;  // one forward (or thread-count change) at a time: the pool runs one job

  ~Model() {
    for (auto& l : layers)
      for (Linear* w : {&l.wqkv, &l.wo, &l.w13, &l.w2}) w->clear();
    embed.clear();
    in_proj.clear();
    head.clear();
  }
  const Linear& embedding() const { return tied ? head : embed; }
};

// A batch of new tokens over rows of one cache pool (mirrors the ctypes struct).
//  K cache [layers][rows][kv_heads][slots / KV_TILE][head_dim][KV_TILE] (transposed tiles)
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
  std::vector<int32_t> qsum, qsum16;
  int cols = 0;
  Act(int T, int c)
      : x((size_t)T * c), d((size_t)T * c / QK), s((size_t)T * c / QK), q((size_t)T * c), qsum((size_t)T * c / QK),
        qsum16((size_t)T * c / 16), cols(c) {}
  void quantize(const Kernels* k, int t) {
    const size_t nb = (size_t)cols / QK;
    k->quantize_row(&x[(size_t)t * cols], cols, &q[(size_t)t * cols], &d[t * nb], &s[t * nb], &qsum[t * nb], &qsum16[2 * t * nb]);
  }
  QAct view() const { return QAct{cols, cols / QK, x.data(), q.data(), d.data(), s.data(), qsum.data(), qsum16.data()}; }
};

// out[t][row] = W @ a[t] for every row of every part; threads split the parts' panels.
static void matmul(Model& m, const Linear& w, const Act& a, int T, float* out, int ldo) {
  const QAct qa = a.view();
  const int isa = m.k->isa;
  m.pool->parallel_for(w.panels, [&](int p0, int p1) {
    int first = 0;  // panels of part i: [first, first + parts[i].panels)
    for (size_t i = 0; i < w.parts.size(); i++) {
      const Matrix& part = w.parts[i];
      const int lo = std::max(p0, first), hi = std::min(p1, first + part.panels);
      if (lo < hi) part.fmt->matmul[isa](part, lo - first, hi - first, qa, T, out + w.row0[i], ldo);
      first += part.panels;
    }
  }, 2);
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
  const int stride = (max_slot / KV_TILE + 1) * KV_TILE;  // attention scratch per head: whole tiles up to any token's slot
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
        m.embedding().row(bt.ids[t], row + dim);
        fe.quantize(m.k, t);
      }
    }, tok_grain);
    matmul(m, m.in_proj, fe, T, x.data(), dim);
  } else {
    pool.parallel_for(T, [&](int t0, int t1) {
      for (int t = t0; t < t1; t++) m.embedding().row(bt.ids[t], &x[(size_t)t * dim]);
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
          const size_t kt = base + (size_t)(s / KV_TILE) * D * KV_TILE + s % KV_TILE, vt = base + (size_t)s * D;
          const float* k = q + (H + g) * D;
          const float* v = q + (H + KVH + g) * D;
          for (int d = 0; d < D; d++) {
            if (c.kv16) {
              ((uint16_t*)kc)[kt + d * KV_TILE] = float_to_half(k[d]);
              ((uint16_t*)vc)[vt + d] = float_to_half(v[d]);
            } else {
              ((float*)kc)[kt + d * KV_TILE] = k[d];
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
  if (b.cache_slots < KV_TILE || b.cache_slots % KV_TILE)
    return fail("cache slots must be a positive multiple of %d, got %d", KV_TILE, b.cache_slots);
  if (b.n_seqs < 1) return fail("forward needs at least one sequence");
  for (int s = 0; s < b.n_seqs; s++) {
    if (b.seq_row[s] < 0 || b.seq_row[s] >= b.cache_rows) return fail("cache row %d out of [0, %d)", b.seq_row[s], b.cache_rows);
    if (b.seq_cached[s] < 0 || b.seq_cached[s] > b.cache_slots) return fail("cached length %d out of [0, %d]", b.seq_cached[s], b.cache_slots);
  }
  if (b.feat && m.in_proj.empty()) return fail("this model takes token ids, not features (no input projection)");
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
          k[(size_t)(t / vs::KV_TILE) * D * vs::KV_TILE + d * vs::KV_TILE + t % vs::KV_TILE] =
              k[(size_t)(s / vs::KV_TILE) * D * vs::KV_TILE + d * vs::KV_TILE + s % vs::KV_TILE];
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
    m->pool = vs::ThreadPool::shared(threads);
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
  if (threads != m->pool->size()) m->pool = vs::ThreadPool::shared(threads);
  return 0;
}

// Set a tensor. Slots: enum Slot (vs.h). Norm vectors are fp32 [cols] (ggml_type 0).
// Matrices are row-major GGUF blocks of `ggml_type` (a Format of formats/table.cpp) or fp32;
// a second call for the same matrix slot appends rows (a fused layer whose row blocks have
// different formats), each part with its own optional bias [rows].
// A tied model sets only the head (the embedding reads it).
int vs_model_set(void* mp, int layer, int slot, int ggml_type, const void* data, int rows, int cols, const float* bias,
                 char* err, int n) {
  auto* m = (Model*)mp;
  try {
    const bool per_layer = slot < vs::SLOT_NORM;
    if (slot < 0 || slot >= vs::N_SLOTS || (per_layer && (layer < 0 || layer >= m->cfg.n_layers))) {
      set_err(err, n, "bad tensor slot");
      return -1;
    }
    if (slot == vs::SLOT_ATTN_NORM || slot == vs::SLOT_FFN_NORM || slot == vs::SLOT_NORM || slot == vs::SLOT_IN_NORM) {
      if (ggml_type != 0 || cols != m->cfg.dim) {
        set_err(err, n, "norm weights must be fp32 [dim]");
        return -1;
      }
      const float* f = (const float*)data;
      std::vector<float>& dst = slot == vs::SLOT_ATTN_NORM ? m->layers[layer].attn_norm
                              : slot == vs::SLOT_FFN_NORM ? m->layers[layer].ffn_norm
                              : slot == vs::SLOT_IN_NORM  ? m->in_norm : m->norm;
      dst.assign(f, f + cols);
      return 0;
    }
    const vs::Format* f = vs::format_by_type(ggml_type);
    if (!f || rows < 1 || cols % vs::QK || cols % f->block_cols) {
      std::string names;
      for (int i = 0; i < vs::N_FORMATS; i++) names += std::string(i ? ", " : "") + vs::FORMATS[i]->name;
      set_err(err, n, f ? "unsupported shape: columns must be a multiple of 32 and of the format's block"
                        : "unsupported weight format (ggml type " + std::to_string(ggml_type) + "); formats: " + names);
      return -1;
    }
    vs::Linear* dst = slot == vs::SLOT_EMBED ? &m->embed : slot == vs::SLOT_HEAD ? &m->head
                    : slot == vs::SLOT_IN_PROJ ? &m->in_proj : slot == vs::SLOT_WQKV ? &m->layers[layer].wqkv
                    : slot == vs::SLOT_WO ? &m->layers[layer].wo : slot == vs::SLOT_W13 ? &m->layers[layer].w13
                    : &m->layers[layer].w2;
    if (!dst->empty() && dst->cols != cols) {
      set_err(err, n, "the parts of a matrix must have the same number of columns");
      return -1;
    }
    vs::Matrix part;
    {
      std::lock_guard<std::mutex> lock(m->busy);
      vs::repack(part, f, (const uint8_t*)data, rows, cols, m->pool.get());
    }
    if (bias) {
      part.bias = (float*)vs::aligned_zeroed((size_t)rows * 4);
      std::memcpy(part.bias, bias, (size_t)rows * 4);
    }
    dst->row0.push_back(dst->rows);
    dst->parts.push_back(part);
    dst->rows += rows;
    dst->cols = cols;
    dst->panels += part.panels;
    return 0;
  } catch (const std::bad_alloc& ex) {
    set_err(err, n, std::string("out of memory repacking weights: ") + ex.what());
    return -1;
  } catch (const std::exception& ex) {
    set_err(err, n, std::string("cannot repack weights: ") + ex.what());
    return -1;
  }
}

// The input embedding by reference: `data` (row-major source blocks, rows x cols) must stay
// valid and unchanged for the model's lifetime; nothing is copied (models/cpu.py keeps it alive).
int vs_model_set_embed_ref(void* mp, int ggml_type, const void* data, int rows, int cols, char* err, int n) {
  auto* m = (Model*)mp;
  const vs::Format* f = vs::format_by_type(ggml_type);
  if (!f || !data || rows < 1 || cols % vs::QK || cols % f->block_cols) {
    set_err(err, n, "unsupported embedding format or shape");
    return -1;
  }
  m->embed.clear();
  m->embed.ref_fmt = f;
  m->embed.ref = (const uint8_t*)data;
  m->embed.ref_row_bytes = (size_t)(cols / f->block_cols) * f->src_block_bytes;
  m->embed.rows = rows;
  m->embed.cols = cols;
  return 0;
}

// Check that every tensor has the shape the config says; tie the embedding to the head if unset.
int vs_model_finish(void* mp, char* err, int n) {
  auto* m = (Model*)mp;
  const vs::Config& c = m->cfg;
  auto bad = [&](const char* what, const vs::Linear& w, int rows, int cols) {
    if (!w.empty() && w.rows == rows && w.cols == cols) return false;
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s: expected [%d, %d], got %s[%d, %d]", what, rows, cols, w.empty() ? "nothing " : "", w.rows, w.cols);
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
  m->tied = m->embed.empty();
  if (m->tied && c.embed_rows != c.vocab) {
    set_err(err, n, "a tied model embeds with its LM head: embed_rows must equal vocab");
    return -1;
  }
  if (!m->tied && bad("embedding", m->embed, c.embed_rows, c.dim)) return -1;
  if (!m->in_proj.empty() && bad("in_proj", m->in_proj, c.dim, 2 * c.dim)) return -1;
  return 0;
}

// Bytes of repacked weights read per decode step (the embedding's rows are read one per token).
size_t vs_model_weight_bytes(void* mp) {
  auto* m = (Model*)mp;
  size_t total = m->head.bytes() + m->in_proj.bytes();
  for (auto& L : m->layers) total += L.wqkv.bytes() + L.wo.bytes() + L.w13.bytes() + L.w2.bytes();
  return total;
}

// One matrix product out[T][rows] = W @ x[t] through a format's kernels on one ISA, outside
// any model (tests: every ISA against the scalar reference, every format against a
// dequantized fp32 reference). x is fp32 [T][cols], quantized here as a forward does.
int vs_test_matmul(int ggml_type, const void* data, int rows, int cols, const float* x, int T, float* out,
                   const char* isa, char* err, int n) {
  std::string e;
  const vs::Kernels* k = vs::select_kernels(isa, e);
  const vs::Format* f = vs::format_by_type(ggml_type);
  if (!k || !f || rows < 1 || T < 1 || cols % vs::QK || cols % f->block_cols) {
    set_err(err, n, !k ? e : !f ? "unsupported format" : "bad shape");
    return -1;
  }
  try {
    vs::Matrix m;
    vs::repack(m, f, (const uint8_t*)data, rows, cols);
    vs::Act a(T, cols);
    std::memcpy(a.x.data(), x, (size_t)T * cols * sizeof(float));
    for (int t = 0; t < T; t++) a.quantize(k, t);
    f->matmul[k->isa](m, 0, m.panels, a.view(), T, out, rows);
    std::free(m.data);
  } catch (const std::exception& ex) {
    set_err(err, n, ex.what());
    return -1;
  }
  return 0;
}

// Seconds per matrix product of T tokens (best of `reps`) on `threads` threads: a kernel
// micro-benchmark for scripts/bench_kernels.py (weights repacked once, random activations).
double vs_bench_matmul(int ggml_type, const void* data, int rows, int cols, int T, int reps, const char* isa,
                       int threads) {
  std::string e;
  const vs::Kernels* k = vs::select_kernels(isa, e);
  const vs::Format* f = vs::format_by_type(ggml_type);
  if (!k || !f || rows < 1 || T < 1 || reps < 1 || threads < 1 || cols % vs::QK || cols % f->block_cols) return -1.0;
  auto pool = vs::ThreadPool::shared(threads);
  vs::Matrix m;
  vs::repack(m, f, (const uint8_t*)data, rows, cols, pool.get());
  vs::Act a(T, cols);
  for (size_t i = 0; i < a.x.size(); i++) a.x[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
  for (int t = 0; t < T; t++) a.quantize(k, t);
  std::vector<float> out((size_t)T * rows);
  const vs::QAct qa = a.view();
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    pool->parallel_for(m.panels, [&](int p0, int p1) { f->matmul[k->isa](m, p0, p1, qa, T, out.data(), rows); }, 2);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::free(m.data);
  return best;
}

// Rows of a matrix dequantized from its panels (the embedding lookup), fp32 [rows][cols].
int vs_test_dequant(int ggml_type, const void* data, int rows, int cols, float* out, char* err, int n) {
  const vs::Format* f = vs::format_by_type(ggml_type);
  if (!f || rows < 1 || cols % vs::QK || cols % f->block_cols) {
    set_err(err, n, "unsupported format or shape");
    return -1;
  }
  vs::Linear l;
  vs::Matrix m;
  vs::repack(m, f, (const uint8_t*)data, rows, cols);
  l.parts.push_back(m);
  l.row0.push_back(0);
  for (int r = 0; r < rows; r++) l.row(r, out + (size_t)r * cols);
  l.clear();
  return 0;
}

// Rows of a source matrix re-encoded as Q4_0 blocks (dst: rows x cols / 32 x 18 bytes): a
// draft model streams fewer bytes per token; the target checks every drafted token, so
// output is unchanged (models/cpu.py requantize). Rows are split over `threads` threads.
int vs_requantize_q4_0(int src_type, const void* data, int rows, int cols, void* dst, int threads, char* err, int n) {
  const vs::Format* f = vs::format_by_type(src_type);
  if (!f || rows < 1 || cols % vs::QK || cols % f->block_cols || threads < 1) {
    set_err(err, n, "unsupported format or shape");
    return -1;
  }
  try {
    auto pool = vs::ThreadPool::shared(threads);
    vs::Matrix m;
    vs::repack(m, f, (const uint8_t*)data, rows, cols, pool.get());
    const size_t rb = (size_t)(cols / vs::QK) * 18;
    pool->parallel_for(m.panels, [&](int p0, int p1) {
      std::vector<float> row(cols);
      for (int r = p0 * vs::PANEL; r < std::min(rows, p1 * vs::PANEL); r++) {
        f->dequant_row(m.data + (size_t)(r / vs::PANEL) * m.panel_bytes, cols, r % vs::PANEL, row.data());
        vs::quantize_row_q4_0(row.data(), cols, (uint8_t*)dst + (size_t)r * rb);
      }
    }, 4);
    std::free(m.data);
  } catch (const std::exception& ex) {
    set_err(err, n, ex.what());
    return -1;
  }
  return 0;
}

// ---- the ABI, checked by models/cpu.py at load: a stale or mismatched build fails loudly

int vs_abi_version() { return vs::ABI_VERSION; }

// sizeof of the shared structs: 0 Config, 1 Batch
size_t vs_abi_sizeof(int which) { return which == 0 ? sizeof(vs::Config) : which == 1 ? sizeof(vs::Batch) : 0; }

int vs_abi_slots() { return vs::N_SLOTS; }

// "name:ggml_type:block_cols:block_bytes" of every format, comma-separated
int vs_formats(char* out, int n) {
  std::string s;
  for (int i = 0; i < vs::N_FORMATS; i++) {
    const vs::Format* f = vs::FORMATS[i];
    s += (i ? "," : "") + std::string(f->name) + ":" + std::to_string(f->ggml_type) + ":" + std::to_string(f->block_cols) + ":" +
         std::to_string(f->src_block_bytes);
  }
  set_err(out, n, s);
  return (int)s.size() < n ? 0 : -1;
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
