"""Every row of the compiled runtime's format table (csrc/formats/table.cpp, read through
``vs_formats``), each checked alike: its ggml type id and block geometry, each ISA's kernels
giving the scalar reference's bits for every token count, a matrix product within the
activation quantization's error of the dequantized fp32 matrix (gguf.quants.dequantize), its
rows dequantized as the gguf package does, and its quantize slot: a format is a re-quantization
target (``vs_requantize``) exactly when its row has a ``quantize_row``. A format added to the
table is tested here with no test written for it (a format whose blocks cannot be written here
fails ``blocks``, naming it)."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tiny_models import available_isas, runtime_dequant

from verispec.models import cpu_abi
from verispec.models.cpu_abi import FORMATS
from verispec.models.cpu_weights import QUANTS, REQUANTS
from verispec.models.ggml_quants import quantize

if not cpu_abi.available():
    pytest.fail("the compiled runtime is not built", pytrace=False)
cpu_abi.library()
ROWS = tuple(str(f) for f in FORMATS)  # every row of the C++ table
ISAS = available_isas()  # scalar (the reference) first
FLOAT_ACTIVATIONS = ("f32", "f16", "bf16")  # multiplied with fp32 activations: no int8 rounding of x
# formats neither verispec's ggml_quants nor the gguf package writes: random blocks whose fp16
# scales (at these byte offsets of a block) are set so a weight is about scale x CODE_RMS
HALF_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "iq4_nl": (0,), "iq4_xs": (0,)}
CODE_RMS = {"q2_k": 20.0, "q3_k": 40.0, "iq4_nl": 70.0, "iq4_xs": 1300.0}
GGUF_WRITES = ("f16", "bf16", "q5_1")
ROUNDED_ROWS = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k")  # rows within float rounding of gguf's; the rest bitwise


def qtype(fmt: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[fmt.upper()]


def blocks(fmt: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """A random matrix in ``fmt`` (f32: float32 [rows, cols]; else uint8 [rows, row bytes]) with
    rows of different scales and one all-zero row."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.01, 2.0, (rows, 1)).astype(np.float32)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * scale
    w[rows // 2] = 0.0
    if fmt == "f32":
        return w
    if fmt in QUANTS:
        return quantize(w, fmt)
    if fmt in GGUF_WRITES:
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype(fmt))).view(np.uint8).reshape(rows, -1)
    assert fmt in HALF_FIELDS, f"format {fmt}: no way to write its blocks here (add it to HALF_FIELDS)"
    block, size = GGML_QUANT_SIZES[qtype(fmt)]
    out = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in HALF_FIELDS[fmt]:
        half = (rng.standard_normal((rows, cols // block)) * scale / CODE_RMS[fmt]).astype(np.float16)
        half[rows // 2] = 0.0
        out[:, :, at:at + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return out.reshape(rows, -1)


def dequantized(fmt: str, data: np.ndarray) -> np.ndarray:
    return data if fmt == "f32" else gguf.quants.dequantize(data, qtype(fmt)).astype(np.float32)


def activations(T: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    x[:, :32] *= 50.0  # blocks of very different scales
    x[0, 64:96] = 0.0  # an all-zero activation block
    return x


def run_matmul(fmt: str, data: np.ndarray, rows: int, cols: int, x: np.ndarray, isa: str) -> np.ndarray:
    lib = cpu_abi.library()
    fp = ctypes.POINTER(ctypes.c_float)
    lib.vs_test_matmul.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, fp, ctypes.c_int, fp,
                                   ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int)
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((len(x), rows), dtype=np.float32)
    err = ctypes.create_string_buffer(256)
    rc = lib.vs_test_matmul(FORMATS[fmt].fmt.ggml_type, np.ascontiguousarray(data).ctypes.data, rows, cols,
                            x.ctypes.data_as(fp), len(x), out.ctypes.data_as(fp), isa.encode(), err, 256)
    assert rc == 0, err.value.decode()
    return out


def test_the_table_has_the_formats_verispec_names() -> None:
    assert {"f32", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "f16", "bf16",
            "iq4_nl", "iq4_xs"} <= set(ROWS)


@pytest.mark.parametrize("fmt", ROWS)
def test_row_names_ggml_type_and_block_geometry(fmt: str) -> None:
    f = FORMATS[fmt]
    assert f.fmt.ggml_type == int(qtype(fmt)) and (f.block, f.block_bytes) == GGML_QUANT_SIZES[qtype(fmt)]


@pytest.mark.parametrize("fmt", ROWS)
def test_every_isa_and_token_count_gives_the_scalar_bits(fmt: str) -> None:
    """T = 1..11 tokens (every tile width of every ISA's matmul and its remainders), rows = 40 (a
    partial last panel): every ISA equals the scalar reference bitwise, and a token's outputs do
    not depend on the others."""
    rows, cols = 40, 768
    data = blocks(fmt, rows, cols, seed=1)
    x = activations(11, cols, seed=2)
    ref = run_matmul(fmt, data, rows, cols, x, "scalar")
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    for isa in ISAS:
        for T in (1, 2, 3, 4, 5, 7, 8, 9, 11):
            got = run_matmul(fmt, data, rows, cols, x[:T], isa)
            assert np.array_equal(got.view(np.uint32), ref[:T].view(np.uint32)), f"{isa}, T = {T} differs from scalar"
        alone = run_matmul(fmt, data, rows, cols, x[5:6], isa)
        assert np.array_equal(alone.view(np.uint32), ref[5:6].view(np.uint32)), f"{isa}: token 5 alone differs"


@pytest.mark.parametrize("fmt", ROWS)
def test_a_long_product_in_token_chunks_gives_the_scalar_bits(fmt: str) -> None:
    """A prefill-sized product: 9216 columns make the drivers cut the 61 tokens into chunks of
    16 (AVX-512) or 28 (AVX2) whose activations stay in L2 (layout.h chunk_tokens), the last one
    with a partial tile; every ISA still equals the scalar reference bitwise, token by token."""
    rows, cols, T = 40, 9216, 61
    data = blocks(fmt, rows, cols, seed=5)
    x = activations(T, cols, seed=6)
    ref = run_matmul(fmt, data, rows, cols, x, "scalar")
    for isa in ISAS:
        got = run_matmul(fmt, data, rows, cols, x, isa)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{isa} differs from scalar"


@pytest.mark.parametrize("fmt", ROWS)
def test_matmul_matches_the_dequantized_matrix(fmt: str) -> None:
    """|W x - runtime| <= sum_k |W_k| * (its activation block's max |x|) / 254 (int8 rounding of
    x: half a step of max/127; none for formats multiplied with fp32 activations) + 1e-5 relative
    float rounding, per output."""
    rows, cols = 48, 1024
    data = blocks(fmt, rows, cols, seed=3)
    wf = dequantized(fmt, data).astype(np.float64)
    x = activations(5, cols, seed=4)
    exact = x.astype(np.float64) @ wf.T
    amax = np.abs(x).reshape(5, cols // 32, 32).max(-1).repeat(32, -1)  # [T, cols]
    rounding = 1e-5 * (np.abs(wf)[None] * np.abs(x)[:, None, :]).sum(-1)
    act = 0.0 if fmt in FLOAT_ACTIVATIONS else (np.abs(wf)[None] * (amax[:, None, :] / 254.0)).sum(-1) * 1.0001
    for isa in ISAS:
        err = np.abs(run_matmul(fmt, data, rows, cols, x, isa) - exact)
        assert (err <= act + rounding + 1e-6).all(), f"{isa}: worst error {err.max():.3g}"


@pytest.mark.parametrize("fmt", ROWS)
def test_rows_dequantize_as_the_gguf_package_does(fmt: str) -> None:
    """The embedding lookup's rows (repacked into panels, then each row dequantized)."""
    rows, cols = 37, 512
    data = blocks(fmt, rows, cols, seed=5)
    ref = dequantized(fmt, data)
    got = runtime_dequant(fmt, data, rows, cols)
    assert np.abs(ref).max() > 0
    if fmt in ROUNDED_ROWS:  # d * q in another order than numpy's
        np.testing.assert_allclose(got, ref, rtol=2e-7, atol=1e-7 * float(np.abs(ref).max()))
    else:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("fmt", ROWS)
def test_a_row_is_a_requantization_target_exactly_when_it_has_an_encoder(fmt: str) -> None:
    """``vs_requantize`` picks the encoder from the destination's row (its quantize slot): f32 rows
    re-encoded into a format with one decode near the source; into any other, refused."""
    lib = cpu_abi.library()
    rows, cols = 16, 512
    w = blocks("f32", rows, cols, seed=6)
    out = np.zeros((rows, FORMATS[fmt].row_bytes(cols)), dtype=np.uint8)
    err = ctypes.create_string_buffer(256)
    rc = lib.vs_requantize(FORMATS[fmt].fmt.ggml_type, FORMATS["f32"].fmt.ggml_type, w.ctypes.data, rows, cols,
                           out.ctypes.data, 1, err, 256)
    assert (rc == 0) == FORMATS[fmt].quantizes == (fmt in REQUANTS), err.value.decode()
    if rc == 0:
        got = dequantized(fmt, out)
        assert np.abs(got - w).mean() < 0.4 * np.abs(w).mean()  # Q2_K's 4 levels: ~0.34
