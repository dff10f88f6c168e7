"""Lossless rejection sampling over draft chains and trees.

Chain: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023): accept draft x ~ q with probability
min(1, p(x) / q(x)); on rejection sample from norm(max(0, p - q)); when every draft is
accepted sample a bonus token from p.

Tree: multi-draft recursive rejection (SpecInfer, Miao et al. 2024; Recursive Speculative
Decoding, Jeon et al. 2024): at a node, try its children in order; child k drawn from
q_k is accepted with min(1, p(x_k) / q_k(x_k)), else p <- norm(max(0, p - q_k)) and the
next sibling is tried. This is exact when siblings are i.i.d. draws of q (q_k = q), draws
without replacement (q_k = q renormalised without the earlier siblings) or deterministic
distinct candidates (q_k = one-hot, the point-mass case used when a drafter gives no
probabilities: accept with p(x_k), then remove x_k from p).
"""

from __future__ import annotations

import torch

from ..sampling import sample, uniform
from ..tree import DraftTree
from .acceptance import Acceptance


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """norm(max(0, p - q)) for [V] vectors; None when p <= q everywhere (then the
    rejection had probability zero and any fallback is never reached in exact math)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else None


def accept_rejection(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator
) -> Acceptance:
    """``probs``: [N, V] target distribution at each node (already temperature/top-k/top-p
    processed). Uses ``tree.draft_probs`` (q per node) when present, point masses otherwise."""
    probs = probs.float().cpu()
    q_all = tree.draft_probs.float().cpu() if tree.draft_probs is not None else None
    node, path = 0, []
    while True:
        p = probs[node]  # [V]
        for child in tree.children[node]:
            x = tree.tokens[child]
            q = q_all[child] if q_all is not None else torch.nn.functional.one_hot(
                torch.tensor(x), p.shape[-1]
            ).float()
            if q[x] > 0 and uniform(generator) * q[x] < p[x]:  # u < p(x)/q(x)
                path.append(child)
                node = child
                break
            p = residual(p, q)
            if p is None:  # p <= q_k everywhere: rejection had probability 0
                p = probs[node]
        else:
            kind = "bonus" if not tree.children[node] else "recovered"
            return Acceptance(path=path, next_token=sample(p, generator), kind=kind)
