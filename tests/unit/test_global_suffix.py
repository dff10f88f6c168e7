"""SuffixDecoding's global trie over earlier requests (``SuffixDecodingDrafter``): least recently used
eviction (a continued session's documents and the documents a draft is read from are kept, an idle
session's go), the memory bound, the global trie consulted only while the request's own match is
short; and, on real models, greedy output equal to plain decoding with drafts from the global trie
that earlier requests populated."""

from __future__ import annotations

import pytest
import torch

from helpers import run
from verispec.api import load_model
from verispec.drafters.base import DraftContext, NoDrafter, Observation
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.sampling import make_generator
from verispec.types import SamplingParams


def _step(drafter, rid, tokens, new):
    tree = drafter.propose(DraftContext(rid, tokens, 8, SamplingParams(), make_generator(0, 1)))
    drafter.observe(Observation(rid, tree, [], new, torch.zeros(tree.size, 10), None))
    return tree


def _request(d: SuffixDecodingDrafter, rid: str, prompt: list[int]) -> None:
    d.start(rid, prompt)
    d.finish(rid)


def _global_docs(d: SuffixDecodingDrafter) -> list[list[int]]:
    return [d.global_trie.document(i) for i in d.global_trie.documents]


def test_a_continued_session_outlives_an_idle_one():
    """Session A, session B, then A's next turn (it continues A's remembered request: A's documents are
    used again); a new session needs room for 20 tokens: B's prompt goes, not A's older first turn (the
    oldest-first rule would have dropped it)."""
    d = SuffixDecodingDrafter(max_depth=16, max_match=8, max_global_tokens=40)
    a1, b1 = list(range(100, 110)), list(range(200, 210))
    _request(d, "a1", a1)
    _request(d, "b1", b1)
    _request(d, "a2", a1 + list(range(110, 115)))  # adds only its 5 new tokens
    _request(d, "c1", list(range(300, 320)))
    docs = _global_docs(d)
    assert a1 in docs and b1 not in docs and list(range(110, 115)) in docs
    assert d.global_trie.num_tokens <= 40
    d.global_trie.check_integrity()


def test_a_document_drafted_from_is_kept():
    """Two earlier prompts; a request drafts from the first (it continues its tokens): that document is
    the most recently used, so room for a new one is made by dropping the second."""
    d = SuffixDecodingDrafter(max_depth=16, max_match=8, min_score=0.0, max_global_tokens=30)
    p0, p1 = list(range(50, 60)), list(range(60, 70))
    _request(d, "p0", p0)
    _request(d, "p1", p1)
    d.start("q", [7, 50, 51, 52])  # its own trie cannot continue 53; the global one can (p0)
    tree = _step(d, "q", [7, 50, 51, 52, 53], [54])
    assert tree.tokens[1:4] == (54, 55, 56)
    d.finish("q")
    _request(d, "n", list(range(400, 408)))
    docs = _global_docs(d)
    assert p0 in docs and p1 not in docs
    d.global_trie.check_integrity()


def test_the_memory_bound_holds():
    """Documents of few distinct tokens (many repeated substrings: materialised nodes; ~9 KB each) under a 40 KiB
    bound: the estimate never exceeds it; a document over the bound alone is not kept."""
    bound = 40 * 1024
    d = SuffixDecodingDrafter(max_depth=16, max_match=8, max_global_mb=bound / 2**20)
    g = torch.Generator().manual_seed(0)
    for i in range(30):
        _request(d, f"r{i}", [1000 + i] + torch.randint(0, 4, (40,), generator=g).tolist())
        assert d.global_trie.memory_bytes() <= bound
    assert len(d.global_trie.documents) >= 2
    d.global_trie.check_integrity()
    _request(d, "huge", [5000] + torch.randint(0, 4, (2000,), generator=g).tolist())
    assert d.global_trie.memory_bytes() <= bound and d.global_trie.num_tokens == 0
    with pytest.raises(ValueError, match="max_global_mb"):
        SuffixDecodingDrafter(max_global_mb=0)


@pytest.mark.parametrize("max_match,first", [(4, 30), (8, 20)])
def test_the_global_trie_is_consulted_while_the_own_match_is_short(max_match, first):
    """Three earlier sessions continue [1, 2, 3, 4] with 20, 21, ...; the request's own prompt continues it
    with 30 once. Its own match of [1, 2, 3, 4] is max_match long at max_match 4: its own draft stands
    (the global trie, scoring higher by its counts, is not consulted); at max_match 8 it is short, and
    the global draft wins by its score."""
    d = SuffixDecodingDrafter(max_depth=16, max_match=max_match, min_score=0.0)
    for s in range(3):
        _request(d, f"g{s}", [90 + s, 1, 2, 3, 4, *range(20, 28)])
    prompt = [8, 1, 2, 3, 4, 30, 7, 1, 2, 3]
    d.start("q", prompt)
    tree = d.propose(DraftContext("q", prompt + [4], 8, SamplingParams(), make_generator(0, 1)))
    assert tree.tokens[1] == first


@pytest.fixture(scope="module")
def stories():
    return load_model("stories260k")


@pytest.mark.parametrize("global_tokens", [100_000, 0], ids=["global", "request-only"])
def test_greedy_equals_plain_with_a_global_trie_earlier_requests_filled(stories, global_tokens):
    """stories260K: requests in turn through one drafter (a server's); a later request that asks what an
    earlier one did (the same prompt: a retried tool call, another session reading the same file), and
    one that continues an earlier answer, draft from the earlier responses in the global trie: far
    fewer steps than without it, and output equal to plain decoding every time."""
    tok = stories.tokenizer
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    first = tok("Once upon a time, a cat and a dog")["input_ids"]
    other = tok("Tom had a red ball.")["input_ids"]
    d = SuffixDecodingDrafter(max_global_tokens=global_tokens)
    plain = {}
    for prompt in (first, other):
        plain[tuple(prompt)] = run(stories.backend, NoDrafter(), prompt, params)[0]
        assert run(stories.backend, d, prompt, params, k=8)[0] == plain[tuple(prompt)]
    again = first
    out, stats = run(stories.backend, d, again, params, k=8)
    assert out == plain[tuple(first)]
    later = first + plain[tuple(first)][:10]
    out2, stats2 = run(stories.backend, d, later, params, k=8)
    assert out2 == run(stories.backend, NoDrafter(), later, params)[0]
    if global_tokens:
        assert stats.steps <= 20 and stats.accepted >= 40  # drafted from the earlier response
    else:
        assert stats.steps > 20
