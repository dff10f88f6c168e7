"""Constraints as the OpenAI API and verispec's extensions name them, compiled against a model's
vocabulary: ``json_object`` (any JSON object), ``json_schema`` (a JSON Schema; ``strict``
refuses keywords the engine cannot enforce, non-strict ignores them), ``regex``, ``grammar``
(Lark or llama.cpp's GBNF) and ``choice`` (one of a list of strings).

JSON is written compactly but readably: ``", "`` between items, ``": "`` after keys, no other
whitespace (as Python's ``json.dumps``), so the schema's keys and punctuation are forced
tokens and the model cannot pad an answer with endless newlines.

A ``Constraint`` is immutable and shared by every sample of a request; each request's engine
state is its own ``Constraint.matcher()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from .matcher import MAX_GRAMMAR_BYTES, GrammarError, GrammarVocabulary, Matcher

ConstraintKind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]
KINDS: tuple[ConstraintKind, ...] = ("json_object", "json_schema", "regex", "grammar", "choice")
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_CHOICES = 4096


@dataclass(frozen=True)
class Constraint:
    """A compiled constraint: ``kind``, the grammar it became, and a matcher template in the
    start state (compiled once; ``matcher`` forks it per request)."""

    kind: ConstraintKind
    grammar: str = field(repr=False)
    vocab: GrammarVocabulary = field(repr=False, compare=False)
    template: Matcher = field(repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def matcher(self) -> Matcher:
        return self.template.fork()


def grammar_of(kind: ConstraintKind, spec: Any, strict: bool = True) -> str:
    """The llguidance grammar of a constraint. ``spec``: None (json_object), a schema (dict or
    JSON text), a regex, a Lark or GBNF grammar, or a list of strings (choice)."""
    import llguidance

    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        schema = _schema(spec)
        options = JSON_OPTIONS | ({} if strict else {"lenient": True})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {_first_line(e)}") from None
    if kind == "regex":
        _check_text(spec, "regex")
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "grammar":
        _check_text(spec, "grammar")
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(spec)
        except Exception as e:  # the GBNF converter raises whatever its parser meets
            raise GrammarError(f"invalid grammar: {_first_line(e)}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if kind == "choice":
        if (not isinstance(spec, list) or not spec or len(spec) > MAX_CHOICES
                or not all(isinstance(s, str) and s for s in spec)):
            raise GrammarError(f"a choice is a list of 1 to {MAX_CHOICES} non-empty strings")
        _check_text(json.dumps(spec), "choice list")
        # one lexeme (a terminal, matched by the lexer's automaton), not a rule of alternatives:
        # the parser's Earley rows would hold one item per string, past its limit at 2,000
        return llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(s) for s in spec))
    raise GrammarError(f"unknown constraint kind {kind!r}; use one of {', '.join(KINDS)}")


def compile_constraint(kind: ConstraintKind, spec: Any, vocab: GrammarVocabulary, strict: bool = True) -> Constraint:
    """Compile a constraint for ``vocab``; GrammarError (one line, the engine's message) if it
    does not compile, is too large, or asks more work than the parser's limits allow."""
    grammar = grammar_of(kind, spec, strict)
    return Constraint(kind, grammar, vocab, Matcher.compile(grammar, vocab))


def constraint_for(model: Any, kind: ConstraintKind, spec: Any, strict: bool = True) -> Constraint:
    """``compile_constraint`` against a loaded model's tokenizer and target vocabulary."""
    info = model.backend.info
    return compile_constraint(kind, spec, GrammarVocabulary.of(model.tokenizer, info.vocab_size, info.eos_token_ids),
                              strict)


def _schema(spec: Any) -> dict:
    if isinstance(spec, str):
        _check_text(spec, "JSON schema")
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(spec, (dict, bool)):
        raise GrammarError("a JSON schema is a JSON object")
    if isinstance(spec, dict):
        _check_text(json.dumps(spec), "JSON schema")
    return spec


def _check_text(text: Any, what: str) -> None:
    if not isinstance(text, str) or not text:
        raise GrammarError(f"the {what} must be a non-empty string")
    if len(text) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the {what} is {len(text)} characters; at most {MAX_GRAMMAR_BYTES} are accepted")


def _first_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]
