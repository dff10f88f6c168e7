"""SuffixTrie and the SuffixDecoding drafter: docstring examples, brute-force property tests
(counts, integrity, eviction, matching, drafts), the adaptive draft size and the global
trie's bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from verispec.drafters.base import DraftContext, Observation
from verispec.drafters.suffix_tree import SuffixDecodingDrafter, common_prefix_length
from verispec.drafters.suffix_trie import SuffixTrie
from verispec.sampling import make_generator
from verispec.types import SamplingParams


def brute_count(docs: list[list[int]], s: list[int]) -> int:
    n = len(s)
    return sum(1 for d in docs for i in range(len(d) - n + 1) if d[i:i + n] == s)


def test_docstring_example():
    t = SuffixTrie(max_depth=4)
    t.add_document(0)
    t.extend(0, [1, 2, 3, 1, 2])
    assert (t.count([1, 2]), t.count([2, 3, 1]), t.count([3, 3])) == (2, 1, 0)
    cur, m = t.match([9, 1, 2], max_length=8)
    assert m == 2
    draft = t.speculate([9, 1, 2], max_tokens=8, max_match=8, max_spec_factor=4.0, min_token_prob=0.0)
    assert draft.tokens == (3, 1) and draft.parents == (-1, 0)  # depth cap 4: [1, 2, 3, 1]
    t.check_integrity()


docs_strategy = st.lists(st.lists(st.integers(0, 3), max_size=18), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, depth=st.integers(1, 6), split=st.integers(0, 18),
       evict=st.lists(st.booleans(), max_size=4))
def test_counts_match_brute_force(docs, depth, split, evict):
    """Every substring (<= depth) is counted exactly, also when documents grow in two
    pieces, are sealed, and after evicting some of them."""
    t = SuffixTrie(max_depth=depth)
    for i, d in enumerate(docs):
        t.add_document(i, d[:split])
        t.extend(i, d[split:])
    t.check_integrity()
    kept = dict(enumerate(docs))
    for i, e in enumerate(evict[: len(docs)]):
        if e:
            t.remove_document(i)
            del kept[i]
    t.check_integrity()
    t.add_document(99, [0, 1, 0, 1, 2], sealed=True)
    kept[99] = [0, 1, 0, 1, 2]
    t.check_integrity()
    live = list(kept.values())
    for d in live:
        for i in range(len(d)):
            for n in range(1, depth + 1):
                s = d[i:i + n]
                assert t.count(s) == brute_count(live, s)
    assert t.count([3, 3, 3, 3, 3, 3][:depth]) == brute_count(live, [3, 3, 3, 3, 3, 3][:depth])
    assert t.num_tokens == sum(len(d) for d in live)


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, context=st.lists(st.integers(0, 3), min_size=1, max_size=10),
       depth=st.integers(2, 7))
@example(docs=[[1, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0]], context=[1], depth=3)  # 0.4 * 3 / 3 > 0.4
def test_match_and_draft_against_brute_force(docs, context, depth):
    t = SuffixTrie(max_depth=depth)
    for i, d in enumerate(docs):
        t.add_document(i, d, sealed=True)
    _, m = t.match(context, max_length=10)
    # brute force: longest suffix (< depth) that occurs followed by another token
    def continues(s):
        return any(d[i:i + len(s)] == s and i + len(s) < len(d) for d in docs for i in range(len(d)))
    want = 0
    for n in range(1, min(len(context), depth - 1) + 1):
        if not continues(context[-n:]):
            break
        want = n
    assert m == want
    draft = t.speculate(context, max_tokens=6, max_match=10, max_spec_factor=3.0, min_token_prob=0.0)
    assert len(draft.tokens) <= min(6, 3 * m)
    for i in range(len(draft.tokens)):  # every drafted path continues the match somewhere
        path, j = [], i
        while j >= 0:
            path.append(draft.tokens[j])
            j = draft.parents[j]
        s = context[len(context) - m:] + path[::-1]
        assert len(s) <= depth and brute_count(docs, s) >= 1
        assert draft.parents[i] < i
        assert 0 < draft.probs[i] <= (draft.probs[draft.parents[i]] if draft.parents[i] >= 0 else 1.0)


def test_probabilities_and_min_prob_pruning():
    t = SuffixTrie(max_depth=8)
    # after [7, 8]: 9 three times, 5 once -> p(9) = 0.75, p(5) = 0.25
    t.add_document(0, [7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9, 3, 7, 8, 5, 4], sealed=True)
    d = t.speculate([0, 7, 8], max_tokens=8, max_match=4, max_spec_factor=4.0, min_token_prob=0.3)
    assert d.tokens[0] == 9 and d.probs[0] == pytest.approx(0.75)
    assert 5 not in d.tokens  # 0.25 < 0.3: pruned
    d = t.speculate([0, 7, 8], max_tokens=8, max_match=4, max_spec_factor=4.0, min_token_prob=0.0)
    assert {9, 5} <= set(d.tokens[:2])


def test_draft_size_adapts_to_match_length():
    t = SuffixTrie(max_depth=32)
    t.add_document(0, list(range(20)) * 2, sealed=True)
    short = t.speculate([99, 3], max_tokens=16, max_match=16, max_spec_factor=2.0, min_token_prob=0.1)
    long = t.speculate([99, 1, 2, 3, 4, 5], max_tokens=16, max_match=16, max_spec_factor=2.0, min_token_prob=0.1)
    assert short.match_length == 1 and len(short.tokens) == 2
    assert long.match_length == 5 and len(long.tokens) == 10
    assert long.tokens[:3] == (6, 7, 8)


def test_memory_estimate_is_in_the_right_range():
    import sys

    t = SuffixTrie(max_depth=16)
    g = torch.Generator().manual_seed(0)
    t.add_document(0, torch.randint(0, 50, (3000,), generator=g).tolist(), sealed=True)

    def deep(node):
        size = sys.getsizeof(node) + sys.getsizeof(node.children)
        for c in node.children.values():
            size += sys.getsizeof(c) if isinstance(c, int) else deep(c)
        return size

    real = deep(t._root) + 4 * t.num_tokens
    assert 0.7 * real <= t.memory_bytes() <= 1.4 * real


def _step(drafter, rid, tokens, new):
    tree = drafter.propose(DraftContext(rid, tokens, 8, SamplingParams(), make_generator(0, 1)))
    drafter.observe(Observation(rid, tree, [], new, torch.zeros(tree.size, 10), None))
    return tree


def test_drafter_uses_prompt_then_global_responses():
    d = SuffixDecodingDrafter(max_depth=16, max_match=8, max_spec_factor=2.0, min_token_prob=0.1,
                              max_global_tokens=30, global_prompts=False)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    d.start("a", prompt)
    tree = _step(d, "a", prompt + [3], [4])  # root 3 is the prefill's token
    assert tree.tokens[:3] == (3, 4, 5)  # matched [1, 2, 3] in the prompt
    tokens = prompt + [3, 4]
    for t in [7, 8, 9]:
        _step(d, "a", tokens, [t])
        tokens.append(t)
    d.finish("a")
    assert d.global_trie.documents == [0] and d.global_trie.document(0) == [3, 4, 7, 8, 9]
    d.start("b", [20, 21, 4])
    tree = _step(d, "b", [20, 21, 4, 7], [8])  # [4, 7] occurs only in the earlier response
    assert tree.tokens[:3] == (7, 8, 9)
    d.finish("b")
    # the bound evicts the oldest responses first
    for i in range(6):
        d.start(f"c{i}", [40 + i])
        _step(d, f"c{i}", [40 + i, 50 + i], list(range(60, 66)))
        d.finish(f"c{i}")
    assert d.global_trie.num_tokens <= 30
    assert d.global_trie.documents[0] > 1  # "a"'s and "b"'s responses are gone
    d.global_trie.check_integrity()


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix_length([], [1]) == 0 and common_prefix_length([7] * 50, [7] * 50) == 50
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = torch.randint(0, 3, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        b = torch.randint(0, 3, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        brute = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == brute


def test_sessions_index_what_each_prompt_adds_and_draft_across_sessions():
    """Turn 2 of a session adds only its new tool output to the global trie (the rest continues turn
    1's prompt + response); a second session drafts a file view the first one read; bounded."""
    d = SuffixDecodingDrafter(max_depth=16, max_match=8, min_token_prob=0.1, max_global_tokens=60)
    system, view = [1, 2, 3], [30, 31, 32, 33, 34, 35, 36, 37]
    turn1 = system + [9] + view
    d.start("a1", turn1)
    _step(d, "a1", turn1 + [5], [6])
    d.finish("a1")  # response [5, 6]
    assert [d.global_trie.document(i) for i in d.global_trie.documents] == [turn1, [5, 6]]
    tool = [40, 41, 42, 43]
    turn2 = turn1 + [5, 6] + tool
    d.start("a2", turn2)
    assert d.global_trie.document(d.global_trie.documents[-1]) == tool  # only what the turn added
    d.finish("a2")
    d.start("b", [7, 8, 30, 31, 32])  # another session opens the same file
    tree = _step(d, "b", [7, 8, 30, 31, 32, 33], [34])
    assert tree.tokens[:4] == (33, 34, 35, 36)  # drafted from session a's prompt
    d.finish("b")
    for i in range(8):  # the bound holds: oldest documents and remembered requests go first
        d.start(f"c{i}", [50 + i] * 12)
        d.finish(f"c{i}")
    assert d.global_trie.num_tokens <= 60
    assert d.memory_bytes() <= d.global_trie.memory_bytes() + 60 * 4  # remembered requests: <= 60 tokens
    d.global_trie.check_integrity()
    d.reset()
    assert d.global_trie.num_tokens == 0 and d.memory_bytes() == SuffixDecodingDrafter().memory_bytes()


def test_missed_observation_is_detected():
    d = SuffixDecodingDrafter()
    d.start("r", [1, 2, 3])
    ctx = DraftContext("r", [1, 2, 3, 4, 5], 4, SamplingParams(), make_generator(0, 1))
    with pytest.raises(ValueError, match="observation was missed"):
        d.propose(ctx)


def test_options_validated():
    with pytest.raises(ValueError):
        SuffixDecodingDrafter(max_depth=8, max_match=8)
    with pytest.raises(ValueError):
        SuffixDecodingDrafter(min_token_prob=1.5)


def test_min_score_drops_drafts_not_worth_a_wider_forward():
    prompt = [1, 2, 3, 9, 1, 5]  # after [1]: 2 or 5 (one each) -> a 1-token match, score 1
    for min_score, drafted in ((1.5, 0), (0.0, 2)):
        d = SuffixDecodingDrafter(min_token_prob=0.0, max_spec_factor=2.0, min_score=min_score,
                                  max_global_tokens=0)
        d.start("r", prompt)
        tree = d.propose(DraftContext("r", prompt + [1], 8, SamplingParams(), make_generator(0, 1)))
        assert tree.num_drafted == drafted
    with pytest.raises(ValueError):
        SuffixDecodingDrafter(min_score=-1.0)
