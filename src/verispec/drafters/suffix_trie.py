"""A depth-capped suffix trie with occurrence counts over several documents: the data structure
of SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; the drafter that uses it is ``suffix_tree.py``).
It counts every substring of length <= ``max_depth`` and grows, from a matched suffix, the
continuation tree of highest empirical path probability (``SuffixTrie.speculate``).

Glossary:
  document   one token sequence in a trie (the request's prompt + output, or one earlier
             response); suffixes never cross documents.
  occurrence a (document, start) pair; the trie counts occurrences of every substring of
             length <= ``max_depth`` (a depth-capped suffix trie, as ArcticInference's
             ``max_depth = 64``; deeper context never improves a draft of <= 64 tokens).
  leaf ref   ``leaf(doc, pos)`` (one int, ``doc << 32 | pos``) stored in place of a child
             node whose count is 1: that substring occurs once, so everything below it is
             the document itself,
             ``doc[pos + 1], doc[pos + 2], ...`` (implicit chain, count 1). Materialising
             only repeated substrings keeps the node count near the number of repeats,
             not ``tokens x max_depth``.

Memory (documented bound): each document costs 4 bytes per token (``array('i')``); each
materialised node about ``NODE_BYTES`` and each leaf ref ``LEAF_BYTES`` (CPython 3.11,
measured: about 250 bytes per indexed token on GSM8K answers). Materialised
nodes are substrings that occur at least twice (count-1 nodes remain only after an
eviction), so they number at most ``tokens x max_depth`` and in practice about the
number of repeated n-grams. ``memory_bytes()`` reports this estimate (the drafter caps its global
trie at ``max_global_tokens`` tokens).
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Union

from ..tree import DraftTree

NODE_BYTES = 48 + 224  # a two-slot object + a small dict (<= 5 children)
LEAF_BYTES = 32 + 20  # an int object + its share of the parent's dict
TOKEN_BYTES = 4
_SHIFT = 32


def leaf(doc: int, pos: int) -> int:
    """A leaf ref as one int: leaf(3, 7) == 3 << 32 | 7."""
    return doc << _SHIFT | pos


def unleaf(ref: int) -> tuple[int, int]:
    """(doc, pos) of a leaf ref: unleaf(leaf(3, 7)) == (3, 7)."""
    return ref >> _SHIFT, ref & ((1 << _SHIFT) - 1)


class _Node:
    """A materialised trie node. ``count``: occurrences of the node's string (>= 1);
    ``children``: token -> _Node or leaf ref (an int); sum of the children's counts
    <= count (an occurrence at a document end or at depth ``max_depth`` has no child)."""

    __slots__ = ("count", "children")

    def __init__(self, count: int):
        self.count = count
        self.children: dict[int, Union[_Node, int]] = {}


class _Cursor(NamedTuple):
    """A position in the trie: a materialised ``node``, or (``node is None``) the implicit
    chain of one occurrence whose current token is ``docs[doc][pos]``."""

    node: _Node | None
    doc: int
    pos: int
    depth: int  # length of the string spelled from the root


@dataclass(frozen=True)
class SuffixDraft:
    """A continuation tree below a matched suffix. ``parents[i]`` indexes ``tokens`` (-1 =
    attached to the match, i.e. the draft root); parents precede children, siblings are in
    decreasing probability."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]  # path probability of each node
    match_length: int
    sources: tuple[int, ...] = ()  # documents the drafted continuation was read from (a global trie's recency)

    @property
    def score(self) -> float:
        return sum(self.probs)

    def to_tree(self, root: int) -> DraftTree:
        return DraftTree(tokens=(root, *self.tokens), parents=(-1, *(p + 1 for p in self.parents)))


EMPTY_DRAFT = SuffixDraft((), (), (), 0)


