"""A draft model's sampled chain in one call on the compiled runtime (issue 33: the sampled path's
draft loop in C++): ``CpuLlama.draft_chain`` with ``sampled`` draws each draft from q, the draft's
logits processed as ``sampling.process_logits`` does (temperature, min-p, top-k, top-p), with the
caller's uniforms, and returns q. Checked here: q equals the Python path's q to float rounding
(a full and a reduced FR-Spec head), the draws follow q (chi-square), every ISA drafts the same
chain bit for bit, speculative sampling with the one-call chain follows plain sampling's law
(chi-square against plain and against the target's exact p), and a seed fixes the output."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_target_law, law_pvalue, run, same_first_tokens_law
from tiny_models import available_isas, tiny_llama
from verispec.drafters.base import DraftContext
from verispec.cost_model import CostModel
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models import cpu, cpu_abi
from verispec.sampling import make_generator, target_probs
from verispec.types import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_abi.available(), reason="the compiled runtime is not built")

V = 96
PROMPT = [1, 40, 41, 3, 17, 88, 40, 41, 3, 60]
COST = CostModel(draft=0.05, curve={1: 1.02, 2: 1.05, 4: 1.15, 8: 1.5, 16: 2.6})
LAWS = {"T": SamplingParams(temperature=2.0), "top-k": SamplingParams(temperature=1.5, top_k=7),
        "top-p": SamplingParams(temperature=1.5, top_p=0.8), "min-p": SamplingParams(temperature=1.5, min_p=0.05),
        "all": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01),
        "huge top-k": SamplingParams(temperature=1.5, top_k=2**31 + 5),  # beyond int32: keeps every token
        "float edges": SamplingParams(temperature=1.5, top_p=1e-50, min_p=1 - 1e-10)}  # 0 and 1 as float32


def compiled(seed: int, head_rows=None, isa: str | None = None) -> cpu.CpuLlama:
    hf = tiny_llama(seed, vocab=V)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return cpu.CpuLlama.from_state_dict(hf.config.to_dict(), state, max_length=256, threads=1, head_rows=head_rows,
                                        isa=isa)


@pytest.fixture(scope="module")
def models():
    rows = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:60]  # a reduced head in no particular order
    return {"target": compiled(0), "other": compiled(1), "reduced": compiled(1, head_rows=rows)}


def uniforms(n: int, seed: int = 0) -> list[float]:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tolist()


@pytest.mark.parametrize("law", LAWS, ids=list(LAWS))
@pytest.mark.parametrize("draft", ["other", "reduced"])
def test_q_rows_are_the_python_paths_q(models, law, draft):
    """Each draft's q is target_probs of the draft's logits after the chain so far (what the
    Python loop samples from), to float rounding, with the same support; the draft has mass."""
    model, params = models[draft], LAWS[law]
    drafts, fed, q = model.draft_chain(model.new_cache(64), PROMPT, 6, sampled=(params, uniforms(6)))
    assert len(drafts) == 6 and fed == len(PROMPT) + 5 and q.shape == (6, V)
    ids = torch.tensor([PROMPT + drafts[:-1]])
    logits = model.forward(ids, torch.arange(ids.shape[1])[None], model.new_cache(64)).logits[0, len(PROMPT) - 1:]
    want = target_probs(logits, params)
    assert torch.equal(q > 0, want > 0)
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-6)
    assert all(q[i, t] > 0 for i, t in enumerate(drafts))
    if draft == "reduced":
        assert set(drafts) <= set(model.head_rows.tolist())


@pytest.mark.parametrize("law", ["T", "top-k"])
@pytest.mark.parametrize("draft", ["other", "reduced"])
def test_draws_follow_q(models, law, draft):
    """The first draft, over 3000 uniforms, follows the q returned with it (chi-square; no draw
    outside q's support); the reduced head's rows map back to their token ids."""
    model, params = models[draft], LAWS[law]
    cache, tokens, q = model.new_cache(64), [], None
    for u in uniforms(3000, seed=1):
        cache.truncate(0)
        drafts, _, q = model.draft_chain(cache, PROMPT, 1, sampled=(params, [u]))
        tokens.append(drafts[0])
    assert law_pvalue(torch.tensor(tokens), q[0]) > 1e-3
    assert len(set(tokens)) > 3  # a law with some spread: the test can fail


def test_every_isa_drafts_the_same_chain():
    """Scalar, AVX2 and AVX-512 give the same logits, so the same q rows and draws, bit for bit."""
    params, u = LAWS["all"], uniforms(8, seed=2)
    chains = []
    for isa in available_isas():
        model = compiled(1, isa=isa)
        chains.append(model.draft_chain(model.new_cache(64), PROMPT, 8, sampled=(params, u)))
    for drafts, fed, q in chains[1:]:
        assert drafts == chains[0].drafts and fed == chains[0].fed and torch.equal(q, chains[0].q)


def test_the_cost_rule_sizes_sampled_chains(models):
    """With the cost rule a chain stops where one more token no longer pays, acceptance guessed
    from each q's top probability: the Python loop's rule, recomputed here from the q rows that
    came back."""
    model = models["other"]
    budget, params = 8, LAWS["T"]
    lengths = []
    for seed in range(20):
        drafts, _, q = model.draft_chain(model.new_cache(64), PROMPT, budget, cost=(COST.draft, [
            COST.verify(n) for n in range(budget + 2)]), sampled=(params, uniforms(budget, seed)))
        accept_all, expected = 1.0, 1.0
        for i in range(len(drafts)):
            keep_p = accept_all * float(q[i].max())
            assert COST.keeps(i, expected, keep_p)
            accept_all, expected = keep_p, expected + keep_p
            if i + 1 < len(drafts):
                assert COST.pays_another(i, expected, accept_all * float(q[i].max()))
        lengths.append(len(drafts))
    assert min(lengths) < budget  # the rule cut some chains short


def test_sampled_speculation_follows_plain_sampling(models):
    """Tokens 2-3, committed by speculative steps whose drafts the one-call chain sampled, have
    plain sampling's joint law (chi-square, two samples)."""
    assert same_first_tokens_law(models["target"], DraftModelDrafter(models["other"]), PROMPT, seeds=150) > 1e-3


@pytest.mark.parametrize("law", ["top-p", "all"])
def test_the_token_after_a_speculative_step_follows_p(models, law):
    """The second generated token (the first a speculative step commits) follows the target's
    p(. | prompt, first token) under the filters, the draft a reduced head (chi-square)."""
    params = LAWS[law]
    pairs = []
    for seed in range(300):
        ids, _ = run(models["target"], DraftModelDrafter(models["reduced"]), PROMPT,
                     SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    min_p=params.min_p, max_new_tokens=2, seed=seed, ignore_eos=True), k=4)
        pairs.append(ids)
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    assert_target_law(models["target"], PROMPT + [first], [p[1] for p in pairs if p[0] == first], params)


