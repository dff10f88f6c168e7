"""verispec.models.ggml_quants: numpy encoders for ggml's block formats.

* The legacy formats are gguf's own encoder (byte-identical).
* The K formats (Q4_K, Q5_K, Q6_K) are checked three ways:
  - layout: literal ports of ggml's ``dequantize_row_q{4,5,6}_K`` (ggml-quants.c) are first
    checked against gguf's numpy decoder on random bytes, then used to read back the integer
    codes of blocks quantized from exact grid points (d*sc*q - dmin*m), which must be the
    codes the points were built from, and re-quantizing their dequantization must give the
    same bytes (byte-exact round trip);
  - accuracy: ``gguf.quants.dequantize(quantize(x))`` stays within the per-weight error bound
    derived in the module docstring (restated in ``_k_bound``), on matrices of several shapes
    and kinds (mixed scales, zero / constant / negative-only / positive-only rows, outliers)
    and on hypothesis-generated ones;
  - errors: wrong shapes, unknown formats, non-finite or fp16-overflowing values.

Why the byte-exact round trip is only asserted on grid points: the encoder re-derives every
scale from the data's extremes, so ``quantize(dequantize(quantize(x))) == quantize(x)`` needs
each sub-block's codes to reach both ends of the grid (0 and Qmax; +-31 for Q6_K) and one
sub-block per super-block to reach the largest scale code. Random data usually satisfies that
for Q4_K but not for Q5_K / Q6_K, where rounding a small sub-block's scale code up leaves its
extreme one code short of the end (e.g. 30 of 31), so the re-derived scale is smaller.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from verispec.models import ggml_quants
from verispec.models.ggml_quants import FORMATS, QK_K, quantize

K_FORMATS = ("q4_k", "q5_k", "q6_k")
LEGACY = ("q4_0", "q4_1", "q5_0", "q8_0")
QMAX = {"q4_k": 15, "q5_k": 31}
TAU = 0.05  # the encoder's round-up slack, which the stated bounds assume


def _qtype(fmt: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[fmt.upper()]


def _dequant(b: np.ndarray, fmt: str) -> np.ndarray:
    return gguf_dequantize(b, _qtype(fmt))


# ----------------------------------------------------------------------------- reference decoders
# Literal ports of ggml-quants.c, returning integer codes per weight instead of floats, so a
# test can compare codes exactly. Slow (Python loops): a few blocks only.


def _f16(b: np.ndarray, at: int) -> float:
    return float(b[at:at + 2].view("<f2")[0])


def _get_scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return (int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
            int((q[j + 4] >> 4) | ((q[j] >> 6) << 4)))


def _ref_q45_k(block: np.ndarray, five_bits: bool):
    """One Q4_K / Q5_K block -> (d, dmin, sc[256], m[256], q[256]) per weight."""
    d, dmin, scales = _f16(block, 0), _f16(block, 2), block[4:16]
    qh, ql = (block[16:48], block[48:176]) if five_bits else (None, block[16:144])
    sc, m, q = (np.zeros(QK_K, np.int64) for _ in range(3))
    y, is_, u1, u2 = 0, 0, 1, 2
    for _ in range(0, QK_K, 64):
        sc1, m1 = _get_scale_min_k4(is_ + 0, scales)
        sc2, m2 = _get_scale_min_k4(is_ + 1, scales)
        for l in range(32):
            hi = (16 if qh[l] & u1 else 0) if five_bits else 0
            sc[y + l], m[y + l], q[y + l] = sc1, m1, (ql[l] & 0xF) + hi
        for l in range(32):
            hi = (16 if qh[l] & u2 else 0) if five_bits else 0
            sc[y + 32 + l], m[y + 32 + l], q[y + 32 + l] = sc2, m2, (ql[l] >> 4) + hi
        y, ql, is_, u1, u2 = y + 64, ql[32:], is_ + 2, u1 << 2, u2 << 2
    return d, dmin, sc, m, q


def _ref_q6_k(block: np.ndarray):
    """One Q6_K block -> (d, sc[256] (int8), q[256] (0..63)) per weight."""
    ql, qh, scales = block[0:128], block[128:192], block[192:208].view(np.int8)
    d = _f16(block, 208)
    sc, q = np.zeros(QK_K, np.int64), np.zeros(QK_K, np.int64)
    for n in range(0, QK_K, 128):
        for l in range(32):
            is_ = l // 16
            q[n + l + 0] = (ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)
            q[n + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)
            q[n + l + 64] = (ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)
            q[n + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)
            for k in range(4):
                sc[n + l + 32 * k] = scales[is_ + 2 * k]
        ql, qh, scales = ql[64:], qh[32:], scales[8:]
    return d, sc, q


def _ref_dequant_block(block: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "q6_k":
        d, sc, q = _ref_q6_k(block)
        return (np.float32(d) * sc.astype(np.float32)) * (q - 32).astype(np.float32)
    d, dmin, sc, m, q = _ref_q45_k(block, fmt == "q5_k")
    return (np.float32(d) * sc.astype(np.float32)) * q.astype(np.float32) - np.float32(dmin) * m.astype(np.float32)


def _random_blocks(fmt: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with finite, normal fp16 super-block scales."""
    b = rng.integers(0, 256, (n, FORMATS[fmt][1]), dtype=np.uint8)
    halves = rng.uniform(0.01, 2.0, (n, 2)).astype("<f2").view(np.uint8)
    if fmt == "q6_k":
        b[:, 208:210] = halves[:, :2]
    else:
        b[:, 0:4] = halves
    return b


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_reference_decoders_agree_with_gguf(fmt):
    b = _random_blocks(fmt, 3, np.random.default_rng(7))
    ours = np.stack([_ref_dequant_block(row, fmt) for row in b])
    np.testing.assert_array_equal(ours, _dequant(b, fmt))


