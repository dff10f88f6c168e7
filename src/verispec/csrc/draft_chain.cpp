// A draft chain in one call (drafters/draft_model.py on the compiled runtime): feed the tokens
// the draft's cache lacks, then pick the next token, decide whether to keep it and whether to
// pay for another draft forward, and feed it back, until the stop rule ends the chain. No
// Python runs between draft tokens (per token the Python loop built a batch, scattered a
// reduced head's logits over the whole vocabulary and ran softmax and argmax, or the sampling
// filters and a draw, in torch).
//
// A greedy chain takes the argmax. A sampled chain draws each draft from the draft's own
// distribution q (speculative sampling, Leviathan et al. 2023; Chen et al. 2023: the rejection
// sampler accepts x ~ q with min(1, p(x) / q(x)) and needs q), q being sampling.process_logits'
// law over the LM head's rows: temperature, then min-p, then top-k, then top-p, then softmax.
// The draws are the caller's uniforms (its per-request generator: seeding and reproducibility
// stay Python's), each an inverse CDF over q in double precision; q is returned row by row, so
// the rejection sampler tests every draft against the very law it was drawn from (q agrees
// with torch's to float rounding; the output's law does not depend on that rounding).
//
// The decisions are DraftModelDrafter._next's, in double precision: the chain's probability
// of being accepted whole (accept_all, guessed from each draft's law's top probability) and the
// tokens a step is expected to yield (expected).
// Output never depends on them (a draft is only a proposal); they only size the chain.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.h"

