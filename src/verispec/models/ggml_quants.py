"""fp32 matrices -> GGML quantized blocks, with numpy, including the K formats.

``quantize(x, fmt)`` turns a float32 ``[rows, cols]`` matrix into the uint8
``[rows, cols // block * block_bytes]`` bytes of ggml's block format ``fmt``: the row-major
tensor data of a GGUF file, which ``gguf.quants.dequantize`` (or llama.cpp) decodes.

* ``q4_0``, ``q4_1``, ``q5_0``, ``q8_0`` (blocks of 32) are delegated to
  ``gguf.quants.quantize``, so they match what the gguf package writes.
* ``q4_k``, ``q5_k``, ``q6_k`` (super-blocks of QK_K = 256), which the gguf package can decode
  but not encode, are quantized here. The byte layouts are exactly ggml's (``block_q4_K``,
  ``block_q5_K``, ``block_q6_K`` in ggml-common.h). The *choice* of scales is a plain
  min/max (Q4_K, Q5_K) or abs-max (Q6_K) rule, not llama.cpp's iterative search
  (``make_qkx2_quants`` / ``make_qx_quants``, optionally importance-weighted), so the bytes
  differ from llama-quantize's and the error is somewhat larger, but every weight has a
  guaranteed error bound (below).

Everything is vectorized over blocks; large matrices are processed in chunks of
``_CHUNK_BLOCKS`` super-blocks to bound the float64 temporaries.

Layouts (QK_K = 256 weights per super-block)
--------------------------------------------
Q4_K, 144 bytes: ``d`` fp16, ``dmin`` fp16, ``scales[12]``, ``qs[128]``. Eight sub-blocks j
of 32 weights, each with a 6-bit scale ``sc[j]`` and a 6-bit min ``m[j]``;
``w = d*sc[j]*q - dmin*m[j]``, q in 0..15. ``scales`` packs sc and m as ggml's
``get_scale_min_k4`` reads them: for j < 4, bytes j and j+4 hold sc[j] and m[j] in their low 6
bits; for j >= 4, byte j+4 holds sc[j] & 15 (low nibble) and m[j] & 15 (high nibble), and the
top 2 bits of bytes j-4 and j hold bits 4-5 of sc[j] and m[j]. ``qs`` is four chunks of 32
bytes, one per 64 weights: byte l of chunk c holds weight 64c+l (sub-block 2c) in its low
nibble and weight 64c+32+l (sub-block 2c+1) in its high nibble.

Q5_K, 176 bytes: ``d``, ``dmin``, ``scales[12]`` as Q4_K, then ``qh[32]``, ``qs[128]``; q in
0..31. ``qs`` holds the low 4 bits as in Q4_K; bit j of ``qh[l]`` is bit 4 of weight 32j+l
(sub-block j, position l).

Q6_K, 210 bytes: ``ql[128]``, ``qh[64]``, ``scales[16]`` (int8), ``d`` fp16 last. Sixteen
sub-blocks of 16; ``w = d*scales[i//16]*(q-32)``, q in 0..63. Each half h of 128 weights
uses ``ql[64h:64h+64]`` and ``qh[32h:32h+32]``; for l in 0..31, the weights l, l+32, l+64,
l+96 of the half take their low 4 bits from the low nibble of ql[l], the low nibble of
ql[l+32], the high nibble of ql[l], the high nibble of ql[l+32], and their high 2 bits from
bits 0-1, 2-3, 4-5, 6-7 of qh[l].

Quantization rules and error bounds
-----------------------------------
Notation: ``u(v) = max(v * 2**-11, 2**-25)`` bounds the error of rounding a non-negative
float to fp16 (half an ulp, normal or subnormal); ``TAU = _ROUND_UP_SLACK = 0.05``.

Q4_K / Q5_K (Qmax = 15 / 31), per sub-block j: ``lo = min(min(x), 0)``, ``hi = max(x)``,
``M_j = -lo >= 0``. Per super-block ``dmin = fp16(max_j M_j / 63)``,
``m_j = round(M_j / dmin)`` (so the offset ``M'_j = dmin*m_j`` is within dmin/2 of M_j).
The range the codes must then cover is ``R_j = max(hi + M'_j, 0)``;
``d = fp16(max_j R_j / (63*Qmax))`` and ``sc_j = ceil(R_j / (Qmax*d) - TAU)``, clipped to 0..63:
rounding the scale *up* (unless it is within TAU of the integer below) keeps the top of the
sub-block inside the grid, where rounding to nearest could clip up to Qmax*d/2. Finally
``q = round((x + M'_j) / (d*sc_j))`` clipped to 0..Qmax (q = 0 where d*sc_j == 0). Checking
the three cases (code inside 0..Qmax, clipped at 0, clipped at Qmax) gives, for every weight of
sub-block j with ``range_j = hi - lo``::

    |x - w| <= (range_j + dmin/2) / (2*Qmax) + d/2 + dmin/2 + TAU*Qmax*d
               + 63*u(dmin) + 63*Qmax*u(d)

i.e. half a step of the sub-block's own grid, plus about half a unit of each super-block scale
(d, dmin are at most 1/63 of the largest sub-block step and min), plus fp16 rounding terms that
only matter when d or dmin is subnormal in fp16 (super-block ranges below about 0.06).

Q6_K, per sub-block j of 16: ``s_j = max|x| / 31``; ``d = fp16(max_j s_j / 127)``;
``sc_j = ceil(s_j / d - TAU)`` clipped to 0..127 (so scales are never negative);
``q = round(x / (d*sc_j)) + 32`` clipped to 0..63 (q = 32 where d*sc_j == 0). Bound::

    |x - w| <= (s_j + d) / 2 + 31*TAU*d + 31*127*u(d)

Limits: the super-block scales are fp16, so a super-block whose d or dmin would exceed 65504
(ranges beyond roughly 6e7) raises ValueError; tiny ranges lose relative precision to fp16
subnormals, as in ggml. Non-finite inputs raise ValueError.

Idempotence: ``quantize(dequantize(quantize(x)))`` equals ``quantize(x)`` only when every
sub-block's codes reach both ends of the grid (and a sub-block reaches the super-block's
maximum scale 63 / 127), since the rules above re-derive the scales from the data's extremes;
for grids of that form the re-quantization is byte-exact (see tests/unit/test_ggml_quants.py).
"""

