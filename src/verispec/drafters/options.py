"""A drafter's options: one frozen dataclass beside each drafter (``PromptLookupOptions`` in
prompt_lookup.py, ...), the one place an option's name, type, default and help are defined,
checked in its ``__post_init__``. The registry builds it from ``-o key=value`` strings by field
type (``from_strings``); ``verispec drafters``, the command line's help and the docs' option
table are generated from it (``describe``), as llama.cpp gathers its speculative options in one
struct (``common_params_speculative``).

    @dataclass(frozen=True)
    class PromptLookupOptions:
        \"\"\"n-gram match over prompt + output.\"\"\"  # the method's one-line description
        max_ngram: int = option(3, "longest n-gram matched")
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

PASSTHROUGH = "passthrough"  # metadata key: a dict field that collects ``<prefix>_<key>`` options


def option(default: Any, help: str, passthrough: str | None = None) -> Any:
    """A field of an options dataclass: its default and one-line help (``passthrough``: a dict
    field collecting every option named ``<passthrough>_<key>``, handed on as ``key``)."""
    meta = {"help": help} | ({PASSTHROUGH: passthrough} if passthrough else {})
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(name: str, value: Any, kind: Any) -> Any:
    """``value`` (a string from the command line, or already typed) as the field type ``kind``."""
    args = get_args(kind)
    if get_origin(kind) is typing.Union or type(kind).__name__ == "UnionType":  # X | None
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        return _convert(name, value, inner[0])
    if get_origin(kind) is Literal:
        if str(value) not in [str(a) for a in args]:
            raise ValueError(f"option {name} must be {'|'.join(map(str, args))}, got {value!r}")
        return next(a for a in args if str(a) == str(value))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() not in ("yes", "no", "true", "false", "1", "0"):
            raise ValueError(f"option {name} must be yes or no, got {value!r}")
        return str(value).lower() in ("yes", "true", "1")
    if kind in (int, float):
        try:
            return kind(value) if kind is float or not isinstance(value, str) else int(value, 10)
        except (TypeError, ValueError):
            raise ValueError(f"option {name} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}") from None
    return str(value)


def from_strings(cls: type, given: Mapping[str, Any], method: str) -> Any:
    """An instance of the options dataclass ``cls`` from ``key=value`` options (strings or typed
    values); an unknown key is a ValueError naming the method's options."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints, values = _hints(cls), {}
    passthrough = {f.metadata[PASSTHROUGH]: f.name for f in fields.values() if PASSTHROUGH in f.metadata}
    for key, value in given.items():
        prefix = next((p for p in passthrough if key.startswith(p + "_")), None)
        if prefix is not None:
            values.setdefault(passthrough[prefix], {})[key[len(prefix) + 1:]] = value
        elif key not in fields or PASSTHROUGH in fields[key].metadata:
            names = ", ".join(n if PASSTHROUGH not in f.metadata else f"{f.metadata[PASSTHROUGH]}_<option>"
                              for n, f in fields.items()) or "none"
            raise ValueError(f"drafter {method} has no option {key!r}; its options: {names}")
        else:
            values[key] = _convert(key, value, hints[key])
    return cls(**values)


def type_text(kind: Any) -> str:
    """A field type as the docs and ``verispec drafters`` show it: ``int``, ``a|b|c``, ``str``."""
    if get_origin(kind) is Literal:
        return "|".join(map(str, get_args(kind)))
    if get_origin(kind) is typing.Union or type(kind).__name__ == "UnionType":
        return type_text(next(a for a in get_args(kind) if a is not type(None)))
    return getattr(kind, "__name__", str(kind))


def describe(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) of every option of ``cls``, in declaration order."""
    hints, rows = _hints(cls), []
    for f in dataclasses.fields(cls):
        if PASSTHROUGH in f.metadata:
            rows.append((f"{f.metadata[PASSTHROUGH]}_<option>", "", "", f.metadata["help"]))
            continue
        rows.append((f.name, type_text(hints[f.name]), "" if f.default is None else str(f.default), f.metadata["help"]))
    return rows


def summary(cls: type) -> str:
    """The method's one-line description: the first line of the options class's docstring."""
    return (cls.__doc__ or "").strip().splitlines()[0]


@dataclass(frozen=True)
class NoOptions:
    """plain autoregressive decoding (the baseline)."""


@dataclass(frozen=True)
class AutoOptions:
    """the best lossless method measured for the target (the default): with a catalog draft model (Qwen2.5-Coder 1.5B: the 0.5B) the hybrid of suffix and the draft, else on the compiled runtime model-free (suffix, else Token Recycling), elsewhere suffix (serve: prompt lookup); options go to that method."""
