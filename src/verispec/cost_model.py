"""The cost model: what a speculative step costs, in target decode steps, with one owner.

``CostModel.curve`` is the target's t(n), one forward over the root and n drafted tokens at
measured n (t(0) = 1: a decode step; ``cost_curve.py`` measures it); ``draft`` is a learned
drafter's c, one draft forward, where measured. The registry builds it once per target
(``registry.cost_model``) and hands it to the drafters that size their drafts and to the engine
(which sizes a constrained request's forced tokens by it); no drafter declares the target's
cost. The rule every user of it follows is Sequoia's hardware-aware one (Chen et al. 2024,
"Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding"): a draft grows while it
raises expected tokens per unit of time.

By context (``curve_by_context``, ``draft_by_context``: ``cost_curve.ContextCostCurve``, timed at a
few contexts): a step's costs grow with the tokens it attends to (verifying at 2-3k tokens of agent
history, a draft model's step and its feed of that history there); ``at(context)`` is the cost model
read at a request's length, ``feed(context)`` a token of history fed to the draft model there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cost_curve import ContextCostCurve


@dataclass(frozen=True)
class CostModel:
    curve: dict[int, float]  # the target's t(n) at measured n, in decode steps
    draft: float | None = None  # a learned drafter's forward, in target decode steps; None: not measured
    # by context, where timed there: the target's t(n | context); the draft's forward over n tokens (size 1: a
    # draft step; a larger size: a feed of the history) over the target's decode step at that context
    curve_by_context: ContextCostCurve | None = None
    draft_by_context: ContextCostCurve | None = None

    def at(self, context: int) -> CostModel:
        """The costs at ``context`` tokens (itself where nothing was timed by context)."""
        if self.curve_by_context is None and self.draft_by_context is None:
            return self
        curve = self.curve if self.curve_by_context is None else self.curve_by_context.at(context)
        draft = self.draft if self.draft_by_context is None else self.draft_by_context.t(1, context, at_zero=0.0)
        return CostModel(curve, draft)

    def feed(self, context: int) -> float | None:
        """A token of history fed to the draft model at ``context`` tokens, in target decode steps there
        (its timed feed forward over its size), or None where no feed was timed."""
        by = self.draft_by_context
        largest = None if by is None else max(by.curves[by.contexts[0]])
        if largest is None or largest <= 1:
            return None
        return by.t(largest, context, at_zero=0.0) / largest

    def verify(self, n: int) -> float:
        """t(n), interpolated linearly between measured sizes (t(0) = 1, a decode step)."""
        points = sorted({0: 1.0, **self.curve}.items())
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)

    def with_draft(self, draft: float) -> CostModel:
        """The same target curve with a learned drafter's measured forward."""
        return CostModel(self.curve, draft, self.curve_by_context, self.draft_by_context)

    def keeps(self, i: int, expected: float, p: float, forwards: int | None = None) -> bool:
        """With i tokens kept (E = ``expected`` tokens a step) and ``forwards`` draft forwards
        paid (i + 1 unless told: tokens a grammar forces cost none), does token i + 1, reached
        with probability ``p``, raise tokens per unit time?"""
        paid = (i + 1 if forwards is None else forwards) * self._draft
        return (expected + p) / (paid + self.verify(i + 1)) >= expected / (paid + self.verify(i))

    def pays_another(self, i: int, expected: float, p: float, forwards: int | None = None) -> bool:
        """With i + 1 tokens kept (``forwards`` draft forwards paid, i + 1 unless told), is one
        more draft forward worth paying for, the next token guessed to be reached with probability ``p``?"""
        paid = (i + 1 if forwards is None else forwards) * self._draft
        now = expected / (paid + self.verify(i + 1))
        return (expected + p) / (paid + self._draft + self.verify(i + 2)) >= now

    def catch_up(self) -> float:
        """A learned drafter's cost per token of a long catch-up (a prefill of many tokens): the
        target's marginal cost at its largest measured sizes scaled by the draft's forward over
        the target's (both compute-bound there)."""
        (n0, t0), (n1, t1) = sorted(self.curve.items())[-2:] if len(self.curve) > 1 else ((0, 1.0), *self.curve.items())
        return max(0.0, self._draft * (t1 - t0) / (n1 - n0))  # a curve timed under load may dip at its end

    @property
    def _draft(self) -> float:
        if self.draft is None:
            raise ValueError("this cost model has no measured draft forward")
        return self.draft
