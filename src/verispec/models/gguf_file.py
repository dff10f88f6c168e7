"""A GGUF file read directly, once: header, key/value metadata and tensor table (``GGUFInfo``).

The file is opened once per load: ``read_gguf`` maps it read-only and the map stays with the
``GGUFInfo`` (``data``); every later read (an array, token texts, tensors, the cache key) is a
view of that one map, never another open.

Nothing here interprets the model (``gguf_config.py`` turns the metadata into a checked config),
converts weights or builds a tokenizer (``gguf_tokenizer.py``). ``read_gguf`` parses the header,
the metadata (large arrays only when asked for; each array's offset is recorded, so ``with_arrays``
and ``token_texts`` read one later without parsing the header again) and the tensor table, and
checks every tensor's data range against the file's size, so a truncated file fails in well under
a second, before any large allocation.

    info = read_gguf(path)                  # GGUFInfo: metadata, tensors, data offsets: the one parse
    info = with_arrays(info, {"tokenizer.ggml.merges"})   # an array read later, at its offset
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from verispec.models.base import ModelError, one_line
from verispec.models.formats import WeightFormat

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
EXPECTED = "a GGUF v2/v3 file (magic 'GGUF')"
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
TOKENIZER_VERSION = 1  # bump when the tokenizer built from a GGUF changes (invalidates the cache)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length (fastest-varying)
    type_id: int  # ggml type (gguf.GGMLQuantizationType value)
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def format(self) -> WeightFormat | None:
        """Its weight format; None for a ggml type verispec does not name (the IQ formats, ...)."""
        return WeightFormat.from_ggml_type(self.type_id)

    @property
    def type_name(self) -> str:
        """ggml's name of its type: Q4_K, F32, IQ2_XS."""
        if self.format is not None:
            return self.format.label
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id).name


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    size: int  # bytes of the file
    meta: dict[str, object]
    tensors: dict[str, GGUFTensor] = field(repr=False)
    tokenizer_key: str = ""  # sha256 of the tokenizer.* key/value bytes (+ the builder version)
    array_keys: frozenset[str] = frozenset()  # keys holding arrays (an undecoded one reads as its length)
    array_offsets: dict[str, int] = field(default_factory=dict, repr=False)  # key -> byte offset of its array
    data: mmap.mmap | None = field(default=None, repr=False, compare=False)  # the file, mapped read-only once

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of the file at ``offset`` as a read-only uint8 array over the map."""
        return np.frombuffer(self.data, dtype=np.uint8, count=nbytes, offset=offset)

    def release(self, offset: int, nbytes: int) -> None:
        """Drop the map's resident pages of a range already read (repacked or dequantized): the
        file stays mapped, its pages are read again from disk if touched."""
        lo = offset // mmap.PAGESIZE * mmap.PAGESIZE
        if self.data is not None and nbytes > 0:
            self.data.madvise(mmap.MADV_DONTNEED, lo, offset + nbytes - lo)


def read_gguf(path: Path, arrays: frozenset[str] = frozenset(), tensors: bool = True) -> GGUFInfo:
    """Metadata (arrays named in ``arrays`` decoded, others given as their length) and, with
    ``tensors``, the tensor table with each tensor's data range checked against the file size."""
    path = Path(path)
    with _reading(path):
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelError(f"{path} is {size} bytes, too short for a GGUF header: expected {EXPECTED}")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _parse(path, buf, size, arrays, tensors)
        except BaseException:
            buf.close()
            raise


