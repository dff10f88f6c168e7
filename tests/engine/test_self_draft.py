"""Self-speculation on the compiled runtime (``models/self_draft.py``, ``-o model=self skip=...`` of the
draft drafter): the target with a subset of its layers, its weights shared (no copy, no second file),
computes bit for bit what a draft loaded from the file with those layers skipped computes; speculative
output with it is plain decoding's, greedy (chains, 1 and 2 threads, batched server rows) and under the
law of sampling; bad subsets are refused in one line."""

from __future__ import annotations

import pytest
import torch

from gguf_fixtures import tiny_qwen2, write_gguf
from helpers import run, same_first_tokens_law
from verispec.api import load_draft_model, load_model
from verispec.drafters.base import NoDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine
from verispec.engine.batch import BatchEngine, SpecSchedule
from verispec.models.load import DraftShape
from verispec.models.self_draft import layer_subset
from verispec.registry import default_self_skip, make_drafter
from verispec.types import SamplingParams

IDS = [(7 * i + 3) % 250 + 5 for i in range(40)]
PROMPTS = [IDS[:12], IDS[5:20], [9, 200, 31, 9, 200, 31, 9]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("self")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(root / "cache"))  # the cost curves of this file
        path = root / "t8.gguf"
        write_gguf(path, *tiny_qwen2(hidden=128, ffn=256, heads=4, kv_heads=2, layers=8, context=512))
        yield path, load_model(str(path), backend="cpu")


def logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(ids) + 1)
    return model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits[0]


def test_a_layer_subset_is_the_file_with_those_layers_skipped_without_copying_them(tiny):
    path, lm = tiny
    sub = layer_subset(lm.backend, (0, 1, 3, 5, 7))
    loaded = load_draft_model(lm, str(path), shape=DraftShape(skip=(2, 4, 6)))
    assert torch.equal(logits(sub, IDS), logits(loaded, IDS))
    assert sub.args.n_layers == 5 and sub.info.name.endswith("[skip 2+4+6]")
    assert sub.resident_bytes == 0 < sub.weight_bytes < lm.backend.weight_bytes  # reads its layers, holds none
    assert torch.equal(logits(layer_subset(lm.backend, tuple(range(8))), IDS), logits(lm.backend, IDS))
    assert not torch.equal(logits(sub, IDS), logits(lm.backend, IDS))
    del lm  # the subset keeps the target's weights alive
    assert torch.equal(logits(sub, IDS), logits(loaded, IDS))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("opts", [{"stop": "fixed"}, {"skip": "1+2+3+4+5+6", "stop": "fixed"}, {}],
                         ids=["default-skip", "keep-ends", "cost-sized"])
def test_greedy_self_speculation_is_plain_decoding(tiny, opts, threads):
    _, lm = tiny
    lm.backend.set_threads(threads)
    try:
        drafter = make_drafter("draft", lm, {"model": "self", **opts})
        params = SamplingParams(max_new_tokens=60, ignore_eos=True)
        for prompt in PROMPTS:
            plain, _ = run(lm.backend, NoDrafter(), prompt, params)
            spec, stats = run(lm.backend, drafter, prompt, params, k=4)
            assert spec == plain
        assert stats.drafted > 0 or "stop" not in opts
    finally:
        lm.backend.set_threads(2)


def test_batched_rows_with_the_self_draft_are_each_requests_plain_tokens(tiny):
    _, lm = tiny
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    refs = [run(lm.backend, NoDrafter(), p, params)[0] for p in PROMPTS]
    drafter = make_drafter("draft", lm, {"model": "self", "stop": "fixed"})
    assert isinstance(drafter, DraftModelDrafter)
    be = BatchEngine(lm.backend, {"d": Engine(lm.backend, drafter, 4)}, max_batch=4, max_length=128,
                     schedule=SpecSchedule("budget", 0))
    reqs = [be.add_request(f"r{i}", p, params, "d") for i, p in enumerate(PROMPTS)]
    while not all(r.finished for r in reqs):
        step = be.step([r for r in reqs if not r.finished])
        assert not any(isinstance(x, Exception) for x in step.results), step.results
    assert [r.generated for r in reqs] == refs


def test_sampling_with_the_self_draft_keeps_the_targets_law(tiny):
    _, lm = tiny
    drafter = make_drafter("draft", lm, {"model": "self", "stop": "fixed"})
    assert same_first_tokens_law(lm.backend, drafter, IDS[:12], seeds=150) > 1e-3


def test_the_default_skip_leaves_out_every_other_middle_layer():
    assert default_self_skip(8) == (3, 5) and default_self_skip(28) == (8, 10, 12, 14, 16, 18, 20)
    assert default_self_skip(2) == ()


@pytest.mark.parametrize("opts,match", [({"skip": "8"}, r"skip must name distinct layers in \[0, 8\)"),
                                        ({"skip": "0-7"}, "and keep one"),
                                        ({"vocab": "100"}, "no vocab=N, quant or window"),
                                        ({"window": "4"}, "no vocab=N, quant or window")])
def test_bad_self_drafts_are_refused(tiny, opts, match):
    _, lm = tiny
    with pytest.raises(ValueError, match=match):
        make_drafter("draft", lm, {"model": "self", **opts})
    with pytest.raises(ValueError, match="ascending, distinct"):
        layer_subset(lm.backend, (3, 1))


def test_self_needs_the_compiled_runtime(stories_native):
    with pytest.raises(ValueError, match="model=self needs the compiled runtime"):
        make_drafter("draft", stories_native, {"model": "self"})


def test_a_runtime_built_before_layer_subsets_is_one_line(tiny, monkeypatch):
    from verispec.models import self_draft
    from verispec.models.base import ModelError

    monkeypatch.setattr(self_draft, "library", lambda: object())  # a build without vs_model_subset
    with pytest.raises(ModelError, match="predates layer subsets"):
        layer_subset(tiny[1].backend, (0, 1))
