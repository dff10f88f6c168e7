"""Tiny GGUF files written field by field, for the hostile-input tests: a valid qwen2 model of
~200 KB (F32, 2 layers, a 262-token byte-level BPE with ChatML) and the byte offset of every
header field, so that a test can change exactly one field (a dimension, a type id, a string's
length, an array's count) and nothing else.

    meta, tensors = tiny_qwen2()
    meta["qwen2.attention.key_length"] = (UINT32, 64)       # a metadata value, retyped or changed
    fields = write_gguf(path, meta, tensors)               # every header field, by label
    patch(path, fields["tensor blk.0.attn_k.weight dim 0"], 0)  # one header field overwritten
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
                  BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
ALIGN = 32
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# key -> (value type, value); an array's value is (item type, items)
Meta = dict[str, tuple[int, object]]


@dataclass(frozen=True)
class Field:
    """One fixed-size header field of a written file: where it is and how it is packed."""

    label: str  # "kv qwen2.context_length value", "tensor blk.0.attn_k.weight dim 1", ...
    offset: int
    fmt: str  # struct format: "<Q", "<I", "<f", ...


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): three control tokens, GPT-2's 256 byte symbols, "Ġt", "he", "Ġthe"."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    return tokens, [3] * 3 + [1] * (len(tokens) - 3), ["Ġ t", "h e", "Ġt he"]


def tiny_qwen2(hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128, layers: int = 2,
               context: int = 128, seed: int = 0) -> tuple[Meta, dict[str, np.ndarray]]:
    """The metadata and float32 tensors (numpy order: [rows, row length]) of a random qwen2
    model in llama.cpp's names: untied head, Q/K/V biases."""
    tokens, types, merges = byte_level_vocab()
    meta: Meta = {
        "general.architecture": (STRING, "qwen2"),
        "general.name": (STRING, "tiny"),
        "qwen2.block_count": (UINT32, layers),
        "qwen2.context_length": (UINT32, context),
        "qwen2.embedding_length": (UINT32, hidden),
        "qwen2.feed_forward_length": (UINT32, ffn),
        "qwen2.attention.head_count": (UINT32, heads),
        "qwen2.attention.head_count_kv": (UINT32, kv_heads),
        "qwen2.rope.freq_base": (FLOAT32, 1e6),
        "qwen2.attention.layer_norm_rms_epsilon": (FLOAT32, 1e-6),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, "qwen2"),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, tokens)),
        "tokenizer.ggml.token_type": (ARRAY, (INT32, types)),
        "tokenizer.ggml.merges": (ARRAY, (STRING, merges)),
        "tokenizer.ggml.bos_token_id": (UINT32, 0),
        "tokenizer.ggml.eos_token_id": (UINT32, 2),
        "tokenizer.chat_template": (STRING, CHATML),
    }
    rng = np.random.default_rng(seed)
    head_dim, vocab = hidden // heads, len(tokens)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (hidden,), b + "ffn_norm.weight": (hidden,),
                   b + "attn_q.weight": (heads * head_dim, hidden), b + "attn_q.bias": (heads * head_dim,),
                   b + "attn_k.weight": (kv_heads * head_dim, hidden), b + "attn_k.bias": (kv_heads * head_dim,),
                   b + "attn_v.weight": (kv_heads * head_dim, hidden), b + "attn_v.bias": (kv_heads * head_dim,),
                   b + "attn_output.weight": (hidden, heads * head_dim), b + "ffn_gate.weight": (ffn, hidden),
                   b + "ffn_up.weight": (ffn, hidden), b + "ffn_down.weight": (hidden, ffn)}
    tensors = {name: (np.ones(shape) if "norm" in name else rng.normal(0, 0.2, shape)).astype(np.float32)
               for name, shape in shapes.items()}
    return meta, tensors


def _pack(vtype: int, value: object, label: str, at: int, fields: list[Field]) -> bytes:
    """One value (without its type), recording its fields at absolute offset ``at``."""
    if vtype in SCALAR_FORMATS:
        fields.append(Field(f"{label} value", at, SCALAR_FORMATS[vtype]))
        return struct.pack(SCALAR_FORMATS[vtype], value)
    if vtype == STRING:
        data = str(value).encode("utf-8")
        fields.append(Field(f"{label} length", at, "<Q"))
        return struct.pack("<Q", len(data)) + data
    if vtype == ARRAY:
        item_type, items = value
        fields += [Field(f"{label} item type", at, "<I"), Field(f"{label} count", at + 4, "<Q")]
        out = struct.pack("<IQ", item_type, len(items))
        for i, item in enumerate(items):
            out += _pack(item_type, item, f"{label} item {i}", at + len(out), fields if i == 0 else [])
        return out
    raise ValueError(f"unknown value type {vtype}")


