"""Hybrid drafter (retrieval first, learned fallback, or both fused): the pure pieces
(fusion, per-step sizing, acceptance tracking), strict greedy equality with plain decoding
on the toy target, which sub-drafter proposed under each cost curve, EAGLE-3 as the learned
drafter (the target layers it reads, asked for only while it is in), the exact sampling law,
and lifecycle errors. The real SmolLM2 target runs in tests/real/test_real_native.py."""

from __future__ import annotations

import doctest
from collections import Counter

import pytest
import torch

from helpers import AskedDrafter, TemperedSelfDraft, assert_target_law, run, stories_eagle3
from verispec.drafters import hybrid as hybrid_module
from verispec.drafters.base import DraftContext, NoDrafter, features_of
from verispec.cost_model import CostModel
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from verispec.drafters.hybrid import HybridDrafter, fuse, truncate
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.engine import Engine
from verispec.policies import draft_budget
from verispec.policies.draft_budget import DepthAcceptance, best_size, interpolate
from verispec.cost_curve import measure_draft_cost
from verispec.registry import make_drafter
from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.types import SamplingParams

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
# a repeated phrase (retrieval hits) around novel stretches (misses)
PROMPTS = [[1, 40, 41, 3, 17, 88, 40, 41, 3, 60], [1, 70, 71, 72, 70, 71, 33]]
FLAT = {n: 1.0 for n in (1, 2, 4, 8, 16)}  # verifying is free: any draft pays


@pytest.fixture(scope="module")
def plain(toy_target):
    return [run(toy_target, NoDrafter(), p, GREEDY)[0] for p in PROMPTS]


def toy_eagle(target) -> EagleDrafter:
    """An untrained EAGLE head on the toy target: reads hidden states, drafts noise."""
    torch.manual_seed(0)
    cfg = EagleConfig(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=96, draft_vocab_size=96)
    embed = target.model.get_input_embeddings().weight.detach()
    return EagleDrafter(EagleHead(cfg), embed, mode="tree", depth=3, top_k=2)


def suffix() -> SuffixDecodingDrafter:
    return SuffixDecodingDrafter(min_score=0.0, max_global_tokens=0)


# ---- pure pieces --------------------------------------------------------------------------------
def test_doctests():
    for module in (hybrid_module, draft_budget):
        assert doctest.testmod(module).failed == 0


def test_fuse_shares_prefixes_and_respects_budget():
    base = DraftTree((7, 3, 5, 9), (-1, 0, 0, 1))
    other = DraftTree((7, 3, 9, 2, 6), (-1, 0, 1, 2, 0))  # 3-9-2 shares 3-9; 6 is new
    fused = fuse(base, other, 8)
    assert fused.tokens == (7, 3, 5, 9, 2, 6) and fused.parents == (-1, 0, 0, 1, 3, 0)
    assert fuse(base, other, 4).tokens == (7, 3, 5, 9, 2)  # one new node fits
    assert fuse(base, other, 3) == DraftTree(base.tokens, base.parents)  # full: nothing added
    paths = {tuple(fused.tokens[i] for i in fused.path_to(n)) for n in range(1, fused.size)}
    assert {(3,), (5,), (3, 9), (3, 9, 2), (6,)} <= paths
    with pytest.raises(ValueError, match="roots"):
        fuse(base, DraftTree((8, 3), (-1, 0)), 4)
    chain = DraftTree.chain(7, [1, 2, 3], torch.rand(3, 5))
    assert truncate(chain, 2).tokens == (7, 1, 2) and truncate(chain, 2).draft_probs.shape == (3, 5)


def test_sizes_follow_the_cost_curve():
    assert interpolate({4: 2.0}, 2) == 1.5 and interpolate({2: 1.0}, 2, at_zero=0.0) == 1.0
    values = [0.9, 0.8, 0.4, 0.1]
    assert best_size(values, FLAT)[0] == 4  # free verification: take every node
    assert best_size(values, {n: 1.0 + n for n in (1, 2, 4)})[0] == 0  # linear cost: nothing pays
    assert best_size(values, {1: 1.1, 2: 1.2, 4: 1.5})[0] == 3  # 3.1 / 1.35 beats 2.7 / 1.2 and 3.2 / 1.5
    assert best_size(values, FLAT, {n: 5.0 for n in (1, 4)})[0] == 0  # a costly drafter never pays
    assert best_size([], FLAT) == (0, 1.0)


