"""Structured outputs and tool calls of the OpenAI chat API, as constraints and parsed answers.

- ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``, and as extensions ``{"type": "regex", "regex": ...}``,
  ``{"type": "grammar", "grammar": <Lark or GBNF>}``, ``{"type": "choice", "choice": [...]}``.
- ``tools`` are rendered by the model's chat template; the answer's tool calls, in the model's
  syntax (Qwen2.5 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``),
  become ``message.tool_calls``. ``tool_choice``: ``none`` (tools not rendered, nothing parsed),
  ``auto`` (the model decides; calls are parsed), ``required`` or a named function (the answer
  is constrained to that syntax, the arguments to the function's ``parameters`` schema);
  ``parallel_tool_calls = false`` allows one call.

What fails to compile is a 400 with the grammar engine's message in one line (``GrammarError``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..constraints import Constraint, GrammarError, GrammarVocabulary, compile_constraint
from ..constraints.compile import JSON_OPTIONS
from .schemas import ApiError, ChatCompletionRequest, Tool
from .state import ServerState

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ConstraintRequest:
    """What a request asks the output to follow, before compiling: kind, spec, strict, and the
    request field named in a 400."""

    kind: str
    spec: Any
    strict: bool
    param: str


def response_format_request(response_format: dict[str, Any] | None) -> ConstraintRequest | None:
    """The constraint ``response_format`` names (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintRequest("json_object", None, True, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                           "response_format")
        return ConstraintRequest("json_schema", spec["schema"], spec.get("strict") is True, "response_format")
    if kind in ("regex", "grammar", "choice"):
        if kind not in response_format:
            raise ApiError(400, f"response_format of type {kind} needs a {kind!r} field", "response_format")
        return ConstraintRequest(kind, response_format[kind], True, "response_format")
    raise ApiError(400, f"unknown response_format type {kind!r}: use text, json_object, json_schema, regex, grammar "
                   "or choice", "response_format")


def forced_tools(body: ChatCompletionRequest) -> list[Tool] | None:
    """The functions a call must be made to (``required``: any; named: that one), or None when
    the model may answer in text."""
    choice, tools = body.tool_choice, body.tools or []
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        return tools
    name = choice.function.name
    named = [t for t in tools if t.function.name == name]
    if not named:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return named


def tool_call_request(tools: list[Tool], parallel: bool, tokenizer: Any = None) -> ConstraintRequest:
    """A constraint for answers made of tool calls in the Qwen2.5 / Hermes syntax: the call's
    JSON is ``{"name": <one of tools>, "arguments": <that function's parameters>}``. Where the
    tokenizer has ``<tool_call>`` as one token (Qwen2.5), the grammar names that token."""
    options = {"x-guidance": JSON_OPTIONS}
    alternatives = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                     "properties": {"name": {"const": t.function.name},
                                    "arguments": t.function.parameters or {"type": "object"}}} for t in tools]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    call = (f'call: {_tag(tokenizer, "<tool_call>")} "\\n" %json {json.dumps(schema | options)} "\\n" '
            f'{_tag(tokenizer, "</tool_call>")}')
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return ConstraintRequest("grammar", f"{start}\n{call}\n", True, "tools")


def _tag(tokenizer: Any, text: str) -> str:
    """``text`` in llguidance's Lark: the token naming it (``<[id]>``) when it is one added token, else a string."""
    if tokenizer is not None:
        token = tokenizer.added_tokens_encoder.get(text)
        if token is not None:
            return f"<[{token}]>"
    return json.dumps(text)


def compile_request(state: ServerState, req: ConstraintRequest) -> Constraint:
    """Compile against the served model (on the tokenizer thread: a large schema takes a while);
    a 400 naming the field in one line when the engine refuses it."""
    info = state.model.backend.info
    try:
        vocab = GrammarVocabulary.of(state.model.tokenizer, info.vocab_size, info.eos_token_ids)
        return compile_constraint(req.kind, req.spec, vocab, req.strict)  # type: ignore[arg-type]
    except GrammarError as e:
        raise ApiError(400, str(e), req.param, "invalid_grammar") from None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls or None, OpenAI tool calls) of an answer. A block whose JSON
    is not ``{"name": str, "arguments": ...}`` stays in the content."""
    calls, kept, pos = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            continue
        args = call["arguments"] if isinstance(call["arguments"], str) else json.dumps(call["arguments"])
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": args}})
        kept.append(text[pos:m.start()])
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls
