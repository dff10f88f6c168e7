"""Issue 15 through `verispec serve` and the unmodified ``openai`` client (sync, async,
streaming): logprobs, n > 1, penalties / logit bias / min-p / stop token ids, echo, and
per-request speculation control (``extra_body``). The server runs stories260K on the native
runtime, which claims bit-exactness, so "equal" below means bitwise."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from helpers import forced_logits
from serving import MODEL, complete, running_server, stories_native_model, with_chat_template

PROMPT = "Tim had a red ball. Tim had a red ball. Tim had a"  # repetitive: prompt lookup accepts drafts
PLAIN = {"speculation": False}


@pytest.fixture(scope="module")
def stories():
    return with_chat_template(stories_native_model())


@pytest.fixture(scope="module")
def served(stories):
    assert stories.backend.caps.exactness.bit_exact
    with running_server(stories) as s:
        yield s[0], stories


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def _lp(choice) -> list[tuple]:
    lp = choice.logprobs
    return list(zip(lp.tokens, lp.token_logprobs, [sorted(d.items()) for d in lp.top_logprobs]))


def test_completion_logprobs_equal_plain_decoding(client) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    spec = client.completions.create(**kw)
    plain = client.completions.create(**kw, extra_body=PLAIN)
    assert spec.model_extra["verispec"]["accepted"] > 0 and plain.model_extra["verispec"]["drafted"] == 0
    assert spec.choices[0].text == plain.choices[0].text
    assert _lp(spec.choices[0]) == _lp(plain.choices[0])
    lp = spec.choices[0].logprobs
    assert len(lp.tokens) == spec.usage.completion_tokens and all(len(d) == 3 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in _lp(c.choices[0])]
    assert streamed == _lp(spec.choices[0])


def test_sampled_logprobs_are_the_targets_at_each_position(served) -> None:
    """Seeded sampling under speculation: every token's logprob (accepted, recovered, bonus)
    is bitwise the target's log-softmax at that position (teacher-forced plain decoding)."""
    url, model = served
    out = complete(url, prompt=PROMPT, max_tokens=20, temperature=1.0,
                   seed=4, logprobs=2, return_token_ids=True, ignore_eos=True)
    choice = out["choices"][0]
    ids = choice["token_ids"]
    logp = torch.log_softmax(forced_logits(model.backend, choice["prompt_token_ids"], ids).float(), -1)
    assert choice["logprobs"]["token_logprobs"] == [logp[i, t].item() for i, t in enumerate(ids)]
    assert out["verispec"]["drafted"] > 0


def test_chat_logprobs_and_streaming(client) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    spec = client.chat.completions.create(**kw)
    plain = client.chat.completions.create(**kw, extra_body=PLAIN)
    content = spec.choices[0].logprobs.content
    assert [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content] == \
        [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in plain.choices[0].logprobs.content]
    assert len(content) == spec.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)
    stream = list(client.chat.completions.create(**kw, stream=True))
    streamed = [c.logprob for ch in stream if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert streamed == [c.logprob for c in content]
    no_lp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert no_lp.choices[0].logprobs is None


def test_n_samples_are_seeded_streams_sharing_the_prefill(client) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=9)
    many = client.completions.create(**kw, n=3, extra_body={"return_token_ids": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    for j, c in enumerate(many.choices):  # sample j == the request seeded seed + j
        alone = client.completions.create(**(kw | {"seed": 9 + j}), extra_body={"return_token_ids": True})
        assert c.model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
    again = client.completions.create(**kw, n=3)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # reproducible
    stats = many.model_extra["verispec"]["choices"]
    assert [s["target_forwards"] - s["steps"] for s in stats] == [1, 0, 0]  # one prefill for all three
    assert many.usage.completion_tokens == sum(s["new_tokens"] for s in stats)

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "A cat"}], max_tokens=10, temperature=1.0, seed=3)
    two = client.chat.completions.create(**chat, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    stream = list(client.chat.completions.create(**chat, n=2, stream=True))
    texts = {0: "", 1: ""}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in two.choices]


