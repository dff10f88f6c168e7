"""Token Recycling: the template construction, template expansion from the adjacency
matrix, and matrix updates from the target logits at every tree node."""

from __future__ import annotations

import pytest
import torch

from verispec.drafters.base import DraftContext, Observation
from verispec.drafters.token_recycling import (DEFAULT_RANK_PROBS, PROBE_EVERY, TokenRecyclingDrafter,
                                               expand_template, tree_template, valued_template)
from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.types import SamplingParams


def test_template_docstring_example():
    assert tree_template((0.6, 0.3), 4, 3) == ((-1, 0), (0, 0), (-1, 1), (1, 0))


def test_template_is_greedy_optimal_and_prefix_closed():
    tmpl = tree_template(DEFAULT_RANK_PROBS, 40, 6)

    def prob(i):
        p = 1.0
        while i >= 0:
            parent, rank = tmpl[i]
            p *= DEFAULT_RANK_PROBS[rank]
            i = parent
        return p

    probs = [prob(i) for i in range(len(tmpl))]
    assert all(a >= b - 1e-12 for a, b in zip(probs, probs[1:]))  # added best first
    for i, (parent, rank) in enumerate(tmpl):
        assert parent < i  # parents precede children: every prefix is a tree
        if rank > 0:  # the previous sibling is already there
            assert (parent, rank - 1) in tmpl[:i]
    depth = [0] * len(tmpl)
    for i, (parent, _) in enumerate(tmpl):
        depth[i] = 1 + (depth[parent] if parent >= 0 else 0)
    assert max(depth) <= 6


def test_expand_docstring_example_and_unknown_rows():
    m = torch.full((10, 2), -1, dtype=torch.int32)
    m[7] = torch.tensor([3, 5])
    m[3] = torch.tensor([9, -1])
    tree = expand_template(m, 7, ((-1, 0), (0, 0), (-1, 1), (1, 1)))
    assert tree.tokens == (7, 3, 9, 5) and tree.parents == (-1, 0, 1, 0)
    empty = expand_template(torch.full((10, 2), -1, dtype=torch.int32), 7, ((-1, 0), (0, 0)))
    assert empty.tokens == (7,)


def test_observe_updates_rows_and_drafts_from_them():
    d = TokenRecyclingDrafter(vocab_size=12, k=2, max_depth=4, rank_probs=(0.7, 0.2))
    d.start("r", [1, 2])
    ctx = DraftContext("r", [1, 2], 6, SamplingParams(), make_generator(0, 1))
    assert d.propose(ctx).tokens == (2,)  # nothing known yet
    tree = DraftTree(tokens=(2, 4, 6), parents=(-1, 0, 0))
    logits = torch.zeros(3, 12)
    logits[0, [5, 4]] = torch.tensor([3.0, 2.0])  # after 2: 5 then 4
    logits[1, [8, 9]] = torch.tensor([3.0, 2.0])  # after 4: 8 then 9
    logits[2, [1, 0]] = torch.tensor([3.0, 2.0])  # after 6: 1 then 0
    d.observe(Observation("r", tree, [1], [4, 8], logits, None))
    m = d.adjacency
    assert m[2].tolist() == [5, 4] and m[4].tolist() == [8, 9] and m[6].tolist() == [1, 0]
    assert m[3].tolist() == [-1, -1]
    draft = d.propose(DraftContext("r", [1, 2, 4, 8], 6, SamplingParams(), make_generator(0, 1)))
    assert draft.tokens == (8,)  # row 8 unknown
    draft = d.propose(DraftContext("r", [1, 2], 6, SamplingParams(), make_generator(0, 1)))
    assert draft.tokens[:3] == (2, 5, 4) and draft.num_drafted <= 6
    assert d.memory_bytes() == 12 * 2 * 4


def test_repeated_token_in_tree_takes_its_last_node():
    d = TokenRecyclingDrafter(vocab_size=6, k=1, rank_probs=(0.5,))
    d.start("r", [0])
    tree = DraftTree(tokens=(3, 3), parents=(-1, 0))
    logits = torch.zeros(2, 6)
    logits[0, 1] = logits[1, 2] = 5.0
    d.observe(Observation("r", tree, [], [3], logits, None))
    assert d.adjacency[3].tolist() == [2]


def test_options_validated():
    with pytest.raises(ValueError):
        TokenRecyclingDrafter(vocab_size=10, k=11)
    with pytest.raises(ValueError):
        TokenRecyclingDrafter(vocab_size=10, k=4, rank_probs=(0.5, 0.2))


