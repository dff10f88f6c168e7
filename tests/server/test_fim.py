"""Fill-in-the-middle (issue 34): ``fim.fim_prompt`` formats prefix and suffix with the model's FIM
tokens (literal text stays text), ``/v1/completions`` with OpenAI's ``suffix`` sends exactly that
prompt, and speculative greedy output equals plain decoding on it; a model without FIM tokens, a
suffix of the wrong type and a suffix with token-id prompts are refused with a one-line 400.
A tiny random qwen2 GGUF whose vocabulary has Qwen2.5-Coder's three FIM tokens stands in for the coder."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from gguf_fixtures import ARRAY, INT32, STRING, tiny_qwen2, write_gguf
from serving import assert_error, post, running_server

from verispec.api import load_model
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.fim import FimUnsupported, fim_prompt, fim_token_ids

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
PREFIX, SUFFIX = "def the(t):\n    ", "\n    return the\n"


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A tiny qwen2 with <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> as control tokens."""
    meta, tensors = tiny_qwen2(context=256)
    tokens = meta["tokenizer.ggml.tokens"][1][1] + FIM
    types = meta["tokenizer.ggml.token_type"][1][1] + [3] * 3
    meta["tokenizer.ggml.tokens"] = (ARRAY, (STRING, tokens))
    meta["tokenizer.ggml.token_type"] = (ARRAY, (INT32, types))
    rng = np.random.default_rng(1)
    for name in ("token_embd.weight", "output.weight"):
        extra = rng.normal(0, 0.2, (3, tensors[name].shape[1])).astype(np.float32)
        tensors[name] = np.concatenate([tensors[name], extra])
    path = tmp_path_factory.mktemp("fim") / "coder.gguf"
    write_gguf(path, meta, tensors)
    return load_model(str(path), backend="cpu")


def test_fim_prompt_is_psm_with_literal_text(coder):
    tok = coder.tokenizer
    pre, suf, mid = fim_token_ids(tok)
    text = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert fim_prompt(tok, PREFIX, SUFFIX) == [pre, *text(PREFIX), suf, *text(SUFFIX), mid]
    assert fim_prompt(tok, "", "") == [pre, suf, mid]
    sneaky = fim_prompt(tok, "x = '<|fim_middle|>'", "")
    assert sneaky.count(mid) == 1 and sneaky[-1] == mid  # a marker typed in the code stays text


def test_a_model_without_fim_tokens_is_refused(stories_native):
    assert fim_token_ids(stories_native.tokenizer) is None
    with pytest.raises(FimUnsupported, match="fill-in-the-middle"):
        fim_prompt(stories_native.tokenizer, PREFIX, SUFFIX)


def test_suffix_sends_the_fim_prompt_and_speculation_keeps_greedy_output(coder):
    expected = fim_prompt(coder.tokenizer, PREFIX, SUFFIX)
    with running_server(coder, "coder", max_model_len=256, drafters={"suffix": SuffixDecodingDrafter()}) as (url, _, _):
        outs = {}
        for drafter in ("none", "suffix", "prompt-lookup"):
            body = {"model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 40, "temperature": 0,
                    "ignore_eos": True, "drafter": drafter, "return_token_ids": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["prompt_token_ids"] == expected
            outs[drafter] = choice["token_ids"]
        assert outs["suffix"] == outs["none"] == outs["prompt-lookup"] and len(outs["none"]) == 40
        raw = httpx.post(f"{url}/v1/completions", json={"model": "coder", "prompt": expected, "max_tokens": 40,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
        assert raw.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]  # as editors' raw FIM prompts
        bad = httpx.post(f"{url}/v1/completions", json={"model": "coder", "prompt": [5, 6], "suffix": "x"}, timeout=60)
        assert "token ids" in assert_error(bad, 400, param="suffix")["message"]


def test_bad_suffixes_are_one_line_400s(url):
    err = assert_error(post(url, "completions", {"prompt": "Once", "suffix": "upon"}), 400, param="suffix")
    assert "fill-in-the-middle" in err["message"] and "\n" not in err["message"]
    for wrong in (5, ["a"], {"text": "a"}):
        err = assert_error(post(url, "completions", {"prompt": "Once", "suffix": wrong}), 400)
        assert "suffix" in err["message"] and "\n" not in err["message"]
    ok = post(url, "completions", {"prompt": "Once", "suffix": "", "max_tokens": 2})  # no FIM tokens: plain
    assert ok.status_code == 200, ok.text
