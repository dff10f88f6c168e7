"""The decoder architectures verispec runs from GGUF files, each declared once (``ARCHITECTURES``).

A declaration says what differs from a 2023 Llama: how the file spells its tensors (fused
QKV, fused gate/up), which norms a layer has (per-head Q/K norms, norms after attention and
MLP), the activation, RoPE's row order, embedding scaling, which layers attend through a
sliding window and with which RoPE base, and which hyper-parameters it reads. Every reader
follows the declaration: the GGUF config reader (``gguf_config``: keys, tensors, shapes), the
config of the runtimes (``llama.LlamaArgs``), the compiled runtime's weight reader
(``cpu_weights.gguf_weights``) and its forward (``csrc/forward.cpp``, which runs what the
config and the tensors it is given say). Adding an architecture is a row here and its test.

The names follow llama.cpp (``src/llama-arch.cpp``, ``src/llama-model.cpp``: tensor names,
``LLM_KV_*`` keys, the RoPE type of each architecture) and transformers' model types.

    ARCHITECTURES["qwen3"].qk_norm     # True: attn_q_norm / attn_k_norm, RMSNorm over each head
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from verispec.models.base import ModelError


@dataclass(frozen=True)
class Architecture:
    """One GGUF ``general.architecture``: what its layers compute beyond a plain Llama layer
    (x += Wo @ attn(rope(Wq, Wk @ norm(x)), Wv @ norm(x)); x += W2 @ (silu(W1 @ norm(x)) * W3 @ norm(x)))."""

    name: str  # general.architecture, and the prefix of its metadata keys
    model_type: str  # the transformers model_type of the config it gets (``llama.LlamaArgs`` reads it)
    hf_class: str  # transformers' class of that model (the config's ``architectures``)
    # Q/K rows in the file: "interleaved" pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM; permuted to
    # rotate_half at load) or already rotate_half ("neox": LLAMA_ROPE_TYPE_NEOX)
    rope: Literal["interleaved", "neox"]
    fused_qkv: bool = False  # one attn_qkv [(H + 2 KVH) D, dim] (phi3) instead of attn_q, attn_k, attn_v
    fused_gate_up: bool = False  # one ffn_up [2 ffn, dim]: gate rows, then up rows (phi3)
    qkv_bias: bool = False  # attn_q/k/v may carry biases (qwen2)
    qk_norm: bool = False  # attn_q_norm, attn_k_norm [D]: RMSNorm of each q and k head before RoPE
    post_norms: bool = False  # post_attention_norm, post_ffw_norm [dim]: RMSNorm of each output before its residual add
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the gate: SwiGLU or GeGLU (tanh-approximated GELU)
    embed_scale: bool = False  # embeddings times sqrt(dim) (gemma)
    rope_freqs: bool = False  # may carry rope_freqs.weight [D / 2]: Llama-3 RoPE scaling as per-frequency divisors
    # With a window in the file (``attention.sliding_window``): which layers slide. 0: every
    # layer; n: all but every n-th (layers n-1, 2n-1, ... attend globally; llama.cpp's set_swa_pattern).
    swa_pattern: int = 0
    local_rope_base: float | None = None  # RoPE base of sliding layers (gemma3: llama.cpp's rope_freq_base_train_swa)
    default_rope_base: float = 10000.0  # when the file gives no rope.freq_base
    # its transformers config switches the window on with use_sliding_window (qwen2), so the
    # switch is written: off, or on when the file gives a window
    window_switch: bool = False
    # its transformers config names the attention scale (query_pre_attn_scalar, gemma3): head_dim,
    # or dim / heads for a 62-layer model (the 27B; llama.cpp's f_attention_scale)
    attention_scalar: bool = False
    # <arch>.* keys read beyond the common ones (COMMON_KEYS); any other <arch>.* key is refused
    keys: frozenset[str] = frozenset()


# <arch>.<key> every architecture reads (gguf_config.gguf_hf_config)
COMMON_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
})  # fmt: skip
SLIDING = frozenset({"attention.sliding_window"})
LINEAR_ROPE = frozenset({"rope.scaling.factor"})  # with rope.scaling.type = linear

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    # Llama 2/3.x, SmolLM, Mistral (a llama file with a sliding window: Mistral 7B v0.1)
    Architecture("llama", "llama", "LlamaForCausalLM", rope="interleaved", rope_freqs=True, keys=SLIDING | LINEAR_ROPE),
    Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", rope="neox", qkv_bias=True, default_rope_base=1e6,
                 window_switch=True),
    Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", rope="neox", qk_norm=True, default_rope_base=1e6),
    Architecture("gemma3", "gemma3_text", "Gemma3ForCausalLM", rope="neox", qk_norm=True, post_norms=True,
                 activation="gelu_tanh", embed_scale=True, swa_pattern=6, local_rope_base=10000.0,
                 default_rope_base=1e6, attention_scalar=True, keys=SLIDING | LINEAR_ROPE | {"final_logit_softcapping"}),
    # original_context_length only matters with LongRoPE's rope_factors_long/short tensors, which are refused
    Architecture("phi3", "phi3", "Phi3ForCausalLM", rope="neox", fused_qkv=True, fused_gate_up=True,
                 keys=SLIDING | {"rope.scaling.original_context_length"}),
)}  # fmt: skip


def by_model_type(model_type: str | None) -> Architecture | None:
    """The declaration whose config has this transformers model_type (mistral: llama's), or None."""
    if model_type == "mistral":
        return ARCHITECTURES["llama"]
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)


