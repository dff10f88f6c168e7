"""A GGUF's vocabulary identity read from its header alone, with bounded reads: what draft discovery
(``models/discovery.py``) compares between the target and every GGUF it finds.

Two files share a vocabulary when their ``tokenizer.ggml.model``, ``tokenizer.ggml.tokens`` and
``tokenizer.ggml.merges`` (when present) are byte for byte equal: the same token ids mean the same
texts, so a draft's proposals are the target's tokens (its names, chat template and pre-tokenizer
may differ: they do not change what an id means). ``VocabHeader.vocab_key`` is the SHA-256 of those
three values' bytes as the file stores them, hashed where they lie (nothing decoded).

Every file here is hostile input: it is opened only if it is a regular file (``O_NONBLOCK``, then
``fstat``: a FIFO or device named ``*.gguf`` never blocks), memory-mapped read-only, and its key/value
section is parsed within its first ``max_bytes`` (``MAX_HEADER_BYTES``): a key, a string value, an
array running past that bound, more than ``MAX_KEYS`` keys or arrays nested deeper than one level
are a ``VocabError`` (a ``ModelError``) of one line. Only the few scalar strings named in ``_WANTED`` are copied
(at most ``MAX_STRING`` bytes each); the tensor table and the weights are never read.

    head = read_vocab_header(path)     # VocabHeader(architecture="qwen2", vocab_key="9f3c...", n_tokens=151665, ...)
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from verispec.models.base import ModelError, one_line

MAX_HEADER_BYTES = 64 << 20  # a GGUF's key/value section read at most (Gemma 3's 262,144 tokens + scores: ~6 MiB)
MAX_KEYS = 1 << 16  # key/value pairs at most (llama.cpp's files have ~30-50)
MAX_KEY = 1 << 10  # bytes of a key
MAX_STRING = 1 << 12  # bytes of a wanted string value (an architecture, a name)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # gguf scalar types
_STRING, _ARRAY = 8, 9
_VOCAB = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_WANTED = ("general.architecture", "general.name", "tokenizer.ggml.model")


class VocabError(ModelError):
    """A file that is not a readable GGUF header; ``reason`` says why without naming the file."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class VocabHeader:
    """What discovery needs of a GGUF: its vocabulary's identity and what names it."""

    path: Path
    size: int  # bytes of the file: the weights a decode step reads, roughly
    architecture: str
    name: str  # general.name, "" when absent
    vocab_key: str  # sha256 hex of the model, tokens and merges values' bytes; "" when it has no vocabulary
    n_tokens: int


def is_gguf(path: Path) -> bool:
    """Whether a regular file starts with GGUF's magic (4 bytes read; False for anything unreadable)."""
    try:
        with _open_regular(path) as f:
            return f.read(4) == b"GGUF"
    except (OSError, ModelError):
        return False


def vocab_key_of(path: Path) -> str | None:
    """The vocabulary key of the GGUF at ``path``, None where it cannot be read (``weights.vocab_ranking``)."""
    try:
        return read_vocab_header(path).vocab_key
    except (ModelError, OSError):
        return None


