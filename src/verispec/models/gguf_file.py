"""A GGUF file read directly: header, metadata, tensor table, config and tokenizer.

Nothing here converts weights. ``read_gguf`` parses the header, the key/value metadata (large
arrays only when asked for) and the tensor table, and checks every tensor's data range
against the file's size, so a truncated file fails in well under a second, before any
large allocation. ``gguf_hf_config`` turns llama.cpp's metadata into the HF-style config
dict the runtimes read (``llama`` and ``qwen2``). ``gguf_tokenizer`` builds the tokenizer
from the file's vocabulary and merges with the ``tokenizers`` library, once: the result
is cached under the model cache keyed by the tokenizer metadata's bytes (content, not
modification time), so a warm start reads one ``tokenizer.json``.

    info = read_gguf(path)                  # GGUFInfo: metadata, tensors, data offset
    cfg = gguf_hf_config(info)              # {"model_type": "qwen2", "hidden_size": 1536, ...}
    tok = gguf_tokenizer(info, cache_dir)   # transformers PreTrainedTokenizerFast, chat template set
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from verispec.models.base import ModelError
from verispec.models.formats import WeightFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
EXPECTED = "a GGUF v2/v3 file (magic 'GGUF')"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"})
_TOKENIZER_VERSION = 1  # bump when the tokenizer built from a GGUF changes (invalidates the cache)


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

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture"))


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def read_gguf(path: Path, arrays: frozenset[str] = frozenset(), tensors: bool = True) -> GGUFInfo:
    """Metadata (arrays named in ``arrays`` decoded, others given as their length) and, with
    ``tensors``, the tensor table with each tensor's data range checked against the file size."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelError(f"{path} is {size} bytes, too short for a GGUF header: expected {EXPECTED}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, size, arrays, tensors)
    except ModelError:
        raise
    except OSError as err:
        raise ModelError(f"cannot read {path} ({_one_line(err)}): expected {EXPECTED}") from None
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, IndexError, RecursionError) as err:
        raise ModelError(f"{path} is truncated or corrupt ({_one_line(err)}): expected {EXPECTED}") from None


def _parse(path: Path, buf: mmap.mmap, size: int, arrays: frozenset[str], want_tensors: bool) -> GGUFInfo:
    if buf[:4] != b"GGUF":
        raise ModelError(f"{path} has no GGUF magic: expected {EXPECTED}")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ModelError(f"{path} is GGUF version {version}: expected {EXPECTED}")
    meta: dict[str, object] = {}
    array_keys: set[str] = set()
    tok_hash = hashlib.sha256(f"verispec-gguf-tokenizer-v{_TOKENIZER_VERSION}".encode())
    offset = 24
    for _ in range(n_kv):
        start = offset
        key, offset = _string(buf, offset)
        (vtype,) = struct.unpack_from("<I", buf, offset)
        meta[key], offset = _value(buf, offset + 4, vtype, decode=key in arrays)
        if vtype == _ARRAY:
            array_keys.add(key)
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
    return GGUFInfo(path, size, meta, tensors, tok_hash.hexdigest(), frozenset(array_keys))


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


# --------------------------------------------------------------------------- config


