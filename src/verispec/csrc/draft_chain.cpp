// A greedy draft chain in one call (drafters/draft_model.py on the compiled runtime): feed the
// tokens the draft's cache lacks, then take the argmax, decide whether to keep it and whether
// to pay for another draft forward, and feed it back, until the stop rule ends the chain. No
// Python runs between draft tokens (per token the Python loop built a batch, scattered a
// reduced head's logits over the whole vocabulary and ran softmax and argmax in torch).
//
// The decisions are DraftModelDrafter._next's, in double precision: the chain's probability
// of being accepted whole (accept_all) and the tokens a step is expected to yield (expected).
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
  double sum = 0.0;
  for (int r = 0; r < rows; r++) sum += std::exp((double)logits[r] - (double)bv);
  return {head_rows ? head_rows[best] : best, 1.0 / sum};
}

// DraftCost.keeps / pays_another (drafters/draft_model.py)
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
  d.n_drafts = d.n_fed = 0;
  std::vector<float> logits(m.cfg.vocab);
  for (int at = 0; at < d.n_feed; at += FEED_CHUNK) {
    const int n = std::min(FEED_CHUNK, d.n_feed - at);
    feed(m, d, d.feed + at, n, d.cached + at, logits.data());
    d.n_fed += n;
  }
  double accept_all = 1.0, expected = 1.0;
  for (int i = 0; i < d.budget; i++) {
    const Pick p = pick(logits.data(), m.cfg.vocab, d.head_rows);
    if (d.min_confidence > 0.0f && p.prob < (double)d.min_confidence) return;
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
