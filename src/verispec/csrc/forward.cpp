// verispec compiled CPU runtime: the Llama forward, read top to bottom like llama2.c's run.c.
// embed, then per layer
//   x += Wo @ attention(rope(Wqkv @ norm(x)))          (the K/V cache is written first)
//   x += W2 @ (silu(W1 @ norm(x)) * (W3 @ norm(x)))
// then the final norm and the LM head over the rows that want logits. Architectures beyond
// Llama (models/architectures.py) add steps the config and each Layer ask for: scaled
// embeddings, an RMSNorm over each q and k head, a norm over each output before its residual
// add, GELU for SiLU, a sliding window and a second RoPE table per layer, logit softcapping.
// The T new tokens of a batch go through each step together; every step is row-local or reduces in a fixed order
// (vs.h), so a token's logits do not depend on the other tokens of the forward, the thread
// count or the ISA.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "model.h"

namespace vs {

// fn(t) for every token t in [0, T), threads splitting the tokens: one chunk per thread of
// at least 4 tokens (fewer do not pay a wake-up). Which thread runs a token never changes it.
template <class Fn>
static void for_each_token(ThreadPool& pool, int T, Fn fn) {
  const int grain = std::max(4, (T + pool.size() - 1) / pool.size());
  pool.parallel_for(T, [&](int t0, int t1) {
    for (int t = t0; t < t1; t++) fn(t);
  }, grain);
}

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

// out = gelu(g) * u, GELU's tanh approximation (transformers' gelu_pytorch_tanh), one fixed
// sequence of operations per element (libm's tanhf: the same bits on every ISA of a build)
static void gelu_tanh_mul(const float* g, const float* u, float* out, int n) {
  for (int i = 0; i < n; i++) {
    const float x = g[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x))) * u[i];
  }
}

