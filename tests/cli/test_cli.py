"""The command line: golden output, JSON shape, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest
from transformers.utils import logging as hf_logging
from typer.testing import CliRunner

from verispec.cli import app

runner = CliRunner()
hf_logging.disable_progress_bar()  # as verispec.cli.main does
GOLDEN_START = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_stories_golden_json_through_plain_engine():
    r = invoke("generate", "--model", "stories260k", "--temperature", "0", "--drafter", "none",
               "-n", "40", "--json", "")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["text"].startswith(GOLDEN_START)
    assert len(out["token_ids"]) == 40
    assert out["stats"]["target_forwards"] == 40 and out["stats"]["tau"] == 1.0


def test_stories_prompt_lookup_matches_golden_and_reports_stats():
    r = invoke("generate", "--model", "stories260k", "--drafter", "prompt-lookup", "-n", "200", "--json", "")
    out = json.loads(r.stdout)
    assert out["text"].startswith(GOLDEN_START)
    assert out["stats"]["target_forwards"] < 200 and out["stats"]["tau"] > 1.0


@pytest.mark.parametrize("backend,exact,needle", [("native", True, "row-invariant"), ("hf", False, "transformers")])
def test_json_reports_whether_output_is_bit_exact(backend, exact, needle):
    r = invoke("generate", "--model", "stories260k", "--backend", backend, "-n", "8", "--json", "")
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["bit_exact"] is exact and needle in stats["bit_exact_reason"]


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["-n", "0"], "max_new_tokens"),
    (["--drafter", "nope"], "unknown drafter"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--model", "/does/not/exist.gguf"], "exist"),
    (["--file", "/does/not/exist.txt"], "does not exist"),
    (["--dtype", "float8"], "dtype"),
    (["-o", "max_ngram"], "key=value"),
    (["-o", "bogus=1"], "bogus"),
])
def test_bad_input_one_line_exit_2(args, needle):
    base = ["generate", "--model", "stories260k", "hello"]
    r = invoke(*base[:1], *args, *base[1:]) if "--model" not in args else invoke("generate", *args, "hello")
    assert r.exit_code == 2, r.output
    lines = [l for l in r.output.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and needle.lower() in lines[0].lower() and "Traceback" not in r.output


def test_models_lists_catalog():
    r = invoke("models")
    assert r.exit_code == 0 and "smollm2-135m-instruct" in r.stdout and "stories260k" in r.stdout


def test_drafter_aliases_resolve(tmp_path):
    """The names the issues use (recycling, retrieval, pld) build the same drafters."""
    from verispec.api import load_model
    from verispec.registry import make_drafter

    lm = load_model("stories260k")
    assert type(make_drafter("recycling", lm)).__name__ == type(make_drafter("token-recycling", lm)).__name__
    assert type(make_drafter("pld", lm)).__name__ == type(make_drafter("prompt-lookup", lm)).__name__
