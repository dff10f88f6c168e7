"""Hybrid drafting: a model-free (retrieval) drafter and a learned drafter, chosen or fused
per step, each step's size from the measured cost curve.

Retrieval (SuffixDecoding, prompt lookup) is nearly free and wins where the answer copies the
context; a learned drafter (EAGLE, EAGLE-3, a distilled draft LM) is the only help on novel
text but costs model calls. Per step (``mode="fallback"``):

  1. the retrieval draft, best-first with node values (SuffixDecoding: the tries' path
     probabilities; prompt lookup: its tracked per-depth acceptance), is a candidate when its
     score (sum of values) reaches ``min_score`` and (SuffixDecoding) the context suffix it
     continues is at least ``min_match`` tokens;
  2. each option's best size and rate (``policies/draft_budget.py``, Sequoia's hardware-aware
     rule per step): retrieval ``(E_r(n) + 1) / t(n)``; learned ``(E_l(n) + 1) / (t(n) + c(n))``
     with ``E_l`` its tracked per-depth acceptance and ``c(n)`` its measured drafting time;
     plain decoding 1;
  3. the highest rate proposes (retrieval wins ties); the learned drafter is called only when
     it proposes. One that would lose to plain decoding even if every node were accepted is left
     out at construction (``learned_enabled``); with ``learned_cost`` one whose tracked
     acceptance says it loses is asked only once in PROBE_EVERY steps.

``mode="fuse"`` merges the retrieval draft into the learned tree by longest shared prefix (RASD:
Quan et al. 2025, "Retrieval-Augmented Speculative Decoding", arXiv 2503.03434). Without a cost
curve the rule is the plain fallback: retrieval when it passes its gates, else the learned
drafter at the full budget. ``learned_sizing="self"``: the learned drafter sizes its own drafts
(the draft model's cost rule) and gets the full budget when retrieval is not a candidate.
Under a constraint (``ctx.grammar``) the retrieval draft loses the nodes the grammar forbids
before it is sized.

Both sub-drafters observe every step, whoever proposed; the prefill observation goes only to
sub-drafters that need hidden states. A learned drafter that reads no features (a draft model)
starts a request only when first asked to propose, with everything committed so far as its
prompt, and, when next asked, feeds itself every token committed since it last drafted.
Asking it then is a rent-or-buy decision (ski rental, Karlin et al. 1988, "Competitive snoopy
caching"): each step decoded without it forgoes ``1 - 1/r`` decode steps (r its rate on the
cost curve), the catch-up costs ``pending * catch_up_cost``; it is asked once the forgone
savings reach that cost (within twice the better choice in hindsight); a short catch-up is paid
at once. Its first start (the prompt's prefill past its own prefix cache) is rented by
``rent_start``: ``"constrained"`` on constrained requests only (a schema the draft model has
seen starts it at once), ``"always"`` on every request, ``"predicted"`` after a prediction (ski
rental with a prediction, Purohit, Svitkina and Kumar 2018, "Improving Online Algorithms via ML
Predictions"): the median length of the last ANSWERS_KEPT answers, less what this answer has,
predicts the tokens to come; the start is bought at once where they would save more than it
costs (or no answer has finished yet), else rented until the forgone savings reach twice its
cost (1 / PREDICTION_TRUST). A request that carries a prediction (Predicted Outputs) rents the
start plainly. Under every rule a start, catch-up, probe or ask for evidence that the answer's
remaining room (``max_new_tokens`` less what it has) could not pay back even with drafts accepted in
full is never bought (the tracked rate only prices the rent: before any evidence its prior, 1.06 on
the Qwen pair, would keep out starts that pay): an agent turn's first start feeds the draft model
2-3k tokens of history for an answer of at most a few hundred. The measurements behind ``min_match``, the rent rules and their defaults:
docs/benchmarks.md, "How auto chooses".

The hybrid declares the learned drafter's ``features`` as its own, so the engine hands its
observations the features it reads; a learned drafter left out asks for nothing.

By context (``context_costs``: a self-sizing draft model's ``CostModel`` with curves timed at several
contexts, ``cost_curve.ContextCostCurve``): every price above (t(n), the draft model's c(n) = n draft
steps, a catch-up's cost per token: its timed feed of the history there) is read at the request's
current length, not at the 128 tokens a single curve was timed at. Where, at that context, even a
draft accepted in full would lose to plain decoding the draft model is not asked, nor started
(``declined`` counts those steps): the free drafters carry the turn.

Lossless: every proposed tree is a sub-drafter's own tree (with its draft probabilities, if
any) or a fused point-mass tree. A point-mass node is verified by recursive rejection, whose
output law is p for *any* x chosen independently of the verification's randomness, so dropping
the learned tree's q in a fusion only lowers acceptance. Greedy: any tree verifies to plain
decoding.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import ClassVar, Literal

from ..constraints.speculation import keep_nodes, reachable
from ..cost_model import CostModel
from ..policies.draft_budget import DepthAcceptance, best_size
from ..tree import DraftTree
from .base import (NO_FEATURES, CountsPrefill, DeclaresFeatures, DraftContext, Drafter, Observation, RequestTable,
                   Speculates, features_of)
from .options import option

Source = Literal["retrieval", "learned", "fused", "none"]
SOURCES: tuple[Source, ...] = ("retrieval", "learned", "fused", "none")


def fuse(base: DraftTree, other: DraftTree, budget: int) -> DraftTree:
    """Longest-prefix fusion (RASD): add ``other``'s nodes to ``base`` in ``other``'s order,
    sharing every path prefix ``base`` already has, while the tree has fewer than ``budget``
    drafted nodes. ``base`` keeps its nodes and order; the result is point-mass.

    >>> t = fuse(DraftTree((7, 3, 5, 9), (-1, 0, 0, 1)), DraftTree((7, 3, 4, 8), (-1, 0, 1, 2)), 5)
    >>> t.tokens, t.parents
    ((7, 3, 5, 9, 4, 8), (-1, 0, 0, 1, 1, 4))
    """
    if base.tokens[0] != other.tokens[0]:
        raise ValueError(f"cannot fuse trees with roots {base.tokens[0]} and {other.tokens[0]}")
    tokens, parents = list(base.tokens), list(base.parents)
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if i}  # (parent, token) -> node
    where = [0]  # node of other -> node of the fused tree
    for t, p in zip(other.tokens[1:], other.parents[1:]):
        key = (where[p], t)
        if key not in child:
            if len(tokens) - 1 >= budget:
                break  # other is topological: later nodes would need this one or come later
            child[key] = len(tokens)
            tokens.append(t)
            parents.append(where[p])
        where.append(child[key])
    return DraftTree(tuple(tokens), tuple(parents))


def truncate(tree: DraftTree, n: int) -> DraftTree:
    """The first n drafted nodes of a tree (a tree whenever nodes are topological)."""
    probs = None if tree.draft_probs is None else tree.draft_probs[: n + 1]
    return DraftTree(tree.tokens[: n + 1], tree.parents[: n + 1], probs)


@dataclass(frozen=True)
class _Plan:
    """One request's step before the learned drafter runs (``HybridDrafter._plan``)."""

    retrieval: DraftTree  # the retrieval tree, best-first
    r_n: int  # its size (0: not a candidate)
    fusing: bool
    learned_budget: int  # the learned drafter's budget (0: not asked)


