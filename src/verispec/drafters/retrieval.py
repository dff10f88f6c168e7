"""Retrieval drafting, REST (He et al. 2024, "REST: Retrieval-Based Speculative Decoding",
arXiv 2311.08252).

A read-only datastore of token sequences (a corpus tokenized with the target's
tokenizer) is indexed by a suffix array. To draft, the longest suffix of the context
(``max_match`` down to ``min_match`` tokens) is looked up exactly; the continuations of
its occurrences (at most ``max_candidates`` of them, spread evenly over the match range)
are merged into a trie with counts and the ``budget`` most frequent nodes are proposed
(best-first by count, so parents precede children and siblings come by frequency).

Datastore layout (``.npz``, written by ``verispec datastore build``):
  tokens        [T] int32, documents separated by ``SEPARATOR`` (-1)
  suffix_array  [S] int32, every non-separator position, sorted by the first ``depth``
                tokens of the suffix that starts there (-1 / the array end sort first)
  depth         the sort depth; lookups of up to ``depth`` tokens are exact
  fingerprint   sha256 of the tokenizer vocabulary (the drafter refuses another tokenizer)
Memory: 8 bytes per token (tokens + suffix array), bounded at build time by ``max_tokens``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..tree import DraftTree
from .base import DeclaresFeatures, DraftContext, Observation, RequestTable
from .options import option

SEPARATOR = -1


def suffix_array(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Start positions of all non-separator suffixes, sorted lexicographically by their
    first ``depth`` tokens (prefix doubling; positions past the end read as SEPARATOR,
    ties keep position order).

    Example: tokens [2, 1, 2, 1, -1, 2], depth 8 -> [3, 1, 5, 2, 0], the suffixes
    [1, -1, ..], [1, 2, 1, -1, ..], [2], [2, 1, -1, ..], [2, 1, 2, 1, -1, ..]."""
    n = len(tokens)
    rank = tokens.astype(np.int64) + 1  # SEPARATOR -> 0, below every token
    k = 1
    while k < depth:
        second = np.zeros(n, dtype=np.int64)  # past the end reads as 0, below every rank
        if k < n:
            second[: n - k] = rank[k:]
        order = np.lexsort((second, rank))
        pair_first, pair_second = rank[order], second[order]
        new_group = np.empty(n, dtype=bool)
        new_group[:1] = True
        new_group[1:] = (pair_first[1:] != pair_first[:-1]) | (pair_second[1:] != pair_second[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new_group)  # dense ranks of the first 2k tokens, >= 1
        k *= 2
        if new_group.sum() == n:
            break  # all suffixes already distinct
    order = np.argsort(rank, kind="stable")
    return order[tokens[order] != SEPARATOR].astype(np.int32)


@dataclass(frozen=True)
class Datastore:
    tokens: np.ndarray  # [T] int32
    suffix_array: np.ndarray  # [S] int32
    depth: int
    fingerprint: str = ""

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.suffix_array.nbytes)

    def save(self, path: str | Path) -> None:
        np.savez(Path(path), tokens=self.tokens, suffix_array=self.suffix_array,
                 depth=np.int64(self.depth), fingerprint=np.str_(self.fingerprint))

    @staticmethod
    def load(path: str | Path) -> "Datastore":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"datastore {path} does not exist (build one with `verispec datastore build`)")
        try:
            with np.load(path, allow_pickle=False) as z:
                return Datastore(z["tokens"].astype(np.int32), z["suffix_array"].astype(np.int32),
                                 int(z["depth"]), str(z["fingerprint"]))
        except (KeyError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a verispec datastore: {e}") from None

    def check_integrity(self) -> None:
        """The suffix array is a sorted permutation of the non-separator positions."""
        want = np.flatnonzero(self.tokens != SEPARATOR)
        assert np.array_equal(np.sort(self.suffix_array), want), "suffix array is not a permutation"
        keys = [self._key(int(s), self.depth) for s in self.suffix_array]
        assert all(a <= b for a, b in zip(keys, keys[1:])), "suffix array is not sorted"

    def _key(self, start: int, m: int) -> list[int]:
        """The first ``m`` tokens at ``start``, cut at a separator (which sorts first)."""
        seg = self.tokens[start : start + m].tolist()
        if SEPARATOR in seg:
            seg = seg[: seg.index(SEPARATOR) + 1]
        return seg

    def find(self, query: list[int]) -> tuple[int, int]:
        """Suffix-array range [lo, hi) of the occurrences of ``query`` (len <= depth).

        Example: tokens [2, 1, 2, 1, -1, 2] -> find([2, 1]) == (3, 5) (starts 2 and 0)."""
        m = len(query)
        if not 0 < m <= self.depth:
            raise ValueError(f"query length must be in [1, {self.depth}]")
        sa = self.suffix_array
        lo, hi = 0, len(sa)
        while lo < hi:  # first key >= query
            mid = (lo + hi) // 2
            if self._key(int(sa[mid]), m) < query:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, len(sa)
        while lo < hi:  # first key > query (keys are cut to m tokens: equal means a match)
            mid = (lo + hi) // 2
            if self._key(int(sa[mid]), m) <= query:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def count(self, query: list[int]) -> int:
        lo, hi = self.find(query)
        return hi - lo


def build_datastore(documents: Iterable[list[int]], max_tokens: int = 10_000_000, depth: int = 64,
                    fingerprint: str = "") -> Datastore:
    """Concatenate documents (separator after each) until ``max_tokens``; index them."""
    if max_tokens < 1 or depth < 1:
        raise ValueError("a datastore needs max_tokens >= 1 and depth >= 1")
    parts, total = [], 0
    for doc in documents:
        if not doc:
            continue
        if total + len(doc) + 1 > max_tokens:
            break
        if min(doc) < 0:
            raise ValueError("token ids must be >= 0")
        parts.append(np.asarray(list(doc) + [SEPARATOR], dtype=np.int32))
        total += len(doc) + 1
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return Datastore(tokens, suffix_array(tokens, depth), depth, fingerprint)


def read_documents(path: str | Path, field: str | None = None) -> Iterable[str]:
    """Texts of a corpus file: ``.jsonl`` rows (``field``, else "text", else every string
    value joined by newlines) or a ``.txt`` file (paragraphs split at blank lines)."""
    from ..paths import parse_json_line, read_text_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus {path} does not exist")
    if path.suffix not in (".jsonl", ".txt"):
        raise ValueError(f"corpus {path} must be .txt or .jsonl")
    text = read_text_file(path, "corpus")  # UTF-8 text, or one line naming the file
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            row = parse_json_line(line, f"{path}:{n}")  # malformed, too deep or not text: one line
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n} is not a JSON object (each line must be an object, e.g. "
                                 '{"text": "..."})')
            if field is not None and field not in row:
                raise ValueError(f"{path}:{n} has no field {field!r}")
            key = field or ("text" if "text" in row else None)
            yield str(row[key]) if key else "\n".join(v for v in row.values() if isinstance(v, str))
    else:
        for para in text.split("\n\n"):
            if para.strip():
                yield para.strip()


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def longest_match(ds: Datastore, context: list[int], max_match: int, min_match: int) -> tuple[int, int, int]:
    """(lo, hi, m) for the longest suffix of ``context`` of ``min_match..max_match``
    tokens that occurs followed by at least one more token; (0, 0, 0) if none."""
    best = (0, 0, 0)
    for m in range(min_match, min(max_match, ds.depth, len(context)) + 1):
        lo, hi = ds.find(context[len(context) - m :])
        if lo == hi:
            break  # a longer suffix cannot occur either
        ends = ds.suffix_array[lo:hi].astype(np.int64) + m
        if np.any((ends < len(ds.tokens)) & (ds.tokens[np.minimum(ends, len(ds.tokens) - 1)] != SEPARATOR)):
            best = (lo, hi, m)
    return best


