"""Speculation for a target with no draft model (issue 47): SuffixDecoding where the answer
copies its context, Token Recycling where it does not, both sized by the target's cost curve.

The composition is a ``HybridDrafter`` (drafters/hybrid.py) with SuffixDecoding (Oliaro et al.
2024) as its retrieval drafter and Token Recycling (Luo et al. 2024, "Turning Trash into
Treasure") as its learned one, sizing itself (``learned_sizing="self"``): per step the suffix
draft proposes when its match is at least ``min_match`` tokens long (0 by default) and some size
of it beats plain decoding on the cost curve (its scores calibrated by what its drafts yielded); otherwise Token Recycling drafts the prefix of its best-first
tree template whose expected accepted tokens per unit of t(n) are best, or nothing (a plain step)
where no size pays (``choose="rate"``: the hybrid compares the suffix draft's rate with Token
Recycling's tracked one, a chain model of its trees, and gives Token Recycling that size as its
budget). Both draft for microseconds, so the only cost is the target's t(n).
Lossless as each part is: every tree is a sub-drafter's point-mass tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .hybrid import HybridDrafter
from .options import option
from .suffix_tree import SuffixDecodingDrafter
from .token_recycling import TokenRecyclingDrafter

# no context-match gate: Token Recycling is a weak alternative (its top-1 successor is right 0.35-0.45 of the
# time), so a suffix draft that pays by its calibrated score is taken (tuning runs: docs/benchmarks.md)
MIN_MATCH = 0


@dataclass(frozen=True)
class ModelFreeOptions:
    """for a target without a draft model: SuffixDecoding on a context match, else Token Recycling; sized by the target's cost curve."""

    min_match: int = option(MIN_MATCH, "suffix drafts only after a context match this long")
    min_score: float = option(1.0, "suffix drafts worth fewer expected tokens are no candidate")
    k: int = option(8, "Token Recycling: successors kept per token")
    max_depth: int = option(8, "Token Recycling: deepest level of its tree")
    choose: Literal["suffix-first", "rate"] = option(
        "suffix-first", "suffix-first: suffix whenever its draft pays; rate: the higher tracked rate of the two")

    def __post_init__(self) -> None:
        if self.min_match < 0 or self.min_score < 0 or self.k < 1 or self.max_depth < 1:
            raise ValueError("model-free needs min_match >= 0, min_score >= 0, k >= 1, max_depth >= 1")


def model_free_drafter(vocab_size: int, cost: dict[int, float], o: ModelFreeOptions) -> HybridDrafter:
    """The composition for a target of ``vocab_size`` tokens and measured t(n) ``cost``."""
    recycling = TokenRecyclingDrafter(vocab_size, k=o.k, max_depth=o.max_depth, cost=cost)
    return HybridDrafter(SuffixDecodingDrafter(min_score=0.0), recycling, mode="fallback", min_score=o.min_score,
                         cost=cost, min_match=o.min_match,
                         learned_sizing="self" if o.choose == "suffix-first" else "hybrid")
