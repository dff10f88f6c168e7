// verispec compiled CPU runtime: the C ABI that Python calls through ctypes (models/cpu.py;
// ctypes releases the GIL for the call). Building a model (vs_model_*), the forward and its
// input checks, cache slot moves, draft requantization, and the ABI facts checked at load.
// Kernel test and benchmark entry points are in c_api_test.cpp.
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.h"

using vs::Model;
using vs::set_err;

std::string vs::check_batch(const Model& m, const vs::Batch& b) {
  const vs::Config& c = m.cfg;
  char buf[256];
  auto fail = [&](const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return std::string(buf);
  };
  if (b.T < 1) return fail("forward needs at least one token, got %d", b.T);
  if (b.cache_slots < vs::KV_TILE || b.cache_slots % vs::KV_TILE)
    return fail("cache slots must be a positive multiple of %d, got %d", vs::KV_TILE, b.cache_slots);
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
        cfg->n_kv_heads < 1 || cfg->n_heads % cfg->n_kv_heads || cfg->n_heads / cfg->n_kv_heads > vs::MAX_GROUP) {
      set_err(err, n, "unsupported shape: dim, ffn and heads * head_dim must be multiples of 32, heads a multiple of kv "
                      "heads (at most " + std::to_string(vs::MAX_GROUP) + " per kv head)");
      return nullptr;
    }
    if (cfg->n_rope < 1 || cfg->n_rope > 2 || cfg->act < 0 || cfg->act > 1) {
      set_err(err, n, "unsupported config: 1 or 2 RoPE tables, activation 0 (SiLU) or 1 (GELU)");
      return nullptr;
    }
    auto* m = new Model();
    m->cfg = *cfg;
    if (m->cfg.embed_rows <= 0) m->cfg.embed_rows = cfg->vocab;  // 0: a model embedding its own vocabulary
    m->k = k;
    m->layers.resize(cfg->n_layers);
    const size_t table = (size_t)cfg->n_rope * cfg->max_pos * (cfg->head_dim / 2);
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

