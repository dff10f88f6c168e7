"""The draft size of one step from the measured cost curve: Sequoia's hardware-aware rule
(Chen et al. 2024, arXiv 2402.12374, Sec. 3.3) applied per step to one concrete draft.

Glossary:
  node values  ``values[i]``: the estimated probability that drafted node i is accepted
               (its whole root-to-node path), nodes in best-first order so that every
               prefix of them is a tree; ``E(n) = sum(values[:n])`` is the expected
               number of accepted drafted tokens of the first n nodes.
  t(n)         the target's time to verify root + n nodes over its 1-token decode time
               (``cost_curve.measure_cost_curve``).
  c(n)         the drafter's own time to draft n nodes, in the same unit
               (``cost_curve.measure_draft_cost``); 0 for model-free drafters (microseconds).
  rate         ``(E(n) + 1) / (t(n) + c(n))``: committed tokens per unit of target time;
               plain decoding (n = 0, no drafter call) has rate 1.

``DepthAcceptance`` supplies node values for drafters that give none (a learned chain or
tree, prompt lookup): the tracked probability that depth d is accepted given depth d - 1
was, from that drafter's verified proposals, multiplied down the depths (a chain model).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def interpolate(curve: dict[int, float], n: int, at_zero: float = 1.0) -> float:
    """A cost curve at any size: ``at_zero`` at 0 unless given (1 for ``t``: plain decoding;
    0 for ``c``: no drafter call), linear between measured sizes, extended past the largest
    one with the slope of its last segment.

    >>> interpolate({2: 1.2, 4: 1.6}, 3), interpolate({2: 1.2, 4: 1.6}, 6), interpolate({2: 1.2}, 1)
    (1.4, 2.0, 1.1)
    """
    pts = sorted({0: at_zero, **curve}.items())
    sizes = [s for s, _ in pts]
    i = bisect.bisect_left(sizes, n)
    if i < len(sizes) and sizes[i] == n:
        return pts[i][1]
    lo, hi = (pts[-2], pts[-1]) if i == len(sizes) else (pts[i - 1], pts[i])
    return round(lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0]), 12)


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """A cost curve made non-decreasing in n (each t(n) raised to the largest t at a smaller size):
    a curve timed on a busy machine can dip (t(12) below t(8)), and a dip would make a larger draft
    look cheaper than a smaller one.

    >>> monotone({1: 1.3, 8: 2.5, 12: 2.0, 16: 4.0})
    {1: 1.3, 8: 2.5, 12: 2.5, 16: 4.0}
    """
    out, top = {}, 0.0
    for n in sorted(curve):
        top = max(top, curve[n])
        out[n] = top
    return out


def best_size(values: Sequence[float], cost: dict[int, float],
              draft_cost: dict[int, float] | None = None) -> tuple[int, float]:
    """The size n in 0..len(values) with the highest rate ``(E(n) + 1) / (t(n) + c(n))``,
    and that rate; n = 0 (plain decoding, rate 1, no drafter call) wins ties.

    >>> n, rate = best_size([0.9, 0.8, 0.1], {1: 1.1, 2: 1.2, 4: 1.5}); n, round(rate, 3)
    (2, 2.25)
    >>> best_size([0.9, 0.8], {1: 1.1, 2: 1.2}, {1: 2.0, 2: 2.0})
    (0, 1.0)
    """
    best, rate, expected = 0, 1.0, 0.0
    for n, v in enumerate(values, start=1):
        expected += v
        c = interpolate(cost, n) + (interpolate(draft_cost, n, at_zero=0.0) if draft_cost else 0.0)
        if (expected + 1.0) / c > rate + 1e-12:
            best, rate = n, (expected + 1.0) / c
    return best, rate


class DepthAcceptance:
    """Per-depth acceptance of one drafter's verified proposals, with a Beta prior.

    ``rate(d)`` estimates P(depth d accepted | depth d - 1 accepted, the draft reached d):
    ``(accepted[d] + prior * mean) / (trials[d] + prior)``. Depths never tried use the prior
    mean (0.5: neither optimistic nor locked out after a few misses).

    >>> a = DepthAcceptance(); a.update(drafted_depth=3, accepted=1)
    >>> [round(x, 3) for x in a.node_values(3)]
    [0.75, 0.188, 0.094]
    """

    def __init__(self, max_depth: int = 32, prior: float = 1.0, mean: float = 0.5):
        if max_depth < 1 or prior <= 0 or not 0.0 < mean < 1.0:
            raise ValueError("need max_depth >= 1, prior > 0 and 0 < mean < 1")
        self.max_depth, self.prior, self.mean = max_depth, prior, mean
        self._accepted = [0] * (max_depth + 1)  # index d = depth d (0 unused)
        self._trials = [0] * (max_depth + 1)

    def update(self, drafted_depth: int, accepted: int) -> None:
        """One verified proposal that reached ``drafted_depth`` and had ``accepted`` nodes
        on the accepted path (0 <= accepted <= drafted_depth)."""
        if not 0 <= accepted <= drafted_depth:
            raise ValueError(f"accepted {accepted} must lie in [0, drafted depth {drafted_depth}]")
        for d in range(1, min(drafted_depth, accepted + 1, self.max_depth) + 1):
            self._trials[d] += 1
            self._accepted[d] += d <= accepted

    def rate(self, depth: int) -> float:
        d = min(depth, self.max_depth)
        return (self._accepted[d] + self.prior * self.mean) / (self._trials[d] + self.prior)

    def trials(self, depth: int) -> int:
        """How many verified proposals reached ``depth`` (the evidence behind ``rate(depth)``)."""
        return self._trials[min(depth, self.max_depth)]

    def node_values(self, n: int) -> list[float]:
        """Values of a chain of n nodes: the product of the rates down to each depth."""
        out, reach = [], 1.0
        for d in range(1, n + 1):
            reach *= self.rate(d)
            out.append(reach)
        return out

    def reset(self) -> None:
        self._accepted = [0] * (self.max_depth + 1)
        self._trials = [0] * (self.max_depth + 1)


class RankAcceptance:
    """Per-(depth, rank) acceptance of a tree drafter whose nodes are ranked children (Token
    Recycling: the rank-r successor in a matrix row), with a Beta prior per rank.

    ``prob(d, r)`` estimates P(the rank-r child of a depth-(d - 1) node is the accepted one |
    that node was accepted and the child was drafted): accepted / reached counts plus
    ``prior`` pseudo-trials at ``prior_probs[r]``. Depths past ``depths`` share the last
    bucket. A node's path value is the product of ``prob`` along its path (Sequoia's
    positional acceptance with the siblings' exclusion folded in: the children of a node are
    accepted exclusively, so their probabilities sum to at most 1).

    >>> a = RankAcceptance((0.5, 0.2), depths=2, prior=2.0)
    >>> a.update([(1, 0, True), (1, 1, False), (2, 0, False)])  # depth 1: rank 0 accepted; its rank-0 child not
    >>> round(a.prob(1, 0), 3), round(a.prob(1, 1), 3), round(a.prob(2, 0), 3)
    (0.667, 0.133, 0.333)
    """

    def __init__(self, prior_probs: Sequence[float], depths: int = 4, prior: float = 4.0):
        if not prior_probs or depths < 1 or prior <= 0 or any(not 0.0 < p <= 1.0 for p in prior_probs):
            raise ValueError("need prior_probs in (0, 1], depths >= 1 and prior > 0")
        self.prior_probs, self.depths, self.prior = tuple(prior_probs), depths, prior
        self._reached = [[0] * len(self.prior_probs) for _ in range(depths)]
        self._accepted = [[0] * len(self.prior_probs) for _ in range(depths)]

    def _bucket(self, depth: int) -> int:
        return min(max(depth, 1), self.depths) - 1

    def update(self, reached: Sequence[tuple[int, int, bool]]) -> None:
        """One verified tree: ``(depth, rank, accepted)`` of every drafted node whose parent
        was accepted (or is the root): the nodes the target's choice was checked against."""
        for d, r, ok in reached:
            if r < len(self.prior_probs):
                b = self._bucket(d)
                self._reached[b][r] += 1
                self._accepted[b][r] += bool(ok)

    def prob(self, depth: int, rank: int) -> float:
        b = self._bucket(depth)
        return (self._accepted[b][rank] + self.prior * self.prior_probs[rank]) / (self._reached[b][rank] + self.prior)

    def profile(self) -> tuple[tuple[float, ...], ...]:
        """One row of rank probabilities per depth bucket (``tree_template``'s per-depth input)."""
        return tuple(tuple(self.prob(d, r) for r in range(len(self.prior_probs))) for d in range(1, self.depths + 1))

    def reset(self) -> None:
        self.__init__(self.prior_probs, self.depths, self.prior)
