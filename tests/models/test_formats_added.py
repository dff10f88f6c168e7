"""The compiled runtime's formats of issue 35 (Q2_K, Q3_K, F16, BF16, IQ4_NL, IQ4_XS, Q5_1) in a
tiny model that decodes bitwise alike on every ISA and thread count, in chains, trees and
batches, and in a GGUF on both runtimes (each format alone, as every row of the table:
test_format_table.py).

Test weights: ``gguf.quants.quantize`` where the gguf package encodes the type (F16, BF16,
Q5_1); the others (which it only decodes) are random blocks: random bytes with finite fp16
super-block scales, which is every valid block of those formats."""

from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tiny_models import (
    assert_batch_bitwise,
    assert_chain_bitwise,
    assert_same_bits,
    assert_tree_bitwise,
    available_isas,
    scenario,
)

from verispec.models import cpu_abi
from verispec.models.cpu import CpuLlama
from verispec.models.cpu_weights import RawMatrix

if not cpu_abi.available():
    pytest.fail("the compiled runtime is not built", pytrace=False)
ISAS = available_isas()  # scalar (the reference) first

ADDED = ("q2_k", "q3_k", "f16", "bf16", "iq4_nl", "iq4_xs", "q5_1")
ENCODED = ("f16", "bf16", "q5_1")  # gguf.quants.quantize writes these
# byte offsets of each format's fp16 scales in its block (the rest of a block is any bits)
HALF_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "iq4_nl": (0,), "iq4_xs": (0,)}
# about the RMS of a random block's integer factor (scale code x weight code), so that a weight is about its fp16 scale x this
CODE_RMS = {"q2_k": 20.0, "q3_k": 40.0, "iq4_nl": 70.0, "iq4_xs": 1300.0}