def test_depth_acceptance_tracks_a_perfect_and_a_useless_drafter():
    good, bad = DepthAcceptance(), DepthAcceptance()
    for _ in range(50):
        good.update(drafted_depth=4, accepted=4)
        bad.update(drafted_depth=4, accepted=0)
    assert min(good.node_values(4)) > 0.9 and bad.node_values(1)[0] < 0.05
    assert bad.rate(3) == 0.5  # never reached: the prior
    with pytest.raises(ValueError, match="accepted"):
        good.update(drafted_depth=2, accepted=3)


# ---- greedy equality and who proposed -----------------------------------------------------------
LEARNED = {
    "self-draft": lambda t: DraftModelDrafter(t),  # the target itself: every learned draft accepted
    "eagle": toy_eagle,  # needs hidden states: the prefill goes to it alone
}


@pytest.mark.parametrize("mode", ["fallback", "fuse"])
@pytest.mark.parametrize("learned", list(LEARNED))
@pytest.mark.parametrize("retrieval", ["suffix", "prompt-lookup"])
def test_greedy_equals_plain_and_both_sources_propose(toy_target, plain, mode, learned, retrieval):
    r = suffix() if retrieval == "suffix" else PromptLookupDrafter(max_ngram=3)
    h = HybridDrafter(r, LEARNED[learned](toy_target), mode=mode, min_score=0.5)
    steps = 0
    for prompt, want in zip(PROMPTS, plain):
        ids, stats = run(toy_target, h, prompt, GREEDY, k=6)
        assert ids == want
        assert stats.steps + 1 == stats.target_forwards
        steps += stats.steps
    assert h.steps["retrieval"] + h.steps["fused"] > 0 and h.steps["learned"] + h.steps["fused"] > 0
    assert sum(h.steps.values()) == steps  # every verified step is attributed to one source
    if learned == "self-draft":  # the target drafting for itself is always right
        assert h.accepted["learned"] == h.drafted["learned"] > 0


def test_fallback_counts_without_a_cost_curve(toy_target, plain):
    """min_score 0: every retrieval match proposes; an impossible score: only the learned one."""
    always = HybridDrafter(suffix(), DraftModelDrafter(toy_target), min_score=0.0)
    never = HybridDrafter(suffix(), DraftModelDrafter(toy_target), min_score=1e9)
    for h in (always, never):
        for prompt, want in zip(PROMPTS, plain):
            assert run(toy_target, h, prompt, GREEDY, k=6)[0] == want
    assert always.steps["retrieval"] > 0 and never.steps["retrieval"] == 0
    assert never.steps["learned"] == sum(never.steps.values())


@pytest.mark.parametrize("cost,learned_cost,enabled,expect", [
    ({n: 1.0 + n for n in (1, 2, 4, 8)}, None, False, {"none"}),  # verification never pays: plain decoding
    (FLAT, {n: 50.0 for n in (1, 8)}, False, {"retrieval", "none"}),  # 50 steps: could never pay, left out
    (FLAT, {n: 4.0 for n in (1, 8)}, True, {"retrieval", "none"}),  # could pay; its tracked acceptance says no
    # nearly free learned drafter ("none": each request's last step, with a budget of 0, asks no drafter)
    (FLAT, {n: 0.01 for n in (1, 8)}, True, {"retrieval", "learned", "none"}),
])
def test_cost_curves_decide_who_proposes(toy_target, plain, cost, learned_cost, enabled, expect):
    learned = toy_eagle(toy_target) if learned_cost and learned_cost[1] == 4.0 else DraftModelDrafter(toy_target)
    h = HybridDrafter(suffix(), learned, min_score=0.5, cost=cost, learned_cost=learned_cost)
    assert h.learned_enabled == enabled
    assert h.features.wanted == (enabled and isinstance(learned, EagleDrafter))
    for prompt, want in zip(PROMPTS, plain):
        assert run(toy_target, h, prompt, GREEDY, k=8)[0] == want
    assert {s for s, n in h.steps.items() if n} == expect
    if "learned" in expect:  # the tracker learned the self-draft is always right: full budget
        assert h.drafted["learned"] > 4 * h.steps["learned"]