def _f32(value: object) -> float:
    """Shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


# Texts llama.cpp treats as end-of-generation besides EOS (llama-vocab.cpp, special_eog_ids).
EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")
_CONTROL = 3  # tokenizer.ggml.token_type: control
_USER_DEFINED = 4


def check_architecture(info: GGUFInfo) -> str:
    arch = info.meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"{info.path} has architecture {arch!r}: expected one of "
                         f"{', '.join(map(repr, SUPPORTED_ARCHITECTURES))}")
    return str(arch)


def gguf_hf_config(info: GGUFInfo, eos_ids: list[int] | None = None) -> dict:
    """An HF-style config dict (``LlamaConfig`` / ``Qwen2Config`` fields) from llama.cpp's
    ``<arch>.*`` metadata; ``eos_token_id`` lists every end-of-generation token when
    ``eos_ids`` is given (else the GGUF's EOS). Every size is a positive integer, the head
    counts agree with each other and the hidden size, the norm epsilon and RoPE base are finite
    and positive, and (with the tensor table) every weight has the shape they imply: a file
    that disagrees is one ModelError here, before any weight is read or any runtime sees it."""
    arch = check_architecture(info)
    meta, path = info.meta, info.path
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    if meta.get(key("rope.scaling.type"), "none") not in ("none", None) or "rope_freqs.weight" in info.tensors:
        raise ModelError(f"{path} uses RoPE scaling: expected plain RoPE (scaling is not supported yet)")

    def invalid(what: str) -> ModelError:
        return ModelError(f"{path} has invalid {arch} metadata: {what}")

    def given(name: str, default: object) -> object:
        """The value at ``<arch>.<name>``; ``default`` None: the key is required."""
        if key(name) not in meta and default is None:
            raise ModelError(f"{path} lacks metadata {key(name)!r}: expected a complete {arch} GGUF")
        return meta.get(key(name), default)

    def size(name: str, default: int | None = None, least: int = 1) -> int:
        value = given(name, default)
        # bool, float, string, array (an undecoded one reads as its length): not a size
        if type(value) is not int or key(name) in info.array_keys or not least <= value <= _MAX_SIZE:
            raise invalid(f"{name} = {_shown(value)}: expected an integer from {least} to {_MAX_SIZE:,}")
        return value

    def positive(name: str, default: float | None = None) -> float:
        value = given(name, default)
        with np.errstate(over="ignore"):  # beyond float32's range: inf, refused below
            f32 = _f32(value) if type(value) in (int, float) and key(name) not in info.array_keys else math.nan
        if not (math.isfinite(f32) and f32 > 0):
            raise invalid(f"{name} = {_shown(value)}: expected a finite positive number")
        return f32

    hidden, heads = size("embedding_length"), size("attention.head_count")
    kv_heads = size("attention.head_count_kv", heads)
    if key("attention.key_length") not in meta and hidden % heads:
        raise invalid(f"attention.head_count = {heads} does not divide embedding_length = {hidden}: "
                      "expected heads of a whole number of values")
    head_dim = size("attention.key_length", hidden // heads)
    if heads % kv_heads:
        raise invalid(f"attention.head_count = {heads} is not a multiple of attention.head_count_kv = {kv_heads}: "
                      "expected query heads in whole groups per K/V head")
    if head_dim % 2 or size("attention.value_length", head_dim) != head_dim:
        raise invalid(f"attention.key_length = {head_dim}, value_length = {meta.get(key('attention.value_length'))}: "
                      "expected an even key length equal to the value length")
    if size("rope.dimension_count", head_dim) != head_dim:
        raise ModelError(f"{path} applies RoPE to part of each head: expected full-head RoPE")
    tokens = meta.get("tokenizer.ggml.tokens")
    if key("vocab_size") in meta:
        vocab = size("vocab_size")
    elif isinstance(tokens, (list, int)) and not isinstance(tokens, bool) and tokens:
        vocab = len(tokens) if isinstance(tokens, list) else tokens
    elif "token_embd.weight" in info.tensors:
        vocab = info.tensors["token_embd.weight"].shape[-1]
    else:
        raise ModelError(f"{path} has no vocabulary ({key('vocab_size')}, tokenizer.ggml.tokens): expected a "
                         f"complete {arch} GGUF")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    cfg = {
        "model_type": arch,
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length"),
        "num_hidden_layers": size("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": size("context_length", least=2),  # a prompt token and one generated
        "rms_norm_eps": positive("attention.layer_norm_rms_epsilon"),
        "rope_theta": positive("rope.freq_base", 1000000.0 if arch == "qwen2" else 10000.0),
        "tie_word_embeddings": "output.weight" not in info.tensors,
        "attention_bias": "blk.0.attn_q.bias" in info.tensors,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(eos_ids) if eos_ids else eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    if info.tensors:
        _check_tensors(info, cfg)
    return cfg


_MAX_SIZE = 1 << 24  # the largest count or length a config may give (layers, heads, vocabulary, context)


def _check_tensors(info: GGUFInfo, cfg: dict) -> None:
    """Every tensor a decoder layer needs is there, and every weight has the shape the config
    gives it (GGUF order: the row length first), before any weight is read: a mismatch names
    the tensor and the metadata its expected shape comes from."""
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        names += [f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    missing = [n for n in names if n not in info.tensors]
    if missing:
        raise ModelError(f"{info.path} lacks tensor {missing[0]} ({len(missing)} missing): expected a complete "
                         f"{cfg['model_type']} model")
    arch, meta = cfg["model_type"], info.meta
    per_head = (f"{arch}.attention.key_length" if f"{arch}.attention.key_length" in meta
                else f"{arch}.embedding_length/attention.head_count")
    vocab_from = next((k for k in (f"{arch}.vocab_size", "tokenizer.ggml.tokens") if k in meta), "token_embd.weight")
    # each dimension: (size, the metadata it comes from)
    h = (cfg["hidden_size"], f"{arch}.embedding_length")
    v = (cfg["vocab_size"], vocab_from)
    f = (cfg["intermediate_size"], f"{arch}.feed_forward_length")
    q = (cfg["num_attention_heads"] * cfg["head_dim"], f"{per_head}/head_count")
    kv = (cfg["num_key_value_heads"] * cfg["head_dim"], f"{per_head}/head_count_kv")
    shapes = {"token_embd.weight": (h, v), "output.weight": (h, v), "output_norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,), b + "attn_q.weight": (h, q),
                   b + "attn_k.weight": (h, kv), b + "attn_v.weight": (h, kv), b + "attn_output.weight": (q, h),
                   b + "ffn_gate.weight": (h, f), b + "ffn_up.weight": (h, f), b + "ffn_down.weight": (f, h),
                   b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
    for name, dims in shapes.items():
        t = info.tensors.get(name)
        want = tuple(d for d, _ in dims)
        if t is not None and t.shape != want:
            wrong = [src for (d, src), got in zip(dims, t.shape) if d != got] or [src for _, src in dims]
            raise ModelError(f"{info.path}: tensor {name} has shape {list(t.shape)}, expected {list(want)} from "
                             f"{', '.join(dict.fromkeys(wrong))}")


def gguf_eos_ids(tokens: list[str], types: list[int] | None, eos: int | None) -> list[int]:
    """EOS plus the control tokens llama.cpp also ends generation on (e.g. ``<|im_end|>``, ``<|endoftext|>``)."""
    ids = [int(eos)] if eos is not None else []
    for i, text in enumerate(tokens):
        if text in EOG_TEXTS and (types is None or types[i] == _CONTROL) and i not in ids:
            ids.append(i)
    return ids


# --------------------------------------------------------------------------- tokenizer

SPECIAL_TOKEN_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "padding", "unknown"))
_STRING_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_FLAG_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object, limit: int = 40) -> str:
    """A metadata value in a one-line message: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_tokenizer_metadata(info: GGUFInfo) -> None:
    """The tokenizer's scalar metadata is usable: special-token ids are integers inside the
    vocabulary, flags booleans, the tokenizer model, pre-tokenizer and chat template strings,
    and ``token_type`` has one entry per token. It reads no array (an array not decoded counts
    as its length), so it runs before anything trusts these keys: the config
    (``loading.open_gguf``) and every tokenizer load, a cached one included. A malformed value
    is one ModelError naming its key, never an IndexError further on."""
    meta, path = info.meta, info.path
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else tokens if _is_int(tokens) else None
    for key in SPECIAL_TOKEN_KEYS:
        value = meta.get(key)
        if value is None:
            continue
        if not _is_int(value) or value < 0 or (n_tokens is not None and value >= n_tokens):
            bound = f"[0, {n_tokens})" if n_tokens is not None else "a non-negative integer"
            raise ModelError(f"{path} has {key} = {_shown(value)}: expected a token id in {bound}")
    for key in _STRING_KEYS:
        if key in meta and not isinstance(meta[key], str):
            raise ModelError(f"{path} has {key} = {_shown(meta[key])}: expected a string")
    for key in _FLAG_KEYS:
        if key in meta and not isinstance(meta[key], bool):
            raise ModelError(f"{path} has {key} = {_shown(meta[key])}: expected a boolean")
    types = meta.get("tokenizer.ggml.token_type")
    n_types = len(types) if isinstance(types, list) else types if _is_int(types) else None
    if types is not None and n_types is None:
        raise ModelError(f"{path} has tokenizer.ggml.token_type = {_shown(types)}: expected an array of integers")
    if types is not None and n_tokens is not None and n_types != n_tokens:
        raise ModelError(f"{path} has tokenizer.ggml.token_type of {n_types} entries for {n_tokens} tokens: "
                         "expected one token type per token")


def _check_items(info: GGUFInfo, key: str, items: object, kind: type[str] | type[int]) -> list:
    """``items`` (the decoded array at ``key``) as a list whose every item is a ``kind``."""
    expected = f"expected an array of {'strings' if kind is str else 'integers'}"
    if not isinstance(items, list):
        raise ModelError(f"{info.path} has {key} = {_shown(items)}: {expected}")
    for i, item in enumerate(items):
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ModelError(f"{info.path} has {key}[{i}] = {_shown(item)}: {expected}")
    return items


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) as HF splits
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")  # fmt: skip
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT,
           "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}  # fmt: skip
