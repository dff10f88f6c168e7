"""Sequoia's optimal tree (policies/tree_shape.py): DP vs brute force, Monte-Carlo check of
the expected accepted length, hardware-aware size choice, degenerate and bad inputs."""

from __future__ import annotations

import os

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.cost_curve import cached_cost_curve, measure_cost_curve
from verispec.drafters.medusa import sparse_tree_paths
from verispec.policies.tree_shape import (
    choose_size,
    conditional_from_marginal,
    expected_accepted,
    optimal_tree,
    rank_probs,
    sequoia_tree,
)


def all_trees(depth: int, width: int, budget: int, d: int = 0, prefix: tuple = (), r: int = 0):
    """Every tree (list of rank paths) below ``prefix`` with children ranks r.. contiguous."""
    yield []
    if d >= depth or r >= width or budget <= 0:
        return
    node = prefix + (r,)
    for sub in all_trees(depth, width, budget - 1, d + 1, node, 0):
        for rest in all_trees(depth, width, budget - 1 - len(sub), d, prefix, r + 1):
            yield [node, *sub, *rest]


probs = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 6), st.data())
def test_dp_equals_brute_force(depth, width, budget, data):
    per_depth = data.draw(st.booleans())
    p = [data.draw(st.lists(probs, min_size=width, max_size=width)) for _ in range(depth)] if per_depth \
        else data.draw(st.lists(probs, min_size=width, max_size=width))
    tree = optimal_tree(p, budget, max_depth=depth)
    brute = max(expected_accepted(t, p, depth) for t in all_trees(depth, width, budget))
    assert tree.expected_accepted == pytest.approx(brute, abs=1e-9)
    assert expected_accepted(tree.paths, p, depth) == pytest.approx(tree.expected_accepted, abs=1e-9)
    assert tree.size <= budget and tree.depth <= depth
    assert set(tree.paths) == {q[:i] for q in tree.paths for i in range(1, len(q) + 1)}  # prefix-closed
    for q in tree.paths:  # contiguous sibling ranks
        assert q[-1] == 0 or q[:-1] + (q[-1] - 1,) in tree.paths


def simulate(paths, p, trials: int, rng: random.Random) -> float:
    """Mean accepted length: at each node try its children in rank order, child r accepted
    with the conditional probability p[depth][r]; stop when all are rejected."""
    kids: dict[tuple, list[int]] = {}
    for q in paths:
        kids.setdefault(q[:-1], []).append(q[-1])
    total = 0
    for _ in range(trials):
        node = ()
        while node in kids:
            row = p[len(node)]
            hit = next((r for r in sorted(kids[node]) if rng.random() < row[r]), None)
            if hit is None:
                break
            node += (hit,)
            total += 1
    return total / trials


def test_expected_length_matches_monte_carlo():
    p = [[0.7, 0.4, 0.3], [0.5, 0.3, 0.2], [0.4, 0.2, 0.1], [0.3, 0.2, 0.1]]
    tree = optimal_tree(p, 12, max_depth=4)
    trials = 40_000
    mc = simulate(tree.paths, p, trials, random.Random(0))
    assert abs(mc - tree.expected_accepted) < 4 * 2.0 / trials ** 0.5  # std of a length <= 4 is <= 2


def test_matches_medusa_greedy_for_decreasing_rank_probs():
    acc = [[0.5, 0.15, 0.08, 0.04], [0.3, 0.12, 0.06, 0.03], [0.2, 0.1, 0.05, 0.02]]
    p = [conditional_from_marginal(a) for a in acc]
    for budget in (1, 3, 8, 16):
        tree = optimal_tree(p, budget)
        greedy = sparse_tree_paths(acc, budget)
        assert tree.expected_accepted == pytest.approx(expected_accepted(greedy, p, 3), abs=1e-12)


def test_marginal_conditional_round_trip():
    acc = [0.4, 0.2, 0.1, 0.0]
    assert rank_probs(conditional_from_marginal(acc)) == pytest.approx(acc)
    assert conditional_from_marginal([1.0, 0.0]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="sum to <= 1"):
        conditional_from_marginal([0.7, 0.6])


def test_choose_size_picks_argmax_of_synthetic_curve():
    p = [0.6, 0.3, 0.2]
    cost = {n: 1.0 + 0.02 * n + (0.5 if n > 8 else 0.0) for n in (1, 2, 4, 8, 12, 16)}

    def e(n):
        return optimal_tree(p, n, max_depth=5).expected_accepted

    want = max([0, *cost], key=lambda n: (e(n) + 1) / cost.get(n, 1.0))
    assert choose_size(e, cost) == want == 8
    assert sequoia_tree(p, cost, max_budget=32, max_depth=5).size <= 8
    assert sequoia_tree(p, cost, max_budget=4, max_depth=5).size <= 4
    assert choose_size(lambda n: 0.0, cost) == 0  # drafting never pays: plain decoding


