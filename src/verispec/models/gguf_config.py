"""What a GGUF file says about its model, checked: the HF-style config the runtimes read, the
tensors a decoder needs at the shapes that config implies, and the tokenizer's scalar metadata.

``open_gguf`` is every check a load makes before reading a weight, on the ``GGUFInfo`` of the one
header parse (``gguf_file.py``); a file that disagrees with itself is one ModelError naming the key
or tensor. What each architecture reads (keys, tensors, their shapes) is its declaration in
``architectures.py``: a key or tensor it does not declare is refused here, naming it.
``LAYER_TENSORS`` maps llama / qwen2 tensor names to HF's (the dequantizing ``gguf_tensors``).

    info, cfg = open_gguf(path)      # {"model_type": "qwen2", "hidden_size": 1536, ...}: ModelSource.config
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from verispec.models.architectures import (
    COMMON_KEYS,
    Architecture,
    architecture,
    layer_tensor,
    layer_tensors,
    optional_layer_tensors,
    sliding_layers,
)
from verispec.models.base import ModelError
from verispec.models.formats import WeightFormat
from verispec.models.gguf_file import GGUFInfo, read_gguf, token_texts, with_arrays

TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"})


def _f32(value: object) -> float:
    """Shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


# Texts llama.cpp treats as end-of-generation besides EOS (llama-vocab.cpp, special_eog_ids).
EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type: control


def check_architecture(info: GGUFInfo) -> str:
    """The file's architecture, one of ``architectures.ARCHITECTURES``, with no ``<arch>.*`` key its
    declaration does not read: a hyper-parameter we would ignore is refused, naming the key."""
    arch = architecture(info.meta.get("general.architecture"), info.path)
    known = COMMON_KEYS | arch.keys
    for key in info.meta:
        if key.startswith(arch.name + ".") and key[len(arch.name) + 1:] not in known:
            raise ModelError(f"{info.path} has metadata {key!r}, which verispec does not implement for {arch.name} "
                             "(models/architectures.py lists what each architecture reads)")
    return arch.name