def gguf_bytes(meta: Meta, tensors: dict[str, np.ndarray]) -> tuple[bytes, dict[str, Field]]:
    """A GGUF v3 file of ``meta`` and F32 ``tensors``, and its header fields by label."""
    fields: list[Field] = [Field("version", 4, "<I"), Field("tensor count", 8, "<Q"), Field("kv count", 16, "<Q")]
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for key, (vtype, value) in meta.items():
        out += _pack(STRING, key, f"kv {key} key", len(out), fields)
        fields.append(Field(f"kv {key} type", len(out), "<I"))
        out += struct.pack("<I", vtype)
        out += _pack(vtype, value, f"kv {key}", len(out), fields)
    rel = 0
    for name, array in tensors.items():
        label = f"tensor {name}"
        out += _pack(STRING, name, f"{label} name", len(out), fields)
        shape = array.shape[::-1]  # GGUF order: the row length first
        fields.append(Field(f"{label} n_dims", len(out), "<I"))
        out += struct.pack("<I", len(shape))
        for i, d in enumerate(shape):
            fields.append(Field(f"{label} dim {i}", len(out), "<Q"))
            out += struct.pack("<Q", d)
        fields += [Field(f"{label} type", len(out), "<I"), Field(f"{label} offset", len(out) + 4, "<Q")]
        out += struct.pack("<IQ", 0, rel)
        rel += -(-array.nbytes // ALIGN) * ALIGN
    out += bytes(-len(out) % ALIGN)
    for array in tensors.values():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        out += data + bytes(-len(data) % ALIGN)
    return bytes(out), {f.label: f for f in fields}


def write_gguf(path: Path, meta: Meta, tensors: dict[str, np.ndarray]) -> dict[str, Field]:
    data, fields = gguf_bytes(meta, tensors)
    Path(path).write_bytes(data)
    return fields


def patch(path: Path, field: Field, value: int | float) -> None:
    """Overwrite one header field of a written file (the value wraps to the field's width)."""
    if field.fmt in ("<f", "<d"):
        packed = struct.pack(field.fmt, value)
    else:
        size = struct.calcsize(field.fmt)
        packed = (int(value) % (1 << (8 * size))).to_bytes(size, "little")
    with open(path, "r+b") as f:
        f.seek(field.offset)
        f.write(packed)


# ----------------------------------------------------------------------------- from a transformers model


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    return tokens, [3] * 3 + [1] * (len(tokens) - 3), ["Ġ t", "h e", "Ġt he"]


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:  # llama.cpp LlamaModel.permute
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_tiny_gguf(path: Path, arch: str = "qwen2", hidden: int = 64, ffn: int = 96, heads: int = 4,
                    kv_heads: int = 2, raw_types: dict[str, int] | None = None):
    """A random tiny model in llama.cpp's layout (llama: permuted Q/K; qwen2: as HF, with QKV
    bias; untied head); returns the transformers reference model (``arch`` llama/qwen2), or
    None for other architectures (tensors written as they are)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokens, types, merges = _tiny_vocab()
    kw = dict(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2), w.add_context_length(128), w.add_embedding_length(hidden), w.add_feed_forward_length(ffn)
    w.add_head_count(heads), w.add_head_count_kv(kv_heads), w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(1e6 if arch == "qwen2" else 10000.0), w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(tokens), w.add_token_types(types), w.add_token_merges(merges)
    w.add_bos_token_id(0), w.add_eos_token_id(2), w.add_chat_template("{% for m in messages %}<|im_start|>"
                                                                      "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                                                      "{% endfor %}")
    for name, tensor in model.state_dict().items():
        fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
        if name in fixed:
            gname = fixed[name]
        else:
            layer, rest, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name).groups()
            gname = f"blk.{layer}.{_NAMES[rest]}.{kind}"
        t = tensor
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            t = _permute(tensor, heads if "q_proj" in name else kv_heads)
        array = np.ascontiguousarray(t.numpy())
        qtype = (raw_types or {}).get(gname)
        if qtype is not None:
            from gguf import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            raw = np.zeros((array.shape[0], array.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType(qtype))
        elif name == "model.layers.1.mlp.up_proj.weight":  # one Q8_0 tensor: the reference gets its values
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            tensor.copy_(torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)))
        else:
            w.add_tensor(gname, array)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return model


