"""The hybrid prices its draft model at the request's context (``HybridDrafter(context_costs=...)``,
``cost_curve.ContextCostCurve``): at a context where verifying and drafting are dear enough that even
a draft accepted in full loses to plain decoding it is not asked (nor started), where they are cheap
it is; a catch-up of the history is priced by the draft's feed at that context. Greedy output equals
plain decoding either way (only who proposes changes). Fake curves throughout: speed is never
asserted."""

from __future__ import annotations

import pytest

from helpers import AskedDrafter, run
from verispec.cost_curve import ContextCostCurve
from verispec.drafters.base import DraftContext, NoDrafter
from verispec.cost_model import CostModel
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.types import SamplingParams

SIZES = (1, 2, 4, 8, 16)
FLAT = {n: 1.0 for n in SIZES}  # verifying is free
DEAR = {n: 1.0 + 0.7 * n for n in SIZES}  # each verified token costs 0.7 of a decode step
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
ROOMY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)  # an answer with room to pay any catch-up back


def priced(short: int, long: int, feed: tuple[float, float] | None = None) -> CostModel:
    """A draft model's costs: free verification and 0.1 a draft step at ``short`` tokens; at ``long``
    DEAR verification and 0.5 a draft step (a draft of n tokens accepted in full: (n + 1) / (1 + 1.2n),
    below plain decoding). ``feed``: its feed per token at the two contexts (timed over 64)."""
    verify = ContextCostCurve({short: FLAT, long: DEAR})
    steps = {short: {1: 0.1}, long: {1: 0.5}} if feed is None else \
        {short: {1: 0.1, 64: 64 * feed[0]}, long: {1: 0.1, 64: 64 * feed[1]}}
    if feed is not None:
        verify = ContextCostCurve({short: FLAT, long: FLAT})
    return CostModel(FLAT, 0.1, verify, ContextCostCurve(steps))


def hybrid(learned, costs: CostModel | None, catch_up: float = 0.0) -> HybridDrafter:
    return HybridDrafter(PromptLookupDrafter(), learned, min_score=0.0, cost=FLAT,
                         learned_cost={n: 0.1 * n for n in SIZES}, learned_sizing="self",
                         catch_up_cost=catch_up, context_costs=costs)


def ask(h: HybridDrafter, tokens: list[int]) -> DraftTree:
    return h.propose(DraftContext("r", tokens, 8, ROOMY, make_generator(0, 1)))


@pytest.mark.parametrize("by_context", [True, False], ids=["by-context", "one-curve"])
def test_the_draft_model_is_declined_where_its_priced_gain_is_negative(by_context):
    """At 2,100 tokens of history the curves timed there say no draft pays: the hybrid leaves the draft
    model out (the free drafter carries the step) and counts it; at 10 tokens it asks it. With one curve
    (timed at the probe context, the behaviour before) it is asked at every context."""
    learned = AskedDrafter()
    h = hybrid(learned, priced(128, 2048) if by_context else None)
    h.start("r", [1, 2])
    assert ask(h, list(range(10, 20))).num_drafted == 1 and learned.asked == [10]
    history = list(range(10, 2110))  # no repeats: prompt lookup finds nothing
    tree = ask(h, history)
    if by_context:
        assert tree.num_drafted == 0 and learned.asked == [10] and h.declined == 1
    else:
        assert tree.num_drafted == 1 and learned.asked == [10, 2100] and h.declined == 0


def test_between_the_timed_contexts_the_gain_is_read_there():
    """At 600 tokens (between FLAT at 128 and DEAR at 2048: t(n) = 1 + 0.17n, 0.2 a draft step) a draft
    accepted in full still pays: asked; at 1,900 tokens (t(n) = 1 + 0.65n, 0.47 a step) none does: declined."""
    learned = AskedDrafter()
    h = hybrid(learned, priced(128, 2048))
    h.start("r", [1, 2])
    assert ask(h, list(range(10, 610))).num_drafted == 1
    assert ask(h, list(range(10, 1910))).num_drafted == 0 and learned.asked == [600]


