"""Token Recycling: the template construction, template expansion from the adjacency
matrix, and matrix updates from the target logits at every tree node."""

from __future__ import annotations

import pytest
import torch

from verispec.drafters.base import DraftContext, Observation
from verispec.drafters.token_recycling import (DEFAULT_RANK_PROBS, TokenRecyclingDrafter,
                                               expand_template, tree_template)
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
