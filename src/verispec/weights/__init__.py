"""Shipped drafter weights: one directory per (drafter kind, target), each holding
``model.safetensors``, ``config.json`` and ``MODEL_CARD.md`` (data, steps, final loss,
validation acceptance). Nothing here duplicates the target's embedding or LM head."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parent

# (drafter kind, target model name) -> directory under weights/
SHIPPED: dict[tuple[str, str], str] = {
    ("eagle", "smollm2-135m-instruct"): "eagle-smollm2-135m-instruct",
    ("eagle3", "smollm2-135m-instruct"): "eagle3-smollm2-135m-instruct",
    ("medusa", "smollm2-135m-instruct"): "medusa-smollm2-135m-instruct",
    ("draft", "smollm2-135m-instruct"): "draft-smollm2-135m-instruct",
}


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
