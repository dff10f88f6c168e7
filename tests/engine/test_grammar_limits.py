"""Grammars at the edge of the grammar engine's limits: a grammar whose start state allows no
token (an empty language: a schema that only refers to itself, a ``$ref`` cycle) or whose first
step is past llguidance's limits (thousands of alternatives as rules, ``a{1000000}``) is refused
at compile time in one line; a choice list up to its documented 4,096 strings works; an answer
whose grammar runs into the limits mid-way ends cleanly (finish "grammar": cut short, also where a
mask the engine could not compute left EOS alone), plain and
speculative, greedy and sampled, never with "committed a token its grammar forbids"."""

from __future__ import annotations

import pytest

from verispec.constraints import GrammarError, constraint_for
from verispec.drafters.base import NoDrafter
from verispec.engine import Engine
from verispec.models.load import load_model
from verispec.registry import make_drafter
from verispec.types import SamplingParams

ALTS = " | ".join(f'" w{i}x"' for i in range(3000))
# a first step the engine takes, a later one past its limits (an Earley row of 3,000 items)
MID_WAY = [("grammar", 'start: /[a-z ]{5,20}/ "." alt\nalt: ' + ALTS),
           ("regex", "Once upon a time(a{100000}|b{100000}|c{1000000})"),
           ("grammar", 'start: /[a-z ]{2,9}/ "," /[a-z ]{2,9}/ "." alt\nalt: ' + ALTS)]


@pytest.fixture(scope="module")
def stories():
    return load_model("stories260k")


@pytest.mark.parametrize("kind,spec,needle", [
    ("json_schema", {"$ref": "#"}, "allows no answer"),
    ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "allows no answer"),
    ("json_schema", {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "allows no answer"),
    ("json_schema", {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "limits"),
    ("grammar", "start: " + ALTS, "limits"),
    ("grammar", "start: " + " | ".join(f'"v{i}"' for i in range(5000)), "limits"),
    ("regex", "^a{1000000}$", "limits"),
    ("regex", "[^\\x00-\\U0010FFFF]", "allows no answer"),
    ("grammar", "start: /[a-b&&c]/", "allows no answer"),
    ("grammar", "start: a\na: a", "allows no answer"),
])
def test_a_grammar_that_allows_nothing_is_refused_at_compile_time(stories, kind, spec, needle):
    with pytest.raises(GrammarError) as e:
        constraint_for(stories, kind, spec)
    assert needle in str(e.value) and "\n" not in str(e.value) and "<non-verbose" not in str(e.value)


@pytest.mark.parametrize("n", [2000, 3000, 4096])
def test_a_long_choice_list_works(stories, n):
    options = [f"option number {i}" for i in range(n)]
    c = constraint_for(stories, "choice", options)
    out, req = _generate(stories, NoDrafter(), c, temperature=1.0, seed=n)
    assert req.finished == "eos" and stories.tokenizer.decode(out) in options


def test_choices_that_prefix_each_other_are_all_reachable(stories):
    c = constraint_for(stories, "choice", ["a", "ab", "abc"])
    eos = stories.backend.info.eos_token_ids
    m = c.matcher()
    byte = {m.text([t]): t for t in range(c.vocab_size)}  # one token per letter (a byte-level spelling)
    for text in ("a", "ab", "abc"):
        m = c.matcher()
        assert m.advance([byte[ch.encode()] for ch in text]), text
        assert any(bool(m.allowed()[t]) for t in eos), text


@pytest.mark.parametrize("kind,spec", MID_WAY, ids=["lark", "regex", "lark-later"])
@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_answer_past_the_limits_mid_way_ends_cleanly(stories, kind, spec, drafter, temperature):
    c = constraint_for(stories, kind, spec)
    d = NoDrafter() if drafter == "none" else make_drafter(drafter, stories, {"model": "truncated:2"}
                                                          if drafter == "draft" else {})
    out, req = _generate(stories, d, c, temperature=temperature, seed=7)
    assert req.finished == "grammar"  # the answer is cut short where the engine stopped, and says so


def test_past_the_limits_greedy_speculative_equals_plain(stories):
    c = constraint_for(stories, *MID_WAY[0])
    plain, plain_req = _generate(stories, NoDrafter(), c)
    spec, req = _generate(stories, make_drafter("prompt-lookup", stories, {}), constraint_for(stories, *MID_WAY[0]))
    assert spec == plain and plain_req.finished == req.finished == "grammar"
    assert stories.tokenizer.decode(plain).endswith(".")  # the step past the limits is the answer's end


def test_a_step_past_the_limits_leaves_the_matcher_where_it_was(stories):
    c = constraint_for(stories, *MID_WAY[0])
    m = c.matcher()
    prefix = stories.tokenizer("there was", add_special_tokens=False)["input_ids"]
    assert m.advance(prefix)
    before = m.allowed()
    dot = stories.tokenizer(".", add_special_tokens=False)["input_ids"][-1:]
    assert bool(before[dot[0]]) and not m.advance(dot)  # allowed, but past the limits
    assert not m.failed and bool((m.allowed() == before).all())
    m.rollback(len(prefix))
    assert bool((m.allowed() == c.matcher().allowed()).all())


def _generate(model, drafter, constraint, temperature=0.0, seed=0, max_new_tokens=40):
    engine = Engine(model.backend, drafter, 6)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, constraint=constraint)
    req = engine.add_request(model.tokenizer("Once upon a time")["input_ids"], params)
    while not req.finished:
        engine.step(req)
    return req.generated, req
