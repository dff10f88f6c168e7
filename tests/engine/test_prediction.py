"""Predicted Outputs (drafters/prediction.py): a request's prediction drafts where the output
follows it, and the wrapped drafter drafts elsewhere. Greedy output equals plain decoding for
right, wrong, edited, empty, longer-than-the-answer and out-of-vocabulary-free random
predictions; the sampled law is the target's; usage counts what was accepted."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import run, same_first_tokens_law, stories_eagle3

from verispec.cost_model import CostModel
from verispec.drafters.base import DraftContext, NoDrafter, Observation
from verispec.drafters.prediction import PredictionDrafter, find_place
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import Engine
from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def target(stories_native):
    return stories_native.backend


@pytest.fixture(scope="module")
def prompt(stories_native):
    return stories_native.tokenizer("Once upon a time, there was a little girl")["input_ids"]


@pytest.fixture(scope="module")
def plain(target, prompt):
    return run(target, NoDrafter(), prompt, GREEDY)[0]


def generate(target, drafter, prompt, prediction, params=GREEDY, k=8):
    engine = Engine(target, drafter, k)
    req = engine.add_request(prompt, params, prediction=prediction)
    while not req.finished:
        engine.step(req)
    engine.finish(req, req.finished)
    return req.generated, req.stats


def edits(plain: list[int], vocab: int) -> dict[str, list[int]]:
    """Predictions of the answer: right, wrong, edited in the ways an editor's file differs."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(3, vocab, (80,), generator=g).tolist()
    return {
        "right": plain,
        "longer": plain + plain[:30],
        "empty": [],
        "random": rand,
        "inserted": plain[:20] + rand[:7] + plain[20:],  # the answer lacks a span of the prediction
        "deleted": plain[:15] + plain[25:],  # the answer has a span the prediction lacks
        "renamed": [t if i % 13 else rand[i % 80] for i, t in enumerate(plain)],
        "shifted": plain[5:],
        "repeated": plain[:10] * 6,
    }


@pytest.mark.parametrize("inner", ["none", "prompt-lookup"])
def test_greedy_equals_plain_for_every_prediction(target, prompt, plain, inner):
    drafter = PredictionDrafter(NoDrafter() if inner == "none" else PromptLookupDrafter())
    for name, prediction in edits(plain, target.info.vocab_size).items():
        out, stats = generate(target, drafter, prompt, prediction)
        assert out == plain, name
        assert stats.accepted <= stats.drafted


def test_a_right_prediction_is_accepted_and_counted(target, prompt, plain):
    drafter = PredictionDrafter(NoDrafter())
    out, stats = generate(target, drafter, prompt, plain, k=8)
    assert out == plain
    assert stats.accepted == stats.drafted and stats.steps <= len(plain) // 9 + 1  # 8 drafts + the bonus a step
    engine = Engine(target, drafter, 8)
    req = engine.add_request(prompt, GREEDY, request_id="r", prediction=plain + plain[:30])
    while not req.finished:
        engine.step(req)
    engine.finish(req, req.finished)
    accepted, rejected = drafter.prediction_usage("r")
    assert accepted == len(plain) and rejected == 30  # every answer token was in it, drafted or the target's own
    assert drafter.prediction_usage("r") is None  # read once


def test_an_edit_is_followed_after_the_divergence(target, prompt, plain):
    """The prediction lacks a span of the answer (a line the edit inserts): after it, drafting
    finds its place again instead of giving up (most of the rest is accepted)."""
    deleted = plain[:15] + plain[25:]
    out, stats = generate(target, PredictionDrafter(NoDrafter()), prompt, deleted)
    assert out == plain and stats.accepted >= len(plain) - 20


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_feature_reading_inner_drafter_stays_exact(stories_native, target, prompt, plain, mode):
    """EAGLE-3 (reads the target's layers) wrapped: it observes steps the prediction drafted."""
    for prediction in (plain[:20] + plain[30:], plain[::-1]):
        drafter = PredictionDrafter(stories_eagle3(stories_native, mode=mode))
        assert generate(target, drafter, prompt, prediction)[0] == plain


def test_without_a_prediction_the_inner_drafter_runs_unchanged(target, prompt, plain):
    out, stats = generate(target, PredictionDrafter(PromptLookupDrafter()), prompt, ())
    ref, ref_stats = run(target, PromptLookupDrafter(), prompt, GREEDY, k=8)
    assert out == ref == plain and (stats.drafted, stats.accepted) == (ref_stats.drafted, ref_stats.accepted)


def test_bad_predictions_are_refused(target, prompt):
    engine = Engine(target, PredictionDrafter(NoDrafter()), 4)
    with pytest.raises(ValueError, match="prediction token ids"):
        engine.add_request(prompt, GREEDY, prediction=[target.info.vocab_size])
    with pytest.raises(ValueError, match="prediction token ids"):
        engine.add_request(prompt, GREEDY, prediction=[-1])
    with pytest.raises(ValueError, match="prediction has"):
        engine.add_request(prompt, GREEDY, prediction=[1] * (target.info.max_length + 1))


class FixedPrediction(PredictionDrafter):
    """Every request predicts ``prediction`` (so the shared law helpers can run it)."""

    def __init__(self, inner, prediction):
        super().__init__(inner)
        self.fixed = tuple(prediction)

    def propose_batch(self, ctxs: list[DraftContext]):
        return super().propose_batch([dataclasses.replace(c, prediction=self.fixed) for c in ctxs])


@pytest.mark.extended  # statistics over many draws: run by .ci/run (make test-extended)
def test_sampling_law_with_a_prediction(target, prompt, plain):
    """T = 1: tokens 2-3 (committed by speculative steps from the prediction) follow the
    target's law, as with plain sampling (two-sample chi-square)."""
    assert same_first_tokens_law(target, FixedPrediction(NoDrafter(), plain), prompt, seeds=200, k=4) > 1e-3


