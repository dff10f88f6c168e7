"""The tokenizer of a GGUF file, built from its vocabulary and merges with ``tokenizers``, once.

``gguf_tokenizer`` builds a byte-level BPE (``tokenizer.ggml.model = gpt2``: Qwen2, Llama 3,
SmolLM) itself, with llama.cpp's pre-tokenizer regexes, and hands other vocabularies to
transformers' GGUF conversion. The result is cached under the model cache keyed by the tokenizer
metadata's bytes (``GGUFInfo.tokenizer_key``: content, not modification time), so a warm start
reads one ``tokenizer.json`` and never decodes the vocabulary; a cold one reads the tokenizer's
arrays at the offsets the header parse recorded (``gguf_file.with_arrays``), not the header again.

    info = read_gguf(path)                           # gguf_file: the header, parsed once
    tok = load_gguf_tokenizer(info)                  # transformers PreTrainedTokenizerFast, chat template set
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.models.base import ModelError, one_line
from verispec.models.gguf_config import (
    CONTROL_TOKEN,
    EOG_TEXTS,
    TOKENIZER_ARRAYS,
    check_tokenizer_metadata,
    shown,
)
from verispec.models.gguf_file import GGUFInfo, with_arrays
from verispec.models.model_cache import default_cache_dir, discard, sound_entry, write_entry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_USER_DEFINED = 4  # tokenizer.ggml.token_type: user-defined


def gguf_eos_ids(tokens: list[str], types: list[int] | None, eos: int | None) -> list[int]:
    """EOS plus the control tokens llama.cpp also ends generation on (e.g. ``<|im_end|>``, ``<|endoftext|>``)."""
    ids = [int(eos)] if eos is not None else []
    for i, text in enumerate(tokens):
        if text in EOG_TEXTS and (types is None or types[i] == CONTROL_TOKEN) and i not in ids:
            ids.append(i)
    return ids


def _check_items(info: GGUFInfo, key: str, items: object, kind: type[str] | type[int]) -> list:
    """``items`` (the decoded array at ``key``) as a list whose every item is a ``kind``."""
    expected = f"expected an array of {'strings' if kind is str else 'integers'}"
    if not isinstance(items, list):
        raise ModelError(f"{info.path} has {key} = {shown(items)}: {expected}")
    for i, item in enumerate(items):
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ModelError(f"{info.path} has {key}[{i}] = {shown(item)}: {expected}")
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


def gguf_tokenizer(info: GGUFInfo, cache_dir: Path | None = None,
                   max_length: int | None = None) -> tuple[PreTrainedTokenizerBase, list[int]]:
    """(tokenizer, end-of-generation ids) of a GGUF. Built once from the file's vocabulary and
    merges, then read from ``<cache_dir>/tokenizers/gguf-<key>/`` (``cache_dir=None``: not cached).
    ``max_length``: the model's context (its checked config's), the tokenizer's ``model_max_length``.
    Malformed tokenizer metadata is one ModelError naming its key, and nothing is cached for it."""
    check_tokenizer_metadata(info)
    entry = tokenizer_cache_dir(info, cache_dir) if cache_dir is not None else None
    if entry is not None and sound_entry(entry):  # checked against its manifest; a damaged one is discarded
        try:
            facts = _TokenizerFacts.from_json((entry / "verispec.json").read_text(encoding="utf-8"))
            return _wrap(str(entry / "tokenizer.json"), facts, max_length), facts.eos_ids
        except Exception as err:  # noqa: BLE001 - intact files that do not load: replaced below
            discard(entry, one_line(err))
    full = with_arrays(info, TOKENIZER_ARRAYS)  # the vocabulary and merges: read only on a cache miss
    with _tokenizer_errors(info):
        backend, facts = _build_backend(full)
    if entry is not None:
        try:
            _save_entry(entry, backend, facts)
            return _wrap(str(entry / "tokenizer.json"), facts, max_length), facts.eos_ids
        except OSError as err:  # an unwritable cache only costs the next start the build again
            warnings.warn(f"cannot cache the tokenizer in {entry} ({one_line(err)})", RuntimeWarning, stacklevel=2)
    return _wrap_object(backend, facts, max_length), facts.eos_ids


def _save_entry(entry: Path, backend, facts: _TokenizerFacts) -> None:
    """Write the cache entry atomically with its manifest, replacing a damaged one
    (``model_cache.write_entry``); OSError when the cache cannot be written."""
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
            raise ModelError(f"{info.path} has a malformed merge {shown(m)}: expected 'left right'")
        # tokenizers panics (a Rust abort of the whole build) on a merge outside the vocabulary
        missing = next((t for t in (left, right, left + right) if t not in vocab), None)
        if missing is not None:
            raise ModelError(f"{info.path} has tokenizer.ggml.merges[{i}] = {shown(m)}, naming {shown(missing)}, "
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
                   if ty == CONTROL_TOKEN and set(t) <= alphabet]
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
        raise ModelError(f"cannot build a tokenizer from {info.path} ({type(err).__name__}: {one_line(err)}): "
                         "expected a GGUF tokenizer") from None


def _kwargs(facts: _TokenizerFacts, max_length: int | None) -> dict:
    kw = {k: v for k, v in facts.special.items() if v is not None}
    return kw | {"clean_up_tokenization_spaces": False, "chat_template": facts.chat_template,
                 "model_max_length": max_length or int(1e30)}  # transformers' "no limit"


def _wrap(tokenizer_file: str, facts: _TokenizerFacts, max_length: int | None):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **_kwargs(facts, max_length))


def _wrap_object(backend, facts: _TokenizerFacts, max_length: int | None):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, **_kwargs(facts, max_length))


def load_gguf_tokenizer(info: GGUFInfo, cache_dir: Path | None = None,
                        max_length: int | None = None) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer (built once with ``tokenizers``, cached by content under the model cache);
    ``max_length``: the model's context (``ModelSource.config``'s), its ``model_max_length``."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer, _ = gguf_tokenizer(info, root, max_length)
    if "tokenizer.chat_template" in info.meta and not tokenizer.chat_template:
        raise ModelError(f"{info.path}: the GGUF chat template did not reach the tokenizer")
    return tokenizer

