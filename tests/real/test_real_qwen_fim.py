"""Fill-in-the-middle and agent replays on the real Qwen2.5-Coder 0.5B (issue 34): the shipped FIM
items' prompts through ``/v1/completions`` with ``suffix`` are the model's own FIM prompts (the same
ids as the raw ``<|fim_prefix|>…`` text editors send), and speculative greedy output equals plain
decoding on a FIM item and on the turns of a replayed agent session."""

from __future__ import annotations

import httpx
import pytest
from serving import running_server

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.bench.datasets import AGENT, FIM, load_workload
from verispec.fim import fim_prompt
from verispec.types import SamplingParams

MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def qwen():
    return load_model(MODEL)


@pytest.mark.qwen
def test_fim_suffix_is_the_raw_fim_prompt_and_auto_equals_plain(qwen):
    prefix, suffix = load_workload(FIM, 1)[0].fim
    ids = fim_prompt(qwen.tokenizer, prefix, suffix)
    raw = encode_prompt(qwen, f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>", chat=False)
    assert ids == raw  # stdlib code holds no FIM marker: editors' raw prompts tokenize the same
    with running_server(qwen, MODEL, max_model_len=2048, drafters={}) as (url, _, _):
        outs = {}
        for drafter in ("none", "auto"):
            body = {"model": MODEL, "prompt": prefix, "suffix": suffix, "max_tokens": 32, "temperature": 0,
                    "drafter": drafter, "return_token_ids": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["prompt_token_ids"] == ids
            outs[drafter] = choice["token_ids"]
        assert outs["auto"] == outs["none"]


@pytest.mark.qwen
def test_agent_replay_turns_equal_plain_with_auto(qwen):
    session = load_workload(AGENT)[-1]  # mini-SWE-agent's session: the shortest history
    params = SamplingParams(max_new_tokens=24)
    plain, auto = SpecDecoder(qwen, "none"), SpecDecoder(qwen, "auto", num_draft_tokens=8)
    for at in session.replayed[:3]:
        history = list(session.messages[:at])
        want = plain.generate(history, params)
        got = auto.generate(history, params)
        assert got.token_ids == want.token_ids
    assert got.stats.cached_tokens > 0  # the history before the turn came from the prefix cache
