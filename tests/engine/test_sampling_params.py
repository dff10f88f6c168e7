"""Issue 15 in the engine: sampling parameters under speculation (logit bias, penalties,
min-p, stop token ids), logprobs, and n samples sharing one prefill (``Engine.fork``).

Oracles: a slow per-token reference of the penalties (plain Python loops), teacher-forced
one-token forwards for logprobs (exactly what plain decoding computes), plain decoding
with the same parameters, and the target's exact law for sampling (chi-square)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from helpers import RandomDrafter, TemperedSelfDraft, forced_logits, law_pvalue, run
from verispec.drafters.base import NoDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import Engine
from verispec.logits_processing import adjust_tree_logits, path_counts
from verispec.sampling import target_probs
from verispec.tree import DraftTree
from verispec.types import SamplingParams

PROMPT = [1, 5, 6, 7, 8, 5, 6, 7, 9, 10, 11]  # repetitive: prompt lookup accepts drafts

PENALTIES = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5, logit_bias=((9, 3.0), (17, -50.0)))
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True, **PENALTIES)


# ---- reference implementations (slow loops) -------------------------------------------------
def ref_adjust(row: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """One position's logits after bias and penalties, token by token."""
    out = row.float().clone()
    for t, b in params.logit_bias:
        out[t] += b
    counts = Counter(generated)
    for t in set(prompt) | set(counts):
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t, c in counts.items():
        out[t] -= params.frequency_penalty * c + params.presence_penalty
    return out


def ref_greedy(target, prompt: list[int], params: SamplingParams) -> list[int]:
    cache = target.new_cache()
    row = target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache,
                         last_logits_only=True).logits[0, -1]
    out: list[int] = []
    while True:
        out.append(int(ref_adjust(row, params, prompt, out).argmax()))
        if len(out) == params.max_new_tokens:
            return out
        row = target.forward(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + len(out) - 1]]), cache).logits[0, -1]


# ---- logit processing ----------------------------------------------------------------------
def test_path_counts_docstring_and_loop():
    counts = path_counts(DraftTree.chain(4, [3, 3]), [4], 6)
    assert counts.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 2, 1, 0]]
    tree = DraftTree(tokens=(5, 1, 2, 1, 3, 1), parents=(-1, 0, 0, 1, 3, 2))
    generated = [0, 5, 5]
    counts = path_counts(tree, generated, 6)
    for i in range(tree.size):
        want = Counter(generated + [tree.tokens[j] for j in tree.path_to(i)])
        assert counts[i].tolist() == [want[t] for t in range(6)]


def test_adjust_tree_logits_equals_per_node_reference():
    g = torch.Generator().manual_seed(0)
    tree = DraftTree(tokens=(5, 1, 2, 1, 3), parents=(-1, 0, 0, 1, 1))
    logits = torch.randn(tree.size, 8, generator=g) * 3
    params = SamplingParams(**PENALTIES | {"logit_bias": ((1, 2.0), (7, -1.5))})
    got = adjust_tree_logits(logits, tree, params, [2, 6, 6], [4, 5])
    for i in range(tree.size):
        want = ref_adjust(logits[i], params, [2, 6, 6], [4, 5] + [tree.tokens[j] for j in tree.path_to(i)])
        assert torch.allclose(got[i], want, atol=1e-6)


def test_min_p_keeps_tokens_above_fraction_of_the_max():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))[0]
    assert p[3] == 0 and p[2] > 0 and torch.allclose(p.sum(), torch.tensor(1.0))


