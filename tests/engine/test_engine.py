"""Engine on tiny fp32 models: strict greedy equality with plain decoding for every kind of
drafter, deterministic counts, stopping, and sampling-distribution equality."""

import pytest
from collections import Counter

import torch
from scipy.stats import chisquare

from helpers import OracleDrafter, RandomDrafter, TemperedSelfDraft, run
from verispec.drafters.base import NoDrafter
from verispec.cost_model import CostModel
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.sampling import target_probs
from verispec.types import SamplingParams

PROMPT = [1, 5, 6, 7, 8, 5, 6, 7, 9, 10, 11]
GREEDY = SamplingParams(max_new_tokens=48, ignore_eos=True)
COST = CostModel({1: 1.1, 2: 1.2, 4: 1.5, 8: 2.2}, 0.3)  # draft forward and t(n), in target decode steps


@pytest.fixture(scope="module")
def plain(toy_target):
    return run(toy_target, NoDrafter(), PROMPT, GREEDY)


def test_plain_decoding_one_forward_per_token(plain):
    ids, stats = plain
    assert len(ids) == 48 and stats.target_forwards == 48 and stats.tau == 1.0


@pytest.mark.parametrize("make", [
    lambda t, d: PromptLookupDrafter(),
    lambda t, d: PromptLookupDrafter(max_ngram=4, num_candidates=4),
    lambda t, d: DraftModelDrafter(d),
    lambda t, d: DraftModelDrafter(d, min_confidence=0.5),
    lambda t, d: DraftModelDrafter(d, cost=COST),
    lambda t, d: RandomDrafter(t.info.vocab_size),
    lambda t, d: RandomDrafter(t.info.vocab_size, tree=True),
], ids=["pld", "pld-tree", "draft", "draft-conf", "draft-cost", "random", "random-tree"])
@pytest.mark.parametrize("policy", ["fixed", "heuristic"])
def test_greedy_equals_plain(toy_target, toy_draft, plain, make, policy):
    ids, stats = run(toy_target, make(toy_target, toy_draft), PROMPT, GREEDY, policy=policy)
    assert ids == plain[0]
    assert stats.steps + 1 == stats.target_forwards


def test_same_model_as_draft_accepts_everything(toy_target, plain):
    ids, stats = run(toy_target, DraftModelDrafter(toy_target), PROMPT, GREEDY, k=5)
    assert ids == plain[0]
    assert stats.alpha == 1.0
    # prefill gives 1 token, each step 6 (5 drafts + bonus); the last step is budget-capped
    assert stats.target_forwards == 1 + 8 and stats.accepted == 47 - 8


@pytest.mark.parametrize("j", [0, 1, 3])
def test_oracle_prefix_accepts_exactly_j(toy_target, plain, j):
    reference = PROMPT + plain[0]
    ids, stats = run(toy_target, OracleDrafter(reference, j, toy_target.info.vocab_size),
                     PROMPT, GREEDY, k=5)
    assert ids == plain[0]
    steps = -(-47 // (j + 1))  # ceil: each step commits j + 1 tokens
    assert stats.steps == steps
    assert stats.accepted == 47 - steps


def test_max_new_tokens_and_eos_cut(toy_target, plain):
    ids, _ = run(toy_target, PromptLookupDrafter(), PROMPT, SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert ids == plain[0][:7]
    eos_token = plain[0][5]
    target_with_eos = type(toy_target).__new__(type(toy_target))
    target_with_eos.__dict__.update(toy_target.__dict__)
    target_with_eos.info = type(toy_target.info)(**{**toy_target.info.__dict__, "eos_token_ids": (eos_token,)})
    first = plain[0].index(eos_token)
    ids, _ = run(target_with_eos, PromptLookupDrafter(), PROMPT, SamplingParams(max_new_tokens=40))
    assert ids == plain[0][:first]


def test_seeded_sampling_is_deterministic(toy_target, toy_draft):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)
    a = run(toy_target, DraftModelDrafter(toy_draft), PROMPT, params)[0]
    b = run(toy_target, DraftModelDrafter(toy_draft), PROMPT, params)[0]
    assert a == b


def test_cost_sized_drafts(toy_target):
    """t(n) interpolates the measured curve (t(0) = 1); a dear draft drafts less than a cheap one,
    and never more than the budget."""
    assert COST.verify(0) == 1.0 and COST.verify(3) == pytest.approx(1.35) and COST.verify(16) == pytest.approx(3.6)
    from verispec.drafters.base import DraftContext
    from verispec.sampling import make_generator

    def drafted(cost):
        d = DraftModelDrafter(toy_target, cost=cost)
        d.start("r", PROMPT)
        n = len(d.propose(DraftContext("r", PROMPT, 8, GREEDY, make_generator(0, 1))).tokens) - 1
        d.finish("r")
        return n
    cheap, dear = drafted(CostModel({1: 1.0, 8: 1.0}, 0.0)), drafted(CostModel(COST.curve, 5.0))
    assert cheap == 8 and dear < cheap


@pytest.mark.parametrize("which", ["draft", "draft-cost", "pld"])
def test_sampling_distribution_matches_target(toy_target, which):
    """Token 2 is committed by the first speculative step; given token 1 its law must be
    exactly the target's p(. | prompt, token 1) at the request's temperature. A small smoke test of the
    engine's plumbing per sampler (250 seeds): the rule itself is enumerated exactly in unit/test_verify.py."""
    drafter = (TemperedSelfDraft(toy_target) if which == "draft" else TemperedSelfDraft(toy_target, cost=COST)
               if which == "draft-cost" else PromptLookupDrafter(max_ngram=1))
    params = [SamplingParams(temperature=1.5, max_new_tokens=4, seed=s, ignore_eos=True)
              for s in range(250)]
    pairs = [tuple(run(toy_target, drafter, PROMPT, p, k=3)[0]) for p in params]
    t1 = Counter(p[0] for p in pairs).most_common(1)[0][0]
    seconds = torch.tensor([p[1] for p in pairs if p[0] == t1])
    ids = torch.tensor([PROMPT + [t1]])
    cache = toy_target.new_cache()
    logits = toy_target.forward(ids, torch.arange(ids.shape[1])[None], cache).logits[0, -1:]
    p = target_probs(logits, params[0])[0].double()
    counts = torch.bincount(seconds, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    big = p * len(seconds) >= 5  # chi-square cells with enough expected mass; rest pooled
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([p[big], p[~big].sum()[None]]) * len(seconds)
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3
