"""Draft-model drafting (Leviathan et al. 2023; Chen et al. 2023): a small causal LM that
shares the target's tokenizer proposes a chain autoregressively, with its own KV cache
that is rolled back to the committed prefix before every proposal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..models.base import CausalLM, KVCache, model_bytes
from ..sampling import sample, target_probs
from ..tree import DraftTree
from .base import DraftContext, Observation, RequestTable


@dataclass
class _DraftState:
    cache: KVCache
    fed: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelDrafter:
    """Chain drafts from ``model``. Greedy requests draft argmax tokens; sampled requests
    draw from the draft's processed distribution q and attach q for rejection sampling.
    ``min_confidence`` > 0 stops drafting when the draft's top probability falls below it
    (a draft-confidence threshold, as transformers' ``assistant_confidence_threshold``)."""

    name: ClassVar[str] = "draft"
    needs_hidden_states: ClassVar[bool] = False
    provides_probs: ClassVar[bool] = True

    def __init__(self, model: CausalLM, min_confidence: float = 0.0):
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError("min_confidence must be in [0, 1)")
        self.model, self.min_confidence = model, min_confidence
        self._states: RequestTable[_DraftState] = RequestTable()

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self._states.add(request_id, _DraftState(cache=self.model.new_cache()))

    def finish(self, request_id: str) -> None:
        self._states.pop(request_id)

    def observe(self, obs: Observation) -> None:
        pass  # the cache is re-synchronised lazily in propose()

    def memory_bytes(self) -> int:
        """The draft model's resident weights plus every open request's pooled K/V."""
        pools = (getattr(st.cache, "pool", None) for st in self._states.values())  # transformers: no pool
        return model_bytes(self.model) + sum(p.nbytes for p in pools if p is not None)

    def _feed(self, state: _DraftState, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the draft cache; returns [V] logits after the last one."""
        start = state.cache.length
        device = self.model.info.device
        ids = torch.tensor([tokens], device=device)
        pos = torch.arange(start, start + len(tokens), device=device)[None]
        out = self.model.forward(ids, pos, state.cache, last_logits_only=True)
        state.fed.extend(tokens)
        return out.logits[0, -1]

    def propose(self, ctx: DraftContext) -> DraftTree:
        state = self._states.get(ctx.request_id)
        keep = common_prefix_length(state.fed, ctx.tokens)
        keep = min(keep, len(ctx.tokens) - 1)  # always re-feed the root for its logits
        state.cache.truncate(keep)
        del state.fed[keep:]
        budget = min(ctx.budget, self.model.info.max_length - len(ctx.tokens))
        logits = self._feed(state, ctx.tokens[keep:])
        drafts, qs = [], []
        for i in range(budget):
            q = target_probs(logits[None], ctx.params)[0] if not ctx.params.greedy else None
            token = sample(q, ctx.generator) if q is not None else int(logits.argmax())
            if self.min_confidence and logits.float().softmax(-1).max() < self.min_confidence:
                break
            drafts.append(token)
            if q is not None:
                qs.append(q)
            if i + 1 < budget:
                logits = self._feed(state, [token])
        probs = torch.stack(qs) if qs else None
        return DraftTree.chain(ctx.tokens[-1], drafts, probs)
