"""Acceptance rules on synthetic distributions: greedy paths, and losslessness of
rejection sampling: its law enumerated exactly with the sampler's own per-sibling step
(``rejection_step``) for chains and multi-draft trees, and the real sampler checked
statistically against that enumeration."""

import itertools
from collections import Counter, defaultdict

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.verify.greedy import accept_greedy
from verispec.verify.rejection import accept_rejection, rejection_step

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


# ---- rejection: the exact law, enumerated with the sampler's own rejection_step --------------
def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """P(rejection_step accepts draft x) for u ~ U(0, 1): the measure of the u it accepts,
    an interval [0, a) (checked on a grid) whose end a is found by bisection. The float32
    rounding of u * q(x) < p(x) is the sampler's own, so this is its exact law."""
    key = (p.numpy().tobytes(), q.numpy().tobytes(), x)
    if key not in _ACCEPT:
        _ACCEPT[key] = _accept_probability(p, q, x)
    return _ACCEPT[key]


_ACCEPT: dict = {}


def _accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    def accepted(u: float) -> bool:
        return rejection_step(p, q, x, u)[0]

    lo, hi = 0.0, 1.0
    for _ in range(64):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepted(mid) else (lo, mid)
    a = lo if accepted(lo) else 0.0
    grid = [i / 32 for i in range(32)]
    assert all(accepted(u) == (u < a) for u in grid if abs(u - a) > 1e-9), "the accepted u are not an interval"
    return a


def exact_step_law(tree: DraftTree, probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """The exact law of ``accept_rejection(tree, probs, .)``'s committed tokens (accepted
    drafts then the next token): siblings tried in order with ``rejection_step``, each
    rejection passing its residual on, the next token drawn from the last law."""
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def at(node: int, prefix: tuple[int, ...], weight: float) -> None:
        p = probs[node].float()
        for child in tree.children[node]:
            x = tree.tokens[child]
            q = tree.draft_probs[child].float() if tree.draft_probs is not None else F.one_hot(
                torch.tensor(x), p.numel()).float()
            a = accept_probability(p, q, x)
            if a > 0:
                at(child, prefix + (x,), weight * a)
            weight *= 1 - a
            if weight == 0:
                return
            accepted, rest = rejection_step(p, q, x, 1.0)  # u = 1 rejects whenever a < 1
            assert not accepted
            p = rest if rest is not None else probs[node].float()
        for y, py in enumerate((p / p.sum()).tolist()):
            if py > 0:
                out[prefix + (y,)] += weight * py

    at(0, (), 1.0)
    return out


def seeded_law(ctx: tuple[int, ...], salt: int, sharp: float = 2.0) -> torch.Tensor:
    """A fixed [V] law per context (a toy target or drafter); some entries are exactly 0."""
    g = torch.Generator().manual_seed(hash((salt, *ctx)) % 2**31)
    x = torch.rand(V, generator=g) ** sharp
    x[int(torch.randint(0, V, (), generator=g))] = 0.0
    return x / x.sum()


def target(ctx):
    return seeded_law(ctx, 0)


def draft(ctx):
    return seeded_law(ctx, 1, sharp=1.0)


def target_joint(depth: int) -> dict[tuple[int, ...], float]:
    """The target's own law of the next ``depth`` tokens after the empty context."""
    law = {(): 1.0}
    for _ in range(depth):
        law = {seq + (y,): w * py for seq, w in law.items() for y, py in enumerate(target(seq).tolist()) if py > 0}
    return law


def speculative_joint(trees: list[tuple[float, DraftTree, list[tuple[int, ...]]]], depth: int):
    """Law of the first ``depth`` tokens when one speculative step with a tree drawn from
    ``trees`` ((probability, tree, context of each node)) is followed by plain sampling."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for w_tree, tree, ctxs in trees:
        probs = torch.stack([target(c) for c in ctxs])
        for seq, w in exact_step_law(tree, probs).items():
            tails = {seq[:depth]: 1.0}
            while len(next(iter(tails))) < depth:
                tails = {s + (y,): v * py for s, v in tails.items() for y, py in enumerate(target(s).tolist()) if py > 0}
            for s, v in tails.items():
                law[s] += w_tree * w * v
    return law


def draws(q: torch.Tensor, k: int, replacement: bool):
    """Every ordered k-tuple of draws from q with its probability, and each draw's law
    (q itself, or q renormalised without the earlier draws)."""
    def go(prefix, w, laws):
        if len(prefix) == k:
            yield w, prefix, laws
            return
        qk = q.clone()
        if not replacement:
            qk[list(prefix)] = 0
            if qk.sum() == 0:
                return
            qk /= qk.sum()
        for x in range(V):
            if qk[x] > 0:
                yield from go(prefix + (x,), w * float(qk[x]), laws + [qk])
    yield from go((), 1.0, [])


def chain_trees(depth: int):
    """Chains x_1..x_depth, x_i ~ q(. | x_<i) (draft-model speculative sampling)."""
    def go(ctx, w):
        if len(ctx) == depth:
            tree = DraftTree.chain(0, list(ctx), torch.stack([draft(ctx[:i]) for i in range(depth)]))
            yield w, tree, [ctx[:i] for i in range(depth + 1)]
            return
        q = draft(ctx)
        for x in range(V):
            if q[x] > 0:
                yield from go(ctx + (x,), w * float(q[x]))
    yield from go((), 1.0)


def sibling_trees(k: int, replacement: bool, children: int = 0):
    """k siblings drawn from q at the root (i.i.d. as SpecTr / multi-draft SpecInfer, or
    without replacement as RSD), each with ``children`` i.i.d. children of its own."""
    for w, xs, laws in draws(draft(()), k, replacement):
        subs = [list(draws(draft((x,)), children, True)) for x in xs]
        for combo in itertools.product(*subs):
            tokens, parents, rows, ctxs, weight = [0, *xs], [-1] + [0] * k, [laws[0], *laws], [(), *[(x,) for x in xs]], w
            for i, (wc, ys, ys_laws) in enumerate(combo):
                weight *= wc
                tokens += ys
                parents += [1 + i] * len(ys)
                rows += ys_laws
                ctxs += [(xs[i], y) for y in ys]
            yield weight, DraftTree(tokens=tuple(tokens), parents=tuple(parents), draft_probs=torch.stack(rows)), ctxs


def assert_same_law(got: dict, want: dict) -> None:
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)
    for key in set(got) | set(want):
        assert got.get(key, 0.0) == pytest.approx(want.get(key, 0.0), abs=1e-6), key


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_chain_law_is_exactly_the_target(depth):
    """A draft chain of ``depth`` tokens with their q: the step then plain sampling gives
    exactly the target's law of the next depth + 1 tokens."""
    assert_same_law(speculative_joint(list(chain_trees(depth)), depth + 1), target_joint(depth + 1))


@pytest.mark.parametrize("k,replacement,children", [(1, True, 0), (2, True, 0), (3, True, 0), (2, False, 0),
                                                    (3, False, 0), (2, True, 1), (2, False, 1)])
def test_multi_draft_tree_law_is_exactly_the_target(k, replacement, children):
    """Recursive rejection over k root siblings drawn i.i.d. from q (SpecTr, SpecInfer) or
    without replacement (RSD, each with its renormalised q), with i.i.d. children under
    each: exactly the target's law of the next two tokens."""
    trees = list(sibling_trees(k, replacement, children))
    assert sum(w for w, _, _ in trees) == pytest.approx(1.0)
    assert_same_law(speculative_joint(trees, 2), target_joint(2))


def test_point_mass_tree_law_is_exactly_the_target():
    """Deterministic distinct candidates (no q: prompt lookup, suffix trees), including a
    candidate the target gives probability 0."""
    zero = int((target(()) == 0).nonzero()[0])
    tree = DraftTree.from_paths(0, [[1, 2], [zero, 4], [3, 3, 1]])
    assert_same_law(speculative_joint([(1.0, tree, path_contexts(tree))], 3), target_joint(3))


def test_single_draft_accept_probability_is_sum_min():
    """P(accept) of one draft x ~ q is sum_x min(p(x), q(x)) (Leviathan et al., Theorem 3.5)."""
    p, q = target(()), draft(())
    accept = sum(float(q[x]) * accept_probability(p, q, x) for x in range(V) if q[x] > 0)
    assert accept == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-6)