_GPT2_STYLE = ("default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "", None)


def _pre_tokenizer(pre: object):
    from tokenizers import Regex, pre_tokenizers

    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in ("smollm", "starcoder", "refact"):  # llama.cpp: \p{N} alone first, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_STYLE:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known to verispec; splitting text as GPT-2 does "
                      "(token ids may differ from llama.cpp's)", RuntimeWarning, stacklevel=3)
    return byte_level


@dataclass(frozen=True)
class _TokenizerFacts:
    """What the runtime needs besides tokenizer.json, cached beside it."""

    eos_ids: list[int]
    special: dict[str, str | None]  # bos_token, eos_token, pad_token, unk_token
    chat_template: str | None

    def to_json(self) -> str:
        return json.dumps({"eos_ids": self.eos_ids, "special": self.special, "chat_template": self.chat_template})

    @classmethod
    def from_json(cls, text: str) -> _TokenizerFacts:
        d = json.loads(text)
        return cls(list(d["eos_ids"]), dict(d["special"]), d.get("chat_template"))


def tokenizer_cache_dir(info: GGUFInfo, cache_dir: Path) -> Path:
    return Path(cache_dir) / "tokenizers" / f"gguf-{info.tokenizer_key[:24]}"


def gguf_tokenizer(info: GGUFInfo, cache_dir: Path | None = None) -> tuple[PreTrainedTokenizerBase, list[int]]:
    """(tokenizer, end-of-generation ids) of a GGUF. Built once from the file's vocabulary and
    merges, then read from ``<cache_dir>/tokenizers/gguf-<key>/`` (``cache_dir=None``: not cached).
    Malformed tokenizer metadata is one ModelError naming its key, and nothing is cached for it."""
    check_tokenizer_metadata(info)
    entry = tokenizer_cache_dir(info, cache_dir) if cache_dir is not None else None
    from verispec.models.model_cache import discard, sound_entry

    if entry is not None and sound_entry(entry):  # checked against its manifest; a damaged one is discarded
        try:
            facts = _TokenizerFacts.from_json((entry / "verispec.json").read_text(encoding="utf-8"))
            return _wrap(str(entry / "tokenizer.json"), facts, info), facts.eos_ids
        except Exception as err:  # noqa: BLE001 - intact files that do not load: replaced below
            discard(entry, _one_line(err))
    full = read_gguf(info.path, TOKENIZER_ARRAYS, tensors=False) if not isinstance(
        info.meta.get("tokenizer.ggml.tokens"), list) else info  # fmt: skip
    with _tokenizer_errors(info):
        backend, facts = _build_backend(full)
    if entry is not None:
        try:
            _save_entry(entry, backend, facts)
            return _wrap(str(entry / "tokenizer.json"), facts, info), facts.eos_ids
        except OSError as err:  # an unwritable cache only costs the next start the build again
            warnings.warn(f"cannot cache the tokenizer in {entry} ({_one_line(err)})", RuntimeWarning, stacklevel=2)
    return _wrap_object(backend, facts, info), facts.eos_ids