def gguf_hf_config(info: GGUFInfo, eos_ids: list[int] | None = None) -> dict:
    """An HF-style config dict (``LlamaConfig`` / ``Qwen2Config`` fields) from llama.cpp's
    ``<arch>.*`` metadata; ``eos_token_id`` lists every end-of-generation token when
    ``eos_ids`` is given (else the GGUF's EOS). Every size is a positive integer, the head
    counts agree with each other and the hidden size, the real-number values (norm epsilon,
    RoPE base and factor, logit softcap) are finite and in their plausible ranges
    (``PLAUSIBLE``), and (with the tensor table) every weight has the shape they imply: a file
    that disagrees is one ModelError here, before any weight is read or any runtime sees it."""
    decl = architecture(check_architecture(info), info.path)
    arch = decl.name
    meta, path = info.meta, info.path
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    scaling = meta.get(key("rope.scaling.type"), "none")
    if scaling not in ("none", "linear") or (scaling == "linear" and "rope.scaling.factor" not in decl.keys):
        raise ModelError(f"{path} has {key('rope.scaling.type')} = {shown(scaling)}, which verispec does not "
                         f"implement for {arch}: expected none{' or linear' * ('rope.scaling.factor' in decl.keys)}")

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
        low, high = PLAUSIBLE[name]
        if not (math.isfinite(f32) and f32 > 0):
            raise invalid(f"{name} = {shown(value)}: expected a finite positive number from {low:g} to {high:g}")
        if not low <= f32 <= high:
            raise invalid(f"{name} = {shown(value)}: expected a finite positive number from {low:g} to {high:g} "
                          "(a value outside that range makes no working model)")
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
        "model_type": decl.model_type,
        "gguf_architecture": arch,  # read from a GGUF: the compiled runtime runs every declared architecture
        "architectures": [decl.hf_class],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length"),
        "num_hidden_layers": size("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": size("context_length", least=2),  # a prompt token and one generated
        "rms_norm_eps": positive("attention.layer_norm_rms_epsilon"),
        "rope_theta": positive("rope.freq_base", decl.default_rope_base),
        "tie_word_embeddings": "output.weight" not in info.tensors,
        "attention_bias": "blk.0.attn_q.bias" in info.tensors,
        "hidden_act": "gelu_pytorch_tanh" if decl.activation == "gelu_tanh" else "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(eos_ids) if eos_ids else eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if decl.window_switch:
        cfg["use_sliding_window"] = False
    cfg |= _variant_config(info, decl, cfg, size, positive)
    if info.tensors:
        _check_tensors(info, cfg, decl)
    return cfg


def _variant_config(info: GGUFInfo, decl: Architecture, cfg: dict, size: Callable[..., int],
                    positive: Callable[[str], float]) -> dict:
    """The config fields of what ``decl`` declares beyond a plain Llama, read from the file
    (transformers' names where it has one): sliding window and its layers, RoPE scaling and the
    sliding layers' base, the attention scale, logit softcapping, Llama-3 RoPE frequency factors.
    ``size`` and ``positive`` read and check one ``<arch>.*`` value (``gguf_hf_config``'s)."""
    out: dict = {}
    key = lambda name: f"{decl.name}.{name}"  # noqa: E731
    window = size("attention.sliding_window", 0, least=0) if key("attention.sliding_window") in info.meta else 0
    if window:
        out["sliding_window"] = window
        out["layer_types"] = ["sliding_attention" if s else "full_attention"
                              for s in sliding_layers(decl, cfg["num_hidden_layers"], window)]
        if decl.window_switch:
            out["use_sliding_window"] = True
    if info.meta.get(key("rope.scaling.type")) == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": positive("rope.scaling.factor")}
    if decl.local_rope_base is not None:
        out["rope_local_base_freq"] = decl.local_rope_base
    if decl.attention_scalar:  # llama.cpp's f_attention_scale: 1/sqrt(head_dim), the 27B (62 layers) 1/sqrt(dim/heads)
        big = cfg["num_hidden_layers"] == 62
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    if key("final_logit_softcapping") in info.meta:
        out["final_logit_softcapping"] = positive("final_logit_softcapping")
    if "rope_freqs.weight" in info.tensors:
        out["rope_freq_factors"] = _rope_freq_factors(info, decl, cfg["head_dim"])
    return out


def _rope_freq_factors(info: GGUFInfo, decl: Architecture, head_dim: int) -> list[float]:
    """``rope_freqs.weight``: llama.cpp's Llama-3 RoPE scaling, one divisor per frequency
    (F32 [head_dim / 2], each finite and positive); read here, before any weight, as it is the config."""
    t = info.tensors["rope_freqs.weight"]
    if not decl.rope_freqs:
        raise ModelError(f"{info.path} has tensor rope_freqs.weight, which verispec does not implement for {decl.name}")
    if t.format != WeightFormat.F32 or t.shape != (head_dim // 2,):
        raise ModelError(f"{info.path}: tensor rope_freqs.weight is {t.type_name} {list(t.shape)}: expected F32 "
                         f"[{head_dim // 2}] (head_dim / 2)")
    factors = info.view(t.offset, t.nbytes).view(np.float32)
    if len(factors) != head_dim // 2 or not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ModelError(f"{info.path}: tensor rope_freqs.weight: expected {head_dim // 2} finite positive factors")
    return [float(x) for x in factors]


_MAX_SIZE = 1 << 24  # the largest count or length a config may give (layers, heads, vocabulary, context)
# <arch>.<key> real-number metadata -> the plausible range of its value: released models sit well inside
# (epsilon 1e-6 to 1e-5, RoPE base 1e4 to 1e7, linear RoPE factors 2 to 32, Gemma's final softcap 30); out
# of range, the model computes nothing useful (a softcap of 1e-45 makes every logit equal: token 0 forever)
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "attention.layer_norm_rms_epsilon": (1e-12, 0.1),
    "rope.freq_base": (100.0, 1e10),
    "rope.scaling.factor": (1 / 64, 1024.0),
    "final_logit_softcapping": (1.0, 1e4),
}


# llama.cpp's names of a llama / qwen2 layer's tensors (``blk.{i}.<name>.weight``, Qwen2's Q/K/V
# also ``.bias``) -> HF Llama/Qwen2's (``model.layers.{i}.<name>``): what the dequantizing reader and
# the converter read (other architectures' tensors: ``architectures.layer_tensors``)
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


def _check_tensors(info: GGUFInfo, cfg: dict, decl: Architecture) -> None:
    """Every tensor a decoder layer of ``decl`` needs is there, no tensor is one it does not
    declare, and every weight has the shape the config gives it (GGUF order: the row length
    first), before any weight is read: a mismatch names the tensor and the metadata its
    expected shape comes from."""
    required, optional = layer_tensors(decl), optional_layer_tensors(decl)
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        names += [layer_tensor(i, n) for n in required]
    missing = [n for n in names if n not in info.tensors]
    if missing:
        raise ModelError(f"{info.path} lacks tensor {missing[0]} ({len(missing)} missing): expected a complete "
                         f"{decl.name} model")
    arch, meta = decl.name, info.meta
    per_head = (f"{arch}.attention.key_length" if f"{arch}.attention.key_length" in meta
                else f"{arch}.embedding_length/attention.head_count")
    vocab_from = next((k for k in (f"{arch}.vocab_size", "tokenizer.ggml.tokens") if k in meta), "token_embd.weight")
    f = cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    # each dimension: (size, the metadata it comes from)
    dims = {"h": (cfg["hidden_size"], f"{arch}.embedding_length"), "v": (cfg["vocab_size"], vocab_from),
            "f": (f, f"{arch}.feed_forward_length"), "2f": (2 * f, f"{arch}.feed_forward_length"),
            "q": (q, f"{per_head}/head_count"), "kv": (kv, f"{per_head}/head_count_kv"),
            "qkv": (q + 2 * kv, f"{per_head}/head_count/head_count_kv"), "d": (cfg["head_dim"], per_head)}
    shapes = {"token_embd.weight": ("h", "v"), "output.weight": ("h", "v"), "output_norm.weight": ("h",)}
    for i in range(cfg["num_hidden_layers"]):
        shapes |= {layer_tensor(i, n): d for n, d in required.items()}
        shapes |= {f"blk.{i}.{n}": d for n, d in optional.items()}
    for name, t in info.tensors.items():
        if name not in shapes and name != "rope_freqs.weight":  # rope_freqs: checked with the config
            raise ModelError(f"{info.path} has tensor {name}, which verispec does not implement for {arch}")
        want = tuple(dims[d][0] for d in shapes.get(name, ()))
        if want and t.shape != want:
            srcs = [dims[d] for d in shapes[name]]
            wrong = [src for (d, src), got in zip(srcs, t.shape) if d != got] or [src for _, src in srcs]
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
    control = [i for i, t in enumerate(types if isinstance(types, list) else ()) if t == CONTROL_TOKEN]
    texts = token_texts(info, set(control)) if control else {}  # only control tokens' texts are decoded
    return info, gguf_hf_config(info, _eog_ids(info, control, texts))


def _eog_ids(info: GGUFInfo, control: list[int], texts: dict[int, str]) -> list[int]:
    """End-of-generation ids: EOS, then the ``control`` tokens whose ``texts`` llama.cpp treats as such."""
    eos = info.meta.get("tokenizer.ggml.eos_token_id")
    ids = [int(eos)] if eos is not None else []
    ids += [i for i in control if texts.get(i) in EOG_TEXTS and i not in ids]
    return ids
