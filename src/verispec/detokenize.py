"""Incremental detokenization with stop strings (``SpecDecoder.stream`` and the server's worker)."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Incremental detokenization with stop strings: emits only text that can no longer
    change (holds back an incomplete UTF-8 character or a possible stop-string prefix)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.emitted = 0  # characters of text already emitted

    def push(self, new_ids: list[int], final: bool) -> tuple[str, list[int], bool]:
        start = len(self.ids)
        self.ids.extend(new_ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        # stop strings are searched in complete text only: a trailing U+FFFD is a character
        # still being decoded (an emoji's first bytes) and must not match a stop string holding one
        complete = len(text) if final else len(text.rstrip("\ufffd"))
        hits = [text.find(s, max(0, self.emitted - len(s)), complete) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            cut = min(hits)
            self._trim_ids(cut)
            delta, self.emitted = text[self.emitted:cut], cut
            return delta, self.ids[start:], True
        hold = max((len(s) - 1 for s in self.stop), default=0)
        safe = len(text) - hold
        while safe > self.emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        if final:
            safe = len(text)
        delta = text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta, list(new_ids), False

    def _trim_ids(self, cut: int) -> None:
        """Keep the fewest ids whose text reaches the stop string's start."""
        for m in range(len(self.ids) + 1):
            if len(self.tok.decode(self.ids[:m], skip_special_tokens=True)) >= cut:
                del self.ids[m:]
                return
