"""Tool calls in the Qwen2.5 / Hermes syntax parsed into OpenAI's ``tool_calls`` (server/structured.py)
and the constraint a required call compiles to."""

from __future__ import annotations

import json

from verispec.server.schemas import Tool
from verispec.server.structured import parse_tool_calls, response_format_request, tool_call_request


def test_calls_and_the_content_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "CET"}
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


def test_text_without_a_well_formed_call_is_content():
    for text in ("plain answer", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("") == (None, [])


def test_one_call_or_several():
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
    one, many = tool_call_request([tool], parallel=False), tool_call_request([tool], parallel=True)
    assert one.kind == many.kind == "grammar" and one.param == "tools"
    assert "start: call\n" in one.spec and '("\\n" call)*' in many.spec
    assert response_format_request({"type": "text"}) is None
    assert response_format_request({"type": "json_schema", "json_schema": {"schema": {}, "strict": True}}).strict
