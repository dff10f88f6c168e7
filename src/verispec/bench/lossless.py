"""Greedy exactness: token-id equality against plain decoding, with the near-tie rule.

A forward over k tokens rounds differently from k single-token forwards (different GEMM
shapes). scripts/measure_drift.py measured the largest logit change this causes on
SmolLM2-135M with the transformers backend: 8.8e-5 in float32 (k = 8, 6 Spec-Bench prompts;
0.78 in bfloat16, which is why float32 is the transformers default). A speculative greedy
output may therefore differ from plain decoding only where the target's top-two logits are
within ``NEAR_TIE = 1e-3`` (about 10x the measured drift) and the speculative token is one of
those two; every other difference is a bug (or, for a peer engine, a real change of output).

Glossary: the *reference* is plain greedy decoding through our engine (drafter ``none``);
a *candidate* is any other method's output for the same prompt. Both are generated token
ids, prompt excluded. Comparison is on ids and lengths, never on text (text equality hides
tokenization differences and truncation; Spec-Bench's ``equal.py`` compares text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..models.base import CausalLM

NEAR_TIE = 1e-3
Status = Literal["equal", "near-tie", "mismatch"]


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first differing token; ``None`` when equal. When one output is a
    strict prefix of the other (one stopped earlier, e.g. at EOS), the index is the
    shorter length: that is where one produced EOS and the other a token.

    Examples: ([1, 2, 3], [1, 2, 3]) -> None; ([1, 2, 3], [1, 5, 3]) -> 1;
    ([1, 2], [1, 2, 7]) -> 2.
    """
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def is_near_tie(gap: float, top2: tuple[int, int], token: int | None,
                eos_ids: tuple[int, ...], bound: float = NEAR_TIE) -> bool:
    """The target's top-two logits are within ``bound`` and the candidate's token at the
    divergence (``None`` = it stopped there, i.e. emitted an EOS) is one of those two.

    Example: gap 4e-4, top2 (11, 42), token 42 -> True; token 7 -> False; gap 0.3 -> False.
    """
    if not gap < bound:
        return False
    if token is None:
        return any(t in eos_ids for t in top2)
    return token in top2


def top2_at(backend: CausalLM, context: list[int]) -> tuple[float, tuple[int, int]]:
    """Gap between the target's two best logits after ``context`` (one fresh prefill,
    plain causal forward: the reference's own numerics), and those two token ids."""
    device = backend.info.device
    ids = torch.tensor([context], device=device)  # [1, T]
    pos = torch.arange(len(context), device=device)[None]  # [1, T]
    logits = backend.forward(ids, pos, backend.new_cache()).logits[0, -1].float()  # [V]
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), (int(top.indices[0]), int(top.indices[1]))


@dataclass(frozen=True)
class LosslessCheck:
    """One candidate output compared with the reference for the same prompt."""

    first_divergence: int | None  # None = identical ids and length
    reference_len: int
    candidate_len: int
    gap: float | None  # target's top-2 logit gap at the divergence (None when equal)
    near_tie: bool  # the divergence is explained by a near-tie (see module docstring)

    @property
    def status(self) -> Status:
        if self.first_divergence is None:
            return "equal"
        return "near-tie" if self.near_tie else "mismatch"

    def describe(self, reference: list[int], candidate: list[int]) -> str:
        i = self.first_divergence
        if i is None:
            return "equal"
        ref = reference[i] if i < len(reference) else "EOS"
        cand = candidate[i] if i < len(candidate) else "EOS"
        return (f"token {i}: reference {ref} vs candidate {cand}, top-2 gap {self.gap:.2e}, "
                f"lengths {self.reference_len}/{self.candidate_len}")


def check_greedy(backend: CausalLM, prompt: list[int], reference: list[int], candidate: list[int],
                 bound: float = NEAR_TIE) -> LosslessCheck:
    """Compare ``candidate`` with ``reference`` (both generated after ``prompt``); at a
    divergence, ask the target whether it is a near-tie (one extra prefill)."""
    i = first_divergence(reference, candidate)
    if i is None:
        return LosslessCheck(None, len(reference), len(candidate), None, False)
    gap, top2 = top2_at(backend, prompt + reference[:i])
    token = candidate[i] if i < len(candidate) else None
    near = is_near_tie(gap, top2, token, backend.info.eos_token_ids, bound)
    return LosslessCheck(i, len(reference), len(candidate), gap, near)


@dataclass(frozen=True)
class ExactnessRow:
    """One candidate record compared with the baseline record of the same prompt turn."""

    method: str
    question_id: int | str
    category: str
    turn: int
    repeat: int
    status: Status | Literal["skipped"]  # skipped: an earlier turn already diverged
    first_divergence: int | None
    gap: float | None
    detail: str


def check_records(records: list, baseline: str, backend: CausalLM,
                  bound: float = NEAR_TIE) -> list[ExactnessRow]:
    """Compare every non-baseline record with the baseline's record for the same
    (prompt, turn, repeat). A later turn whose conversation already diverged (its prompt
    contains a different earlier answer) is ``skipped``, not counted twice.
    ``records``: ``bench.harness.Record`` objects."""
    ref = {r.key: r for r in records if r.method == baseline}
    diverged: set[tuple] = set()
    rows = []
    for r in sorted((r for r in records if r.method != baseline), key=lambda r: (r.method, str(r.question_id), r.turn, r.repeat)):
        base = ref.get(r.key)
        conv = (r.method, r.question_id, r.repeat)
        if base is None or conv in diverged or base.prompt_ids != r.prompt_ids:
            reason = "no baseline record" if base is None else "an earlier turn diverged"
            rows.append(ExactnessRow(r.method, r.question_id, r.category, r.turn, r.repeat,
                                     "skipped", None, None, reason))
            continue
        ref_ids, cand = list(base.token_ids), list(r.token_ids)
        c = check_greedy(backend, list(base.prompt_ids), ref_ids, cand, bound)
        if c.status != "equal":
            diverged.add(conv)
        rows.append(ExactnessRow(r.method, r.question_id, r.category, r.turn, r.repeat,
                                 c.status, c.first_divergence, c.gap, c.describe(ref_ids, cand)))
    return rows


def exactness_counts(rows: list[ExactnessRow]) -> dict[str, dict[str, int]]:
    """Per method: how many records were equal / near-tie / mismatch / skipped.

    Example: two rows of "pld", one equal and one mismatch ->
    {"pld": {"equal": 1, "near-tie": 0, "mismatch": 1, "skipped": 0}}.
    """
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = out.setdefault(row.method, {"equal": 0, "near-tie": 0, "mismatch": 0, "skipped": 0})
        counts[row.status] += 1
    return out