PROBE_EVERY = 16  # a self-sizing learned drafter judged not to pay is still asked once in this many steps
MIN_EVIDENCE = 4  # ... and is always asked until this many of its proposals were verified
CALIBRATION_PRIOR = 8.0  # pseudo-tokens of a request's suffix-draft calibration (``_calibration``)
ANSWERS_KEPT = 16  # rent_start="predicted": the answer lengths of this many finished requests predict the next's
PREDICTION_TRUST = 0.5  # ... and where they say it does not pay, its start is bought at 1 / this times its cost


@dataclass
class _Proposal:
    """What one request's last proposal was, for the acceptance trackers."""

    source: Source = "none"
    learned_nodes: int = 0  # fused: the learned tree's nodes come first (indices 1..this)
    learned_depth: int = 0
    prefilled: bool = False  # the prefill observation has been seen
    learned_seen: int = 0  # committed tokens the learned drafter had when it last drafted
    rent: float = 0.0  # decode steps of saving forgone since then by not asking it (``catch_up_cost``)
    proposed: bool = False  # this step's tree is the hybrid's (a wrapper, e.g. a prediction, may draft instead)
    learned_started: bool = False  # the learned drafter has started this request
    prompt_length: int = 0  # tokens of the prompt ``start`` was given
    answer_length: int = 0  # tokens committed after it, when the hybrid was last asked
    since_learned: int = 0  # steps since the learned drafter last proposed (self sizing: its probes)
    r_expected: float = 0.0  # this step's retrieval draft: the sum of its scores (the accepted tokens they promise)
    r_promised: float = 0.0  # over this request's retrieval steps: tokens the scores promised
    r_accepted: int = 0  # ... and tokens accepted


