"""A draft re-encoded at load (models.cpu_weights.requantize, csrc/formats/q4.cpp quantize_row_q4_0):
the C++ Q4_0 encoder writes ggml's bytes (gguf.quants, the reference rule), every wider
format is dequantized and re-encoded exactly so, narrower ones are kept, and a scale below
fp16's normal range is written as zero (the repack's range check holds). Q3_K and Q2_K
(csrc/formats/q3_k.cpp, q2_k.cpp; the gguf package cannot encode them) decode, by the gguf
package, to within their grids' error bounds, and rows that are not 256-multiples take Q4_0."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
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
        requantize(RawMatrix("f32", _weights(16, 64), 16, 64), "q6_k")


def _k_bound(w: np.ndarray, fmt: str) -> np.ndarray:
    """Per-weight error bound of the first-pass Q3_K / Q2_K rules (q3_k.cpp, q2_k.cpp):
    Q3_K: step s = amax / 4 per 16, d = max s / 32, |x - w| <= s + 4 d (the grid's clipped
    end, scale codes within d / 2 of s); Q2_K: step s = (max + m) / 3, min m = -min(x, 0),
    |x - w| <= s / 2 + 2 d + dmin with d = max s / 15, dmin = max m / 15. fp16 scales: x 1.001."""
    sub = w.reshape(w.shape[0], -1, 16, 16)  # [rows, super-block, sub-block, 16]
    if fmt == "q3_k":
        s = np.abs(sub).max(-1) / 4
        bound = s + 4 * s.max(-1, keepdims=True) / 32 * 1.001
    else:
        m = -np.minimum(sub.min(-1), 0)
        s = (sub.max(-1) + m) / 3
        bound = s / 2 + (2 * s.max(-1, keepdims=True) + m.max(-1, keepdims=True)) / 15 * 1.001
    return np.repeat(bound[..., None], 16, -1).reshape(w.shape) + 1e-6


@pytest.mark.parametrize("fmt", ["q3_k", "q2_k"])
@pytest.mark.parametrize("src_fmt", ["f32", "q4_k"])
def test_k_formats_decode_within_their_grid(fmt, src_fmt):
    rows, cols = 24, 512
    w = _weights(rows, cols, 2) * np.random.default_rng(3).uniform(0.01, 3, (rows, 1)).astype(np.float32)
    src = RawMatrix("f32", w, rows, cols) if src_fmt == "f32" else RawMatrix(src_fmt, quantize(w, src_fmt), rows, cols)
    x = _dequant(src) if src_fmt != "f32" else w
    out = requantize(src, fmt)
    assert out.fmt == fmt and out.data.shape == (rows, cols // 256 * GGML_QUANT_SIZES[GGMLQuantizationType[fmt.upper()]][1])
    got = gguf.quants.dequantize(out.data, GGMLQuantizationType[fmt.upper()])
    err = np.abs(got - x)
    assert (err <= _k_bound(x, fmt)).all(), f"worst {err.max():.3g}"
    # mean error against mean |x| (Gaussian rows): ~0.14 for Q3_K's 8 levels, ~0.34 for Q2_K's 4
    assert np.abs(got).max() > 0 and err.mean() < {"q3_k": 0.2, "q2_k": 0.4}[fmt] * np.abs(x).mean()


def test_k_formats_take_q4_0_where_rows_are_not_256_multiples():
    """The Qwen2.5 0.5B's 896-wide rows: Q4_0 (ggml's bytes) instead; a 256-multiple is K."""
    src = RawMatrix("q5_0", quantize(_weights(32, 896, 4), "q5_0"), 32, 896)
    for fmt in ("q3_k", "q2_k"):
        out = requantize(src, fmt)
        assert out.fmt == "q4_0" and np.array_equal(out.data, requantize(src, "q4_0").data)
    assert requantize(RawMatrix("q2_k", np.zeros((16, 84), np.uint8), 16, 256), "q3_k").fmt == "q2_k"  # narrower: kept
