"""Structured outputs and tool calls of the OpenAI chat API, as constraints and parsed answers.

- ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``, and as extensions ``{"type": "regex", "regex": ...}``,
  ``{"type": "grammar", "grammar": <Lark or GBNF>}``, ``{"type": "choice", "choice": [...]}``.
- ``tools``: rendered by the model's chat template; their grammar is ``tool_grammar.py``'s, the
  answer's calls are parsed by ``tool_calls.py`` (each template family's syntax).

What fails to compile is a 400 with the grammar engine's message in one line (``GrammarError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..constraints import Constraint, GrammarError, GrammarVocabulary, compile_constraint
from .schemas import ApiError
from .state import ServerState


@dataclass(frozen=True)
class ConstraintRequest:
    """What a request asks the output to follow, before compiling: kind, spec, strict, and the
    request field named in a 400."""

    kind: str
    spec: Any
    strict: bool
    param: str


def response_format_request(response_format: dict[str, Any] | None) -> ConstraintRequest | None:
    """The constraint ``response_format`` names (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintRequest("json_object", None, True, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                           "response_format")
        return ConstraintRequest("json_schema", spec["schema"], spec.get("strict") is True, "response_format")
    if kind in ("regex", "grammar", "choice"):
        if kind not in response_format:
            raise ApiError(400, f"response_format of type {kind} needs a {kind!r} field", "response_format")
        return ConstraintRequest(kind, response_format[kind], True, "response_format")
    raise ApiError(400, f"unknown response_format type {kind!r}: use text, json_object, json_schema, regex, grammar "
                   "or choice", "response_format")


def compile_request(state: ServerState, req: ConstraintRequest) -> Constraint:
    """Compile against the served model (on the tokenizer thread: a large schema takes a while);
    a 400 naming the field in one line when the engine refuses it."""
    info = state.model.backend.info
    try:
        vocab = GrammarVocabulary.of(state.model.tokenizer, info.vocab_size, info.eos_token_ids)
        return compile_constraint(req.kind, req.spec, vocab, req.strict)  # type: ignore[arg-type]
    except GrammarError as e:
        raise ApiError(400, str(e), req.param, "invalid_grammar") from None
