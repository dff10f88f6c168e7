"""Log-probabilities of emitted tokens, from the target's logits at each token's position.

What is reported: the raw model distribution, ``log_softmax`` of the target's float32
logits, before logit bias, penalties, temperature, min-p, top-k and top-p. This is vLLM's
default (``logprobs_mode="raw_logprobs"``) and what users compare across servers; it is
also meaningful for greedy requests, whose processed distribution is a point mass.

Under speculation token j of a step is scored at its parent node: accepted draft
``path[j]`` at ``path[j-1]`` (the root for j = 0) and the recovered or bonus token at the
path's last node. Those rows are the target's logits at exactly the positions plain
decoding scores, so the values equal plain decoding's (bitwise on a bit-exact backend,
``model.exactness``). The draft's probabilities are never used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .types import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """``logits``: [M, V] target logits at the positions that emitted ``tokens`` ([M]);
    returns each token's log-probability and its ``num_top`` most likely alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    chosen = logp.gather(-1, torch.tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None])[:, 0]
    if num_top:
        top_vals, top_ids = logp.topk(num_top, dim=-1)  # [M, num_top]
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(t), float(c), top) for t, c, top in zip(tokens, chosen.tolist(), tops)]


def step_rows(path: Sequence[int]) -> list[int]:
    """Tree rows whose logits emitted a step's tokens (accepted path, then the next token).

    ``step_rows([2, 5])`` -> ``[0, 2, 5]``: node 2 was drawn at the root, node 5 at node 2,
    and the recovered/bonus token at node 5."""
    return [0, *path]