def test_params_validation():
    for bad in [dict(min_p=1.5), dict(presence_penalty=3.0), dict(repetition_penalty=0.0),
                dict(repetition_penalty=float("nan")), dict(logit_bias=((1, 200.0),)),
                dict(logit_bias=((1, 1.0), (1, 2.0))), dict(stop_token_ids=(-1,)), dict(logprobs=21)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert not SamplingParams().adjusts_logits and SamplingParams(repetition_penalty=1.1).adjusts_logits


def test_out_of_vocab_ids_are_refused(toy_target):
    engine = Engine(toy_target, NoDrafter())
    for p in [SamplingParams(logit_bias=((10_000, 1.0),)), SamplingParams(stop_token_ids=(10_000,))]:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request(PROMPT, p)


# ---- penalties under speculation -----------------------------------------------------------
@pytest.fixture(scope="module")
def penalized_plain(toy_target):
    return run(toy_target, NoDrafter(), PROMPT, GREEDY)[0]


def test_penalized_plain_decoding_equals_reference(toy_target, penalized_plain):
    assert penalized_plain == ref_greedy(toy_target, PROMPT, GREEDY)
    unpenalized = run(toy_target, NoDrafter(), PROMPT, replace(GREEDY, repetition_penalty=1.0, presence_penalty=0.0,
                                                               frequency_penalty=0.0, logit_bias=()))[0]
    assert unpenalized != penalized_plain  # the parameters really change the output
    assert 17 not in penalized_plain  # logit_bias -50 bans it


@pytest.mark.parametrize("make", [
    lambda t: PromptLookupDrafter(max_ngram=4, num_candidates=4),
    lambda t: DraftModelDrafter(t),  # the target itself: accepted chains and bonus tokens
    lambda t: RandomDrafter(t.info.vocab_size, tree=True),
], ids=["pld-tree", "same-model", "random-tree"])
def test_penalized_greedy_speculation_equals_plain(toy_target, penalized_plain, make):
    ids, stats = run(toy_target, make(toy_target), PROMPT, GREEDY, k=5)
    assert ids == penalized_plain and stats.drafted > 0


def test_penalized_sampling_follows_target_law(toy_target):
    """Token 2 is committed by a speculative step (point-mass drafts, often rejected); given
    token 1 its law must be the target's at that position after penalties, temperature and
    min-p (the slow reference)."""
    params = [SamplingParams(temperature=1.5, min_p=0.02, max_new_tokens=2, seed=s, ignore_eos=True, **PENALTIES)
              for s in range(500)]
    drafter = PromptLookupDrafter(max_ngram=1, num_candidates=2)
    pairs = [tuple(run(toy_target, drafter, PROMPT, p, k=3)[0]) for p in params]
    t1 = Counter(p[0] for p in pairs).most_common(1)[0][0]
    seconds = torch.tensor([p[1] for p in pairs if p[0] == t1])
    row = forced_logits(toy_target, PROMPT, [t1, 0])[-1]
    p = target_probs(ref_adjust(row, params[0], PROMPT, [t1])[None], params[0])[0]
    assert law_pvalue(seconds, p) > 1e-3


def test_stop_token_ids_end_generation(toy_target):
    plain = run(toy_target, NoDrafter(), PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stop = plain[6]
    engine = Engine(toy_target, PromptLookupDrafter(), 4)
    req = engine.add_request(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))
    while not req.finished:
        engine.step(req)
    assert req.generated == plain[: plain.index(stop)] and req.finished == "stop"


# ---- logprobs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exact_models(tmp_path_factory, toy_target):
    """The toy target on the bit-exact runtimes (native PyTorch; compiled when built)."""
    from verispec.models import cpu
    from verispec.models import cpu_abi
    from verispec.models.native import NativeLlama

    path = tmp_path_factory.mktemp("toy-exact")
    toy_target.model.save_pretrained(path)
    models = {"native": NativeLlama.from_hf_dir(path, dtype=torch.float32)}
    if cpu_abi.available():
        models["cpu"] = cpu.CpuLlama.from_hf_dir(path, max_length=512)
    return models


def _run_logprobs(target, drafter, params, k=4):
    engine = Engine(target, drafter, k)
    req = engine.add_request(PROMPT, params)
    while not req.finished:
        engine.step(req)
    return req


@pytest.mark.parametrize("backend", ["native", "cpu"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("which", ["same-model", "tempered", "random"])
def test_logprobs_equal_plain_decoding_bitwise(exact_models, backend, temperature, which):
    """Accepted, rejected-then-recovered and bonus tokens alike: every logprob (and the top-5
    alternatives) is bitwise the one plain decoding computes at that position."""
    if backend not in exact_models:
        pytest.skip("compiled runtime not built")
    target = exact_models[backend]
    assert target.caps.exactness.bit_exact, target.caps.exactness.reason
    drafter = {"same-model": lambda: DraftModelDrafter(target), "tempered": lambda: TemperedSelfDraft(target),
               "random": lambda: RandomDrafter(target.info.vocab_size, tree=True)}[which]()
    params = SamplingParams(temperature=temperature, max_new_tokens=24, seed=3, ignore_eos=True, logprobs=5)
    req = _run_logprobs(target, drafter, params)
    assert req.stats.drafted > 0 and len(req.logprobs) == len(req.generated) == 24
    if which != "same-model":  # (drafting with the target itself accepts everything: bonus tokens)
        assert req.stats.accepted < req.stats.drafted  # some drafts were rejected
    logp = torch.log_softmax(forced_logits(target, PROMPT, req.generated).float(), -1)  # [T, V]
    top = logp.topk(5, -1)
    for i, (t, lp) in enumerate(zip(req.generated, req.logprobs)):
        assert lp.token_id == t and lp.logprob == logp[i, t].item()
        assert [a for a, _ in lp.top] == top.indices[i].tolist() and [b for _, b in lp.top] == top.values[i].tolist()
    if temperature == 0.0:  # and plain decoding through the engine gives the same list
        assert _run_logprobs(target, NoDrafter(), params).logprobs == req.logprobs


def test_logprobs_are_raw_model_logprobs_with_penalties(exact_models):
    """Documented choice: logprobs are of the raw model distribution (vLLM's default)."""
    target = exact_models["native"]
    params = replace(GREEDY, logprobs=0, max_new_tokens=10)
    req = _run_logprobs(target, PromptLookupDrafter(), params)
    logp = torch.log_softmax(forced_logits(target, PROMPT, req.generated).float(), -1)
    assert [lp.logprob for lp in req.logprobs] == [logp[i, t].item() for i, t in enumerate(req.generated)]
    assert all(lp.top == () for lp in req.logprobs)


def test_logprobs_cut_with_tokens_at_length(toy_target):
    req = _run_logprobs(toy_target, DraftModelDrafter(toy_target), SamplingParams(max_new_tokens=7, ignore_eos=True,
                                                                                   logprobs=1), k=5)
    assert len(req.logprobs) == len(req.generated) == 7


# ---- n samples: Engine.fork --------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["hf", "native", "cpu"])
def test_fork_equals_a_fresh_request(exact_models, toy_target, backend):
    """A fork (shared prefill) gives bitwise what a fresh request with its seed gives."""
    target = toy_target if backend == "hf" else exact_models.get(backend)
    if target is None:
        pytest.skip("compiled runtime not built")
    engine = Engine(target, PromptLookupDrafter(), 4)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=11, ignore_eos=True, logprobs=2)
    parent = engine.add_request(PROMPT, params)
    engine.step(parent)  # the parent may have moved on: only its prompt slots are copied
    forks = [engine.fork(parent, replace(params, seed=11 + i)) for i in (1, 2)]
    for i, req in zip((1, 2), forks):
        assert req.stats.target_forwards == 0  # no prefill forward of its own
        while not req.finished:
            engine.step(req)
        fresh = _run_logprobs(target, PromptLookupDrafter(), replace(params, seed=11 + i))
        assert req.generated == fresh.generated and req.logprobs == fresh.logprobs


def test_forked_samples_follow_target_law(toy_target):
    """n = 500 samples sharing one prefill: the first token (drawn from the shared prefill
    logits with each sample's own generator) follows the target's law exactly."""
    engine = Engine(toy_target, NoDrafter())
    params = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0, ignore_eos=True)
    parent = engine.add_request(PROMPT, params)
    firsts = [parent.generated[0]] + [engine.fork(parent, replace(params, seed=s)).generated[0] for s in range(1, 500)]
    assert law_pvalue(torch.tensor(firsts), target_probs(parent.prefill_logits, params)[0]) > 1e-3
    assert len(set(firsts)) > 1


def test_batch_engine_forks_only_a_running_parent(exact_models):
    """``fork_of`` shares a running parent's prefill (a row copy in the pool); once the parent
    is released the sample prefills on its own; output is the same either way."""
    from verispec.engine.batch import BatchEngine

    target = exact_models["native"]
    be = BatchEngine(target, {"pld": Engine(target, PromptLookupDrafter(), 4)}, max_batch=3, max_length=128)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)
    parent = be.add_request("p", PROMPT, params, "pld")
    shared = be.add_request("s", PROMPT, replace(params, seed=6), "pld", fork_of="p")
    be.release(parent)
    alone = be.add_request("a", PROMPT, replace(params, seed=6), "pld", fork_of="p")
    assert (shared.stats.target_forwards, alone.stats.target_forwards) == (0, 1)
    while not (shared.finished and alone.finished):
        be.step([r for r in (shared, alone) if not r.finished])
    assert shared.generated == alone.generated and be.free_slots == 1