def test_best_of_returns_the_most_likely_samples(client) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=21)
    three = client.completions.create(**kw, n=3, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in three.choices]
    best = client.completions.create(**kw, best_of=3)
    assert [c.text for c in best.choices] == [three.choices[scores.index(max(scores))].text]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == three.usage.completion_tokens
    two = client.completions.create(**kw, n=2, best_of=3, logprobs=1)
    order = sorted(range(3), key=lambda j: -scores[j])[:2]
    assert [c.text for c in two.choices] == [three.choices[j].text for j in order]
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].logprobs is not None


def test_penalties_under_speculation_equal_plain_decoding(client) -> None:
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    unpenalized = client.completions.create(**base, extra_body={"return_token_ids": True})
    banned = unpenalized.choices[0].model_extra["token_ids"][3]
    extra = {"repetition_penalty": 1.05, "min_p": 0.05, "return_token_ids": True}
    kw = base | dict(presence_penalty=0.2, frequency_penalty=0.1, logit_bias={str(banned): -100})
    spec = client.completions.create(**kw, extra_body=extra)
    plain = client.completions.create(**kw, extra_body=extra | PLAIN)
    ids = spec.choices[0].model_extra["token_ids"]
    assert ids == plain.choices[0].model_extra["token_ids"] and banned not in ids
    assert ids != unpenalized.choices[0].model_extra["token_ids"]
    assert spec.model_extra["verispec"]["drafted"] > 0
    stop = client.completions.create(**kw, extra_body=extra | {"stop_token_ids": [ids[5]]})
    assert stop.choices[0].finish_reason == "stop" and stop.choices[0].model_extra["token_ids"] == ids[:5]


def test_per_request_speculation_control(client) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    ref = client.completions.create(**kw)
    for extra in [PLAIN, {"drafter": "none"}, {"num_draft_tokens": 0}, {"num_draft_tokens": 1}]:
        out = client.completions.create(**kw, extra_body=extra)
        stats = out.model_extra["verispec"]
        assert out.choices[0].text == ref.choices[0].text, extra
        if extra.get("num_draft_tokens") == 1:
            assert 0 < stats["drafted"] <= stats["steps"]
        else:
            assert stats["drafted"] == 0, extra


def test_echo(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.choices[0].text == "Once upon a time" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_async_client_concurrent_mix(served, client) -> None:
    """logprobs, n = 2 and penalties concurrently through AsyncOpenAI equal the same requests sent alone."""
    bodies = [dict(prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2),
              dict(prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=1, n=2),
              dict(prompt="The dog", max_tokens=16, temperature=0, frequency_penalty=0.7,
                   extra_body={"repetition_penalty": 1.2}),
              dict(prompt="The sun", max_tokens=16, temperature=0, extra_body=PLAIN)]
    alone = [client.completions.create(model=MODEL, **b) for b in bodies]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(aclient.completions.create(model=MODEL, **b) for b in bodies))

    for a, t in zip(alone, asyncio.run(together())):
        assert [c.text for c in t.choices] == [c.text for c in a.choices]
        if a.choices[0].logprobs is not None:
            assert _lp(t.choices[0]) == _lp(a.choices[0])


BAD = [
    ({"n": 17}, "n"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"num_draft_tokens": 65}, "num_draft_tokens"),
    ({"num_draft_tokens": -1}, "num_draft_tokens"),
    ({"speculation": "no"}, "speculation"),
    ({"speculation": False, "num_draft_tokens": 2}, "num_draft_tokens"),
    ({"drafter": "nope"}, "drafter"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_parameters_get_400(served, body, param) -> None:
    r = httpx.post(f"{served[0]}/v1/completions", json={"model": MODEL, "prompt": "a"} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [({"top_logprobs": 2}, "top_logprobs"),
                                             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                             ({"n": 0}, "n")])
def test_bad_chat_parameters_get_400(served, body, param) -> None:
    r = httpx.post(f"{served[0]}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
