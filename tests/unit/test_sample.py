"""``sampling.sample``, the one draw from a distribution every path makes (plain decoding, the
verifiers' residuals, sampled drafts): a two-level inverse CDF in float64. It follows the law
(chi-square, with the mass spread over several blocks, a partial last block and zeros between),
never draws a token of probability 0 (however the point falls on a block edge), is reproducible
from the generator's seed, and refuses what is not a distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from verispec.models.base import NonFiniteLogits
from verispec.sampling import SAMPLE_BLOCK, sample


def _law(n: int) -> torch.Tensor:
    p = torch.zeros(n)
    picks = [0, 3, SAMPLE_BLOCK - 1, SAMPLE_BLOCK, 2 * SAMPLE_BLOCK + 7, n - 1]  # block edges, the tail block
    p[picks] = torch.tensor([0.05, 0.2, 0.1, 0.25, 0.3, 0.1])
    return p


@pytest.mark.parametrize("n", [2 * SAMPLE_BLOCK + 100, 3 * SAMPLE_BLOCK])  # a partial last block, and none
def test_draws_follow_the_law(n):
    p, g, draws = _law(n), torch.Generator().manual_seed(1), 8000
    counts = Counter(sample(p, g) for _ in range(draws))
    support = torch.nonzero(p).flatten().tolist()
    assert set(counts) <= set(support)
    mass = [float(p[i]) for i in support]
    expected = [m / sum(mass) * draws for m in mass]
    assert chisquare([counts[i] for i in support], expected).pvalue > 1e-3


def test_an_unnormalised_vector_is_its_normalised_law():
    p, g = torch.tensor([2.0, 0.0, 6.0]), torch.Generator().manual_seed(2)
    counts = Counter(sample(p, g) for _ in range(4000))
    assert counts[1] == 0 and chisquare([counts[0], counts[2]], [1000, 3000]).pvalue > 1e-3


def test_a_point_mass_and_edge_points_never_draw_zero_mass():
    for i in (0, SAMPLE_BLOCK - 1, SAMPLE_BLOCK, 5 * SAMPLE_BLOCK + 3):
        p = torch.zeros(5 * SAMPLE_BLOCK + 4)
        p[i] = 1e-30  # all the mass in one tiny entry
        assert all(sample(p, torch.Generator().manual_seed(s)) == i for s in range(20))


def test_the_top_of_the_unit_interval_draws_the_last_token_with_mass(monkeypatch):
    p = torch.zeros(SAMPLE_BLOCK + 10)
    p[[2, SAMPLE_BLOCK + 4]] = 0.5
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k) * 0 + (1 - 2 ** -53))
    assert sample(p, torch.Generator()) == SAMPLE_BLOCK + 4
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k) * 0)
    assert sample(p, torch.Generator()) == 2


def test_reproducible_from_the_seed():
    p = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(0)), -1)
    a = [sample(p, torch.Generator().manual_seed(7)) for _ in range(5)]
    g = torch.Generator().manual_seed(7)
    assert a == [sample(p, torch.Generator().manual_seed(7))] * 5 and len({sample(p, g) for _ in range(50)}) > 5


@pytest.mark.parametrize("bad", [[0.5, float("nan")], [0.5, float("inf")], [1.5, -0.5], [0.0, 0.0], []],
                         ids=["nan", "inf", "negative", "no-mass", "empty"])
def test_what_is_not_a_distribution_is_refused(bad):
    with pytest.raises(NonFiniteLogits):
        sample(torch.tensor(bad), torch.Generator())
