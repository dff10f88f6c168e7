import pytest
import torch
from hypothesis import given, strategies as st

from verispec.tree import DraftTree


def test_chain_mask_depths():
    t = DraftTree.chain(7, [1, 2, 3])
    assert t.depths == (0, 1, 2, 3)
    assert torch.equal(t.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert t.is_chain and t.num_drafted == 3


def test_two_by_two_tree():
    # root 7 -> (3 -> 9, 3 -> 4), (5)
    t = DraftTree.from_paths(7, [[3, 9], [5], [3, 4]])
    assert t.tokens == (7, 3, 5, 9, 4)
    assert t.parents == (-1, 0, 0, 1, 1)
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(t.ancestor_mask(), expected)
    assert t.children[1] == (3, 4) and t.path_to(4) == [1, 4]
    assert not t.is_chain


def test_invalid_trees_rejected():
    with pytest.raises(ValueError):
        DraftTree(tokens=(1, 2), parents=(-1, 1))
    with pytest.raises(ValueError):
        DraftTree(tokens=(1,), parents=(0,))


@given(st.lists(st.integers(0, 5), min_size=0, max_size=12), st.data())
def test_mask_is_transitive_closure_of_parents(raw, data):
    parents = [-1] + [data.draw(st.integers(0, i)) for i in range(len(raw))]
    t = DraftTree(tokens=tuple([0] + raw), parents=tuple(parents))
    mask = t.ancestor_mask()
    for i in range(t.size):
        ancestors = {i}
        j = i
        while parents[j] >= 0:
            j = parents[j]
            ancestors.add(j)
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == ancestors
        assert t.depths[i] == len(ancestors) - 1
