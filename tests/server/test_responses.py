"""The OpenAI Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) on stories260K
with a template that renders tools: every answer equals the chat completion of the same
conversation (greedy), for string and item inputs, instructions, tool-call items, chained
``previous_response_id`` turns; json_schema output valid; the stream's typed events in order,
numbered, their deltas adding up to the whole answer; usage; the store per API key and bounded;
``store: false``; one-line errors; and the unmodified ``openai`` client parsing all of it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import MODEL, assert_error, metrics, running_server, stories_native_model, wait_until, with_chat_template

from verispec.server.responses import Turn, response_usage, stream_response
from verispec.server.responses_schema import ResponsesRequest, chat_messages
from verispec.server.responses_store import ResponseStore, owner_of
from verispec.server.routing import routing_text

TOOL_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
                 "{{ m['content'] }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
                 "{% endfor %}\n{% endfor %}assistant:")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 10}}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
GREEDY = {"temperature": 0.0, "max_output_tokens": 24}


@pytest.fixture(scope="module")
def served():
    with running_server(with_chat_template(stories_native_model(), TOOL_TEMPLATE), max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def url(served):
    return served[0]


def respond(url: str, key: str = "key-a", **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/responses", json={"model": MODEL} | body, timeout=120,
                      headers={"authorization": f"Bearer {key}"})


def ok(url: str, **body) -> dict:
    r = respond(url, **body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, messages: list[dict], **body) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0.0, "max_tokens": 24} | body
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def events(r: httpx.Response) -> list[dict]:
    """The SSE events of a stream, each checked: its ``event:`` line names its data's type."""
    out = []
    for block in r.text.strip().split("\n\n"):
        if block.startswith(":"):  # an SSE comment (a keep-alive)
            continue
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[6:])
        assert event["type"] == kind[7:]
        out.append(event)
    return out


def test_string_input_is_the_chat_answer(url):
    r = ok(url, input="Once upon a time", **GREEDY)
    c = chat(url, [{"role": "user", "content": "Once upon a time"}])
    assert r["object"] == "response" and r["id"].startswith("resp_") and r["model"] == MODEL
    [item] = r["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["text"] == r["output_text"]
    assert r["output_text"] == c["choices"][0]["message"]["content"]
    length = c["choices"][0]["finish_reason"] == "length"
    assert r["status"] == ("incomplete" if length else "completed")
    assert r["incomplete_details"] == ({"reason": "max_output_tokens"} if length else None)
    u = r["usage"]
    assert (u["input_tokens"], u["output_tokens"]) == (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"])
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["output_tokens_details"] == {"reasoning_tokens": 0}
    assert u["input_tokens_details"]["cached_tokens"] == c["verispec"]["cached_tokens"]


def test_usage_counts_cached_tokens():
    """Cached prompt tokens: OpenAI's chat field when the chat usage has it, else the engine's
    statistics (the stories model's native backend has no prefix cache to test it end to end)."""
    chat_usage = {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}
    u = response_usage(chat_usage, {"cached_tokens": 32})
    assert u == {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 7,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 47}
    details = chat_usage | {"prompt_tokens_details": {"cached_tokens": 16}}
    assert response_usage(details, {"cached_tokens": 32})["input_tokens_details"]["cached_tokens"] == 16
    assert response_usage(chat_usage, None)["input_tokens_details"]["cached_tokens"] == 0


def test_items_and_instructions_are_the_chat_messages(url):
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tom had a "},
                                                              {"type": "input_text", "text": "red ball."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "He liked it.", "annotations": []}]},
             {"role": "developer", "content": "Be kind."},
             {"role": "user", "content": "What did Tom do?"}]
    r = ok(url, input=items, instructions="Tell a story.", **GREEDY)
    c = chat(url, [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Tom had a red ball."},
                   {"role": "assistant", "content": "He liked it."}, {"role": "developer", "content": "Be kind."},
                   {"role": "user", "content": "What did Tom do?"}])
    assert r["output_text"] == c["choices"][0]["message"]["content"] and r["instructions"] == "Tell a story."