@dataclass(frozen=True)
class HybridOptions:
    """Suffix (or prompt lookup) first, a learned drafter when that pays more, or both fused (RASD); sizes from the measured cost curves."""

    retrieval: Literal["suffix", "prompt-lookup"] = option("suffix", "the model-free drafter")
    learned: Literal["eagle", "eagle3", "draft"] = option("eagle", "the learned drafter")
    mode: Literal["fallback", "fuse"] = option("fallback", "one of them proposes, or the two trees fused (RASD)")
    min_score: float = option(1.0, "retrieval drafts worth fewer expected tokens are no candidate")
    min_match: int = option(0, "suffix drafts only after a context match this long")
    budget: Literal["measured", "fixed"] = option("measured", "measured: sizes from the cost curves")
    rent_start: Literal["predicted", "always", "constrained"] = option(
        "predicted", "when a draft model's first start on a request is deferred (module docstring)")
    global_suffix: bool = option(True, "retrieval=suffix: its global trie over earlier requests (no: each request's own)")
    learned_options: dict = option({}, "an option of the learned drafter", passthrough="learned")

    def __post_init__(self) -> None:
        if self.min_score < 0 or self.min_match < 0:
            raise ValueError("min_score and min_match must be >= 0")
        if not self.global_suffix and self.retrieval != "suffix":
            raise ValueError("global_suffix=no needs retrieval=suffix")


