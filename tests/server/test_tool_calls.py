"""Tool calls through `verispec serve` (stories260K with a Hermes-style template that renders tools,
and one without tools): streamed answers send text as it is generated and calls as OpenAI does
(id and name first, then the arguments in pieces), a call cut by ``max_tokens`` leaves no markup,
token ids under speculation equal those of plain decoding for tool requests, and what cannot be
served is a one-line 400 naming its field (a template without a tool format, non-object
``parameters``, a response_format that cannot go with tools)."""

from __future__ import annotations

import json

import httpx
import pytest
from serving import MODEL, assert_error, running_server, stories_native_model, with_chat_template

TOOL_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
                 "{{ m['content'] }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
                 "{% endfor %}\n{% endfor %}assistant:")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 24}}}}}
MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def url():
    with running_server(with_chat_template(stories_native_model(), TOOL_TEMPLATE), max_model_len=512,
                        drafters=None) as (base, _, _):
        yield base


def chat(url, **kw):
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 60} | kw
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def stream(url, **kw):
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 60, "stream": True} | kw
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_streamed_calls_come_as_openai_sends_them(url):
    chunks = stream(url, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    deltas = [d for d in deltas if d]
    first = deltas[0][0]
    assert set(first) == {"index", "id", "type", "function"} and first["type"] == "function"
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("call_")
    pieces = [d[0] for d in deltas[1:]]
    assert len(pieces) > 1 and all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
                                   for p in pieces)
    args = first["function"]["arguments"] + "".join(p["function"]["arguments"] for p in pieces)
    whole = chat(url, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                 max_tokens=120).json()["choices"][0]
    assert json.loads(args) == json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])


def test_text_streams_before_the_end_with_tools_bound(url):
    chunks = stream(url, tools=[WEATHER], tool_choice="auto", max_tokens=40)
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert len([t for t in texts if t]) > 5  # piece by piece, not one chunk at the end
    whole = chat(url, tools=[WEATHER], tool_choice="auto", max_tokens=40).json()["choices"][0]
    assert "".join(t or "" for t in texts) == whole["message"]["content"]


@pytest.mark.parametrize("max_tokens", [2, 5, 9, 14])
def test_a_call_cut_by_max_tokens_leaves_no_markup(url, max_tokens):
    whole = chat(url, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens).json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    assert not whole["message"].get("tool_calls")
    chunks = stream(url, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens)
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("drafter", ["auto", "prompt-lookup"])
def test_speculation_gives_the_tokens_of_plain_decoding(url, choice, drafter):
    kw = {"tools": [WEATHER], "tool_choice": choice, "return_token_ids": True, "max_tokens": 48}
    plain = chat(url, speculation=False, **kw).json()["choices"][0]
    spec = chat(url, drafter=drafter, **kw).json()["choices"][0]
    assert spec["token_ids"] == plain["token_ids"] and spec["finish_reason"] == plain["finish_reason"]
    assert _shown(spec["message"]) == _shown(plain["message"])


def _shown(message):
    """A message without its calls' random ids."""
    return message["content"], [c["function"] for c in message.get("tool_calls") or []]


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {}}, {"type": "integer"},
                                        {"type": ["object", "null"]}])
def test_non_object_parameters_are_400(url, parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    err = assert_error(chat(url, tools=[tool]), 400)
    assert "tools.0.function.parameters" in err["param"] + err["message"] and "\n" not in err["message"]


def test_tools_with_a_response_format_that_cannot_combine_are_400(url):
    fmt = {"type": "regex", "regex": "[a-z]+"}
    assert_error(chat(url, tools=[WEATHER], response_format=fmt), 400, param="response_format")
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    r = chat(url, tools=[WEATHER], response_format=schema, max_tokens=80).json()["choices"][0]
    if not r["message"].get("tool_calls") and r["finish_reason"] == "stop":
        assert isinstance(json.loads(r["message"]["content"])["n"], int)


def test_a_template_without_a_tool_format_refuses_tools():
    with running_server(with_chat_template(stories_native_model()), max_model_len=256) as (base, _, _):
        err = assert_error(chat(base, tools=[WEATHER]), 400, param="tools")
        assert "no tool-call format" in err["message"] and "\n" not in err["message"]
        assert chat(base, tools=[WEATHER], tool_choice="none", max_tokens=4).status_code == 200