def architecture(name: object, path: object) -> Architecture:
    """The declaration of ``general.architecture`` = ``name``, or a ModelError naming what is supported."""
    if name not in ARCHITECTURES:
        raise ModelError(f"{path} has architecture {name!r}: expected one of {', '.join(map(repr, ARCHITECTURES))}")
    return ARCHITECTURES[name]


# --------------------------------------------------------------------------- tensors

def layer_tensors(arch: Architecture) -> dict[str, tuple[str, ...]]:
    """llama.cpp's names of the weights every layer of ``arch`` has, and their shapes (GGUF order:
    the row length first) in dimension names: h hidden, f ffn, q = H * D, kv = KVH * D, d = D."""
    t: dict[str, tuple[str, ...]] = {"attn_norm": ("h",), "ffn_norm": ("h",), "attn_output": ("q", "h"),
                                     "ffn_down": ("f", "h")}
    t |= {"attn_qkv": ("h", "qkv")} if arch.fused_qkv else {"attn_q": ("h", "q"), "attn_k": ("h", "kv"),
                                                             "attn_v": ("h", "kv")}
    t |= {"ffn_up": ("h", "2f")} if arch.fused_gate_up else {"ffn_gate": ("h", "f"), "ffn_up": ("h", "f")}
    if arch.qk_norm:
        t |= {"attn_q_norm": ("d",), "attn_k_norm": ("d",)}
    if arch.post_norms:
        t |= {"post_attention_norm": ("h",), "post_ffw_norm": ("h",)}
    return t


def layer_tensor(layer: int, name: str, kind: str = "weight") -> str:
    """GGUF name of layer ``layer``'s tensor ``name`` (a key of ``layer_tensors``): ``blk.3.attn_q.weight``."""
    return f"blk.{layer}.{name}.{kind}"


def optional_layer_tensors(arch: Architecture) -> dict[str, tuple[str, ...]]:
    """Tensors a layer of ``arch`` may have: Q/K/V biases (``blk.{i}.attn_q.bias``, ...)."""
    return {"attn_q.bias": ("q",), "attn_k.bias": ("kv",), "attn_v.bias": ("kv",)} if arch.qkv_bias else {}


def sliding_layers(arch: Architecture, n_layers: int, window: int) -> tuple[bool, ...]:
    """Which layers attend through the window (llama.cpp's ``set_swa_pattern``; transformers' ``layer_types``).

    Example: gemma3 (pattern 6), 8 layers, a window -> (T, T, T, T, T, F, T, T).
    """
    if not window:
        return (False,) * n_layers
    n = arch.swa_pattern
    return tuple(n == 0 or (i + 1) % n != 0 for i in range(n_layers))