def continuations(ds: Datastore, lo: int, hi: int, m: int, length: int, max_candidates: int) -> list[list[int]]:
    """Up to ``length`` tokens after each of (at most ``max_candidates``, evenly spread)
    occurrences in the range, cut at separators; empty ones dropped."""
    idx = np.arange(lo, hi) if hi - lo <= max_candidates else np.linspace(lo, hi - 1, max_candidates).astype(np.int64)
    out = []
    for s in ds.suffix_array[idx].tolist():
        seg = ds.tokens[s + m : s + m + length].tolist()
        if SEPARATOR in seg:
            seg = seg[: seg.index(SEPARATOR)]
        if seg:
            out.append(seg)
    return out


def frequency_tree(root: int, conts: list[list[int]], budget: int) -> DraftTree:
    """Trie of the continuations keeping the ``budget`` most frequent nodes.

    Example: root 0, conts [[1, 2], [1, 2], [1, 3], [4]], budget 2 -> tokens (0, 1, 2):
    counts 1:3, 2:2, 3:1, 4:1."""
    counts: dict[tuple[int, ...], int] = {}
    for c in conts:
        for d in range(1, len(c) + 1):
            counts[tuple(c[:d])] = counts.get(tuple(c[:d]), 0) + 1
    kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in counts:
        kids.setdefault(path[:-1], []).append(path)
    heap = [(-counts[p], p) for p in kids.get((), [])]
    heapq.heapify(heap)
    index: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents = [root], [-1]
    while heap and len(tokens) <= budget:
        _, path = heapq.heappop(heap)
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        for child in kids.get(path, []):
            heapq.heappush(heap, (-counts[child], child))
    return DraftTree(tokens=tuple(tokens), parents=tuple(parents))


