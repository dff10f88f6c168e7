"""``--drafter auto`` on the real Qwen2.5-Coder pair: the 1.5B gets the hybrid of suffix and its
0.5B draft, whose greedy output is plain decoding's, alone and in batched server rows."""

from __future__ import annotations

import pytest

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.drafters.hybrid import HybridDrafter
from verispec.registry import best_method, describe_method, make_drafter
from verispec.types import SamplingParams

TARGET = "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def qwen():
    return load_model(TARGET)


@pytest.mark.qwen
def test_auto_on_the_qwen_pair_is_the_hybrid_with_its_draft(qwen):
    assert best_method(qwen) == ("hybrid", {"learned": "draft", "min_match": 6})
    assert best_method(qwen, batched=True) == ("hybrid", {"learned": "draft", "min_match": 6})
    assert describe_method("auto", qwen) == "auto: hybrid (learned=draft, min_match=6)"


@pytest.mark.qwen
def test_auto_greedy_equals_plain_alone_and_batched(qwen):
    """Greedy: the default method's tokens are plain decoding's, run alone and as rows of one
    batched server step (two requests: a code task and a rewrite), and it drafts with both."""
    from verispec.engine.batch import BatchEngine, SpecSchedule
    from verispec.engine.engine import Engine

    prompts = [encode_prompt(qwen, "Write a Python function is_prime(n) with a docstring."),
               encode_prompt(qwen, "Repeat this function with a new name:\n\ndef clamp(x, lo, hi):\n    if x < lo:\n"
                                   "        return lo\n    if x > hi:\n        return hi\n    return x\n")]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain, auto = SpecDecoder(qwen, "none"), SpecDecoder(qwen, "auto", num_draft_tokens=8)
    assert isinstance(auto.drafter, HybridDrafter)
    assert auto.drafter.learned_sizing == "self" and auto.drafter.min_match == 6  # the draft sizes itself
    alone = []
    for ids in prompts:
        ref = plain.engine.add_request(ids, params)
        while not ref.finished:
            plain.engine.step(ref)
        req = auto.engine.add_request(ids, params)
        while not req.finished:
            auto.engine.step(req)
        assert req.generated == ref.generated
        assert req.stats.accepted > 10
        alone.append(ref.generated)
    assert auto.drafter.steps["retrieval"] > 0 and auto.drafter.steps["learned"] > 0  # the rewrite copies
    engine = Engine(qwen.backend, make_drafter("auto", qwen, batched=True), 8)
    be = BatchEngine(qwen.backend, {"auto": engine}, max_batch=2, max_length=256, schedule=SpecSchedule("budget", 0))
    reqs = [be.add_request(f"r{i}", ids, params, "auto") for i, ids in enumerate(prompts)]
    while not all(r.finished for r in reqs):
        step = be.step([r for r in reqs if not r.finished])
        assert not any(isinstance(x, Exception) for x in step.results), step.results
    assert [r.generated for r in reqs] == alone
