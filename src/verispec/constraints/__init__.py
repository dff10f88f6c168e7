"""Constrained decoding: outputs that follow a JSON schema, a regex, a grammar or a choice list.

``compile.py`` turns what a request names into a ``Constraint`` (a compiled grammar over the
model's vocabulary); ``matcher.py`` is the grammar engine's adapter (llguidance), one
``Matcher`` per request; ``speculation.py`` applies a matcher to a draft tree: each node's
allowed tokens, drafts the grammar forbids cut, forced tokens drafted for free.
"""

from .compile import KINDS, Constraint, ConstraintKind, compile_constraint, constraint_for, grammar_of
from .matcher import GrammarError, GrammarVocabulary, Matcher

__all__ = ["KINDS", "Constraint", "ConstraintKind", "GrammarError", "GrammarVocabulary", "Matcher",
           "compile_constraint", "constraint_for", "grammar_of"]