def test_degenerate_inputs():
    one = optimal_tree([0.9, 0.5], 1, max_depth=3)
    assert one.paths == [(0,)] and one.expected_accepted == pytest.approx(0.9)
    zero = optimal_tree([0.0, 0.0], 8, max_depth=3)
    assert zero.paths == [] and zero.expected_accepted == 0.0
    assert optimal_tree([0.5], 0, max_depth=2).paths == []
    chain = optimal_tree([1.0, 0.5], 5, max_depth=3)  # rank 0 always right: a chain, then stop
    assert chain.paths == [(0,), (0, 0), (0, 0, 0)] and chain.expected_accepted == pytest.approx(3.0)


@pytest.mark.parametrize("args, match", [
    (([1.2, 0.1], 4, 2), r"\[0, 1\]"),
    (([float("nan")], 4, 2), r"\[0, 1\]"),
    (([], 4, 2), "non-empty"),
    (([0.5], -1, 2), "budget"),
    (([0.5], 4, 0), "max_depth"),
    (([0.5], 4, None), "needs max_depth"),
    (([[0.5], [0.4]], 4, 3), "rows for 2 depths"),
    (([[0.5, 0.1], [0.4]], 4, 2), "rectangular"),
])
def test_bad_input_raises(args, match):
    with pytest.raises(ValueError, match=match):
        optimal_tree(*args)


def test_choose_size_rejects_bad_costs():
    with pytest.raises(ValueError, match="positive finite"):
        choose_size(lambda n: 1.0, {2: 0.0})


def test_cost_curve_measured_once_and_cached(tmp_path, toy_target, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine, whatever else runs
    model = toy_target
    curve = measure_cost_curve(model, sizes=(1, 4), repeats=1, context=8)
    assert set(curve) == {1, 4} and all(t > 0 for t in curve.values())
    first = cached_cost_curve(model, "toy/hf/none/1", sizes=(1, 2), repeats=1, cache_dir=tmp_path)
    assert (tmp_path / "cost-curves" / "toy_hf_none_1.json").exists()
    assert cached_cost_curve(None, "toy/hf/none/1", sizes=(2,), cache_dir=tmp_path) == {2: first[2]}


@pytest.mark.parametrize("busy_when", ["before", "after"])
def test_a_cost_curve_timed_on_a_busy_machine_is_used_not_stored(tmp_path, monkeypatch, busy_when):
    """Load over 1.5x the cores before or after the timing: the curve is returned, nothing is written, and
    the next call (quiet) times it again and stores it."""
    loads = iter([(99.0, 0, 0), (0.0, 0, 0)] if busy_when == "before" else [(0.0, 0, 0), (99.0, 0, 0)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(loads, (0.0, 0.0, 0.0)))
    timed = []

    def measure(model, sizes, repeats):
        timed.append(1)
        return {1: 1.0, 2: 1.5 + len(timed)}

    with pytest.warns(RuntimeWarning, match=r"busy \(load average 99.0 on \d+ cores\): used now, not stored"):
        assert cached_cost_curve(None, "toy", sizes=(1, 2), cache_dir=tmp_path, measure=measure) == {1: 1.0, 2: 2.5}
    assert not (tmp_path / "cost-curves").exists() or not any((tmp_path / "cost-curves").iterdir())
    assert cached_cost_curve(None, "toy", sizes=(1, 2), cache_dir=tmp_path, measure=measure) == {1: 1.0, 2: 3.5}
    assert cached_cost_curve(None, "toy", sizes=(1, 2), cache_dir=tmp_path, measure=measure) == {1: 1.0, 2: 3.5}
    assert len(timed) == 2


def test_a_cost_curve_keyed_by_long_paths_is_stored_under_a_short_unique_name(tmp_path, monkeypatch):
    """A draft found by path beside a target given by path: a key of two paths is no file name over 255 bytes."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    keys = [f"/{'a' * 120}/target.gguf-cpu-t2-draftstep-/{'b' * 120}/draft{i}.gguf" for i in range(2)]
    for i, key in enumerate(keys):
        assert cached_cost_curve(None, key, sizes=(1,), cache_dir=tmp_path, measure=lambda m, s, r, i=i: {1: i + 1.0}) \
            == {1: i + 1.0}
    names = [p.name for p in (tmp_path / "cost-curves").iterdir()]
    assert len(names) == 2 and all(len(n) < 255 for n in names)
    assert cached_cost_curve(None, keys[1], sizes=(1,), cache_dir=tmp_path, measure=None) == {1: 2.0}