STEEP = {n: 1.0 + 0.4 * n for n in (1, 2, 4, 8)}  # every verified token costs 0.4 of a step (AVX2-like)


class CountingDraft(DraftModelDrafter):
    """A draft model counting the steps it was asked to propose for."""

    asked = 0

    def propose_batch(self, ctxs):
        self.asked += len(ctxs)
        return super().propose_batch(ctxs)


@pytest.mark.parametrize("which", ["self-draft", "other-draft"])
def test_a_self_sizing_draft_model_is_asked_only_while_it_pays(toy_target, toy_draft, which):
    """A draft model sizing its own drafts (the registry's auto): on a steep verify curve a draft
    that is always right is asked every step, while one the target rejects is asked only until
    its tracked acceptance says it loses to plain decoding, then once in PROBE_EVERY steps."""
    c = 0.1
    learned = CountingDraft(toy_target if which == "self-draft" else toy_draft, cost=CostModel(STEEP, c))
    h = HybridDrafter(suffix(), learned, min_score=1e9, cost=STEEP, learned_cost={n: n * c for n in STEEP},
                      learned_sizing="self")
    assert h.learned_enabled
    long = SamplingParams(max_new_tokens=120, ignore_eos=True)
    for prompt in PROMPTS:
        assert run(toy_target, h, prompt, long, k=8)[0] == run(toy_target, NoDrafter(), prompt, long)[0]
    steps = sum(h.steps.values())
    if which == "self-draft":
        # every step but, perhaps, a request's last (one token left: no room for a draft)
        assert learned.asked >= steps - len(PROMPTS) and h.accepted["learned"] == h.drafted["learned"] > 0
    else:
        assert h.accepted["learned"] < 0.3 * h.drafted["learned"]  # the target rejects this draft
        assert 0 < learned.asked <= 8 + steps / hybrid_module.PROBE_EVERY < steps / 2


def test_suffix_drafts_are_sized_by_what_they_kept(toy_target, monkeypatch):
    """The trie's scores are scaled by the request's accepted / promised tokens: on a target
    that keeps few of the repeated phrase's continuations, later drafts are smaller than the
    uncalibrated scores would make them (same output as plain decoding either way)."""
    prompt = [1] + [40, 41, 3, 17, 88, 23, 54] * 6  # a long context the random target does not follow
    long = SamplingParams(max_new_tokens=80, ignore_eos=True)
    want = run(toy_target, NoDrafter(), prompt, long)[0]
    drafted = {}
    for prior in (hybrid_module.CALIBRATION_PRIOR, 1e12):  # 1e12: the scores as the trie gives them
        monkeypatch.setattr(hybrid_module, "CALIBRATION_PRIOR", prior)
        h = HybridDrafter(suffix(), DraftModelDrafter(toy_target), min_score=0.0, cost=STEEP,
                          learned_cost={n: 50.0 for n in STEEP})
        assert not h.learned_enabled
        assert run(toy_target, h, prompt, long, k=8)[0] == want
        drafted[prior] = h.drafted["retrieval"], h.accepted["retrieval"]
    (n_cal, kept_cal), (n_raw, kept_raw) = drafted.values()
    assert kept_raw < n_raw  # the scores over-promise here
    assert n_cal < n_raw and kept_cal / n_cal > kept_raw / n_raw


# ---- EAGLE-3 as the learned drafter ------------------------------------------------------------
# on stories260K: the fused layers (0, 2, 4) are 3x as wide as the final hidden state, so an
# observation of the wrong features fails in the head (its greedy output would not tell)
class Recording:
    """The target, recording the hidden-state arguments of every forward."""

    def __init__(self, backend):
        self.backend, self.asked = backend, set()

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, *args, **kw):
        self.asked.add((kw.get("want_hidden", False), tuple(kw.get("hidden_layers", ()))))
        return self.backend.forward(*args, **kw)