def _waits(h: HybridDrafter, learned: AskedDrafter, context: int) -> int | None:
    """Start on a ``context``-token history (asked at once), commit 200 more tokens by other drafters,
    then count the plain steps before the learned drafter is asked again (None: not within 40)."""
    tokens = list(range(10, 10 + context))  # no repeats: prompt lookup finds nothing
    h.start("r", tokens[:-1])
    assert ask(h, tokens).num_drafted == 1
    tokens += list(range(3000, 3200))
    for step in range(40):
        ask(h, tokens + [5000 + step])
        tokens.append(5000 + step)
        if len(learned.asked) > 1:
            return step
    return None


def test_a_catch_up_is_priced_by_the_feed_at_its_context():
    """The same 200 tokens to catch up cost ~0.013 a token fed after a short prompt and 0.1 after 2,000
    tokens (the feed timed there): the rent rule buys the first after a few plain steps and not the
    second within 40; priced at the probe context alone (``catch_up_cost`` 0.01) both wait alike."""
    short, long = (_waits(hybrid(learned := AskedDrafter(), priced(128, 2048, (0.01, 0.1)), 0.01), learned, n)
                   for n in (3, 2000))
    assert short is not None and short < 10 and long is None
    fixed = [_waits(hybrid(learned := AskedDrafter(), None, 0.01), learned, n) for n in (3, 2000)]
    assert fixed[0] == fixed[1] is not None


@pytest.mark.parametrize("prompt_length,learned_steps", [(80, False), (4, True)])
def test_greedy_equals_plain_with_the_draft_model_priced_by_context(toy_target, toy_draft, prompt_length,
                                                                    learned_steps):
    """The toy pair with costs that turn dear past 64 tokens: an 80-token prompt never asks (nor starts)
    the draft model, a 4-token one does; output equals plain decoding either way."""
    prompt = [1] + [(7 * i) % 90 + 3 for i in range(prompt_length - 1)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    costs = priced(8, 64)
    draft = DraftModelDrafter(toy_draft, cost=costs)
    h = HybridDrafter(SuffixDecodingDrafter(min_score=0.0, max_global_tokens=0), draft, cost=FLAT,
                      learned_cost={n: 0.1 * n for n in SIZES}, min_match=1000, learned_sizing="self",
                      context_costs=costs)
    out, _ = run(toy_target, h, prompt, params, k=6)
    assert out == run(toy_target, NoDrafter(), prompt, params)[0]
    assert (h.steps["learned"] > 0) == learned_steps == (draft.fed_tokens > 0)
    assert (h.declined > 0) != learned_steps


def test_context_costs_need_a_self_sizing_draft_model():
    with pytest.raises(ValueError, match="context_costs"):
        HybridDrafter(PromptLookupDrafter(), AskedDrafter(), cost=FLAT, context_costs=priced(128, 2048))


def test_options_from_the_registry(stories_native, tmp_path, monkeypatch):
    """``cost_contexts`` (a draft model sizing by cost times its costs at these contexts; the hybrid
    prices it there) and ``global_suffix=false`` (no global trie); bad values are one clear error."""
    from verispec.registry import make_drafter

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))  # curves timed here, not in the user's cache
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    h = make_drafter("hybrid", stories_native, {"learned": "draft", "learned_stop": "cost",
                                                "learned_cost_contexts": "128+256", "global_suffix": "false"})
    assert h.context_costs is not None and h.context_costs.curve_by_context.contexts == (128, 256)
    assert h.context_costs.feed(256) > 0 and h.retrieval.max_global_tokens == 0
    one = make_drafter("hybrid", stories_native, {"learned": "draft", "learned_stop": "cost",
                                                  "learned_cost_contexts": "128"})
    assert one.context_costs is None and one.retrieval.max_global_tokens > 0  # one curve: as before
    for opts, match in (({"global_suffix": "maybe"}, "global_suffix"),
                        ({"global_suffix": "no", "retrieval": "prompt-lookup"}, "global_suffix"),
                        ({"learned_cost_contexts": "128+x"}, "cost_contexts"),
                        ({"learned_cost_contexts": "+".join(map(str, range(128, 138)))}, "at most 8"),
                        ({"learned_stop": "cost", "learned_cost_contexts": "256+512"}, "the least 128")):
        with pytest.raises(ValueError, match=match):
            make_drafter("hybrid", stories_native, {"learned": "draft", **opts})