def test_a_seed_fixes_the_output(models):
    params = SamplingParams(temperature=0.7, max_new_tokens=24, seed=11, ignore_eos=True)
    outs = [run(models["target"], DraftModelDrafter(models["other"], cost=COST), PROMPT, params, k=6)[0]
            for _ in range(2)]
    assert outs[0] == outs[1]
    other = run(models["target"], DraftModelDrafter(models["other"], cost=COST), PROMPT,
                SamplingParams(temperature=0.7, max_new_tokens=24, seed=12, ignore_eos=True), k=6)[0]
    assert other != outs[0]


def test_the_drafter_passes_q_and_draws_from_its_generator(models):
    """DraftModelDrafter's sampled proposal comes from the one-call chain: q rows attached, the
    draws the request's drafter generator's (the same generator state, the same chain)."""
    drafter = DraftModelDrafter(models["other"])
    trees = []
    for _ in range(2):
        drafter.start("r", PROMPT[:-1])
        ctx = DraftContext("r", PROMPT, 5, LAWS["T"], make_generator(3, 1))
        trees.append(drafter.propose(ctx))
        drafter.finish("r")
    assert trees[0].tokens == trees[1].tokens and len(trees[0].tokens) == 6
    assert trees[0].draft_probs.shape == (6, V) and torch.equal(trees[0].draft_probs, trees[1].draft_probs)


@pytest.mark.parametrize("sampled, message", [
    ((SamplingParams(temperature=0.0), [0.5] * 4), "a temperature > 0 and 4 uniforms"),
    ((SamplingParams(temperature=0.7), [0.5] * 3), "a temperature > 0 and 4 uniforms"),
])
def test_bad_sampled_calls_are_refused(models, sampled, message):
    model = models["other"]
    cache = model.new_cache(64)
    with pytest.raises(ValueError, match=message):
        model.draft_chain(cache, [3], 4, sampled=sampled)
    assert cache.length == 0


@pytest.mark.parametrize("cost", [None, CostModel(draft=0.01, curve={1: 1.0, 4: 1.02, 16: 1.1})], ids=["fixed", "cost"])
@pytest.mark.parametrize("draft", ["other", "reduced"])
def test_one_call_and_batched_loop_draft_the_same_sampled_chains(models, draft, cost):
    """A request drafts the same sampled chain (tokens and q, bit for bit) in one call, through the
    Python loop, and batched beside another request: the loop draws with the runtime's law
    (``draft_sample``) and the same uniforms, so seeded output does not depend on other traffic."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16)
    prompts = [PROMPT, [1, 70, 71, 72, 70, 71, 33]]
    trees = {}
    for how in ("one call", "python", "batched"):
        d = DraftModelDrafter(models[draft], one_call=how == "one call", cost=cost)
        for r, p in enumerate(prompts):
            d.start(f"r{r}", p[:-1])
        ctxs = [DraftContext(f"r{r}", p, 6, params, make_generator(5, r)) for r, p in enumerate(prompts)]
        trees[how] = d.propose_batch(ctxs) if how == "batched" else [d.propose(c) for c in ctxs]
        assert d.pool is not None and d.pool.in_use == 2  # both requests' caches are rows of one pool: batched
    for how in ("python", "batched"):
        for a, b in zip(trees["one call"], trees[how]):
            assert a.tokens == b.tokens and torch.equal(a.draft_probs, b.draft_probs)
    lengths = [len(t.tokens) - 1 for t in trees["one call"]]
    assert lengths == [6, 6] if cost is None else max(lengths) > 1


def test_logits_that_name_no_token_end_the_chain(models):
    """NaN, +inf or no finite logit: no draft (the chain ends; the target's own logits are checked)."""
    model, params = models["other"], LAWS["all"]
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert model.draft_sample(torch.full((V,), bad), params, 0.5) is None
    token, q = model.draft_sample(torch.arange(V, dtype=torch.float32) / 10, params, 0.5)
    assert q.shape == (V,) and q[token] > 0 and abs(float(q.sum()) - 1) < 1e-5
