"""stories260K (real trained weights, tiny): strict greedy equality for every drafter, and
the sampled distribution of the first tokens with a drafter vs plain sampling."""

from __future__ import annotations

import pytest

from helpers import run, same_first_tokens_law
from verispec.api import load_model
from verispec.drafters.base import NoDrafter
from verispec.registry import make_drafter
from verispec.types import SamplingParams

DRAFTERS = [("prompt-lookup", {}), ("prompt-lookup", {"num_candidates": "4", "max_ngram": "2"}),
            ("draft", {"model": "truncated:2"})]
NEW_TOKENS = 80


@pytest.fixture(scope="module")
def stories():
    return load_model("stories260k", dtype="float32", backend="hf")


@pytest.fixture(scope="module")
def prompts(stories):
    texts = ["", "Tom had a red ball.", "Once upon a time, a cat and a dog"]
    return [stories.tokenizer(t)["input_ids"] or [stories.backend.info.bos_token_id] for t in texts]


@pytest.mark.parametrize("name,opts", DRAFTERS, ids=["pld", "pld-tree", "draft"])
def test_greedy_equals_plain(stories, prompts, name, opts):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt in prompts:
        plain, _ = run(stories.backend, NoDrafter(), prompt, params)
        spec, stats = run(stories.backend, make_drafter(name, stories, opts), prompt, params)
        assert spec == plain
        assert stats.steps + 1 == stats.target_forwards


@pytest.mark.extended  # statistics over many draws: run by .ci/run (make test-extended)
def test_sampling_first_tokens_match_plain(stories, prompts):
    """Joint law of tokens 2-3 (committed by speculative steps) over many seeds: a draft
    model vs plain sampling, two-sample chi-square on the pooled histogram."""
    drafter = make_drafter("draft", stories, {"model": "truncated:4"})
    assert same_first_tokens_law(stories.backend, drafter, prompts[1], seeds=150) > 1e-3