def test_function_call_items_are_the_chat_tool_messages(url):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    r = ok(url, input=items, tools=[WEATHER], tool_choice="none", **GREEDY)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    c = chat(url, [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
             tools=[chat_tool], tool_choice="none")
    assert r["output_text"] == c["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_round_trip(url, stream):
    body = dict(input="Weather in Paris?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                temperature=0.0, max_output_tokens=200)
    if stream:
        r = respond(url, stream=True, **body)
        evs = events(r)
        deltas = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"]
        assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.output_item.added",
                                            *["response.function_call_arguments.delta"] * len(deltas),
                                            "response.function_call_arguments.done", "response.output_item.done",
                                            "response.completed"] and deltas
        first = evs[-1]["response"]
        assert "".join(deltas) == evs[-3]["arguments"] == evs[-2]["item"]["arguments"]
    else:
        first = ok(url, **body)
    [call] = first["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["call_id"]
    assert set(json.loads(call["arguments"])) == {"city"} and first["output_text"] == ""
    final = ok(url, previous_response_id=first["id"], tools=[WEATHER], tool_choice="none", **GREEDY,
               input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}])
    assert final["output"][0]["type"] == "message" and final["output_text"]


def test_json_schema_format(url):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    r = ok(url, input="Once upon a time", text={"format": fmt}, temperature=0.0, max_output_tokens=80,
           drafter="prompt-lookup")
    jsonschema.validate(json.loads(r["output_text"]), SCHEMA)
    assert r["text"]["format"] == fmt and r["status"] == "completed"
    # speculative (above) equals plain decoding: the chat extensions pass through
    plain = ok(url, input="Once upon a time", text={"format": fmt}, temperature=0.0, max_output_tokens=80,
               speculation=False)
    assert plain["output_text"] == r["output_text"]
    assert r["verispec"]["steps"] > 0 and plain["verispec"]["drafted"] == 0  # the engine's statistics, as chat's


def test_previous_response_id_chains_the_conversation(url):
    one = ok(url, input="Lily went to the park.", instructions="Tell a story.", **GREEDY)
    two = ok(url, input="She saw a dog.", previous_response_id=one["id"], **GREEDY)
    assert two["previous_response_id"] == one["id"]
    # the instructions are not carried over (OpenAI's rule)
    c = chat(url, [{"role": "user", "content": "Lily went to the park."},
                   {"role": "assistant", "content": one["output_text"]},
                   {"role": "user", "content": "She saw a dog."}])
    assert two["output_text"] == c["choices"][0]["message"]["content"]
    three = ok(url, input="The end.", previous_response_id=two["id"], **GREEDY)
    c = chat(url, [{"role": "user", "content": "Lily went to the park."},
                   {"role": "assistant", "content": one["output_text"]},
                   {"role": "user", "content": "She saw a dog."}, {"role": "assistant", "content": two["output_text"]},
                   {"role": "user", "content": "The end."}])
    assert three["output_text"] == c["choices"][0]["message"]["content"]


def test_stored_responses_belong_to_their_api_key(url):
    mine = ok(url, input="Once upon a time", **GREEDY)
    got = httpx.get(f"{url}/v1/responses/{mine['id']}", headers={"authorization": "Bearer key-a"})
    assert got.status_code == 200 and got.json() == mine
    for key in ("key-b", None):  # another key, and none, see nothing: not even that the id exists
        headers = {"authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(f"{url}/v1/responses", headers=headers, timeout=60,
                       json={"model": MODEL, "input": "Hi", "previous_response_id": mine["id"]})
        err = assert_error(r, 404, "previous_response_not_found", "previous_response_id")
        assert err["message"] == f"Previous response with id '{mine['id']}' not found."
        assert_error(httpx.get(f"{url}/v1/responses/{mine['id']}", headers=headers), 404)
        assert_error(httpx.delete(f"{url}/v1/responses/{mine['id']}", headers=headers), 404)
    r = httpx.delete(f"{url}/v1/responses/{mine['id']}", headers={"authorization": "Bearer key-a"})
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert_error(httpx.get(f"{url}/v1/responses/{mine['id']}", headers={"authorization": "Bearer key-a"}), 404)


def test_store_false_keeps_nothing(url):
    r = ok(url, input="Once upon a time", store=False, **GREEDY)
    assert r["store"] is False
    assert_error(respond(url, input="Hi", previous_response_id=r["id"]), 404, "previous_response_not_found")


def test_the_server_store_is_bounded(served):
    url, app = served[0], served[2].config.app
    kept, app.state.responses = app.state.responses, ResponseStore(max_responses=2)
    try:
        ids = [ok(url, input=f"Story {k}", temperature=0.0, max_output_tokens=4)["id"] for k in range(3)]
        assert_error(respond(url, input="Hi", previous_response_id=ids[0]), 404, "previous_response_not_found")
        assert ok(url, input="Hi", previous_response_id=ids[2], temperature=0.0, max_output_tokens=4)
        assert len(app.state.responses) == 2
        app.state.responses.check_integrity()
    finally:
        app.state.responses = kept


def test_store_bounds_count_bytes_and_owner():
    store = ResponseStore(max_responses=3, max_bytes=2000)
    a, b = owner_of("Bearer a"), owner_of("Bearer b")
    assert a != b and owner_of(None) == owner_of("Basic xyz") == "" and owner_of("bearer a") == a

    def put(rid: str, size: int = 10, owner: str = a) -> bool:
        kept = store.put(owner, {"id": rid}, [{"text": "x" * size}])
        store.check_integrity()
        return kept

    assert put("r1") and put("r2") and put("r3")
    assert store.get(a, "r1") and store.get(b, "r1") is None  # r1 is now the most recently used
    assert put("r4") and store.get(a, "r2") is None and len(store) == 3  # the least recently used went
    assert not put("big", 5000) and store.get(a, "big") is None  # alone over the byte bound: not kept
    assert put("r5", 1950)  # fits only when the older ones go
    assert store.nbytes <= 2000 and len(store) == 1 and store.get(a, "r5")
    assert not store.delete(b, "r5") and store.delete(a, "r5") and store.get(a, "r5") is None
    store.check_integrity()
    assert put("r1", owner=b) and put("r1") and store.get(b, "r1") is None and len(store) == 1  # same id: replaced


def test_stream_events_add_up_to_the_answer(url):
    whole = ok(url, input="Once upon a time", **GREEDY)
    r = respond(url, input="Once upon a time", stream=True, **GREEDY)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r)
    types = [e["type"] for e in evs]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    end = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    assert types[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", end]
    text = "".join(e["delta"] for e in deltas)
    assert text == whole["output_text"] == evs[-4]["text"] == evs[-2]["item"]["content"][0]["text"]
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    final = evs[-1]["response"]
    assert final["output_text"] == text and final["status"] == whole["status"]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert {e["item_id"] for e in deltas} == {evs[2]["item"]["id"]} == {final["output"][0]["id"]}
    got = httpx.get(f"{url}/v1/responses/{final['id']}", headers={"authorization": "Bearer key-a"}).json()
    assert got == final  # a streamed response is stored too


def test_engine_failure_ends_the_stream_with_response_failed(url):
    r = respond(url, input="a ] b", stream=True, drafter="explode", max_output_tokens=8)
    evs = events(r)
    assert evs[-1]["type"] == "response.failed" and evs[-1]["response"]["status"] == "failed"
    assert evs[-1]["response"]["error"]["message"]


def test_stream_disconnect_cancels_generation(url):
    key = 'verispec_requests_total{outcome="cancelled"}'
    before = metrics(url)[key]
    body = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert any("response.output_text.delta" in next(lines) for _ in range(40))
    wait_until(lambda: metrics(url)[key] == before + 1)  # the client went away: its job was cancelled
    assert metrics(url)["verispec_requests_running"] == 0


@pytest.mark.parametrize("body,status,param", [
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, None),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, None),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "max_tool_calls": 2}, 400, "max_tool_calls"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"input": "hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": "hi"}] * 1025}, 400, "input"),
    ({"input": "hi", "seed": "x"}, 400, "seed"),
    ({"input": "hi", "model": "gpt-5"}, 404, "model"),
    ({"input": "\ud800"}, 400, None),
])
def test_bad_requests_are_one_line_errors(url, body, status, param):
    r = httpx.post(f"{url}/v1/responses", content=json.dumps({"model": MODEL} | body), timeout=60,
                   headers={"content-type": "application/json"})
    err = assert_error(r, status)
    assert "\n" not in err["message"] and (param is None or err["param"] == param), err


