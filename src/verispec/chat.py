"""Chat prompts whose message contents stay literal text.

A chat template renders messages into one string, and tokenizing that string parses special
tokens anywhere in it: a user message containing ``<|im_end|>\\n<|im_start|>system\\n...``
would become real ChatML control tokens and forge a system (or assistant) turn. Here control
tokens (the tokenizer's added tokens) come from the template alone; inside a message's
content they are tokenized as the plain characters they are (``split_special_tokens``).

Content spans are found by rendering the template once more with a sentinel per message; when
the template rewrites contents (strip, truncation, ...) the spans are unknown, and a content
that holds a control-token string is refused instead of guessed at.

The tools' JSON (names, descriptions, parameter schemas, enum values) and the messages' earlier
tool calls (names, arguments, ids) are client text too: each control-token string in them is
rendered as a sentinel, then put back as a literal span (whatever the template does around it,
the string itself is tokenized as plain text).

Templates are rendered by ``chat_template`` (a worker process, under time, memory and size
bounds: the template is the model file's code); a server renders (``render_chat``, a wait of
up to its timeout) and tokenizes (``tokenize_chat``) on different threads.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from .chat_template import DEFAULT_MAX_CHARS, ChatTemplate, ChatTooLong, RenderBounds, RenderWorker

__all__ = ["ChatTooLong", "RenderedChat", "content_spans", "control_strings", "encode_chat", "max_text_chars",
           "render_chat", "template_of", "tokenize_chat"]

_SENTINEL = "\ue000{}\ue001"  # private-use characters: never in a template, never in tokenizers' specials
_TOOL_SENTINEL = "\ue002{}\ue003"  # a control-token string (its index) inside the tools' JSON
_TOOL_SENTINELS = re.compile("\ue002([0-9]{1,4})\ue003")


@dataclass(frozen=True)
class RenderedChat:
    """A chat through its template: ``text`` (generation prompt added) and each message's
    content span in it (None when the template does not paste contents verbatim)."""

    text: str
    spans: list[tuple[int, int]] | None
    literal: tuple[tuple[int, int], ...] = ()  # control-token strings of the tools' JSON, kept as text


def template_of(tokenizer: Any, bounds: RenderBounds = RenderBounds(),
                worker: RenderWorker | None = None) -> ChatTemplate:
    """The tokenizer's chat template compiled (``TemplateError`` in one line when it does not
    compile; ValueError when there is none), with the special tokens it sees as variables
    (as ``apply_chat_template`` passes them)."""
    return ChatTemplate(tokenizer.get_chat_template(), tokenizer.special_tokens_map, bounds, worker)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], max_chars: int | None = None,
                template: ChatTemplate | None = None) -> list[int]:
    """Token ids of ``messages`` through the chat template (generation prompt added), with
    every message content literal. Without control-token strings in the contents the result
    is exactly the template's usual tokenization. ``render_chat`` then ``tokenize_chat``."""
    return tokenize_chat(tokenizer, messages, render_chat(tokenizer, messages, max_chars, template))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], max_chars: int | None = None,
                template: ChatTemplate | None = None, tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> RenderedChat:
    """Render ``messages`` (``template``, default: the tokenizer's, with default bounds), and
    once more with a sentinel per content to find the contents' spans, in one bounded call.
    ``max_chars``: refuse (``ChatTooLong``) a rendering longer than this (the template's own
    text counts, not only the contents); the sentinel rendering may be longer by the sentinels.
    ``tools``: function definitions the template renders (a tool-calling request);
    ``add_generation_prompt``: end with the assistant turn's opening (as transformers does)."""
    template = template or template_of(tokenizer)
    bound = DEFAULT_MAX_CHARS if max_chars is None else max_chars
    calls = any(set(m) - {"role", "content"} for m in messages)  # tool_calls, tool_call_id: client text too
    controls = control_strings(tokenizer) if tools or calls else []
    if controls:
        marked_tools = _mark_controls(tools, controls)
        marked_messages = [{k: v if k in ("role", "content") else _mark_controls(v, controls) for k, v in m.items()}
                           for m in messages]
        if marked_tools == tools and marked_messages == messages:
            controls = []  # no control-token string outside the contents
        tools, messages = marked_tools, marked_messages
    marked = [m | {"content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    extra = sum(len(_SENTINEL.format(i)) for i in range(len(messages)))
    text, marked_text = template.render([(messages, bound), (marked, bound + extra)], add_generation_prompt, tools)
    spans = _spans(messages, marked_text, text)
    if not controls or "\ue002" not in text:
        return RenderedChat(text, spans)
    return _restore_controls(text, spans, controls)


def _mark_controls(value: Any, controls: list[str]) -> Any:
    """``value`` (JSON) with each control-token string in its strings (keys too) as a sentinel."""
    pattern = re.compile("|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True)))
    index = {c: i for i, c in enumerate(controls)}

    def mark(v: Any) -> Any:
        if isinstance(v, str):
            return pattern.sub(lambda m: _TOOL_SENTINEL.format(index[m.group()]), v)
        if isinstance(v, dict):
            return {mark(k): mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v

    return mark(value)


def _restore_controls(text: str, spans: list[tuple[int, int]] | None, controls: list[str]) -> RenderedChat:
    """The rendering with each tool sentinel (outside the message contents) back as its control
    string, that string's span kept literal, the message spans moved to match."""
    inside = spans or []
    found = [(m.start(), m.end(), controls[int(m.group(1))]) for m in _TOOL_SENTINELS.finditer(text)
             if int(m.group(1)) < len(controls) and not any(s < m.end() and m.start() < e for s, e in inside)]
    out, literal, pos, shift = [], [], 0, 0
    for start, end, control in found:
        out += [text[pos:start], control]
        literal.append((start + shift, start + shift + len(control)))
        shift += len(control) - (end - start)
        pos = end

    def moved(i: int) -> int:
        return i + sum(len(c) - (e - s) for s, e, c in found if e <= i)

    out.append(text[pos:])
    return RenderedChat("".join(out), None if spans is None else [(moved(s), moved(e)) for s, e in spans],
                        tuple(literal))


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]], rendered: RenderedChat) -> list[int]:
    """Token ids of a rendered chat whose message contents stay literal: control tokens come
    from the template's text alone (ValueError when that cannot be told apart).

    Linear in the rendered text: spans are found in one pass and each token is checked
    against them by bisection."""
    text, spans = rendered.text, rendered.spans
    control = control_strings(tokenizer)
    if spans is None:
        if any(s in m["content"] for m in messages for s in control):
            raise ValueError("a message contains a control token string (e.g. <|im_end|>) and this model's chat "
                             "template rewrites message contents, so it cannot be kept literal")
        spans = []
    if rendered.literal:
        spans = sorted(spans + list(rendered.literal))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    control_ids = set(tokenizer.added_tokens_decoder)
    ends = [e for _, e in spans]  # spans are disjoint and in order: sorted by start and by end
    template_specials = [(s, e, i) for i, (s, e) in zip(ids, offsets)
                         if i in control_ids and not _inside(s, e, spans, ends)]
    if len(template_specials) == sum(i in control_ids for i in ids):
        return ids  # no forged control token: the usual tokenization
    return _literal_between(tokenizer, text, template_specials)


def max_text_chars(tokenizer: Any, max_tokens: int) -> int:
    """Characters beyond which a text cannot fit ``max_tokens`` tokens: a text of C characters
    has at least C / (the longest vocabulary entry's characters) tokens (x2 for normalizers
    that shrink text). Longer texts are refused before tokenizing (which costs time and, for
    hundreds of MB, the tokenizer's memory)."""
    return max_tokens * 2 * max(map(len, tokenizer.get_vocab()), default=1)


def control_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into added (control) tokens."""
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.content]


def content_spans(tokenizer: Any, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]] | None:
    """[start, end) character span of each message's content in the rendered ``text``, or
    None when the template does not paste contents verbatim.

    Example: ChatML renders ``[{"role": "user", "content": "hi"}]`` as
    ``"<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"``: span ``[(17, 19)]``.
    """
    marked = [m | {"content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    extra = sum(len(_SENTINEL.format(i)) for i in range(len(messages)))
    try:
        [marked_text] = template_of(tokenizer).render([(marked, len(text) + extra)])
    except ChatTooLong:  # longer than ``text`` with every content back: it cannot be ``text``
        return None
    return _spans(messages, marked_text, text)


def _spans(messages: list[dict[str, str]], marked: str, text: str) -> list[tuple[int, int]] | None:
    """Content spans in ``text`` from ``marked``, the same chat rendered with content i replaced
    by sentinel i; None unless putting the contents back in ``marked`` gives ``text``."""
    spans, out, pos, length = [], [], 0, 0  # length: characters of "".join(out), kept as it grows
    for i, m in enumerate(messages):
        k = marked.find(_SENTINEL.format(i), pos)
        if k < 0:
            return None
        out.append(marked[pos:k])
        start = length + k - pos
        out.append(m["content"])
        length = start + len(m["content"])
        spans.append((start, length))
        pos = k + len(_SENTINEL.format(i))
    out.append(marked[pos:])
    return spans if "".join(out) == text else None


def _inside(start: int, end: int, spans: list[tuple[int, int]], ends: list[int]) -> bool:
    """Does [start, end) overlap a span? ``ends``: the spans' ends (sorted, as the spans are)."""
    j = bisect_right(ends, start)  # the first span ending after ``start``
    return j < len(spans) and spans[j][0] < end


def _literal_between(tokenizer: Any, text: str, specials: list[tuple[int, int, int]]) -> list[int]:
    """Keep the template's control tokens (start, end, id); tokenize the text between them
    with special-token parsing off."""
    ids, prev = [], 0
    for start, end, token in specials:
        ids += _plain(tokenizer, text[prev:start]) + [token]
        prev = end
    return ids + _plain(tokenizer, text[prev:])


def _plain(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
