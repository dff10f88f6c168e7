"""Each drafter's options are one frozen dataclass beside the drafter (issue 48): the one place
an option's name, type, default and help are defined. The registry builds it from ``-o
key=value`` strings by field type and names the fields on an unknown key; ``verispec drafters``
and the docs' option table are generated from it; a drafter's constructor takes its defaults
from it (the hybrid's ``rent_start`` had two)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from serving import runner

import verispec
from verispec.cli import app as cli_app
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.drafters.draft_model import DraftModelDrafter, DraftModelOptions
from verispec.drafters.eagle import EagleDrafter, EagleOptions
from verispec.drafters.hybrid import HybridDrafter, HybridOptions
from verispec.drafters.lookahead import LookaheadDrafter, LookaheadOptions
from verispec.drafters.medusa import MedusaDrafter, MedusaOptions
from verispec.drafters.options import describe, from_strings
from verispec.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupOptions
from verispec.drafters.retrieval import RestOptions, RetrievalDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter, SuffixOptions
from verispec.drafters.token_recycling import TokenRecyclingDrafter, TokenRecyclingOptions
from verispec.registry import DRAFTERS, options_markdown

SRC = Path(verispec.__file__).parent
DOCS = SRC.parents[1] / "docs" / "usage.md"


def test_every_drafter_has_a_frozen_options_dataclass_with_help_on_every_field() -> None:
    for name, (_, options) in DRAFTERS.items():
        assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen, name
        assert options.__doc__ and options.__doc__.strip(), name
        for f in dataclasses.fields(options):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help"


def test_the_registry_defines_no_option() -> None:
    """No option name, default or help in registry.py: no ``opts.pop`` / ``.get`` of option
    strings and no help text; its factories read the options' fields."""
    text = (SRC / "registry.py").read_text(encoding="utf-8")
    assert not re.search(r"opts\.(pop|get)\(", text)
    tree = ast.parse(text)
    drafters = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "DRAFTERS")
    assert not [c.value for c in ast.walk(drafters.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                and " " in c.value]  # names only, no descriptions


def test_strings_become_typed_fields_and_bad_ones_are_one_line() -> None:
    o = from_strings(SuffixOptions, {"max_depth": "48", "min_score": "0.5"}, "suffix")
    assert (o.max_depth, o.min_score, o.max_match) == (48, 0.5, SuffixOptions.max_match)
    assert from_strings(HybridOptions, {"mode": "fuse", "learned_vocab": "full"}, "hybrid") == \
        HybridOptions(mode="fuse", learned_options={"vocab": "full"})
    with pytest.raises(ValueError, match=r"no option 'max_dept'; its options: max_depth, max_match"):
        from_strings(SuffixOptions, {"max_dept": "3"}, "suffix")
    with pytest.raises(ValueError, match="option max_depth must be an integer, got '3.5'"):
        from_strings(SuffixOptions, {"max_depth": "3.5"}, "suffix")
    with pytest.raises(ValueError, match="option mode must be fallback\\|fuse, got 'both'"):
        from_strings(HybridOptions, {"mode": "both"}, "hybrid")
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):  # __post_init__
        from_strings(PromptLookupOptions, {"min_ngram": "4"}, "prompt-lookup")


@pytest.mark.parametrize(("drafter", "options"), [
    (PromptLookupDrafter, PromptLookupOptions), (SuffixDecodingDrafter, SuffixOptions),
    (TokenRecyclingDrafter, TokenRecyclingOptions), (LookaheadDrafter, LookaheadOptions),
    (RetrievalDrafter, RestOptions), (HybridDrafter, HybridOptions), (DraftModelDrafter, DraftModelOptions),
    (EagleDrafter, EagleOptions), (MedusaDrafter, MedusaOptions), (CrossTokenizerDrafter, DraftModelOptions)])
def test_constructors_take_their_defaults_from_the_options(drafter, options) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(options)}
    for name, p in inspect.signature(drafter).parameters.items():
        if name in defaults and p.default is not inspect.Parameter.empty:
            assert p.default == defaults[name], (drafter.__name__, name)
    assert inspect.signature(HybridDrafter).parameters["rent_start"].default == HybridOptions.rent_start == "predicted"


def test_verispec_drafters_lists_every_field() -> None:
    r = runner.invoke(cli_app, ["drafters"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    for name, (_, options) in DRAFTERS.items():
        assert name in r.output
        for key, _, _, _ in describe(options):
            assert key in r.output, (name, key)


def test_the_docs_option_table_is_the_generated_one() -> None:
    text = DOCS.read_text(encoding="utf-8")
    start, end = "<!-- drafter options: generated by registry.options_markdown() -->", "<!-- end drafter options -->"
    assert start in text and end in text
    assert text.split(start)[1].split(end)[0].strip() == options_markdown()
