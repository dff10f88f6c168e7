"""Drafters on the real target, SmolLM2-135M-Instruct: the shipped EAGLE, EAGLE-3 and Medusa weights
and the training-free tree drafters give plain greedy decoding's tokens (strict on the compiled
runtime; on transformers float32 up to justified near-ties, tests/exactness.py)."""

from __future__ import annotations

import pytest

from exactness import compare_greedy
from helpers import run, shared_file
from verispec.api import load_model
from verispec.drafters.base import NoDrafter
from verispec.drafters.eagle import load_target_embedding
from verispec.drafters.medusa import MedusaDrafter, MedusaHeads
from verispec.drafters.retrieval import build_datastore
from verispec.registry import make_drafter
from verispec.types import SamplingParams


# ---- the real target with the shipped weights ----------------------------------------------
@pytest.mark.parametrize("name,opts", [("eagle", {"mode": "tree"}), ("eagle", {"mode": "chain"}), ("medusa", {}),
                                      ("medusa", {"tree": "sequoia"})])
def test_smollm2_shipped_drafters_greedy_exact(name, opts):
    from exactness import compare_greedy
    from verispec.api import SpecDecoder, encode_prompt
    from verispec.weights import ROOT, SHIPPED

    assert (ROOT / SHIPPED[(name, "smollm2-135m-instruct")]).exists(), f"no shipped {name} weights"
    lm = load_model("smollm2-135m-instruct", dtype="float32", backend="hf")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    prompts = [encode_prompt(lm, "Explain what a rainbow is in two sentences."),
               encode_prompt(lm, "Write a short poem about the sea.")]
    drafter = name
    if opts.get("tree") == "sequoia":  # the DP tree at the engine's budget (hardware-aware size: test_real_native)
        drafter = MedusaDrafter(MedusaHeads.load(ROOT / SHIPPED[(name, "smollm2-135m-instruct")]),
                                load_target_embedding(lm.hf_dir), tree="sequoia")
    plain_dec, dec = SpecDecoder(lm, "none"), SpecDecoder(lm, drafter, opts, num_draft_tokens=12)
    accepted = 0
    for prompt in prompts:
        plain = _ids(plain_dec, prompt, params)
        spec_req = dec.engine.add_request(prompt, params)
        while not spec_req.finished:
            dec.engine.step(spec_req)
        compare_greedy(lm.backend, prompt, plain, spec_req.generated)
        accepted += spec_req.stats.accepted
    assert accepted > 10


def _ids(dec, prompt, params):
    req = dec.engine.add_request(prompt, params)
    while not req.finished:
        dec.engine.step(req)
    return req.generated


@pytest.mark.parametrize("mode,runtime,budget", [("tree", "compiled", "measured"), ("chain", "compiled", "measured"),
                                                ("tree", "compiled", "fixed"), ("tree", "torch", "fixed")])
def test_smollm2_shipped_eagle3_greedy_exact(mode, runtime, budget):
    """The shipped EAGLE-3 head on the real target (default backend: the compiled runtime,
    which returns the fused layers), the head itself on the compiled runtime (Q8_0, the
    default there) or in PyTorch, drafts filling the budget or cut by the measured cost
    curve (which depends on the machine): token-for-token plain greedy decoding, drafts accepted."""
    from verispec.api import encode_prompt, load_model
    from verispec.weights import has_shipped

    assert has_shipped("eagle3", "smollm2-135m-instruct"), "no shipped eagle3 weights"
    lm = load_model("smollm2-135m-instruct")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    accepted = 0
    for text in ("Explain what a rainbow is in two sentences.", "Write a short poem about the sea."):
        prompt = encode_prompt(lm, text)
        plain, _ = run(lm.backend, NoDrafter(), prompt, params)
        drafter = make_drafter("eagle3", lm, {"mode": mode, "runtime": runtime, "budget": budget})
        assert type(drafter.runner).__name__ == {"compiled": "CompiledHeadRunner", "torch": "TorchHeadRunner"}[runtime]
        spec, stats = run(lm.backend, drafter, prompt, params, k=8)
        assert spec == plain
        accepted += stats.accepted
    assert accepted > (10 if budget == "fixed" else 0)


# ---- SmolLM2 (near-tie rule), short -----------------------------------------------------------------
SMOL_DRAFTERS = [("suffix", {}, 8), ("token-recycling", {}, 16), ("lookahead", {}, 30),
                 ("rest", {}, 12), ("prompt-lookup", {"num_candidates": "4"}, 10)]


@pytest.fixture(scope="module")
def smol_case(tmp_path_factory):
    from verispec.api import encode_prompt, load_model
    from verispec.bench.datasets import load_spec_bench
    from verispec.drafters.retrieval import read_documents, tokenizer_fingerprint

    lm = load_model("smollm2-135m-instruct", dtype="float32", backend="hf")
    rows = load_spec_bench(categories=("summarization", "qa"), limit_per_category=1)
    prompts = [encode_prompt(lm, r.turns[0][:1200]) for r in rows]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = [run(lm.backend, NoDrafter(), p, params)[0] for p in prompts]
    texts = list(read_documents(shared_file("data/gsm8k/train.jsonl"), "answer"))[:300]
    ds = build_datastore((lm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts),
                         fingerprint=tokenizer_fingerprint(lm.tokenizer))
    path = tmp_path_factory.mktemp("ds") / "gsm8k.npz"
    ds.save(path)
    return lm, prompts, plain, params, path


@pytest.mark.parametrize("name,opts,k", SMOL_DRAFTERS, ids=[d[0] + ("-tree" if d[1] else "") for d in SMOL_DRAFTERS])
def test_smollm2_greedy_equals_plain(smol_case, name, opts, k):
    from verispec.registry import make_drafter

    lm, prompts, plain, params, ds_path = smol_case
    opts = {**opts, "datastore": str(ds_path)} if name == "rest" else opts
    drafter = make_drafter(name, lm, opts)
    near_ties = 0
    for prompt, want in zip(prompts, plain):
        ids, _ = run(lm.backend, drafter, prompt, params, k=k)
        near_ties += compare_greedy(lm.backend, prompt, want, ids).near_tie_at is not None
    assert near_ties <= 1, f"{near_ties} near-ties in {len(prompts)} prompts"