// What a layer computes beyond a Llama layer (models/architectures.py): its sliding window
// (keys at most, 0: all), its RoPE table (< n_rope), and optional fp32 norms (null: none):
// q_norm, k_norm [head_dim] over each q / k head before RoPE, post_attn, post_ffn [dim] over
// the attention / MLP output before its residual add.
int vs_model_set_layer(void* mp, int layer, int window, int rope, const float* q_norm, const float* k_norm,
                       const float* post_attn, const float* post_ffn, char* err, int n) {
  auto* m = (Model*)mp;
  const vs::Config& c = m->cfg;
  if (layer < 0 || layer >= c.n_layers || window < 0 || rope < 0 || rope >= c.n_rope || (!q_norm != !k_norm) ||
      (!post_attn != !post_ffn)) {
    set_err(err, n, "bad layer settings: layer, window >= 0, RoPE table < n_rope, Q and K norms together, post-norms "
                    "together");
    return -1;
  }
  vs::Layer& L = m->layers[layer];
  L.window = window;
  L.rope = rope;
  auto set = [](std::vector<float>& dst, const float* src, int len) {
    if (src) dst.assign(src, src + len);
    else dst.clear();
  };
  set(L.q_norm, q_norm, c.head_dim);
  set(L.k_norm, k_norm, c.head_dim);
  set(L.post_attn_norm, post_attn, c.dim);
  set(L.post_ffn_norm, post_ffn, c.dim);
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

// A model of `n` of a finished model's layers (`keep`: ascending, distinct) with its embedding, final
// norm and head: self-speculation's draft (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024).
// Its matrices are the parent's, not copied (`borrowed`: the parent frees them and must outlive it);
// its K/V cache is its own, of n layers. Same forward, so a kept layer computes exactly what it
// computes in the parent, over the subset's own K/V.
void* vs_model_subset(void* pp, const int32_t* keep, int n, char* err, int len) {
  auto* p = (Model*)pp;
  if (!p || !keep || n < 1 || n > p->cfg.n_layers) {
    set_err(err, len, "a layer subset keeps 1 to all of the model's layers");
    return nullptr;
  }
  for (int i = 0; i < n; i++)
    if (keep[i] < 0 || keep[i] >= p->cfg.n_layers || (i && keep[i] <= keep[i - 1])) {
      set_err(err, len, "a layer subset lists ascending, distinct layers of the model");
      return nullptr;
    }
  try {
    auto* m = new Model();
    m->cfg = p->cfg;
    m->cfg.n_layers = n;
    for (int i = 0; i < n; i++) m->layers.push_back(p->layers[keep[i]]);
    m->norm = p->norm;
    m->rope_cos = p->rope_cos;
    m->rope_sin = p->rope_sin;
    m->embed = p->embed;
    m->head = p->head;
    m->in_proj = p->in_proj;
    m->in_norm = p->in_norm;
    m->tied = p->tied;
    m->k = p->k;
    m->pool = p->pool;
    m->borrowed = true;
    return m;
  } catch (const std::exception& ex) {
    set_err(err, len, std::string("cannot create the layer subset: ") + ex.what());
    return nullptr;
  }
}

// Bytes of repacked weights read per decode step (the embedding's rows are read one per token).
size_t vs_model_weight_bytes(void* mp) {
  auto* m = (Model*)mp;
  size_t total = m->head.bytes() + m->in_proj.bytes();
  for (auto& L : m->layers) total += L.wqkv.bytes() + L.wo.bytes() + L.w13.bytes() + L.w2.bytes();
  return total;
}

// Rows of a source matrix re-encoded as blocks of dst_type, a format whose table row has a
// quantize_row (Q4_0, Q3_K, Q2_K; dst: rows x the rows' bytes in that format): a draft model streams fewer bytes per token; the target checks
// every drafted token, so output is unchanged (models/cpu_weights.py requantize). Rows are
// split over `threads` threads.
int vs_requantize(int dst_type, int src_type, const void* data, int rows, int cols, void* dst, int threads, char* err,
                  int n) {
  const vs::Format* f = vs::format_by_type(src_type);
  const vs::Format* to = vs::format_by_type(dst_type);
  if (!f || !to || !to->quantize_row || rows < 1 || cols % vs::QK || cols % f->block_cols || cols % to->block_cols ||
      threads < 1) {
    set_err(err, n, "unsupported format or shape");
    return -1;
  }
  try {
    auto pool = vs::ThreadPool::shared(threads);
    vs::Matrix m;
    vs::repack(m, f, (const uint8_t*)data, rows, cols, pool.get());
    const size_t rb = (size_t)(cols / to->block_cols) * to->src_block_bytes;
    pool->parallel_for(m.panels, [&](int p0, int p1) {
      std::vector<float> row(cols);
      for (int r = p0 * vs::PANEL; r < std::min(rows, p1 * vs::PANEL); r++) {
        f->dequant_row(m.data + (size_t)(r / vs::PANEL) * m.panel_bytes, cols, r % vs::PANEL, row.data());
        to->quantize_row(row.data(), cols, (uint8_t*)dst + (size_t)r * rb);
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
size_t vs_abi_sizeof(int which) {
  return which == 0 ? sizeof(vs::Config) : which == 1 ? sizeof(vs::Batch) : which == 2 ? sizeof(vs::DraftChain) : 0;
}

int vs_abi_slots() { return vs::N_SLOTS; }

// "name:ggml_type:block_cols:block_bytes" of every format, comma-separated
int vs_formats(char* out, int n) {
  std::string s;
  for (int i = 0; i < vs::N_FORMATS; i++) {
    const vs::Format* f = vs::FORMATS[i];
    s += (i ? "," : "") + std::string(f->name) + ":" + std::to_string(f->ggml_type) + ":" + std::to_string(f->block_cols) + ":" +
         std::to_string(f->src_block_bytes) + ":" + (f->quantize_row ? "1" : "0");
  }
  set_err(out, n, s);
  return (int)s.size() < n ? 0 : -1;
}

int vs_forward(void* mp, const vs::Batch* b, char* err, int n) {
  auto* m = (Model*)mp;
  const std::string e = check_batch(*m, *b);
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
  vs::move_cache_slots(*c, kcache, vcache, rows, slots, row, src, count, dst);
}

}  // extern "C"
