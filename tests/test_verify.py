"""Acceptance rules on synthetic distributions: greedy paths, and losslessness of
rejection sampling (exactly by enumeration, and statistically with the real sampler)."""

import pytest
import torch
from scipy.stats import chisquare

from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.verify.greedy import accept_greedy
from verispec.verify.rejection import accept_rejection, residual

V = 6


def onehot_logits(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 100.0
    return logits


# ---- greedy -------------------------------------------------------------------------------
def test_greedy_empty_draft():
    acc = accept_greedy(DraftTree.chain(0, []), onehot_logits([4]))
    assert acc.path == [] and acc.next_token == 4 and acc.kind == "bonus"


def test_greedy_early_mismatch():
    acc = accept_greedy(DraftTree.chain(0, [1, 2, 3]), onehot_logits([1, 5, 3, 3]))
    assert acc.path == [1] and acc.next_token == 5 and acc.kind == "recovered"


def test_greedy_full_match_bonus():
    acc = accept_greedy(DraftTree.chain(0, [1, 2, 3]), onehot_logits([1, 2, 3, 4]))
    assert acc.path == [1, 2, 3] and acc.next_token == 4 and acc.kind == "bonus"


def test_greedy_tree_second_branch():
    tree = DraftTree.from_paths(0, [[1, 2], [3, 4], [3, 5]])  # nodes: 0,1,3,2,4,5
    # root argmax 3 -> node 2 (token 3); its argmax 5 -> node 5; leaf -> bonus argmax 1
    logits = onehot_logits([3, 0, 5, 0, 0, 1])
    acc = accept_greedy(tree, logits)
    assert [tree.tokens[i] for i in acc.path] == [3, 5] and acc.next_token == 1
    assert acc.kind == "bonus"


# ---- rejection: exact enumeration of the first emitted token -------------------------------
def exact_first_token(p: torch.Tensor, qs: list[torch.Tensor]) -> torch.Tensor:
    """Slow reference: the distribution of the first emitted token when k sibling drafts are
    drawn from q_1..q_k (i.i.d. with q_k = q), enumerating every draft combination."""
    out = torch.zeros(V, dtype=torch.float64)

    def recurse(k: int, p_cur: torch.Tensor, weight: float) -> None:
        if k == len(qs):
            out.add_(weight * p_cur)
            return
        q = qs[k]
        for x in range(V):
            if q[x] == 0:
                continue
            a = min(1.0, float(p_cur[x] / q[x]))
            out[x] += weight * q[x] * a
            r = residual(p_cur, q)
            if r is not None and a < 1:
                recurse(k + 1, r.double(), weight * q[x] * (1 - a))

    recurse(0, p.double(), 1.0)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_multi_draft_emits_exactly_p(k):
    g = torch.Generator().manual_seed(k)
    p = torch.rand(V, generator=g) ** 3
    p /= p.sum()
    q = torch.rand(V, generator=g) ** 3
    q /= q.sum()
    assert torch.allclose(exact_first_token(p, [q] * k), p.double(), atol=1e-6)


def test_acceptance_probability_is_sum_min():
    g = torch.Generator().manual_seed(7)
    p, q = torch.rand(V, generator=g), torch.rand(V, generator=g)
    p, q = p / p.sum(), q / q.sum()
    accept = sum(float(q[x]) * min(1.0, float(p[x] / q[x])) for x in range(V))
    assert accept == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-6)


# ---- rejection: the real sampler, statistically ---------------------------------------------
def sample_steps(tree, probs, n, seed=0):
    gen = make_generator(seed)
    return [accept_rejection(tree, probs, gen) for _ in range(n)]


def chi2_ok(samples: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=V).double()
    keep = p > 0
    assert counts[~keep].sum() == 0, "emitted a token with zero target probability"
    expected = p[keep].double() / p[keep].double().sum() * len(samples)
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def random_dist(g, sharp=2.0):
    x = torch.rand(V, generator=g) ** sharp
    return x / x.sum()


def test_chain_with_probs_matches_target_at_two_depths():
    g = torch.Generator().manual_seed(3)
    p0, p1, p2 = (random_dist(g) for _ in range(3))
    q1, q2 = random_dist(g), random_dist(g)
    gen = make_generator(11)
    firsts, seconds, accepted = [], [], 0
    for _ in range(6000):
        d1 = int(torch.multinomial(q1, 1, generator=gen))
        d2 = int(torch.multinomial(q2, 1, generator=gen))
        tree = DraftTree.chain(0, [d1, d2], torch.stack([q1, q2]))
        # target at node 1 depends on the drafted token: use p1 shifted by d1 (conditional)
        probs = torch.stack([p0, p1.roll(d1), p2])
        acc = accept_rejection(tree, probs, gen)
        toks = acc.tokens(tree)
        firsts.append(toks[0])
        accepted += len(acc.path) > 0
        if len(toks) > 1 and toks[0] == 3:
            seconds.append(toks[1])
    assert chi2_ok(firsts, p0) > 1e-3
    assert chi2_ok(seconds, p1.roll(3)) > 1e-3
    assert accepted / 6000 == pytest.approx(float(torch.minimum(p0, q1).sum()), abs=0.03)


def test_point_mass_tree_matches_target():
    g = torch.Generator().manual_seed(5)
    p0, p_a, p_b = (random_dist(g) for _ in range(3))
    # deterministic candidates 1 and 4 (siblings), each with one child
    tree = DraftTree.from_paths(0, [[1, 2], [4, 4]])
    child_probs = {1: p_a, 4: p_b}
    probs = torch.stack([p0, p_a, p_b, p_a, p_b])  # node order (0, 1, 4, 2, 4)
    steps = sample_steps(tree, probs, 6000)
    toks = [a.tokens(tree) for a in steps]
    assert chi2_ok([t[0] for t in toks], p0) > 1e-3
    for first in (1, 4):
        second = [t[1] for t in toks if t[0] == first]
        assert chi2_ok(second, child_probs[first]) > 1e-3


def test_iid_siblings_with_probs_match_target():
    g = torch.Generator().manual_seed(9)
    p0, q = random_dist(g), random_dist(g)
    gen = make_generator(2)
    firsts = []
    for _ in range(6000):
        drafts = torch.multinomial(q, 3, replacement=True, generator=gen).tolist()
        tree = DraftTree(tokens=(0, *drafts), parents=(-1, 0, 0, 0),
                         draft_probs=torch.stack([q, q, q, q]))
        probs = torch.stack([p0] * 4)
        firsts.append(accept_rejection(tree, probs, gen).tokens(tree)[0])
    assert chi2_ok(firsts, p0) > 1e-3


def test_zero_probability_token_never_emitted():
    p0 = torch.tensor([0.5, 0.5, 0, 0, 0, 0])
    tree = DraftTree.chain(0, [3])  # a point-mass draft of an impossible token
    for a in sample_steps(tree, torch.stack([p0, p0]), 500):
        assert a.path == [] and a.next_token in (0, 1)
