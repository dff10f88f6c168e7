"""Dispatch between greedy and rejection-sampling verification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..sampling import target_probs
from ..tree import DraftTree
from ..types import SamplingParams


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices, root excluded, root-to-leaf order
    next_token: int  # recovered or bonus token sampled from the target
    kind: Literal["recovered", "bonus"]

    def tokens(self, tree: DraftTree) -> list[int]:
        """Committed tokens of this step: accepted drafts then the next token."""
        return [tree.tokens[i] for i in self.path] + [self.next_token]


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,  # [N, V] target logits at each tree node
    params: SamplingParams,
    generator: torch.Generator,
) -> Acceptance:
    """Greedy longest-match when ``params.greedy``, else lossless recursive rejection."""
    from .greedy import accept_greedy
    from .rejection import accept_rejection

    if params.greedy:
        return accept_greedy(tree, logits)
    return accept_rejection(tree, target_probs(logits, params), generator)
