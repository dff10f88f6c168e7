"""A request's grammar applied to a draft tree, so constrained speculation stays exact.

Node i's target logits predict the token after the root-to-i path, so node i's mask is the
grammar's allowed set in the state after that path (each node its own state; a depth-first
walk consumes a node's token on the way down and rolls it back on the way up, the matcher's
committed state untouched). Masking every row with its own state makes each row exactly the
distribution constrained plain decoding uses at that point, so greedy verification picks the
constrained argmax and rejection sampling follows the constrained law (verify/ is unchanged).

Drafts the grammar forbids could never be accepted (their probability under the masked target
is 0); ``prune`` cuts them before the forward, so the budget goes to drafts that can win. That is
exact where the rejected draft carries no probability of its own: greedy verification, and
point-mass drafts (a point mass q at x with p(x) = 0 leaves the residual p unchanged). A draft
sampled from a draft model's q is kept: rejecting it is part of the law of the residual.

A draft model can do better than being cut: ``GrammarDraft`` masks each of its draft steps'
logits with the grammar state after the chain drafted so far (a scratch walk of the request's
matcher, rolled back when the chain is done), so its argmax (or its sample from the masked q)
never leaves the grammar. That is exact too: drafts are only proposals, and the target is masked
at verification all the same; only what is proposed changes (the draft's constrained guess
instead of its unconstrained one, which the grammar would have cut).

``jump_forward`` drafts the tokens the grammar forces after a chain (a schema's keys and
punctuation; SGLang's "jump-forward decoding", Zheng et al. 2024, arXiv 2312.07104) for free:
the target still verifies them, so output never changes, and they are accepted whenever the
target agrees with the grammar's tokenization. Free to draft is not free to verify: where the
target's cost curve is known, ``JumpForward`` sizes them like any draft (the size with the most
tokens per unit of target time), else they fill the draft budget.

Where a forced run ends on a choice among few tokens (after a number's digit: another digit, or
the `,` or `}` that ends it), the grammar forces nothing, so the forced run after the choice would
wait a step. ``forced_branches`` drafts the choice's branches that lead to a forced run (`,` then
`` "next key": ``), each followed by its run, as a tree; the target's pick among them is verified
with its run in the same step. Point masses like any forced token, so output never changes.
"""

from __future__ import annotations

import torch

from ..policies.draft_budget import DepthAcceptance, interpolate
from ..tree import DraftTree
from .matcher import Matcher, has_bit, unpack_bitmask


_MINUS_INF = torch.tensor(float("-inf"))


def _walk(tree: DraftTree, matcher: Matcher) -> tuple[torch.Tensor, list[bool]]:
    """([N, W] int32 bitmasks, reachable per node): node i is reachable when the grammar allows
    every token on its path; an unreachable node's row is all ones (never used: its token has
    probability 0 at its parent)."""
    bits = matcher.new_bitmask(tree.size).fill_(-1)  # rows of nodes never reached stay all ones
    reachable = [False] * tree.size
    reachable[0] = True
    stack: list[tuple[int, bool]] = [(0, False)]  # (node, leaving): leaving rolls its token back
    while stack:
        node, leaving = stack.pop()
        if leaving:
            matcher.rollback(1)
            continue
        if node:
            if not has_bit(bits[tree.parents[node]], tree.tokens[node]):
                bits[node] = -1
                continue
            if matcher.ends_at(tree.tokens[node]):  # EOS ends the answer: nothing past it is reachable
                reachable[node] = True
                matcher.fill_eos_only(bits[node])
                continue
            reachable[node] = True
            if not matcher.advance([tree.tokens[node]]):  # allowed, but past the engine's limits: the
                matcher.fill_eos_only(bits[node])  # answer ends there (as plain decoding's commit does)
                continue
            stack.append((node, True))
        matcher.fill_bitmask(bits[node])
        for child in reversed(tree.children[node]):
            stack.append((child, False))
    return bits, reachable


def node_masks(tree: DraftTree, matcher: Matcher) -> torch.Tensor:
    """[N, V] bool: the tokens the grammar allows after each node's path."""
    return unpack_bitmask(_walk(tree, matcher)[0], matcher.vocab_size)


def mask_logits(logits: torch.Tensor, tree: DraftTree, matcher: Matcher) -> torch.Tensor:
    """[N, V] logits with every token the grammar forbids at a node set to -inf (a new tensor)."""
    allowed = node_masks(tree, matcher).to(logits.device)
    return torch.where(allowed, logits.float(), _MINUS_INF.to(logits.device))


def reachable(tree: DraftTree, matcher: Matcher) -> list[bool]:
    """Per node: does the grammar allow every token on its path? (The matcher's state is unchanged.)"""
    if tree.is_chain:
        keep = matcher.valid_prefix(list(tree.tokens[1:]))
        return [True] * (keep + 1) + [False] * (tree.num_drafted - keep)
    return _walk(tree, matcher)[1]