@pytest.mark.parametrize("prediction,tokens,hint,want", [
    ((3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 9), [3, 4, 5, 6], 5, 10),  # nearest after the place
    ((3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 9), [3, 4, 5, 6], 0, 4),
    ((2, 4, 5, 6, 7, 8, 0, 4, 5, 6, 9, 1), [2, 4, 5, 6], 11, 4),  # out of step: the longer match wins
    ((5, 6, 7, 8, 5, 6, 9), [1, 5, 6], 3, None),  # away from the place, 2 tokens are not enough
    ((5, 6, 7, 8, 5, 6, 9), [7, 5, 6], 5, 6),  # at the place (hint + 1: the bonus token), they are
    ((5, 6, 7), [1, 2], 0, None),
    ((5, 6, 7), [6], 0, None),  # shorter than a match
    ((5, 6, 7, 8), [5, 6, 7], 2, 3),  # in step: one past the place (the bonus token)
    ((5, 6, 7, 8), [9, 5, 6], 0, 2),  # nothing matched yet: the prediction's first two tokens start it
    ((5, 6, 7, 8, 5, 6, 1), [9, 5, 6], 3, None),  # ...but not once drafting has moved on
])
def test_find_place(prediction, tokens, hint, want):
    index: dict[tuple[int, ...], list[int]] = {}
    for p in range(len(prediction) - 1):
        index.setdefault(prediction[p:p + 2], []).append(p)
    assert find_place(prediction, index, tokens, hint) == want


# t(n) of the Qwen2.5-Coder 1.5B target on 2 AVX-512 cores (compute-bound past 4 tokens), and a memory-bound one
AVX512 = {1: 1.07, 2: 1.13, 4: 1.19, 8: 1.69, 12: 2.27, 16: 2.96, 24: 4.26, 32: 5.54}
FLAT = {n: 1.0 for n in (1, 2, 4, 8, 16, 32)}


def test_drafts_are_sized_by_the_cost_curve_and_the_requests_acceptance():
    """A match in step is drafted as far as t(n) pays at the request's acceptance of its prediction
    drafts: all of the budget on a flat curve, less on a steep one, and less again after misses."""
    prediction = tuple(range(10, 90))

    def sizes(cost, misses):
        d = PredictionDrafter(NoDrafter(), cost=CostModel(cost))
        ctx = DraftContext("r", [1, 10, 11], 32, GREEDY, make_generator(0, 1), prediction)
        for _ in range(misses):  # drafts rejected at their first token
            tree = d.propose(ctx)
            d.observe(Observation("r", tree, [], [3], torch.zeros(tree.size, 4), None))
        return d.propose(ctx).num_drafted

    assert sizes(FLAT, 0) == 32
    assert 4 <= sizes(AVX512, 0) < 32
    assert sizes(AVX512, 10) < sizes(AVX512, 0)
    assert sizes(None, 10) == 32  # no curve: the budget


def test_an_answer_that_starts_before_the_prediction_drafts_only_once_it_reaches_it():
    """A chat answer opens a code block before the predicted code: nothing is drafted blindly at
    the start; the prediction's first two tokens in the answer start drafting from there."""
    d = PredictionDrafter(NoDrafter(), cost=CostModel(FLAT))
    prediction = tuple(range(10, 40))
    tree = d.propose(DraftContext("r", [1, 2, 7], 8, GREEDY, make_generator(0, 1), prediction))
    assert tree == DraftTree.chain(7, [])
    d.observe(Observation("r", tree, [], [8], torch.zeros(1, 4), None))
    tree = d.propose(DraftContext("r", [1, 2, 7, 8, 10, 11], 8, GREEDY, make_generator(0, 1), prediction))
    assert tree.tokens[1:] == prediction[2:10]


def test_at_the_predictions_end_the_step_drafts_nothing():
    """The output has followed the prediction to its end: the inner drafter (which would copy what
    follows that code in the prompt) is not asked; the next step is plain."""
    prediction = tuple(range(10, 20))
    tokens = [1, 16, 17, 18, 19, 5, 6, 16, 17, 18, 19]  # prompt lookup would draft 5, 6, ...
    d = PredictionDrafter(PromptLookupDrafter(), cost=CostModel(FLAT))
    assert d.propose(DraftContext("r", tokens, 8, GREEDY, make_generator(0, 1), prediction)).num_drafted == 0
    assert PromptLookupDrafter().propose(DraftContext("r", tokens, 8, GREEDY, make_generator(0, 1))).num_drafted > 0


def test_one_plain_step_after_the_answer_leaves_the_prediction_at_its_last_token():
    """The answer spells the prediction's last token otherwise (its "\\n```" where the prediction
    ends in "\\n"): once, the next step is plain; after it the inner drafter drafts again."""
    prediction = tuple(range(10, 20))
    tokens = [1, 5, 6, 7, 10, 11]
    d = PredictionDrafter(PromptLookupDrafter(), cost=CostModel(FLAT))
    tree = d.propose(DraftContext("r", tokens, 8, GREEDY, make_generator(0, 1), prediction))
    assert tree.tokens[1:] == prediction[2:10]
    d.observe(Observation("r", tree, list(range(1, 8)), [*prediction[2:9], 5], torch.zeros(tree.size, 4), None))
    tokens += [*prediction[2:9], 5]
    assert d.propose(DraftContext("r", tokens, 8, GREEDY, make_generator(0, 1), prediction)).num_drafted == 0
    tokens.append(6)  # prompt lookup drafts 7, 10, ... after "5 6"
    assert d.propose(DraftContext("r", tokens, 8, GREEDY, make_generator(0, 1), prediction)).num_drafted > 0