@pytest.fixture(scope="module")
def stories_plain(stories_native):
    return [run(stories_native.backend, NoDrafter(), p, GREEDY)[0] for p in PROMPTS]


@pytest.mark.parametrize("mode", ["fallback", "fuse"])
def test_eagle3_learned_reads_its_layers_and_equals_plain(stories_native, stories_plain, mode):
    target = Recording(stories_native.backend)
    h = HybridDrafter(suffix(), stories_eagle3(stories_native), mode=mode, min_score=0.5)
    assert features_of(h).forward_kwargs() == {"want_hidden": False, "hidden_layers": (0, 2, 4)}
    for prompt, want in zip(PROMPTS, stories_plain):
        assert run(target, h, prompt, GREEDY, k=6)[0] == want
    assert target.asked == {(False, (0, 2, 4))}  # the prefill and every step: the fused layers
    assert h.steps["retrieval"] + h.steps["fused"] > 0 and h.steps["learned"] + h.steps["fused"] > 0


def test_eagle3_left_out_asks_for_nothing(stories_native, stories_plain):
    target = Recording(stories_native.backend)
    h = HybridDrafter(suffix(), stories_eagle3(stories_native), min_score=0.5, cost=FLAT,
                      learned_cost={n: 50.0 for n in (1, 8)})
    assert not h.learned_enabled and features_of(h).forward_kwargs() == {"want_hidden": False}
    for prompt, want in zip(PROMPTS, stories_plain):
        assert run(target, h, prompt, GREEDY, k=6)[0] == want
    assert target.asked == {(False, ())} and h.steps["learned"] == 0


def test_eagle3_from_the_registry_and_its_measured_cost(stories_native, tmp_path):
    """``learned=eagle3`` builds the hybrid around an EAGLE-3 head; its drafting cost c(n)
    is measured after observing the layers it reads."""
    learned = stories_eagle3(stories_native)
    learned.head.save(tmp_path)
    h = make_drafter("hybrid", stories_native, {"learned": "eagle3", "learned_weights": str(tmp_path),
                                                "budget": "fixed", "mode": "fuse"})
    assert isinstance(h, HybridDrafter) and h.features.layers == (0, 2, 4) and h.mode == "fuse"
    with pytest.raises(ValueError, match="eagle3"):
        make_drafter("hybrid", stories_native, {"learned": "medusa"})
    cost = measure_draft_cost(stories_native.backend, learned, sizes=(1, 4), repeats=1)
    assert set(cost) == {1, 4} and min(cost.values()) > 0


# ---- the exact sampling law ---------------------------------------------------------------------
# the fused point-mass tree runs by default; the sources passed through unchanged are the
# prompt-lookup and draft-model law tests of test_engine.py, re-run here under -m slow
@pytest.mark.parametrize("mode,min_score,source", [
    pytest.param("fallback", 0.0, "retrieval", marks=pytest.mark.slow),
    pytest.param("fallback", 1e9, "learned", marks=pytest.mark.slow), ("fuse", 0.0, "fused")])
def test_sampling_distribution_matches_target(toy_target, mode, min_score, source):
    """Token 2 is committed by the first speculative step, proposed by ``source``; given
    token 1 = 94 (among the likeliest, and in the prompt: prompt lookup matches it) its law
    must be exactly the target's p(. | prompt, 94). A small smoke test of the engine's
    plumbing (250 seeds): the rule itself is enumerated exactly in unit/test_verify.py."""
    prompt, t1 = [1, 40, 41, 3, 17, 94, 88, 40, 41, 3, 60, 40, 41], 94
    h = HybridDrafter(PromptLookupDrafter(max_ngram=2), TemperedSelfDraft(toy_target), mode=mode,
                      min_score=min_score)
    engine = Engine(toy_target, h, 3)
    params = [SamplingParams(temperature=1.5, max_new_tokens=4, seed=s, ignore_eos=True) for s in range(250)]
    pairs = []
    for p in params:
        req = engine.add_request(prompt, p)
        engine.step(req)  # the prefill gave token 1; this step commits token 2 (and maybe more)
        pairs.append(tuple(req.generated[:2]))
        engine.finish(req, "stop")
    assert h.steps[source] >= 50  # the source under test really proposed
    assert Counter(p[0] for p in pairs)[t1] >= 30  # enough second tokens after t1 to test their law
    assert_target_law(toy_target, prompt + [t1], [p[1] for p in pairs if p[0] == t1], params[0])