def with_arrays(info: GGUFInfo, keys: frozenset[str]) -> GGUFInfo:
    """``info`` with the arrays at ``keys`` decoded, read at the offsets the header parse recorded
    (the header is not parsed again); ``info`` itself when they are decoded already."""
    wanted = {k for k in keys if k in info.array_offsets and not isinstance(info.meta.get(k), list)}
    if not wanted:
        return info
    meta = dict(info.meta)
    with _reading(info.path):
        for key in sorted(wanted):
            meta[key], _ = _value(info.data, info.array_offsets[key], _ARRAY, decode=True)
    return replace(info, meta=meta)


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Any failure to read or decode the file at ``path`` is one ModelError."""
    try:
        yield
    except ModelError:
        raise
    except OSError as err:
        raise ModelError(f"cannot read {path} ({one_line(err)}): expected {EXPECTED}") from None
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, IndexError, RecursionError) as err:
        raise ModelError(f"{path} is truncated or corrupt ({one_line(err)}): expected {EXPECTED}") from None


def _parse(path: Path, buf: mmap.mmap, size: int, arrays: frozenset[str], want_tensors: bool) -> GGUFInfo:
    if buf[:4] != b"GGUF":
        raise ModelError(f"{path} has no GGUF magic: expected {EXPECTED}")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ModelError(f"{path} is GGUF version {version}: expected {EXPECTED}")
    meta: dict[str, object] = {}
    array_offsets: dict[str, int] = {}
    tok_hash = hashlib.sha256(f"verispec-gguf-tokenizer-v{TOKENIZER_VERSION}".encode())
    offset = 24
    for _ in range(n_kv):
        start = offset
        key, offset = _string(buf, offset)
        (vtype,) = struct.unpack_from("<I", buf, offset)
        if vtype == _ARRAY:
            array_offsets[key] = offset + 4
        meta[key], offset = _value(buf, offset + 4, vtype, decode=key in arrays)
        if key.startswith("tokenizer."):
            tok_hash.update(buf[start:offset])
    tensors: dict[str, GGUFTensor] = {}
    if want_tensors:
        infos = []
        for _ in range(n_tensors):
            name, offset = _string(buf, offset)
            (n_dims,) = struct.unpack_from("<I", buf, offset)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ModelError(f"{path}: tensor {name} has {n_dims} dimensions: expected 1 to {_MAX_DIMS}")
            shape = tuple(int(d) for d in struct.unpack_from(f"<{n_dims}Q", buf, offset + 4))
            if min(shape) < 1:
                raise ModelError(f"{path}: tensor {name} has shape {list(shape)}: expected every dimension >= 1")
            type_id, rel = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, shape, type_id, rel))
        align = meta.get("general.alignment", 32)
        if type(align) is not int or align < 1 or align & (align - 1):
            raise ModelError(f"{path} has general.alignment = {align!r}: expected a power of two")
        data_start = -(-offset // align) * align
        for name, shape, type_id, rel in infos:
            if rel % align:
                raise ModelError(f"{path}: tensor {name} starts at data offset {rel}, not a multiple of the "
                                 f"file's alignment {align}: expected a valid GGUF")
            nbytes = _tensor_nbytes(path, name, shape, type_id)
            if nbytes > size:
                raise ModelError(f"{path}: tensor {name} of shape {list(shape)} needs {nbytes:,} bytes, more than the "
                                 f"whole file ({size:,} bytes): expected a valid GGUF")
            end = data_start + rel + nbytes
            if end > size:
                raise ModelError(f"{path} is truncated: tensor {name} ends at byte {end:,} but the file has "
                                 f"{size:,} bytes (expected the complete file; download or reinstall it again)")
            tensors[name] = GGUFTensor(name, shape, type_id, data_start + rel, nbytes)
    return GGUFInfo(path, size, meta, tensors, tok_hash.hexdigest(), frozenset(array_offsets), array_offsets, buf)


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], type_id: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelError(f"{path}: tensor {name} has unknown ggml type {type_id}: expected a type "
                         "the gguf package knows (F32, F16, Q4_0 ... Q8_0, K-quants)") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[0] % block:
        raise ModelError(f"{path}: tensor {name} has rows of {shape[0]} values, not a multiple of "
                         f"{qtype.name}'s block of {block}: expected a valid GGUF")
    return math.prod(shape) // block * type_size  # Python ints: a huge shape cannot wrap and pass the size check


def _string(buf: mmap.mmap, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offset)
    if offset + 8 + n > len(buf):
        raise ValueError(f"string of {n} bytes runs past the end of the file")
    return buf[offset + 8 : offset + 8 + n].decode("utf-8"), offset + 8 + n


def _value(buf: mmap.mmap, offset: int, vtype: int, decode: bool = True) -> tuple[object, int]:
    """One value at ``offset`` -> (value, next offset); an undecoded array yields its length."""
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, offset)
    if vtype != _ARRAY:
        raise ValueError(f"unknown value type {vtype}")
    item_type, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if item_type in _SCALARS:  # fixed-size items: one numpy read, or skip in one step
        end = offset + count * struct.calcsize(_SCALARS[item_type])
        if end > len(buf):
            raise ValueError(f"array of {count} items runs past the end of the file")
        if not decode:
            return count, end
        items = np.frombuffer(buf, dtype=_NUMPY[item_type], count=count, offset=offset).tolist()
        return (items if item_type != 7 else [bool(x) for x in items]), end
    if item_type == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        strings, n_buf = [], len(buf)
        for _ in range(count):
            (n,) = unpack(buf, offset)
            offset += 8
            if offset + n > n_buf:
                raise ValueError(f"string of {n} bytes runs past the end of the file")
            if decode:
                strings.append(buf[offset : offset + n].decode("utf-8"))
            offset += n
        return (strings if decode else count), offset
    items = []
    for _ in range(count):
        item, offset = _value(buf, offset, item_type, decode)
        items.append(item)
    return (items if decode else count), offset


def token_texts(info: GGUFInfo, wanted: set[int]) -> dict[int, str]:
    """Texts of the token ids in ``wanted``: the token array read at its recorded offset,
    decoding only those."""
    not_strings = ModelError(f"{info.path} has a tokenizer.ggml.tokens that is not an array of strings: "
                             "expected the vocabulary's token texts")
    offset = info.array_offsets.get("tokenizer.ggml.tokens")
    if offset is None:
        if "tokenizer.ggml.tokens" in info.meta:
            raise not_strings
        return {}
    with _reading(info.path):
        buf = info.data
        item_type, count = struct.unpack_from("<IQ", buf, offset)
        if item_type != _STRING:
            raise not_strings
        offset += 12
        out = {}
        for i in range(min(count, max(wanted) + 1)):
            (n,) = struct.unpack_from("<Q", buf, offset)
            if i in wanted:
                out[i] = buf[offset + 8 : offset + 8 + n].decode("utf-8")
            offset += 8 + n
        return out
