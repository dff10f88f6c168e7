"""The Llama architecture as verispec's runtimes read it (the native PyTorch runtime,
models/native.py; the compiled one, models/cpu.py; EAGLE heads, drafters/eagle.py):

* the config: ``LlamaArgs`` from an HF ``config.json`` (Llama, Llama-3 RoPE scaling, GQA,
  Qwen2, Mistral, SmolLM), ``SUPPORTED_MODEL_TYPES``; from a GGUF's config (``gguf_config``),
  also every architecture of ``architectures.ARCHITECTURES`` (Q/K norms, post-norms, GeGLU,
  scaled embeddings, sliding windows, a second RoPE base), which the compiled runtime runs;
* an HF checkpoint's tensors: ``read_safetensors``, ``take``;
* the row-local math they share: RoPE (rotate-half, HF layout: ``rope_inv_freq``,
  ``rope_tables``, ``apply_rope``) and ``rms_norm``;
* the Q/K row order of checkpoints written for interleaved RoPE (GGUF, llama2.c), turned into
  HF's: ``rope_interleaved_to_half``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from verispec.models.architectures import by_model_type
from verispec.models.base import ModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "smollm")


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (or plain 'linear')."""

    kind: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class LlamaArgs:
    """Architecture, read from an HF ``config.json``."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # beyond a plain Llama (architectures.Architecture; a GGUF's config sets them, HF configs of
    # the Llama family leave the defaults)
    qk_norm: bool = False  # RMSNorm [head_dim] of every q and k head before RoPE
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # input embeddings times this (gemma: sqrt(dim))
    attn_scale: float | None = None  # scores times this; None: 1 / sqrt(head_dim)
    logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap); 0: none
    layer_windows: tuple[int, ...] = ()  # per layer: keys it attends to at most (0: all); () all layers global
    local_rope_theta: float | None = None  # RoPE base of sliding layers (their own table); None: the one table
    rope_freq_factors: tuple[float, ...] | None = None  # Llama-3 scaling as per-frequency divisors (GGUF rope_freqs)

    @property
    def group(self) -> int:  # query heads per kv head
        return self.n_heads // self.n_kv_heads

    @property
    def beyond_llama(self) -> tuple[str, ...]:
        """What this model computes beyond a Llama/Qwen2 layer (what the native runtime does not implement)."""
        flags = {"Q/K norms": self.qk_norm, "post-norms": self.post_norms, "GeGLU": self.activation != "silu",
                 "scaled embeddings": self.embed_scale != 1.0, "an attention scale": self.attn_scale is not None,
                 "logit softcapping": self.logit_softcap > 0, "sliding-window attention": any(self.layer_windows)}
        return tuple(name for name, on in flags.items() if on)

    def layer_rope(self, layer: int) -> int:
        """RoPE table of ``layer``: 0 the model's, 1 the sliding layers' own (``local_rope_theta``)."""
        return int(self.local_rope_theta is not None and bool(self.layer_windows) and self.layer_windows[layer] > 0)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaArgs:
        _check_supported(cfg)
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests theta + scaling here
        eos = cfg.get("eos_token_id")
        return cls(**_variant_fields(cfg), **_llama_fields(cfg, heads, rope, eos))


def _llama_fields(cfg: dict, heads: int, rope: dict, eos: object) -> dict:
    return dict(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(cfg.get("rope_scaling") or rope),
        max_position=cfg.get("max_position_embeddings", 2048),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
    )


def _variant_fields(cfg: dict) -> dict:
    """``LlamaArgs``' fields beyond a plain Llama, from a GGUF's config and its architecture's
    declaration; none for an HF config (the Llama family as transformers writes it)."""
    decl = by_model_type(cfg.get("model_type"))
    if cfg.get("gguf_architecture") is None or decl is None:
        return {}
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or 0
    types = (cfg.get("layer_types") or [])[:layers]  # a config cut to its first layers keeps theirs
    if window and len(types) != layers:
        raise ModelError(f"config: layer_types must list {layers} layers, got {len(types)}")
    scalar = cfg.get("query_pre_attn_scalar")
    factors = cfg.get("rope_freq_factors")
    local = cfg.get("rope_local_base_freq")
    return {"qk_norm": decl.qk_norm, "post_norms": decl.post_norms, "activation": decl.activation,
            "embed_scale": math.sqrt(cfg["hidden_size"]) if decl.embed_scale else 1.0,
            "attn_scale": None if scalar is None else 1.0 / math.sqrt(float(scalar)),
            "logit_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
            "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types) if window else (),
            "local_rope_theta": None if local is None else float(local),
            "rope_freq_factors": None if factors is None else tuple(float(f) for f in factors)}


def check_native(args: LlamaArgs, what: str) -> None:
    """The PyTorch runtimes (``native``, EAGLE heads) compute a Llama/Qwen2 layer (and Llama-3 RoPE):
    a model with more is refused in one line, before its weights are read."""
    if args.beyond_llama:
        raise ModelError(f"{what} has {', '.join(args.beyond_llama)}, which the PyTorch runtime does not implement: "
                         "run it on the compiled runtime (--backend cpu, float32 on CPU)")


def _check_supported(cfg: dict) -> None:
    """An HF config of the Llama family, or the config of a GGUF of a declared architecture
    (``gguf_config``: its ``gguf_architecture`` says so; the compiled runtime reads the file)."""
    kind = cfg.get("model_type")
    if cfg.get("gguf_architecture") is not None and by_model_type(kind) is not None:
        return
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ModelError(f"native runtime supports model_type in {SUPPORTED_MODEL_TYPES}, got {kind!r}")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise ModelError("native runtime supports only a bias-free SiLU-gated MLP")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", kind == "mistral"):
        raise ModelError("native runtime does not support sliding-window attention")


def _rope_scaling(rs: dict) -> RopeScaling | None:
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    raise ModelError(f"native runtime: unsupported rope scaling {kind!r} (supported: llama3, linear)")


# ----------------------------------------------------------------------------- checkpoint


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in the HF directory ``path``, by name."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``state[name]``, or a ModelError naming the missing tensor."""
    if name not in state:
        raise ModelError(f"missing tensor {name!r} in checkpoint")
    return state[name]


