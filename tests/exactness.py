"""Greedy exactness against plain decoding, with the near-tie rule for fp32 backends.

A forward over k tokens rounds differently from k single-token forwards (different GEMM
shapes). scripts/measure_drift.py measured the largest logit change this causes on
SmolLM2-135M with the transformers backend: 8.8e-5 in float32 (k = 8, 6 Spec-Bench prompts;
0.78 in bfloat16, which is why float32 is the transformers default). A speculative greedy
output may therefore differ from plain decoding only where the target's top-two logits are
within NEAR_TIE = 1e-3 (about 10x the measured drift) and the speculative token is the
runner-up; every other difference is a bug."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-3


@dataclass(frozen=True)
class Comparison:
    equal: bool
    near_tie_at: int | None  # index of the first divergence when explained by a near-tie


def compare_greedy(backend, prompt: list[int], plain: list[int], spec: list[int]) -> Comparison:
    """Equal outputs, or a first divergence explained by a near-tie; raises AssertionError
    naming the position, tokens and logit gap otherwise."""
    if spec == plain:
        return Comparison(True, None)
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if i is None:
        raise AssertionError(f"lengths differ without a token difference: {len(plain)} vs {len(spec)}")
    ids = torch.tensor([prompt + plain[:i]])
    logits = backend.forward(ids, torch.arange(ids.shape[1])[None], backend.new_cache()).logits[0, -1]
    top2 = torch.topk(logits, 2)
    gap = float(top2.values[0] - top2.values[1])
    runner_up = {int(t) for t in top2.indices}
    assert gap < NEAR_TIE and spec[i] in runner_up, (
        f"token {i}: plain {plain[i]} vs speculative {spec[i]}, top-2 gap {gap:.2e} "
        f"(near-tie bound {NEAR_TIE})")
    return Comparison(False, i)