# ----------------------------------------------------------------------------- grid points: layout, round trip


def _grid_q45_k(fmt: str, nblocks: int, rng: np.random.Generator):
    """x built from codes the encoder must recover: per super-block some sc_j = 63 and some
    m_j = 63, and every sub-block with sc_j > 0 has codes 0 and Qmax (all codes 0 when
    sc_j = 0). d and dmin are normal fp16 within a factor 10 of each other (keeps float32
    noise in x far below the encoder's rounding slack)."""
    qmax = QMAX[fmt]
    d = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), nblocks)).astype(np.float16)
    dmin = (d * np.exp(rng.uniform(np.log(0.1), np.log(10.0), nblocks))).astype(np.float16)
    sc = rng.integers(0, 64, (nblocks, 8))
    m = rng.integers(0, 64, (nblocks, 8))
    sc[np.arange(nblocks), rng.integers(0, 8, nblocks)] = 63
    m[np.arange(nblocks), rng.integers(0, 8, nblocks)] = 63
    q = rng.integers(0, qmax + 1, (nblocks, 8, 32))
    pos = np.argsort(rng.random((nblocks, 8, 32)), axis=-1)[..., :2]  # two distinct slots
    np.put_along_axis(q, pos[..., :1], 0, axis=-1)
    np.put_along_axis(q, pos[..., 1:], qmax, axis=-1)
    q[sc == 0] = 0
    d64, dmin64 = d.astype(np.float64)[:, None, None], dmin.astype(np.float64)[:, None, None]
    x = (d64 * sc[..., None] * q - dmin64 * m[..., None]).astype(np.float32)  # exact in f64, one f32 rounding
    codes = dict(d=d, dmin=dmin, sc=np.repeat(sc, 32, axis=1), m=np.repeat(m, 32, axis=1), q=q.reshape(nblocks, QK_K))
    return x.reshape(nblocks, QK_K), codes


def _grid_q6_k(nblocks: int, rng: np.random.Generator):
    """Per super-block some sc_j = 127; codes q-32 in -31..31 reaching +-31 in every sub-block
    with sc_j > 0 (q = 32 when sc_j = 0)."""
    d = np.exp(rng.uniform(np.log(1e-4), np.log(1e-1), nblocks)).astype(np.float16)
    sc = rng.integers(0, 128, (nblocks, 16))
    sc[np.arange(nblocks), rng.integers(0, 16, nblocks)] = 127
    q = rng.integers(1, 64, (nblocks, 16, 16))
    ends = rng.choice([1, 63], (nblocks, 16, 1))
    np.put_along_axis(q, rng.integers(0, 16, (nblocks, 16, 1)), ends, axis=-1)
    q[sc == 0] = 32
    x = (d.astype(np.float64)[:, None, None] * sc[..., None] * (q - 32)).astype(np.float32)  # exact
    codes = dict(d=d, sc=np.repeat(sc, 16, axis=1), q=q.reshape(nblocks, QK_K))
    return x.reshape(nblocks, QK_K), codes


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_grid_points_layout_and_byte_exact_round_trip(fmt, seed):
    rng = np.random.default_rng(seed)
    rows, per_row = 2, 2
    if fmt == "q6_k":
        x, codes = _grid_q6_k(rows * per_row, rng)
    else:
        x, codes = _grid_q45_k(fmt, rows * per_row, rng)
    x = x.reshape(rows, per_row * QK_K)

    b = quantize(x, fmt)
    assert b.dtype == np.uint8 and b.shape == (rows, per_row * FORMATS[fmt][1])
    blocks = b.reshape(-1, FORMATS[fmt][1])
    for i, block in enumerate(blocks):  # the codes, read back with ggml's own decoding
        if fmt == "q6_k":
            d, sc, q = _ref_q6_k(block)
            got, want = (d, sc, q), (float(codes["d"][i]), codes["sc"][i], codes["q"][i])
        else:
            d, dmin, sc, m, q = _ref_q45_k(block, fmt == "q5_k")
            got = (d, dmin, sc, m, q)
            want = (float(codes["d"][i]), float(codes["dmin"][i]), codes["sc"][i], codes["m"][i], codes["q"][i])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)

    y = _dequant(b, fmt)
    np.testing.assert_array_equal(y, x)  # grid points are reproduced exactly
    np.testing.assert_array_equal(quantize(y, fmt), b)  # and re-quantize to the same bytes


