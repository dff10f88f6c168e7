"""Predicted Outputs through `verispec serve`, the unmodified ``openai`` client and
`verispec generate --prediction`: a prediction changes no output (greedy: the answer without
it, token for token), is counted in ``usage.completion_tokens_details`` as OpenAI does
(accepted + rejected = the prediction's tokens), streams too, and bad predictions are 400s."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import MODEL, TEMPLATE, assert_error, running_server, runner, stories_native_model, with_chat_template

from verispec.cli import app as cli_app

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
GREEDY = {"temperature": 0, "max_tokens": 48, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served():
    model = with_chat_template(stories_native_model(), TEMPLATE)
    with running_server(model, drafters=None, max_model_len=256) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def plain(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert r.usage.completion_tokens_details is None  # no prediction, no prediction counts
    return r.choices[0].message.content


def _tokens(served, text: str) -> int:
    return len(served[1].model.tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("how", ["right", "edited", "unrelated", "parts"])
def test_chat_prediction_changes_nothing_and_is_counted(served, client, plain, how):
    prediction = {"right": plain, "edited": plain[:40] + " and then a dragon came" + plain[40:],
                  "unrelated": "def add(a, b):\n    return a + b\n" * 3, "parts": None}[how]
    content = prediction if how != "parts" else [{"type": "text", "text": plain[:30]}, {"type": "text", "text": plain[30:]}]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, prediction={"type": "content", "content": content},
                                       **GREEDY)
    assert r.choices[0].message.content == plain
    details = r.usage.completion_tokens_details
    text = prediction if prediction is not None else plain
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == _tokens(served, text)
    if how in ("right", "parts"):
        assert details.accepted_prediction_tokens >= 0.8 * r.usage.completion_tokens
    if how == "unrelated":
        assert details.accepted_prediction_tokens <= 2


def test_streamed_chat_with_a_prediction(client, plain):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True},
                                            prediction={"type": "content", "content": plain}, **GREEDY)
    text, usage = [], None
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(text) == plain
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_completions_take_a_prediction_too(served, client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": base.choices[0].text}})
    assert r.choices[0].text == base.choices[0].text
    assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("prediction,needle", [
    ({"type": "text", "content": "x"}, "prediction"),
    ({"type": "content", "content": 5}, "prediction"),
    ({"type": "content"}, "prediction"),
    ("just text", "prediction"),
    ({"type": "content", "content": [{"type": "image", "text": "x"}]}, "prediction"),
    ({"type": "content", "content": "x" * 400_000}, "prediction has"),
])
def test_bad_predictions_are_400(served, prediction, needle):
    r = httpx.post(f"{served[0]}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "prediction": prediction})
    body = assert_error(r, 400)
    assert needle in json.dumps(body)


def test_lone_surrogate_in_a_prediction_is_400(served):
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
           '"prediction": {"type": "content", "content": "\\ud800"}}' % MODEL)
    r = httpx.post(f"{served[0]}/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert_error(r, 400)


def test_cli_prediction_changes_nothing(tmp_path):
    args = ["generate", "--model", "stories260k", "--no-chat", "-n", "40", "--json", "Once upon a time"]
    plain = json.loads(runner.invoke(cli_app, args).stdout)
    predicted = tmp_path / "prediction.txt"
    predicted.write_text(plain["text"], encoding="utf-8")
    r = runner.invoke(cli_app, [*args[:-1], "--prediction", str(predicted), args[-1]])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["token_ids"] == plain["token_ids"]
    assert out["stats"]["accepted_prediction_tokens"] > 0
    assert out["stats"]["steps"] < plain["stats"]["steps"]


def _usage_of(client, stream: bool, **kw):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, **kw,
                                       **({"stream_options": {"include_usage": True}} if stream else {}))
    if not stream:
        return r.usage, r.choices[0].message.content
    text, usage = [], None
    for chunk in r:
        text += [chunk.choices[0].delta.content or ""] if chunk.choices else []
        usage = chunk.usage or usage
    return usage, "".join(text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("at", [3, 12, 30, 60])
def test_a_stop_string_cuts_the_accepted_prediction_tokens(served, client, plain, at, stream):
    """OpenAI counts prediction tokens that appear in the completion: none past a stop string's cut."""
    stop = plain[at:at + 4]
    usage, text = _usage_of(client, stream, prediction={"type": "content", "content": plain}, stop=[stop], **GREEDY)
    assert text == plain[:plain.index(stop)]
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens <= usage.completion_tokens
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == _tokens(served, plain)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", ["max_tokens 1", "max_tokens 2", "empty", "speculation off", "no drafts",
                                  "draft limit 0"])
def test_a_prediction_is_always_counted(served, client, plain, case, stream):
    """``completion_tokens_details`` whenever a prediction came, drafted from or not."""
    kw = GREEDY | {"extra_body": dict(GREEDY["extra_body"])}
    prediction = "" if case == "empty" else plain
    if case.startswith("max_tokens"):
        kw["max_tokens"] = int(case[-1])
    else:
        kw["extra_body"] |= {"speculation off": {"speculation": False}, "no drafts": {"num_draft_tokens": 0},
                             "draft limit 0": {"num_draft_tokens": 0, "speculation": True}, "empty": {}}[case]
    usage, text = _usage_of(client, stream, prediction={"type": "content", "content": prediction}, **kw)
    assert plain.startswith(text)
    details = usage.completion_tokens_details
    assert details is not None
    assert details.accepted_prediction_tokens <= usage.completion_tokens
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == _tokens(served, prediction)
