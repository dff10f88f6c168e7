"""The real target, SmolLM2-135M-Instruct (transformers backend, float32): speculative greedy
output equals plain decoding for every drafter, up to justified near-ties."""

from __future__ import annotations

import pytest

from exactness import compare_greedy
from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.bench.datasets import load_spec_bench
from verispec.types import SamplingParams

NEW_TOKENS = 64
DRAFTERS = [("prompt-lookup", {}), ("prompt-lookup", {"num_candidates": "3"}), ("draft", {"model": "truncated:6"})]


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m-instruct", dtype="float32", backend="hf")


@pytest.fixture(scope="module")
def prompts(smollm):
    rows = load_spec_bench(categories=("summarization", "rag", "qa", "math_reasoning"), limit_per_category=1)
    return [encode_prompt(smollm, r.turns[0][:1500]) for r in rows]


@pytest.fixture(scope="module")
def plain_outputs(smollm, prompts):
    dec = SpecDecoder(smollm, "none")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(_ids(dec, p, params)) for p in prompts]


def _ids(dec, prompt_ids, params):
    engine = dec.engine
    req = engine.add_request(prompt_ids, params)
    while not req.finished:
        engine.step(req)
    return req.generated


@pytest.mark.parametrize("name,opts", DRAFTERS, ids=["pld", "pld-tree", "draft-truncated"])
def test_greedy_equals_plain(smollm, prompts, plain_outputs, name, opts):
    dec = SpecDecoder(smollm, name, opts, num_draft_tokens=6)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    near_ties = 0
    for prompt, plain in zip(prompts, plain_outputs):
        result = compare_greedy(smollm.backend, prompt, plain, _ids(dec, prompt, params))
        near_ties += result.near_tie_at is not None
    assert near_ties <= len(prompts) // 2, f"{near_ties} near-ties in {len(prompts)} prompts"
