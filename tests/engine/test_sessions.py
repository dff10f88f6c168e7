"""Agent sessions (issue 34): each request carries the whole history (system prompt, tool outputs,
earlier answers). Through ``auto``'s hybrid rule (suffix drafts after a match of 6 or more tokens,
the learned drafter sizing itself otherwise), every turn of two sessions that share a tool output
equals plain greedy decoding, and free suffix drafts are taken and accepted (drafting from another
session's prompt is tested on the drafter: tests/unit/test_suffix_tree.py). The draft model starts
(prefills) a request only when the hybrid first asks it to draft, and with its own prefix cache
prefills only the part of a turn's history that is new."""

from __future__ import annotations

import pytest
from helpers import run

from verispec.drafters.base import DraftContext, NoDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.sampling import make_generator
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


class _Spy(DraftModelDrafter):
    """A draft model that records the prompts it starts requests with."""

    def __init__(self, target):
        super().__init__(target)
        self.started: list[list[int]] = []

    def start(self, request_id, prompt_ids):
        self.started.append(list(prompt_ids))
        super().start(request_id, prompt_ids)


def test_the_draft_model_starts_only_when_first_asked(tiny_dirs):
    """A request the suffix drafts carry never starts (prefills) the draft model; one that needs it
    starts it at that step, with everything committed before the step, and stays equal to plain."""
    target, draft = (cpu.CpuLlama.from_hf_dir(tiny_dirs[kind][0], max_length=512, threads=2)
                     for kind in ("llama", "llama3-tied"))
    spy = _Spy(draft)
    h = HybridDrafter(SuffixDecodingDrafter(), spy, min_match=6, learned_sizing="self", cost=FLAT)
    prompt = [1] + TOOL * 3
    h.start("r", prompt)
    ctx = DraftContext("r", prompt + [TOOL[0]], 8, PARAMS, make_generator(0, 1))  # continues a repeat
    assert h.propose(ctx).num_drafted > 0 and spy.started == []  # retrieval drafted: no draft prefill
    h.finish("r")
    h.start("s", [1, 7, 9])
    ctx = DraftContext("s", [1, 7, 9, 4], 8, PARAMS, make_generator(0, 1))  # nothing to retrieve
    h.propose(ctx)
    assert spy.started == [[1, 7, 9]]  # the committed tokens before this step's root
    h.finish("s")
    want, _ = run(target, NoDrafter(), [1, 7, 9, 4, 5], PARAMS)
    got, _ = run(target, h, [1, 7, 9, 4, 5], PARAMS, k=8)
    assert got == want and spy.started[-1] == [1, 7, 9, 4, 5]


def test_the_draft_models_prefix_cache_carries_a_session(tiny_dirs):
    """Each turn of a session sends the whole history; with its own prefix cache the draft model
    prefills only what is new (the history's K/V come from the cache), drafts exactly what it drafts
    without one (the same drafted and accepted counts), and every turn equals plain decoding."""
    from verispec.engine import Engine
    from verispec.engine.prefix_cache import PrefixCache

    target, draft = (cpu.CpuLlama.from_hf_dir(tiny_dirs[kind][0], max_length=512, threads=2)
                     for kind in ("llama", "llama3-tied"))
    cached = DraftModelDrafter(draft, prefix_cache=PrefixCache(1 << 24))
    fresh = DraftModelDrafter(draft)
    engines = [Engine(target, d, 4) for d in (cached, fresh)]
    history, sent_before, reused_before = [1, 10, 11, 12] + TOOL * 2, [], 0
    for turn in range(3):
        want, _ = run(target, NoDrafter(), history, PARAMS)
        fed, counts = [], []
        for engine in engines:
            before = engine.drafter.fed_tokens
            req = engine.add_request(history, PARAMS)
            while not req.finished:
                engine.step(req)
            engine.finish(req, req.finished)
            assert req.generated == want
            fed.append(engine.drafter.fed_tokens - before)
            counts.append((req.stats.drafted, req.stats.accepted))
        assert counts[0] == counts[1]  # the same drafts
        reused = fed[1] - fed[0]  # history tokens the cached draft did not run again
        assert reused == cached.prefix_cache.stats.reused_tokens - reused_before
        assert reused >= len(sent_before) - 16  # what the last turn sent, but its last, partial block
        sent_before, reused_before = list(history), cached.prefix_cache.stats.reused_tokens
        history += want + TOOL[turn:turn + 6]  # the answer, then the next tool output