class Person(BaseModel):
    name: Annotated[str, Field(max_length=16)]
    age: Annotated[int, Field(ge=0, le=120)]


def test_the_openai_client_reads_responses(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="key-c", max_retries=0)
    r = client.responses.create(model=MODEL, input="Once upon a time", temperature=0, max_output_tokens=24)
    assert r.output_text == ok(url, input="Once upon a time", **GREEDY)["output_text"]
    assert r.usage.input_tokens > 0 and r.usage.input_tokens_details.cached_tokens >= 0
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text
    events = list(client.responses.create(model=MODEL, input="Once upon a time", temperature=0, max_output_tokens=24,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    # the stream helper wants response.completed (a cut answer ends with response.incomplete, as OpenAI's)
    whole = ok(url, input="Once upon a time", temperature=0.0, max_output_tokens=40, stop=["."])
    assert whole["status"] == "completed"
    with client.responses.stream(model=MODEL, input="Once upon a time", temperature=0, max_output_tokens=40,
                                 extra_body={"stop": ["."]}) as s:
        assert s.get_final_response().output_text == whole["output_text"]
    parsed = client.responses.parse(model=MODEL, input="Once upon a time", text_format=Person, temperature=0,
                                    max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Person)
    call = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    assert call.output[0].type == "function_call" and call.output[0].name == "get_weather"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_streamed_tool_calls_in_pieces_become_call_events():
    """The chat stream as OpenAI sends tool calls (id and name first, then the arguments in
    pieces; text before them), read into a message item, then one function_call item per call."""
    def delta(**d) -> dict:
        return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}

    chunks = [delta(role="assistant", content=""), ": keep-alive\n\n", delta(content="Let me "), delta(content="check."),
              delta(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}]),
              delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city"'}}]),
              delta(tool_calls=[{"index": 0, "function": {"arguments": ': "Paris"}'}}]),
              delta(tool_calls=[{"index": 1, "id": "call_b", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 30, "total_tokens": 39},
               "verispec": {"cached_tokens": 0}}]

    async def chat_chunks():
        for c in chunks:
            yield c

    async def run() -> list[dict]:
        body = ResponsesRequest(model=MODEL, input="Weather in Paris and Rome?", tools=[WEATHER])
        store = ResponseStore()
        turn = Turn(SimpleNamespace(name=MODEL), body, [])
        text = "".join([e async for e in stream_response(turn, chat_chunks(), store, "")])
        assert store.get("", turn.id) is not None
        blocks = text.strip().split("\n\n")
        assert blocks.count(": keep-alive") == 1  # SSE comments pass through
        return [json.loads(block.split("\n")[1][6:]) for block in blocks if block != ": keep-alive"]

    evs = asyncio.run(run())
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = evs[-1]["response"]
    text, paris, rome = final["output"]
    assert text["content"][0]["text"] == final["output_text"] == "Let me check."
    assert (paris["call_id"], paris["name"], paris["arguments"]) == ("call_a", "get_weather", '{"city": "Paris"}')
    assert (rome["call_id"], rome["arguments"]) == ("call_b", '{"city": "Rome"}')
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert final["usage"]["output_tokens"] == 30 and final["status"] == "completed"


