"""Structured outputs and tool calls on the real Qwen2.5-Coder pair: a JSON-schema answer with
the default method (hybrid of suffix and the 0.5B draft, plus forced tokens) equals constrained
plain decoding token for token and is valid against the schema; through `verispec serve` and the
unmodified ``openai`` client, ``parse`` with a pydantic model and a tool-call round trip (call,
tool result, final answer), streamed and not, with the model's own chat template."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from serving import running_server

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.types import SamplingParams

TARGET = "qwen2.5-coder-1.5b-instruct"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["language", "function_name", "arguments"],
          "properties": {"language": {"enum": ["python", "rust", "go"]},
                         "function_name": {"type": "string", "maxLength": 30},
                         "arguments": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 30}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Function(BaseModel):
    language: Literal["python", "rust", "go"]
    function_name: str
    arguments: list[str]


@pytest.fixture(scope="module")
def qwen():
    return load_model(TARGET)


@pytest.mark.qwen
def test_schema_answer_equals_constrained_plain(qwen):
    prompt = encode_prompt(qwen, "Describe the Python function is_prime(n) as JSON with keys language, "
                                 "function_name and arguments.")
    params = SamplingParams(max_new_tokens=60)
    plain = SpecDecoder(qwen, "none").engine
    auto = SpecDecoder(qwen, "auto", num_draft_tokens=8)
    params = auto.constrained(params, json_schema=SCHEMA)
    ref = plain.add_request(prompt, params, draft_limit=0)
    while not ref.finished:
        plain.step(ref)
    req = auto.engine.add_request(prompt, params)
    while not req.finished:
        auto.engine.step(req)
    assert req.generated == ref.generated and req.finished == "eos"
    jsonschema.validate(json.loads(qwen.tokenizer.decode(req.generated)), SCHEMA)
    assert req.stats.target_forwards < ref.stats.target_forwards


@pytest.mark.qwen
def test_parse_and_a_tool_call_round_trip_through_the_openai_client(qwen):
    with running_server(qwen, TARGET, max_batch=2, max_model_len=1024) as (url, _, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.parse(model=TARGET, temperature=0, max_tokens=80, response_format=Function,
                                          messages=[{"role": "user", "content": "Describe the Python function "
                                                     "is_prime(n) as JSON."}])
        assert isinstance(r.choices[0].message.parsed, Function)
        for stream in (False, True):
            first = client.chat.completions.create(model=TARGET, messages=ASK, tools=[WEATHER], temperature=0,
                                                   tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                                   stream=stream)
            if stream:
                calls = _accumulated(first)
            else:
                assert first.choices[0].finish_reason == "tool_calls"
                calls = first.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "get_weather"
            args = json.loads(calls[0].function.arguments)
            assert "paris" in args["city"].lower()
            history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": calls[0].function.arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 degrees Celsius"}]
            final = client.chat.completions.create(model=TARGET, messages=history, tools=[WEATHER], temperature=0,
                                                   tool_choice="none", max_tokens=40)
            answer = final.choices[0].message
            assert not answer.tool_calls and "21" in answer.content


def _accumulated(chunks):
    """Streamed tool calls put together as OpenAI's clients do: id and name first, then the arguments in pieces."""
    calls = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if d.index in calls:
                calls[d.index].function.arguments += d.function.arguments
            else:
                calls[d.index] = d
    return [calls[i] for i in sorted(calls)]


@pytest.mark.qwen
def test_tool_calls_in_auto_and_required_mode_stop_after_the_call_and_match_plain_decoding(qwen):
    """Auto: Qwen2.5-Coder writes its call as fenced JSON, parsed into tool_calls; required (parallel calls
    allowed): the answer ends after the call; streamed, text arrives piece by piece; the token ids under
    speculation (auto drafter, prompt lookup) equal those of plain decoding."""
    with running_server(qwen, TARGET, max_batch=2, max_model_len=1024,
                        drafters={"prompt-lookup": PromptLookupDrafter()}) as (url, _, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def ask(messages=ASK, **kw):
            return client.chat.completions.create(model=TARGET, messages=messages, tools=[WEATHER], temperature=0,
                                                  max_tokens=kw.pop("max_tokens", 40), **kw)

        tokens = {}
        for extra in ({"speculation": False}, {}, {"drafter": "prompt-lookup"}):  # {}: the default (hybrid)
            r = ask(tool_choice="auto", extra_body=extra | {"return_token_ids": True}).choices[0]
            assert r.finish_reason == "tool_calls" and r.message.content is None
            assert [c.function.name for c in r.message.tool_calls] == ["get_weather"]
            assert json.loads(r.message.tool_calls[0].function.arguments) == {"city": "Paris"}
            tokens[json.dumps(extra)] = r.model_extra["token_ids"]
        assert len({json.dumps(t) for t in tokens.values()}) == 1, tokens
        required = ask(tool_choice="required").choices[0]
        assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
        calls = _accumulated(ask(tool_choice="required", stream=True))
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]
        text = [c.choices[0].delta.content for c in ask([{"role": "user", "content": "Say hello in French."}],
                                                        tool_choice="auto", max_tokens=16, stream=True)
                if c.choices and c.choices[0].delta.content]
        assert len(text) > 2
