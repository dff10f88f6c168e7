"""Checks of user-given paths that commands run *before* their work (a run of minutes or
hours must not end on an unwritable output path) and reads of user text files."""

from __future__ import annotations

import os
from pathlib import Path


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: Path, flag: str) -> None:
    """``path`` is, or can be created as, a writable directory; raises ValueError naming ``flag``."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a directory")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ValueError(f"{flag} {path}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} is not writable ({base} is read-only for this user)")


def check_output_file(path: Path, flag: str) -> None:
    """``path`` can be written as a file (an existing file is replaced); raises ValueError."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")
    check_output_dir(path.parent, flag)


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
