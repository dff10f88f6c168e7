"""Hostile grammars and other servers' fields through `verispec serve` (stories260K, both
endpoints): a grammar that allows nothing or asks past the grammar engine's limits is a 400
``invalid_grammar`` naming its field, one that reaches the limits mid-way ends cleanly
(finish "length", streamed or not, never an error event); llama.cpp's, vLLM's, TGI's and
SGLang's constraint fields are honoured or refused with a 400 naming the field, never ignored;
``stream_options`` needs ``stream``; every field error names its ``param``."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from serving import MODEL, TEMPLATE, assert_error, running_server, stories_native_model, with_chat_template

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ALTS = " | ".join(f'" w{i}x"' for i in range(3000))
MID_WAY = 'start: /[a-z ]{5,20}/ "." alt\nalt: ' + ALTS  # compiles; the step after "." is past the parser's limits
ROUTES = ["chat/completions", "completions"]


@pytest.fixture(scope="module")
def url():
    with running_server(with_chat_template(stories_native_model(), TEMPLATE), max_model_len=512) as s:
        yield s[0]


@pytest.fixture(scope="module")
def tool_url():
    """A server whose template renders tools in the Hermes format (calls can be served)."""
    from test_tool_calls import TOOL_TEMPLATE
    with running_server(with_chat_template(stories_native_model(), TOOL_TEMPLATE), max_model_len=512) as s:
        yield s[0]


def ask(url: str, route: str, body: dict, stream: bool = False) -> httpx.Response:
    where = {"messages": [{"role": "user", "content": "Once upon a time"}]} if route.startswith("chat") else {
        "prompt": "Once upon a time"}
    full = {"model": MODEL, "max_tokens": 60, "temperature": 0.8, "seed": 3} | where | body
    if stream:
        full |= {"stream": True}
    return httpx.post(f"{url}/v1/{route}", json=full, timeout=120)


def text_of(route: str, r: httpx.Response) -> tuple[str, str]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["message"]["content"] if route.startswith("chat") else choice["text"]), choice["finish_reason"]


def streamed(route: str, r: httpx.Response) -> tuple[str, str | None]:
    """Choice 0's text and finish_reason from an SSE answer (no error event in it)."""
    assert r.status_code == 200, r.text
    text, finish = [], None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for c in chunk.get("choices", []):
            if c["index"] == 0:
                text.append((c.get("delta") or {}).get("content") or c.get("text") or "")
                finish = c.get("finish_reason") or finish
    return "".join(text), finish


# ---- hostile grammars (issue 45, class 1) -----------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}, "response_format"),
    ({"response_format": {"type": "grammar", "grammar": "start: " + ALTS}}, "response_format"),
    ({"response_format": {"type": "regex", "regex": "^a{1000000}$"}}, "response_format"),
    ({"response_format": {"type": "regex", "regex": "[^\\x00-\\U0010FFFF]"}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}, "guided_json"),
    ({"guided_grammar": "start: a\na: a"}, "guided_grammar"),
])
def test_a_grammar_that_allows_nothing_is_a_400(url, route, body, param):
    err = assert_error(ask(url, route, body), 400, "invalid_grammar", param)
    assert "\n" not in err["message"]


def test_a_self_referencing_tool_is_a_400(tool_url):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    assert_error(ask(tool_url, "chat/completions", {"tools": [tool], "tool_choice": "required"}), 400, "invalid_grammar",
                 "tools")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("n", [2000, 4096])
def test_a_long_choice_list_is_answered(url, route, n):
    options = [f"option {i}" for i in range(n)]
    text, finish = text_of(route, ask(url, route, {"response_format": {"type": "choice", "choice": options}}))
    assert text in options and finish == "stop"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("extra", [{}, {"speculation": False}, {"temperature": 0}, {"n": 2}],
                         ids=["speculative", "plain", "greedy", "n2"])
def test_an_answer_past_the_limits_ends_cleanly(url, route, stream, extra):
    r = ask(url, route, {"response_format": {"type": "grammar", "grammar": MID_WAY}} | extra, stream)
    text, finish = streamed(route, r) if stream else text_of(route, r)
    assert finish == "length" and re.fullmatch(r"[a-z ]{5,20}\.", text), text


# ---- other servers' constraint fields (class 8) ------------------------------------------------------------
def _schema_ok(s: str) -> bool:
    jsonschema.validate(json.loads(s), SCHEMA)
    return True