def _save_entry(entry: Path, backend, facts: _TokenizerFacts) -> None:
    """Write the cache entry atomically with its manifest, replacing a damaged one
    (``model_cache.write_entry``); OSError when the cache cannot be written."""
    from verispec.models.model_cache import write_entry

    def build(tmp: Path) -> None:
        backend.save(str(tmp / "tokenizer.json"))
        (tmp / "verispec.json").write_text(facts.to_json(), encoding="utf-8")

    write_entry(entry, build)


def _build_backend(info: GGUFInfo):
    """A ``tokenizers.Tokenizer`` for the GGUF's ``gpt2`` (byte-level BPE) vocabulary; other
    tokenizer models go through transformers' own GGUF tokenizer conversion."""
    meta = info.meta
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or tokens == []:
        raise ModelError(f"{info.path} has no tokenizer.ggml.tokens: expected a GGUF with its tokenizer")
    tokens = _check_items(info, "tokenizer.ggml.tokens", tokens, str)
    check_tokenizer_metadata(info)  # the special-token ids against the decoded vocabulary
    types = meta.get("tokenizer.ggml.token_type")
    types = None if types is None else _check_items(info, "tokenizer.ggml.token_type", types, int)
    eos_ids = gguf_eos_ids(tokens, types, meta.get("tokenizer.ggml.eos_token_id"))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None else None

    special = {"bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
               "unk_token": token("unknown")}  # fmt: skip
    facts = _TokenizerFacts(eos_ids, special, meta.get("tokenizer.chat_template"))
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        return _byte_level_bpe(info, tokens, types), facts
    return _transformers_backend(info), facts


