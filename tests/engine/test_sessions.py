"""Agent sessions (issue 34): each request carries the whole history (system prompt, tool outputs,
earlier answers). Through ``auto``'s hybrid rule (suffix drafts after a match of 6 or more tokens,
the learned drafter sizing itself otherwise), every turn of two sessions that share a tool output
equals plain greedy decoding, and free suffix drafts are taken and accepted (drafting from another
session's prompt is tested on the drafter: tests/unit/test_suffix_tree.py)."""

from __future__ import annotations

import pytest
from helpers import run

from verispec.drafters.base import NoDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.types import SamplingParams

FLAT = {n: 1.0 for n in (1, 2, 4, 8, 16)}
TOOL = list(range(50, 62))  # a tool output both sessions see
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)
cpu = pytest.importorskip("verispec.models.cpu")


def test_sessions_through_auto_equal_plain_and_take_free_drafts(tiny_dirs):
    """Tiny random models on the compiled runtime: the target and a draft of another seed."""
    toy_target, toy_draft = (cpu.CpuLlama.from_hf_dir(tiny_dirs[kind][0], max_length=512, threads=2)
                             for kind in ("llama", "llama3-tied"))
    h = HybridDrafter(SuffixDecodingDrafter(), DraftModelDrafter(toy_draft), min_match=6, learned_sizing="self",
                      cost=FLAT)
    accepted = []
    for start in ([1, 10, 11, 12] + TOOL, [1, 20, 21] + TOOL[:5]):
        history = list(start)
        for turn in range(3):
            want, _ = run(toy_target, NoDrafter(), history, PARAMS)
            got, stats = run(toy_target, h, history, PARAMS, k=8)
            assert got == want
            accepted.append(stats.accepted)
            history += want + TOOL[turn:turn + 6]  # the answer, then the next tool output
    assert h.steps["retrieval"] > 0 and h.accepted["retrieval"] > 0, accepted
