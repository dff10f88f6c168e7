"""Draft trees: one type for chains and trees.

A draft is a tree of nodes in topological order. Node 0 (the root) is the newest
committed token, which is not in the KV cache yet; every other node is a drafted token
whose parent is ``parents[i] < i``. Siblings are ordered by drafter preference (the
verifier tries them in that order). A chain is a tree where ``parents[i] == i - 1``.

``draft_probs[i]`` (optional) is the distribution q the drafter drew node i from,
conditioned on the path to its parent; row 0 is unused. ``None`` means every node is a
point-mass (deterministic) proposal, as for n-gram or suffix drafters.

Example: root 7 with children 3, 5 and grandchild 9 under 3::

    tokens  = [7, 3, 5, 9]
    parents = [-1, 0, 0, 1]
    depths  = [0, 1, 1, 2]
    ancestor_mask row 3 = [1, 1, 0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    draft_probs: torch.Tensor | None = None  # [N, V] float32, row i = q for node i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a draft tree needs a root and one parent per token")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs needs one row per node")

    @staticmethod
    def chain(root: int, drafts: list[int], probs: torch.Tensor | None = None) -> "DraftTree":
        """Root followed by ``drafts`` in a line. ``probs``: [K, V] q for each draft."""
        if probs is not None:
            probs = torch.cat([probs.new_zeros(1, probs.shape[-1]), probs])
        return DraftTree(
            tokens=(root, *drafts), parents=tuple(range(-1, len(drafts))), draft_probs=probs
        )

    @staticmethod
    def from_paths(root: int, paths: list[list[int]]) -> "DraftTree":
        """Merge token paths (each continuing the root) into a trie, shared prefixes once.

        ``from_paths(7, [[3, 9], [5], [3, 4]])`` -> tokens (7, 3, 5, 9, 4) in BFS order."""
        index: dict[tuple[int, ...], int] = {(): 0}
        nodes: list[tuple[int, ...]] = [()]
        for depth in range(1, max((len(p) for p in paths), default=0) + 1):
            for path in paths:
                prefix = tuple(path[:depth])
                if len(path) >= depth and prefix not in index:
                    index[prefix] = len(nodes)
                    nodes.append(prefix)
        tokens = (root, *(n[-1] for n in nodes[1:]))
        parents = (-1, *(index[n[:-1]] for n in nodes[1:]))
        return DraftTree(tokens=tokens, parents=parents)

    @property
    def size(self) -> int:
        """Number of nodes, root included (= tokens fed to the target)."""
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depths[i] = depths[self.parents[i]] + 1
        return tuple(depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True when j is i or an ancestor of i."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask.to(device)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first drafted node down to ``node`` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
