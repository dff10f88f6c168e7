"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of
Large Language Models with Token Recycling", arXiv 2408.08696).

Every verification computes the target's next-token distribution at every draft node,
most of which is thrown away. Token Recycling keeps the top-k of each as a row of an
adjacency matrix ``M [V, k]`` (int32: row t = the k most likely successors of token t the
last time the target saw t), and drafts by expanding a static tree template breadth-first
from the root: the template node ``(parent, rank)`` takes token ``M[token(parent), rank]``.

The matrix is shared by all requests and persists across them (the paper's "hot start");
it changes only in ``observe``. Memory: exactly ``V * k * 4`` bytes (49152 x 8 -> 1.5 MiB).

Template: the paper uses a fixed 80-node tree. Here the template is the best n-node tree
for a per-rank acceptance profile (the chance that the rank-r successor is the target's
choice; ``rank_probs`` for every depth, or one row per depth): nodes are added in decreasing
path probability, the greedy construction that is optimal for monotone path weights
(Sequoia, Chen et al. 2024). Parents precede children and siblings come in rank order, so
every prefix of the template is itself a valid tree.

Size (``cost``, the target's t(n) from ``cost_curve``; Sequoia's hardware-aware rule per
step): the profile is the acceptance of its own verified trees per depth and rank
(``policies.draft_budget.RankAcceptance``, ``rank_probs`` its prior), kept across requests
as the matrix is; a step drafts the template prefix (its unknown rows dropped) with the best
``(E(n) + 1) / t(n)``, nothing where plain decoding is best. Without ``cost``: the static
``rank_probs`` template at the whole budget (the paper's setting).
"""

from __future__ import annotations

from dataclasses import dataclass
import heapq
from typing import ClassVar, Literal

import torch

from ..policies.draft_budget import RankAcceptance, best_size, monotone
from ..tree import DraftTree
from .base import DeclaresFeatures, DraftContext, Observation, RequestTable
from .options import option

# Roughly the per-rank acceptance of a recycled top-k row on chat text (the top-1 of a
# stale row is right about half the time); only the order of magnitude matters.
DEFAULT_RANK_PROBS = (0.5, 0.15, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01)


def _row(rank_probs, depth: int) -> tuple[float, ...]:
    """The rank probabilities at ``depth`` (1-based): one row for every depth, or one row per
    depth (the last one for deeper levels)."""
    if rank_probs and isinstance(rank_probs[0], (tuple, list)):
        return tuple(rank_probs[min(depth, len(rank_probs)) - 1])
    return tuple(rank_probs)


def valued_template(rank_probs, size: int, max_depth: int) -> tuple[tuple[tuple[int, int], ...], tuple[float, ...]]:
    """``tree_template`` and each node's path probability (non-increasing: the greedy order).
    ``rank_probs``: one row of per-rank probabilities, or one row per depth."""
    out: list[tuple[int, int]] = []
    values: list[float] = []
    heap = [(-_row(rank_probs, 1)[0], 0, -1, 0, 1)]  # (-path prob, tie, parent, rank, depth)
    tick = 1
    while heap and len(out) < size:
        neg, _, parent, rank, depth = heapq.heappop(heap)
        out.append((parent, rank))
        values.append(-neg)
        me = len(out) - 1
        row = _row(rank_probs, depth)
        if rank + 1 < len(row):  # the next sibling
            heapq.heappush(heap, (-(-neg / row[rank] * row[rank + 1]), tick, parent, rank + 1, depth))
            tick += 1
        if depth < max_depth:  # the first child
            heapq.heappush(heap, (neg * _row(rank_probs, depth + 1)[0], tick, me, 0, depth + 1))
            tick += 1
    return tuple(out), tuple(values)


def tree_template(rank_probs, size: int, max_depth: int) -> tuple[tuple[int, int], ...]:
    """``size`` template nodes as ``(parent template index, rank)`` (parent -1 = the root),
    chosen greedily by path probability (product of the rank probabilities along the path;
    ``rank_probs``: one row, or one row per depth).

    Example: rank_probs (0.6, 0.3), size 4, max_depth 3 -> ((-1, 0), (0, 0), (-1, 1), (1, 0)):
    paths 0.6, 0.36, 0.3, 0.216 beat 0.18 (rank 1 under the first node).
    """
    return valued_template(rank_probs, size, max_depth)[0]


def expand_template(adjacency: torch.Tensor, root: int, template: tuple[tuple[int, int], ...]) -> DraftTree:
    """Fill the template from ``adjacency`` ([V, k] int32, -1 = unknown): a node whose
    parent's row is unknown is dropped with its subtree.

    Example: M[7] = [3, 5], M[3] = [9, -1]; template ((-1, 0), (0, 0), (-1, 1), (1, 1))
    -> tokens (7, 3, 9, 5), parents (-1, 0, 1, 0) (node (1, 1) is unknown, dropped).
    """
    return _expand(adjacency, root, template)[0]


def _expand(adjacency: torch.Tensor, root: int,
            template: tuple[tuple[int, int], ...]) -> tuple[DraftTree, list[int]]:
    """``expand_template`` and the template index of each drafted node."""
    cache: dict[int, list[int]] = {}

    def row(t: int) -> list[int]:
        if t not in cache:
            cache[t] = adjacency[t].tolist()
        return cache[t]

    tokens, parents, kept = [root], [-1], []
    where: list[int] = []  # template index -> tree node (-1 = dropped)
    for parent, rank in template:
        pnode = 0 if parent < 0 else where[parent]
        tok = row(tokens[pnode])[rank] if pnode >= 0 else -1
        if tok < 0:
            where.append(-1)
            continue
        where.append(len(tokens))
        kept.append(len(where) - 1)
        tokens.append(tok)
        parents.append(pnode)
    return DraftTree(tokens=tuple(tokens), parents=tuple(parents)), kept


@dataclass(frozen=True)
class TokenRecyclingOptions:
    """Token Recycling: [V, k] successor matrix from past verifications, a tree template sized by the cost curve (Luo et al. 2024)."""

    k: int = option(8, "successors kept per token")
    max_depth: int = option(8, "deepest level of the tree template")
    budget: Literal["measured", "fixed"] = option(
        "measured", "measured: the tree's size where its expected accepted tokens per unit of t(n) are best")

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_depth < 1:
            raise ValueError("token recycling needs k >= 1 and max_depth >= 1")


PROBE_EVERY = 8  # steps a cost-sized drafter that chose plain decoding waits before drafting one node again


@dataclass
class _Receipt:
    pending: tuple[DraftTree, tuple[int, ...]] | None = None  # the last proposed tree and its nodes' ranks
    idle: int = 0  # steps since the last non-empty proposal (cost sizing)


class TokenRecyclingDrafter(DeclaresFeatures):
    """Adjacency-matrix drafter. Options: ``k`` successors kept per token (8),
    ``max_depth`` of the template (8), ``rank_probs`` (the acceptance profile's prior).
    Vocabulary size ``vocab_size`` comes from the target.

    The template's rank probabilities are tracked per depth from the verified trees
    (``policies.draft_budget.RankAcceptance``, ``rank_probs`` its prior), across requests as
    the matrix is. With ``cost`` (the target's t(n), ``cost_curve``) each step drafts the
    prefix of its best-first template with the best ``(E(n) + 1) / t(n)`` (``best_size``):
    none where no size beats plain decoding, then one node every PROBE_EVERY steps so the
    tracked acceptance can recover; without it the whole budget."""

    name: ClassVar[str] = "token-recycling"

    def __init__(self, vocab_size: int, k: int = TokenRecyclingOptions.k, max_depth: int = TokenRecyclingOptions.max_depth,
                 rank_probs: tuple[float, ...] = DEFAULT_RANK_PROBS, cost: dict[int, float] | None = None):
        if vocab_size < 1 or not 1 <= k <= vocab_size or max_depth < 1:
            raise ValueError("token recycling needs vocab_size >= 1, 1 <= k <= vocab_size, max_depth >= 1")
        if len(rank_probs) < k or any(not 0 < p <= 1 for p in rank_probs):
            raise ValueError(f"rank_probs needs k={k} values in (0, 1]")
        self.k, self.max_depth = k, max_depth
        self.cost = None if cost is None else monotone(cost)  # a dip timed under load is no bargain
        self.rank_probs = tuple(rank_probs[:k])
        self._adjacency = torch.full((vocab_size, k), -1, dtype=torch.int32)  # [V, k]
        self._templates: dict[int, tuple[tuple[int, int], ...]] = {}
        self._acceptance = RankAcceptance(self.rank_probs)
        self._requests: RequestTable[_Receipt] = RequestTable()

    @property
    def adjacency(self) -> torch.Tensor:
        """[V, k] int32 read-only view of the matrix."""
        return self._adjacency.clone()

    @property
    def acceptance(self) -> RankAcceptance:
        return self._acceptance

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self._requests.add(request_id, _Receipt())

    def _template(self, size: int) -> tuple[tuple[int, int], ...]:
        if size not in self._templates:  # a pure function of (rank_probs, size, depth)
            self._templates[size] = tree_template(self.rank_probs, size, self.max_depth)
        return self._templates[size]

    def propose(self, ctx: DraftContext) -> DraftTree:
        state = self._requests.get(ctx.request_id)
        root = ctx.tokens[-1]
        if self.cost is None:
            template = self._template(ctx.budget)
            tree, kept = _expand(self._adjacency, root, template)
        else:
            template, values = valued_template(self._acceptance.profile(), ctx.budget, self.max_depth)
            tree, kept = _expand(self._adjacency, root, template)
            n = best_size([values[i] for i in kept], self.cost)[0]
            if n == 0 and kept and state.idle >= PROBE_EVERY:
                n = 1
            state.idle = 0 if n else state.idle + 1
            tree, kept = DraftTree(tree.tokens[: n + 1], tree.parents[: n + 1]), kept[:n]
        state.pending = (tree, tuple(template[i][1] for i in kept))
        return tree

    def observe(self, obs: Observation) -> None:
        """Row ``tokens[i]`` <- top-k of the target logits at node i, for every node; the
        acceptance of the ranks this drafter proposed, when the tree is its own."""
        state = self._requests.get(obs.request_id)
        pending, state.pending = state.pending, None
        if pending is not None and pending[0] is obs.tree and obs.tree.num_drafted:
            tree, ranks = pending
            on_path = {0, *obs.path}
            depths = tree.depths
            self._acceptance.update([(depths[i], ranks[i - 1], i in on_path)
                                     for i in range(1, tree.size) if tree.parents[i] in on_path])
        last = {t: i for i, t in enumerate(obs.tree.tokens)}  # a repeated token: its last node
        nodes = torch.tensor(list(last.values()), dtype=torch.long)
        top = obs.logits[nodes].topk(self.k, dim=-1).indices.to(torch.int32).cpu()  # [M, k]
        self._adjacency[torch.tensor(list(last), dtype=torch.long)] = top

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id)

    def reset(self) -> None:
        """Forget every successor and acceptance learned so far (the matrix starts empty again)."""
        self._adjacency.fill_(-1)
        self._acceptance.reset()

    def memory_bytes(self) -> int:
        return self._adjacency.numel() * self._adjacency.element_size()
