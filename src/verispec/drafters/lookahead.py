"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding", arXiv 2402.02057).

Two branches ride in the same target forward:

* the *lookahead branch*, a Jacobi window of ``W`` columns. Column j holds the
  trajectory of guesses for one future position, oldest first: ``[a_j^0, ..., a_j^{f-1}]``
  (``f <= N - 1``). The target's argmax after the newest guess ``a_j^{f-1}`` is the
  column's next Jacobi iterate. When a column is full (f = N - 1) the n-gram
  ``(a_j^0, ..., a_j^{N-2}, new)`` is harvested into the pool and the trajectory shifts.
* the *verification branch*: up to ``G`` cached (N-1)-token continuations of the root
  token from the n-gram pool, merged into a trie.

The mask realised with the DraftTree (node 0 = root, the newest committed token)::

    root ── a_0^0 ── a_1^0 ── a_2^0 ── ...       the spine: oldest guesses, a causal chain
              │        │        │
            a_0^1    a_1^1    a_2^1              each column's newer guesses hang from
              │        │        │                its oldest one as a chain (the teeth)
            a_0^2    a_1^2    a_2^2
    root ── verification trie (pool continuations of root, shared prefixes once)

so ``a_j^l`` (position root + j + l + 1) attends to the prefix, the root, ``a_0^0 ..
a_j^0`` and ``a_j^1 .. a_j^l``. This is the paper's lookahead mask (its Fig. 2: each
token sees the first level up to its column and the earlier levels of its own column;
TensorRT-LLM's ``LookaheadAlgorithm`` builds the same comb from position ids). The
differences: (1) the paper feeds the current token as the oldest guess of column 0 and
keeps a window of W - 1 further columns, here every column keeps its full trajectory
below the root; (2) the paper verifies G independent n-grams, here they share prefixes in
a trie; (3) the window nodes are also ordinary draft nodes, so the verifier may accept a
window path the target agrees with (lossless either way: the verifier only accepts what
the target would emit). Window guesses always advance by argmax (Jacobi), also when the
request samples; the drafts are point masses.

