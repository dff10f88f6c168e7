"""Greedy verification: follow the target's argmax down the tree."""

from __future__ import annotations

import torch

from ..sampling import check_logits
from ..tree import DraftTree
from .acceptance import Acceptance


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Longest root-to-node path whose every token equals the target's argmax at its
    parent, plus the argmax after it.

    Example: tokens (7, 3, 5, 9), parents (-1, 0, 0, 1), argmax per node (3, 9, 1, 4):
    root->3 matches, 3->9 matches, 9 is a leaf -> path [1, 3], next token 4 (bonus).

    A node whose row is followed must have a finite maximum (``sampling.check_logits``; the max
    comes with the argmax at no cost), else NonFiniteLogits: the argmax of a NaN row is token 0,
    forever. Rows off the path are not read, as plain decoding would not compute them.
    """
    best, argmax = logits.max(-1)  # [N], [N]: a row's max is NaN / +inf / -inf when it names no token
    finite, argmax = torch.isfinite(best).tolist(), argmax.tolist()
    node, path = 0, []
    while True:
        if not finite[node]:
            check_logits(logits[node])  # raises NonFiniteLogits: the row names no token
        want = argmax[node]
        child = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
        if child is None:
            kind = "bonus" if not tree.children[node] else "recovered"
            return Acceptance(path=path, next_token=want, kind=kind)
        path.append(child)
        node = child
