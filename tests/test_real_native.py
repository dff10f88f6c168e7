"""The default configuration on the real target: SmolLM2-135M-Instruct from its Q4_1 GGUF on
the native runtime (int4 weights, batch-invariant). Speculative greedy output must equal
plain decoding token for token for every drafter: strict equality, no near-tie allowance."""

from __future__ import annotations

import pytest

from helpers import run
from verispec.api import encode_prompt, load_model
from verispec.bench.datasets import load_spec_bench
from verispec.drafters.base import NoDrafter
from verispec.registry import make_drafter
from verispec.types import SamplingParams

pytestmark = pytest.mark.real
PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)
DRAFTERS = [("prompt-lookup", {}), ("prompt-lookup", {"num_candidates": "3"}), ("suffix", {}),
            ("token-recycling", {}), ("lookahead", {}), ("draft", {"model": "truncated:4"}), ("draft", {"model": "shipped"}), ("eagle", {}),
            ("medusa", {}), ("medusa", {"tree": "sequoia"})]


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(smollm):
    rows = load_spec_bench(categories=("summarization", "rag", "math_reasoning"), limit_per_category=1)
    return [encode_prompt(smollm, r.turns[0][:1200]) for r in rows]


@pytest.fixture(scope="module")
def plain(smollm, prompts):
    return [run(smollm.backend, NoDrafter(), p, PARAMS)[0] for p in prompts]


def test_default_is_native_int4(smollm):
    assert (smollm.backend_kind, smollm.quant) == ("native", "int4")
    assert smollm.backend.options.batch_invariant
    assert smollm.backend.exactness.bit_exact, smollm.backend.exactness.reason


@pytest.mark.parametrize("name,opts", DRAFTERS, ids=["-".join([n, *(f"{k}={v}" for k, v in o.items())]) for n, o in DRAFTERS])
def test_greedy_equals_plain_exactly(smollm, prompts, plain, name, opts):
    drafter = make_drafter(name, smollm, opts)
    accepted = 0
    for prompt, want in zip(prompts, plain):
        ids, stats = run(smollm.backend, drafter, prompt, PARAMS, k=6)
        assert ids == want
        accepted += stats.accepted
    assert accepted > 0 or name in ("eagle",), f"{name} never had a draft token accepted"