def test_rejection_step_residual():
    """A rejection leaves norm(max(0, p - q)); a draft q cannot give is rejected whatever u;
    p <= q everywhere has no residual."""
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    accepted, rest = rejection_step(p, q, 1, 0.9)  # 0.9 >= 0.3 / 0.6
    assert not accepted and torch.allclose(rest, torch.tensor([1.0, 0.0, 0.0]))
    assert rejection_step(p, q, 1, 0.4) == (True, None)
    assert rejection_step(p, torch.tensor([0.0, 0.0, 1.0]), 1, 0.0)[0] is False
    assert rejection_step(p, p, 0, 1.0) == (False, None)


# ---- rejection: the real sampler agrees with the enumerated law, statistically ----------------
def sample_steps(tree, probs, n, seed=0):
    gen = make_generator(seed)
    return [accept_rejection(tree, probs, gen) for _ in range(n)]


def path_contexts(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's context: the drafted tokens on its path."""
    ctxs = [()]
    for i in range(1, len(tree.tokens)):
        ctxs.append(ctxs[tree.parents[i]] + (tree.tokens[i],))
    return ctxs


FIXED_TREES = {  # one likely tree of each kind
    "chain": lambda: next(t for w, t, _ in chain_trees(2) if w > 0.02),
    "siblings": lambda: next(t for w, t, _ in sibling_trees(3, False) if w > 0.01),
    "point-mass": lambda: DraftTree.from_paths(0, [[1, 2], [4, 4], [3]]),
}


@pytest.mark.parametrize("which", FIXED_TREES)
def test_sampler_follows_the_enumerated_law(which):
    """accept_rejection's committed tokens over 4000 draws: chi-square against
    exact_step_law of the same tree (so the enumeration describes the real sampler)."""
    tree = FIXED_TREES[which]()
    probs = torch.stack([target(c) for c in path_contexts(tree)])
    law = exact_step_law(tree, probs)
    counts = Counter(tuple(a.tokens(tree)) for a in sample_steps(tree, probs, 4000))
    assert set(counts) <= {k for k, v in law.items() if v > 0}, "drew an outcome of probability 0"
    keys = [k for k, v in law.items() if v * 4000 >= 5]
    obs = [counts[k] for k in keys] + [4000 - sum(counts[k] for k in keys)]
    exp = [law[k] * 4000 for k in keys] + [4000 * (1 - sum(law[k] for k in keys))]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    assert chisquare(obs, exp).pvalue > 1e-3


def test_zero_probability_token_never_emitted():
    p0 = torch.tensor([0.5, 0.5, 0, 0, 0, 0])
    tree = DraftTree.chain(0, [3])  # a point-mass draft of an impossible token
    for a in sample_steps(tree, torch.stack([p0, p0]), 500):
        assert a.path == [] and a.next_token in (0, 1)
