"""Shipped drafter weights: one directory per (drafter kind, target), each holding
``model.safetensors``, ``config.json`` and ``MODEL_CARD.md`` (data, steps, final loss,
validation acceptance). Nothing here duplicates the target's embedding or LM head."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).parent

# (drafter kind, target model name) -> directory under weights/
SHIPPED: dict[tuple[str, str], str] = {
    ("eagle", "smollm2-135m-instruct"): "eagle-smollm2-135m-instruct",
    ("eagle3", "smollm2-135m-instruct"): "eagle3-smollm2-135m-instruct",
    ("medusa", "smollm2-135m-instruct"): "medusa-smollm2-135m-instruct",
    ("draft", "smollm2-135m-instruct"): "draft-smollm2-135m-instruct",
}


# model name -> its vocabulary ranked by frequency on the tuning text (scripts/vocab_frequencies.py):
# int32 token ids, most frequent first. A draft with this file can run an FR-Spec head.
VOCAB_FREQ: dict[str, str] = {
    "qwen2.5-coder-1.5b-instruct": "vocab-freq-qwen2.5-coder.npy",
    "qwen2.5-coder-0.5b-instruct": "vocab-freq-qwen2.5-coder.npy",
}


# the same rankings by vocabulary (``models.gguf_vocab``'s ``vocab_key``: the tokens, merges and tokenizer model
# byte for byte), for a GGUF named by path (a draft ``--draft-search`` found): Qwen2.5's vocabulary
VOCAB_FREQ_BY_KEY: dict[str, str] = {
    "1edd2ceb00b4a68f1321e0a7583baa5ebefa194259016676fac08ce433890f96": "vocab-freq-qwen2.5-coder.npy",
}


def vocab_ranking(model: str, vocab_key: Callable[[Path], str | None] | None = None) -> str | None:
    """The ranking file of a catalog model, or of a GGUF file (by path) whose vocabulary has one
    (``vocab_key``: reads a file's vocabulary key, ``models.gguf_vocab.vocab_key_of``); None else."""
    if model in VOCAB_FREQ:
        return VOCAB_FREQ[model]
    path = Path(model)
    if vocab_key is None or model in ("shipped", "self") or model.startswith("truncated:") or not path.is_file():
        return None
    key = vocab_key(path)
    return None if key is None else VOCAB_FREQ_BY_KEY.get(key)


def frequent_tokens(model: str, n: int, always: list[int],
                    vocab_key: Callable[[Path], str | None] | None = None) -> torch.Tensor:
    """The ``n`` most frequent token ids of ``model``'s vocabulary plus ``always`` (its
    control tokens), sorted: the rows of an FR-Spec draft head (Zhao et al. 2025). ValueError
    when no ranking is shipped for the model (``vocab_ranking``)."""
    import numpy as np
    import torch

    file = vocab_ranking(model, vocab_key)
    if file is None:
        raise ValueError(f"no vocabulary ranking shipped for {model!r} (have: {', '.join(VOCAB_FREQ) or 'none'}); "
                         "use vocab=full")
    ranked = np.load(ROOT / file)
    if n < 1:
        raise ValueError(f"vocab must be >= 1 or 'full', got {n}")
    rows = np.union1d(ranked[:n], np.asarray(always, dtype=np.int64))
    return torch.from_numpy(rows.astype(np.int64))


def has_shipped(kind: str, target: str) -> bool:
    name = SHIPPED.get((kind, target))
    return name is not None and (ROOT / name / "config.json").exists()


def shipped_weights(kind: str, target: str) -> Path:
    """The directory of the shipped ``kind`` weights for ``target``; ValueError if none."""
    name = SHIPPED.get((kind, target))
    if not has_shipped(kind, target):
        have = ", ".join(f"{k} for {t}" for (k, t), n in SHIPPED.items() if (ROOT / n / "config.json").exists())
        raise ValueError(f"no shipped {kind} weights for {target!r} (shipped: {have or 'none'}); "
                         f"train some with `verispec train {kind}` and pass their directory "
                         f"({'model' if kind == 'draft' else 'weights'}=<dir>)")
    return ROOT / name
