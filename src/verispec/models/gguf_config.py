"""What a GGUF file says about its model, checked: the HF-style config the runtimes read, the
tensors a decoder needs at the shapes that config implies, and the tokenizer's scalar metadata.

``open_gguf`` is every check a load makes before reading a weight, on the ``GGUFInfo`` of the one
header parse (``gguf_file.py``); a file that disagrees with itself is one ModelError naming the key
or tensor. ``LAYER_TENSORS`` spells llama.cpp's tensor names once, for every reader of them (the
compiled runtime's ``cpu_weights.gguf_weights``, the dequantizing ``gguf_tensors``).

    info, cfg = open_gguf(source.gguf)      # {"model_type": "qwen2", "hidden_size": 1536, ...}
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from verispec.models.base import ModelError
from verispec.models.gguf_file import GGUFInfo, read_gguf, token_texts, with_arrays

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"})


def _f32(value: object) -> float:
    """Shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


# Texts llama.cpp treats as end-of-generation besides EOS (llama-vocab.cpp, special_eog_ids).
EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type: control


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
            raise invalid(f"{name} = {shown(value)}: expected an integer from {least} to {_MAX_SIZE:,}")
        return value

    def positive(name: str, default: float | None = None) -> float:
        value = given(name, default)
        with np.errstate(over="ignore"):  # beyond float32's range: inf, refused below
            f32 = _f32(value) if type(value) in (int, float) and key(name) not in info.array_keys else math.nan
        if not (math.isfinite(f32) and f32 > 0):
            raise invalid(f"{name} = {shown(value)}: expected a finite positive number")
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


# llama.cpp's names of a decoder layer's tensors (``blk.{i}.<name>.weight``, Qwen2's Q/K/V also
# ``.bias``) -> HF Llama/Qwen2's (``model.layers.{i}.<name>``): the one spelling of GGUF tensor names
# (the config's checks here, the compiled runtime's reader, the dequantizing reader, the converter)
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}  # fmt: skip


def layer_tensor(layer: int, name: str, kind: str = "weight") -> str:
    """GGUF name of layer ``layer``'s tensor ``name`` (a key of LAYER_TENSORS): ``blk.3.attn_q.weight``."""
    return f"blk.{layer}.{name}.{kind}"


def _check_tensors(info: GGUFInfo, cfg: dict) -> None:
    """Every tensor a decoder layer needs is there, and every weight has the shape the config
    gives it (GGUF order: the row length first), before any weight is read: a mismatch names
    the tensor and the metadata its expected shape comes from."""
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        names += [layer_tensor(i, n) for n in LAYER_TENSORS]
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
    layer_shapes = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (h, q), "attn_k": (h, kv), "attn_v": (h, kv),
                    "attn_output": (q, h), "ffn_gate": (h, f), "ffn_up": (h, f), "ffn_down": (f, h)}
    bias_shapes = {"attn_q": (q,), "attn_k": (kv,), "attn_v": (kv,)}
    shapes = {"token_embd.weight": (h, v), "output.weight": (h, v), "output_norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        shapes |= {layer_tensor(i, n): dims for n, dims in layer_shapes.items()}
        shapes |= {layer_tensor(i, n, "bias"): dims for n, dims in bias_shapes.items()}
    for name, dims in shapes.items():
        t = info.tensors.get(name)
        want = tuple(d for d, _ in dims)
        if t is not None and t.shape != want:
            wrong = [src for (d, src), got in zip(dims, t.shape) if d != got] or [src for _, src in dims]
            raise ModelError(f"{info.path}: tensor {name} has shape {list(t.shape)}, expected {list(want)} from "
                             f"{', '.join(dict.fromkeys(wrong))}")


# --------------------------------------------------------------------------- tokenizer

SPECIAL_TOKEN_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "padding", "unknown"))
_STRING_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_FLAG_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: object, limit: int = 40) -> str:
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
    n_tokens = len(tokens) if isinstance(tokens, list) else tokens if is_int(tokens) else None
    for key in SPECIAL_TOKEN_KEYS:
        value = meta.get(key)
        if value is None:
            continue
        if not is_int(value) or value < 0 or (n_tokens is not None and value >= n_tokens):
            bound = f"[0, {n_tokens})" if n_tokens is not None else "a non-negative integer"
            raise ModelError(f"{path} has {key} = {shown(value)}: expected a token id in {bound}")
    for key in _STRING_KEYS:
        if key in meta and not isinstance(meta[key], str):
            raise ModelError(f"{path} has {key} = {shown(meta[key])}: expected a string")
    for key in _FLAG_KEYS:
        if key in meta and not isinstance(meta[key], bool):
            raise ModelError(f"{path} has {key} = {shown(meta[key])}: expected a boolean")
    types = meta.get("tokenizer.ggml.token_type")
    n_types = len(types) if isinstance(types, list) else types if is_int(types) else None
    if types is not None and n_types is None:
        raise ModelError(f"{path} has tokenizer.ggml.token_type = {shown(types)}: expected an array of integers")
    if types is not None and n_tokens is not None and n_types != n_tokens:
        raise ModelError(f"{path} has tokenizer.ggml.token_type of {n_types} entries for {n_tokens} tokens: "
                         "expected one token type per token")


# --------------------------------------------------------------------------- opening a model file

TOKEN_TYPES = "tokenizer.ggml.token_type"
OPEN_ARRAYS = frozenset({TOKEN_TYPES})  # the arrays the one parse of a model file decodes (open_gguf reads them)


def open_gguf(info_or_path: GGUFInfo | Path | str) -> tuple[GGUFInfo, dict]:
    """(the file's header and tensor table, its HF-style config): every check a load needs
    (architecture, metadata, tensors present, data ranges within the file) and no weights read.
    Given a ``GGUFInfo`` (``ModelSource.gguf``), the header is not parsed again. The config's
    ``eos_token_id`` lists every end-of-generation id (``<|im_end|>``, ``<|endoftext|>``)."""
    info = info_or_path if isinstance(info_or_path, GGUFInfo) else read_gguf(Path(info_or_path), OPEN_ARRAYS)
    check_architecture(info)
    check_tokenizer_metadata(info)  # the special-token ids the config and the EOS list read
    info = with_arrays(info, OPEN_ARRAYS)
    types = info.meta.get(TOKEN_TYPES)
    return info, gguf_hf_config(info, _eog_ids(info, types if isinstance(types, list) else None))


def _eog_ids(info: GGUFInfo, types: list[int] | None) -> list[int]:
    """End-of-generation ids without decoding the whole vocabulary: only control tokens' texts."""
    eos = info.meta.get("tokenizer.ggml.eos_token_id")
    ids = [int(eos)] if eos is not None else []
    control = [i for i, t in enumerate(types or ()) if t == CONTROL_TOKEN]
    if not control:
        return ids
    texts = token_texts(info, set(control))
    for i in control:
        if texts.get(i) in EOG_TEXTS and i not in ids:
            ids.append(i)
    return ids
