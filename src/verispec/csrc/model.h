// verispec compiled CPU runtime: the model, its weights and a forward's batch (the types shared
// by weights.cpp, forward.cpp and the C ABI in c_api.cpp / c_api_test.cpp).
//
// Shapes in the comments: dim = Config::dim, D = head_dim, H = n_heads, KVH = n_kv_heads,
// ffn = Config::ffn, T = the batch's new tokens. Matrices are [rows, cols] and compute
// out = W @ x; every buffer is row-major.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "threads.h"
#include "vs.h"

namespace vs {

// ---------------------------------------------------------------- weights (weights.cpp)

// A linear layer: row blocks ("parts") stacked on top of each other, each in its own format
// (a fused QKV whose V is Q6_K while Q and K are Q4_K). Part i computes output rows
// [row0_i, row0_i + rows_i); each part's panels are its own, padded to 16 rows.
struct Linear {
  std::vector<Matrix> parts;  // [n_parts] row blocks, each repacked into 16-row panels
  std::vector<int> row0;      // [n_parts] first output row of each part
  int rows = 0, cols = 0;     // logical shape [rows, cols]: the parts' rows summed, their common cols
  int panels = 0;             // panels of all parts: the matmul's unit of work
  // By reference (an input embedding read one row per token): the caller's source blocks,
  // e.g. a memory-mapped GGUF, instead of panels; rows are repacked one at a time on lookup.
  const Format* ref_fmt = nullptr;
  const uint8_t* ref = nullptr;  // [rows] source rows of ref_row_bytes each
  size_t ref_row_bytes = 0;

  bool empty() const { return parts.empty() && !ref; }
  void clear();                     // frees every part's panels and bias
  size_t bytes() const;             // bytes of repacked panels
  void row(int r, float* out) const;  // row r as fp32 [cols] (embedding lookups)
};

// "auto" picks the widest ISA the CPU has; a named ISA must be supported (else null and `err`).
const Kernels* select_kernels(const char* want, std::string& err);

// `bytes` zeroed bytes aligned for panels (throws std::bad_alloc).
void* aligned_zeroed(size_t bytes);

// Repack a row-major source matrix (GGUF blocks of `f`, or fp32) [rows, cols] into 16-row
// panels; with a pool, threads split the panels. Throws if the format refuses a block.
void repack(Matrix& m, const Format* f, const uint8_t* data, int rows, int cols, ThreadPool* pool = nullptr);

// ---------------------------------------------------------------- the model

struct Config {  // mirrors the Python ctypes struct (models/cpu.py): its fields, in order, are the ABI
  int32_t vocab;       // rows of the LM head: logits per token
  int32_t dim;         // width of the residual stream
  int32_t n_layers;
  int32_t n_heads;     // H query heads
  int32_t n_kv_heads;  // KVH key / value heads; G = H / KVH query heads share each one
  int32_t head_dim;    // D
  int32_t ffn;         // width of the MLP's hidden layer
  int32_t max_pos;     // rows of the RoPE tables: positions < max_pos
  float eps;           // RMSNorm epsilon
  int32_t kv16;        // the KV cache holds fp16 values (else fp32)
  int32_t embed_rows;  // rows of the input embedding (token ids < this); a tied model has vocab
  // Architectures beyond a plain Llama (models/architectures.py); a Llama gives 0, 1, 1, 0, 0.
  int32_t act;          // the MLP's gate activation: 0 SiLU (SwiGLU), 1 tanh-approximated GELU (GeGLU)
  int32_t n_rope;       // RoPE tables: 1, or 2 when sliding layers have their own base (Layer::rope)
  float embed_scale;    // input embeddings times this (gemma: sqrt(dim)); 1 or 0: as they are
  float attn_scale;     // attention scores times this; 0: 1 / sqrt(head_dim)
  float logit_softcap;  // logits -> cap * tanh(logits / cap); 0: none
};

struct Layer {
  std::vector<float> attn_norm, ffn_norm;  // [dim] RMSNorm weights before attention / before the MLP
  // optional (empty: none; vs_model_set_layer): RMSNorm of each q and k head before RoPE [D];
  // of the attention and MLP outputs before their residual adds [dim]
  std::vector<float> q_norm, k_norm, post_attn_norm, post_ffn_norm;
  int window = 0;  // keys a token attends to at most, itself included (sliding window); 0: all
  int rope = 0;    // its RoPE table, < Config::n_rope
  Linear wqkv;  // [(H + 2 KVH) * D, dim]: rows of the q heads, then the k heads, then the v heads
  Linear wo;    // [dim, H * D]
  Linear w13;   // [2 ffn, dim]: gate (W1) rows, then up (W3) rows
  Linear w2;    // [dim, ffn]: down
};

struct Model {
  Config cfg{};
  std::vector<Layer> layers;           // [n_layers]
  std::vector<float> norm;             // [dim] final RMSNorm weights
  std::vector<float> rope_cos, rope_sin;  // [n_rope, max_pos, D / 2] RoPE tables (rotate_half convention)
  Linear embed;                        // [embed_rows, dim] input embedding; empty when tied to the head
  Linear head;                         // [vocab, dim] LM head
  // Feature input (EAGLE heads): x = in_proj @ [in_norm(feat) ; embed(id)], used when a
  // batch carries features; in_norm empty = features as given.
  Linear in_proj;                      // [dim, 2 dim], or empty
  std::vector<float> in_norm;          // [dim], or empty
  bool tied = false;          // the input embedding is the LM head (embed empty)
  const Kernels* k = nullptr;  // the ISA's kernels (matmuls go by k->isa into each Format)
  std::shared_ptr<ThreadPool> pool;  // ThreadPool::shared: one pool per thread count in the process
  std::mutex busy;  // one forward (or thread-count change) at a time: the pool runs one job
  // a layer subset of another model (vs_model_subset): its matrices are that model's, freed by it
  bool borrowed = false;

