"""Lookahead decoding: the n-gram pool (LRU per key and over keys), the tree layout (comb
+ verification trie), budget splitting and the Jacobi window update from target logits."""

from __future__ import annotations

import pytest
import torch

from verispec.drafters.base import DraftContext, Observation
from verispec.drafters.lookahead import LookaheadDrafter, NgramPool, add_ngrams, build_tree, fit_paths
from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.types import SamplingParams


def test_pool_lru_docstring_example():
    pool = NgramPool(per_key=2, max_keys=10)
    for g in [(5, 1, 2), (5, 3, 4), (5, 1, 2), (5, 7, 7)]:
        pool.add(g)
    assert pool.get(5) == [(7, 7), (1, 2)]
    assert pool.get(6) == [] and len(pool) == 2


def test_pool_evicts_least_recent_key():
    pool = NgramPool(per_key=3, max_keys=2)
    pool.add((1, 9))
    pool.add((2, 9))
    pool.add((1, 8))  # touches key 1
    pool.add((3, 9))  # evicts key 2
    assert pool.get(2) == [] and pool.get(1) == [(8,), (9,)] and pool.get(3) == [(9,)]
    assert len(pool) == 3 and pool.memory_bytes() > 0


def test_add_ngrams():
    pool = NgramPool(per_key=4, max_keys=10)
    add_ngrams(pool, [1, 2, 3, 4, 1, 2, 5], n=3)
    assert pool.get(1) == [(2, 5), (2, 3)] and pool.get(4) == [(1, 2)]


def test_build_tree_docstring_example():
    tree, last = build_tree(9, [[4, 5]], [[1, 2], [3, 6]])
    assert tree.tokens == (9, 4, 5, 1, 2, 3, 6) and tree.parents == (-1, 0, 1, 0, 3, 3, 5)
    assert last == (4, 6)
    mask = tree.ancestor_mask()
    assert mask[6].nonzero().flatten().tolist() == [0, 3, 5, 6]  # root, a_0^0, a_1^0, a_1^1
    assert tree.depths[6] == 3  # position root + j + l + 1 for j = 1, l = 1


def test_fit_paths_trims_least_preferred():
    assert fit_paths(0, [[1, 2, 3], [1, 4, 5], [6, 7, 8]], 5) == [[1, 2, 3], [1, 4, 5]]
    assert fit_paths(0, [[1, 2, 3]], 2) == [[1, 2]]
    assert fit_paths(0, [[1, 2, 3]], 0) == []


def _ctx(tokens, budget):
    return DraftContext("r", tokens, budget, SamplingParams(), make_generator(0, 1))


def test_window_advances_harvests_and_verifies():
    d = LookaheadDrafter(window=2, ngram=3, guesses=2)
    prompt = [10, 11, 12, 13]
    d.start("r", prompt)
    state = d._requests.get("r")
    assert [c[0] for c in state.columns] == [10, 12]  # spread over the prompt
    tokens = prompt + [20]  # 20: the prefill's token, the first root
    tree = d.propose(_ctx(tokens, 8))
    assert tree.tokens == (20, 10, 12) and tree.parents == (-1, 0, 1)  # pool knows nothing after 20
    logits = torch.zeros(3, 40)
    logits[0, 21] = logits[1, 30] = logits[2, 31] = 1.0  # argmax after each window node
    d.observe(Observation("r", tree, [], [21], logits, None))
    assert state.columns == [[10, 30], [12, 31]]
    assert d._requests.get("r").pool.get(13) == [(20, 21)]  # n-grams of the committed text
    tokens.append(21)
    tree = d.propose(_ctx(tokens, 8))
    # window comb: 10 -> 12 spine, teeth 10 -> 30 and 12 -> 31
    assert tree.tokens == (21, 10, 30, 12, 31) and tree.parents == (-1, 0, 1, 1, 3)
    logits = torch.zeros(5, 40)
    logits[0, 22] = logits[2, 32] = logits[4, 33] = 1.0
    d.observe(Observation("r", tree, [], [22], logits, None))
    assert state.columns == [[30, 32], [31, 33]]
    # harvested, most recent first (the prompt's n-grams are in the pool too)
    assert state.pool.get(10) == [(30, 32), (11, 12)] and state.pool.get(12)[0] == (31, 33)
    # a root the pool knows: the verification trie comes first, then the window
    tree = d.propose(_ctx(tokens + [22, 12], 12))
    trie = DraftTree.from_paths(12, [list(p) for p in state.pool.get(12)])
    assert trie.num_drafted == 4 and tree.tokens[:5] == trie.tokens and tree.parents[:5] == trie.parents
    assert tree.tokens[5:] == (30, 32, 31, 33)


def test_budget_split_and_unfed_columns_keep_state():
    d = LookaheadDrafter(window=4, ngram=3, guesses=3)
    d.start("r", [1, 2, 3, 1, 2, 4, 1, 2, 5])
    tree = d.propose(_ctx([1, 2, 3, 1, 2, 4, 1, 2, 5, 1], 5))
    assert tree.num_drafted <= 5
    # half the budget (2 columns of 1) for the window, 3 nodes for the pool's [2, x] paths
    assert tree.tokens[1] == 2 and tree.num_drafted == 5
    state = d._requests.get("r")
    before = [list(c) for c in state.columns]
    d.observe(Observation("r", tree, [], [7], torch.zeros(tree.size, 10), None))
    fed = [len(c) for c in state.columns]
    assert fed.count(2) >= 1 and state.columns[3] == before[3]


def test_options_validated():
    with pytest.raises(ValueError):
        LookaheadDrafter(ngram=1)
    with pytest.raises(ValueError):
        NgramPool(per_key=0, max_keys=1)