@dataclass(frozen=True)
class RestOptions:
    """REST retrieval from a suffix-array datastore (He et al. 2024)."""

    datastore: str = option("", "the datastore file (.npz; build one with `verispec datastore build`); required")
    max_match: int = option(16, "longest context suffix looked up")
    min_match: int = option(2, "shortest context suffix looked up")
    max_candidates: int = option(256, "continuations read from the datastore at most")

    def __post_init__(self) -> None:
        if not self.datastore:
            raise ValueError("needs -o datastore=<file.npz> (build one with `verispec datastore build`)")
        if not 1 <= self.min_match <= self.max_match or self.max_candidates < 1:
            raise ValueError("rest needs 1 <= min_match <= max_match and max_candidates >= 1")


class RetrievalDrafter(DeclaresFeatures):
    """REST over a read-only ``Datastore``. Options: ``max_match`` (16), ``min_match`` (2),
    ``max_candidates`` occurrences read per step (256)."""

    name: ClassVar[str] = "rest"

    def __init__(self, datastore: Datastore, max_match: int = RestOptions.max_match, min_match: int = RestOptions.min_match,
                 max_candidates: int = RestOptions.max_candidates):
        if not 1 <= min_match <= max_match or max_candidates < 1:
            raise ValueError("rest needs 1 <= min_match <= max_match and max_candidates >= 1")
        self.datastore = datastore
        self.max_match, self.min_match, self.max_candidates = max_match, min_match, max_candidates
        self._requests: RequestTable[None] = RequestTable()

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self._requests.add(request_id, None)

    def propose(self, ctx: DraftContext) -> DraftTree:
        self._requests.get(ctx.request_id)
        lo, hi, m = longest_match(self.datastore, ctx.tokens, self.max_match, self.min_match)
        if hi == lo:
            return DraftTree.chain(ctx.tokens[-1], [])
        conts = continuations(self.datastore, lo, hi, m, ctx.budget, self.max_candidates)
        return frequency_tree(ctx.tokens[-1], conts, ctx.budget)

    def observe(self, obs: Observation) -> None:
        self._requests.get(obs.request_id)

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id)

    def memory_bytes(self) -> int:
        return self.datastore.nbytes
