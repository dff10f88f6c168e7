"""Weight formats of the compiled runtime (csrc/formats/): each format's kernels on every
ISA give the scalar reference's bits, a matrix product matches the dequantized fp32 matrix
(gguf.quants.dequantize) within the activation quantization's error, the embedding rows are
the dequantized rows, and tiny models mixing the formats (K-quants beside Q5_0 / Q8_0, a
fused QKV of three formats, GQA of 6 and 7 heads per kv head) decode bitwise alike in
chains, trees and batches, for every ISA and thread count."""

from __future__ import annotations

import ctypes

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
    runtime_dequant,
    scenario,
)

from verispec.models import cpu_abi
from verispec.models.cpu import CpuLlama
from verispec.models.cpu_abi import FORMATS
from verispec.models.cpu_weights import quantize_matrix
from verispec.models.ggml_quants import quantize

if not cpu_abi.available():
    pytest.fail("the compiled runtime is not built", pytrace=False)
ISAS = available_isas()  # scalar (the reference) first

QUANTIZED = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k")


def test_format_table_matches_ggml():
    """The library's table names every format with ggml's type id and block geometry."""
    cpu_abi.library()
    assert {"f32", *QUANTIZED} <= set(FORMATS)  # and issue 35's (test_formats_added.py)
    for name, f in FORMATS.items():
        qtype = GGMLQuantizationType[name.upper()]
        assert f.fmt.ggml_type == int(qtype)
        assert (f.block, f.block_bytes) == GGML_QUANT_SIZES[qtype]


def _lib():
    lib = cpu_abi.library()
    p = ctypes.POINTER
    lib.vs_test_matmul.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, p(ctypes.c_float),
                                   ctypes.c_int, p(ctypes.c_float), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int)
    return lib