from __future__ import annotations

import numpy as np

from verispec.models.formats import WeightFormat

QK_K = 256

W = WeightFormat
# fmt -> (weights per block, bytes per block); equal to gguf.GGML_QUANT_SIZES for these types.
FORMATS: dict[WeightFormat, tuple[int, int]] = {
    W.Q4_0: (32, 18),
    W.Q4_1: (32, 20),
    W.Q5_0: (32, 22),
    W.Q8_0: (32, 34),
    W.Q4_K: (QK_K, 144),
    W.Q5_K: (QK_K, 176),
    W.Q6_K: (QK_K, 210),
}

_GGUF_DELEGATED = (W.Q4_0, W.Q4_1, W.Q5_0, W.Q8_0)
del W

# A scale code is rounded up unless the exact ratio is within this of the integer below (see the
# module docstring): keeps data inside the grid while letting an already exact scale (e.g. a
# dequantized block's) map to itself despite float noise. Must exceed that noise (~1e-6).
_ROUND_UP_SLACK = 0.05

_CHUNK_BLOCKS = 1 << 14  # super-blocks per vectorized step (4M weights, ~32 MB float64 temporaries)


def quantize(x: np.ndarray, fmt: WeightFormat | str) -> np.ndarray:
    """Quantize float32 ``x`` [rows, cols] to ggml format ``fmt`` (a key of ``FORMATS``).

    Returns uint8 [rows, cols // block * block_bytes]: each row's blocks, in order, in ggml's
    byte layout. Raises ValueError for an unknown format, a non-2-D input, cols not a multiple
    of the block size, non-finite values, or K-format super-block scales beyond fp16's range.
    """
    if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
        raise ValueError(f"unknown GGML format {fmt!r}; expected one of {sorted(FORMATS)}")
    key = WeightFormat(fmt.lower())
    block, nbytes = FORMATS[key]
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{key} quantization expects a 2-D [rows, cols] matrix, got shape {x.shape}")
    rows, cols = x.shape
    if cols % block:
        raise ValueError(f"{key} needs cols to be a multiple of its block size {block}, "
                         f"got shape {x.shape} ({cols} % {block} = {cols % block})")
    if not np.isfinite(x).all():
        raise ValueError(f"cannot quantize non-finite values (nan or inf) to {key}")
    out_shape = (rows, cols // block * nbytes)
    if x.size == 0:
        return np.zeros(out_shape, dtype=np.uint8)

    if key in _GGUF_DELEGATED:
        from gguf.quants import quantize as gguf_quantize

        return gguf_quantize(np.ascontiguousarray(x), key.gguf_type)

    encode = {WeightFormat.Q4_K: _q4_k_blocks, WeightFormat.Q5_K: _q5_k_blocks, WeightFormat.Q6_K: _q6_k_blocks}[key]
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], nbytes), dtype=np.uint8)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start:start + _CHUNK_BLOCKS].astype(np.float64)
        out[start:start + chunk.shape[0]] = encode(chunk)
    return out.reshape(out_shape)