# ---- lifecycle ------------------------------------------------------------------------------------
def test_lifecycle_errors(toy_target):
    h = HybridDrafter(suffix(), toy_eagle(toy_target))
    assert h.features.wanted and h.name == "hybrid"
    h.start("r1", [1, 2, 3])
    errors = [(lambda: h.start("r1", [1, 2, 3]), "already started"),
              (lambda: h.propose(DraftContext("ghost-3", [1, 2], 4, SamplingParams(), make_generator(0, 1))), "ghost-3")]
    for call, message in errors:
        with pytest.raises(ValueError, match=message):
            call()
    h.finish("r1")
    h.finish("r1")  # idempotent (the engine may finish twice)
    with pytest.raises(ValueError, match="mode"):
        HybridDrafter(suffix(), NoDrafter(), mode="merge")
    with pytest.raises(ValueError, match="model-free"):
        HybridDrafter(toy_eagle(toy_target), NoDrafter())
    with pytest.raises(ValueError, match="min_score"):
        HybridDrafter(suffix(), NoDrafter(), min_score=-1)
    with pytest.raises(ValueError, match="min_match"):
        HybridDrafter(suffix(), NoDrafter(), min_match=-1)
    with pytest.raises(ValueError, match="learned_sizing"):
        HybridDrafter(suffix(), NoDrafter(), learned_sizing="both")
    with pytest.raises(ValueError, match="fallback"):
        HybridDrafter(suffix(), NoDrafter(), mode="fuse", learned_sizing="self")
    with pytest.raises(ValueError, match="rent_start"):
        HybridDrafter(suffix(), NoDrafter(), rent_start="never")


# ---- the match-length gate and a self-sizing learned drafter ----------------------------------
@pytest.mark.parametrize("min_match,retrieves", [(0, True), (100, False)])
def test_min_match_gates_suffix_drafts(toy_target, plain, min_match, retrieves):
    """A suffix draft proposes only after a context match of ``min_match`` tokens; greedy output
    is plain decoding's either way."""
    h = HybridDrafter(suffix(), DraftModelDrafter(toy_target), min_score=0.0, min_match=min_match)
    for prompt, want in zip(PROMPTS, plain):
        assert run(toy_target, h, prompt, GREEDY, k=6)[0] == want
    assert (h.steps["retrieval"] > 0) == retrieves and h.steps["learned"] > 0


def test_self_sizing_learned_drafter_gets_the_full_budget(toy_target, plain):
    """``learned_sizing="self"``: when retrieval is gated out the learned drafter is handed the
    whole budget (here the target drafting for itself, so every node is accepted), and retrieval
    proposes whenever it passes the gates and pays on the cost curve."""
    k = 6
    h = HybridDrafter(suffix(), DraftModelDrafter(toy_target), min_score=0.0, cost=FLAT, min_match=2,
                      learned_sizing="self")
    for prompt, want in zip(PROMPTS, plain):
        assert run(toy_target, h, prompt, GREEDY, k=k)[0] == want
    assert h.steps["retrieval"] > 0 and h.steps["learned"] > 0
    # every learned proposal is k nodes, except where fewer than k tokens were left to generate
    assert h.drafted["learned"] >= k * (h.steps["learned"] - len(PROMPTS))
    assert h.accepted["learned"] == h.drafted["learned"]


