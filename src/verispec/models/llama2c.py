"""A llama2.c checkpoint read directly: the 7-int32 header, the float32 weights under HF Llama
names, and its ``tokenizer.bin`` turned into a ``PreTrainedTokenizerFast`` that encodes as
llama2.c's ``run`` does (BOS, a dummy-prefix space, byte fallback).

llama2.c stores Q/K rows for interleaved RoPE; the weights come back in HF's rotate_half order
(``llama.rope_interleaved_to_half``). ``models/converted.py`` writes them as an HF directory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from verispec.models.base import ModelError, one_line
from verispec.models.llama import rope_interleaved_to_half

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Llama2cHeader:
    """The 7 int32 at the start of a llama2.c checkpoint (legacy format)."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool  # llama2.c: a positive vocab_size on disk means wcls == token_embedding

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every float32 tensor in file order (llama2.c ``memory_map_weights``)."""
        L, D, F, V, S = self.n_layers, self.dim, self.hidden_dim, self.vocab_size, self.seq_len
        kv_dim = self.n_kv_heads * self.head_dim
        shapes = [
            ("token_embedding", (V, D)), ("rms_att", (L, D)), ("wq", (L, D, D)), ("wk", (L, kv_dim, D)),
            ("wv", (L, kv_dim, D)), ("wo", (L, D, D)), ("rms_ffn", (L, D)), ("w1", (L, F, D)),
            ("w2", (L, D, F)), ("w3", (L, F, D)), ("rms_final", (D,)),
            ("freq_cis_real", (S, self.head_dim // 2)), ("freq_cis_imag", (S, self.head_dim // 2)),
        ]  # fmt: skip
        return shapes if self.shared_classifier else [*shapes, ("wcls", (V, D))]


_LLAMA2C_HEADER = struct.Struct("<7i")


def read_llama2c_header(path: Path) -> Llama2cHeader:
    """Parse and sanity-check the header; the file size must match the tensors it implies."""
    expected = "a llama2.c checkpoint (7 int32 header + float32 weights)"
    with path.open("rb") as f:
        raw = f.read(_LLAMA2C_HEADER.size)
    if len(raw) < _LLAMA2C_HEADER.size:
        raise ModelError(f"{path} is too short: expected {expected}")
    dim, hidden, layers, heads, kv_heads, vocab, seq = _LLAMA2C_HEADER.unpack(raw)
    sizes_ok = all(0 < v < 1 << 20 for v in (dim, hidden, layers, heads, kv_heads, abs(vocab), seq))
    if not sizes_ok or dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise ModelError(f"{path} has an implausible header {(dim, hidden, layers, heads, kv_heads, vocab, seq)}: "
                         f"expected {expected}")  # fmt: skip
    header = Llama2cHeader(dim, hidden, layers, heads, kv_heads, abs(vocab), seq, shared_classifier=vocab > 0)
    n_floats = sum(int(np.prod(shape)) for _, shape in header.tensor_shapes())
    size = path.stat().st_size
    if size != _LLAMA2C_HEADER.size + 4 * n_floats:
        raise ModelError(f"{path} has {size} bytes, its header implies {_LLAMA2C_HEADER.size + 4 * n_floats}: "
                         f"expected {expected} (truncated or corrupt?)")  # fmt: skip
    return header


def read_llama2c_weights(path: Path, header: Llama2cHeader) -> dict[str, torch.Tensor]:
    """All tensors of a llama2.c checkpoint under HF Llama names, Q/K permuted for rotate_half."""
    flat = torch.from_numpy(np.fromfile(path, dtype="<f4", offset=_LLAMA2C_HEADER.size))  # [n_floats]
    raw: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in header.tensor_shapes():
        n = int(np.prod(shape))
        raw[name] = flat[offset : offset + n].reshape(shape)  # a view; copied once below
        offset += n
    weights = {"model.embed_tokens.weight": raw["token_embedding"], "model.norm.weight": raw["rms_final"]}
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": raw["rms_att"][i],
            p + "self_attn.q_proj.weight": rope_interleaved_to_half(raw["wq"][i], header.n_heads),
            p + "self_attn.k_proj.weight": rope_interleaved_to_half(raw["wk"][i], header.n_kv_heads),
            p + "self_attn.v_proj.weight": raw["wv"][i],
            p + "self_attn.o_proj.weight": raw["wo"][i],
            p + "post_attention_layernorm.weight": raw["rms_ffn"][i],
            p + "mlp.gate_proj.weight": raw["w1"][i],
            p + "mlp.down_proj.weight": raw["w2"][i],
            p + "mlp.up_proj.weight": raw["w3"][i],
        }
    if not header.shared_classifier:
        weights["lm_head.weight"] = raw["wcls"]
    return {k: v.clone() for k, v in weights.items()}  # own storage each: safetensors refuses shared tensors


def read_llama2c_vocab(path: Path, vocab_size: int | None = None) -> list[tuple[bytes, float]]:
    """(piece bytes, score) per token id from a llama2.c ``tokenizer.bin``.

    Format: int32 max_token_length, then per token float32 score, int32 length, bytes.
    """
    expected = "a llama2.c tokenizer (int32 max length, then per token: float32 score, int32 length, bytes)"
    data = path.read_bytes() if path.is_file() else None
    if data is None or len(data) < 4:
        raise ModelError(f"{path} is missing or too short: expected {expected}")
    (max_len,) = struct.unpack_from("<i", data, 0)
    pieces: list[tuple[bytes, float]] = []
    offset = 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ModelError(f"{path} ends inside token {len(pieces)}: expected {expected}")
        score, n = struct.unpack_from("<fi", data, offset)
        if not 0 < n <= max(max_len, 0) or offset + 8 + n > len(data):
            raise ModelError(f"{path}: token {len(pieces)} has length {n} (max {max_len}): expected {expected}")
        pieces.append((data[offset + 8 : offset + 8 + n], score))
        offset += 8 + n
    if vocab_size is not None and len(pieces) != vocab_size:
        raise ModelError(f"{path} has {len(pieces)} tokens, the model expects {vocab_size}: expected its own tokenizer")
    return pieces


def find_llama2c_tokenizer(model: Path, vocab_size: int) -> Path:
    """``tokenizer.bin`` or ``tok*.bin`` beside ``model`` whose token count is ``vocab_size``."""
    candidates = sorted({model.parent / "tokenizer.bin", *model.parent.glob("tok*.bin")} - {model})
    matching = []
    for candidate in candidates:
        if candidate.is_file():
            try:
                read_llama2c_vocab(candidate, vocab_size)
                matching.append(candidate)
            except ModelError:
                continue
    if len(matching) != 1:
        found = f"found {[p.name for p in matching]}" if matching else "found none"
        raise ModelError(f"no unique llama2.c tokenizer for {model} ({found}): expected one tokenizer.bin or "
                         f"tok*.bin with {vocab_size} tokens beside it, or pass tokenizer_path")  # fmt: skip
    return matching[0]


_LLAMA2C_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2; the .bin spells 1 and 2 as "\n<s>\n", "\n</s>\n"


def llama2c_hf_pieces(pieces: list[tuple[bytes, float]]) -> list[str]:
    """Token strings in HF sentencepiece style: spaces as ``▁``, specials renamed, bytes ``<0xXX>``."""
    if len(pieces) < 259 or any(pieces[3 + b][0] != f"<0x{b:02X}>".encode() for b in range(256)):
        raise ModelError("unsupported llama2.c tokenizer: expected byte-fallback pieces <0x00>..<0xFF> at ids 3..258")
    try:
        text = [raw.decode("utf-8").replace(" ", "▁") for raw, _ in pieces[3:]]
    except UnicodeDecodeError as err:
        raise ModelError(f"llama2.c tokenizer has a non-UTF-8 piece ({one_line(err)})") from None
    strings = [*_LLAMA2C_SPECIALS, *text]
    if len(set(strings)) != len(strings):
        raise ModelError("llama2.c tokenizer has duplicate pieces: expected each piece once")
    return strings


def llama2c_merges(strings: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama2.c's greedy ``encode``.

    llama2.c repeatedly merges the adjacent pair whose concatenation is the highest-scoring
    vocab piece (leftmost on ties). A BPE whose merge ranks follow the merged piece's score
    does the same; every split of a piece into two vocab pieces is a merge. Only when two
    different pairs spell the same piece in one text can the tie order differ (rare).
    Example: pieces "▁t"(-0) "he"(-1) "▁the"(-6) give merges ("▁","t"), ("h","e"), ("▁t","he").
    """
    normal = {s: i for i, s in enumerate(strings) if i >= 259}  # not specials, not byte tokens
    ranked = []
    for piece, piece_id in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-scores[piece_id], piece_id, k, left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def build_llama2c_tokenizer(pieces: list[tuple[bytes, float]]) -> PreTrainedTokenizerBase:
    """A ``PreTrainedTokenizerFast`` that encodes like llama2.c (BOS, dummy-prefix space, byte fallback)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    strings = llama2c_hf_pieces(pieces)
    bpe = models.BPE(
        vocab={s: i for i, s in enumerate(strings)},
        merges=llama2c_merges(strings, [score for _, score in pieces]),
        unk_token="<unk>",
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = Tokenizer(bpe)
    # llama2.c encode prepends one dummy " " to non-empty text and merges across spaces (no pre-split).
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )  # llama2.c `run` encodes prompts with bos=1
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _LLAMA2C_SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )
