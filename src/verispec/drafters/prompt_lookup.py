"""Prompt lookup / multi-level n-gram drafting (Saxena 2023, "Prompt Lookup Decoding";
ANPD, Ou et al. 2024): find the most recent earlier occurrence of the last n tokens, for
n from ``max_ngram`` down to ``min_ngram``, and propose the tokens that followed it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..tree import DraftTree
from .base import DraftContext, StatelessDrafter
from .options import option


def find_continuation(
    tokens: list[int], max_ngram: int, k: int, min_ngram: int = 1
) -> list[int]:
    """Continuation (up to k tokens) of the most recent earlier match of the longest
    suffix n-gram of ``tokens``; [] when nothing matches.

    Example: tokens [1, 2, 3, 4, 2, 3], max_ngram 2, k 2 -> suffix [2, 3] matched at
    index 1 -> proposes [4, 2].
    """
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = tokens[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):  # most recent match first
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def find_continuations(
    tokens: list[int], max_ngram: int, k: int, max_candidates: int, min_ngram: int = 1
) -> list[list[int]]:
    """Up to ``max_candidates`` distinct continuations for the longest matching n-gram,
    most recent first (the tree variant of ``find_continuation``)."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix, found = tokens[n_tokens - n :], []
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow and follow not in found:
                    found.append(follow)
                    if len(found) == max_candidates:
                        break
        if found:
            return found
    return []


@dataclass(frozen=True)
class PromptLookupOptions:
    """n-gram match over prompt + output (prompt lookup decoding, Saxena 2023)."""

    max_ngram: int = option(3, "longest n-gram matched at the end of the output")
    min_ngram: int = option(1, "shortest n-gram matched")
    num_candidates: int = option(1, "distinct continuations drafted (a tree when > 1)")

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        if self.num_candidates < 1:
            raise ValueError("num_candidates must be >= 1")


class PromptLookupDrafter(StatelessDrafter):
    """Chain draft from the most recent n-gram match; with ``num_candidates > 1`` a tree
    of several distinct continuations sharing prefixes (budget counts tree nodes)."""

    name: ClassVar[str] = "prompt-lookup"

    def __init__(self, max_ngram: int = PromptLookupOptions.max_ngram, min_ngram: int = PromptLookupOptions.min_ngram,
                 num_candidates: int = PromptLookupOptions.num_candidates):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        if num_candidates < 1:
            raise ValueError("num_candidates must be >= 1")
        self.max_ngram, self.min_ngram, self.num_candidates = max_ngram, min_ngram, num_candidates

    def propose(self, ctx: DraftContext) -> DraftTree:
        root = ctx.tokens[-1]
        if ctx.budget <= 0:
            return DraftTree.chain(root, [])
        if self.num_candidates == 1:
            return DraftTree.chain(
                root, find_continuation(ctx.tokens, self.max_ngram, ctx.budget, self.min_ngram)
            )
        paths = find_continuations(
            ctx.tokens, self.max_ngram, ctx.budget, self.num_candidates, self.min_ngram
        )
        tree = DraftTree.from_paths(root, paths)
        while tree.num_drafted > ctx.budget:  # trim the least preferred candidate
            paths = paths[:-1] if len(paths) > 1 else [paths[0][: ctx.budget]]
            tree = DraftTree.from_paths(root, paths)
        return tree