@pytest.mark.parametrize("catch_up_cost,waits", [(0.0, 0), (0.01, 4), (1.0, None)])
def test_a_long_catch_up_is_rented_before_it_is_bought(catch_up_cost, waits):
    """After 200 tokens the learned drafter has not seen, it is asked only once the plain steps
    since have forgone as much saving (0.5 a step at its prior rate on a flat curve) as feeding
    it those tokens costs: at once when catching up is free, after 4 steps at 0.01 a token,
    not within 20 steps at 1.0."""
    learned = AskedDrafter()
    h = HybridDrafter(PromptLookupDrafter(), learned, min_score=0.0, cost=FLAT, learned_sizing="self",
                      catch_up_cost=catch_up_cost)
    long = SamplingParams(max_new_tokens=1000, ignore_eos=True)  # room in the answer to pay any catch-up back
    h.start("r", [1, 2])
    ctx = DraftContext("r", [1, 2, 3], 8, long, make_generator(0, 1))
    assert h.propose(ctx).tokens == (3, 5) and learned.asked == [3]  # started: its first draft is not deferred
    tokens = [1, 2, 3] + list(range(10, 210))  # committed since, drafted by someone else
    trees = []
    for step in range(20):
        trees.append(h.propose(DraftContext("r", tokens + [300 + step], 8, long, make_generator(0, 1))))
        tokens.append(300 + step)
        if len(learned.asked) > 1:
            break
    assert [t.num_drafted for t in trees] == ([0] * waits + [1] if waits is not None else [0] * 20)


def test_a_catch_up_never_blocks_a_learned_drafter_that_must_be_asked():
    """Where the learned drafter's tracked rate promises no saving (its prior on a curve this steep) no rent
    accrues, so the rent rule would defer its catch-up for ever, and with it the proposals that are its only
    evidence: it is asked (here every step: without ``learned_cost`` it is always worth asking) whatever it
    has to catch up, where the answer's room could pay that back with drafts accepted in full."""
    learned = AskedDrafter()
    steep = {n: 1.0 + 0.6 * n for n in (1, 2, 4, 8)}  # pays if all is accepted, not at the prior 0.5
    h = HybridDrafter(PromptLookupDrafter(), learned, min_score=0.0, cost=steep, learned_sizing="self",
                      catch_up_cost=1.0)
    h.start("r", [1, 2])
    tokens = [1, 2, 3]
    roomy = SamplingParams(max_new_tokens=10_000, ignore_eos=True)  # an answer with room to pay a catch-up back
    for step in range(5):
        assert h.propose(DraftContext("r", tokens, 8, roomy, make_generator(0, 1))).num_drafted == 1
        tokens += list(range(10 + 50 * step, 60 + 50 * step))  # 50 tokens committed by someone else
    assert len(learned.asked) == 5


class _PromptCached(DraftModelDrafter):
    """A draft model whose prefix cache holds every prompt: starting a request prefills nothing."""

    def prefill_tokens(self, prompt_ids: list[int]) -> int:
        return 0


@pytest.mark.parametrize("rent_start,catch_up_cost,max_new_tokens,cached,starts",
                         [("always", 0.0, 12, False, True), ("always", 0.05, 12, False, False),
                          ("always", 0.05, 60, False, True), ("always", 0.05, 12, True, True),
                          ("constrained", 0.05, 12, False, True)],
                         ids=["free", "short", "long", "cached", "not-rented"])
def test_the_first_start_is_rented_on_every_request(toy_target, rent_start, catch_up_cost, max_new_tokens, cached,
                                                    starts):
    """``rent_start="always"``: on an unconstrained request too the draft model's start (its prompt's prefill,
    81 tokens at ``catch_up_cost`` target steps each) waits until the plain steps the hybrid would have asked
    it have forgone as much saving (1 - 1/r a step, r = 1.46: its prior on a flat curve at 0.1 a draft
    forward). Free, it starts on the first step; at 0.05 a token (4.1 steps, and 0.05 more with each token
    decoded meanwhile: 15 plain steps of rent) a 12-token answer never starts it and a 60-token one does; a prompt its prefix cache holds starts it at
    once; ``"constrained"`` (the grammar-only rule) starts it at once. Output equals plain decoding."""
    prompt = [1] + [(7 * i) % 90 + 3 for i in range(80)]
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    draft = (_PromptCached if cached else DraftModelDrafter)(toy_target)
    h = HybridDrafter(suffix(), draft, cost=FLAT, learned_cost={n: 0.1 * n for n in FLAT}, min_match=1000,
                      learned_sizing="self", catch_up_cost=catch_up_cost, rent_start=rent_start)
    out, stats = run(toy_target, h, prompt, params, k=6)
    assert out == run(toy_target, NoDrafter(), prompt, params)[0]
    assert (draft.fed_tokens > 0) == (h.steps["learned"] > 0) == starts
    if starts and catch_up_cost and not cached and rent_start == "always":  # rented: 15 plain steps first
        assert h.steps["none"] == 15
    elif starts:
        assert h.steps["none"] == 0


