"""REST datastore and drafter: suffix array and lookups against brute force (hypothesis),
longest-suffix matching, the frequency trie, save/load, the size bound, and the
`verispec datastore build` command."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.drafters.base import DraftContext
from verispec.drafters.retrieval import (SEPARATOR, Datastore, RetrievalDrafter, build_datastore,
                                         continuations, frequency_tree, longest_match, suffix_array)
from verispec.sampling import make_generator
from verispec.types import SamplingParams


def brute_count(docs, q):
    return sum(1 for d in docs for i in range(len(d) - len(q) + 1) if d[i:i + len(q)] == q)


def test_docstring_examples():
    t = np.array([2, 1, 2, 1, -1, 2], dtype=np.int32)
    assert suffix_array(t, 8).tolist() == [3, 1, 5, 2, 0]
    ds = Datastore(t, suffix_array(t, 8), 8)
    assert ds.find([2, 1]) == (3, 5)
    tree = frequency_tree(0, [[1, 2], [1, 2], [1, 3], [4]], 2)
    assert tree.tokens == (0, 1, 2) and tree.parents == (-1, 0, 1)


docs_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, depth=st.integers(1, 9), queries=st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=9), max_size=8))
def test_lookups_match_brute_force(docs, depth, queries):
    ds = build_datastore(docs, depth=depth)
    ds.check_integrity()
    assert ds.tokens.tolist() == [t for d in docs for t in d + [SEPARATOR]]
    for d in docs:  # every substring of the corpus, and random queries
        queries = queries + [d[i:i + n] for i in range(len(d)) for n in (1, 3, depth)]
    for q in queries:
        q = q[:depth]
        if q:
            lo, hi = ds.find(q)
            assert hi - lo == brute_count(docs, q)
            for s in ds.suffix_array[lo:hi].tolist():
                assert ds.tokens[s:s + len(q)].tolist() == q


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, context=st.lists(st.integers(0, 3), min_size=1, max_size=8))
def test_longest_match_and_continuations_against_brute_force(docs, context):
    ds = build_datastore(docs, depth=8)
    lo, hi, m = longest_match(ds, context, max_match=6, min_match=1)

    def continues(q):
        return any(d[i:i + len(q)] == q and i + len(q) < len(d) for d in docs for i in range(len(d)))

    want = 0
    for n in range(1, min(6, len(context)) + 1):
        if brute_count(docs, context[-n:]) == 0:
            break
        if continues(context[-n:]):
            want = n
    assert m == want
    if m:
        conts = continuations(ds, lo, hi, m, length=3, max_candidates=100)
        suffix = context[-m:]
        want_conts = sorted(d[i + m:i + m + 3] for d in docs for i in range(len(d) - m)
                            if d[i:i + m] == suffix)
        assert sorted(conts) == want_conts


def test_frequency_tree_budget_and_order():
    conts = [[5, 6, 7]] * 4 + [[5, 6, 8]] * 2 + [[9]] * 3
    tree = frequency_tree(1, conts, 10)
    assert tree.tokens == (1, 5, 6, 7, 9, 8)  # best first by count: 5:6, 6:6, 7:4, 9:3, 8:2
    assert all(p < i for i, p in enumerate(tree.parents))
    assert frequency_tree(1, conts, 3).num_drafted == 3
    assert frequency_tree(1, [], 3).tokens == (1,)


def test_size_bound_and_save_load(tmp_path):
    docs = [[1, 2, 3]] * 10
    ds = build_datastore(docs, max_tokens=9, depth=4, fingerprint="abc")
    assert len(ds.tokens) == 8 and ds.nbytes == 8 * 4 + 6 * 4  # two documents fit
    ds.save(tmp_path / "ds.npz")
    back = Datastore.load(tmp_path / "ds.npz")
    assert back.tokens.tolist() == ds.tokens.tolist() and back.depth == 4 and back.fingerprint == "abc"
    with pytest.raises(ValueError, match="does not exist"):
        Datastore.load(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a verispec datastore"):
        Datastore.load(tmp_path / "bad.npz")


def test_drafter_proposes_the_frequent_continuation():
    ds = build_datastore([[7, 8, 9, 10, 11], [7, 8, 9, 10, 12], [3, 8, 9, 4]], depth=8)
    d = RetrievalDrafter(ds, max_match=4, min_match=1)
    d.start("r", [1])
    tree = d.propose(DraftContext("r", [1, 7, 8, 9], 4, SamplingParams(), make_generator(0, 1)))
    assert tree.tokens == (9, 10, 11, 12)  # matched [7, 8, 9]; 10 twice, then 11 / 12
    tree = d.propose(DraftContext("r", [1, 5, 5], 4, SamplingParams(), make_generator(0, 1)))
    assert tree.tokens == (5,)


def test_cli_builds_a_datastore(tmp_path):
    from typer.testing import CliRunner

    from verispec.cli import app

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"q": "x", "answer": t}) for t in
                                ["Once upon a time there was a cat.", "The cat liked milk."]))
    out = tmp_path / "ds.npz"
    res = CliRunner().invoke(app, ["datastore", "build", "--model", "stories260k", "--input", str(corpus),
                                   "--field", "answer", "--output", str(out)])
    assert res.exit_code == 0, res.output
    ds = Datastore.load(out)
    ds.check_integrity()
    assert json.loads(res.output.strip().splitlines()[-1])["tokens"] == len(ds.suffix_array) > 5
    res = CliRunner().invoke(app, ["datastore", "build", "--model", "stories260k", "--input",
                                   str(tmp_path / "none.txt"), "--output", str(out)])
    assert res.exit_code == 2 and "does not exist" in res.output