HONOURED = [
    ({"grammar": 'root ::= "a" [b-d] [b-d] "!"'}, lambda s: re.fullmatch("a[b-d]{2}!", s)),
    ({"grammar": {"type": "regex", "value": "(cat|dog)s?"}}, lambda s: s in ("cat", "cats", "dog", "dogs")),
    ({"grammar": {"type": "json", "value": SCHEMA}}, _schema_ok),
    ({"json_schema": SCHEMA}, _schema_ok),
    ({"guided_json": SCHEMA}, _schema_ok),
    ({"guided_json": json.dumps(SCHEMA)}, _schema_ok),
    ({"guided_choice": ["red", "green", "blue"]}, lambda s: s in ("red", "green", "blue")),
    ({"guided_regex": "(yes|no), [0-9]{3}"}, lambda s: re.fullmatch("(yes|no), [0-9]{3}", s)),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda s: re.fullmatch("x[0-9]{2}", s)),
    ({"structured_outputs": {"json": SCHEMA}}, _schema_ok),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda s: s in ("up", "down")),
    ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda s: re.fullmatch("[0-9]{4}", s)),
    ({"structured_outputs": {"grammar": 'root ::= "q" [a-c]'}}, lambda s: re.fullmatch("q[a-c]", s)),
    ({"structured_outputs": {"json_object": True}}, lambda s: s.startswith('{"')),  # a long object: cut by length
    ({"regex": "[A-Z]{3}"}, lambda s: re.fullmatch("[A-Z]{3}", s)),
    ({"ebnf": 'root ::= "z" [0-9]'}, lambda s: re.fullmatch("z[0-9]", s)),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, _schema_ok),
    ({"response_format": {"type": "json_schema", "schema": SCHEMA}}, _schema_ok),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body,valid", HONOURED, ids=[next(iter(b)) + str(i) for i, (b, _) in enumerate(HONOURED)])
def test_other_servers_constraint_fields_are_honoured(url, route, body, valid):
    text, finish = text_of(route, ask(url, route, body | {"max_tokens": 120}))
    assert finish in ("stop", "length") and valid(text), text


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body,param", [
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
    ({"structured_outputs": {"whitespace_pattern": "x"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_choice": "red"}, "guided_choice"),
    ({"guided_json": 5}, "guided_json"),
    ({"grammar": 5}, "grammar"),
    ({"grammar": {"type": "yaml", "value": "x"}}, "grammar"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
    ({"grammar": 'root ::= "a"', "json_schema": SCHEMA}, "json_schema"),
    ({"response_format": {"type": "json_object", "schema": 7}}, "response_format"),
])
def test_other_servers_fields_we_do_not_honour_are_400s(url, route, body, param):
    err = assert_error(ask(url, route, body), 400, None, param)
    assert "\n" not in err["message"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body,param", [({"guided_regex": "(("}, "guided_regex"),
                                        ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
                                        ({"grammar": "root ::= nowhere"}, "grammar")])
def test_a_bad_constraint_in_another_servers_field_names_it(url, route, body, param):
    assert_error(ask(url, route, body), 400, "invalid_grammar", param)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body", [{"stream_options": {"include_usage": True}},
                                  {"stream_options": {"include_usage": False}, "stream": False},
                                  {"stream_options": {}}])
def test_stream_options_without_stream_is_a_400(url, route, body):
    assert_error(ask(url, route, body), 400, None, "stream_options")


# ---- every field error names its param (class 7) ----------------------------------------------------------
@pytest.mark.parametrize("route,raw,param", [
    ("chat/completions", '"prediction": {"type": "content", "content": "a\\ud800"}', "prediction.content"),
    ("chat/completions", '"prediction": {"type": "content", "content": [{"type": "text", "text": "\\udfff"}]}',
     "prediction.content.0.text"),
    ("completions", '"prediction": {"type": "content", "content": "\\ud83d"}', "prediction.content"),
    ("completions", '"suffix": "def f():\\ud800"', "suffix"),
    ("completions", '"stop": ["ok", "\\udc00"]', "stop.1"),
    ("chat/completions", '"user": "\\ud800"', "user"),
])
def test_a_lone_surrogate_names_its_param(url, route, raw, param):
    where = '"messages": [{"role": "user", "content": "hi"}]' if route.startswith("chat") else '"prompt": "hi"'
    body = '{"model": "%s", "max_tokens": 2, %s, %s}' % (MODEL, where, raw)
    r = httpx.post(f"{url}/v1/{route}", content=body, headers={"content-type": "application/json"}, timeout=60)
    err = assert_error(r, 400, None, param)
    assert "Unicode" in err["message"] and "Value error" not in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
])
def test_every_field_error_names_its_param(url, body, param):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL} | body, timeout=60)
    err = assert_error(r, 400, None, param)
    assert "Value error" not in err["message"]


@pytest.mark.parametrize("field", [{"guided_json": SCHEMA}, {"grammar": 'root ::= "a"'}, {"guided_choice": ["a"]}])
def test_another_servers_constraint_beside_a_forced_tool_call_is_a_400(tool_url, field):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = ask(tool_url, "chat/completions", {"tools": [tool], "tool_choice": "required"} | field)
    assert_error(r, 400, None, next(iter(field)))


@pytest.mark.parametrize("route", ROUTES)
def test_llama_cpps_empty_grammar_means_none(url, route):
    text, finish = text_of(route, ask(url, route, {"grammar": "", "max_tokens": 8}))
    assert text and finish in ("stop", "length")
