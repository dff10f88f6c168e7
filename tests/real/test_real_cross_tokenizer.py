"""SmolLM2-135M (its own 49,152-token vocabulary) drafting for the Qwen2.5-Coder 1.5B through text
(``drafters/cross_tokenizer.py``): ``--drafter draft -o model=`` routes it there, and greedy output
equals plain decoding on code, with drafts accepted. Marked ``qwen`` (the Qwen parts are installed
for that group); its speed is in docs/history/benchmarks-2026-11.md."""

from __future__ import annotations

import pytest

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.registry import make_drafter
from verispec.types import SamplingParams

pytestmark = pytest.mark.qwen

PROMPTS = ["Write a Python function is_prime(n) with a docstring.",
           "Explain what a hash map is in two sentences, with a café ☕ example."]


def test_smollm2_drafts_for_qwen_through_text_and_greedy_equals_plain():
    target = load_model("qwen2.5-coder-1.5b-instruct")
    drafter = make_drafter("draft", target, {"model": "smollm2-135m-instruct"})
    assert isinstance(drafter, CrossTokenizerDrafter)
    plain, spec = SpecDecoder(target, "none"), SpecDecoder(target, drafter, num_draft_tokens=3)
    accepted = 0
    for text in PROMPTS:
        ids, params = encode_prompt(target, text), SamplingParams(max_new_tokens=48, ignore_eos=True)
        reqs = [dec.engine.add_request(ids, params) for dec in (plain, spec)]
        for dec, req in zip((plain, spec), reqs):
            while not req.finished:
                dec.engine.step(req)
        assert reqs[1].generated == reqs[0].generated
        accepted += reqs[1].stats.accepted
    assert accepted > 0
