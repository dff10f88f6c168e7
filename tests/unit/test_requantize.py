"""A draft re-encoded at load (models.cpu_weights.requantize, csrc/formats/q4.cpp quantize_row_q4_0):
the C++ Q4_0 encoder writes ggml's bytes (gguf.quants, the reference rule), every wider
format is dequantized and re-encoded exactly so, narrower ones are kept, and a scale below
fp16's normal range is written as zero (the repack's range check holds)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import runtime_dequant

from verispec.models import cpu_abi
from verispec.models.cpu_abi import FORMATS
from verispec.models.cpu_weights import RawMatrix, requantize
from verispec.models.ggml_quants import quantize

if not cpu_abi.available():
    pytest.fail("the compiled runtime is not built", pytrace=False)


def _dequant(m: RawMatrix) -> np.ndarray:
    return runtime_dequant(m.fmt, m.data, m.rows, m.cols)


def _signless_zero_scales(q4: np.ndarray) -> np.ndarray:
    """Q4_0 bytes with a -0 scale written +0: an all-zero block's d is -0 or +0 depending on
    the zeros' signs, and ggml's C rule (running max from +0) and gguf's numpy (the block's own
    zero) pick the sign differently; either decodes to zeros."""
    q = q4.reshape(-1, 18).copy()
    q[(q[:, 0] == 0) & (q[:, 1] == 0x80), 1] = 0
    return q.reshape(q4.shape)


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[3, :32] = 0.0  # an all-zero block
    w[5, 32:64] = -w[5, 32:64]  # blocks whose largest magnitude is negative as well as positive
    return w


@pytest.mark.parametrize("rows,cols", [(37, 256), (16, 4864)])
def test_q4_0_bytes_are_ggmls(rows, cols):
    w = _weights(rows, cols)
    out = requantize(RawMatrix("f32", w, rows, cols))
    assert out.fmt == "q4_0"
    assert np.array_equal(out.data, quantize(w, "q4_0"))


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_1", "q6_k", "q5_k"])
def test_wider_formats_are_dequantized_then_encoded(fmt):
    """Each source row is read as the runtime reads it (vs_test_dequant), then encoded:
    the bytes equal ggml's Q4_0 of those values, and fewer bytes stream per weight."""
    rows, cols = 40, 512
    src = RawMatrix(fmt, quantize(_weights(rows, cols, 1), fmt), rows, cols)
    released = []
    src = RawMatrix(src.fmt, src.data, rows, cols, release=lambda: released.append(True))
    out = requantize(src)
    assert out.fmt == "q4_0" and out.data.shape == (rows, cols // 32 * 18)
    assert np.array_equal(_signless_zero_scales(out.data), _signless_zero_scales(quantize(_dequant(src), "q4_0")))
    assert released == [True]  # the source pages are given back once read
    assert FORMATS["q4_0"].row_bytes(cols) < FORMATS[fmt].row_bytes(cols)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_formats_as_narrow_are_kept(fmt):
    src = RawMatrix(fmt, quantize(_weights(16, 256), fmt), 16, 256)
    assert requantize(src) is src


def test_scales_below_fp16_normal_range_are_zero():
    """A block of weights all below ~5e-4 would need a subnormal fp16 scale, which the Q4_0
    repack refuses: it is written as an all-zero block (d = 0, every q = 8) and the matrix
    loads; other blocks keep ggml's bytes."""
    w = _weights(16, 64)
    w[0, :32] = 1e-5
    out = requantize(RawMatrix("f32", w, 16, 64))
    assert out.data[0, :2].tobytes() == b"\0\0" and (out.data[0, 2:18] == 0x88).all()
    assert np.array_equal(out.data[1:], quantize(w, "q4_0")[1:])
    assert np.array_equal(out.data[0, 18:], quantize(w, "q4_0")[0, 18:])
    assert (_dequant(out)[0, :32] == 0).all()


def test_unknown_requantization_is_refused():
    with pytest.raises(ValueError, match="unknown requantization"):
        requantize(RawMatrix("f32", _weights(16, 64), 16, 64), "q2_k")