def keep_nodes(tree: DraftTree, keep: list[bool]) -> DraftTree:
    """The nodes of ``tree`` marked in ``keep`` (every kept node's parent kept), in their order."""
    if all(keep):
        return tree
    kept = [i for i in range(tree.size) if keep[i]]
    index = {old: new for new, old in enumerate(kept)}
    parents = tuple(-1 if i == 0 else index[tree.parents[i]] for i in kept)
    probs = None if tree.draft_probs is None else tree.draft_probs[kept]
    return DraftTree(tuple(tree.tokens[i] for i in kept), parents, probs)


def prune(tree: DraftTree, matcher: Matcher) -> DraftTree:
    """``tree`` without the drafts the grammar forbids (and their subtrees); only for trees
    whose drafts are point masses (``draft_probs is None``) or greedy verification."""
    return tree if tree.size == 1 else keep_nodes(tree, reachable(tree, matcher))


class GrammarDraft:
    """One draft chain's walk of a request's grammar (``DraftModelDrafter`` under a constraint):
    ``mask`` a draft step's logits with the state after the chain so far, ``push`` each drafted
    token, ``close`` (always, ``try``/``finally``) to roll the matcher back to the committed state."""

    def __init__(self, matcher: Matcher):
        self.matcher, self.advanced = matcher, 0

    def mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[V'] draft logits with every token the grammar forbids next at -inf (a draft vocabulary
        V' other than the target's: tokens past the target's are forbidden); None when nothing
        the draft can propose is allowed (an FR-Spec head without the tokens the grammar wants)."""
        allowed = self.matcher.allowed().to(logits.device)
        n = min(len(allowed), len(logits))
        out = torch.full_like(logits, float("-inf"))
        out[:n] = torch.where(allowed[:n], logits[:n], _MINUS_INF.to(logits.device, logits.dtype))
        return out if bool(torch.isfinite(out).any()) else None

    def push(self, token: int) -> bool:
        """Consume a drafted token (one ``mask`` allowed); False when the chain must end there
        (EOS, or the grammar is complete and only EOS may follow)."""
        if self.matcher.ends_at(token):
            return False
        if not self.matcher.advance([token]):  # past the grammar engine's limits: the chain ends
            return False
        self.advanced += 1
        return not self.matcher.stopped

    def forced(self) -> list[int]:
        """The tokens the grammar forces after the chain so far (a schema's keys, punctuation)."""
        return [] if self.matcher.stopped else self.matcher.forced()

    def close(self) -> None:
        self.matcher.rollback(self.advanced)
        self.advanced = 0


BRANCH_ALLOWED = 32  # a choice among more tokens than this (a string's contents, a key's name) is not branched
MAX_BRANCHES = 4


def forced_branches(matcher: Matcher) -> list[list[int]]:
    """``[token, *forced]`` for each token the grammar allows next after which it forces a run, where
    it forces nothing now and allows at most ``BRANCH_ALLOWED`` tokens; [] elsewhere or past
    ``MAX_BRANCHES`` such tokens. The matcher's state is unchanged."""
    if matcher.stopped or matcher.forced():
        return []
    bits = matcher.new_bitmask(1)
    matcher.fill_bitmask(bits[0])
    words = bits[0].nonzero().flatten().tolist()
    if len(words) > BRANCH_ALLOWED:
        return []
    values = bits[0][words].tolist()  # the few set words as Python ints (int32: bit 31 reads right from a negative)
    allowed = [32 * w + j for w, v in zip(words, values) for j in range(32) if (v >> j) & 1]
    if len(allowed) > BRANCH_ALLOWED:
        return []
    out = []
    for token in allowed:
        if matcher.ends_at(token) or not matcher.advance([token]):
            continue
        try:
            run = [] if matcher.stopped else matcher.forced()
        finally:
            matcher.rollback(1)
        if run:
            out.append([token, *run])
    return out if len(out) <= MAX_BRANCHES else []


class JumpForward:
    """One request's forced-token draft sizes from the target's cost curve ``cost`` (t(n), in
    decode steps; ``policies.draft_budget``): after a chain of n drafted tokens, k forced tokens
    are appended where k maximizes ``(E(n + k) + 1) / t(n + k)`` (k = 0 wins ties). A forced token
    is accepted only if the whole chain before it is, and then unless the target prefers another
    tokenization of the forced text; both are tracked per depth over the request's steps
    (``DepthAcceptance``: the drafter's chains with the usual even prior, the forced tokens with
    a prior mean of 0.9), so node values are P(chain accepted) x P(forced tokens 1..j accepted)."""

    def __init__(self, cost: dict[int, float]):
        self.cost = cost
        self.chain = DepthAcceptance()
        self.forced = DepthAcceptance(mean=0.9)
        self.branch = DepthAcceptance(max_depth=1)  # P(the target picks one of the drafted branches)
        self._shaped: tuple[int, int, bool] | None = None  # (chain tokens, forced tokens, branches?) being verified

    def size(self, drafted: int, available: int) -> int:
        """How many of ``available`` forced tokens to append to a chain of ``drafted`` tokens."""
        reach = self.chain.node_values(drafted)
        after = reach[-1] if reach else 1.0
        expected = sum(reach)
        best, rate = 0, (expected + 1.0) / interpolate(self.cost, drafted)
        for k, value in enumerate(self.forced.node_values(available), start=1):
            expected += after * value
            if (expected + 1.0) / interpolate(self.cost, drafted + k) > rate + 1e-12:
                best, rate = k, (expected + 1.0) / interpolate(self.cost, drafted + k)
        return best

    def branches(self, drafted: int, forced: int, branches: list[list[int]]) -> int:
        """How many of ``branches`` (the tree after a chain of ``drafted`` tokens and ``forced`` ones,
        in order) pay their verification: their value is P(chain and forced tokens all accepted) x
        P(the target picks a drafted branch) x (1 + the branch's forced tokens' values)."""
        chain = self.chain.node_values(drafted)
        reach = chain + [v * (chain[-1] if chain else 1.0) for v in self.forced.node_values(forced)]
        after, expected, n = (reach[-1] if reach else 1.0), sum(reach), drafted + forced
        best, rate = 0, (expected + 1.0) / interpolate(self.cost, n)
        hit = self.branch.rate(1)
        for i, branch in enumerate(branches, start=1):
            expected += after * hit / len(branches) * (1.0 + sum(self.forced.node_values(len(branch) - 1)))
            n += len(branch)
            if (expected + 1.0) / interpolate(self.cost, n) > rate + 1e-12:
                best, rate = i, (expected + 1.0) / interpolate(self.cost, n)
        return best

    def shaped(self, drafted: int, forced: int, branched: bool = False) -> None:
        """The draft sent for verification: a chain of ``drafted`` tokens, then ``forced`` ones, then
        (``branched``) a choice's branches."""
        self._shaped = (drafted, forced, branched)

    def observe(self, accepted: int) -> None:
        """Its verification accepted ``accepted`` drafted tokens (a step without a shaped chain: nothing)."""
        if self._shaped is None:
            return
        (n, k, branched), self._shaped = self._shaped, None
        if n:
            self.chain.update(n, min(accepted, n))
        if k and accepted >= n:
            self.forced.update(k, min(accepted - n, k))
        if branched and accepted >= n + k:
            self.branch.update(1, int(accepted > n + k))


def jump_forward(tree: DraftTree, matcher: Matcher, budget: int, sizing: JumpForward | None = None) -> DraftTree:
    """A point-mass chain extended by up to ``budget`` tokens the grammar forces after it, as many
    as ``sizing`` finds worth verifying where given; where the whole forced run fits and ends on a
    choice, the choice's branches (``forced_branches``) after it, as many as ``sizing`` finds worth
    verifying, or without ``sizing`` only when they all spell one text."""
    if not tree.is_chain or tree.draft_probs is not None:
        return tree
    drafts = list(tree.tokens[1:])
    if budget <= 0 or any(matcher.ends_at(t) for t in drafts):  # no room, or the chain already ends the answer
        forced = []
    elif not matcher.advance(drafts):  # a pruned chain the engine's limits stop inside
        forced = []
    else:
        try:
            forced = matcher.forced()[:budget]
        finally:
            matcher.rollback(len(drafts))
    available = len(forced)
    if sizing is not None:
        forced = forced[:sizing.size(len(drafts), len(forced))] if forced else forced
    chain = drafts + forced
    branches = _branches_after(chain, matcher, budget) if len(forced) == available else []
    if sizing is not None:
        branches = branches[:sizing.branches(len(drafts), len(forced), branches)] if branches else branches
        sizing.shaped(len(drafts), len(forced), bool(branches))
    elif len({matcher.text(b) for b in branches}) > 1:
        branches = []  # no cost curve to weigh guesses by: only a choice with one way on (one text) is drafted
    if not branches:
        return DraftTree.chain(tree.tokens[0], chain) if forced else tree
    tokens, parents = [tree.tokens[0], *chain], list(range(-1, len(chain)))
    for branch in branches:
        for j, token in enumerate(branch):
            parents.append(len(chain) if j == 0 else len(tokens) - 1)
            tokens.append(token)
    return DraftTree(tuple(tokens), tuple(parents))


def _branches_after(chain: list[int], matcher: Matcher, budget: int) -> list[list[int]]:
    """``forced_branches`` after ``chain`` (drafted, then forced, tokens), cut to the ``budget`` left."""
    room = budget - len(chain)
    if room <= 0 or any(matcher.ends_at(t) for t in chain) or not matcher.advance(chain):
        return []
    try:
        found = forced_branches(matcher)
    finally:
        matcher.rollback(len(chain))
    out = []
    for branch in found:
        if room <= 0:
            break
        out.append(branch[:room])
        room -= len(out[-1])
    return out


def shape_draft(tree: DraftTree, matcher: Matcher, greedy: bool, budget: int,
                sizing: JumpForward | None = None) -> DraftTree:
    """The draft a constrained request verifies: forbidden drafts cut where that is exact
    (``prune``), then forced tokens appended within the draft ``budget`` (``jump_forward``),
    sized by ``sizing`` where given."""
    if greedy or tree.draft_probs is None:
        tree = prune(tree, matcher)
    return jump_forward(tree, matcher, budget - tree.num_drafted, sizing)