  ~Model() {
    if (borrowed) return;
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
  int32_t n_seqs;             // sequences in the batch, each in its own cache row
  const int32_t* seq_row;     // [n_seqs] cache row
  const int32_t* seq_cached;  // [n_seqs] visible cached slots 0 .. n-1
  void* kcache;               // K cache of the pool (layout above)
  void* vcache;               // V cache of the pool
  int32_t cache_rows, cache_slots;  // rows (sequences) of the pool, slots per row (a multiple of KV_TILE)
  int32_t n_logits;
  const int32_t* logit_tokens;  // [n_logits] tokens whose logits are wanted
  float* logits;                // [n_logits][vocab]
  float* hidden;                // [T][dim] final-normed hidden states, or null
  int32_t n_layer_out;          // layers whose output residual stream is copied out (EAGLE-3 features)
  const int32_t* layer_ids;     // [n_layer_out] ascending decoder-layer indices
  float* layer_out;             // [T][n_layer_out][dim], or null
  const float* feat;            // [T][dim] input features (a model with in_proj: EAGLE heads), or null = embed ids
};

// One greedy draft chain on a draft model in one call (draft_chain.cpp; mirrors the ctypes
// struct in models/cpu_abi.py). The stop rule is drafters/draft_model.py's: a token is drafted
// unless the budget is spent, its probability is below min_confidence, or (use_cost) it does
// not raise the expected tokens per unit time; another draft forward is paid for only while
// one more token would. verify[n] = t(n), the target's forward over the root and n drafted
// tokens, and draft_cost = one draft forward, both in target decode steps.
struct DraftChain {
  int32_t n_feed;           // tokens the draft's cache lacks (>= 1), the last one the chain's root
  const int32_t* feed;      // [n_feed]
  int32_t row, cached;      // the cache row and its cached slots (the feed goes to cached, cached + 1, ...)
  void* kcache;             // the pool's K and V caches (Batch's layout)
  void* vcache;
  int32_t cache_rows, cache_slots;
  int32_t budget;           // drafted tokens at most
  float min_confidence;     // 0: off
  int32_t use_cost;         // 1: the cost rule (draft_cost, verify) sizes the chain
  double draft_cost;
  const double* verify;     // [budget + 2] t(0) .. t(budget + 1)
  const int32_t* head_rows; // [vocab] the token id of each LM-head row (a reduced head), or null
  int32_t* drafts;          // [budget] out: the chain
  int32_t n_drafts;         // out: tokens drafted
  int32_t n_fed;            // out: tokens whose K/V were written (the feed, then drafts fed back)
  // a sampled chain (temperature > 0): each draft drawn from the draft's processed distribution q
  float temperature;        // 0: greedy (the argmax)
  float min_p, top_p;       // sampling.process_logits' filters (min_p 0, top_p 1: off)
  int32_t top_k;            // 0: off
  const double* uniforms;   // [budget] one U(0, 1) draw per draft, the caller's (its generator's) randomness
  float* q;                 // [budget, vocab] out: each draft's q over the LM head's rows (head_rows' order)
};

// Element d of `slot` (>= 0) in one kv head's K cache [slots / KV_TILE][head_dim][KV_TILE]: the
// keys of a tile lie side by side, so SIMD lanes are keys; element d + 1 is KV_TILE further.
inline size_t k_tile_offset(int slot, int d, int head_dim) {
  return (size_t)(slot >> KV_TILE_LOG2) * head_dim * KV_TILE + (size_t)d * KV_TILE + (slot & (KV_TILE - 1));
}

// Scratch for T token rows of width `cols`: fp32 input and its int8 quantization (the input
// of a matmul; QAct in vs.h).
struct Act {
  std::vector<float> x, d, s;   // x: [T, cols]; d, s: [T, cols / 32]
  std::vector<int8_t> q;        // [T, cols]
  std::vector<int32_t> qsum, qsum16;  // [T, cols / 32], [T, cols / 16]
  int cols = 0;
  Act(int T, int c)
      : x((size_t)T * c), d((size_t)T * c / QK), s((size_t)T * c / QK), q((size_t)T * c), qsum((size_t)T * c / QK),
        qsum16((size_t)T * c / 16), cols(c) {}
  void quantize(const Kernels* k, int t) {  // row t of x into q, d, s, qsum, qsum16
    const size_t nb = (size_t)cols / QK;
    k->quantize_row(&x[(size_t)t * cols], cols, &q[(size_t)t * cols], &d[t * nb], &s[t * nb], &qsum[t * nb], &qsum16[2 * t * nb]);
  }
  QAct view() const { return QAct{cols, cols / QK, x.data(), q.data(), d.data(), s.data(), qsum.data(), qsum16.data()}; }
};

// ---------------------------------------------------------------- the forward (forward.cpp)

// One forward of a checked batch (c_api.cpp checks it): K/V of its tokens into the cache,
// then logits, hidden states and layer outputs as the batch asks. The caller holds m.busy.
void forward(Model& m, const Batch& bt);

// Move slots src[0..count) of cache row `row` to dst, dst+1, ... in every layer and kv head
// (the accepted tree path); the caches are laid out as Batch says, fp16 if c.kv16.
void move_cache_slots(const Config& c, void* kcache, void* vcache, int rows, int slots, int row, const int32_t* src,
                      int count, int dst);

// ---------------------------------------------------------------- the C ABI (c_api.cpp, c_api_test.cpp, draft_chain.cpp)

// Why a batch cannot run on this model ("" if it can): every index the forward follows is in
// range, and each token sees itself last and only new slots after its cached ones (c_api.cpp).
std::string check_batch(const Model& m, const Batch& b);

// `msg` into the caller's buffer err[n] (truncated, always terminated).
inline void set_err(char* err, int n, const std::string& msg) {
  if (err && n > 0) std::snprintf(err, n, "%s", msg.c_str());
}

}  // namespace vs
