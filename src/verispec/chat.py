"""Chat prompts whose message contents stay literal text.

A chat template renders messages into one string, and tokenizing that string parses special
tokens anywhere in it: a user message containing ``<|im_end|>\\n<|im_start|>system\\n...``
would become real ChatML control tokens and forge a system (or assistant) turn. Here control
tokens (the tokenizer's added tokens) come from the template alone; inside a message's
content they are tokenized as the plain characters they are (``split_special_tokens``).

Content spans are found by rendering the template once with a sentinel per message; when the
template rewrites contents (strip, truncation, ...) the spans are unknown, and a content that
holds a control-token string is refused instead of guessed at.
"""

from __future__ import annotations

from typing import Any

_SENTINEL = "\ue000{}\ue001"  # private-use characters: never in a template, never in tokenizers' specials


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the chat template (generation prompt added), with
    every message content literal. Without control-token strings in the contents the result
    is exactly the template's usual tokenization."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    control = control_strings(tokenizer)
    spans = content_spans(tokenizer, messages, text)
    if spans is None:
        if any(s in m["content"] for m in messages for s in control):
            raise ValueError("a message contains a control token string (e.g. <|im_end|>) and this model's chat "
                             "template rewrites message contents, so it cannot be kept literal")
        spans = []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    control_ids = set(tokenizer.added_tokens_decoder)
    template_specials = [(s, e, i) for i, (s, e) in zip(ids, offsets) if i in control_ids and not _inside(s, e, spans)]
    if len(template_specials) == sum(i in control_ids for i in ids):
        return ids  # no forged control token: the usual tokenization
    return _literal_between(tokenizer, text, template_specials)


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
    template = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    spans, out, pos = [], [], 0
    for i, m in enumerate(messages):
        k = template.find(_SENTINEL.format(i), pos)
        if k < 0:
            return None
        out.append(template[pos:k])
        start = sum(len(x) for x in out)
        out.append(m["content"])
        spans.append((start, start + len(m["content"])))
        pos = k + len(_SENTINEL.format(i))
    out.append(template[pos:])
    return spans if "".join(out) == text else None


def _inside(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return any(start < e and s < end for s, e in spans)


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
