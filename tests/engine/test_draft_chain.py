"""A draft model's greedy chain in one call on the compiled runtime (issue 33: "the draft loop in
the compiled runtime: one call drafts a whole chain with the confidence stop inside C++"):
``CpuLlama.draft_chain`` drafts the chains the Python loop of ``DraftModelDrafter`` drafts
(fixed length, the confidence stop, the cost rule; a full and a reduced head), leaves the
draft's cache where that loop leaves it, keeps generation equal to plain decoding, and
refuses bad calls with a ValueError before touching the cache."""

from __future__ import annotations


import pytest
import torch

from helpers import run
from tiny_models import tiny_llama
from verispec.drafters.base import DraftContext, NoDrafter
from verispec.cost_model import CostModel
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models import cpu, cpu_abi
from verispec.types import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_abi.available(), reason="the compiled runtime is not built")

V = 96
PROMPTS = [[1, 40, 41, 3, 17, 88, 40, 41, 3, 60], [1, 70, 71, 72, 70, 71, 33], [1, 9, 20, 31, 9, 20, 31, 9]]
COST = CostModel(draft=0.05, curve={1: 1.02, 2: 1.05, 4: 1.15, 8: 1.5, 16: 2.6})
RULES = {"fixed": {}, "confidence": {"min_confidence": 0.3}, "cost": {"cost": COST}}


def compiled(seed: int, head_rows=None) -> cpu.CpuLlama:
    hf = tiny_llama(seed, vocab=V)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return cpu.CpuLlama.from_state_dict(hf.config.to_dict(), state, max_length=256, threads=1, head_rows=head_rows)


@pytest.fixture(scope="module")
def models():
    # a reduced head in no particular order (FR-Spec rows are by frequency), without the target's favourite tokens
    rows = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:60]
    return {"target": compiled(0), "other": compiled(1), "self": compiled(0), "reduced": compiled(0, head_rows=rows)}


@pytest.mark.parametrize("rule", RULES, ids=list(RULES))
@pytest.mark.parametrize("draft", ["other", "self", "reduced"])
def test_one_call_drafts_the_python_loops_chains(models, rule, draft):
    contexts = [PROMPTS[0], PROMPTS[0] + [5, 6], PROMPTS[0] + [5], PROMPTS[0] + [5, 7, 8, 9, 10, 11, 12]]
    assert models[draft].caps.chain_drafting
    chains = {}
    for name, one_call in (("one call", True), ("python", False)):
        d = DraftModelDrafter(models[draft], one_call=one_call, **RULES[rule])
        d.start("r", contexts[0][:-1])
        chains[name] = []
        for tokens in contexts:
            tree = d.propose(DraftContext("r", tokens, 8, SamplingParams(max_new_tokens=32), None))
            chains[name].append(tree.tokens[1:])
        d.finish("r")
    assert chains["one call"] == chains["python"]
    assert any(chains["python"])  # the rule drafted something: the comparison is not between empty chains


@pytest.mark.parametrize("rule", RULES, ids=list(RULES))
@pytest.mark.parametrize("draft", ["other", "self", "reduced"])
def test_one_call_chains_keep_generation_equal_to_plain(models, rule, draft):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        plain, _ = run(models["target"], NoDrafter(), prompt, params)
        out, stats = run(models["target"], DraftModelDrafter(models[draft], **RULES[rule]), prompt, params, k=8)
        assert out == plain
        if draft == "self" and rule == "fixed":
            assert stats.accepted == stats.drafted > 0  # the target drafting for itself: every draft accepted


def test_the_cache_holds_what_was_fed(models):
    """The feed and every draft fed back are in the cache (the last draft is not): feeding
    them one by one in Python gives the same next logits."""
    model = models["other"]
    cache = model.new_cache(128)
    drafts, fed, _ = model.draft_chain(cache, PROMPTS[1], 6)
    assert len(drafts) == 6 and fed == len(PROMPTS[1]) + 5 == cache.length
    ref = model.new_cache(128)
    logits = None
    for i, tok in enumerate(PROMPTS[1] + drafts[:-1]):
        logits = model.forward(torch.tensor([[tok]]), torch.tensor([[i]]), ref).logits[0, -1]
    assert int(logits.argmax()) == drafts[-1]
    a = model.forward(torch.tensor([[drafts[-1]]]), torch.tensor([[fed]]), cache).logits
    b = model.forward(torch.tensor([[drafts[-1]]]), torch.tensor([[fed]]), ref).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("call, message", [
    (lambda m, c: m.draft_chain(c, [], 4), "needs tokens to feed"),
    (lambda m, c: m.draft_chain(c, [3], -1), "budget >= 0"),
    (lambda m, c: m.draft_chain(c, [3] * 60, 8), "cache overflow"),
    (lambda m, c: m.draft_chain(c, [3], 4, cost=(0.1, [1.0, 1.1])), "needs t(0) .. t(5)"),
    (lambda m, c: m.draft_chain(c, [V + 3], 4), "token ids must be in"),
    (lambda m, c: m.draft_chain(compiled(2).new_cache(64), [3], 4), "a CpuCache of a pool created by this model"),
])
def test_bad_calls_are_refused_before_the_cache_moves(models, call, message):
    model = models["other"]
    cache = model.new_cache(64)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(model, cache)
    assert cache.length == 0
