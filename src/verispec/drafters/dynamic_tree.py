"""Dynamic draft trees (EAGLE-2, Li et al. 2024, arXiv 2406.16858, Sec. 4).

EAGLE-2 grows a tree level by level: at each depth it *expands* only the ``top_k``
candidates with the highest cumulative draft log-probability (the "value" of a node, an
estimate of the probability that the whole root-to-node path is accepted), then *reranks*
every candidate ever generated and keeps the ``budget`` best as the draft. Since a child's
value never exceeds its parent's, the best-N set is ancestor-closed (ties are broken
toward shallower, earlier nodes, and a closure check guards against anything else).

Candidates are kept in flat lists ("candidate index" c): ``tokens[c]``, ``parents[c]``
(-1 = child of the root) and ``scores[c]`` (cumulative log-prob). These functions are
pure; ``EagleDrafter`` owns the model calls.
"""

from __future__ import annotations

from ..tree import DraftTree


def select_frontier(scores: list[float], candidates: list[int], top_k: int) -> list[int]:
    """The ``top_k`` candidates (by score, ties by index) to expand at the next depth.

    >>> select_frontier([-0.1, -2.0, -0.5, -0.3], [1, 2, 3], 2)
    [3, 2]
    """
    return sorted(candidates, key=lambda c: (-scores[c], c))[:top_k]


def rerank(scores: list[float], parents: list[int], budget: int) -> list[int]:
    """Best ``budget`` candidates by score, ancestor-closed, in topological order.

    A candidate is taken only if its parent was taken (or it hangs off the root); parents
    are visited first because ``parents[c] < c`` and ties go to the lower index.

    >>> rerank([-0.1, -1.0, -0.2, -3.0], [-1, -1, 0, 1], 3)
    [0, 1, 2]
    >>> rerank([-0.1, -1.0, -0.2, -0.15], [-1, -1, 0, 2], 3)  # 3 comes before its parent: skipped
    [0, 1, 2]
    """
    order = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
    taken: set[int] = set()
    for c in order:
        if len(taken) == budget:
            break
        if parents[c] == -1 or parents[c] in taken:
            taken.add(c)
    return sorted(taken)


def size_by_cost(scores: list[float], selected: list[int], cost: dict[int, float]) -> list[int]:
    """The best-first prefix of ``selected`` that maximises committed tokens per unit of
    target time, ``(E(n) + 1) / t(n)`` with ``E(n)`` the sum of the first n nodes' path
    probabilities ``exp(score)`` (EAGLE-2's acceptance estimate) and ``t`` the measured
    cost curve (``policies.draft_budget.best_size``): on a CPU, where verifying 16 nodes
    costs several decode steps, a confident draft stays large and a doubtful one shrinks
    to a few nodes or none. Every best-first prefix of an ancestor-closed set is one too.

    >>> size_by_cost([-0.1, -3.0, -0.2], [0, 1, 2], {1: 1.1, 2: 1.2, 3: 1.6})
    [0, 2]
    """
    import math

    from ..policies.draft_budget import best_size

    order = sorted(selected, key=lambda c: (-scores[c], c))
    n, _ = best_size([math.exp(scores[c]) for c in order], cost)
    return sorted(order[:n])


def tree_from_candidates(root: int, tokens: list[int], parents: list[int], scores: list[float],
                         selected: list[int]) -> DraftTree:
    """DraftTree over ``selected`` candidates: BFS by depth, siblings by descending score.

    >>> t = tree_from_candidates(7, [3, 5, 9], [-1, -1, 0], [-0.1, -1.0, -0.2], [0, 1, 2])
    >>> t.tokens, t.parents
    ((7, 3, 5, 9), (-1, 0, 0, 1))
    """
    keep = set(selected)
    depth = {}
    for c in sorted(selected):
        if parents[c] != -1 and parents[c] not in keep:
            raise ValueError(f"candidate {c} is selected without its parent {parents[c]}")
        depth[c] = 1 if parents[c] == -1 else depth[parents[c]] + 1
    node_of: dict[int, int] = {-1: 0}
    out_tokens, out_parents = [root], [-1]
    for d in sorted(set(depth.values())):
        # siblings stay adjacent and follow their parents' order
        level = sorted((c for c in selected if depth[c] == d), key=lambda c: (node_of[parents[c]], -scores[c], c))
        for c in level:
            node_of[c] = len(out_tokens)
            out_tokens.append(tokens[c])
            out_parents.append(node_of[parents[c]])
    return DraftTree(tokens=tuple(out_tokens), parents=tuple(out_parents))