def qtype(fmt: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[fmt.upper()]


def blocks(fmt: str, rows: int, cols: int, seed: int, std: float = 1.0) -> np.ndarray:
    """uint8 [rows, row bytes]: a random matrix in ``fmt`` whose weights have about ``std``
    times a per-row scale in 0.01..2 (and one all-zero row)."""
    rng = np.random.default_rng(seed)
    row_scale = rng.uniform(0.01, 2.0, (rows, 1)).astype(np.float32) * std
    if fmt in ENCODED:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * row_scale
        w[rows // 2] = 0.0
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype(fmt))).view(np.uint8).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[qtype(fmt)]
    out = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in HALF_FIELDS[fmt]:
        half = (rng.standard_normal((rows, cols // block)) * row_scale / CODE_RMS[fmt]).astype(np.float16)
        half[rows // 2] = 0.0
        out[:, :, at:at + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return out.reshape(rows, -1)


# ----------------------------------------------------------------------------- a tiny model of these formats

VOCAB, DIM, KV, HEAD_DIM, FFN = 256, 256, 2, 64, 512
# formats of q, k, v, o, gate, up, down per layer; head; embedding
LAYER_FORMATS = [("q3_k", "q2_k", "q3_k", "iq4_xs", "q3_k", "q3_k", "q2_k"),
                 ("f16", "bf16", "q5_1", "iq4_nl", "q5_1", "iq4_xs", "bf16")]
HEAD_FORMAT, EMBED_FORMAT = "q3_k", "f16"


def _matrix(fmt: str, rows: int, cols: int, seed: int, std: float) -> RawMatrix:
    return RawMatrix(fmt, blocks(fmt, rows, cols, seed, std), rows, cols)


def tiny_model(isa: str | None = None, threads: int = 2) -> CpuLlama:
    heads = DIM // HEAD_DIM
    cfg = {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": FFN,
           "num_hidden_layers": len(LAYER_FORMATS), "num_attention_heads": heads, "num_key_value_heads": KV,
           "head_dim": HEAD_DIM, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": 1}
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.08  # noqa: E731
    shapes = [(DIM, DIM), (KV * HEAD_DIM, DIM), (KV * HEAD_DIM, DIM), (DIM, DIM), (FFN, DIM), (FFN, DIM), (DIM, FFN)]
    layers = []
    for i, fmts in enumerate(LAYER_FORMATS):
        q, k, v, o, gate, up, down = (_matrix(f, r, c, 100 * i + j, 0.05) for j, ((r, c), f) in
                                      enumerate(zip(shapes, fmts)))
        layers.append({"attn_norm": 1 + rand(DIM), "ffn_norm": 1 + rand(DIM), "wqkv": [q, k, v], "wo": o,
                       "w13": [gate, up], "w2": down, "wqkv_bias": rand(DIM + 2 * KV * HEAD_DIM) * 5})
    weights = {"layers": layers, "norm": 1 + rand(DIM), "head": _matrix(HEAD_FORMAT, VOCAB, DIM, 998, 0.3),
               "embed": _matrix(EMBED_FORMAT, VOCAB, DIM, 999, 1.0)}
    return CpuLlama.from_weights(cfg, weights, 256, name="issue35-formats", isa=isa, threads=threads)


def test_tiny_model_chain_tree_batch_and_isas_bitwise():
    """Alone == chain == tree node == batch row, bitwise, with 1 and 2 threads; and every ISA
    and thread count gives the scalar reference's bits."""
    model = tiny_model()
    assert set(model.formats) == {f for fmts in LAYER_FORMATS for f in fmts}
    for threads in (1, 2):
        model.set_threads(threads)
        assert_chain_bitwise(model, VOCAB, prefix_len=60, k=8)
        assert_tree_bitwise(model, VOCAB, prefix_len=12)
        assert_batch_bitwise(model, VOCAB)
    ref = scenario(tiny_model("scalar", threads=1), VOCAB)
    assert all(torch.isfinite(t).all() for t in ref) and ref[0].std() > 0
    for isa in ISAS:
        for threads in (1, 2):
            assert_same_bits(ref, scenario(tiny_model(isa, threads), VOCAB), f"{isa}, {threads} threads")


# ----------------------------------------------------------------------------- a GGUF of these formats, both runtimes

GGUF_TYPES = {"blk.0.attn_q.weight": "q3_k", "blk.0.attn_k.weight": "q2_k", "blk.0.attn_v.weight": "iq4_xs",
              "blk.0.attn_output.weight": "iq4_nl", "blk.0.ffn_gate.weight": "q5_1", "blk.0.ffn_up.weight": "f16",
              "blk.0.ffn_down.weight": "bf16", "blk.1.attn_q.weight": "q2_k", "blk.1.attn_k.weight": "q3_k",
              "blk.1.attn_v.weight": "q3_k", "blk.1.attn_output.weight": "q3_k", "blk.1.ffn_gate.weight": "q3_k",
              "blk.1.ffn_up.weight": "q2_k", "blk.1.ffn_down.weight": "q3_k", "output.weight": "q2_k",
              "token_embd.weight": "bf16"}


def write_formats_gguf(path) -> None:
    """A tiny qwen2 GGUF (tests/gguf_fixtures.py) whose matrices are random blocks of GGUF_TYPES."""
    from gguf_fixtures import write_tiny_gguf

    write_tiny_gguf(path, "qwen2", hidden=256, ffn=256, heads=4, kv_heads=2,
                    raw_types={name: int(qtype(fmt)) for name, fmt in GGUF_TYPES.items()})
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    with open(path, "r+b") as f:
        for i, (name, fmt) in enumerate(GGUF_TYPES.items()):
            t = tensors[name]
            cols, rows = (int(n) for n in t.shape)
            data = blocks(fmt, rows, cols, seed=50 + i, std=1.0 if name == "token_embd.weight" else 0.06)
            assert data.nbytes == t.n_bytes
            f.seek(t.data_offset)
            f.write(data.tobytes())


def test_gguf_of_these_formats_runs_on_both_runtimes(tmp_path, monkeypatch):
    """The compiled runtime reads the file's own blocks, the PyTorch runtime (``--backend
    native``) dequantizes them with the gguf package: their logits agree within the int8
    activation rounding of the compiled runtime (measured: differences of std 0.022 and at
    most 0.22 against logits of std 1.0, through 16 matrices), and greedy decoding gives the
    same tokens."""
    from verispec.api import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    write_formats_gguf(tmp_path / "formats.gguf")
    compiled = load_model(str(tmp_path / "formats.gguf"), backend="cpu")
    with pytest.warns(RuntimeWarning, match="dequantizing"):
        native = load_model(str(tmp_path / "formats.gguf"), backend="native", quant="none")
    assert set(GGUF_TYPES.values()) - {"bf16"} <= set(compiled.backend.formats)  # the embedding is not a layer matrix
    ids = [5, 77, 3, 200, 9, 1, 12, 40]
    logits = []
    for model in (compiled, native):
        out = model.backend.forward(torch.tensor([ids]), torch.arange(len(ids))[None], model.backend.new_cache(64))
        logits.append(out.logits[0].float())
    diff, std = (logits[0] - logits[1]).abs(), float(logits[1].std())
    assert std > 0.5 and float(diff.std()) < 0.05 * std and float(diff.max()) < 0.4 * std
    assert greedy(compiled.backend, ids, 16) == greedy(native.backend, ids, 16)


def greedy(backend, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one token per forward."""
    cache, out = backend.new_cache(64), []
    logits = backend.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits[0, -1]
    for i in range(n):
        out.append(int(logits.argmax()))
        logits = backend.forward(torch.tensor([[out[-1]]]), torch.tensor([[len(ids) + i]]), cache).logits[0, -1]
    return out


def test_file_types_and_type_ids_name_the_added_formats():
    """A GGUF's general.file_type (llama_ftype) names its main format; the PyTorch runtime runs
    low-bit files as int4, 16-bit float files unquantized."""
    from verispec.models.formats import WeightFormat

    ftypes = {gguf.LlamaFileType.MOSTLY_Q2_K: "q2_k", gguf.LlamaFileType.MOSTLY_Q3_K_M: "q3_k",
              gguf.LlamaFileType.MOSTLY_Q3_K_L: "q3_k", gguf.LlamaFileType.MOSTLY_IQ4_NL: "iq4_nl",
              gguf.LlamaFileType.MOSTLY_IQ4_XS: "iq4_xs", gguf.LlamaFileType.MOSTLY_F16: "f16",
              gguf.LlamaFileType.MOSTLY_BF16: "bf16", gguf.LlamaFileType.MOSTLY_Q5_1: "q5_1"}
    for ftype, fmt in ftypes.items():
        assert WeightFormat.from_file_type(int(ftype)) == fmt
        assert WeightFormat.from_ggml_type(int(qtype(fmt))) == fmt and WeightFormat(fmt).gguf_type == qtype(fmt)
        assert WeightFormat(fmt).pytorch == ("none" if fmt in ("f16", "bf16") else "int4" if fmt != "q5_1" else "int8")
