"""Greedy exactness against plain decoding for tests: the near-tie rule lives in
``verispec.bench.lossless`` (shared with ``verispec bench``); this wrapper turns a
non-near-tie divergence into an AssertionError naming the position, tokens and gap."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.bench.lossless import NEAR_TIE, check_greedy

__all__ = ["NEAR_TIE", "Comparison", "compare_greedy"]


@dataclass(frozen=True)
class Comparison:
    equal: bool
    near_tie_at: int | None  # index of the first divergence when explained by a near-tie


def compare_greedy(backend, prompt: list[int], plain: list[int], spec: list[int]) -> Comparison:
    """Equal outputs, or a first divergence explained by a near-tie; raises AssertionError
    naming the position, tokens and logit gap otherwise."""
    check = check_greedy(backend, prompt, plain, spec)
    assert check.status != "mismatch", (
        f"{check.describe(plain, spec)} (near-tie bound {NEAR_TIE})")
    return Comparison(check.status == "equal", check.first_divergence)