# ----------------------------------------------------------------------------- error bound


def _u16(v: np.ndarray) -> np.ndarray:
    """Bound on |fp16(v) - v| for 0 <= v < 65504: half an ulp, normal (2^-11 relative) or
    subnormal (2^-25 absolute)."""
    return np.maximum(v * 2.0**-11, 2.0**-25)


def _k_bound(x: np.ndarray, fmt: str) -> np.ndarray:
    """Per-weight bound on |dequantize(quantize(x)) - x|, from x alone (module docstring).

    Q4_K / Q5_K, sub-block j: (range_j + dmin/2)/(2 Qmax) + d/2 + dmin/2 + TAU Qmax d
    + 63 u(dmin) + 63 Qmax u(d), where range_j = max(x_j) - min(min(x_j), 0), dmin = max_j
    (-min(min(x_j), 0)) / 63 and d = (max_j range_j + dmin/2) / (63 Qmax), both taken at their
    upper bound after fp16 rounding. Q6_K: (s_j + d)/2 + 31 TAU d + 31*127 u(d) with
    s_j = max|x_j| / 31, d = max_j s_j / 127. Plus float32 noise of the decoder: 2^-21 of the
    super-block's largest magnitude.
    """
    tau = TAU
    blocks = x.astype(np.float64).reshape(-1, QK_K)
    noise = 2.0**-21 * np.abs(blocks).max(axis=-1, keepdims=True)
    if fmt == "q6_k":
        s = np.abs(blocks.reshape(-1, 16, 16)).max(axis=-1) / 31
        d_exact = s.max(axis=-1, keepdims=True) / 127
        d = d_exact + _u16(d_exact)
        per_sub = (s + d) / 2 + 31 * tau * d + 31 * 127 * _u16(d_exact)
        return (np.repeat(per_sub, 16, axis=1) + noise).reshape(x.shape)
    qmax = QMAX[fmt]
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)
    rng_ = sub.max(axis=-1) - lo
    dmin_exact = (-lo).max(axis=-1, keepdims=True) / 63
    dmin = dmin_exact + _u16(dmin_exact)
    d_exact = (rng_.max(axis=-1, keepdims=True) + dmin / 2) / (63 * qmax)
    d = d_exact + _u16(d_exact)
    per_sub = ((rng_ + dmin / 2) / (2 * qmax) + d / 2 + dmin / 2 + tau * qmax * d
               + 63 * _u16(dmin_exact) + 63 * qmax * _u16(d_exact))
    return (np.repeat(per_sub, 32, axis=1) + noise).reshape(x.shape)


