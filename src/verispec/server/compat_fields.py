"""The constraint fields other OpenAI-compatible servers take, mapped onto verispec's structured
outputs (``structured.ConstraintRequest``) or refused: a client coming from one of them gets
its constraint or a 400 naming the field, never unconstrained text.

Honoured (the field named in a 400 is the one sent):

- llama.cpp: ``grammar`` (GBNF text; Lark too), ``json_schema`` (a schema), and in
  ``response_format`` ``{"type": "json_object", "schema": {...}}`` or ``{"type": "json_schema",
  "schema": {...}}`` (the schema beside the type);
- vLLM: ``guided_json`` (a schema, object or JSON text), ``guided_choice`` (strings),
  ``guided_regex``, ``guided_grammar``, and ``structured_outputs`` with one of ``json``,
  ``choice``, ``regex``, ``grammar`` or ``json_object: true``;
- TGI: ``grammar`` as ``{"type": "json" | "regex" | "grammar", "value": ...}``;
- SGLang: ``regex`` and ``ebnf`` (a grammar).

Refused: ``guided_whitespace_pattern`` and ``structural_tag`` (vLLM), and any other key of
``structured_outputs``: they change what the constraint allows in ways verispec does not
implement. ``guided_decoding_backend`` only names vLLM's grammar engine: ignored.

A schema given as these servers' fields is read as ``response_format``'s non-strict
``json_schema`` is (keywords the engine cannot enforce are ignored). Two constraints in one
request (``response_format`` and ``guided_json``, or two of these fields) are a 400 naming the
second: verispec follows one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .schemas import ApiError
from .structured import ConstraintRequest

# field -> constraint kind it names
SIMPLE = {"json_schema": "json_schema", "guided_json": "json_schema", "guided_choice": "choice",
          "guided_regex": "regex", "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar"}
REFUSED = ("guided_whitespace_pattern", "structural_tag")
STRUCTURED_OUTPUTS = {"json": "json_schema", "choice": "choice", "regex": "regex", "grammar": "grammar"}
TGI_GRAMMAR = {"json": "json_schema", "json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}
# the request fields this module reads (declared on the request schemas, so they are not dropped)
FIELDS = ("grammar", *SIMPLE, "structured_outputs", *REFUSED)


def constraint_request(body: Any, response_format: Callable[[dict[str, Any] | None], ConstraintRequest | None]
                       ) -> ConstraintRequest | None:
    """The one constraint a request names: ``response_format`` (read by ``response_format``, after
    llama.cpp's spellings) or another server's field; None for free text. A 400 naming the field
    for a field refused or malformed, or for a second constraint."""
    found: list[ConstraintRequest] = []
    rf = body.response_format
    req = _llama_cpp_response_format(rf) or response_format(rf)
    if req is not None:
        found.append(req)
    for name in FIELDS:
        if not _sent(body, name):
            continue
        req = _field_request(name, getattr(body, name))
        if req is None:
            continue
        if found:
            raise ApiError(400, f"{name} and {found[0].param} both constrain the answer; send one of them", name)
        found.append(req)
    return found[0] if found else None


def refuse_beside(body: Any, what: str) -> None:
    """A 400 naming the first of these fields ``body`` sets, where ``what`` (a forced tool call)
    already constrains the answer."""
    for name in FIELDS:
        if _sent(body, name):
            raise ApiError(400, f"{name} and {what} both constrain the answer; send one of them", name)


def _sent(body: Any, name: str) -> bool:
    """Does ``body`` set the field ``name``? (llama.cpp's clients send ``"grammar": ""`` for none.)"""
    value = getattr(body, name, None)
    return value is not None and not (name == "grammar" and value == "")


def _field_request(name: str, value: Any, param: str | None = None) -> ConstraintRequest | None:
    """The constraint field ``name`` names (``param``: the field as the client spelled it)."""
    param = param or name
    if name in REFUSED:
        raise ApiError(400, f"{param} is not supported; verispec's structured outputs are response_format's "
                       "(json_schema, regex, grammar, choice)", param)
    if name == "grammar" and isinstance(value, dict):  # TGI: {"type": ..., "value": ...}
        kind = TGI_GRAMMAR.get(value.get("type"))  # type: ignore[arg-type]
        if kind is None or "value" not in value:
            raise ApiError(400, 'grammar as an object is {"type": "json" | "regex" | "grammar", "value": ...}', param)
        return ConstraintRequest(kind, value["value"], False, param)
    if name == "structured_outputs":
        return _structured_outputs(value)
    kind = SIMPLE.get(name, "grammar")
    if kind in ("regex", "grammar") and not isinstance(value, str):
        raise ApiError(400, f"{param} is a string", param)
    if kind == "choice" and not isinstance(value, list):
        raise ApiError(400, f"{param} is a list of strings", param)
    if kind == "json_schema" and not isinstance(value, (dict, str)):
        raise ApiError(400, f"{param} is a JSON schema (an object, or its JSON text)", param)
    return ConstraintRequest(kind, value, kind != "json_schema", param)


def _structured_outputs(value: Any) -> ConstraintRequest | None:
    """vLLM's ``structured_outputs``: one of json / choice / regex / grammar, or json_object: true."""
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} is an object with one of json, choice, regex, grammar", name)
    unknown = [k for k in value if k not in (*STRUCTURED_OUTPUTS, "json_object") and value[k] not in (None, False)]
    if unknown:
        raise ApiError(400, f"{name}.{unknown[0]} is not supported; use one of json, choice, regex, grammar",
                       f"{name}.{unknown[0]}")
    kinds = [k for k in STRUCTURED_OUTPUTS if value.get(k) is not None]
    if value.get("json_object") not in (None, False, True):
        raise ApiError(400, f"{name}.json_object is a boolean", f"{name}.json_object")
    if value.get("json_object"):
        kinds.append("json_object")
    if len(kinds) > 1:
        raise ApiError(400, f"{name} names {' and '.join(kinds)}; send one of them", name)
    if not kinds:
        return None
    key = kinds[0]
    if key == "json_object":
        return ConstraintRequest("json_object", None, True, name)
    return _field_request(f"guided_{key}", value[key], f"{name}.{key}")  # as vLLM's older spelling


def _llama_cpp_response_format(rf: dict[str, Any] | None) -> ConstraintRequest | None:
    """llama.cpp's ``response_format``: a ``schema`` beside ``type`` json_object or json_schema."""
    if not isinstance(rf, dict) or "schema" not in rf or rf.get("type") not in ("json_object", "json_schema"):
        return None
    if rf.get("type") == "json_schema" and "json_schema" in rf:
        raise ApiError(400, "response_format has both schema and json_schema; send one", "response_format")
    schema = rf["schema"]
    if not isinstance(schema, (dict, str)):
        raise ApiError(400, "response_format's schema is a JSON schema (an object)", "response_format")
    return ConstraintRequest("json_schema", schema, rf.get("strict") is True, "response_format")
