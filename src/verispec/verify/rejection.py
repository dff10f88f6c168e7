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


def rejection_step(p: torch.Tensor, q: torch.Tensor, x: int, u: float) -> tuple[bool, torch.Tensor | None]:
    """One sibling's test, given its uniform draw ``u`` in [0, 1) (vLLM's rejection sampler
    also takes its uniforms as input): draft ``x``, drawn from ``q``, is accepted against the
    current target ``p`` when u < p(x) / q(x), computed as u * q(x) < p(x). A draft with
    q(x) = 0 is rejected whatever ``u``. Returns ``(True, None)`` on acceptance, else
    ``(False, norm(max(0, p - q)))``, the law to test the next sibling against (None when
    p <= q everywhere: see ``residual``).

    >>> p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.0, 1.0, 0.0])
    >>> rejection_step(p, q, 1, 0.2)                 # 0.2 < p(1) / q(1) = 0.25: accepted
    (True, None)
    >>> rejection_step(p, q, 1, 0.3)                 # rejected: x leaves p, the rest renormalised
    (False, tensor([0.6667, 0.0000, 0.3333]))
    """
    if q[x] > 0 and u * q[x] < p[x]:
        return True, None
    return False, residual(p, q)


def accept_rejection(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator
) -> Acceptance:
    """``probs``: [N, V] target distribution at each node (already temperature/top-k/top-p
    processed). Uses ``tree.draft_probs`` (q per node) when present, point masses otherwise.
    Each sibling's test is ``rejection_step``; its uniform is drawn from ``generator`` only
    when q(x) > 0 (a draft q cannot give is rejected without a draw).

    A sibling whose q is not finite (a drafter's NaN) is rejected and leaves p as it is: as if it
    had not been drafted, so the next sibling, or the token sampled, follows p exactly (for
    chains and i.i.d. siblings; the draft is simply lost). A NaN in p itself, the target's,
    raises NonFiniteLogits when the token is sampled (``sampling.sample``)."""
    probs = probs.float().cpu()
    q_all = tree.draft_probs.float().cpu() if tree.draft_probs is not None else None
    q_usable = torch.isfinite(q_all).all(-1).tolist() if q_all is not None else None
    node, path = 0, []
    while True:
        p = probs[node]  # [V]
        for child in tree.children[node]:
            if q_usable is not None and not q_usable[child]:
                continue
            x = tree.tokens[child]
            q = q_all[child] if q_all is not None else torch.nn.functional.one_hot(
                torch.tensor(x), p.shape[-1]
            ).float()
            accepted, rest = rejection_step(p, q, x, uniform(generator) if q[x] > 0 else 1.0)
            if accepted:
                path.append(child)
                node = child
                break
            # rest is None when p <= q_k everywhere: the rejection had probability 0
            p = rest if rest is not None else probs[node]
        else:
            kind = "bonus" if not tree.children[node] else "recovered"
            return Acceptance(path=path, next_token=sample(p, generator), kind=kind)