# ----------------------------------------------------------------------------- math


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-local RMSNorm in fp32 (as HF Llama), x [..., H] -> [..., H] in x.dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, rs: RopeScaling | None = None,
                  device: torch.device | None = None, factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies (on ``device``), with Llama-3 / linear scaling ``rs``
    applied, or divided by llama.cpp's per-frequency ``factors`` (a GGUF's rope_freqs)."""
    d = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if factors is not None:
        inv = inv / torch.tensor(factors, dtype=torch.float32, device=device)
    if rs is None:
        return inv
    if rs.kind == "linear":
        return inv / rs.factor
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(args: LlamaArgs, n_pos: int, device: torch.device,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [n_pos, head_dim / 2] fp32 of ``args``' RoPE at positions 0 .. n_pos - 1;
    ``local``: the sliding layers' own (base ``local_rope_theta``, unscaled, as transformers' Gemma 3)."""
    inv = (rope_inv_freq(args.head_dim, args.local_rope_theta) if local else
           rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling, factors=args.rope_freq_factors))
    freqs = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv)
    return freqs.cos().to(device), freqs.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout), computed in fp32. x [..., D]; cos, sin [..., D/2] fp32,
    broadcast against x's halves (e.g. x [B, N, heads, D] with cos [B, N, 1, D/2])."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)  # [..., D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q/K rows per head from interleaved RoPE pairs to HF's ``rotate_half`` layout.

    Within each head, rows ``(x0, y0, x1, y1, ...)`` become ``(x0, x1, ..., y0, y1, ...)``; this
    is ``permute`` in transformers' ``convert_llama_weights_to_hf.py`` and the inverse of
    ``LlamaModel.permute`` in llama.cpp's ``convert_hf_to_gguf.py``.
    Example, one head of dim 4: rows [a0, b0, a1, b1] -> [a0, a1, b0, b1].
    """
    out_dim, in_dim = w.shape  # [n_heads * head_dim, in]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)

