"""EAGLE heads on the compiled CPU runtime (``CompiledHeadRunner``) against the PyTorch
reference (``TorchHeadRunner``): the same features and draft logits (fp32 weights), the
same drafts through the engine, and lossless greedy decoding with the Q8_0 head."""

from __future__ import annotations

import pytest
import torch

from helpers import random_eagle_head, run
from tiny_models import tiny_llama

from verispec.drafters.base import NoDrafter
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.eagle_runner import CompiledHeadRunner, TorchHeadRunner
from verispec.models import cpu
from verispec.models import cpu_abi
from verispec.types import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_abi.available(), reason="the compiled runtime is not built")

H, V = 64, 96


@pytest.fixture(scope="module")
def target():
    """A random 2-layer Llama on the compiled runtime (fp32 weights)."""
    hf = tiny_llama(0, vocab=V)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return cpu.CpuLlama.from_state_dict(hf.config.to_dict(), state, max_length=256, threads=1)


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["eagle", "eagle3"])
def test_compiled_f32_head_equals_torch(layers):
    """extend in two pieces, then two proposals of three depths with tree ancestors (the
    second overwrites the first's draft slots): step_out and logits match PyTorch."""
    head, embed = random_eagle_head(layers), torch.randn(V, H)
    ref, fast = TorchHeadRunner(head, embed), CompiledHeadRunner(head, embed, 128, quant="f32")
    rs, fs = ref.open(), fast.open()
    feats, toks = torch.randn(9, H), torch.randint(0, V, (9,)).tolist()

    def close(a, b):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=2e-4, rtol=2e-4)

    close(ref.extend(rs, feats[:5], toks[:5], 0), fast.extend(fs, feats[:5], toks[:5], 0))
    close(ref.extend(rs, feats[5:], toks[5:], 5), fast.extend(fs, feats[5:], toks[5:], 5))
    assert ref.cached(rs) == fast.cached(fs) == 9
    for proposal in range(2):
        ref.begin(rs)
        fast.begin(fs)
        x = torch.randn(3, H)
        steps = [([4, 7, 9], [[], [], []]), ([1, 2], [[0], [1]]), ([3], [[0, 3]])]
        for depth, (tokens, anc) in enumerate(steps, start=1):
            a = ref.expand(rs, x[:len(tokens)], tokens, 9 + depth, anc)
            b = fast.expand(fs, x[:len(tokens)], tokens, 9 + depth, anc)
            close(a, b)
            x = a[0]


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["eagle", "eagle3"])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_compiled_head_drafts_like_torch_and_is_lossless(target, layers, mode):
    """Greedy decoding with the compiled head equals plain decoding; with fp32 weights it
    drafts exactly what the PyTorch head drafts (same drafted and accepted counts), and the
    Q8_0 head (the default) is lossless too."""
    head, embed = random_eagle_head(layers, seed=3), torch.randn(V, H) * 3
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = [1, 17, 40, 5, 66]
    plain, _ = run(target, NoDrafter(), prompt, params)
    results = {}
    for name, runner in [("torch", None), ("f32", CompiledHeadRunner(head, embed, 256, quant="f32")),
                         ("q8_0", CompiledHeadRunner(head, embed, 256))]:
        drafter = EagleDrafter(head, embed, mode=mode, depth=3, top_k=3, runner=runner)
        out, stats = run(target, drafter, prompt, params, k=6)
        assert out == plain, name
        results[name] = (stats.drafted, stats.accepted, stats.steps)
    assert results["f32"] == results["torch"]
    assert results["torch"][0] > 0


def test_compiled_head_errors(target):
    head, embed = random_eagle_head((0, 1)), torch.randn(V, H)
    runner = CompiledHeadRunner(head, embed, 64, quant="f32", max_draft=8)
    st = runner.open()
    runner.extend(st, torch.randn(4, H), [1, 2, 3, 4], 0)
    runner.begin(st)
    with pytest.raises(ValueError, match="at most 8 expanded draft nodes"):
        runner.expand(st, torch.randn(9, H), list(range(9)), 5, [[]] * 9)
    with pytest.raises(ValueError, match="cache full"):
        runner.extend(st, torch.randn(61, H), [1] * 61, 4)
    with pytest.raises(ValueError, match="compiled EAGLE head quant"):
        CompiledHeadRunner(head, embed, 64, quant="q4_1")
    # a model without an input projection refuses features (checked in C before any write)
    pool = target.new_cache_pool(1, 64)
    import numpy as np

    with pytest.raises(ValueError, match="takes token ids, not features"):
        target.forward_slots(pool, 0, np.array([1]), np.array([0]), np.array([0]), [np.array([0])], 0,
                             feats=torch.randn(1, H))


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_measured_budget_sizes_drafts_by_cost(target, mode):
    """With the target's cost curve the drafter keeps the prefix of its best-first nodes
    that pays most: free verification keeps the whole budget (as without a curve), a prohibitive one drafts
    nothing, and in between the draft shrinks; greedy output stays plain decoding's."""
    head, embed = random_eagle_head((0, 1), seed=3), torch.randn(V, H) * 3
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompt = [1, 17, 40, 5, 66]
    plain, _ = run(target, NoDrafter(), prompt, params)
    drafted = {}
    for name, cost in [("fixed", None), ("free", {n: 1.0 for n in range(1, 33)}), ("steep", {1: 1.3, 2: 1.6, 4: 2.2, 8: 3.4}),
                       ("prohibitive", {1: 100.0})]:
        drafter = EagleDrafter(head, embed, mode=mode, depth=3, top_k=3, runner=CompiledHeadRunner(head, embed, 256),
                               cost=cost)
        out, stats = run(target, drafter, prompt, params, k=6)
        assert out == plain, name
        drafted[name] = stats.drafted / stats.steps
    assert drafted["free"] == drafted["fixed"] > 0 and drafted["prohibitive"] == 0
    assert 0 <= drafted["steep"] < drafted["free"]


def test_drafts_fit_the_compiled_runner(target):
    """A chain longer than the runner's draft room is shortened, not an error mid-request;
    a tree that could not fit is refused when the drafter is built."""
    head, embed = random_eagle_head((0, 1), seed=3), torch.randn(V, H) * 3
    runner = CompiledHeadRunner(head, embed, 256, max_draft=4)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain, _ = run(target, NoDrafter(), [1, 17, 40], params)
    out, stats = run(target, EagleDrafter(head, embed, mode="chain", runner=runner), [1, 17, 40], params, k=12)
    assert out == plain and stats.drafted <= 5 * stats.steps
    with pytest.raises(ValueError, match="expands 9 nodes"):
        EagleDrafter(head, embed, mode="tree", depth=4, top_k=3, runner=runner)