def run_matmul(fmt: str, blocks: np.ndarray, rows: int, cols: int, x: np.ndarray, isa: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((len(x), rows), dtype=np.float32)
    err = ctypes.create_string_buffer(256)
    fp = ctypes.POINTER(ctypes.c_float)
    rc = _lib().vs_test_matmul(FORMATS[fmt].fmt.ggml_type, np.ascontiguousarray(blocks).ctypes.data, rows, cols,
                               x.ctypes.data_as(fp), len(x), out.ctypes.data_as(fp), isa.encode(), err, 256)
    assert rc == 0, err.value.decode()
    return out


def weights(fmt: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF blocks of a random matrix with rows of different scales (and an all-zero row)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2.0, (rows, 1)).astype(np.float32)
    w[rows // 2] = 0.0
    if fmt == "f32":
        return w
    if fmt == "q5_1":  # not among the library's quantizers (issue 35's format): gguf's writes it
        return gguf.quants.quantize(w, GGMLQuantizationType.Q5_1)
    return quantize(w, fmt)


def activations(T: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    x[:, :32] *= 50.0  # blocks of very different scales
    x[0, 64:96] = 0.0  # an all-zero activation block
    return x


@pytest.mark.parametrize("fmt", ["f32", *QUANTIZED])
def test_every_isa_gives_the_scalar_bits(fmt):
    """T = 11 tokens (tiles of 8 + 3 and 4 + 4 + 3) and rows = 40 (a partial last panel): every
    ISA equals the scalar reference bitwise, and a token's outputs do not depend on the others."""
    rows, cols = 40, 768
    w = weights(fmt, rows, cols, seed=1)
    x = activations(11, cols, seed=2)
    ref = run_matmul(fmt, w, rows, cols, x, "scalar")
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    for isa in ISAS:
        got = run_matmul(fmt, w, rows, cols, x, isa)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{isa} differs from scalar"
        alone = run_matmul(fmt, w, rows, cols, x[5:6], isa)
        assert np.array_equal(alone.view(np.uint32), ref[5:6].view(np.uint32)), f"{isa}: token 5 alone differs"


@pytest.mark.parametrize("fmt", [*QUANTIZED, "q5_1"])
def test_every_token_count_gives_the_scalar_bits(fmt):
    """T = 1..9 tokens (every tile width of every ISA's matmul and its remainders) and rows = 37 (a
    last panel with a partial half): every ISA equals the scalar reference bitwise."""
    rows, cols = 37, 512
    w = weights(fmt, rows, cols, seed=5)
    x = activations(9, cols, seed=6)
    ref = run_matmul(fmt, w, rows, cols, x, "scalar")  # a token's outputs do not depend on the others
    for isa in ISAS:
        for T in range(1, 10):
            got = run_matmul(fmt, w, rows, cols, x[:T], isa)
            assert np.array_equal(got.view(np.uint32), ref[:T].view(np.uint32)), f"{isa}, T = {T} differs from scalar"


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_matmul_matches_the_dequantized_matrix(fmt):
    """|W x - runtime| <= sum_k |W_k| * (its activation block's max |x|) / 254 (int8 rounding of
    x is at most half a step of max/127) + 1e-5 relative float rounding, per output."""
    rows, cols = 48, 1024
    w = weights(fmt, rows, cols, seed=3)
    wf = gguf.quants.dequantize(w, GGMLQuantizationType[fmt.upper()]).astype(np.float64)
    x = activations(5, cols, seed=4)
    exact = x.astype(np.float64) @ wf.T
    amax = np.abs(x).reshape(5, cols // 32, 32).max(-1).repeat(32, -1)  # [T, cols]
    bound = (np.abs(wf)[None] * (amax[:, None, :] / 254.0)).sum(-1) * 1.0001 + 1e-5 * (np.abs(wf)[None] * np.abs(x)[:, None, :]).sum(-1)
    for isa in ISAS:
        got = run_matmul(fmt, w, rows, cols, x, isa)
        err = np.abs(got - exact)
        assert (err <= bound + 1e-6).all(), f"{isa}: worst error {err.max():.3g} vs bound {bound[err.argmax() // rows % 5].max():.3g}"
        assert err.max() > 0 or fmt == "q8_0"  # the bound is not vacuous: quantized activations do differ


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_embedding_rows_are_the_dequantized_rows(fmt):
    rows, cols = 37, 512
    w = weights(fmt, rows, cols, seed=5)
    ref = gguf.quants.dequantize(w, GGMLQuantizationType[fmt.upper()]).astype(np.float32)
    out = runtime_dequant(fmt, w, rows, cols)
    np.testing.assert_allclose(out, ref, rtol=2e-7, atol=1e-7 * float(np.abs(ref).max()))


def test_bad_formats_and_shapes_are_refused():
    err = ctypes.create_string_buffer(256)
    x = np.zeros((1, 256), dtype=np.float32)
    out = np.zeros((1, 16), dtype=np.float32)
    fp = ctypes.POINTER(ctypes.c_float)
    blocks = np.zeros(16 * 256, dtype=np.uint8)
    assert _lib().vs_test_matmul(int(GGMLQuantizationType.IQ2_XS), blocks.ctypes.data, 16, 256, x.ctypes.data_as(fp),
                                 1, out.ctypes.data_as(fp), b"scalar", err, 256) == -1
    assert b"unsupported format" in err.value
    assert _lib().vs_test_matmul(FORMATS["q4_k"].fmt.ggml_type, blocks.ctypes.data, 16, 224, x.ctypes.data_as(fp), 1,
                                 out.ctypes.data_as(fp), b"scalar", err, 256) == -1  # 224 is not a 256-multiple


# ----------------------------------------------------------------------------- tiny models mixing the formats

VOCAB = 256


def _config(heads: int, kv: int, head_dim: int, ffn: int) -> dict:
    return {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": heads * head_dim, "intermediate_size": ffn,
            "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
            "bos_token_id": None, "eos_token_id": 1}


# (heads, kv heads, head_dim, ffn, formats of q, k, v, o, gate, up, down, head, embed)
MIXES = {
    "k-quants, 6 heads per kv head": (12, 2, 64, 512, ("q4_k", "q4_k", "q6_k", "q4_k", "q4_k", "q5_k", "q6_k",
                                                        "q6_k", "q4_k")),
    "0.5b-like, 7 heads per kv head": (14, 2, 64, 768, ("q5_0", "q5_0", "q8_0", "q5_0", "q5_0", "q5_0", "q4_k",
                                                         "q8_0", "q5_0")),
}


def mixed_model(mix: str, isa: str | None = None, threads: int = 2, max_length: int = 512) -> CpuLlama:
    heads, kv, hd, ffn, fmts = MIXES[mix]
    cfg = _config(heads, kv, hd, ffn)
    dim = heads * hd
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.08  # noqa: E731
    layers = []
    for _ in range(cfg["num_hidden_layers"]):
        q, k, v, o, gate, up, down = (quantize_matrix(rand(r, c), f) for (r, c), f in zip(
            [(dim, dim), (kv * hd, dim), (kv * hd, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)], fmts))
        layers.append({"attn_norm": 1 + rand(dim), "ffn_norm": 1 + rand(dim), "wqkv": [q, k, v], "wo": o,
                       "w13": [gate, up], "w2": down, "wqkv_bias": rand(dim + 2 * kv * hd) * 5})
    weights = {"layers": layers, "norm": 1 + rand(dim), "head": quantize_matrix(rand(VOCAB, dim) * 4, fmts[7]),
               "embed": quantize_matrix(rand(VOCAB, dim) * 10, fmts[8])}
    return CpuLlama.from_weights({**cfg, "max_position_embeddings": max_length}, weights, max_length, name=mix, isa=isa, threads=threads)


@pytest.mark.parametrize("mix", MIXES)
def test_mixed_formats_chain_tree_batch_bitwise(mix):
    """Alone == chain == tree node == batch row, bitwise, with 1 and 2 threads, across a
    64-slot K tile; and every ISA and thread count gives the scalar reference's bits."""
    model = mixed_model(mix)
    for threads in (1, 2):
        model.set_threads(threads)
        assert_chain_bitwise(model, VOCAB, prefix_len=60, k=8)
        assert_tree_bitwise(model, VOCAB, prefix_len=12)
        assert_batch_bitwise(model, VOCAB)
    ref = scenario(mixed_model(mix, "scalar", threads=1), VOCAB)
    for isa in ISAS:
        for threads in (1, 2):
            assert_same_bits(ref, scenario(mixed_model(mix, isa, threads), VOCAB), f"{isa}, {threads} threads")


def test_long_prompt_bitwise_against_one_at_a_time():
    """A 4,160-token prompt prefilled in one forward gives bitwise the hidden states and the
    last logits of decoding it one token at a time (attention over 65 K tiles, fp16 K/V)."""
    model = mixed_model("k-quants, 6 heads per kv head", max_length=4224)
    n = 4160
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(3))
    whole = model.forward(ids, torch.arange(n)[None], model.new_cache(n + 64), want_hidden=True)
    cache = model.new_cache(n + 64)
    for i in range(n):
        step = model.forward(ids[:, i:i + 1], torch.tensor([[i]]), cache, want_hidden=True)
        if i % 997 == 0 or i == n - 1:
            assert torch.equal(step.hidden[0, 0], whole.hidden[0, i]), f"token {i}"
    assert torch.equal(step.logits[0, 0], whole.logits[0, -1])