# ----------------------------------------------------------------------------- helpers


def _fp16(v: np.ndarray, what: str) -> np.ndarray:
    """Round non-negative super-block scales to fp16 (nearest), refusing overflow."""
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    if np.isinf(h).any():
        raise ValueError(f"values too large for the fp16 super-block scale {what} "
                         f"(needs {float(v.max()):.4g} > 65504)")
    return h


def _div_or_zero(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den == 0."""
    safe = np.where(den == 0, 1.0, den)
    return np.where(den == 0, 0.0, num / safe)


def _scale_codes(need: np.ndarray, unit: np.ndarray, hi: int) -> np.ndarray:
    """ceil(need / unit - slack) in 0..hi (0 where unit == 0): the smallest code whose scale
    covers ``need``, tolerating float noise on exact multiples."""
    code = np.ceil(_div_or_zero(need, unit) - _ROUND_UP_SLACK)
    return np.clip(code, 0, hi)


def _u8(a: np.ndarray) -> np.ndarray:
    return a.astype(np.uint8)


# ----------------------------------------------------------------------------- Q4_K / Q5_K


def _asym_k(blocks: np.ndarray, qmax: int):
    """Shared Q4_K/Q5_K quantizer. blocks float64 [n, 256] -> d, dmin (float16 [n]),
    sc, m (uint8 [n, 8]), q (uint8 [n, 256], 0..qmax)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    mins = -lo  # >= 0: ggml subtracts dmin*m, so only a non-positive offset is representable

    dmin = _fp16(mins.max(axis=-1) / 63.0, "dmin")
    dmin64 = dmin.astype(np.float64)[:, None]
    m = np.clip(np.rint(_div_or_zero(mins, dmin64)), 0, 63)
    offset = dmin64 * m  # M'_j, the min actually stored

    need = np.maximum(hi + offset, 0.0)  # R_j: the span the codes 0..qmax must cover
    d = _fp16(need.max(axis=-1) / (63.0 * qmax), "d")
    d64 = d.astype(np.float64)[:, None]
    sc = _scale_codes(need, d64 * qmax, 63)
    step = d64 * sc  # d*sc_j, the stored step

    q = np.rint(_div_or_zero(sub + offset[..., None], step[..., None]))
    q = np.clip(q, 0, qmax)
    return d, dmin, _u8(sc), _u8(m), _u8(q).reshape(n, QK_K)


def _pack_scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m uint8 [n, 8] (6-bit) -> [n, 12] in get_scale_min_k4's layout."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _pack_nibbles_k(q: np.ndarray) -> np.ndarray:
    """q [n, 256] -> qs [n, 128]: chunk c byte l = weight 64c+l | weight 64c+32+l << 4."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    """float16 [n] -> its little-endian bytes [n, 2]."""
    return h.astype("<f2").view(np.uint8).reshape(-1, 2)


def _q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asym_k(blocks, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, m), _pack_nibbles_k(q)], axis=1)


def _q5_k_blocks(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asym_k(blocks, 31)
    high = (q >> 4).reshape(-1, 8, 32)  # [n, sub-block j, l]: bit 4 of weight 32j + l
    qh = (high << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)  # disjoint bits: sum == or
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, m), qh, _pack_nibbles_k(q)], axis=1)


# ----------------------------------------------------------------------------- Q6_K


def _q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    s = np.abs(sub).max(axis=-1) / 31.0  # step putting the sub-block's abs max at +-31
    d = _fp16(s.max(axis=-1) / 127.0, "d")
    d64 = d.astype(np.float64)[:, None]
    sc = _scale_codes(s, d64, 127)  # int8 scales, kept non-negative
    step = d64 * sc
    q = np.clip(np.rint(_div_or_zero(sub, step[..., None])), -32, 31) + 32
    q = _u8(q).reshape(n, 2, 4, 32)  # [half h, quarter k, l]: weight 128h + 32k + l

    ql = np.concatenate([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),   # ql[l]
                         (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)],  # ql[l + 32]
                        axis=-1).reshape(n, 128)
    hb = q >> 4
    qh = (hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)).reshape(n, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, _f16_bytes(d)], axis=1)
