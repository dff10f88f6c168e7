"""Tiny models mixing the compiled runtime's weight formats (K-quants beside Q5_0 / Q8_0, a
fused QKV of three formats, GQA of 6 and 7 heads per kv head) decode bitwise alike in chains,
trees and batches, for every ISA and thread count; bad formats and shapes are refused. Each
format alone, every row of the table: test_format_table.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
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
from verispec.models.cpu_abi import FORMATS
from verispec.models.cpu_weights import quantize_matrix

if not cpu_abi.available():
    pytest.fail("the compiled runtime is not built", pytrace=False)
ISAS = available_isas()  # scalar (the reference) first


def _lib():
    lib = cpu_abi.library()
    p = ctypes.POINTER
    lib.vs_test_matmul.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, p(ctypes.c_float),
                                   ctypes.c_int, p(ctypes.c_float), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int)
    return lib


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


@pytest.mark.parametrize("mix", MIXES)
def test_paired_prefill_attention_bitwise_against_one_at_a_time(mix):
    """A prefill scores two tokens' keys at a time (attend_pair) where decoding scores one: a
    203-token prompt (4 K tiles; an odd count, so the threads' runs of tasks end on unpaired
    tokens) gives every token's hidden state bitwise as decoding it one token at a time, with
    6 and 7 query heads per kv head, 1 and 2 threads."""
    n = 203
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(7))
    for threads in (1, 2):
        model = mixed_model(mix, threads=threads)
        whole = model.forward(ids, torch.arange(n)[None], model.new_cache(n + 8), want_hidden=True)
        cache = model.new_cache(n + 8)
        for i in range(n):
            step = model.forward(ids[:, i:i + 1], torch.tensor([[i]]), cache, want_hidden=True)
            assert torch.equal(step.hidden[0, 0], whole.hidden[0, i]), f"{threads} threads, token {i}"
