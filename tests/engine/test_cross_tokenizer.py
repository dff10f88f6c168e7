"""A draft model with another tokenizer drafting through text (``drafters/cross_tokenizer.py``):
stories260K (its llama2.c SentencePiece vocabulary, 512 tokens, byte fallback) and a tiny random
GGUF (byte-level BPE, 262 tokens) draft for each other. Greedy output is token-identical to plain
decoding whatever the draft says, over unicode that each vocabulary splits differently and a
random target emitting broken UTF-8; the text path with the target's own model accepts nearly
everything (the re-synchronised stream is the committed text); sampled output keeps the target's
law (a two-sample chi-square against plain sampling)."""

from __future__ import annotations

import pytest

from gguf_fixtures import write_tiny_gguf
from helpers import run, same_first_tokens_law
from verispec.api import load_draft_model, load_model
from verispec.drafters.base import NoDrafter
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.registry import make_drafter
from verispec.types import SamplingParams

TEXTS = ["Once upon a time, a cat", "Tom saw 日本語 und Müller’s café 🙂 — “naïve” ½."]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("xtok") / "tiny-byte-bpe.gguf"
    write_tiny_gguf(path, "llama")
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(str(tiny_path), backend="cpu")  # the compiled runtime: a draft step in microseconds


def through_text(draft, target) -> CrossTokenizerDrafter:
    return CrossTokenizerDrafter(draft.backend, draft.tokenizer, target.tokenizer, target.backend.info.bos_token_id)


def assert_greedy_equal(target, drafter, prompt: list[int], n: int, k: int = 4):
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    plain, _ = run(target.backend, NoDrafter(), prompt, params)
    spec, stats = run(target.backend, drafter, prompt, params, k=k)
    assert spec == plain
    assert stats.drafted > 0  # it did propose
    return stats


def test_another_vocabulary_is_routed_through_text_and_its_options_refused(stories_native, tiny_path):
    assert stories_native.tokenizer.get_vocab() != load_model(str(tiny_path)).tokenizer.get_vocab()
    drafter = make_drafter("draft", stories_native, {"model": str(tiny_path), "max_draft": "2"})
    assert isinstance(drafter, CrossTokenizerDrafter) and drafter.max_draft == 2
    with pytest.raises(ValueError, match="does not share the tokenizer of the target stories260k: it drafts "
                                         "through text, without vocab=N"):
        make_drafter("draft", stories_native, {"model": str(tiny_path), "vocab": "64"})


@pytest.mark.parametrize("text,n", zip(TEXTS, (120, 40)), ids=["ascii-long", "unicode"])
def test_greedy_equals_plain_with_a_draft_that_disagrees(stories_native, tiny, text, n):
    prompt = stories_native.tokenizer(text)["input_ids"]
    stats = assert_greedy_equal(stories_native, through_text(tiny, stories_native), prompt, n=n)
    assert stats.accepted < stats.drafted  # a random draft: most of it rejected


def test_greedy_equals_plain_on_a_target_emitting_broken_utf8(stories_native, tiny):
    """The random byte-level target emits bytes that are no UTF-8: its text is held back or
    re-decoded whole, and the proposal is still only ever verified."""
    prompt = tiny.tokenizer(TEXTS[1])["input_ids"]
    assert_greedy_equal(tiny, through_text(stories_native, tiny), prompt, n=40, k=3)


def test_a_prompt_longer_than_the_drafts_context_decodes_plainly(stories_native, tiny):
    """The tiny draft holds 128 tokens, one a byte here: it drafts nothing, and nothing fails."""
    prompt = stories_native.tokenizer(" ".join(TEXTS * 4))["input_ids"]
    assert len(tiny.tokenizer(" ".join(TEXTS * 4))["input_ids"]) > 128
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain, _ = run(stories_native.backend, NoDrafter(), prompt, params)
    spec, stats = run(stories_native.backend, through_text(tiny, stories_native), prompt, params)
    assert spec == plain and stats.drafted == 0


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "unicode"])
def test_the_text_path_with_the_targets_own_model_accepts_nearly_all(stories_native, text):
    prompt = stories_native.tokenizer(text)["input_ids"]
    stats = assert_greedy_equal(stories_native, through_text(stories_native, stories_native), prompt, n=48)
    assert stats.accepted >= 0.9 * stats.drafted


@pytest.mark.extended  # statistics over many draws: run by .ci/run (make test-extended)
def test_sampling_keeps_the_targets_law(stories_native):
    """Point-mass drafts (no q): accepted with p(x), else drawn from p without x; exact."""
    prompt = stories_native.tokenizer(TEXTS[0])["input_ids"]
    tok = stories_native.tokenizer
    drafter = CrossTokenizerDrafter(load_draft_model(stories_native, "truncated:2"), tok, tok,
                                    stories_native.backend.info.bos_token_id)
    assert same_first_tokens_law(stories_native.backend, drafter, prompt, seeds=100, k=2) > 1e-3
