"""Structured outputs and tool calls through `verispec serve` and the unmodified ``openai``
client (stories260K with a template that renders tools): ``chat.completions.parse`` with a
pydantic model, ``response_format`` json_object / json_schema / regex / grammar / choice, every
answer valid against its schema, speculative answers equal to plain ones, a tool-call round
trip (call, tool result, final answer) streamed and not, and bad schemas as one-line 400s."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import MODEL, running_server, stories_native_model, with_chat_template

TOOL_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
                 "{{ m['content'] }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
                 "{% endfor %}\n{% endfor %}assistant:")
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 10}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


class Person(BaseModel):
    name: Annotated[str, Field(max_length=16)]
    age: Annotated[int, Field(ge=0, le=120)]


@pytest.fixture(scope="module")
def served():
    with running_server(with_chat_template(stories_native_model(), TOOL_TEMPLATE), max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MESSAGES),
                                          temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 140),
                                          **kw)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Person, temperature=0,
                                      max_tokens=80)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_json_schema_speculative_equals_plain_and_streams(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    spec = ask(client, response_format=fmt, extra_body={"drafter": "prompt-lookup"}).choices[0].message.content
    plain = ask(client, response_format=fmt, extra_body={"speculation": False}).choices[0].message.content
    assert spec == plain
    jsonschema.validate(json.loads(spec), SCHEMA)
    chunks = ask(client, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == spec


@pytest.mark.parametrize("fmt,valid", [
    ({"type": "json_object"}, lambda s: isinstance(json.loads(s), dict)),
    ({"type": "regex", "regex": "(yes|no), [0-9]{3}"}, lambda s: s[:3] in ("yes", "no,") and s[-3:].isdigit()),
    ({"type": "choice", "choice": ["red", "green", "blue"]}, lambda s: s in ("red", "green", "blue")),
    ({"type": "grammar", "grammar": 'root ::= "a" [b-d] [b-d] "!"'}, lambda s: len(s) == 4 and s[0] == "a"),
])
def test_response_formats(client, fmt, valid):
    r = ask(client, response_format=fmt, max_tokens=200, temperature=0.8, seed=3)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert valid(text), text
    else:  # an open-ended JSON object may run to max_tokens; what came is still a JSON prefix
        assert fmt["type"] == "json_object" and text.startswith("{")


@pytest.mark.parametrize("fmt,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "regex", "regex": "(("}, "unclosed"),
    ({"type": "grammar", "grammar": "root ::= nowhere"}, "nowhere"),
    ({"type": "choice", "choice": []}, "list of"),
    ({"type": "yaml"}, "unknown response_format"),
])
def test_bad_formats_are_one_line_400s(client, fmt, needle):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, response_format=fmt)
    err = e.value.body
    assert needle in err["message"] and "\n" not in err["message"]
    assert err["param"] == "response_format"


def _round_trip(client, stream: bool):
    first = ask(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=stream)
    if stream:
        calls, finish = {}, None
        for c in first:
            if c.choices:
                for d in c.choices[0].delta.tool_calls or []:  # id and name first, then the arguments in pieces
                    if d.index not in calls:
                        calls[d.index] = d
                    else:
                        calls[d.index].function.arguments += d.function.arguments
                finish = c.choices[0].finish_reason or finish
        call = calls[0]
    else:
        finish, call = first.choices[0].finish_reason, first.choices[0].message.tool_calls[0]
    assert finish == "tool_calls" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = ask(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=12)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_round_trip(client, stream):
    _round_trip(client, stream)


def test_named_tool_and_one_call(client):
    r = ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


def test_bad_tool_requests_are_400(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        ask(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        ask(client, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="strin"):
        ask(client, tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}], tool_choice="required")


def test_every_sample_follows_the_format(client):
    r = ask(client, response_format={"type": "choice", "choice": ["red", "green", "blue"]}, n=3, temperature=1.0,
            seed=5)
    assert len(r.choices) == 3 and all(c.message.content in ("red", "green", "blue") for c in r.choices)


def test_completions_take_a_response_format_too(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                  extra_body={"response_format": {"type": "regex", "regex": "(cat|dog)s?"}})
    assert r.choices[0].text in ("cat", "cats", "dog", "dogs") and r.choices[0].finish_reason == "stop"