def test_items_become_chat_messages():
    """One turn's text and calls are one assistant message; outputs are tool messages; reasoning
    items are skipped; empty instructions add no system message."""
    items = [{"type": "message", "role": "user", "content": "Paris and Rome?"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "a", "output": "sunny"},
             {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"}]
    body = ResponsesRequest.model_validate({"model": MODEL, "input": items, "instructions": ""})
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert chat_messages("", body.input_items()) == [
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a"} | call | {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b"} | call | {"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c"} | call | {"function": {"name": "get_weather", "arguments": "{}"}}]}]
    assert chat_messages("Be brief.", body.input_items()[:1])[0] == {"role": "system", "content": "Be brief."}


def test_routing_text_of_a_conversation_sent_again_extends():
    """verispec serve --ray places a Responses request by its conversation's text (as a chat's):
    the next turn of a conversation sent whole extends the earlier turn's text."""
    turn = {"instructions": "Be brief.", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}
    nxt = {"instructions": "Be brief.", "input": turn["input"] + [
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "42"}]}
    first, second = (routing_text("/v1/responses", json.dumps(b).encode()) for b in (turn, nxt))
    assert first == "system\x1fBe brief.\x1euser\x1fHi\x1e" and second == first + "tool\x1f42\x1e"
    assert routing_text("/v1/responses", b'{"input": 5}') == routing_text("/v1/responses", b"[") == ""
