"""The grammar a tool-calling chat request is decoded under (llguidance's Lark, ``constraints``).

Every call's JSON is ``{"name": <one of the tools>, <args key>: <that function's parameters>}``,
with whitespace as the model writes it (pretty-printed or compact), in one of the family's forms
(``tool_calls.ToolFormat``): tags, a ```` ```json ```` fence, bare JSON, a prefix token, a list.

- ``required`` / a named function: the answer is calls only, 1 to ``MAX_CALLS`` of them
  (one with ``parallel_tool_calls = false``), whitespace (a few characters) between them, and it may end after any
  complete call (trailing whitespace, then the end): the model's natural ``"\\n"`` then EOS.
- ``auto``: free text, or text then calls. A call starts where the text first holds one of the
  family's starts: its special token (``<tool_call>``, ``<|python_tag|>``, ``[TOOL_CALLS]``), or,
  for the JSON forms, ``{"name": "<a tool's name>"``, found by a lazy lexeme (it ends at the
  first occurrence, as llama.cpp's lazy grammars trigger on a pattern); from there the call is
  constrained by the tools' schemas, and only more calls may follow. One grammar, so the engine's
  matcher, its rollback and constrained speculation apply unchanged (exact for every drafter).
- ``auto`` with ``response_format``: calls, or an answer that follows the format's schema (the
  JSON forms of a call then need their fence, tag or prefix, so the two cannot be confused).
"""

from __future__ import annotations

import json
from typing import Any

from ..constraints.compile import JSON_OPTIONS
from .schemas import ApiError, ChatCompletionRequest, Tool
from .tool_calls import ToolFormat

MAX_CALLS = 16  # calls in one answer


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


def call_schema(tools: list[Tool], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools``."""
    alternatives = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
                     "properties": {"name": {"const": t.function.name},
                                    args_key: arguments_schema(t)}} for t in tools]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema of a call's arguments: the function's ``parameters``, always an object."""
    return {"type": "object"} | (tool.function.parameters or {})


def tool_grammar(fmt: ToolFormat, tools: list[Tool], forced: bool, parallel: bool, tokenizer: Any = None,
                 schema: Any = None) -> str:
    """The Lark grammar of a tool request's answers (module docstring). ``forced``: required or
    named; ``schema``: the ``response_format`` JSON schema an answer without calls follows
    (``True``: any JSON object)."""
    lenient = not all(t.function.strict for t in tools)  # OpenAI's strict: false: unenforceable keywords ignored
    # whitespace as the model writes it: the small models pretty-print their calls, and a call forced
    # compact drifts from the model's own text (it then wrote the call twice)
    # (a space, or a line break and its indentation: bounded, so a model cannot pad a call forever)
    layout = {"whitespace_flexible": True, "whitespace_pattern": "( ?|\n[ \t]{0,16})"}
    options = {"x-guidance": JSON_OPTIONS | layout | ({"lenient": True} if lenient else {})}
    most = MAX_CALLS if parallel else 1
    lines = [f"call: %json {json.dumps(call_schema(tools, fmt.args_key) | options)}",
             'GAP: /[ \\t\\n]{1,4}/', 'FENCE_END: /[ \\t\\n]{0,4}```/']
    forms = []  # every form of a call
    if fmt.tag:
        lines.append(f'tagged: {_tag(tokenizer, fmt.tag[0])} "\\n" call "\\n" {_tag(tokenizer, fmt.tag[1])}')
        forms.append("tagged")
    if fmt.array:
        body = '"[" call (", " call){0,%d} "]"' % (most - 1) if most > 1 else '"[" call "]"'
        lines += [f"listed_body: {body}", f"listed: {_tag(tokenizer, fmt.prefix) if fmt.prefix else ''} listed_body"]
        forms.append("listed")
    if fmt.json_forms:
        lines.append('fenced: "```json\\n" call "\\n```"')
        forms += ["fenced", "call"]
        if fmt.prefix and _token(tokenizer, fmt.prefix) is not None:
            lines.append(f"prefixed: {_tag(tokenizer, fmt.prefix)} call")
            forms.append("prefixed")
    lines.append("one_call: " + " | ".join(forms))
    more = "" if most == 1 or fmt.array else f" (GAP? one_call){{0,{most - 1}}}"
    if fmt.array:
        lines.append("rest: GAP?")
    else:
        lines.append(f"rest: {more} GAP?")
    if forced:
        lines.insert(0, "start: one_call rest")
        return "\n".join(lines) + "\n"
    if schema is not None:
        answer = {"type": "object"} if schema is True else schema
        lines.append(f"answer: %json {json.dumps(answer | options)}")
        lines.insert(0, "start: answer | (" + " | ".join(f for f in forms if f != "call") + ") rest")
        return "\n".join(lines) + "\n"
    starts = ["TEXT"]
    lines.append("TEXT: /(?s:.*)/")
    for special in _special_starts(fmt, tokenizer):
        starts.append(f"TEXT {special}")
    for i, t in enumerate(tools if fmt.json_forms else ()):
        name = t.function.name
        lines.append(f'pre_{i}[lazy]: /(?s:.*)\\{{[ \\t\\n]*"name"[ \\t\\n]*:[ \\t\\n]*"{name}"/')
        lines.append(f"args_{i}: %json {json.dumps(arguments_schema(t) | options)}")
        ws = "[ \\t\\n]{0,8}"  # the model's own layout around the arguments (a pretty-printed call)
        starts.append(f'pre_{i} /{ws},{ws}"{fmt.args_key}"{ws}:{ws}/ args_{i} /{ws}\\}}/ FENCE_END? rest')
    if fmt.tag and _token(tokenizer, fmt.tag[0]) is None:  # a tag that is text: found by a lazy lexeme too
        lines.append(f"pre_tag[lazy]: /(?s:.*){_regex_text(fmt.tag[0])}/")
        starts.append(f'pre_tag "\\n" call "\\n" {json.dumps(fmt.tag[1])} rest')
    if fmt.array and fmt.prefix and _token(tokenizer, fmt.prefix) is None:
        lines.append(f"pre_list[lazy]: /(?s:.*){_regex_text(fmt.prefix)}/")
        starts.append("pre_list listed_body rest")
    lines.insert(0, "start: " + " | ".join(starts))
    return "\n".join(lines) + "\n"


def _special_starts(fmt: ToolFormat, tokenizer: Any) -> list[str]:
    """The forms that open with a special token (after free text): ``<token> ... rest``."""
    out = []
    if fmt.tag and _token(tokenizer, fmt.tag[0]) is not None:
        out.append("tagged rest")
    if fmt.array and fmt.prefix and _token(tokenizer, fmt.prefix) is not None:
        out.append("listed rest")
    if fmt.json_forms and fmt.prefix and _token(tokenizer, fmt.prefix) is not None:
        out.append("prefixed rest")
    return out


def _token(tokenizer: Any, text: str) -> int | None:
    return None if tokenizer is None else tokenizer.added_tokens_encoder.get(text)


def _tag(tokenizer: Any, text: str) -> str:
    """``text`` in llguidance's Lark: the token naming it (``<[id]>``) when it is one added token, else a string."""
    token = _token(tokenizer, text)
    return json.dumps(text) if token is None else f"<[{token}]>"


def _regex_text(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/-#&~" else c for c in text)
