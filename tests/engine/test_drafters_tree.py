"""Training-free tree drafters (SuffixDecoding, Token Recycling, Lookahead, REST, prompt
lookup with several candidates) through the engine: strict greedy equality with plain
decoding on the toy models and on stories260K, near-tie-aware equality on SmolLM2, the
exact sampling law with point-mass trees, and request-lifecycle errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from helpers import run
from verispec.drafters.base import DraftContext, NoDrafter, Observation
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.drafters.model_free import ModelFreeOptions, model_free_drafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.retrieval import RetrievalDrafter, build_datastore
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.drafters.token_recycling import TokenRecyclingDrafter
from verispec.engine import Engine
from verispec.sampling import make_generator, target_probs
from verispec.tree import DraftTree
from verispec.types import SamplingParams

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
TOY_PROMPTS = [[1, 40, 41, 3, 17, 88, 40, 41, 3, 60], [1, 70, 71, 72, 70, 71, 33]]  # varied outputs


def make(name: str, vocab: int, corpus: list[list[int]]):
    """(drafter, budget) for each drafter under test."""
    return {
        "suffix": (SuffixDecodingDrafter(), 8),
        "suffix-wide": (SuffixDecodingDrafter(max_spec_factor=4.0, min_token_prob=0.0), 16),
        "token-recycling": (TokenRecyclingDrafter(vocab), 16),
        # sized by a cost curve: cheap enough that it drafts (and reshapes) trees, steep enough that it sometimes stops
        "token-recycling-costed": (TokenRecyclingDrafter(vocab, cost=CHEAP_CURVE), 16),
        "model-free": (model_free_drafter(vocab, CHEAP_CURVE, ModelFreeOptions(min_match=2)), 16),
        "lookahead": (LookaheadDrafter(), 30),
        "lookahead-small": (LookaheadDrafter(window=3, ngram=3, guesses=2), 6),
        "rest": (RetrievalDrafter(build_datastore(corpus, depth=16)), 10),
        "pld-tree": (PromptLookupDrafter(max_ngram=3, num_candidates=4), 10),
    }[name]


CHEAP_CURVE = {1: 1.02, 2: 1.04, 4: 1.1, 8: 1.3, 16: 1.9}
NAMES = ["suffix", "suffix-wide", "token-recycling", "token-recycling-costed", "model-free", "lookahead", "lookahead-small", "rest", "pld-tree"]


def rounds(name: str) -> int:
    """Drafters that learn across requests (global trie, matrix) get a second round."""
    return 2 if name in ("suffix", "suffix-wide", "token-recycling", "token-recycling-costed", "model-free") else 1


@pytest.fixture(scope="module")
def toy_plain(toy_target):
    return [run(toy_target, NoDrafter(), p, GREEDY)[0] for p in TOY_PROMPTS]


@pytest.mark.parametrize("name,policy", [(n, "fixed") for n in NAMES] + [("suffix", "heuristic"),
                                                                       ("lookahead", "heuristic")])
def test_toy_greedy_equals_plain(toy_target, toy_plain, name, policy):
    # the datastore holds pieces of the right answers and some noise
    corpus = [p + o[:20] for p, o in zip(TOY_PROMPTS, toy_plain)] + [o[15:] for o in toy_plain] + [[3, 4, 5] * 5]
    drafter, k = make(name, toy_target.info.vocab_size, corpus)
    accepted = 0
    for _ in range(rounds(name)):
        for prompt, plain in zip(TOY_PROMPTS, toy_plain):
            ids, stats = run(toy_target, drafter, prompt, GREEDY, k=k, policy=policy)
            assert ids == plain
            assert stats.steps + 1 == stats.target_forwards
            accepted += stats.accepted
    assert accepted > 0  # the drafter did draft something the target accepted
    assert drafter.memory_bytes() >= 0


# ---- stories260K: a real (tiny) trained model, float32 transformers, strict ------------------
@pytest.fixture(scope="module")
def stories():
    from verispec.api import load_model

    return load_model("stories260k", dtype="float32", backend="hf")


@pytest.fixture(scope="module")
def stories_case(stories):
    texts = ["Once upon a time, a cat and a dog", "Tom had a red ball. He liked to play"]
    prompts = [stories.tokenizer(t)["input_ids"] for t in texts]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = [run(stories.backend, NoDrafter(), p, params)[0] for p in prompts]
    return prompts, plain, params


@pytest.mark.parametrize("name", NAMES)
def test_stories_greedy_equals_plain(stories, stories_case, name):
    prompts, plain, params = stories_case
    tok = stories.tokenizer
    corpus = [tok(t)["input_ids"] for t in ["Once upon a time, there was a little girl named Lily.",
                                             "She liked to play with her ball in the park."]]
    drafter, k = make(name, stories.backend.info.vocab_size, corpus)
    for _ in range(rounds(name)):
        for prompt, want in zip(prompts, plain):
            ids, stats = run(stories.backend, drafter, prompt, params, k=k)
            assert ids == want
            assert stats.steps + 1 == stats.target_forwards


# ---- the exact sampling law with point-mass trees ----------------------------------------------
class Spy:
    """Wraps a drafter and counts proposed trees in which some node has >= 2 children."""

    def __init__(self, inner):
        self.inner, self.branching = inner, 0
        self.name = inner.name

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.branching += any(len(c) > 1 for c in tree.children)
        return tree

    def propose_batch(self, ctxs):  # the engine proposes through this
        return [self.propose(c) for c in ctxs]

    def __getattr__(self, attr):  # features / start / observe / finish / memory_bytes / reset
        return getattr(self.inner, attr)


@pytest.mark.parametrize("name,min_branching", [("token-recycling", 200), ("token-recycling-costed", 100),
                                                ("model-free", 50), ("lookahead-small", 20)])
def test_sampling_distribution_matches_target(toy_target, name, min_branching):
    """Token 2 is committed by the first speculative step, verified against a tree of
    point-mass candidates (several siblings per node); given token 1 its law must be
    exactly the target's p(. | prompt, token 1) at the request's temperature."""
    prompt = [1, 40, 41, 3, 17, 88, 40, 41, 3, 60, 40, 41]
    drafter, k = make(name, toy_target.info.vocab_size, [])
    spy = Spy(drafter)
    engine = Engine(toy_target, spy, k)
    params = [SamplingParams(temperature=1.5, max_new_tokens=k + 1, seed=s, ignore_eos=True) for s in range(400)]
    pairs = []
    for p in params:
        req = engine.add_request(prompt, p)
        engine.step(req)  # prefill gave token 1; this step commits token 2 (and maybe more)
        pairs.append(tuple(req.generated[:2]))
        engine.finish(req, "stop")
    # the trees really had sibling candidates (lookahead: when the pool knows token 1)
    assert spy.branching >= min_branching
    t1 = Counter(p[0] for p in pairs).most_common(1)[0][0]
    seconds = torch.tensor([p[1] for p in pairs if p[0] == t1])
    ids = torch.tensor([prompt + [t1]])
    logits = toy_target.forward(ids, torch.arange(ids.shape[1])[None], toy_target.new_cache()).logits[0, -1:]
    p = target_probs(logits, params[0])[0].double()
    counts = torch.bincount(seconds, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    big = p * len(seconds) >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([p[big], p[~big].sum()[None]]) * len(seconds)
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


# ---- lifecycle ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["suffix", "token-recycling", "token-recycling-costed", "lookahead", "rest"])
def test_lifecycle_errors(name):
    drafter, _ = make(name, 32, [[1, 2, 3, 4]])
    ctx = DraftContext("ghost-7", [1, 2, 3], 4, SamplingParams(), make_generator(0, 1))
    with pytest.raises(ValueError, match="ghost-7"):
        drafter.propose(ctx)
    tree = DraftTree.chain(3, [])
    with pytest.raises(ValueError, match="ghost-7"):
        drafter.observe(Observation("ghost-7", tree, [], [4], torch.zeros(1, 32), None))
    drafter.start("r1", [1, 2, 3])
    with pytest.raises(ValueError, match="r1"):
        drafter.start("r1", [1, 2, 3])
    drafter.finish("r1")
    drafter.finish("r1")  # idempotent (the engine may finish twice)
    with pytest.raises(ValueError, match="r1"):
        drafter.propose(DraftContext("r1", [1, 2, 3], 4, SamplingParams(), make_generator(0, 1)))
