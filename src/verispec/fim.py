"""Fill-in-the-middle prompts: the code before the cursor (prefix) and after it (suffix), formatted
with the model's own FIM tokens so that it writes what goes between, as editors' autocomplete asks.

The format is prefix-suffix-middle (PSM; Bavarian et al. 2022, "Efficient Training of Language
Models to Fill in the Middle", arXiv 2207.14255), in the spelling the model was trained with:
Qwen2.5-Coder ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>``, StarCoder and SmolLM
``<fim_prefix>...<fim_suffix>...<fim_middle>``. Each FIM marker must be one control token of the
vocabulary; a model without them cannot do FIM (``FimUnsupported``). Prefix and suffix are tokenized
separately, as literal text (a ``<|fim_suffix|>`` typed inside the code stays text), as llama.cpp's
``/infill`` does: the model sees the same ids whatever the text at the cursor is.

    ids = fim_prompt(tokenizer, "def area(r):\\n    ", "\\n\\nprint(area(2))\\n")
"""

from __future__ import annotations

from typing import Any

SPELLINGS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
             ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))  # StarCoder, SmolLM


class FimUnsupported(ValueError):
    """The tokenizer has no FIM tokens."""


def fim_token_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) marker ids of the first spelling whose three markers are all control
    tokens of ``tokenizer`` (its added vocabulary), else None."""
    added = tokenizer.get_added_vocab()
    for spelling in SPELLINGS:
        if all(s in added for s in spelling):
            return tuple(added[s] for s in spelling)  # type: ignore[return-value]
    return None


def fim_prompt(tokenizer: Any, prefix: str, suffix: str) -> list[int]:
    """Token ids of a PSM fill-in-the-middle prompt; FimUnsupported when the model has no FIM tokens."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise FimUnsupported("this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                             "<|fim_middle|>); send the prompt without suffix")

    def text(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if s else []

    return [ids[0], *text(prefix), ids[1], *text(suffix), ids[2]]