def read_vocab_header(path: Path, max_bytes: int = MAX_HEADER_BYTES) -> VocabHeader:
    """The vocabulary header of the GGUF at ``path``; a file that is not one, or whose key/value section
    does not end within ``max_bytes``, is one ModelError."""
    path = Path(path)
    try:
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise VocabError(path, f"{size} bytes, too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, size, min(size, max_bytes))
    except VocabError:
        raise
    except ModelError as err:
        raise VocabError(path, one_line(err)) from None
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as err:
        raise VocabError(path, f"cannot be read as a GGUF ({one_line(err)})") from None


class _open_regular:
    """A file opened for reading only if it is a regular file (checked on the open descriptor)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise VocabError(self.path, "not a regular file")
        self.file = os.fdopen(fd, "rb")
        return self.file

    def __exit__(self, *exc):
        self.file.close()


class _Cursor:
    """Reads forward through ``buf`` and refuses to pass ``end``."""

    def __init__(self, path: Path, buf: mmap.mmap, end: int):
        self.path, self.buf, self.end, self.pos = path, buf, end, 0

    def skip(self, n: int) -> int:
        start = self.pos
        if n < 0 or self.pos + n > self.end:
            raise VocabError(self.path, f"its GGUF metadata runs past its first {self.end:,} bytes "
                             "(truncated, corrupt or too large to be a model's header)")
        self.pos += n
        return start

    def unpack(self, fmt: str) -> tuple:
        start = self.skip(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)

    def string(self, limit: int | None) -> str | None:
        """A GGUF string: its text when ``limit`` allows its length, else None (skipped)."""
        (n,) = self.unpack("<Q")
        start = self.skip(n)
        if limit is None:
            return None
        if n > limit:
            raise VocabError(self.path, f"a metadata string of {n:,} bytes (at most {limit:,} expected there)")
        return self.buf[start:start + n].decode("utf-8")


def _parse(path: Path, buf: mmap.mmap, size: int, end: int) -> VocabHeader:
    cur = _Cursor(path, buf, end)
    magic = bytes(buf[:4])
    if magic != b"GGUF":
        raise VocabError(path, "no GGUF magic")
    cur.skip(4)
    version, n_tensors, n_kv = cur.unpack("<IQQ")
    if version not in (2, 3):
        raise VocabError(path, f"GGUF version {version}, expected 2 or 3")
    if n_kv > MAX_KEYS:
        raise VocabError(path, f"{n_kv:,} metadata keys declared (at most {MAX_KEYS:,} read)")
    found: dict[str, str] = {}
    spans: dict[str, tuple[int, int]] = {}
    n_tokens = 0
    for _ in range(n_kv):
        key = cur.string(MAX_KEY)
        (vtype,) = cur.unpack("<I")
        start = cur.pos
        if vtype == _STRING:
            value = cur.string(MAX_STRING if key in _WANTED else None)
            if value is not None:
                found[key] = value
        elif vtype == _ARRAY:
            count = _skip_array(cur, depth=0)
            if key == "tokenizer.ggml.tokens":
                n_tokens = count
        elif vtype in _SIZES:
            cur.skip(_SIZES[vtype])
        else:
            raise VocabError(path, f"metadata key {key!r} has unknown value type {vtype}")
        if key in _VOCAB:
            spans[key] = (start, cur.pos)
    key = ""
    if "tokenizer.ggml.tokens" in spans:
        digest = hashlib.sha256(b"verispec-vocab-v1")
        for name in _VOCAB:
            a, b = spans.get(name, (0, 0))
            digest.update(struct.pack("<Q", b - a))
            with memoryview(buf) as view:
                digest.update(view[a:b])
        key = digest.hexdigest()
    return VocabHeader(path, size, found.get("general.architecture", ""), found.get("general.name", ""), key, n_tokens)


def _skip_array(cur: _Cursor, depth: int) -> int:
    """Skips one array (its item type and count first); returns its count."""
    item_type, count = cur.unpack("<IQ")
    if item_type in _SIZES:
        cur.skip(count * _SIZES[item_type])
    elif item_type == _STRING:
        if count > (cur.end - cur.pos) // 8:
            cur.skip(count * 8)  # fails: more strings than bytes left for their lengths
        lengths = struct.Struct("<Q")
        for _ in range(count):
            (n,) = lengths.unpack_from(cur.buf, cur.skip(8))
            cur.skip(n)
    elif item_type == _ARRAY and depth == 0:
        for _ in range(min(count, cur.end)):
            _skip_array(cur, depth + 1)
    else:
        raise VocabError(cur.path, f"a metadata array of item type {item_type} (nested too deep or unknown)")
    return count
