"""A draft model made cheaper at load (``models.load.DraftShape``: layers skipped, attention over a
sliding window; ``-o skip= window=`` of the draft drafter) on a tiny random GGUF: what the draft
computes is exactly the model it claims to be (skipping the last layer is the first layers
alone; a window at least as long as the context changes no bit, a short one changes only the
positions that see past it), and speculative output with it is plain decoding's, greedy and
under the law of sampling. Bad shapes are refused in one line."""

from __future__ import annotations

import pytest
import torch

from gguf_fixtures import write_tiny_gguf
from helpers import run, same_first_tokens_law
from verispec.api import load_draft_model, load_model
from verispec.drafters.base import NoDrafter
from verispec.models.load import DraftShape
from verispec.registry import layer_list, make_drafter
from verispec.types import SamplingParams


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")  # 2 layers, 128 positions
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(str(tiny_path), backend="cpu")


def logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(ids) + 1)
    return model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits[0]


IDS = [(7 * i + 3) % 250 + 5 for i in range(40)]


def test_skipping_the_last_layer_is_the_first_layer_alone(tiny, tiny_path):
    skipped = load_draft_model(tiny, str(tiny_path), shape=DraftShape(skip=(1,)))
    first = load_draft_model(tiny, "truncated:1")
    assert skipped.args.n_layers == 1
    assert torch.equal(logits(skipped, IDS), logits(first, IDS))
    other = load_draft_model(tiny, str(tiny_path), shape=DraftShape(skip=(0,)))  # the second layer alone
    assert not torch.equal(logits(other, IDS), logits(first, IDS))


def test_a_window_changes_only_the_positions_that_see_past_it(tiny, tiny_path):
    full = logits(tiny.backend, IDS)
    assert torch.equal(logits(load_draft_model(tiny, str(tiny_path), shape=DraftShape(window=64)), IDS), full)
    short = logits(load_draft_model(tiny, str(tiny_path), shape=DraftShape(window=8)), IDS)
    assert torch.equal(short[:8], full[:8])  # at most 8 keys: the window holds them all
    assert all(not torch.equal(short[t], full[t]) for t in range(8, len(IDS)))


@pytest.mark.parametrize("opts", [{"skip": "1"}, {"window": "6"}, {"skip": "0", "window": "4"}],
                         ids=["skip", "window", "both"])
def test_greedy_speculation_with_a_shaped_draft_is_plain_decoding(tiny, tiny_path, opts):
    drafter = make_drafter("draft", tiny, {"model": str(tiny_path), "quant": "file", "stop": "fixed", **opts})
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    plain, _ = run(tiny.backend, NoDrafter(), IDS[:20], params)
    spec, stats = run(tiny.backend, drafter, IDS[:20], params, k=4)
    assert spec == plain and stats.drafted > 0


def test_sampling_with_a_shaped_draft_keeps_the_targets_law(tiny, tiny_path):
    drafter = make_drafter("draft", tiny, {"model": str(tiny_path), "quant": "file", "stop": "fixed",
                                           "skip": "1", "window": "4"})
    assert same_first_tokens_law(tiny.backend, drafter, IDS[:12], seeds=150) > 1e-3


def test_layer_lists():
    assert layer_list("") == () and layer_list("3") == (3,) and layer_list("3+10-12") == (3, 10, 11, 12)
    for bad in ("a", "1,2", "3-", "-2", "1-999999", "12-10"):
        with pytest.raises(ValueError, match="skip"):
            layer_list(bad)


@pytest.mark.parametrize("opts,match", [({"skip": "2"}, "skip must name distinct layers in \\[0, 2\\)"),
                                        ({"skip": "0+1"}, "and keep one"),
                                        ({"skip": "1+1"}, "distinct"),
                                        ({"window": "-3"}, "window must be >= 0")])
def test_bad_shapes_are_refused(tiny, tiny_path, opts, match):
    with pytest.raises(ValueError, match=match):
        make_drafter("draft", tiny, {"model": str(tiny_path), "quant": "file", **opts})


def test_a_shape_needs_the_compiled_runtime(stories_native):
    with pytest.raises(ValueError, match="skip= and window= need a GGUF draft on the compiled runtime"):
        make_drafter("draft", stories_native, {"model": "stories260k", "window": "8"})
