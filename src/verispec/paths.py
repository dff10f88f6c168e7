"""Checks of user-given paths that commands run *before* their work (a run of minutes or
hours must not end on an unwritable output path) and reads of user text files."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any


def check_output_dir(path: Path, flag: str) -> None:
    """``path`` is, or is now created as, a directory this process can write: checked by
    creating it and a temporary file in it (``os.access`` says yes to root everywhere, even
    under /proc); raises ValueError naming ``flag``."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".verispec-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path} is not writable: {e.strerror or e}") from None


def check_output_file(path: Path, flag: str) -> None:
    """``path`` can be written as a file (an existing file is replaced): its directory is
    checked by writing in it (``check_output_dir``); raises ValueError naming ``flag``."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise ValueError(f"{flag} {path} exists and is not a regular file")
    check_output_dir(path.parent, flag)
    if path.exists():
        try:
            with path.open("ab"):  # opened for writing, nothing changed
                pass
        except OSError as e:
            raise ValueError(f"{flag} {path} is not writable: {e.strerror or e}") from None


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file's contents; a missing, unreadable or non-UTF-8 file raises ValueError."""
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist" if not path.exists() else f"{what} {path} is not a file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    return decode_utf8(data, f"{what} {path}")


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def parse_json_line(line: str, where: str) -> Any:
    """One JSONL line, parsed; ValueError naming ``where`` for malformed JSON, nesting deeper
    than the parser's recursion limit, and strings that are not text (a lone surrogate such
    as ``"\\ud800"`` is valid JSON but cannot be tokenized or written)."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply") from None
    bad = lone_surrogate(value)
    if bad is not None:
        raise ValueError(f"{where}: {bad or 'the value'} is not valid Unicode (a lone UTF-16 surrogate such as \\ud800)")
    return value


def lone_surrogate(value: Any) -> str | None:
    """The dotted path of the first string holding a lone surrogate (valid JSON, e.g.
    ``"\\ud800"``, but not encodable text), or None. ``lone_surrogate({"a": ["x", "\\ud800"]})
    == "a.1"``. Iterative: a deeply nested value cannot exhaust the recursion limit."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not is_text(item):
                return path
            continue
        pairs = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        children = []
        for key, child in pairs:
            name = str(key).encode("utf-8", "backslashreplace").decode()  # printable in the error message
            key_path = f"{path}.{name}" if path else name
            if isinstance(key, str) and not is_text(key):
                return key_path
            children.append((key_path, child))
        stack.extend(reversed(children))  # depth-first, in document order
    return None


def is_text(text: str) -> bool:
    """Can ``text`` be encoded as UTF-8 (no lone surrogates, e.g. from non-UTF-8 argv bytes)?"""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
