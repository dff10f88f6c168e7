"""Tool calls as each chat-template family writes them (server/tool_calls.py): the family detected
from the template, every form parsed into OpenAI's ``tool_calls`` (tags, fenced and bare JSON,
``<|python_tag|>``, ``[TOOL_CALLS]``), malformed calls left as text, a call cut by ``max_tokens``
leaving no markup, and the streaming parser releasing text at once and arguments in pieces."""

from __future__ import annotations

import json

import pytest

from verispec.server.tool_calls import (HERMES, LLAMA3, MISTRAL, ArgumentsDelta, CallEnd, CallStart, TextEvent,
                                        ToolCallStream, detect_format, parse_tool_calls)

NAMES = {"get_weather", "get_time"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def _calls(text, fmt=HERMES, **kw):
    content, calls = parse_tool_calls(text, fmt, NAMES, **kw)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_families_are_detected_from_the_template():
    assert detect_format("{% if tools %}{{ tools | tojson }}<tool_call>{% endif %}") is HERMES
    assert detect_format("{% if tools %}<|start_header_id|>ipython ... <|python_tag|>{% endif %}") is LLAMA3
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS] [TOOL_CALLS]{% endif %}") is MISTRAL
    for template in ("{{ messages }}", "<|im_start|>{{ m.content }}", "", None):
        assert detect_format(template) is None


@pytest.mark.parametrize("text,content", [
    ("Let me check.\n<tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>\n" + TIME + "\n</tool_call>",
     "Let me check."),
    ("```json\n" + WEATHER + "\n```\n```json\n" + TIME + "\n```", None),
    ("Sure!\n" + WEATHER + "\n" + TIME, "Sure!"),
    ("<tool_call>" + WEATHER + "</tool_call>\n```json\n" + TIME + "\n```\n", None),
])
def test_hermes_tags_fences_and_bare_json(text, content):
    assert _calls(text) == (content, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})])


def test_llama3_and_mistral_forms():
    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    for text in ("<|python_tag|>" + call, call, "```json\n" + call + "\n```"):
        assert _calls(text, LLAMA3) == (None, [("get_weather", {"city": "Rome"})])
    listed = "[" + WEATHER + ", " + TIME + "]"
    for text in ("[TOOL_CALLS]" + listed, listed):  # the special token is not in the decoded text
        assert _calls(text, MISTRAL) == (None, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})])


def test_arguments_as_a_json_string_and_braces_inside_strings():
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"}{\\"}"}\n</tool_call>'
    assert _calls(text) == (None, [("get_time", {"zone": "}{"})])


@pytest.mark.parametrize("text", [
    "plain answer", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
    'code: {"a": 1} and ```python\nx = {"name": 1}\n```', '{"name": "Bob", "arguments": {"age": 3}}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}} and more',
])
def test_malformed_or_unknown_calls_stay_text(text):
    assert parse_tool_calls(text, HERMES, NAMES) == (text, [])


def test_a_call_cut_by_max_tokens_leaves_no_markup():
    for cut in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "<tool_call>\n{\"na", "<tool_",
                '```json\n{"name": "get_weather", "arguments": {"ci', '{"name": "get_wea'):
        assert parse_tool_calls("I'll look. " + cut, HERMES, NAMES, cut=True) == ("I'll look.", [])
    done = "<tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>\n{\"name\": \"get_ti"
    assert _calls(done, cut=True) == (None, [("get_weather", {"city": "Paris"})])
    for closing in ("\n</tool", "\n", ""):  # the call's JSON is whole: it counts, its markup is not content
        assert _calls("<tool_call>\n" + WEATHER + closing, cut=True) == (None, [("get_weather", {"city": "Paris"})])
    assert parse_tool_calls("", HERMES) == (None, [])


def test_the_stream_releases_text_at_once_and_arguments_in_pieces():
    text = "Checking the weather now.\n<tool_call>\n" + WEATHER + "\n</tool_call>\n"
    stream, events = ToolCallStream(HERMES, NAMES), []
    for i in range(0, len(text), 4):
        got = stream.feed(text[i:i + 4])
        if i == 8:  # text that cannot start a call is not held
            assert got == [TextEvent(" the")]
        events += got
    events += stream.finish()
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == "Checking the weather now.\n"
    starts = [e for e in events if isinstance(e, CallStart)]
    pieces = [e.text for e in events if isinstance(e, ArgumentsDelta)]
    assert [s.name for s in starts] == ["get_weather"] and len(pieces) > 3
    assert json.loads("".join(pieces)) == {"city": "Paris"}
    assert isinstance(events[-1], CallEnd)
    assert [c["id"] for c in stream.calls()] == [starts[0].id]


def test_the_stream_holds_only_a_possible_call_start():
    stream = ToolCallStream(HERMES, NAMES)
    assert stream.feed("a <tool") == [TextEvent("a ")]
    assert stream.feed("kit>") == [TextEvent("<toolkit>")]
    assert stream.feed(' {"name": "x') == [TextEvent(" ")]
    assert "".join(e.text for e in stream.feed('y"')) == '{"name": "xy"'  # no tool of that name
