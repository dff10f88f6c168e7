"""Prompt log-probabilities: how likely the target finds each token of a given text, the
``echo`` + ``logprobs`` of OpenAI's /v1/completions, which scorers (lm-evaluation-harness's
log-likelihood tasks) read. Not decoding: one forward over the prompt with logits at every
position, in chunks so the [chunk, V] logits stay small (about what a batched verify step
holds), into a cache row that is emptied afterwards; the decoding path is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..logprobs import token_logprobs
from ..models.base import CausalLM, KVCache
from ..sampling import check_logits
from ..types import TokenLogprob

SCORE_CHUNK = 64  # prompt tokens per forward: [64, V] fp32 logits (Qwen2.5: 39 MB)


def prompt_logprobs(target: CausalLM, cache: KVCache, prompt_ids: Sequence[int], num_top: int,
                    chunk: int = SCORE_CHUNK) -> list[TokenLogprob]:
    """For each prompt token after the first, ``log p(token_i | tokens_<i)`` under the target's
    raw logits (no temperature or penalties) and the ``num_top`` most likely tokens at position
    i; the first token has none (nothing precedes it), so the list has ``len(prompt_ids) - 1``
    entries. ``cache`` must be empty and hold the prompt; it is left holding it. Non-finite
    logits raise ``NonFiniteLogits``."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if cache.length != 0:
        raise ValueError(f"prompt scoring needs an empty cache (length {cache.length})")
    device = target.info.device
    ids = list(prompt_ids)
    out: list[TokenLogprob] = []
    for start in range(0, len(ids) - 1, chunk):  # the last token's logits predict nothing of the prompt
        end = min(start + chunk, len(ids) - 1)
        x = torch.tensor([ids[start:end]], device=device)
        pos = torch.arange(start, end, device=device)[None]
        logits = target.forward(x, pos, cache).logits[0]  # [end - start, V]: row j predicts token start + j + 1
        check_logits(logits)
        out += token_logprobs(logits, ids[start + 1:end + 1], num_top)
    return out
