"""Engine logprobs (``TokenLogprob``) -> the OpenAI JSON shapes.

/v1/completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
with ``top_logprobs`` a list of {token text: logprob} dicts.
/v1/chat/completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.

A token's ``bytes`` are its raw bytes from the vocabulary (byte-level BPE: the GPT-2 byte
alphabet mapped back; SentencePiece: ``<0xNN>`` byte-fallback pieces and ``▁`` as a space),
not its text decoded alone: an emoji split over three tokens has three partial byte strings,
and joining every token's ``bytes`` rebuilds the content's UTF-8 exactly (OpenAI's contract).
A token whose bytes are not whole UTF-8 is named ``"bytes:\\xf0\\x9f"`` (as OpenAI does), so
alternatives never collide on U+FFFD. ``text_offset`` counts the content's characters before
each token (a token that starts inside a character gets that character's offset).
"""

from __future__ import annotations

import codecs
from functools import lru_cache
from typing import Any

from ..types import TokenLogprob


@lru_cache(1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenBytes:
    """token id -> (raw bytes, is a special token) for one tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_fallback = not self.byte_level and "<0x00>" in tokenizer.get_vocab()
        self.added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, bytes] = {}

    def special(self, token_id: int) -> bool:
        t = self.added.get(token_id)
        return bool(t is not None and getattr(t, "special", False))

    def __call__(self, token_id: int) -> bytes:
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._bytes(token_id)
        return out

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].content.encode("utf-8")
        piece = self.tok.convert_ids_to_tokens(token_id)
        if self.byte_level and isinstance(piece, str):
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if self.byte_fallback and isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tok.decode([token_id]).encode("utf-8")  # other vocabularies: the text of the id alone


_TABLES: dict[int, tuple[Any, TokenBytes]] = {}


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The (cached) byte table of ``tokenizer``."""
    hit = _TABLES.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = _TABLES[id(tokenizer)] = (tokenizer, TokenBytes(tokenizer))
    return hit[1]


def token_text(raw: bytes) -> str:
    """A token's name: its text when its bytes are whole UTF-8, else ``bytes:\\x..``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Characters of the content before each token, fed token by token (across stream chunks)."""

    def __init__(self, start: int = 0):
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, raw: bytes) -> int:
        """The offset of a token with bytes ``raw``; advances past it."""
        at = self.offset
        self.offset += len(self._decoder.decode(raw))
        return at


def completion_logprobs(tokenizer: Any, logprobs: list[TokenLogprob], offset: int | TextOffsets = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset``: characters before the first
    token, or a ``TextOffsets`` carried over from the stream's previous chunk."""
    table = token_bytes(tokenizer)
    offsets = offset if isinstance(offset, TextOffsets) else TextOffsets(offset)
    raws = [table(lp.token_id) for lp in logprobs]
    return {
        "tokens": [token_text(r) for r in raws],
        "token_logprobs": [lp.logprob for lp in logprobs],
        # logprobs = 0 asks for no alternatives: the sampled token alone (as vLLM answers), not {}
        "top_logprobs": [{token_text(table(i)): v for i, v in lp.top} or {token_text(r): lp.logprob}
                         for lp, r in zip(logprobs, raws)],
        "text_offset": [offsets.feed(b"" if table.special(lp.token_id) else r) for lp, r in zip(logprobs, raws)],
    }


def prompt_logprobs(tokenizer: Any, prompt_ids: list[int], scored: list[TokenLogprob]) -> dict[str, Any]:
    """The echoed prompt's part of a completion's ``logprobs``: every prompt token, its text offset
    from the prompt's start, and ``scored`` (tokens after the first); the first token's
    ``token_logprobs`` and ``top_logprobs`` are null (nothing precedes it), as in OpenAI's API."""
    out = completion_logprobs(tokenizer, [TokenLogprob(prompt_ids[0], 0.0), *scored], 0)
    out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completion ``logprobs`` objects as one (the echoed prompt's, then the completion's)."""
    return {k: first[k] + then[k] for k in first}


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: one entry per generated token."""
    table = token_bytes(tokenizer)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = table(token_id)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in logprobs]}
