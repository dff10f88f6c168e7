"""Tool calls as each chat-template family writes them, parsed from the answer's text.

A family (``ToolFormat``, one small record each) is detected from the model's chat template
source, as llama.cpp's chat parsers and vLLM's tool parsers do (``detect_format``):

- ``hermes`` (Qwen2.5 / Qwen3, Hermes 2 Pro; the template mentions ``<tool_call>``):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, and the ``{"name",
  "arguments"}`` JSON the same models also write fenced (```` ```json ````) or bare.
- ``llama3`` (Llama 3.1-3.3; ``<|python_tag|>`` or the header tokens with tools):
  ``{"name": ..., "parameters": {...}}``, bare, fenced, or after ``<|python_tag|>``.
- ``mistral`` (``[TOOL_CALLS]``): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A template that defines none of them has no tool format: a request with tools is refused
(``None`` from ``detect_format``), never guessed. Special tokens (``<|python_tag|>``,
``[TOOL_CALLS]``) are not in the decoded text (the detokenizer skips them), so their forms also
parse without the marker.

Interface (the chat endpoint and the Responses API use the same):

- ``parse_tool_calls(text, fmt, names=None, cut=False) -> (content | None, [OpenAI tool calls])``:
  a whole answer. ``names``: the request's function names (a JSON call to another name stays
  text); ``cut``: the answer was cut by ``max_tokens`` (an unfinished call is dropped, never
  left as raw markup in the content).
- ``ToolCallStream(fmt, names)``: ``feed(text_delta)`` and ``finish(cut)`` return events in
  order: ``TextEvent(text)``, ``CallStart(index, id, name)``, ``ArgumentsDelta(index, text)``,
  and (``CallEnd(index)``) when a call's markup closes. Text is released as soon as it cannot
  be (a prefix of) a call start; a call's arguments stream as they are written. The calls that
  ended (``CallEnd``) are the answer's ``tool_calls``; ``calls()`` gives them in OpenAI's shape.

A call opens with the family's start (tag, fence, bracket or bare ``{``), then ``"name":
"<name>"``, then the arguments key; the arguments are any JSON value, delimited by a JSON
scanner; a string value is the arguments' JSON text as OpenAI sends it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import regex

NAME = r'"(?P<name>[A-Za-z0-9_.\-]{1,64})"'
_NAMED = regex.compile(r'"name"\s*:\s*"([^"]*)"')  # a call start's name, once complete
MAX_HELD = 512  # characters held while a call start is unresolved (a start is far shorter)


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call syntax. ``detect``: substrings of a chat template that name it;
    ``args_key``: the arguments' key; ``tag``: (open, close) tags around one call's JSON;
    ``prefix``: the text (often a special token) before the calls; ``array``: the calls are one
    JSON list after the prefix; ``json_forms``: bare and fenced JSON calls are this family's too."""

    name: str
    detect: tuple[str, ...]
    args_key: str
    tag: tuple[str, str] | None = None
    prefix: str | None = None
    array: bool = False
    json_forms: bool = True

    def opening(self) -> str:
        """The regex of a call's start up to its name and arguments key (groups: ``tag``,
        ``fence``, ``array``, ``name``)."""
        obj = r'\{\s*"name"\s*:\s*' + NAME + r'\s*,\s*"' + self.args_key + r'"\s*:\s*'
        forms = []
        if self.tag:
            forms.append(r"(?P<tag>" + regex.escape(self.tag[0]) + r")\s*" + obj)
        if self.array:
            prefix = "" if self.prefix is None else "(?:" + regex.escape(self.prefix) + ")?"
            forms.append(prefix + r"\s*(?P<array>\[)\s*" + obj)
        if self.json_forms:
            prefix = "" if self.prefix is None else "(?:" + regex.escape(self.prefix) + r")?\s*"
            forms.append(prefix + r"(?:(?P<fence>```)(?:json)?[ \t]*\n\s*)?" + obj)
        return "|".join(f"(?:{f})" for f in forms)