static void rope(float* x, const float* cos, const float* sin, int half) {  // rotate_half convention
  for (int i = 0; i < half; i++) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

// Offset of a (cache row, kv head) in one layer's K or V cache, in elements (Batch).
static size_t kv_head_base(const Model& m, const Batch& bt, int row, int g) {
  return ((size_t)row * m.cfg.n_kv_heads + g) * bt.cache_slots * m.cfg.head_dim;
}

// Token t's k and v heads (rows H.. of its qkv) into slot bt.slot[t] of its cache row.
static void write_kv(const Model& m, const Batch& bt, int t, const float* qkv, char* kc, char* vc) {
  const Config& c = m.cfg;
  const int D = c.head_dim, H = c.n_heads, KVH = c.n_kv_heads;
  const int row = bt.seq_row[bt.seq[t]], s = bt.slot[t];
  for (int g = 0; g < KVH; g++) {
    const size_t base = kv_head_base(m, bt, row, g);
    const size_t kt = base + k_tile_offset(s, 0, D), vt = base + (size_t)s * D;
    const float* k = qkv + (H + g) * D;
    const float* v = qkv + (H + KVH + g) * D;
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

// A sliding-window layer's task: of the token's keys (its cached slots, then its new ones),
// only the last `window`, which sit at consecutive positions ending at its own. They are listed
// as path slots from the tile of the first one (the task's K/V start there), so a token's list,
// and with it every operation of its attention, is the same however its keys were split
// between the cache and the forward. `keys`: the list's storage.
static void window_task(AttnTask& task, int window, int D, size_t esize, std::vector<int32_t>& keys) {
  const int n = task.n_cached + task.n_path, drop = n - window;
  keys.clear();
  for (int j = drop; j < n; j++) keys.push_back(j < task.n_cached ? j : task.path[j - task.n_cached]);
  const int first = keys[0] & ~(KV_TILE - 1);  // K tiles and V rows from here: k_tile_offset(first, 0, D) = first * D
  for (int32_t& s : keys) s -= first;
  task.kt = (const char*)task.kt + (size_t)first * D * esize;
  task.v = (const char*)task.v + (size_t)first * D * esize;
  task.n_cached = 0;
  task.n_path = (int)keys.size();
  task.path = keys.data();
}

// Attention of every (token, kv head) over the cache of one layer (kc, vc): the token's cached
// slots, then the new slots it sees (Batch::vis), or their last `window` (0: all).
// qkv: [T, (H + 2 KVH) * D]; att: [T, H * D].
static void attention(Model& m, const Batch& bt, const char* kc, const char* vc, const std::vector<float>& qkv,
                      Act& att, int window) {
  const Config& c = m.cfg;
  const int T = bt.T, D = c.head_dim, H = c.n_heads, KVH = c.n_kv_heads, G = H / KVH;
  const int qkv_w = (H + 2 * KVH) * D;
  const size_t esize = c.kv16 ? 2 : 4;  // bytes per cache element
  const float scale = c.attn_scale > 0 ? c.attn_scale : 1.0f / std::sqrt((float)D);
  int max_slot = 0;
  for (int t = 0; t < T; t++) max_slot = bt.slot[t] > max_slot ? bt.slot[t] : max_slot;
  const int stride = (max_slot / KV_TILE + 1) * KV_TILE;  // scores per head: whole tiles up to any token's slot
  // task i: kv head i / T, token i % T (kv head outer: a sequence's tokens reuse its K/V in cache)
  auto task_of = [&](int i) {
    const int g = i / T, t = i % T, sq = bt.seq[t];
    const size_t base = kv_head_base(m, bt, bt.seq_row[sq], g);
    return AttnTask{&qkv[(size_t)t * qkv_w + g * G * D], kc + base * esize, vc + base * esize, bt.seq_cached[sq],
                    bt.vis_off[t + 1] - bt.vis_off[t], bt.vis + bt.vis_off[t], &att.x[(size_t)t * H * D + g * G * D]};
  };
  // a sliding window cuts the task's keys (window_task), else they are its own
  auto windowed = [&](const AttnTask& task) { return window > 0 && task.n_cached + task.n_path > window; };
  m.pool->parallel_for(T * KVH, [&](int i0, int i1) {
    static thread_local std::vector<float> scores;  // [2 G, stride]: grown, never zeroed (every read score is written first)
    static thread_local std::vector<int32_t> keys;  // a sliding window's slots (window_task)
    if (scores.size() < (size_t)2 * G * stride) scores.resize((size_t)2 * G * stride);
    for (int i = i0; i < i1; i++) {
      AttnTask task = task_of(i);
      if (windowed(task)) {
        window_task(task, window, D, esize, keys);
      } else if (i + 1 < i1 && (i + 1) / T == i / T) {  // the next token of this kv head over the same K cache
        const AttnTask next = task_of(i + 1);         // (a prefill's tokens): both share each K load
        if (next.kt == task.kt && !windowed(next)) {
          m.k->attend_pair(task, next, D, G, scale, scores.data(), stride, c.kv16 != 0);
          i++;
          continue;
        }
      }
      m.k->attend(task, D, G, scale, scores.data(), stride, c.kv16 != 0);
    }
  });
}

void forward(Model& m, const Batch& bt) {
  const Config& c = m.cfg;
  const Kernels* k = m.k;
  ThreadPool& pool = *m.pool;
  const int T = bt.T, dim = c.dim, ffn = c.ffn, D = c.head_dim, H = c.n_heads, KVH = c.n_kv_heads;
  const int qkv_w = (H + 2 * KVH) * D, half = D / 2;
  const size_t layer_bytes = (size_t)bt.cache_rows * KVH * bt.cache_slots * D * (c.kv16 ? 2 : 4);  // K and V alike

  // Scratch, one row per new token. An Act is fp32 rows plus their int8 quantization: a matmul's input.
  std::vector<float> x((size_t)T * dim);        // x: [T, dim] the residual stream
  std::vector<float> qkv((size_t)T * qkv_w);    // qkv: [T, (H + 2 KVH) * D] q heads, k heads, v heads
  std::vector<float> tmp((size_t)T * dim);      // tmp: [T, dim] Wo @ att, then W2 @ hid (added into x)
  std::vector<float> gu((size_t)T * 2 * ffn);   // gu: [T, 2 ffn] gate (W1 @ xn) then up (W3 @ xn)
  Act xn(T, dim);                               // xn: [T, dim] rmsnorm(x), input of Wqkv and W13
  Act att(T, H * D);                            // att: [T, H * D] attention output, input of Wo
  Act hid(T, ffn);                              // hid: [T, ffn] silu(gate) * up, input of W2

  // the input: token embeddings, or an EAGLE head's x = in_proj @ [in_norm(feat) ; embed(id)]
  if (bt.feat) {
    Act fe(T, 2 * dim);  // fe: [T, 2 dim]
    for_each_token(pool, T, [&](int t) {
      float* row = &fe.x[(size_t)t * 2 * dim];
      const float* f = bt.feat + (size_t)t * dim;
      if (m.in_norm.empty()) std::memcpy(row, f, dim * sizeof(float));
      else k->rms_norm(f, m.in_norm.data(), dim, c.eps, row);
      m.embedding().row(bt.ids[t], row + dim);
      fe.quantize(k, t);
    });
    matmul(m, m.in_proj, fe, T, x.data(), dim);
  } else {
    for_each_token(pool, T, [&](int t) {
      float* xt = &x[(size_t)t * dim];
      m.embedding().row(bt.ids[t], xt);
      if (c.embed_scale != 0.0f && c.embed_scale != 1.0f)
        for (int i = 0; i < dim; i++) xt[i] = xt[i] * c.embed_scale;
    });
  }

  for (int l = 0; l < c.n_layers; l++) {
    const Layer& L = m.layers[l];
    char* kc = (char*)bt.kcache + (size_t)l * layer_bytes;  // this layer's K and V caches
    char* vc = (char*)bt.vcache + (size_t)l * layer_bytes;

    // attention rmsnorm, then q, k, v of every token
    for_each_token(pool, T, [&](int t) {
      k->rms_norm(&x[(size_t)t * dim], L.attn_norm.data(), dim, c.eps, &xn.x[(size_t)t * dim]);
      xn.quantize(k, t);
    });
    matmul(m, L.wqkv, xn, T, qkv.data(), qkv_w);

    // (Q/K norms: an rmsnorm over each q and k head,) RoPE on the q and k heads, then k and v
    // into the cache (the tokens of a tree see each other there)
    const size_t table = (size_t)L.rope * c.max_pos * half;  // this layer's RoPE table
    for_each_token(pool, T, [&](int t) {
      float* q = &qkv[(size_t)t * qkv_w];
      if (!L.q_norm.empty())
        for (int h = 0; h < H + KVH; h++)  // q heads, then k heads; in place (row-local)
          k->rms_norm(q + h * D, (h < H ? L.q_norm : L.k_norm).data(), D, c.eps, q + h * D);
      const float* cs = &m.rope_cos[table + (size_t)bt.pos[t] * half];
      const float* sn = &m.rope_sin[table + (size_t)bt.pos[t] * half];
      for (int h = 0; h < H + KVH; h++) rope(q + h * D, cs, sn, half);  // q heads, then k heads
      write_kv(m, bt, t, q, kc, vc);
    });

    // multi-head attention, then the output projection
    attention(m, bt, kc, vc, qkv, att, L.window);
    for_each_token(pool, T, [&](int t) { att.quantize(k, t); });
    matmul(m, L.wo, att, T, tmp.data(), dim);

    // (post-norm of the output,) residual connection, then the ffn rmsnorm
    for_each_token(pool, T, [&](int t) {
      float* xt = &x[(size_t)t * dim];
      float* ot = &tmp[(size_t)t * dim];
      if (!L.post_attn_norm.empty()) k->rms_norm(ot, L.post_attn_norm.data(), dim, c.eps, ot);
      for (int i = 0; i < dim; i++) xt[i] = xt[i] + ot[i];
      k->rms_norm(xt, L.ffn_norm.data(), dim, c.eps, &xn.x[(size_t)t * dim]);
      xn.quantize(k, t);
    });

    // the MLP: W2 @ (silu(W1 @ xn) * (W3 @ xn)), or gelu for silu
    matmul(m, L.w13, xn, T, gu.data(), 2 * ffn);
    for_each_token(pool, T, [&](int t) {
      const float* g = &gu[(size_t)t * 2 * ffn];
      if (c.act == 1) gelu_tanh_mul(g, g + ffn, &hid.x[(size_t)t * ffn], ffn);
      else k->silu_mul(g, g + ffn, &hid.x[(size_t)t * ffn], ffn);
      hid.quantize(k, t);
    });
    matmul(m, L.w2, hid, T, tmp.data(), dim);

    // (post-norm of the output,) residual connection
    for_each_token(pool, T, [&](int t) {
      float* ot = &tmp[(size_t)t * dim];
      if (!L.post_ffn_norm.empty()) k->rms_norm(ot, L.post_ffn_norm.data(), dim, c.eps, ot);
      for (int i = 0; i < dim; i++) x[(size_t)t * dim + i] = x[(size_t)t * dim + i] + ot[i];
    });
    for (int j = 0; j < bt.n_layer_out; j++)  // a copy of this layer's output only when asked: decode path unchanged
      if (bt.layer_ids[j] == l)
        for (int t = 0; t < T; t++)
          std::memcpy(bt.layer_out + ((size_t)t * bt.n_layer_out + j) * dim, &x[(size_t)t * dim], dim * sizeof(float));
  }

  // final rmsnorm: all rows if hidden states are wanted, else only the logit rows
  const int n_out = bt.n_logits;
  Act fin(n_out > 0 ? n_out : 1, dim);  // fin: [n_logits, dim] the normed rows that want logits
  if (bt.hidden)
    for_each_token(pool, T, [&](int t) {
      k->rms_norm(&x[(size_t)t * dim], m.norm.data(), dim, c.eps, bt.hidden + (size_t)t * dim);
    });
  for (int i = 0; i < n_out; i++) {
    const int t = bt.logit_tokens[i];
    if (bt.hidden) std::memcpy(&fin.x[(size_t)i * dim], bt.hidden + (size_t)t * dim, dim * sizeof(float));
    else k->rms_norm(&x[(size_t)t * dim], m.norm.data(), dim, c.eps, &fin.x[(size_t)i * dim]);
    fin.quantize(k, i);
  }

  // classifier into logits (softcapped: cap * tanh(logit / cap))
  if (n_out > 0) matmul(m, m.head, fin, n_out, bt.logits, c.vocab);
  if (n_out > 0 && c.logit_softcap > 0)
    for_each_token(pool, n_out, [&](int i) {
      float* row = bt.logits + (size_t)i * c.vocab;
      for (int v = 0; v < c.vocab; v++) row[v] = c.logit_softcap * std::tanh(row[v] / c.logit_softcap);
    });
}

// ---------------------------------------------------------------- cache slot moves

template <class KV>
static void move_slots(const Config& c, KV* kcache, KV* vcache, int rows, int slots, int row, const int32_t* src,
                       int count, int dst) {
  const int D = c.head_dim, KVH = c.n_kv_heads;
  const size_t layer = (size_t)rows * KVH * slots * D;
  for (int l = 0; l < c.n_layers; l++)
    for (int g = 0; g < KVH; g++) {
      const size_t base = (size_t)l * layer + ((size_t)row * KVH + g) * slots * D;
      for (int i = 0; i < count; i++) {
        const int s = src[i], t = dst + i;
        if (s == t) continue;
        KV* k = kcache + base;
        for (int d = 0; d < D; d++) k[k_tile_offset(t, d, D)] = k[k_tile_offset(s, d, D)];
        std::memmove(vcache + base + (size_t)t * D, vcache + base + (size_t)s * D, D * sizeof(KV));
      }
    }
}

void move_cache_slots(const Config& c, void* kcache, void* vcache, int rows, int slots, int row, const int32_t* src,
                      int count, int dst) {
  if (c.kv16) move_slots(c, (uint16_t*)kcache, (uint16_t*)vcache, rows, slots, row, src, count, dst);
  else move_slots(c, (float*)kcache, (float*)vcache, rows, slots, row, src, count, dst);
}

}  // namespace vs
