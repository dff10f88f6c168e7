"""Engine logprobs (``TokenLogprob``) -> the OpenAI JSON shapes.

/v1/completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
with ``top_logprobs`` a list of {token text: logprob} dicts.
/v1/chat/completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Token text is each id decoded alone (as vLLM does); ``bytes`` its UTF-8 bytes.
"""

from __future__ import annotations

from typing import Any

from ..types import TokenLogprob


def _text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, logprobs: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset``: characters before the first token."""
    tokens = [_text(tokenizer, lp.token_id) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_text(tokenizer, i): v for i, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: one entry per generated token."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in logprobs]}
