"""Tiny random GGUFs of every declared architecture (``verispec.models.architectures``), each
written from a transformers model's own tensors in llama.cpp's layout (``convert_hf_to_gguf.py``:
tensor names, Q/K rows permuted for interleaved RoPE, Gemma's norms stored as 1 + w, Llama-3 RoPE
scaling as ``rope_freqs``), so that the reference and the file hold the same weights.

    reference = write_arch_gguf(path, CASES["gemma3"], "q8_0")   # the transformers model, Q8_0 values
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gguf_fixtures import byte_level_vocab

CONTEXT = 512  # positions of every tiny model (the tests run a few hundred)
HF_TO_GGUF = {  # transformers' layer tensor -> llama.cpp's (blk.{i}.<name>)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One architecture's tiny model: its transformers reference and how llama.cpp writes it."""

    arch: str  # general.architecture
    reference: Callable[[int], torch.nn.Module]  # vocab size -> a random transformers model
    interleaved: bool = False  # Q/K rows permuted for llama.cpp's interleaved RoPE (llama)
    norm_shift: float = 0.0  # added to every norm weight (gemma: transformers' 1 + w)
    names: dict[str, str] = field(default_factory=dict)  # overrides of HF_TO_GGUF
    window: int = 0  # attention.sliding_window written, when not 0
    softcap: float = 0.0  # final_logit_softcapping written, when not 0
    rope_freqs: bool = False  # Llama-3 RoPE scaling written as rope_freqs.weight


def _common(vocab: int, **kw) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=2, pad_token_id=None) | kw


def _qwen3(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_common(vocab, head_dim=32)))  # q: 4 x 32 = 128 rows, wider than hidden


def _llama3(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaForCausalLM(LlamaConfig(**_common(vocab), rope_parameters=rope))


def _gemma3(vocab: int) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = _common(vocab, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                  final_logit_softcapping=3.0, tie_word_embeddings=True)
    return Gemma3ForCausalLM(Gemma3TextConfig(**cfg))  # layers 0-4 slide, layer 5 is global


def _mistral(vocab: int) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_common(vocab, sliding_window=8)))


def _phi3(vocab: int) -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**_common(vocab)))


CASES = {
    "qwen3": Case("qwen3", _qwen3),
    "llama3-rope": Case("llama", _llama3, interleaved=True, rope_freqs=True),
    "gemma3": Case("gemma3", _gemma3, norm_shift=1.0, names={"post_attention_layernorm": "post_attention_norm"},
                   window=8, softcap=3.0),
    "mistral": Case("llama", _mistral, interleaved=True, window=8),
    "phi3": Case("phi3", _phi3),
}


def llamacpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate_half Q/K rows -> llama.cpp's interleaved pairs (``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of Llama-3 RoPE scaling (``LlamaModel.generate_extra_tensors``)."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_arch_gguf(path: Path, case: Case, fmt: str = "f32", seed: int = 0) -> torch.nn.Module:
    """``case``'s tiny model as a GGUF at ``path`` (matrices F32, or all Q8_0 with the reference
    given the Q8_0 values); returns the transformers reference (eval mode)."""
    import gguf

    tokens, types, merges = byte_level_vocab()
    torch.manual_seed(seed)
    model = case.reference(len(tokens)).eval()
    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # transformers starts norms at 1 (Gemma: 0): make them matter
                p.copy_(torch.empty_like(p).normal_(1.0 - case.norm_shift, 0.2))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), case.arch)
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(CONTEXT), w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size), w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads), w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim), w.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if case.window:
        w.add_sliding_window(case.window)
    if case.softcap:
        w.add_final_logit_softcapping(case.softcap)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens), w.add_token_types(types), w.add_token_merges(merges)
    w.add_bos_token_id(0), w.add_eos_token_id(2)
    if case.rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        _write_tensor(w, case, cfg, name, tensor, fmt)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return model


def _write_tensor(w, case: Case, cfg, name: str, tensor: torch.Tensor, fmt: str) -> None:
    """One transformers tensor in llama.cpp's name and layout (Q8_0 values copied back into ``tensor``)."""
    import gguf

    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if name in glob:
        gname = glob[name]
    else:
        layer, rest, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name).groups()
        gname = f"blk.{layer}.{case.names.get(rest, HF_TO_GGUF[rest])}.{kind}"
    if tensor.dim() == 2 and fmt == "q8_0":
        q8 = gguf.GGMLQuantizationType.Q8_0
        tensor.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), q8), q8)))
    t = tensor + case.norm_shift if "norm" in name else tensor
    if case.interleaved and ("q_proj" in name or "k_proj" in name):
        t = llamacpp_permute(t, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
    array = np.ascontiguousarray(t.numpy())
    if tensor.dim() == 2 and fmt == "q8_0":
        q8 = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(gname, gguf.quants.quantize(array, q8), raw_dtype=q8)
    else:
        w.add_tensor(gname, array)
