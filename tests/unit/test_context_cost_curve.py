"""Cost curves by context (``cost_curve.ContextCostCurve``, ``cached_context_curve``): read linearly
between the timed contexts and held outside them, one context = one curve everywhere (the behaviour
before), each context timed once and cached under its own key (the probe context under the key used
before), contexts the model cannot hold left out; a draft model's costs by context (``CostModel.at``,
``CostModel.feed``) and the draft step and feed timed at a context (``measure_draft_step``)."""

from __future__ import annotations

import doctest
import os

import pytest

from verispec import cost_curve
from verispec.cost_curve import (PROBE_CONTEXT, ContextCostCurve, cached_context_curve, cached_cost_curve,
                                 measure_draft_step)
from verispec.cost_model import CostModel
from verispec.policies.draft_budget import interpolate

SHORT = {1: 1.0, 4: 1.2, 16: 2.0}
LONG = {1: 1.1, 4: 1.6, 16: 3.6}


def test_doctests():
    assert doctest.testmod(cost_curve).failed == 0


def test_interpolates_between_contexts_and_holds_outside():
    c = ContextCostCurve({3072: LONG, 128: SHORT})  # any order in, sorted
    assert c.contexts == (128, 3072)
    assert c.at(128) == SHORT and c.at(3072) == LONG
    assert c.at(0) == SHORT and c.at(50_000) == LONG  # held at the nearest timed context
    mid = c.at(1600)  # halfway
    assert mid == pytest.approx({1: 1.05, 4: 1.4, 16: 2.8})
    assert c.t(4, 1600) == pytest.approx(1.4)
    assert c.t(2, 3072) == pytest.approx(interpolate(LONG, 2))  # between sizes: as the policies read a curve
    assert c.t(0, 3072) == 1.0 and c.t(0, 3072, at_zero=0.0) == 0.0
    # monotone in the context when the timed curves are
    assert all(c.t(8, a) <= c.t(8, b) for a, b in zip(range(0, 4000, 100), range(100, 4100, 100)))
    c.at(1600)[4] = 99.0  # a copy: the curve is not changed through it
    assert c.t(4, 1600) == pytest.approx(1.4)


def test_one_context_is_one_curve_everywhere():
    single = ContextCostCurve.single(SHORT)
    assert single.contexts == (PROBE_CONTEXT,)
    assert all(single.at(n) == SHORT for n in (0, 128, 2048, 100_000))


@pytest.mark.parametrize("curves", [{}, {128: {}}, {128: {1: -1.0}}, {128: {1: float("nan")}},
                                    {128: {1: 1.0}, 1024: {1: 1.0, 2: 1.2}}, {-5: {1: 1.0}}])
def test_bad_curves_raise(curves):
    with pytest.raises(ValueError):
        ContextCostCurve(curves)


class _Info:
    max_length = 2048


class _Model:
    info = _Info()


def test_each_context_is_timed_once_and_cached(tmp_path, monkeypatch):
    """The probe context under the plain key (the curve cached before curves by context), the others
    under ``key-ctxC``; a context whose probe does not fit the model is left out; a second call reads
    every curve back."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    timed = []

    def measure(model, sizes, repeats, context):
        timed.append((context, repeats))
        return {n: 1.0 + n * context / 10_000 for n in sizes}

    args = dict(contexts=(128, 1024, 3072), sizes=(1, 8), cache_dir=tmp_path, measure=measure)
    c = cached_context_curve(_Model(), "toy", **args)
    assert c.contexts == (128, 1024) and timed == [(128, 5), (1024, 3)]  # 3072 does not fit 2048 tokens
    files = sorted(p.name for p in (tmp_path / "cost-curves").iterdir())
    assert files == ["toy-ctx1024.json", "toy.json"]
    assert cached_cost_curve(None, "toy", sizes=(1, 8), cache_dir=tmp_path) == c.at(128)  # the plain key
    assert cached_context_curve(_Model(), "toy", **args) == c and len(timed) == 2
    assert c.t(8, 1024) == pytest.approx(1.0 + 8 * 1024 / 10_000)
    nothing_fits = cached_context_curve(_Model(), "toy", **args | {"contexts": (4096,)})
    assert nothing_fits.contexts == (PROBE_CONTEXT,)


def test_draft_costs_by_context():
    curves = ContextCostCurve({128: SHORT, 3072: LONG})
    steps = ContextCostCurve({128: {1: 0.2, 64: 3.2}, 3072: {1: 0.4, 64: 9.6}})
    cost = CostModel(SHORT, 0.2, curves, steps)
    here = cost.at(3072)
    assert here.draft == pytest.approx(0.4) and here.curve == LONG and here.curve_by_context is None
    assert cost.at(1600).draft == pytest.approx(0.3) and cost.at(1600).verify(4) == pytest.approx(1.4)
    assert cost.feed(128) == pytest.approx(0.05) and cost.feed(3072) == pytest.approx(0.15)
    plain = CostModel(SHORT, 0.2)
    assert plain.at(3072) is plain and plain.feed(3072) is None
    assert CostModel(SHORT, 0.2, None, ContextCostCurve({128: {1: 0.2}})).feed(128) is None  # no feed timed


def test_draft_step_and_feed_timed_at_a_context(toy_target, toy_draft):
    ratios = measure_draft_step(toy_target, toy_draft, rounds=1, context=16, sizes=(1, 8))
    assert set(ratios) == {1, 8} and all(r > 0 for r in ratios.values())
