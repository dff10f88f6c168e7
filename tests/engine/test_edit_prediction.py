"""Drafts that follow an edit (drafters/edit_align.py behind drafters/prediction.py): with the target's
tokenizer the prediction drafter aligns the text written so far with the prediction's text. Greedy
output equals plain decoding for predictions that differ from the answer as edits do (re-indented,
renamed, lines inserted, deleted, moved) and for unrelated ones, on SmolLM2-135M (code, BPE) and
stories260K (prose, SentencePiece); the alignment drafts through a dedent and a rename where token
ids lose their place at every line."""

from __future__ import annotations

import pytest

from verispec.api import encode_prediction, encode_prompt, load_model
from verispec.drafters.base import NoDrafter
from verispec.drafters.prediction import PredictionDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import Engine
from verispec.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=110, ignore_eos=True)


def generate(lm, drafter, prompt, prediction, k=16):
    engine = Engine(lm.backend, drafter, k)
    req = engine.add_request(prompt, GREEDY, prediction=prediction)
    while not req.finished:
        engine.step(req)
    engine.finish(req, req.finished)
    return req.generated, req.stats


def edited(text: str, word: str) -> dict[str, str]:
    """Predictions an editor might send for an answer ``text``: the answer as it was before an edit."""
    lines = text.split("\n")
    half = len(lines) // 2
    return {
        "same": text,
        "indented": "\n".join("    " + line if line else line for line in lines),  # the answer dedents
        "renamed": text.replace(word, word + "_old"),  # the answer renames word_old -> word
        "indented+renamed": "\n".join("    " + line.replace(word, "obj") if line else line for line in lines),
        # the answer indents further than the prediction (drafted at the indentation written), odd widths included
        "dedented": "\n".join(line[4:] if line.startswith("    ") else line[1:] for line in lines),
        "docstring": '    """Doc.\n\n            kept.\n    """\n' + text,  # a docstring's own offset, then the answer
        "inserted": "\n".join(lines[:2] + ["    x = compute(1, 2)", "    log(x)"] + lines[2:]),
        "deleted": "\n".join(lines[:1] + lines[3:]),
        "moved": "\n".join(lines[half:] + lines[:half]),
        "unrelated": "The quick brown fox jumps over the lazy dog.\n" * 5,
    }


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def code_case(smollm2):
    prompt = encode_prompt(smollm2, [{"role": "user", "content": "Write a Python class Stack with push, pop and "
                                                                 "peek methods."}])
    plain = generate(smollm2, NoDrafter(), prompt, ())[0]
    return prompt, plain, smollm2.tokenizer.decode(plain, skip_special_tokens=True)


def test_greedy_equals_plain_for_edited_predictions_smollm2(smollm2, code_case):
    prompt, plain, text = code_case
    assert "self" in text  # the edits below rename it
    for name, prediction in edited(text, "self").items():
        for inner in (NoDrafter(), PromptLookupDrafter()):
            drafter = PredictionDrafter(inner, tokenizer=smollm2.tokenizer)
            out, stats = generate(smollm2, drafter, prompt, encode_prediction(smollm2, prediction))
            assert out == plain, (name, type(inner).__name__)
            assert stats.accepted <= stats.drafted


def test_the_alignment_drafts_through_a_dedent_and_a_rename(smollm2, code_case):
    """The prediction is the answer indented by 4 with ``self`` named ``obj``: by token ids the
    drafts lose their place at every line; through the text most of the answer is drafted."""
    prompt, plain, text = code_case
    prediction = encode_prediction(smollm2, edited(text, "self")["indented+renamed"])
    _, by_ids = generate(smollm2, PredictionDrafter(NoDrafter()), prompt, prediction)
    drafter = PredictionDrafter(NoDrafter(), tokenizer=smollm2.tokenizer)
    engine = Engine(smollm2.backend, drafter, 16)
    req = engine.add_request(prompt, GREEDY, prediction=prediction)
    while not req.finished:
        engine.step(req)
    engine.finish(req, req.finished)
    assert req.generated == plain
    assert req.stats.accepted >= 2 * by_ids.accepted and req.stats.accepted >= len(plain) // 2
    accepted, rejected = drafter.prediction_usage(req.request_id)
    assert 0 < accepted <= len(prediction) and accepted + rejected == len(prediction)


def test_greedy_equals_plain_for_edited_predictions_stories(stories_native):
    tok = stories_native.tokenizer
    prompt = tok("Once upon a time, there was a little girl")["input_ids"]
    plain = generate(stories_native, NoDrafter(), prompt, ())[0]
    text = tok.decode(plain)
    word = max(set(text.split()), key=lambda w: (text.count(w) * (len(w) > 2), w))
    for name, prediction in edited(text, word).items():
        drafter = PredictionDrafter(PromptLookupDrafter(), tokenizer=tok)
        out, stats = generate(stories_native, drafter, prompt, encode_prediction(stories_native, prediction), k=8)
        assert out == plain, name
        assert stats.accepted <= stats.drafted


def test_without_a_prediction_the_prompts_code_block_is_followed(smollm2, code_case):
    """``prompt_code``: the prompt's last code block is aligned once an answer line matches one of its
    lines; it drafts the dedented, renamed continuation; greedy output stays plain decoding's."""
    from verispec.drafters.base import DraftContext
    from verispec.sampling import make_generator

    tok = smollm2.tokenizer
    block = "```python\nclass A:\n    def f(self):\n        y = self.x + 1\n        return y * self.z\n```\n"
    prompt = tok("Make f a function taking obj:\n" + block, add_special_tokens=False)["input_ids"]
    answer = tok("```python\ndef f(obj):\n", add_special_tokens=False)["input_ids"]
    d = PredictionDrafter(NoDrafter(), tokenizer=tok, prompt_code=True)
    d.start("r", prompt)
    ctx = DraftContext("r", prompt + answer, 16, GREEDY, make_generator(0, 1))
    assert tok.decode(list(d.propose(ctx).tokens[1:])).startswith("    y = obj.x + 1\n    return y * obj.z")
    assert PredictionDrafter(NoDrafter(), tokenizer=tok).propose(ctx).num_drafted == 0  # off: the inner drafter's
    d.start("s", prompt)  # nothing aligned yet: the answer's first line drafts nothing
    assert d.propose(DraftContext("s", prompt + answer[:4], 16, GREEDY, make_generator(0, 1))).num_drafted == 0

    prompt, plain, text = code_case  # the plain answer as a re-indented, renamed code block of the prompt
    code = edited(text.split("```python\n")[-1].split("```")[0], "self")["indented+renamed"]
    messages = [{"role": "user", "content": f"Rewrite this class:\n```python\n{code}```\n"}]
    prompt = encode_prompt(smollm2, messages)
    plain = generate(smollm2, NoDrafter(), prompt, ())[0]
    out, stats = generate(smollm2, PredictionDrafter(PromptLookupDrafter(), tokenizer=tok, prompt_code=True),
                          prompt, ())
    assert out == plain
