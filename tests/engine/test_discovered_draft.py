"""``auto`` with a draft found on the machine (``--draft-search``, ``models/discovery.py``): a tiny
random qwen2 target whose smaller same-vocabulary GGUF sits in a fixture store gets the hybrid of
suffix and that draft, one of another vocabulary drafts through text, and nothing found leaves
``auto`` as it was. Greedy output equals plain decoding's token for token, alone and with the draft
forced to draft every step; sampling keeps the target's law; the command line says the choice in
one line and names what ran in its statistics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import same_first_tokens_law
from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.models.discovery import Location, with_found_draft
from verispec.registry import best_method, describe_method, make_drafter
from verispec.types import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_discovery import model, ollama_store  # noqa: E402

PROMPT = "the the he t"
FORCED = {"budget": "fixed", "learned_stop": "fixed"}  # the draft drafts every step retrieval does not


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(root / "cache"))  # cost curves and tokenizers of these files
        target = model(root / "target.gguf", hidden=128, layers=4, seed=0, name="target")
        same = model(root / "same" / "draft.gguf", hidden=32, seed=1)
        other = model(root / "other" / "other.gguf", hidden=32, seed=2, other_vocab=True)
        ollama_store(root / "ollama", "tiny", "latest", hidden=32, seed=3)
        yield {"root": root, "target": target, "same": same, "other": other, "cpu": load_model(str(target),
                                                                                                  backend="cpu")}


def plain_and(lm, drafter, options=None, n=40):
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    plain = SpecDecoder(lm, "none").generate(PROMPT, params)
    dec = SpecDecoder(lm, drafter, options, num_draft_tokens=4)
    return plain.token_ids, dec.generate(PROMPT, params), dec


def test_a_same_vocabulary_draft_runs_in_autos_hybrid_and_greedy_is_plain(stores):
    said = []
    lm = with_found_draft(stores["cpu"], [Location(stores["same"].parent)], said.append)
    assert said == [f"draft search: drafting {stores['target']} with draft.gguf from dir ({stores['same']}; "
                    f"{lm.found_draft.cost:.2f}x its size, same vocabulary)"]
    want = ("hybrid", {"learned": "draft", "min_match": 6, "learned_model": str(stores["same"])})
    assert best_method(lm) == want and best_method(lm, batched=True) == want
    assert describe_method("auto", lm) == f"auto: hybrid (learned=draft, min_match=6, learned_model={stores['same']})"
    for options in ({}, FORCED):
        plain, out, dec = plain_and(lm, "auto", options)
        assert isinstance(dec.drafter, HybridDrafter) and isinstance(dec.drafter.learned, DraftModelDrafter)
        assert out.token_ids == plain
    assert out.stats.drafted > 0  # forced: the discovered draft drafted


def test_another_vocabulary_drafts_through_text_and_greedy_is_plain(stores):
    lm = with_found_draft(stores["cpu"], [Location(stores["other"].parent)], lambda line: None)
    assert not lm.found_draft.same_vocab
    assert best_method(lm, batched=True) == ("prompt-lookup", {})  # not in the batched server
    said = []
    assert with_found_draft(stores["cpu"], [Location(stores["other"].parent)], said.append,
                            batched=True).found_draft is None and "auto runs without one" in said[-1]
    plain, out, dec = plain_and(lm, "auto", FORCED)
    assert isinstance(dec.drafter.learned, CrossTokenizerDrafter)
    assert out.token_ids == plain and out.stats.drafted > 0


def test_an_ollama_blob_is_loaded_as_found_and_keeps_the_law(stores):
    lm = with_found_draft(stores["cpu"], [Location(stores["root"] / "ollama", "ollama")], lambda line: None)
    assert lm.found_draft.name == "tiny:latest" and lm.found_draft.path.name.startswith("sha256-")
    plain, out, _ = plain_and(lm, "auto", FORCED)
    assert out.token_ids == plain and out.stats.drafted > 0
    drafter = make_drafter("auto", lm, FORCED)
    assert same_first_tokens_law(lm.backend, drafter, encode_prompt(lm, PROMPT), seeds=120) > 1e-3


def test_nothing_found_leaves_auto_as_it_was(stores, tmp_path, stories_native, monkeypatch):
    said = []
    lm = with_found_draft(stores["cpu"], [Location(tmp_path)], said.append)
    assert lm.found_draft is None and best_method(lm) == ("model-free", {}) and "auto runs without one" in said[0]
    assert with_found_draft(stories_native, [Location(tmp_path)], said.append) is stories_native
    assert said[-1].startswith("draft search: not searched, stories260k is not a GGUF file")
    native = load_model(str(stores["target"]), backend="native")
    assert with_found_draft(native, [Location(stores["same"].parent)], said.append) is native
    assert said[-1].startswith(f"draft search: not searched, {stores['target']} runs on the native backend")
    monkeypatch.setattr("verispec.models.catalog.catalog_draft", lambda target: "its-draft")
    assert with_found_draft(stores["cpu"], [Location(stores["same"].parent)], said.append) is stores["cpu"]
    assert said[-1] == f"draft search: not needed, {stores['target']} has its catalog draft its-draft"


def test_a_found_file_the_loader_refuses_is_skipped_for_the_next(stores, tmp_path):
    """A header that reads as a draft but whose tensor table the loader refuses: one line, the next one."""
    from gguf_fixtures import patch, tiny_qwen2, write_gguf

    bad = tmp_path / "a-bad.gguf"
    meta, tensors = tiny_qwen2(hidden=32, heads=2, kv_heads=1, ffn=64, context=1024)
    patch(bad, write_gguf(bad, meta, tensors)["tensor blk.0.attn_k.weight dim 0"], 0)
    model(tmp_path / "b-good.gguf", hidden=64)
    said = []
    lm = with_found_draft(stores["cpu"], [Location(tmp_path)], said.append)
    assert lm.found_draft.name == "b-good.gguf" and len(said) == 2
    assert said[0].startswith("draft search: skipped a-bad.gguf: ") and "\n" not in said[0]


def test_the_command_line_says_the_choice_and_names_what_ran(stores):
    from verispec.cli import app

    args = ["generate", PROMPT, "--model", str(stores["target"]), "-n", "12", "--json", "--threads", "2"]
    found = CliRunner().invoke(app, [*args, "--draft-search-path", str(stores["same"].parent)])
    plain = CliRunner().invoke(app, [*args, "--drafter", "none"])
    assert found.exit_code == 0 and plain.exit_code == 0, found.output
    lines = found.output.splitlines()
    assert any(line.startswith("draft search: drafting ") for line in lines)
    out = json.loads(next(line for line in lines if line.startswith("{")))
    assert out["stats"]["drafter"].startswith("auto: hybrid (learned=draft") and str(stores["same"]) in out["stats"]["drafter"]
    assert out["token_ids"] == json.loads(next(line for line in plain.output.splitlines() if line.startswith("{")))["token_ids"]


def test_the_server_runs_the_found_draft_for_auto(stores, capsys):
    from verispec.server.state import ServerConfig, build_state

    config = ServerConfig(model=str(stores["target"]), backend="cpu", drafters=("auto", "none"), max_model_len=256,
                          max_batch=2, draft_search=(Location(stores["same"].parent),))
    state = build_state(config)
    try:
        assert state.aliases == {"auto": "hybrid"} and state.config.drafters == ("hybrid", "none")
        assert "draft search: drafting" in capsys.readouterr().err
    finally:
        state.close()


def test_a_cost_curve_that_dips_at_its_end_still_builds_the_hybrid(stores, monkeypatch):
    """Timed on a busy machine, t(n) may fall between its two largest sizes: the draft's catch-up cost
    per token (their slope) is then 0, not a negative cost the hybrid refuses."""
    import verispec.cost_curve as cc

    def curve(model, key, sizes=(), *args, **kwargs):
        return {1: 0.3} if "draftstep" in key else {1: 1.0, 8: 2.0, 16: 1.9}

    monkeypatch.setattr(cc, "cached_cost_curve", curve)
    monkeypatch.setattr("verispec.registry._COSTS", {})  # the target's cost model is built once per process
    lm = with_found_draft(stores["cpu"], [Location(stores["same"].parent)], lambda line: None)
    drafter = make_drafter("auto", lm)
    assert isinstance(drafter, HybridDrafter) and drafter.catch_up_cost == 0.0


def test_bench_runs_auto_with_the_found_draft_and_records_it(stores, tmp_path):
    from verispec.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "--model", str(stores["target"]), "--draft-search-path",
                                      str(stores["same"].parent), "-m", "auto", "-c", "qa", "--limit", "1", "-n", "8",
                                      "--max-prompt-tokens", "200", "--warmup", "0", "--strict", "--output-dir",
                                      str(out)])
    assert result.exit_code == 0, result.output
    assert "draft search: drafting" in result.output and "exactness auto: 1 equal" in result.output
    assert json.loads((out / "results.json").read_text())["meta"]["found_draft"] == str(stores["same"])
