"""The compiled runtime's weights, prepared in Python: matrices in a source format (``RawMatrix``:
fp32 values or GGUF blocks) that ``CpuLlama`` hands to the runtime, which repacks them into
16-row panels.

* an HF checkpoint's tensors, fused (QKV, gate/up) and quantized at load: ``state_dict_weights``
  (``quantize_matrix``, ``models/ggml_quants.py``);
* a GGUF's own blocks, read in place from a memory map with no fp32 copy: ``gguf_weights``
  (tensor names and layouts from the architecture's declaration, ``architectures.py``);
* a draft's wider blocks re-encoded to Q4_0 (or Q3_K / Q2_K) as they are read: ``requantize``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from verispec.models.architectures import ARCHITECTURES, Architecture, layer_tensor
from verispec.models.base import ModelError
from verispec.models.cpu_abi import ERR_LEN, FORMATS, PANEL_ROWS, library
from verispec.models.formats import WeightFormat
from verispec.models.gguf_file import GGUFInfo, GGUFTensor
from verispec.models.llama import LlamaArgs, rope_interleaved_to_half, take


@dataclass(frozen=True)
class RawMatrix:
    """A row-major weight matrix in a source format: fp32 values or GGUF blocks (uint8 [rows, bytes])."""

    fmt: WeightFormat  # one of the runtime's FORMATS (csrc/formats/table.cpp): f32, f16, q4_0, q4_k, iq4_xs, ...
    data: np.ndarray
    rows: int
    cols: int
    # called once the runtime has repacked the data (a memory-mapped file's pages are dropped)
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "fmt", WeightFormat(self.fmt))  # a name ("q4_0") is its format


# A layer's weights: one matrix, or row blocks stacked in order (fused QKV, gate/up), each in
# its own format (a Q4_K_M file mixes Q4_K and Q6_K inside one fused QKV).
Linear = RawMatrix | list[RawMatrix]


def _f32(t: torch.Tensor) -> RawMatrix:
    t = t.float().contiguous()
    return RawMatrix(WeightFormat.F32, t.numpy(), t.shape[0], t.shape[1])


W = WeightFormat
QUANTS = (W.F32, W.Q8_0, W.Q4_1, W.Q4_0, W.Q5_0, W.Q4_K, W.Q5_K, W.Q6_K)  # formats quantize_matrix writes
REQUANTS = (W.Q4_0, W.Q3_K, W.Q2_K)  # formats requantize writes
del W


def quantize_matrix(w: torch.Tensor, fmt: WeightFormat | str) -> RawMatrix:
    """fp32 [rows, cols] -> GGUF blocks of ``fmt`` (one of QUANTS; K formats need cols % 256 == 0)."""
    from verispec.models.ggml_quants import quantize

    fmt = WeightFormat.parse(fmt, QUANTS)
    if fmt == WeightFormat.F32:
        return _f32(w)
    return RawMatrix(fmt, quantize(w.float().numpy(), fmt), w.shape[0], w.shape[1])


def requantize(m: RawMatrix, fmt: WeightFormat | str = WeightFormat.Q4_0) -> RawMatrix:
    """``m`` re-encoded as ``fmt`` (one of REQUANTS: Q4_0 by ggml's rule, Q3_K / Q2_K by a
    first-pass rule, csrc/formats) where that streams fewer bytes: a draft model chosen for
    speed, not fidelity; the target checks every drafted token, so output is unchanged. A
    K format needs rows of 256-multiples: narrower rows (the Qwen2.5 0.5B's 896) take Q4_0
    instead. Matrices already at most as wide come back as they are; the source pages are
    released once read."""
    fmt = WeightFormat.parse(fmt, REQUANTS, "requantization")
    lib, want = library(), FORMATS[fmt]
    if m.cols % want.block:
        want = FORMATS[WeightFormat.Q4_0]
    if m.cols % want.block or FORMATS[m.fmt].row_bytes(m.cols) <= want.row_bytes(m.cols):
        return m
    out = np.empty((m.rows, want.row_bytes(m.cols)), dtype=np.uint8)
    src = np.ascontiguousarray(m.data)
    err = ctypes.create_string_buffer(ERR_LEN)
    if lib.vs_requantize(want.fmt.ggml_type, m.fmt.ggml_type, src.ctypes.data, m.rows, m.cols, out.ctypes.data,
                         max(1, torch.get_num_threads()), err, ERR_LEN):
        raise ModelError(f"requantizing a {m.fmt} matrix to {want.fmt}: {err.value.decode()}")
    if m.release is not None:
        m.release()
    return RawMatrix(want.fmt, out, m.rows, m.cols)


def check_head_rows(head_rows, vocab_size: int) -> torch.Tensor:
    """A reduced LM head's token ids: a non-empty 1-D list of distinct ids in [0, vocab_size)."""
    rows = torch.as_tensor(head_rows, dtype=torch.long)
    if rows.dim() != 1 or not len(rows) or not 0 <= int(rows.min()) <= int(rows.max()) < vocab_size \
            or len(rows.unique()) != len(rows):
        raise ValueError(f"head_rows must be a non-empty 1-D list of distinct token ids in [0, {vocab_size})")
    return rows


def state_dict_weights(cfg: dict, state: dict[str, torch.Tensor], quant: WeightFormat,
                       head_rows: torch.Tensor | None = None) -> dict:
    """HF-named tensors -> the runtime's fused matrices (QKV, gate/up), quantized to ``quant``;
    ``head_rows``: the LM head keeps those rows (the input embedding keeps all of them)."""
    args = LlamaArgs.from_hf_config(cfg)
    if args.beyond_llama:
        raise ModelError(f"{cfg.get('gguf_architecture')} weights are read from the GGUF's own blocks, not "
                         f"re-quantized (it has {', '.join(args.beyond_llama)}): drop --quant")
    q = lambda w: quantize_matrix(w.float(), quant)  # noqa: E731
    layers = []
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        t = lambda n: take(state, p + n)  # noqa: E731
        layer = {"attn_norm": t("input_layernorm.weight"), "ffn_norm": t("post_attention_layernorm.weight"),
                 "wqkv": q(torch.cat([t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"),
                                      t("self_attn.v_proj.weight")])),
                 "wo": q(t("self_attn.o_proj.weight")),
                 "w13": q(torch.cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")])),
                 "w2": q(t("mlp.down_proj.weight"))}
        if p + "self_attn.q_proj.bias" in state:
            layer["wqkv_bias"] = torch.cat([t("self_attn.q_proj.bias"), t("self_attn.k_proj.bias"), t("self_attn.v_proj.bias")])
        layers.append(layer)
    embed = take(state, "model.embed_tokens.weight")
    tied = cfg.get("tie_word_embeddings", "lm_head.weight" not in state)
    head = embed if tied else take(state, "lm_head.weight")
    if head_rows is not None:
        head, tied = head[check_head_rows(head_rows, len(head))], False
    # a quantized model's head in Q8_0, as llama.cpp does
    head_fmt = WeightFormat.F32 if quant == WeightFormat.F32 else WeightFormat.Q8_0
    return {"layers": layers, "norm": take(state, "model.norm.weight"), "head": quantize_matrix(head.float(), head_fmt),
            "embed": None if tied else quantize_matrix(embed.float(), head_fmt)}


_CHUNK_BYTES = 32 << 20  # large tensors are set in row blocks of at most this many source bytes


def gguf_weights(info: GGUFInfo, cfg: dict, head_rows: torch.Tensor | None = None,
                 requant: WeightFormat | None = None, layer_ids: tuple[int, ...] | None = None) -> dict:
    """The weights of a GGUF file of a declared architecture (``architectures.ARCHITECTURES``) as
    its own blocks (no dequantization, no fp32 copy): every format of ``FORMATS`` (F32, F16, BF16,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS).
    Data are views of one read-only memory map; each row block's pages are released once the
    runtime has repacked it, so loading holds the repacked weights plus one block at a time.
    Q/K rows of an architecture with interleaved RoPE (llama) go from GGUF's interleaved pairs to
    HF's rotate_half order (a row permutation); the others keep rotate_half order (llama.cpp's
    NEOX RoPE). A fused QKV or gate/up (phi3) is one matrix already in the runtime's row order.
    ``head_rows``: the LM head keeps only those token ids' rows, in that order (a draft's
    reduced head, FR-Spec); the input embedding keeps every row. ``requant``: matrices wider
    than that format are re-encoded to it as they are read (``requantize``: a draft model).
    ``layer_ids``: only these layers of the file, in this order (a draft with layers skipped;
    ``cfg`` then counts ``len(layer_ids)`` layers)."""
    library()  # FORMATS comes from the library
    args = LlamaArgs.from_hf_config(cfg)
    arch = ARCHITECTURES[cfg.get("gguf_architecture", "llama")]
    read = _MappedGGUF(info, requant, permute=arch.rope == "interleaved")
    ids = range(args.n_layers) if layer_ids is None else layer_ids
    if len(ids) != args.n_layers:
        raise ValueError(f"layer_ids lists {len(ids)} layers, the config {args.n_layers}")
    layers = [_layer(read, i, args, arch) for i in ids]
    tied = "output.weight" not in info.tensors
    head_name = "token_embd.weight" if tied else "output.weight"
    if head_rows is not None:
        head_rows = check_head_rows(head_rows, read.tensor(head_name).shape[1])
    weights = {"layers": layers, "norm": read.vector("output_norm.weight"),
               "head": read.linear(head_name, rows=head_rows), "embed": None}
    if not tied or head_rows is not None:  # the input embedding stays in the mapped file: one row per token
        weights["embed_ref"] = read.matrix("token_embd.weight")
    return weights


def _layer(read: _MappedGGUF, i: int, args: LlamaArgs, arch: Architecture) -> dict:
    """Decoder layer ``i`` as ``arch`` declares it: its norms, fused QKV (and Qwen2's Q/K/V biases),
    output, gate/up and down; Q/K norms and post-norms where it has them."""
    def name(tensor: str, kind: str = "weight") -> str:
        return layer_tensor(i, tensor, kind)

    qkv = (read.linear(name("attn_qkv")) if arch.fused_qkv else
           parts(read.linear(name("attn_q"), heads=args.n_heads), read.linear(name("attn_k"), heads=args.n_kv_heads),
                 read.linear(name("attn_v"))))
    gate_up = read.linear(name("ffn_up")) if arch.fused_gate_up else parts(read.linear(name("ffn_gate")),
                                                                            read.linear(name("ffn_up")))
    layer = {"attn_norm": read.vector(name("attn_norm")), "ffn_norm": read.vector(name("ffn_norm")), "wqkv": qkv,
             "wo": read.linear(name("attn_output")), "w13": gate_up, "w2": read.linear(name("ffn_down"))}
    if arch.qk_norm:
        layer |= {"q_norm": read.vector(name("attn_q_norm")), "k_norm": read.vector(name("attn_k_norm"))}
    if arch.post_norms:
        layer |= {"post_attn_norm": read.vector(name("post_attention_norm")),
                  "post_ffn_norm": read.vector(name("post_ffw_norm"))}
    if name("attn_q", "bias") in read.info.tensors:
        layer["wqkv_bias"] = torch.cat([read.vector(name("attn_q", "bias"), heads=args.n_heads),
                                        read.vector(name("attn_k", "bias"), heads=args.n_kv_heads),
                                        read.vector(name("attn_v", "bias"))])
    return layer


class _MappedGGUF:
    """A GGUF's tensors as the runtime's inputs, read from one read-only memory map of the file:
    matrices as views (in row blocks whose pages are released once repacked), vectors as copies;
    Q/K rows permuted to rotate_half order where ``permute``; matrices re-encoded to ``requant``."""

    def __init__(self, info: GGUFInfo, requant: WeightFormat | None, permute: bool):
        self.info, self.requant, self.permute = info, requant, permute

    def tensor(self, name: str) -> GGUFTensor:
        t = self.info.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.info.path}: missing tensor {name}")
        return t

    def matrix(self, name: str) -> RawMatrix:
        """The whole tensor as a view of the mapped file, in a format of the runtime."""
        t = self.tensor(name)
        fmt = FORMATS.get(t.format)
        if fmt is None or len(t.shape) != 2:
            raise ModelError(f"{self.info.path}: tensor {name} is {t.type_name}; the compiled runtime reads "
                             f"{', '.join(f.label for f in FORMATS)} (try --backend native, which dequantizes)")
        cols, rows = t.shape
        data = self.info.view(t.offset, t.nbytes).reshape(rows, fmt.row_bytes(cols))
        return RawMatrix(fmt.fmt, data.view(np.float32) if fmt.fmt == WeightFormat.F32 else data, rows, cols)

    def linear(self, name: str, heads: int | None = None, rows: torch.Tensor | None = None) -> Linear:
        """A linear's matrix: only ``rows`` (a copy), Q/K rows of ``heads`` heads permuted (a copy),
        else row blocks of the mapped file; re-encoded to ``requant`` when set."""
        out = self._blocks(name, heads, rows)
        if self.requant is None:
            return out
        return [requantize(p, self.requant) for p in out] if isinstance(out, list) else requantize(out, self.requant)

    def _blocks(self, name: str, heads: int | None, rows: torch.Tensor | None) -> Linear:
        m = self.matrix(name)
        if rows is not None:
            return RawMatrix(m.fmt, m.data[rows.numpy()], len(rows), m.cols)
        if heads is not None and self.permute:
            return RawMatrix(m.fmt, rope_interleaved_to_half(torch.from_numpy(np.array(m.data)), heads).numpy(),
                             m.rows, m.cols)
        rb, offset = m.data.nbytes // m.rows, self.tensor(name).offset
        step = max(PANEL_ROWS, _CHUNK_BYTES // rb // PANEL_ROWS * PANEL_ROWS)
        chunks = [RawMatrix(m.fmt, m.data[r:r + step], min(step, m.rows - r), m.cols,
                            self._release(offset + r * rb, min(step, m.rows - r) * rb)) for r in range(0, m.rows, step)]
        return chunks[0] if len(chunks) == 1 else chunks

    def _release(self, start: int, nbytes: int) -> Callable[[], None]:
        """Drop the pages of bytes ``start .. start + nbytes`` (once the runtime has repacked them)."""
        return lambda: self.info.release(start, nbytes)

    def vector(self, name: str, heads: int | None = None) -> torch.Tensor:
        """An F32 vector (a norm, a bias), copied; a Q/K bias of ``heads`` heads permuted."""
        t = self.tensor(name)
        if t.format != WeightFormat.F32:
            raise ModelError(f"{self.info.path}: tensor {name} is {t.type_name}: expected F32")
        v = torch.from_numpy(self.info.view(t.offset, t.nbytes).view(np.float32).copy())
        return rope_interleaved_to_half(v[:, None], heads)[:, 0] if heads is not None and self.permute else v


def parts(*linears: Linear) -> list[RawMatrix]:
    """The matrices of linears, row blocks flattened."""
    return [p for w in linears for p in (w if isinstance(w, list) else [w])]


def layer_formats(weights: dict) -> tuple[WeightFormat, ...]:
    """The distinct formats of the layers' matrices (QKV, output, gate/up, down), sorted."""
    return tuple(sorted({m.fmt for layer in weights["layers"]
                         for m in parts(layer["wqkv"], layer["wo"], layer["w13"], layer["w2"])}))
