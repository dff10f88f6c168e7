"""``--drafter auto`` (the default of generate, demo, serve and SpecDecoder): the best lossless
method measured for the target. Without a catalog draft model it is SuffixDecoding (serve:
prompt lookup); tests/real/test_real_qwen_auto.py checks the Qwen2.5-Coder pair's (the hybrid
of suffix and its 0.5B draft). A draft with another tokenizer is refused."""

from __future__ import annotations

import pytest

from verispec.api import SpecDecoder
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.registry import best_method, describe_method, make_drafter

TARGET = "qwen2.5-coder-1.5b-instruct"


def test_auto_without_a_draft_model_is_suffix(stories_native):
    assert best_method(stories_native) == ("suffix", {})
    assert best_method(stories_native, batched=True) == ("prompt-lookup", {})
    assert isinstance(make_drafter("auto", stories_native), SuffixDecodingDrafter)
    assert isinstance(SpecDecoder(stories_native).drafter, SuffixDecodingDrafter)  # the API's default
    assert describe_method("auto", stories_native) == "auto: suffix"
    assert describe_method("pld", stories_native) == "prompt-lookup"


def test_auto_passes_options_and_refuses_unknown_ones(stories_native):
    drafter = make_drafter("auto", stories_native, {"max_depth": 40})
    assert drafter.max_depth == 40
    with pytest.raises(ValueError, match="has no option"):
        make_drafter("auto", stories_native, {"bogus": 1})


def test_a_draft_with_another_tokenizer_refuses_what_needs_the_targets_naming_both(stories_native):
    """It drafts through text (drafters/cross_tokenizer.py), without an FR-Spec head of the target's tokens."""
    with pytest.raises(ValueError, match="draft model smollm2-135m-instruct does not share the tokenizer of the "
                                         "target stories260k: it drafts through text"):
        make_drafter("draft", stories_native, {"model": "smollm2-135m-instruct", "vocab": "4096"})