def _byte_level_bpe(info: GGUFInfo, tokens: list[str], types: list[int] | None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    meta = info.meta
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelError(f"{info.path} has a gpt2 tokenizer without tokenizer.ggml.merges: expected BPE merges")
    merges = _check_items(info, "tokenizer.ggml.merges", merges, str)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # every byte-level token is spelled in GPT-2's byte alphabet; respell any that is not
    strings = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab: dict[str, int] = {}
    for i, s in enumerate(strings):
        vocab.setdefault(s, i)
    pairs = []
    for i, m in enumerate(merges):
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelError(f"{info.path} has a malformed merge {_shown(m)}: expected 'left right'")
        # tokenizers panics (a Rust abort of the whole build) on a merge outside the vocabulary
        missing = next((t for t in (left, right, left + right) if t not in vocab), None)
        if missing is not None:
            raise ModelError(f"{info.path} has tokenizer.ggml.merges[{i}] = {_shown(m)}, naming {_shown(missing)}, "
                             "not in tokenizer.ggml.tokens: expected merges of vocabulary tokens")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    if types is not None:
        # control tokens (<|im_end|>, ...) are special; user-defined ones (<tool_call>) plain added
        # tokens: llama.cpp matches both whole in text. A "control" token spelled outside the byte
        # alphabet is a llama.cpp mislabel (as transformers' GGUF loader also skips it).
        control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                   if ty == _CONTROL and set(t) <= alphabet]
        user = [AddedToken(t, special=False, normalized=False) for t, s, ty in zip(tokens, strings, types)
                if ty == _USER_DEFINED and t == s]
        tok.add_special_tokens(control)
        tok.add_tokens(user)
    return tok


def _transformers_backend(info: GGUFInfo):
    """transformers' GGUF tokenizer conversion (sentencepiece-style ``llama`` vocabularies)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(info.path.parent), gguf_file=info.path.name).backend_tokenizer


@contextmanager
def _tokenizer_errors(info: GGUFInfo) -> Iterator[None]:
    """Whatever building the tokenizer raises past the checks (transformers' GGUF conversion of a
    vocabulary it cannot read, a Rust panic of ``tokenizers``: pyo3 raises those as a
    BaseException) is one ModelError; only an interrupt or an exit passes through."""
    try:
        yield
    except (ModelError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # noqa: BLE001 - see above: every failure of a hostile file is one line
        raise ModelError(f"cannot build a tokenizer from {info.path} ({type(err).__name__}: {_one_line(err)}): "
                         "expected a GGUF tokenizer") from None


def _kwargs(facts: _TokenizerFacts, info: GGUFInfo) -> dict:
    kw = {k: v for k, v in facts.special.items() if v is not None}
    ctx = info.meta.get(f"{info.architecture}.context_length")  # checked by the config; not needed here
    return kw | {"clean_up_tokenization_spaces": False, "chat_template": facts.chat_template,
                 "model_max_length": ctx if _is_int(ctx) and ctx > 0 else int(1e30)}  # fmt: skip


def _wrap(tokenizer_file: str, facts: _TokenizerFacts, info: GGUFInfo):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **_kwargs(facts, info))


def _wrap_object(backend, facts: _TokenizerFacts, info: GGUFInfo):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, **_kwargs(facts, info))