class SuffixTrie:
    """Depth-capped suffix trie with occurrence counts over several documents.

    Invariants (``check_integrity`` verifies them against brute-force counting):
      * for every string s with 1 <= len(s) <= max_depth, ``count(s)`` equals the number of
        occurrences (doc, i) with ``doc[i : i + len(s)] == s``;
      * a child stored as a leaf ref ``leaf(doc, pos)`` at depth d spells ``doc[pos-d+1 : pos+1]``
        and that string occurs exactly once;
      * ``root.count`` is the total number of tokens (every occurrence starts at the root);
      * ``_active[doc]`` (growing documents only) holds, for each suffix of the document
        shorter than max_depth that ends at a materialised node, that node and its depth.

    Example::

        t = SuffixTrie(max_depth=4); t.add_document(0); t.extend(0, [1, 2, 3, 1, 2])
        t.count([1, 2]) == 2; t.count([2, 3, 1]) == 1; t.count([3, 3]) == 0
    """

    def __init__(self, max_depth: int = 64):
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth
        self._root = _Node(0)
        self._docs: dict[int, array] = {}
        self._active: dict[int, list[tuple[_Node, int]]] = {}
        self._num_nodes = 1
        self._num_edges = 0

    # ---- read-only views -----------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._root.count

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def documents(self) -> list[int]:
        return list(self._docs)

    def document(self, doc_id: int) -> list[int]:
        return list(self._docs[doc_id])

    def memory_bytes(self) -> int:
        leaves = self._num_edges - (self._num_nodes - 1)  # edges not leading to a node
        return self._num_nodes * NODE_BYTES + leaves * LEAF_BYTES + self.num_tokens * TOKEN_BYTES

    # ---- updates -------------------------------------------------------------------------
    def add_document(self, doc_id: int, tokens: list[int] = (), sealed: bool = False) -> None:
        """Start a document (optionally with tokens). A sealed document cannot grow, which
        frees its active-suffix list (used for the global trie's finished responses)."""
        if doc_id in self._docs:
            raise ValueError(f"document {doc_id} already exists")
        self._docs[doc_id] = array("i")
        self._active[doc_id] = []
        self.extend(doc_id, tokens)
        if sealed:
            del self._active[doc_id]

    def extend(self, doc_id: int, tokens: list[int]) -> None:
        """Append tokens to a growing document, updating every suffix that ends there."""
        if doc_id not in self._active:
            raise ValueError(f"document {doc_id} is unknown or sealed")
        for t in tokens:
            self._append(doc_id, int(t))

    def _append(self, doc_id: int, t: int) -> None:
        doc, D = self._docs[doc_id], self.max_depth
        n = len(doc)
        doc.append(t)
        self._root.count += 1
        active: list[tuple[_Node, int]] = []
        for node, depth in self._active[doc_id] + [(self._root, 0)]:  # longest suffix first
            if depth == D:
                continue  # the suffix is max_depth long: it stops growing
            child = node.children.get(t)
            if child is None:  # first occurrence: a leaf ref; the suffix goes implicit
                node.children[t] = leaf(doc_id, n)
                self._num_edges += 1
            elif isinstance(child, int):  # second occurrence: materialise, split the chain
                node.children[t] = self._split(child, depth + 1)
                active.append((node.children[t], depth + 1))
            else:
                child.count += 1
                active.append((child, depth + 1))
        self._active[doc_id] = active

    def _split(self, ref: int, depth: int) -> _Node:
        """Materialise a count-1 leaf at ``depth`` that a second occurrence now reaches."""
        other, pos = unleaf(ref)
        node = _Node(2)
        self._num_nodes += 1
        odoc = self._docs[other]
        if pos + 1 < len(odoc) and depth + 1 <= self.max_depth:
            node.children[odoc[pos + 1]] = leaf(other, pos + 1)
            self._num_edges += 1
        return node

    def remove_document(self, doc_id: int) -> None:
        """Remove every occurrence of a document (eviction). Nodes whose count drops to 0
        disappear; nodes left with count 1 stay materialised (still exact)."""
        if doc_id not in self._docs:
            raise ValueError(f"document {doc_id} is unknown")
        doc = self._docs[doc_id]
        for i in range(len(doc)):
            self._remove_occurrence(doc_id, doc, i)
        self._root.count -= len(doc)
        del self._docs[doc_id]
        self._active.pop(doc_id, None)

    def _remove_occurrence(self, doc_id: int, doc: array, start: int) -> None:
        node = self._root
        for pos in range(start, min(len(doc), start + self.max_depth)):
            child = node.children[doc[pos]]
            if isinstance(child, int):  # count 1: this occurrence's own implicit chain
                assert child == leaf(doc_id, pos), f"leaf {unleaf(child)} is not ({doc_id}, {pos})"
                del node.children[doc[pos]]
                self._num_edges -= 1
                return
            child.count -= 1
            if child.count == 0:  # everything below belonged to this occurrence alone
                del node.children[doc[pos]]
                self._drop_subtree(child)
                return
            node = child

    def _drop_subtree(self, node: _Node) -> None:
        """Forget a detached subtree: its nodes, its edges and the edge that led to it."""
        self._num_edges -= 1
        stack = [node]
        while stack:
            n = stack.pop()
            self._num_nodes -= 1
            for c in n.children.values():
                self._num_edges -= 1
                if isinstance(c, _Node):
                    stack.append(c)

    # ---- queries -------------------------------------------------------------------------
    def _child(self, cur: _Cursor, t: int) -> _Cursor | None:
        if cur.node is None:
            doc = self._docs[cur.doc]
            ok = cur.depth < self.max_depth and cur.pos + 1 < len(doc) and doc[cur.pos + 1] == t
            return _Cursor(None, cur.doc, cur.pos + 1, cur.depth + 1) if ok else None
        child = cur.node.children.get(t)
        if child is None:
            return None
        if isinstance(child, int):
            return _Cursor(None, *unleaf(child), cur.depth + 1)
        return _Cursor(child, -1, -1, cur.depth + 1)

    def _children(self, cur: _Cursor) -> list[tuple[int, int, _Cursor]]:
        """(token, count, cursor) of every continuation of ``cur``."""
        if cur.node is None:
            doc = self._docs[cur.doc]
            if cur.depth < self.max_depth and cur.pos + 1 < len(doc):
                return [(doc[cur.pos + 1], 1, _Cursor(None, cur.doc, cur.pos + 1, cur.depth + 1))]
            return []
        out = []
        for t, c in cur.node.children.items():
            if isinstance(c, int):
                out.append((t, 1, _Cursor(None, *unleaf(c), cur.depth + 1)))
            else:
                out.append((t, c.count, _Cursor(c, -1, -1, cur.depth + 1)))
        return out

    def _walk(self, seq: list[int]) -> _Cursor | None:
        cur = _Cursor(self._root, -1, -1, 0)
        for t in seq:
            cur = self._child(cur, t)
            if cur is None:
                return None
        return cur

    def count(self, seq: list[int]) -> int:
        """Occurrences of ``seq`` (len <= max_depth) across all documents."""
        if len(seq) > self.max_depth:
            raise ValueError(f"sequences longer than max_depth={self.max_depth} are not indexed")
        cur = self._walk(seq)
        if cur is None:
            return 0
        return cur.node.count if cur.node is not None else 1

    def match(self, context: list[int], max_length: int) -> tuple[_Cursor | None, int]:
        """Longest suffix of ``context`` (at most ``max_length`` tokens) that occurs with a
        continuation; returns its cursor and length, or (None, 0).

        Example: documents [[1, 2, 3, 1, 2]], context [9, 1, 2] -> the node of [1, 2]
        (length 2; continuation 3). Longer suffixes are tried only while shorter ones
        occur, since a string occurs no more often than its suffixes."""
        best, best_len = None, 0
        for m in range(1, min(max_length, len(context), self.max_depth - 1) + 1):
            cur = self._walk(context[len(context) - m :])
            if cur is None or not self._children(cur):
                break  # a longer suffix cannot occur (with a continuation) either
            best, best_len = cur, m
        return best, best_len

    def speculate(self, context: list[int], max_tokens: int, max_match: int,
                  max_spec_factor: float, min_token_prob: float) -> SuffixDraft:
        """Best-first continuation tree of the longest matched suffix of ``context``."""
        cur, m = self.match(context, max_match)
        limit = min(max_tokens, math.floor(max_spec_factor * m + 1e-9))
        if cur is None or limit <= 0:
            return EMPTY_DRAFT
        tokens, parents, probs = [], [], []
        heap = []  # (-path prob, tie-break, parent draft index, token, cursor)
        tick = 0

        def push(c: _Cursor, parent: int, prob: float) -> None:
            nonlocal tick
            kids = self._children(c)
            total = sum(k[1] for k in kids)
            for t, n, kc in kids:
                heapq.heappush(heap, (-prob * (n / total), tick, parent, t, kc))  # n/total <= 1: never above prob
                tick += 1

        push(cur, -1, 1.0)
        sources: dict[int, None] = {}  # documents of the drafted nodes (insertion-ordered set)
        last = cur
        while heap and len(tokens) < limit:
            neg, _, parent, t, kc = heapq.heappop(heap)
            if -neg < min_token_prob:
                break  # every remaining node is at most this likely
            tokens.append(t)
            parents.append(parent)
            probs.append(-neg)
            push(kc, len(tokens) - 1, -neg)
            if kc.node is None:
                sources[kc.doc] = None
            last = kc
        if tokens and not sources and (doc := self.source(last)) is not None:
            sources[doc] = None
        return SuffixDraft(tuple(tokens), tuple(parents), tuple(probs), m, tuple(sources))

    def source(self, cur: _Cursor) -> int | None:
        """A document holding the string ``cur`` spells (its own for an implicit chain; below a
        materialised node, the first leaf ref reached going down), or None where none is below."""
        node = cur.node
        for _ in range(self.max_depth + 1):
            if node is None:
                return cur.doc
            child = next(iter(node.children.values()), None)
            if child is None:
                return None
            if isinstance(child, int):
                return unleaf(child)[0]
            node = child
        return None

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Verify the invariants above by brute force (for tests; O(nodes x tokens))."""
        docs = {d: list(a) for d, a in self._docs.items()}
        assert self._root.count == sum(len(d) for d in docs.values()), "root count"

        def brute(s: tuple[int, ...]) -> int:
            n = len(s)
            return sum(1 for d in docs.values() for i in range(len(d) - n + 1) if tuple(d[i:i + n]) == s)

        nodes, edges = 1, 0
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, s = stack.pop()
            assert node.count >= 1 or not s, f"node {s} has count {node.count}"
            if s:
                assert node.count == brute(s), f"count({s}) = {node.count}, brute {brute(s)}"
            child_total = 0
            for t, c in node.children.items():
                edges += 1
                assert len(s) < self.max_depth, f"node {s} deeper than max_depth"
                if isinstance(c, int):
                    d, pos = unleaf(c)
                    span = tuple(docs[d][pos - len(s): pos + 1])
                    assert span == s + (t,), f"leaf {c} spells {span}, expected {s + (t,)}"
                    assert brute(span) == 1, f"leaf {span} occurs {brute(span)} times"
                    child_total += 1
                else:
                    nodes += 1
                    child_total += c.count
                    stack.append((c, s + (t,)))
            assert child_total <= node.count or not s, f"children of {s} outnumber it"
        assert nodes == self._num_nodes, f"node counter {self._num_nodes}, actual {nodes}"
        assert edges == self._num_edges, f"edge counter {self._num_edges}, actual {edges}"
        for d, active in self._active.items():
            for node, depth in active:
                tail = tuple(docs[d][len(docs[d]) - depth:])
                assert self._walk(list(tail)) == _Cursor(node, -1, -1, depth), f"active {tail}"