@pytest.mark.parametrize("rent_start", ["predicted", "always"])
@pytest.mark.parametrize("max_new_tokens,starts", [(4, False), (40, True)], ids=["short-room", "room"])
def test_a_start_the_answer_left_cannot_pay_back_is_never_bought(toy_target, rent_start, max_new_tokens, starts):
    """The draft model's first start feeds it the prompt (81 tokens at 0.05 target decode steps each: 4.05); even
    with its drafts accepted in full (on a flat curve, 7 tokens a step of 6 drafted: 0.86 decode steps saved a token)
    an answer of at most 4 tokens can never pay it back, so it is not started under a rule that rents the start
    (before: ``"predicted"`` with no answer finished started it at once); with room for 40 ``"predicted"`` starts it
    at once, ``"always"`` once the forgone savings reach its cost. (The "never" uses drafts accepted in full, not the
    prior rate: on the Qwen pair the prior, 1.06, kept a 42-token start out of a 40-token answer that the draft then
    drafted 11 of 13 tokens of.) Output equals plain decoding either way."""
    prompt = [1] + [(7 * i) % 90 + 3 for i in range(80)]
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    draft = DraftModelDrafter(toy_target)
    h = HybridDrafter(SuffixDecodingDrafter(), draft, cost=FLAT, learned_cost={n: 0.1 * n for n in SIZES},
                      min_match=1000, learned_sizing="self", catch_up_cost=0.05, rent_start=rent_start)
    out, _ = run(toy_target, h, prompt, params, k=6)
    assert out == run(toy_target, NoDrafter(), prompt, params)[0]
    assert (draft.fed_tokens > 0) == (h.steps["learned"] > 0) == starts
    if starts and rent_start == "predicted":
        assert h.steps["none"] == 0  # bought at once


def test_a_catch_up_the_answer_left_cannot_pay_back_is_never_bought():
    """A started draft model 200 tokens behind (0.01 a token to catch up: 2 decode steps) is asked again once the
    forgone savings reach that cost, but not in an answer with 5 tokens of room left (5 x 0.5 < 2.0 + the tokens
    since): the catch-up could never pay."""
    for room, asked in ((1000, True), (5, False)):
        learned = AskedDrafter()
        h = HybridDrafter(PromptLookupDrafter(), learned, min_score=0.0, cost=FLAT, learned_sizing="self",
                          catch_up_cost=0.01)
        params = SamplingParams(max_new_tokens=202 + room, ignore_eos=True)
        h.start("r", [1, 2])
        assert h.propose(DraftContext("r", [1, 2, 3], 8, params, make_generator(0, 1))).num_drafted == 1
        tokens = [1, 2, 3] + list(range(10, 210))  # committed since, drafted by someone else
        for step in range(5):
            h.propose(DraftContext("r", tokens + [300 + step], 8, params, make_generator(0, 1)))
            tokens.append(300 + step)
        assert (len(learned.asked) > 1) == asked


def test_an_ask_for_evidence_whose_start_cannot_pay_is_not_made(toy_target):
    """Where its tracked rate promises no saving the draft model is still asked for evidence (or a probe), paying
    its catch-up as it is; its first start (81 tokens at 0.05 a token here) is not paid for evidence where even
    drafts accepted in full (1.6 tokens a unit of time on this steep curve: 0.38 decode steps saved a token)
    could not pay it back in the answer's room (8 tokens), and is with room for 60. Output equals plain."""
    steep = {n: 1.0 + 0.6 * n for n in SIZES}  # full acceptance pays, the prior acceptance does not
    prompt = [1] + [(7 * i) % 90 + 3 for i in range(80)]
    for max_new_tokens, starts in ((8, False), (60, True)):
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        draft = DraftModelDrafter(toy_target)
        h = HybridDrafter(SuffixDecodingDrafter(), draft, cost=steep, min_match=1000, learned_sizing="self",
                          catch_up_cost=0.05, rent_start="predicted")
        out, _ = run(toy_target, h, prompt, params, k=6)
        assert out == run(toy_target, NoDrafter(), prompt, params)[0]
        assert (draft.fed_tokens > 0) == starts