@pytest.mark.parametrize("earlier", [3, 60], ids=["after-short-answers", "after-long-answers"])
def test_a_predicted_start_follows_the_answers_seen(toy_target, earlier):
    """``rent_start="predicted"`` (ski rental with a prediction: Purohit et al. 2018): with no answer finished yet
    the draft model starts at once (as ``"constrained"`` starts it on an unconstrained request) unless the answer's
    room (3 tokens) could not pay its prefill back; then the median
    length of the answers finished so far predicts the next one's. Predicted to pay for its prefill (after
    60-token answers) the start is bought at once; predicted not to (after 3-token answers) it is rented until
    the forgone savings reach twice its cost, longer than plain rent-or-buy (``"always"``) waits. Output equals
    plain decoding every time."""
    params = SamplingParams(max_new_tokens=earlier, ignore_eos=True)
    final = SamplingParams(max_new_tokens=60, ignore_eos=True)  # room to pay the start back, even rented
    waited = {}
    for rent_start in ("always", "predicted"):
        draft = DraftModelDrafter(toy_target)
        h = HybridDrafter(suffix(), draft, cost=FLAT, learned_cost={n: 0.1 * n for n in FLAT}, min_match=1000,
                          learned_sizing="self", catch_up_cost=0.05, rent_start=rent_start)
        for seed in range(3):
            prompt = [1] + [(7 * i + seed) % 90 + 3 for i in range(80)]
            assert run(toy_target, h, prompt, params, k=6)[0] == run(toy_target, NoDrafter(), prompt, params)[0]
            if seed == 0 and rent_start == "predicted":  # nothing predicted it: started at once where it can pay
                assert (h.steps["none"] == 0 and h.steps["learned"] > 0) == (earlier == 60)
        before = h.steps["none"]
        prompt = [1] + [(5 * i) % 90 + 3 for i in range(80)]
        assert run(toy_target, h, prompt, final, k=6)[0] == run(toy_target, NoDrafter(), prompt, final)[0]
        waited[rent_start] = h.steps["none"] - before
    if earlier == 3:
        assert waited["predicted"] > waited["always"] > 0
    else:
        assert waited["predicted"] <= 1 < waited["always"]  # 1: the last step (one token left) has no room for a draft


def test_a_request_with_a_prediction_rents_the_start(toy_target):
    """``rent_start="predicted"`` starts the draft model at once where no answer has finished (nothing predicts
    this one); a request carrying a prediction (Predicted Outputs) rents it instead, as ``"always"`` does: the
    prediction says what comes. Output equals plain decoding either way."""
    prompt = [1] + [(7 * i) % 90 + 3 for i in range(80)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = run(toy_target, NoDrafter(), prompt, params)[0]
    waited = {}
    for prediction in ((), tuple((11 * i) % 90 + 3 for i in range(40))):
        h = HybridDrafter(suffix(), DraftModelDrafter(toy_target), cost=FLAT, learned_cost={n: 0.1 * n for n in FLAT},
                          min_match=1000, learned_sizing="self", catch_up_cost=0.05, rent_start="predicted")
        engine = Engine(toy_target, h, 6, "fixed")
        req = engine.add_request(prompt, params, prediction=prediction)
        while not req.finished:
            engine.step(req)
        assert req.generated == plain
        waited[bool(prediction)] = h.steps["none"]
    assert waited[False] == 0 < waited[True]