The pool also receives every n-gram of the prompt and of the committed output (as
TensorRT-LLM and LADE's prompt pool do). It is per request; at most ``G`` continuations
per key and ``max_keys`` keys, both LRU. Memory bound: ``max_keys * G * (N - 1)`` stored
tokens (~``max_keys * G * (8 * (N - 1) + 64)`` bytes as Python tuples) per request.

Budget: the window wants ``W * (N - 1)`` nodes, the verification branch up to
``G * (N - 1)``. Half the step budget is offered to the window (whole columns), the
verification trie takes what it needs of the rest, and any remainder goes back to the
window. Columns that do not fit are not fed and keep their state. Use a budget of
``(W + G) * (N - 1)`` (e.g. ``-k 30`` for the defaults) to run the full algorithm.

``propose`` records which tree nodes are window columns (a receipt read by the next
``observe``); that is the only state it touches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar

from ..tree import DraftTree
from .base import DeclaresFeatures, DraftContext, Observation, RequestTable
from .options import option

NGRAM_ENTRY_BYTES = 64  # a tuple header + an OrderedDict slot, per stored continuation
TOKEN_REF_BYTES = 8


class NgramPool:
    """token -> up to ``per_key`` continuations (tuples), most recently seen first; at most
    ``max_keys`` keys, least recently touched key evicted first.

    Example: per_key 2; add (5, 1, 2), (5, 3, 4), (5, 1, 2), (5, 7, 7) -> get(5) ==
    [(7, 7), (1, 2)] ((3, 4) was least recent when the third continuation arrived).
    """

    def __init__(self, per_key: int, max_keys: int):
        if per_key < 1 or max_keys < 1:
            raise ValueError("an n-gram pool needs per_key >= 1 and max_keys >= 1")
        self.per_key, self.max_keys = per_key, max_keys
        self._pool: OrderedDict[int, OrderedDict[tuple[int, ...], None]] = OrderedDict()
        self._entries = 0
        self._tokens = 0

    def add(self, ngram: tuple[int, ...]) -> None:
        key, cont = ngram[0], tuple(ngram[1:])
        if not cont:
            return
        if key not in self._pool:
            self._pool[key] = OrderedDict()
            if len(self._pool) > self.max_keys:
                _, evicted = self._pool.popitem(last=False)
                self._entries -= len(evicted)
                self._tokens -= sum(len(c) for c in evicted)
        self._pool.move_to_end(key)
        conts = self._pool[key]
        if cont in conts:
            conts.move_to_end(cont)
            return
        conts[cont] = None
        self._entries += 1
        self._tokens += len(cont)
        if len(conts) > self.per_key:
            old, _ = conts.popitem(last=False)
            self._entries -= 1
            self._tokens -= len(old)

    def get(self, key: int) -> list[tuple[int, ...]]:
        return list(reversed(self._pool.get(key, {})))

    def __len__(self) -> int:
        return self._entries

    def memory_bytes(self) -> int:
        return self._entries * NGRAM_ENTRY_BYTES + self._tokens * TOKEN_REF_BYTES


def add_ngrams(pool: NgramPool, tokens: list[int], n: int, first_end: int = 0) -> None:
    """Add every n-gram of ``tokens`` that ends at index >= ``first_end`` (0: all)."""
    for end in range(max(first_end, n - 1), len(tokens)):
        pool.add(tuple(tokens[end - n + 1 : end + 1]))


@dataclass(frozen=True)
class WindowLayout:
    """Where the window went in the last proposed tree: per fed column, its last node."""

    tree: DraftTree  # observe uses the layout only for this very tree
    last_nodes: tuple[int, ...]


def build_tree(root: int, paths: list[list[int]], columns: list[list[int]]) -> tuple[DraftTree, tuple[int, ...]]:
    """Verification trie of ``paths`` followed by the window comb of ``columns``; returns
    the tree and the node index of each column's newest guess.

    Example: root 9, paths [[4, 5]], columns [[1, 2], [3, 6]] -> tokens (9, 4, 5, 1, 2, 3, 6),
    parents (-1, 0, 1, 0, 3, 3, 5): spine 1 -> 3, teeth 1 -> 2 and 3 -> 6; last nodes (4, 6).
    """
    trie = DraftTree.from_paths(root, paths)
    tokens, parents = list(trie.tokens), list(trie.parents)
    spine, last = 0, []
    for col in columns:
        tokens.append(col[0])
        parents.append(spine)
        spine = len(tokens) - 1
        for tok in col[1:]:
            tokens.append(tok)
            parents.append(len(tokens) - 2)
        last.append(len(tokens) - 1)
    return DraftTree(tokens=tuple(tokens), parents=tuple(parents)), tuple(last)


def fit_paths(root: int, paths: list[list[int]], budget: int) -> list[list[int]]:
    """The most preferred candidates whose trie has at most ``budget`` nodes (the last
    one cut short when even a single candidate does not fit)."""
    while paths and DraftTree.from_paths(root, paths).num_drafted > budget:
        paths = paths[:-1] if len(paths) > 1 else [paths[0][:budget]]
    return [p for p in paths if p]


@dataclass
class _LookaheadState:
    columns: list[list[int]]  # W trajectories, oldest guess first
    pool: NgramPool
    history: list[int]  # the N - 1 committed tokens before the newest one (the next root)
    pending: WindowLayout | None = None
    harvested: int = field(default=0)


@dataclass(frozen=True)
class LookaheadOptions:
    """Lookahead decoding: Jacobi window + n-gram pool in one forward; give -k >= (window+guesses)*(ngram-1) (Fu et al. 2024)."""

    window: int = option(5, "Jacobi window width")
    ngram: int = option(4, "n-gram length of the pool")
    guesses: int = option(5, "n-grams verified per step")
    max_keys: int = option(8192, "keys the n-gram pool holds at most")

    def __post_init__(self) -> None:
        if self.window < 1 or self.ngram < 2 or self.guesses < 1 or self.max_keys < 1:
            raise ValueError("lookahead needs window >= 1, ngram >= 2, guesses >= 1, max_keys >= 1")


class LookaheadDrafter(DeclaresFeatures):
    """Jacobi window + n-gram pool. Options: ``window`` W (5), ``ngram`` N (4),
    ``guesses`` G per key (5), ``max_keys`` per request pool (8192)."""

    name: ClassVar[str] = "lookahead"

    def __init__(self, window: int = LookaheadOptions.window, ngram: int = LookaheadOptions.ngram, guesses: int = LookaheadOptions.guesses,
                 max_keys: int = LookaheadOptions.max_keys):
        if window < 1 or ngram < 2 or guesses < 1 or max_keys < 1:
            raise ValueError("lookahead needs window >= 1, ngram >= 2, guesses >= 1, max_keys >= 1")
        self.W, self.N, self.G, self.max_keys = window, ngram, guesses, max_keys
        self._requests: RequestTable[_LookaheadState] = RequestTable()

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        pool = NgramPool(self.G, self.max_keys)
        add_ngrams(pool, prompt_ids, self.N)
        # initial guesses: prompt tokens spread over the prompt (the paper draws them at
        # random from the prompt; a fixed spread keeps runs deterministic)
        step = max(1, len(prompt_ids) // self.W)
        columns = [[prompt_ids[(j * step) % len(prompt_ids)]] for j in range(self.W)]
        self._requests.add(request_id, _LookaheadState(columns, pool, list(prompt_ids[-(self.N - 1):])))

    def propose(self, ctx: DraftContext) -> DraftTree:
        state = self._requests.get(ctx.request_id)
        root, budget = ctx.tokens[-1], ctx.budget
        widths = [len(c) for c in state.columns]
        offered = _columns_within(widths, budget // 2)
        paths = fit_paths(root, [list(p) for p in state.pool.get(root)[: self.G]],
                          budget - sum(widths[:offered]))
        used = DraftTree.from_paths(root, paths).num_drafted if paths else 0
        fed = _columns_within(widths, budget - used)
        tree, last = build_tree(root, paths, state.columns[:fed])
        state.pending = WindowLayout(tree, last)
        return tree

    def observe(self, obs: Observation) -> None:
        state = self._requests.get(obs.request_id)
        layout, state.pending = state.pending, None
        if layout is not None and layout.tree is obs.tree and layout.last_nodes:
            guesses = obs.logits[list(layout.last_nodes)].argmax(-1).tolist()
            for col, new in zip(state.columns, guesses):  # one Jacobi iteration per fed column
                col.append(int(new))
                if len(col) == self.N:  # full trajectory + new iterate: an n-gram
                    state.pool.add(tuple(col))
                    state.harvested += 1
                    del col[0]
        # the root is included because the prefill's token reaches no observation but
        # is the first step's root (re-adding a known n-gram only refreshes it)
        recent = state.history + [obs.tree.tokens[0], *obs.new_tokens]
        add_ngrams(state.pool, recent, self.N, first_end=len(state.history))
        state.history = recent[:-1][-(self.N - 1):]

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id)

    def memory_bytes(self) -> int:
        per_window = self.W * (self.N - 1) * TOKEN_REF_BYTES
        return sum(s.pool.memory_bytes() + per_window for s in self._requests.values())


def _columns_within(widths: list[int], budget: int) -> int:
    """How many leading columns fit in ``budget`` nodes."""
    total = 0
    for i, w in enumerate(widths):
        total += w
        if total > budget:
            return i
    return len(widths)
