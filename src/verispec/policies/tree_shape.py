"""Sequoia's optimal static draft tree and its hardware-aware size (Chen et al. 2024,
"Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding", arXiv 2402.12374).

Acceptance model (Sequoia's *positional acceptance*): ``p[d][r]`` is the probability that
the r-th child (rank r, 0-based here) of a depth-(d-1) node is the accepted one, given that
children of rank < r were rejected. A child of rank r is therefore accepted with
probability ``P[d][r] = p[d][r] * prod_{j<r} (1 - p[d][j])``, and a node is reached with the
product of ``P`` along its path. Children of a node hold ranks ``0..k-1`` (contiguous).
The expected number of accepted drafted tokens of a tree is the sum of its nodes' reach
probabilities (Sequoia, Sec. 3.1); the DP below maximises it for a node budget and a
depth limit. A 1-D ``p`` is the same vector at every depth (Sequoia's setting); a 2-D
``p`` gives one vector per depth (Medusa's heads differ in accuracy).

Hardware-aware size (Sequoia, Sec. 3.3): with ``t(n)`` the target's time to verify ``n``
drafted nodes relative to one plain decoding step, pick ``n`` maximising
``(E[accepted](n) + 1) / t(n)``. ``verispec.cost_curve.measure_cost_curve`` times ``t(n)`` on
a backend; ``cached_cost_curve`` there keeps it in the verispec cache directory.

Trees are returned as rank paths (``(0, 1)`` = the rank-1 child of the rank-0 child of the
root), parents before children: the format ``MedusaDrafter`` consumes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Paths = list[tuple[int, ...]]


@dataclass(frozen=True)
class TreeShape:
    paths: Paths  # rank paths, parents before children (breadth-first)
    expected_accepted: float  # E[accepted drafted tokens] under the acceptance model

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)


def _per_depth(p, max_depth: int | None) -> list[list[float]]:
    """Validate ``p`` (1-D or 2-D, list or tensor) and return one conditional-acceptance
    row per depth 1..D."""
    try:
        t = torch.as_tensor(p, dtype=torch.float64)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"acceptance vector p must be a 1-D or rectangular 2-D list of numbers ({e})") from None
    if t.dim() not in (1, 2) or t.numel() == 0:
        raise ValueError(f"acceptance vector p must be non-empty and 1-D or 2-D, got shape {tuple(t.shape)}")
    if not bool(((t >= 0) & (t <= 1)).all()):  # also rejects NaN
        raise ValueError(f"acceptance probabilities must lie in [0, 1], got {t.tolist()}")
    if max_depth is not None and max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if t.dim() == 1:
        if max_depth is None:
            raise ValueError("a 1-D acceptance vector needs max_depth")
        return [t.tolist()] * max_depth
    if max_depth is not None and max_depth > t.shape[0]:
        raise ValueError(f"max_depth={max_depth} but p has rows for {t.shape[0]} depths only")
    return t[:max_depth].tolist()


def rank_probs(p_row: Sequence[float]) -> list[float]:
    """Conditional acceptances ``p`` -> probability ``P[r]`` that rank r is the accepted child.

    >>> rank_probs([0.5, 0.5, 1.0])
    [0.5, 0.25, 0.25]
    """
    out, miss = [], 1.0
    for x in p_row:
        out.append(miss * x)
        miss *= 1.0 - x
    return out


def conditional_from_marginal(acc: Sequence[float]) -> list[float]:
    """Marginal rank accuracies (``acc[r]`` = how often the rank-r guess is the target's
    token; disjoint events, e.g. Medusa's ``rank_acc``) -> Sequoia's conditional ``p[r]``.

    >>> conditional_from_marginal([0.5, 0.25, 0.25])
    [0.5, 0.5, 1.0]
    """
    if any(a < 0 for a in acc) or sum(acc) > 1 + 1e-6:
        raise ValueError(f"marginal rank accuracies must be >= 0 and sum to <= 1, got {list(acc)}")
    out, left = [], 1.0
    for a in acc:
        out.append(min(1.0, a / left) if left > 1e-12 else 0.0)
        left -= a
    return out


def optimal_tree(p: Sequence[float] | Sequence[Sequence[float]], budget: int,
                 max_depth: int | None = None) -> TreeShape:
    """The tree of at most ``budget`` drafted nodes (root excluded) and depth ``max_depth``
    that maximises the expected accepted length; among optimal trees the smallest.

    DP (Sequoia, Sec. 3.1): ``best(d, n)`` = value of the best subtree under a depth-d node
    using at most n nodes below it; ``kids(d, r, n)`` = best use of n nodes by children of
    rank >= r, where child r with subtree size s is worth ``P[d+1][r] * (1 + best(d+1, s-1))``.

    >>> t = optimal_tree([0.8, 0.5], budget=3, max_depth=2)
    >>> t.paths, round(t.expected_accepted, 3)
    ([(0,), (1,), (0, 0)], 1.54)
    """
    rows = _per_depth(p, max_depth)
    if budget < 0:
        raise ValueError(f"node budget must be >= 0, got {budget}")
    big_p = [rank_probs(r) for r in rows]
    depth = len(rows)
    # best[d][n] for d = 0..depth; kids[d][r][n] with its choice (s = size of child r, 0 = stop)
    best = [[0.0] * (budget + 1) for _ in range(depth + 1)]  # best[depth][n] = 0: no children
    choice: dict[tuple[int, int, int], int] = {}  # (d, r, n) -> size of child r's subtree (0 = none)
    for d in range(depth - 1, -1, -1):
        prow = big_p[d]  # rank probabilities of the depth-(d+1) children
        nxt = [0.0] * (budget + 1)  # kids(d, R, n) = 0
        for r in range(len(prow) - 1, -1, -1):
            cur = [0.0] * (budget + 1)
            for n in range(1, budget + 1):
                for s in range(1, n + 1):  # strict ">": ties keep the smaller tree
                    v = prow[r] * (1.0 + best[d + 1][s - 1]) + nxt[n - s]
                    if v > cur[n] + 1e-12:
                        cur[n], choice[(d, r, n)] = v, s
            nxt = cur
        best[d] = nxt
    paths: Paths = []
    _collect(choice, depth, budget, 0, (), paths)
    paths.sort(key=lambda q: (len(q), q))
    return TreeShape(paths, best[0][budget])


def _collect(choice: dict, depth: int, n: int, d: int, prefix: tuple[int, ...], out: Paths) -> None:
    """Walk the DP choices: children of the node at ``prefix`` (depth d) with n nodes."""
    r = 0
    while d < depth and n > 0:
        s = choice.get((d, r, n), 0)
        if s == 0:
            return
        out.append(prefix + (r,))
        _collect(choice, depth, s - 1, d + 1, prefix + (r,), out)
        n -= s
        r += 1


def expected_accepted(paths: Paths, p: Sequence[float] | Sequence[Sequence[float]],
                      max_depth: int | None = None) -> float:
    """Expected accepted drafted tokens of the rank-path tree ``paths`` (Sequoia's f(T))."""
    depth = max((len(q) for q in paths), default=1)
    rows = _per_depth(p, max_depth if max_depth is not None else depth)
    big_p = [rank_probs(r) for r in rows]
    total = 0.0
    for q in paths:
        if len(q) > len(rows) or any(r >= len(big_p[d]) for d, r in enumerate(q)):
            raise ValueError(f"path {q} is deeper or wider than the acceptance vector")
        total += math.prod(big_p[d][r] for d, r in enumerate(q))
    return total


def choose_size(expected: Callable[[int], float], cost: dict[int, float]) -> int:
    """The measured size n maximising ``(expected(n) + 1) / cost[n]`` (tokens per unit of
    target time; ``cost[0]`` = plain decoding = 1 if missing). Ties: the smaller n.

    >>> choose_size(lambda n: min(n, 2) * 0.9, {1: 1.0, 2: 1.1, 4: 1.5})
    2
    """
    if any(c <= 0 or not math.isfinite(c) for c in cost.values()) or any(n < 0 for n in cost):
        raise ValueError(f"cost curve needs sizes >= 0 and positive finite times, got {cost}")
    curve = {0: 1.0, **cost}
    return max(sorted(curve), key=lambda n: ((expected(n) + 1.0) / curve[n], -n))


def sequoia_tree(p: Sequence[float] | Sequence[Sequence[float]], cost: dict[int, float], max_budget: int,
                 max_depth: int | None = None) -> TreeShape:
    """The optimal tree at the hardware-optimal size among measured sizes <= ``max_budget``."""
    sizes = {n: c for n, c in cost.items() if n <= max_budget}
    n = choose_size(lambda k: optimal_tree(p, k, max_depth).expected_accepted, sizes)
    return optimal_tree(p, n, max_depth)