class HybridDrafter(DeclaresFeatures):
    """A retrieval drafter first, a learned drafter when that pays more (or both fused),
    sized per step from the target's cost curve ``cost`` (t(n)) and the learned drafter's
    measured drafting cost ``learned_cost`` (c(n)). See the module docstring."""

    name: ClassVar[str] = "hybrid"

    def __init__(self, retrieval: Drafter, learned: Drafter, mode: Literal["fallback", "fuse"] = HybridOptions.mode,
                 min_score: float = HybridOptions.min_score, cost: dict[int, float] | None = None,
                 learned_cost: dict[int, float] | None = None, min_match: int = HybridOptions.min_match,
                 learned_sizing: Literal["hybrid", "self"] = "hybrid", catch_up_cost: float = 0.0,
                 rent_start: Literal["constrained", "always", "predicted"] = HybridOptions.rent_start,
                 context_costs: CostModel | None = None):
        if mode not in ("fallback", "fuse"):
            raise ValueError(f"mode must be fallback or fuse, not {mode!r}")
        if min_score < 0:
            raise ValueError(f"min_score must be >= 0, got {min_score}")
        if min_match < 0:
            raise ValueError(f"min_match must be >= 0, got {min_match}")
        if not catch_up_cost >= 0:
            raise ValueError(f"catch_up_cost must be >= 0, got {catch_up_cost}")
        if rent_start not in ("constrained", "always", "predicted"):
            raise ValueError(f"rent_start must be constrained, always or predicted, not {rent_start!r}")
        if learned_sizing not in ("hybrid", "self"):
            raise ValueError(f"learned_sizing must be hybrid or self, not {learned_sizing!r}")
        if learned_sizing == "self" and mode == "fuse":
            raise ValueError("learned_sizing=self needs mode=fallback (a fused tree is sized by the hybrid)")
        self.min_match, self.learned_sizing, self.rent_start = min_match, learned_sizing, rent_start
        if features_of(retrieval).wanted:
            raise ValueError(f"the retrieval drafter {retrieval.name} must be model-free")
        self.retrieval, self.learned, self.mode, self.min_score = retrieval, learned, mode, min_score
        self.cost, self.learned_cost = cost, learned_cost
        self.catch_up_cost = catch_up_cost if cost is not None and not features_of(learned).wanted else 0.0
        if context_costs is not None and (cost is None or learned_sizing != "self"):
            raise ValueError("context_costs prices a self-sizing draft model (learned_sizing=self, with cost)")
        self.context_costs = context_costs
        self.declined = 0  # steps the learned drafter was left out because at their context it could not pay
        # a learned drafter that loses to plain decoding even if every node were accepted
        # is left out entirely (no hidden states, no calls): it could never propose
        largest = max(cost or {0: 1.0})  # the largest measured size
        self.learned_enabled = cost is None or best_size([1.0] * largest, cost, learned_cost)[0] > 0
        self._subs = (retrieval, learned) if self.learned_enabled else (retrieval,)
        # what the learned drafter reads (EAGLE-3: its target layers), only while it is in
        self.features = features_of(learned) if self.learned_enabled else NO_FEATURES
        self._scored = isinstance(retrieval, Speculates)  # gives its own node values
        self._learned_acc = DepthAcceptance()
        self._retrieval_acc = DepthAcceptance()  # node values of drafters without their own
        self._requests: RequestTable[_Proposal] = RequestTable()
        self._answers: deque[int] = deque(maxlen=ANSWERS_KEPT)  # answer lengths of finished requests (rent_start)
        self.steps: Counter[str] = Counter()  # verified steps by who drafted them ("none": not the hybrid)
        self.drafted: Counter[str] = Counter()  # drafted nodes by source
        self.accepted: Counter[str] = Counter()  # accepted drafted tokens by source

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        state = _Proposal(prompt_length=len(prompt_ids))
        self._requests.add(request_id, state)
        self.retrieval.start(request_id, prompt_ids)
        if self.learned_enabled and self.features.wanted:  # it reads the prefill's features: start now
            self.learned.start(request_id, prompt_ids)
            state.learned_started = True

    def _start_learned(self, ctx: DraftContext) -> None:
        """Start the learned drafter on a request when first asked: its prompt is everything
        committed before this step (the step's root, ``ctx.tokens[-1]``, comes with its first
        observation, as a prompt's first generated token does)."""
        state = self._requests.get(ctx.request_id)
        if not state.learned_started:
            self.learned.start(ctx.request_id, list(ctx.tokens[:-1]))
            state.learned_started = True

    def finish(self, request_id: str) -> None:
        state = self._requests.pop(request_id)
        if state is not None and state.answer_length:
            self._answers.append(state.answer_length)
        self.retrieval.finish(request_id)
        if state is not None and state.learned_started:
            self.learned.finish(request_id)

    def reset(self) -> None:
        """Forget what was learned across requests (the bench calls this after warm-up)."""
        self.retrieval.reset()
        self.learned.reset()
        self._learned_acc.reset()
        self._retrieval_acc.reset()
        self._answers.clear()
        for counts in (self.steps, self.drafted, self.accepted):
            counts.clear()

    def drafted_by(self) -> dict[str, int]:
        return dict(self.steps)

    def memory_bytes(self) -> int:
        return sum(sub.memory_bytes() for sub in self._subs)

    def context_bytes(self, max_length: int, rows: int) -> int:
        return sum(sub.context_bytes(max_length, rows) for sub in self._subs)

    def reserve(self, max_length: int, rows: int) -> None:
        for sub in self._subs:
            sub.reserve(max_length, rows)

    def observe(self, obs: Observation) -> None:
        state = self._requests.get(obs.request_id)
        if self.features.wanted and not state.prefilled:  # the prefill: a prompt chain
            state.prefilled = True
            self.learned.observe(obs)
            return
        if state.proposed:
            self._track(state, obs)
            state.proposed = False
        else:  # not asked (a budget of 0), or another drafter's tree (a prediction): teaches no acceptance of ours
            self.steps["none"] += 1
        self.retrieval.observe(obs)
        if state.learned_started:
            self.learned.observe(obs)

    def _track(self, state: _Proposal, obs: Observation) -> None:
        """Count the step and update the proposer's per-depth acceptance."""
        src, depths, path = state.source, obs.tree.depths, obs.path
        self.steps[src] += 1
        self.drafted[src] += obs.tree.num_drafted
        self.accepted[src] += len(path)
        if src == "retrieval":
            self._retrieval_acc.update(max(depths), len(path))
            state.r_promised += state.r_expected
            state.r_accepted += len(path)
        elif src == "learned":
            self._learned_acc.update(max(depths), len(path))
        elif src == "fused":  # the accepted prefix that runs through the learned tree's nodes
            inside = next((i for i, node in enumerate(path) if node > state.learned_nodes), len(path))
            self._learned_acc.update(state.learned_depth, inside)

    # ---- proposing ---------------------------------------------------------------------
    def _retrieval_draft(self, ctx: DraftContext) -> tuple[DraftTree, list[float]]:
        """The retrieval tree (best-first nodes) and its node values (none below ``min_match``)."""
        if self._scored:
            draft = self.retrieval.speculate(ctx)
            if draft.match_length < self.min_match:
                return draft.to_tree(ctx.tokens[-1]), []
            return draft.to_tree(ctx.tokens[-1]), list(draft.probs)
        tree = self.retrieval.propose(ctx)
        values = self._retrieval_acc.node_values(max(tree.depths))
        return tree, [values[d - 1] for d in tree.depths[1:]]

    def _sizes(self, ctx: DraftContext, values: list[float], cost: dict[int, float] | None,
               learned_cost: dict[int, float] | None) -> tuple[int, float, int, float]:
        """(retrieval size, its rate, learned size, its rate); size 0 = not a candidate. ``cost`` and
        ``learned_cost``: t(n) and c(n) at this step's context (``_priced``)."""
        hit = bool(values) and sum(values) >= self.min_score
        if cost is None:  # plain fallback: retrieval on a hit, else the learned drafter
            return (len(values), 1.0, ctx.budget, 0.0) if hit else (0, 0.0, ctx.budget, 1.0)
        r_n, r_rate = best_size(values, cost) if hit else (0, 1.0)
        if not self.learned_enabled:
            return r_n, r_rate, 0, 0.0
        if self.context_costs is not None and best_size([1.0] * max(cost), cost, learned_cost)[0] == 0:
            self.declined += 1  # at this context it loses to plain decoding even if every node were accepted
            return r_n, r_rate, 0, 0.0
        if self.learned_sizing == "self" and r_n:  # retrieval pays: the learned drafter is not asked
            return r_n, r_rate, 0, 0.0
        l_n, l_rate = best_size(self._learned_acc.node_values(ctx.budget), cost, learned_cost)
        if self.learned_sizing == "self":  # the learned drafter sizes itself, when it is worth asking
            return (0, 1.0, ctx.budget, l_rate) if self._self_sizer_pays(ctx, l_n > 0) else (0, 1.0, 0, 0.0)
        return r_n, r_rate, l_n, l_rate

    def _priced(self, context: int) -> tuple[dict[int, float] | None, dict[int, float] | None, float]:
        """t(n), the learned drafter's c(n) and its catch-up per token at ``context`` tokens: with
        ``context_costs`` (a draft model's ``CostModel`` by context) read there (c(n) = n draft steps; the
        catch-up its timed feed per token, else ``CostModel.catch_up``), else the curves given."""
        if self.context_costs is None:
            return self.cost, self.learned_cost, self.catch_up_cost
        here = self.context_costs.at(context)
        catch_up = 0.0
        if self.catch_up_cost:
            feed = self.context_costs.feed(context)
            catch_up = here.catch_up() if feed is None else feed
        return here.curve, {n: n * here.draft for n in here.curve}, catch_up

    def _self_sizer_pays(self, ctx: DraftContext, tracked_pays: bool) -> bool:
        """Whether a self-sizing learned drafter is worth asking this step: its tracked per-depth
        acceptance beats plain decoding at some size (``tracked_pays``, with ``learned_cost``: its
        c(n)), or it has not proposed for PROBE_EVERY steps (a probe, so a tracker that once said
        no can change its mind), or the tracker has seen fewer than MIN_EVIDENCE of its proposals.
        Without ``learned_cost`` it is always asked (the draft model's own cost rule)."""
        if self.learned_cost is None or self._learned_acc.trials(1) < MIN_EVIDENCE:
            return True
        state = self._requests.get(ctx.request_id)
        if tracked_pays or state.since_learned >= PROBE_EVERY:
            state.since_learned = 0
            return True
        state.since_learned += 1
        return False

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.propose_batch([ctx])[0]

    def propose_batch(self, ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """Each request's retrieval decision, then the learned drafter's trees for the requests
        that ask for one, in one ``propose_batch`` call (a draft model: one batched forward per
        draft step)."""
        plans = [self._plan(ctx) for ctx in ctxs]
        asked = [replace(ctx, budget=p.learned_budget) for ctx, p in zip(ctxs, plans) if p.learned_budget]
        for ctx in asked:
            self._start_learned(ctx)
            state = self._requests.get(ctx.request_id)
            state.learned_seen, state.rent = len(ctx.tokens), 0.0
        learned = iter(self.learned.propose_batch(asked) if asked else [])
        return [self._choose(ctx, p, next(learned) if p.learned_budget else None) for ctx, p in zip(ctxs, plans)]

    def _plan(self, ctx: DraftContext) -> _Plan:
        """The retrieval draft and its size, and the learned drafter's budget (0: not asked)."""
        state = self._requests.get(ctx.request_id)
        state.source, state.learned_nodes, state.learned_depth, state.proposed = "none", 0, 0, True
        state.answer_length = len(ctx.tokens) - state.prompt_length
        tree, values = self._retrieval_draft(ctx)
        if ctx.grammar is not None and tree.num_drafted:  # the nodes a grammar forbids would be cut: size the rest
            keep = reachable(tree, ctx.grammar)
            tree, values = keep_nodes(tree, keep), [v for v, k in zip(values, keep[1:]) if k]
        raw = values
        if self._scored and values:  # the trie's scores, scaled by how well they kept their promise so far
            values = [v * self._calibration(state) for v in values]
        cost, learned_cost, catch_up = self._priced(len(ctx.tokens))
        r_n, r_rate, l_n, l_rate = self._sizes(ctx, values, cost, learned_cost)
        state.r_expected = sum(raw[:r_n])
        fusing = self.mode == "fuse" and r_n > 0
        budget = 0
        if l_n > 0 and (fusing or r_n == 0 or l_rate > r_rate):
            budget = max(1, min(l_n, ctx.budget - r_n)) if fusing else l_n
        # a catch-up is bought by the savings its tracked rate forgoes; a probe, or an ask for evidence, when that
        # rate says no saving (l_rate <= 1: no rent would ever accrue), is paid as it is, or it could never happen
        rented = state.learned_started or self.rent_start != "constrained" or ctx.grammar is not None
        if budget and catch_up and rented:
            if l_rate > 1.0 and not (self._could_pay(state, ctx, cost, learned_cost, catch_up)
                                     and self._buys(state, ctx, l_rate, catch_up)):
                budget = 0  # never bought where even drafts accepted in full could not pay it back in this answer
            elif l_rate <= 1.0 and not self._could_pay(state, ctx, cost, learned_cost, catch_up):
                budget = 0  # not even drafts accepted in full could pay this probe's catch-up back in this answer
        return _Plan(tree, r_n, fusing, budget)

    @staticmethod
    def _calibration(state: _Proposal) -> float:
        """Accepted over promised tokens of this request's suffix drafts (at most 1, CALIBRATION_PRIOR
        tokens of each assumed at the start): a long context the answer only paraphrases (a
        summary, a RAG answer) matches the trie often and keeps few of its drafts; its later
        drafts are sized, or left to the draft model, by what they actually yield."""
        return min(1.0, (state.r_accepted + CALIBRATION_PRIOR) / (state.r_promised + CALIBRATION_PRIOR))

    def _pending(self, state: _Proposal, ctx: DraftContext) -> int:
        """Tokens the learned drafter would be fed before it drafts: those since it last drafted, or (not
        started) its prompt past its prefix cache, with the prompt's last token."""
        if not state.learned_started and isinstance(self.learned, CountsPrefill):
            return self.learned.prefill_tokens(list(ctx.tokens[:-1])) + 1
        return len(ctx.tokens) - 1 - state.learned_seen  # the root comes with the draft in any case

    def _could_pay(self, state: _Proposal, ctx: DraftContext, cost: dict[int, float] | None,
                   learned_cost: dict[int, float] | None, catch_up: float) -> bool:
        """A probe or an ask for evidence (its tracked rate promises no saving): could its catch-up (a first
        start: the prompt) be paid back in this answer's room even at the rate of drafts accepted in full?"""
        if cost is None:
            return True
        best = best_size([1.0] * max(cost), cost, learned_cost)[1]
        room = ctx.params.max_new_tokens - state.answer_length
        return room * max(0.0, 1.0 - 1.0 / best) >= self._pending(state, ctx) * catch_up

    def _buys(self, state: _Proposal, ctx: DraftContext, rate: float, catch_up: float) -> bool:
        """Rent or buy (module docstring): is the learned drafter's catch-up (or its start) paid
        for this step? ``rate``: its best rate on the tracked acceptance (``_sizes``); ``catch_up``:
        a token fed to it, in target decode steps at this context (``_priced``)."""
        pending = self._pending(state, ctx)
        saving = max(0.0, 1.0 - 1.0 / rate)
        state.rent += saving
        cost = pending * catch_up
        room = ctx.params.max_new_tokens - state.answer_length  # the most tokens this answer can still have
        if not state.learned_started and self.rent_start == "predicted" and not ctx.prediction \
                and (self._answers or ctx.grammar is None):  # a Predicted Outputs request rents it plainly
            if not self._answers:  # nothing predicts this answer: started at once, as without the rule
                return True
            left = min(room, median(self._answers) - state.answer_length)  # its tokens still to come, predicted
            if left * saving >= cost:  # predicted to pay: bought at once
                return True
            cost /= PREDICTION_TRUST  # predicted not to: bought only once the forgone savings are twice its cost
        return cost <= state.rent

    def _choose(self, ctx: DraftContext, plan: _Plan, learned: DraftTree | None) -> DraftTree:
        state = self._requests.get(ctx.request_id)
        if learned is not None and learned.num_drafted > 0:
            state.source, state.learned_nodes = "learned", learned.num_drafted
            state.learned_depth = max(learned.depths)
            if not plan.fusing:
                return learned
            fused = fuse(learned, truncate(plan.retrieval, plan.r_n), ctx.budget)
            if fused.num_drafted == learned.num_drafted:
                return learned  # nothing new: keep the learned tree (and its q)
            state.source = "fused"
            return fused
        if plan.r_n == 0:
            return DraftTree.chain(ctx.tokens[-1], [])
        state.source = "retrieval"
        return truncate(plan.retrieval, plan.r_n)
