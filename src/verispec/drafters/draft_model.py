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
from .base import DeclaresFeatures, DraftContext, Observation, RequestTable


@dataclass(frozen=True)
class DraftCost:
    """Measured costs in target decode steps: ``draft`` one draft forward; ``curve`` the target
    forward over the root and n drafted tokens at measured n (``policies.tree_shape``)."""

    draft: float
    curve: dict[int, float]

    def verify(self, n: int) -> float:
        """t(n), interpolated linearly between measured sizes (t(0) = 1, a decode step)."""
        points = sorted({0: 1.0, **self.curve}.items())
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)


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


class DraftModelDrafter(DeclaresFeatures):
    """Chain drafts from ``model``. Greedy requests draft argmax tokens; sampled requests
    draw from the draft's processed distribution q and attach q for rejection sampling.
    ``min_confidence`` > 0 stops drafting when the draft's top probability falls below it
    (a draft-confidence threshold, as transformers' ``assistant_confidence_threshold``).

    ``cost`` sizes each draft by the measured curves instead (cost-aware draft length, the
    rule of SpecDec++, Huang et al. 2024, with the draft's own probabilities standing in for
    its trained acceptance predictor): ``cost.verify(n)`` is a target forward over the root
    and n drafted tokens and ``cost.draft`` one draft forward, both in target decode steps.
    With P the probability that every token drafted so far is accepted and E = 1 + sum of
    those P (the expected tokens of a step), a token is kept while it raises E / time, and
    another draft forward is paid for while the next token, guessed as likely as the last,
    would. Output is unchanged either way: only how much is drafted."""

    name: ClassVar[str] = "draft"

    def __init__(self, model: CausalLM, min_confidence: float = 0.0, cost: DraftCost | None = None):
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError("min_confidence must be in [0, 1)")
        self.model, self.min_confidence, self.cost = model, min_confidence, cost
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
        accept_all, expected = 1.0, 1.0  # P(every draft so far accepted), tokens a step yields
        for i in range(budget):
            q = target_probs(logits[None], ctx.params)[0] if not ctx.params.greedy else None
            token = sample(q, ctx.generator) if q is not None else int(logits.argmax())
            if self.min_confidence and logits.float().softmax(-1).max() < self.min_confidence:
                break
            if self.cost is not None:  # keep token i + 1 only if it raises tokens per unit time
                conf = float(q[token]) if q is not None else float(logits.float().softmax(-1)[token])
                keep_p = accept_all * conf
                paid = (i + 1) * self.cost.draft
                if (expected + keep_p) / (paid + self.cost.verify(i + 1)) < expected / (paid + self.cost.verify(i)):
                    break
                accept_all, expected = keep_p, expected + keep_p
            drafts.append(token)
            if q is not None:
                qs.append(q)
            if i + 1 < budget and self.cost is not None:  # pay for another draft forward?
                guess = accept_all * conf
                now = expected / ((i + 1) * self.cost.draft + self.cost.verify(i + 1))
                if (expected + guess) / ((i + 2) * self.cost.draft + self.cost.verify(i + 2)) < now:
                    break
            if i + 1 < budget:
                logits = self._feed(state, [token])
        probs = torch.stack(qs) if qs else None
        return DraftTree.chain(ctx.tokens[-1], drafts, probs)