HERMES = ToolFormat("hermes", ("<tool_call>",), "arguments", tag=("<tool_call>", "</tool_call>"))
LLAMA3 = ToolFormat("llama3", ("<|python_tag|>", "<|start_header_id|>ipython"), "parameters", prefix="<|python_tag|>")
MISTRAL = ToolFormat("mistral", ("[TOOL_CALLS]",), "arguments", prefix="[TOOL_CALLS]", array=True, json_forms=False)
FORMATS = (HERMES, MISTRAL, LLAMA3)


def detect_format(template: str | None) -> ToolFormat | None:
    """The tool-call family a chat template defines (None: it renders no tool calls)."""
    if not template or "tools" not in template:
        return None
    return next((f for f in FORMATS if any(d in template for d in f.detect)), None)


@dataclass(frozen=True)
class TextEvent:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int


Event = TextEvent | CallStart | ArgumentsDelta | CallEnd


class _JsonValue:
    """Finds where one JSON value ends in text fed piece by piece (strings, escapes, nesting)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape = 0, False, False
        self.kind: str | None = None  # "container", "string" or "scalar" once the value starts
        self.done = False

    def feed(self, text: str) -> int:
        """Characters of ``text`` that belong to the value (all of it while it goes on)."""
        for i, ch in enumerate(text):
            if self.kind is None:
                if not ch.isspace():
                    self.kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
                    self.depth, self.in_string = int(ch in "{["), ch == '"'
                continue
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.kind == "string":
                        self.done = True
                        return i + 1
            elif self.kind == "scalar":
                if not (ch.isalnum() or ch in "+-."):
                    self.done = True
                    return i
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallStream:
    """Incremental parse of an answer into text and tool calls (module docstring)."""

    def __init__(self, fmt: ToolFormat, names: set[str] | None = None):
        self.fmt, self.names = fmt, names
        self._open = regex.compile(fmt.opening(), regex.DOTALL)
        self._next = regex.compile(r'\s*\{\s*"name"\s*:\s*' + NAME + r'\s*,\s*"' + fmt.args_key + r'"\s*:\s*')
        self.buf = ""  # text not yet released
        self.state = "text"  # text | args | close
        self.after_call = False  # whitespace after a call is held (dropped at the end)
        self.in_array = False  # between the calls of a JSON list of calls (mistral)
        self._calls: list[dict[str, Any]] = []
        self._args: list[str] = []  # the current call's arguments text
        self._value = _JsonValue()
        self._opened: dict[str, str | None] = {}  # the current call's start groups (tag, fence, array)
        self._raw: list[str] = []  # the current call's text as written (text again if its markup does not close)
        self.dropped = False  # finish(cut=True) dropped an unfinished call or call start

    def calls(self) -> list[dict[str, Any]]:
        """The complete calls so far, as OpenAI's ``tool_calls``."""
        return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self._calls if c["complete"]]

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        """The events left when the answer ends; ``cut``: it was cut by ``max_tokens`` (an
        unfinished call or call start is dropped, not left as text)."""
        out: list[Event] = []
        while self._step(out, final=not cut):
            pass
        if self.state == "close" and regex.match(r"\s*\}", self.buf) and regex.fullmatch(
                self._closer(), self.buf, partial=True):
            self._end_call(out, complete=True)  # the call's JSON closed; its closing markup was cut short
        elif self.state == "text" and self.buf and not cut:
            self._text(out, self.buf)
        else:
            self.dropped = self.dropped or bool(self.buf.strip()) or self.state != "text"
        self.buf, self.state = "", "text"
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what can be told from ``buf``; False when more text is needed."""
        if self.state == "args":
            return self._in_args(out)
        if self.state == "close":
            return self._in_close(out)
        if not self.buf:
            return False
        if self.in_array:  # mistral: after "," the next call's object
            m = self._next.match(self.buf, partial=True)
            if m is not None and m.partial:
                return False
            self.in_array = False
            if m is not None and self._known(m.group("name")):
                self._start_call(out, m)
                return True
        m = self._open.search(self.buf, partial=not final)
        if m is None:
            self._text(out, self.buf)
            self.buf = ""
            return False
        if m.start():
            self._text(out, self.buf[:m.start()])
            self.buf = self.buf[m.start():]
        if m.partial:
            named = _NAMED.search(self.buf)
            if len(self.buf) <= MAX_HELD and (named is None or self._known(named.group(1))):
                return False
            self._text(out, self.buf[:1])  # no call start is this long: release a character
            self.buf = self.buf[1:]
            return True
        if not self._known(m.group("name")):
            self._text(out, self.buf[:1])
            self.buf = self.buf[1:]
            return True
        self._opened = {k: m.group(k) for k in ("tag", "fence", "array") if k in m.groupdict()}
        self._start_call(out, m, end=m.end() - m.start())
        return True

    def _start_call(self, out: list[Event], m: Any, end: int | None = None) -> None:
        index = len(self._calls)
        self._calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": m.group("name"), "arguments": "",
                            "complete": False})
        out.append(CallStart(index, self._calls[-1]["id"], m.group("name")))
        end = m.end() if end is None else end
        self._raw, self.buf = [self.buf[:end]], self.buf[end:]
        self.state, self._value, self._args, self.after_call = "args", _JsonValue(), [], False

    def _in_args(self, out: list[Event]) -> bool:
        if not self.buf:
            return False
        n = self._value.feed(self.buf)
        piece, self.buf = self.buf[:n], self.buf[n:]
        self._raw.append(piece)
        if not self._args:
            piece = piece.lstrip()
        self._args.append(piece)
        if self._value.kind == "container" and piece:
            out.append(ArgumentsDelta(len(self._calls) - 1, piece))
        if not self._value.done:
            return False
        text = "".join(self._args)
        if self._value.kind == "string":
            try:
                text = json.loads(text)
            except ValueError:
                pass
        if self._value.kind != "container":
            out.append(ArgumentsDelta(len(self._calls) - 1, text))
        self._calls[-1]["arguments"] = text
        self.state = "close"
        return True

    def _closer(self) -> str:
        if self._opened.get("array"):
            return r"\s*\}\s*(?P<sep>[,\]])"
        if self._opened.get("tag") and self.fmt.tag:
            return r"\s*\}\s*" + regex.escape(self.fmt.tag[1])
        return r"\s*\}\s*```" if self._opened.get("fence") else r"\s*\}"

    def _in_close(self, out: list[Event]) -> bool:
        m = regex.match(self._closer(), self.buf, partial=True)
        if m is not None and m.partial:
            return False
        if m is None:  # the call's markup does not close as it opened: not a call, its text is text
            self.state = "text"
            self._text(out, "".join(self._raw))
            return True
        self.buf = self.buf[m.end():]
        self.in_array = m.groupdict().get("sep") == ","
        self._end_call(out, complete=True)
        return True

    def _end_call(self, out: list[Event], complete: bool) -> None:
        self._calls[-1]["complete"] = complete
        out.append(CallEnd(len(self._calls) - 1))
        self.state, self.after_call = "text", True

    def _text(self, out: list[Event], text: str) -> None:
        if self.after_call:  # whitespace between and after calls is not content
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        out.append(TextEvent(text))

    def _known(self, name: str) -> bool:
        return self.names is None or name in self.names


def parse_tool_calls(text: str, fmt: ToolFormat, names: set[str] | None = None,
                     cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls or None, OpenAI tool calls) of a whole answer (module docstring)."""
    stream = ToolCallStream(fmt, names)
    events = stream.feed(text) + stream.finish(cut)
    calls = stream.calls()
    content = "".join(e.text for e in events if isinstance(e, TextEvent))
    if calls:
        content = content.strip()
    elif stream.dropped:
        content = content.rstrip()
    return content or None, calls
