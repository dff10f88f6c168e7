"""A GGUF's tensors dequantized to float32 under HF names: what the PyTorch runtime (``--backend
native``) and the conversion to a transformers directory (``--backend hf``, training) read.

The compiled runtime never comes here: it reads the file's own blocks (``cpu_weights.gguf_weights``).
Tensors are read from a memory map one at a time and dequantized by the gguf package; llama-
architecture files store Q/K rows for interleaved RoPE, which are put back in HF's rotate_half
order (``llama.rope_interleaved_to_half``).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from verispec.models.architectures import ARCHITECTURES
from verispec.models.base import ModelError, one_line
from verispec.models.gguf_config import GLOBAL_TENSORS, LAYER_TENSORS
from verispec.models.gguf_file import GGUFInfo
from verispec.models.llama import rope_interleaved_to_half


def gguf_hf_name(name: str) -> str:
    """llama.cpp tensor name -> HF Llama/Qwen2 parameter name."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        raise ModelError(f"unexpected GGUF tensor {name!r}: expected a plain llama or qwen2 model")
    return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}.{match.group(3)}"


def gguf_tensor(info: GGUFInfo, name: str) -> torch.Tensor:
    """One GGUF tensor dequantized to float32 ([rows, cols] or [n]); read from a memory map."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    t = info.tensors[name]
    qtype = GGMLQuantizationType(t.type_id)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else 1
    nbytes = rows * (t.shape[0] // block * type_size)
    raw = info.view(t.offset, nbytes).reshape(rows, -1)
    try:
        array = dequantize(raw, qtype)
    except NotImplementedError as err:
        raise ModelError(f"{info.path}: tensor {name} is {qtype.name} ({one_line(err)}): expected a type the "
                         "gguf package dequantizes") from None
    w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(rows, t.shape[0]))
    del raw, array
    info.release(t.offset, nbytes)
    return w if len(t.shape) > 1 else w.reshape(-1)


def gguf_state_dict(info: GGUFInfo, cfg: dict, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Every tensor (of the first ``num_layers`` layers) dequantized to float32 under its HF name.

    Files whose architecture stores Q/K rows for interleaved RoPE (``Architecture.rope``: llama)
    are permuted back to HF's rotate_half order; NEOX ones (qwen2) keep HF's order already."""
    permute = ARCHITECTURES[cfg["gguf_architecture"]].rope == "interleaved"
    n_layers = num_layers or cfg["num_hidden_layers"]
    state = {}
    for name in info.tensors:
        match = re.match(r"blk\.(\d+)\.", name)
        if match is not None and int(match.group(1)) >= n_layers:
            continue
        hf = gguf_hf_name(name)
        w = gguf_tensor(info, name)
        if permute and (hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias")):
            w = rope_interleaved_to_half(w.reshape(len(w), -1), cfg["num_attention_heads"]).reshape(w.shape)
        elif permute and (hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias")):
            w = rope_interleaved_to_half(w.reshape(len(w), -1), cfg["num_key_value_heads"]).reshape(w.shape)
        state[hf] = w
    return state


def gguf_dequant_bytes(info: GGUFInfo) -> int:
    """Bytes of the float32 copy ``gguf_state_dict`` makes (for the message that says so)."""
    return 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in info.tensors.values())