def test_valued_template_takes_one_row_per_depth():
    one = valued_template((0.6, 0.3), 3, 4)
    assert one == (((-1, 0), (0, 0), (-1, 1)), (0.6, 0.36, 0.3))
    per_depth = valued_template(((0.6, 0.3), (0.2, 0.1)), 3, 4)  # depth 2 is much worse: the sibling first
    assert per_depth[0] == ((-1, 0), (-1, 1), (0, 0))
    assert [round(v, 3) for v in per_depth[1]] == [0.6, 0.3, 0.12]


def _taught(cost):
    """A drafter whose matrix knows 2 -> (5, 4), 5 -> (8, 9), 4 -> (1, 0), sized by ``cost``."""
    d = TokenRecyclingDrafter(vocab_size=12, k=2, max_depth=4, rank_probs=(0.5, 0.2), cost=cost)
    d.start("r", [1, 2])
    tree = DraftTree(tokens=(2, 5, 4), parents=(-1, 0, 0))
    logits = torch.zeros(3, 12)
    logits[0, [5, 4]] = torch.tensor([3.0, 2.0])
    logits[1, [8, 9]] = torch.tensor([3.0, 2.0])
    logits[2, [1, 0]] = torch.tensor([3.0, 2.0])
    d.observe(Observation("r", tree, [], [5], logits, None))
    return d


def ctx_of(tokens, budget=6):
    return DraftContext("r", tokens, budget, SamplingParams(), make_generator(0, 1))


def test_cost_sizing_drafts_what_pays_and_probes_when_nothing_does():
    cheap = _taught({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})  # every node is free: the whole known tree
    assert cheap.propose(ctx_of([1, 2])).tokens == (2, 5, 8, 4, 9, 1)  # the 6-node template, less an unknown row
    steep = _taught({1: 2.0, 2: 3.0, 4: 5.0, 8: 9.0})  # a node costs a whole step: plain decoding
    sizes = [steep.propose(ctx_of([1, 2])).num_drafted for _ in range(PROBE_EVERY + 1)]
    assert sizes == [0] * PROBE_EVERY + [1]  # then one node, so the tracked acceptance can change its mind
    mid = _taught({1: 1.2, 2: 1.6, 4: 2.4, 8: 4.0})  # rank 0 (0.5 prior) pays alone: 1.5 / 1.2 > 1
    tree = mid.propose(ctx_of([1, 2]))
    assert tree.tokens == (2, 5)


def test_the_acceptance_of_its_own_trees_reshapes_them_and_outlives_the_request():
    d = _taught({1: 1.2, 2: 1.3, 4: 2.4, 8: 4.0})
    assert d.acceptance.prob(1, 0) == 0.5  # the prior: an observed tree it did not propose taught nothing
    trees = []
    for _ in range(5):  # the rank-0 successor is accepted, its own rank-0 successor never
        tree = d.propose(ctx_of([1, 2]))
        trees.append((tree.tokens, tree.parents))
        logits = torch.zeros(tree.size, 12)
        logits[0, [5, 4]] = torch.tensor([3.0, 2.0])
        logits[1, [8, 9]] = torch.tensor([3.0, 2.0])
        d.observe(Observation("r", tree, [1], [5, 3], logits, None))
    assert trees[0] == ((2, 5, 8), (-1, 0, 1))  # a chain: 0.5 + 0.25 expected over t(2) = 1.3
    assert trees[-1] == ((2, 5, 4), (-1, 0, 0))  # depth 2 keeps failing: the rank-1 sibling instead
    assert d.acceptance.prob(1, 0) > 0.7 and d.acceptance.prob(2, 0) < 0.3
    d.finish("r")
    d.start("r2", [2])  # a new request keeps the matrix and the acceptance (the paper's hot start)
    again = d.propose(DraftContext("r2", [1, 2], 6, SamplingParams(), make_generator(0, 1)))
    assert again.tokens[:2] == (2, 5)
    d.reset()
    assert d.acceptance.prob(1, 0) == 0.5 and d.propose(DraftContext("r2", [1, 2], 6, SamplingParams(),
                                                                      make_generator(0, 1))).num_drafted == 0


def test_a_cost_curve_that_dips_is_not_taken_for_a_bargain():
    # timed under load: t(8) below t(4); read as it is, 5 nodes would cost 1.45 steps and win
    d = _taught({1: 1.2, 2: 1.3, 4: 1.6, 8: 1.0, 16: 5.0})
    assert d.cost == {1: 1.2, 2: 1.3, 4: 1.6, 8: 1.6, 16: 5.0}
    assert d.propose(ctx_of([1, 2])).tokens == (2, 5, 8)  # 1.75 / t(2) beats 2.15 / t(5) = 2.15 / 1.6
