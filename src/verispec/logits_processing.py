"""History-dependent logit adjustments: logit bias, repetition, presence and frequency
penalties, applied per draft-tree node with that node's own history.

Under speculation the target scores every node of a draft tree in one forward. Node i's
logits predict the token after the root-to-i path, so its history is ``prompt + generated
(root included) + the drafted tokens on the path to i``, never its siblings'. Adjusting
each row with its own history makes the processed distribution at every node exactly the
one plain decoding would use there, so greedy verification and rejection sampling
(``verify/``) stay lossless with these parameters.

Order and definitions (those of vLLM's sampler and the OpenAI API):
1. ``logit_bias``: add the bias to the token's logit.
2. ``repetition_penalty`` r (CTRL, Keskar et al. 2019, arXiv 1909.05858): for every token seen
   in prompt + history, logit / r when the logit is positive, logit * r otherwise; r below
   ``MIN_REPETITION_PENALTY`` (1e-20) saturates to it.
3. ``frequency_penalty`` f and ``presence_penalty`` a (OpenAI): logit - f * count - a * [count > 0],
   counting generated tokens only (prompt tokens are not penalised, as in vLLM).
Temperature, min-p, top-k and top-p come afterwards (``sampling.process_logits``).
Requests without these parameters never reach this module (``SamplingParams.adjusts_logits``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tree import DraftTree
from .types import SamplingParams

# A smaller repetition penalty acts as this one. logit / 1e-38 overflows float32 to inf (NaN
# probabilities when sampling, ties among infs when greedy); logit / 1e-20 stays finite, in
# order, and with room for temperature (>= 1e-5) to divide it again.
MIN_REPETITION_PENALTY = 1e-20


def path_counts(tree: DraftTree, generated: Sequence[int], vocab: int) -> torch.Tensor:
    """[N, V] float32: how often each token occurs in ``generated`` plus the drafted tokens
    on the root-to-node path of node i (node i included; the root is already in
    ``generated``).

    Example: generated [4], tree root 4 -> 3 -> 3 (a chain): row 0 counts {4: 1}, row 1
    {4: 1, 3: 1}, row 2 {4: 1, 3: 2}.
    """
    base = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab)[:vocab].float()  # [V]
    counts = base.repeat(tree.size, 1)  # [N, V]
    if tree.size > 1:
        on_path = tree.ancestor_mask()[:, 1:]  # [N, N-1]: drafted node j is on node i's path
        rows, cols = on_path.nonzero(as_tuple=True)
        tokens = torch.tensor(tree.tokens[1:], dtype=torch.long)  # [N-1]
        counts.index_put_((rows, tokens[cols]), torch.ones(rows.numel()), accumulate=True)
    return counts


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                  counts: torch.Tensor) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 logits after bias and penalties. ``counts``: [N, V]
    generated-token counts per row (``path_counts``); ``prompt``: the prompt's token ids."""
    out = logits.float().clone()  # [N, V]
    counts = counts.to(out.device)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=out.device)
        out[:, ids] += bias  # ids are distinct and < V (SamplingParams, Engine.add_request)
    if params.repetition_penalty != 1.0:
        seen = counts > 0  # [N, V]
        seen[:, torch.tensor(list(prompt), dtype=torch.long, device=out.device)] = True
        r = max(params.repetition_penalty, MIN_REPETITION_PENALTY)  # saturates: never overflows float32
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty != 0.0:
        out -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        out -= params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def adjust_tree_logits(logits: torch.Tensor, tree: DraftTree, params: SamplingParams,
                       prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """[N, V] target logits at a tree's nodes -> adjusted with each node's own history."""
    return adjust_logits(logits, params, prompt, path_counts(tree, generated, logits.shape[-1]))
