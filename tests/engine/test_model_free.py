"""``model-free`` (drafters/model_free.py: SuffixDecoding on a context match, else Token Recycling
sized by the target's cost curve; ``auto`` without a draft model stays SuffixDecoding). Greedy output equals plain decoding's on SmolLM2 with 1 and 2 runtime
threads, for the composition and for cost-sized Token Recycling alone, across requests (the
matrix and the tracked acceptance are kept); the statistics name what ran and who drafted."""

from __future__ import annotations

import pytest

from verispec.api import SpecDecoder, load_model
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.model_free import ModelFreeOptions, model_free_drafter
from verispec.drafters.token_recycling import TokenRecyclingDrafter
from verispec.registry import best_method, describe_method, make_drafter
from verispec.types import SamplingParams

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
           "Tell me a short story about a robot who learns to paint."]
PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)
CHEAP = {1: 1.02, 2: 1.04, 4: 1.1, 8: 1.3, 16: 1.9}  # drafts trees every step
STEEP = {1: 1.3, 2: 1.4, 4: 1.9, 8: 2.6, 16: 4.1}  # the 1.5B's measured shape: small trees or none


@pytest.fixture(scope="module")
def smollm2():
    lm = load_model("smollm2-135m-instruct")
    assert lm.backend_kind == "cpu"
    yield lm
    lm.backend.set_threads(1)


@pytest.fixture(scope="module")
def plain(smollm2):
    return [SpecDecoder(smollm2, "none").generate(p, PARAMS, chat=False).token_ids for p in PROMPTS]


def drafters(vocab: int):
    return {"model-free-cheap": model_free_drafter(vocab, CHEAP, ModelFreeOptions(min_match=3)),
            "model-free-steep": model_free_drafter(vocab, STEEP, ModelFreeOptions()),
            "recycling-cheap": TokenRecyclingDrafter(vocab, cost=CHEAP),
            "recycling-steep": TokenRecyclingDrafter(vocab, cost=STEEP)}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["model-free-cheap", "model-free-steep", "recycling-cheap", "recycling-steep"])
def test_greedy_equals_plain_on_the_compiled_runtime(smollm2, plain, threads, name):
    smollm2.backend.set_threads(threads)
    drafter = drafters(smollm2.backend.info.vocab_size)[name]
    dec = SpecDecoder(smollm2, drafter, num_draft_tokens=16)
    accepted = 0
    for _ in range(2):  # the second round drafts from what the first taught
        for prompt, want in zip(PROMPTS, plain):
            out = dec.generate(prompt, PARAMS, chat=False)
            assert out.token_ids == want
            accepted += out.stats.accepted
    if name.endswith("cheap"):
        assert accepted > 0


def test_model_free_by_name_auto_stays_suffix(smollm2, plain):
    """auto without a draft stays SuffixDecoding (model-free measured no more tokens a step,
    docs/benchmarks.md); model-free, asked by name, is the hybrid with cost-sized Token Recycling."""
    assert best_method(smollm2) == ("suffix", {})
    assert best_method(smollm2, batched=True) == ("prompt-lookup", {})
    assert describe_method("auto", smollm2) == "auto: suffix"
    drafter = make_drafter("model-free", smollm2, {"min_match": "4"})
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.learned, TokenRecyclingDrafter)
    assert drafter.min_match == 4 and drafter.learned.cost is not None  # sized by the target's measured t(n)
    dec = SpecDecoder(smollm2, drafter, num_draft_tokens=16)
    for prompt, want in zip(PROMPTS, plain):
        assert dec.generate(prompt, PARAMS, chat=False).token_ids == want
    assert sum(drafter.steps.values()) > 0  # who drafted each step is counted (the statistics name it)
    with pytest.raises(ValueError, match="has no option"):
        make_drafter("model-free", smollm2, {"window": 3})


def test_generate_and_bench_name_what_auto_ran(tmp_path):
    """``verispec generate --json`` names the method auto resolved to and who drafted its steps;
    ``verispec bench`` says it in a notice."""
    import json

    from typer.testing import CliRunner

    from verispec.bench.command import BenchOptions, build_runners
    from verispec.bench.methods import parse_method, with_baseline
    from verispec.cli import app
    from verispec.registry import DRAFTERS

    r = CliRunner().invoke(app, ["generate", "--model", "smollm2-135m-instruct", "-n", "24", "--json", "--drafter", "model-free",
                                 "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["drafter"] == "model-free" and sum(stats["drafted_by"].values()) == stats["steps"]
    from rich.console import Console

    from verispec.cli.decoding import stats_table

    console = Console(record=True, width=200)
    console.print(stats_table(stats))
    text = console.export_text()
    assert "model-free" in text and "drafted_by" in text
    lm = load_model("stories260k")
    opts = BenchOptions(None, ("qa",), 1, (), "stories260k", "auto", "float32", 0.0, 1.0, 0, 0, 8, 4, "fixed",
                        1, 0, 1, False, None, 1e-3, tmp_path, False, False)
    _, notices = build_runners(with_baseline([parse_method("auto", DRAFTERS)]), lm, opts)
    assert notices == ["method auto: auto: suffix"]  # stories260k runs natively: suffix
