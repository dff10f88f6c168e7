"""Batched draft-model drafting (issue 23: "draft-model rows of several requests run as one
batched draft forward"): ``DraftModelDrafter.propose_batch`` drafts what ``propose`` drafts
for each request, in one draft forward per draft step; the server's BatchEngine drafts its
rows that way, and every row's tokens are the request's tokens alone. On stories260K (the
native runtime, batched) with an untrained layer-skip draft; the real Qwen pair runs in
tests/real/test_real_qwen_auto.py."""

from __future__ import annotations

import pytest
import torch

from helpers import run
from verispec.api import load_draft_model, load_model
from verispec.drafters.base import DraftContext, NoDrafter
from verispec.cost_model import CostModel
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.engine import Engine
from verispec.engine.batch import BatchEngine, SpecSchedule
from verispec.sampling import make_generator
from verispec.types import SamplingParams

PROMPTS = [[1, 40, 41, 3, 17, 88, 40, 41, 3, 60], [1, 70, 71, 72, 70, 71, 33], [1, 9, 200, 31, 9, 200],
           [1, 5, 6, 7, 8, 5, 6, 7, 8, 5]]


class Counting:
    """A model, counting its forwards (one per call, batched or not)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, *args, **kw):
        self.calls += 1
        return self.model.forward(*args, **kw)

    def forward_batch(self, *args, **kw):
        self.calls += 1
        return self.model.forward_batch(*args, **kw)


@pytest.fixture(scope="module")
def pair():
    target = load_model("stories260k")  # the native runtime: batched forwards over one cache pool
    return target, load_draft_model(target, "truncated:3")


def contexts(prompts, params, generators):
    return [DraftContext(f"r{i}", p, 6, params, g) for i, (p, g) in enumerate(zip(prompts, generators))]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_propose_batch_drafts_what_propose_drafts_in_fewer_forwards(pair, temperature):
    """Greedy and sampled (seeded, one generator per request): the same chains (and draft
    probabilities) as request by request, through one draft forward per draft step."""
    _, draft = pair
    params = SamplingParams(temperature=temperature, max_new_tokens=8)
    trees = {}
    for batched in (False, True):
        model = Counting(draft)
        d = DraftModelDrafter(model)
        for i, p in enumerate(PROMPTS):
            d.start(f"r{i}", p)  # prefills each request's draft cache (one forward each)
        assert model.calls == len(PROMPTS)
        model.calls = 0
        gens = [make_generator(7, i) for i in range(len(PROMPTS))]
        ctxs = contexts(PROMPTS, params, gens)
        trees[batched] = d.propose_batch(ctxs) if batched else [d.propose(c) for c in ctxs]
        calls = model.calls
        if batched:
            assert calls == max(t.num_drafted for t in trees[True])  # the last prompt token's feed + one per further token
        else:
            assert calls == sum(t.num_drafted for t in trees[False])
        for i in range(len(PROMPTS)):
            d.finish(f"r{i}")
    for alone, together in zip(trees[False], trees[True]):
        assert alone.tokens == together.tokens and alone.parents == together.parents
        if temperature:
            torch.testing.assert_close(alone.draft_probs, together.draft_probs, rtol=0, atol=0)


def test_cost_sized_chains_stop_per_request(pair):
    """With the cost rule, each request's chain stops on its own draft's confidence: the batch
    drafts chains of different lengths, each the one drafted alone."""
    _, draft = pair
    cost = CostModel({1: 1.05, 2: 1.1, 4: 1.2, 8: 1.6, 16: 2.6}, 0.2)
    d = DraftModelDrafter(draft, cost=cost)
    for i, p in enumerate(PROMPTS):
        d.start(f"r{i}", p)
    gens = [make_generator(0, i) for i in range(len(PROMPTS))]
    alone = [d.propose(c) for c in contexts(PROMPTS, SamplingParams(), gens)]
    together = d.propose_batch(contexts(PROMPTS, SamplingParams(), gens))
    assert [t.tokens for t in alone] == [t.tokens for t in together]


def test_requests_beyond_the_pool_draft_alone(pair):
    """pool_rows caps the requests drafted together; later ones get their own cache and the
    same drafts; finishing returns pool rows."""
    _, draft = pair
    d = DraftModelDrafter(draft, pool_rows=2)
    for i, p in enumerate(PROMPTS):
        d.start(f"r{i}", p)
    gens = [make_generator(0, i) for i in range(len(PROMPTS))]
    together = d.propose_batch(contexts(PROMPTS, SamplingParams(), gens))
    ref = DraftModelDrafter(draft)
    for i, p in enumerate(PROMPTS):
        ref.start(f"r{i}", p)
    assert [t.tokens for t in together] == [ref.propose(c).tokens for c in contexts(PROMPTS, SamplingParams(), gens)]
    assert d._pool.in_use == 2
    for i in range(len(PROMPTS)):
        d.finish(f"r{i}")
    assert d._pool.in_use == 0
    with pytest.raises(ValueError, match="pool_rows"):
        DraftModelDrafter(draft, pool_rows=0)


@pytest.mark.parametrize("hybrid", [False, True])
def test_batch_engine_rows_with_a_draft_model_equal_each_request_alone(pair, hybrid):
    """Greedy server rows drafted together (the draft model, or the hybrid handing it the rows
    retrieval does not take) give each request's plain-decoding tokens, in fewer draft
    forwards than the same requests drafted alone."""
    target, draft = pair
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)

    def drafter(model):
        learned = DraftModelDrafter(model)
        if not hybrid:
            return learned
        return HybridDrafter(SuffixDecodingDrafter(min_score=0.0, max_global_tokens=0), learned, min_score=0.5,
                             min_match=3)

    refs = [run(target.backend, NoDrafter(), p, params)[0] for p in PROMPTS]
    alone_model = Counting(draft)
    alone = drafter(alone_model)  # one drafter for all, as the server's engine has
    assert [run(target.backend, alone, p, params)[0] for p in PROMPTS] == refs
    batch_model = Counting(draft)
    be = BatchEngine(target.backend, {"d": Engine(target.backend, drafter(batch_model), 6)}, max_batch=4,
                     max_length=128, schedule=SpecSchedule("budget", 0))
    reqs = [be.add_request(f"r{i}", p, params, "d") for i, p in enumerate(PROMPTS)]
    while not all(r.finished for r in reqs):
        step = be.step([r for r in reqs if not r.finished])
        assert not any(isinstance(x, Exception) for x in step.results), step.results
    assert [r.generated for r in reqs] == refs
    assert 0 < batch_model.calls < alone_model.calls