namespace vs {
namespace {

constexpr int FEED_CHUNK = 256;  // feed tokens per forward: bounds the causal visibility lists (T^2 / 2 slots)

// The softmax probability of the largest logit, `top`, of logits[0..rows).
double top_probability(const float* logits, int rows, float top) {
  double sum = 0.0;
  for (int r = 0; r < rows; r++) sum += std::exp((double)logits[r] - (double)top);
  return 1.0 / sum;
}

// The token of the largest logit, the smallest token id among ties (torch's argmax over the
// whole vocabulary, a reduced head's other tokens being -inf), NaN counting as the largest;
// and the softmax probability of that token.
struct Pick {
  int token;
  double prob;
};

Pick pick(const float* logits, int rows, const int32_t* head_rows) {
  int best = -1;
  float bv = 0.0f;
  bool nan = false;
  for (int r = 0; r < rows; r++) {
    const float v = logits[r];
    const int tok = head_rows ? head_rows[r] : r;
    const bool vnan = std::isnan(v);
    const bool better = best < 0 || (vnan && !nan) || (vnan == nan && !vnan && v > bv) ||
                        (vnan == nan && (vnan || v == bv) && tok < (head_rows ? head_rows[best] : best));
    if (better) best = r, bv = v, nan = vnan;
  }
  if (nan) return {head_rows ? head_rows[best] : best, NAN};
  return {head_rows ? head_rows[best] : best, top_probability(logits, rows, bv)};
}

// Softmax of x[0..n) (-inf entries allowed; the largest, `top`, finite) into q, in double
// precision (e: scratch) rounded once to float.
void softmax(const float* x, int n, float top, std::vector<double>& e, float* q) {
  double sum = 0.0;
  for (int r = 0; r < n; r++) sum += e[r] = std::exp((double)x[r] - (double)top);
  for (int r = 0; r < n; r++) q[r] = (float)(e[r] / sum);
}

// sampling.process_logits then softmax, over the head's rows (a reduced head's other tokens,
// -inf there, have probability 0 either way): q into `q`; false when the logits name no token
// (NaN, +inf or nothing finite: a drafter stops there, the target's own logits are checked).
// Float arithmetic where torch's is float (logits / T, the min-p threshold, top-p's masses
// before a token), so the filters keep the tokens torch's keep but where float rounding of the
// softmax puts a top-p mass within an ulp of top_p.
struct Scratch {
  std::vector<float> x;
  std::vector<double> e;
  std::vector<int> order;
};

bool draft_law(const float* logits, int rows, const DraftChain& d, Scratch& s, float* q) {
  std::vector<float>& x = s.x;
  std::vector<int>& order = s.order;
  x.resize(rows);
  s.e.resize(rows);
  float top = -INFINITY;
  for (int r = 0; r < rows; r++) {
    x[r] = logits[r] / d.temperature;
    if (std::isnan(x[r]) || x[r] == INFINITY) return false;
    top = std::max(top, x[r]);
  }
  if (top == -INFINITY) return false;
  if (d.min_p > 0.0f) {  // p(x) < min_p * p_max  <=>  logit(x) < logit_max + log(min_p)
    const float below = top + (float)std::log((double)d.min_p);
    for (int r = 0; r < rows; r++)
      if (x[r] < below) x[r] = -INFINITY;
  }
  const auto before = [&](int a, int b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  if (d.top_k > 0 && d.top_k < rows) {
    order.resize(rows);
    for (int r = 0; r < rows; r++) order[r] = r;
    std::nth_element(order.begin(), order.begin() + (d.top_k - 1), order.end(), before);
    const float kth = x[order[d.top_k - 1]];
    for (int r = 0; r < rows; r++)
      if (x[r] < kth) x[r] = -INFINITY;
  }
  if (d.top_p < 1.0f) {
    // drop a token when the mass before it (largest first) reaches top_p, the first kept always:
    // only a prefix of the order is read, so it is sorted in growing prefixes, not whole
    softmax(x.data(), rows, top, s.e, q);
    order.resize(rows);
    for (int r = 0; r < rows; r++) order[r] = r;
    double cum = 0.0;  // torch's cumsum accumulates in double, stores float
    int sorted = 0, kept = rows;
    for (int i = 0; i < rows && kept == rows; i++) {
      if (i == sorted) {
        const int upto = std::min(rows, std::max(64, 2 * sorted));
        std::partial_sort(order.begin() + sorted, order.begin() + upto, order.end(), before);
        sorted = upto;
      }
      const float p = q[order[i]];
      cum += p;
      if (i > 0 && (float)cum - p >= d.top_p) kept = i;
    }
    for (int i = kept; i < rows; i++) x[order[i]] = -INFINITY;
  }
  softmax(x.data(), rows, top, s.e, q);
  return true;
}

// The row that the inverse CDF of q puts `u` in (sampling.sample's rule: the first row whose
// running sum, in double precision, exceeds u times the total; rounding past the end: the last
// row with mass).
int draw(const float* q, int rows, double u) {
  double total = 0.0;
  for (int r = 0; r < rows; r++) total += q[r];
  const double point = u * total;
  double cum = 0.0;
  int last = 0;
  for (int r = 0; r < rows; r++) {
    cum += q[r];
    if (cum > point) return r;
    if (q[r] > 0.0f) last = r;
  }
  return last;
}

// CostModel.keeps / pays_another (cost_model.py)
bool keeps(const DraftChain& d, int i, double expected, double p) {
  const double paid = (i + 1) * d.draft_cost;
  return (expected + p) / (paid + d.verify[i + 1]) >= expected / (paid + d.verify[i]);
}
bool pays_another(const DraftChain& d, int i, double expected, double p) {
  const double now = expected / ((i + 1) * d.draft_cost + d.verify[i + 1]);
  return (expected + p) / ((i + 2) * d.draft_cost + d.verify[i + 2]) >= now;
}

// Tokens ids[0..n) at slots start, start + 1, ... of the chain's row, causal over themselves
// (earlier slots are cached); the last token's logits into `logits`. Throws on a bad batch.
void feed(Model& m, const DraftChain& d, const int32_t* ids, int n, int start, float* logits) {
  std::vector<int32_t> pos(n), seq(n, 0), vis_off(n + 1), vis;
  vis.reserve((size_t)n * (n + 1) / 2);
  for (int t = 0; t < n; t++) {
    pos[t] = start + t;
    vis_off[t] = (int32_t)vis.size();
    for (int j = 0; j <= t; j++) vis.push_back(start + j);
  }
  vis_off[n] = (int32_t)vis.size();
  const int32_t last = n - 1;
  Batch b{};
  b.T = n;
  b.ids = ids;
  b.pos = pos.data();
  b.seq = seq.data();
  b.slot = pos.data();  // a chain's slots are its positions
  b.vis_off = vis_off.data();
  b.vis = vis.data();
  b.n_seqs = 1;
  b.seq_row = &d.row;
  b.seq_cached = &start;
  b.kcache = d.kcache;
  b.vcache = d.vcache;
  b.cache_rows = d.cache_rows;
  b.cache_slots = d.cache_slots;
  b.n_logits = 1;
  b.logit_tokens = &last;
  b.logits = logits;
  const std::string e = check_batch(m, b);
  if (!e.empty()) throw std::invalid_argument(e);
  forward(m, b);
}

void draft_chain(Model& m, DraftChain& d) {
  if (d.n_feed < 1) throw std::invalid_argument("a draft chain needs at least one token to feed (its root)");
  if (d.budget < 0 || (d.use_cost && !d.verify)) throw std::invalid_argument("a draft chain needs budget >= 0 (and t(n) with the cost rule)");
  const bool sampled = d.temperature > 0.0f;
  // top_p and min_p as floats: a request's 1e-50 rounds to 0, its 1 - 1e-10 to 1 (both still mean the same filter)
  if (sampled && (!d.uniforms || !d.q || !(d.top_p >= 0.0f && d.top_p <= 1.0f) || !(d.min_p >= 0.0f && d.min_p <= 1.0f)
                  || d.top_k < 0))
    throw std::invalid_argument("a sampled draft chain needs uniforms, q rows, top_p and min_p in [0, 1] and "
                                "top_k >= 0");
  d.n_drafts = d.n_fed = 0;
  const int rows = m.cfg.vocab;
  std::vector<float> logits(rows);
  Scratch scratch;
  for (int at = 0; at < d.n_feed; at += FEED_CHUNK) {
    const int n = std::min(FEED_CHUNK, d.n_feed - at);
    feed(m, d, d.feed + at, n, d.cached + at, logits.data());
    d.n_fed += n;
  }
  double accept_all = 1.0, expected = 1.0;
  for (int i = 0; i < d.budget; i++) {
    // the draft and the guess of its acceptance the cost rule reads: the top probability of the law it is
    // drafted from (the argmax's softmax probability; a sampled draft's q's largest, not q(draft): see
    // DraftModelDrafter._next); and the draft's confidence, its top softmax probability at temperature 1
    // (the min_confidence stop)
    Pick p{};
    double confidence = 0.0;
    if (!sampled) {
      p = pick(logits.data(), rows, d.head_rows);
      confidence = p.prob;
    } else {
      float* q = d.q + (size_t)i * rows;
      if (!draft_law(logits.data(), rows, d, scratch, q)) return;
      const int r = draw(q, rows, d.uniforms[i]);
      p = {d.head_rows ? d.head_rows[r] : r, (double)*std::max_element(q, q + rows)};
      if (d.min_confidence > 0.0f)
        confidence = top_probability(logits.data(), rows, *std::max_element(logits.begin(), logits.end()));
    }
    if (d.min_confidence > 0.0f && confidence < (double)d.min_confidence) return;
    if (d.use_cost) {  // keep token i + 1 only if it raises tokens per unit time
      const double keep_p = accept_all * p.prob;
      if (!keeps(d, i, expected, keep_p)) return;
      accept_all = keep_p;
      expected += keep_p;
    }
    d.drafts[d.n_drafts++] = p.token;
    if (i + 1 >= d.budget || (d.use_cost && !pays_another(d, i, expected, accept_all * p.prob))) return;
    feed(m, d, &d.drafts[i], 1, d.cached + d.n_fed, logits.data());
    d.n_fed += 1;
  }
}

}  // namespace
}  // namespace vs

extern "C" int vs_draft_chain(void* mp, vs::DraftChain* d, char* err, int n) {
  auto* m = (vs::Model*)mp;
  try {
    std::lock_guard<std::mutex> lock(m->busy);
    vs::draft_chain(*m, *d);
  } catch (const std::exception& ex) {
    vs::set_err(err, n, std::string("draft chain: ") + ex.what());
    return -1;
  }
  return 0;
}

// One draft of a sampled chain from given logits (DraftModelDrafter's Python loop on the compiled
// runtime: requests drafted together in batched forwards), with the one call's law and draw, so a
// request drafts the same chain alone or beside others. q into `q`; the row drawn with `u`, or
// -1 when the logits name no token.
extern "C" int vs_draft_law(int rows, const float* logits, float temperature, float min_p, float top_p, int top_k,
                            double u, float* q) {
  vs::DraftChain d{};
  d.temperature = temperature, d.min_p = min_p, d.top_p = top_p, d.top_k = top_k;
  try {
    vs::Scratch scratch;
    return vs::draft_law(logits, rows, d, scratch, q) ? vs::draw(q, rows, u) : -1;
  } catch (const std::exception&) {  // scratch allocation
    return -1;
  }
}