def _check_bound(x: np.ndarray, fmt: str) -> None:
    b = quantize(x, fmt)
    assert b.dtype == np.uint8 and b.shape == (x.shape[0], x.shape[1] // QK_K * FORMATS[fmt][1])
    err = np.abs(_dequant(b, fmt).astype(np.float64) - x)
    bound = _k_bound(x, fmt)
    bad = err > bound
    assert not bad.any(), (f"{fmt}: {bad.sum()} weights over the bound, worst excess "
                           f"{(err - bound).max():.3g} at {np.unravel_index(np.argmax(err - bound), x.shape)}")


def _matrix(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    g = rng.standard_normal((rows, cols))
    if kind == "gaussian":
        x = g
    elif kind == "mixed_scale":  # every 16 weights its own scale, 1e-4 .. 1e3
        x = g * np.repeat(10.0 ** rng.uniform(-4, 3, (rows, cols // 16)), 16, axis=1)
    elif kind == "zeros":
        x = np.zeros((rows, cols))
    elif kind == "constant":  # each row one value, random sign and magnitude
        x = np.repeat(rng.choice([-1, 1], (rows, 1)) * 10.0 ** rng.uniform(-3, 2, (rows, 1)), cols, axis=1)
    elif kind == "negative_only":
        x = -np.abs(g) - 0.5
    elif kind == "positive_only":
        x = np.abs(g) + 3.0
    elif kind == "outliers":
        x = 0.01 * g
        x[rng.random((rows, cols)) < 0.005] = 50.0 * rng.choice([-1, 1])
    elif kind == "row_mix":  # zero, constant, tiny and ordinary rows in one matrix
        x = g.copy()
        x[0::4] = 0.0
        x[1::4] = -2.5
        x[2::4] *= 1e-6
    else:
        raise AssertionError(kind)
    return x.astype(np.float32)


KINDS = ("gaussian", "mixed_scale", "zeros", "constant", "negative_only", "positive_only", "outliers", "row_mix")
SHAPES = ((1, 256), (2, 512), (5, 768), (4, 2048))


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_error_within_bound(fmt, kind):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}/{kind}".encode()))
    for rows, cols in SHAPES:
        x = _matrix(kind, rows, cols, rng)
        _check_bound(x, fmt)
        if kind == "zeros":
            np.testing.assert_array_equal(_dequant(quantize(x, fmt), fmt), x)


_finite32 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@pytest.mark.parametrize("fmt", K_FORMATS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_error_within_bound_hypothesis(fmt, data):
    rows = data.draw(st.integers(1, 3), label="rows")
    cols = QK_K * data.draw(st.integers(1, 2), label="blocks per row")
    scale = data.draw(st.sampled_from([1e-6, 1e-2, 1.0, 1.0, 100.0]), label="scale")
    x = data.draw(arrays(np.float32, (rows, cols), elements=_finite32), label="x") * np.float32(scale)
    _check_bound(x, fmt)


def test_gaussian_quality():
    """Not just within a loose bound: RMSE / std on Gaussian weights (llama.cpp's searched
    scales reach about 0.07 / 0.035 / 0.018)."""
    x = np.random.default_rng(0).standard_normal((16, 2048)).astype(np.float32)
    for fmt, limit in (("q4_k", 0.09), ("q5_k", 0.045), ("q6_k", 0.022)):
        rmse = float(np.sqrt(np.mean((_dequant(quantize(x, fmt), fmt) - x) ** 2)))
        assert rmse < limit, (fmt, rmse)


# ----------------------------------------------------------------------------- formats, delegation, errors


def test_formats_table_matches_gguf():
    assert ggml_quants._ROUND_UP_SLACK == TAU
    assert set(FORMATS) == set(LEGACY) | set(K_FORMATS)
    for fmt, sizes in FORMATS.items():
        assert GGML_QUANT_SIZES[_qtype(fmt)] == sizes


@pytest.mark.parametrize("fmt", LEGACY)
def test_legacy_formats_are_gguf_bytes(fmt):
    x = _matrix("mixed_scale", 3, 512, np.random.default_rng(1))
    np.testing.assert_array_equal(quantize(x, fmt), gguf_quantize(x, _qtype(fmt)))
    assert quantize(x, fmt.upper()).shape == (3, 512 // 32 * FORMATS[fmt][1])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_wrong_shapes_raise(fmt):
    block = FORMATS[fmt][0]
    with pytest.raises(ValueError, match=rf"{fmt} needs cols to be a multiple of its block size {block}"):
        quantize(np.zeros((2, block + 16), np.float32), fmt)
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros(block, np.float32), fmt)
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros((1, 1, block), np.float32), fmt)


def test_bad_values_and_formats_raise():
    x = np.zeros((1, QK_K), np.float32)
    with pytest.raises(ValueError, match="unknown GGML format 'q3_k'"):
        quantize(x, "q3_k")
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[0, 5] = bad
        with pytest.raises(ValueError, match="non-finite"):
            quantize(y, "q4_k")
    with pytest.raises(ValueError, match="fp16"):
        quantize(np.full((1, QK_K), 1e9, np.float32) * np.arange(QK_K, dtype=np.float32), "q6_k")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_empty_matrix(fmt):
    assert quantize(np.zeros((0, 512), np.float32), fmt).shape == (0, 512 // FORMATS[fmt][0] * FORMATS[fmt][1])
