"""The grammar of tool-calling answers (server/tool_grammar.py), walked token by token with the
engine's matcher on real tokenizers: a required or named answer may end after any complete call
(the model's "\\n" then EOS), ``parallel_tool_calls = false`` gives one call, calls are bounded;
auto answers are free text until a call starts (tag or ``{"name": "<tool>"``), then the call
follows the tool's schema; with ``response_format`` an answer without calls follows the schema."""

from __future__ import annotations

import pytest

from verispec.constraints import GrammarVocabulary, compile_constraint
from verispec.models.resolve import is_installed, resolve_model
from verispec.models.tokenizer import load_tokenizer
from verispec.server.schemas import Tool
from verispec.server.tool_calls import HERMES, LLAMA3, MISTRAL
from verispec.server.tool_grammar import MAX_CALLS, tool_grammar

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}})
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TAGGED = "<tool_call>\n" + CALL + "\n</tool_call>"


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def tok(request):
    if not is_installed(request.param):
        pytest.skip(f"{request.param} is not installed")
    tok = load_tokenizer(resolve_model(request.param))
    eos = (tok.eos_token_id,)
    tok.vocab_for_tests = GrammarVocabulary.of(tok, max(len(tok), max(tok.get_vocab().values()) + 1), eos)
    return tok


def walk(tok, grammar, text):
    """(tokens of ``text`` the grammar takes, whether EOS may follow them)."""
    m = compile_constraint("grammar", grammar, tok.vocab_for_tests).matcher()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = m.valid_prefix(ids)
    m.advance(ids[:n])
    return n == len(ids), bool(m.allowed()[tok.eos_token_id])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_may_end_after_any_call(tok, parallel):
    g = tool_grammar(HERMES, [WEATHER, TIME], True, parallel, tok)
    for form in (TAGGED, "```json\n" + CALL + "\n```", CALL):
        assert walk(tok, g, form) == (True, True)
        assert walk(tok, g, form + "\n") == (True, True)  # the model's newline, then the end
    assert walk(tok, g, "Sure") == (False, False) and walk(tok, g, "")[1] is False
    two = TAGGED + "\n" + TAGGED.replace("Paris", "Rome")
    assert walk(tok, g, two)[0] is parallel
    many = "\n".join([TAGGED] * MAX_CALLS)
    assert walk(tok, g, many)[0] is parallel and not walk(tok, g, many + "\n" + TAGGED)[0]
    assert not walk(tok, g, TAGGED.replace("city", "town"))[0]


def test_auto_is_text_until_a_call_starts(tok):
    g = tool_grammar(HERMES, [WEATHER, TIME], False, True, tok)
    for text in ("It is sunny in Paris.", 'A JSON example: {"name": "Bob", "age": 3}', "```python\nx = 1\n```"):
        assert walk(tok, g, text) == (True, True)
    for text in ("Let me check.\n" + TAGGED, "Checking:\n```json\n" + CALL + "\n```", "Sure " + CALL + "\n"):
        assert walk(tok, g, text) == (True, True)
    started = 'Sure {"name": "get_weather", "arguments": '
    assert walk(tok, g, started + '{"city": "Paris"}}')[0]
    assert not walk(tok, g, started + '{"town": "Paris"}}')[0]  # once started, the call follows the schema
    assert not walk(tok, g, "Let me check.\n" + TAGGED + "\nDone.")[0]  # only calls after a call


def test_auto_with_a_response_format(tok):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    g = tool_grammar(HERMES, [WEATHER], False, True, tok, schema)
    assert walk(tok, g, '{"answer": 42}') == (True, True)
    assert walk(tok, g, TAGGED) == (True, True) and walk(tok, g, "```json\n" + CALL + "\n```") == (True, True)
    assert not walk(tok, g, "It is 42")[0] and not walk(tok, g, '{"answer": "x"}')[0]


def test_other_families(tok):
    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert walk(tok, tool_grammar(LLAMA3, [WEATHER], True, True, tok), call) == (True, True)
    assert walk(tok, tool_grammar(LLAMA3, [WEATHER], False, True, tok), "Hi " + call) == (True, True)
    listed = "[TOOL_CALLS][" + CALL + ", " + CALL.replace("Paris", "Rome") + "]"
    assert walk(tok, tool_grammar(MISTRAL, [WEATHER], True, True, tok), listed) == (True, True)
    assert not walk(tok, tool_grammar(MISTRAL, [WEATHER], True, False, tok), listed)[0]
    assert walk(tok, tool_grammar(MISTRAL, [WEATHER], False, True, tok), "Hi " + listed) == (True, True)
