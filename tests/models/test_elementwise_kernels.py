"""The element-wise kernels of every ISA against the scalar reference, bit for bit: SiLU (and its
fixed exp, which the attention's softmax shares) and the activation quantization every matrix
product's input goes through. Inputs reach each kernel's edges: the exp's clamps, ties of
round-to-nearest-even, all-zero blocks, signed zeros, denormals, huge values, and lengths that leave a
tail for the scalar code."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from tiny_models import available_isas

from verispec.models import cpu_abi

if not cpu_abi.available():
    pytest.fail("the compiled runtime is not built", pytrace=False)
ISAS = available_isas()  # scalar (the reference) first

SILU, QUANTIZE = 0, 1


def _lib():
    lib = cpu_abi.library()
    p = ctypes.POINTER
    f, i32 = p(ctypes.c_float), p(ctypes.c_int32)
    lib.vs_test_elementwise.argtypes = (ctypes.c_char_p, ctypes.c_int, f, f, ctypes.c_int, f, p(ctypes.c_int8), f, f,
                                        i32, i32, ctypes.c_char_p, ctypes.c_int)
    return lib


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def run(isa: str, which: int, a: np.ndarray, b: np.ndarray | None = None) -> dict[str, np.ndarray]:
    n = len(a)
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(a if b is None else b, dtype=np.float32)
    out = {"out": np.zeros(n, np.float32), "q": np.zeros(n, np.int8), "d": np.zeros(n // 32 + 1, np.float32),
           "s": np.zeros(n // 32 + 1, np.float32), "qsum": np.zeros(n // 32 + 1, np.int32),
           "qsum16": np.zeros(2 * (n // 32) + 2, np.int32)}
    err = ctypes.create_string_buffer(256)
    rc = _lib().vs_test_elementwise(isa.encode(), which, _ptr(a, ctypes.c_float), _ptr(b, ctypes.c_float), n,
                                    _ptr(out["out"], ctypes.c_float), _ptr(out["q"], ctypes.c_int8),
                                    _ptr(out["d"], ctypes.c_float), _ptr(out["s"], ctypes.c_float),
                                    _ptr(out["qsum"], ctypes.c_int32), _ptr(out["qsum16"], ctypes.c_int32), err, 256)
    assert rc == 0, err.value.decode()
    return out


def bits(x: np.ndarray) -> np.ndarray:
    """Float bits, every NaN as one pattern (a NaN's payload is not a result)."""
    x = x.copy()
    x[np.isnan(x)] = np.nan
    return x.view(np.uint32)


def silu_inputs(rng) -> tuple[np.ndarray, np.ndarray]:
    g = np.concatenate([rng.standard_normal(300) * scale for scale in (1e-3, 1.0, 10.0, 100.0)] +
                       [np.array([0.0, -0.0, 87.0, -87.0, 88.0, -88.0, 87.5, -87.5, 89.0, -89.0, 1e30, -1e30,
                                  np.inf, -np.inf, np.nan, 1e-40, -1e-40, 20.0, -20.0], np.float32)])
    rng.shuffle(g)
    g = np.concatenate([g, rng.standard_normal(13)])  # a tail shorter than any SIMD width
    return g.astype(np.float32), rng.standard_normal(len(g)).astype(np.float32)


def quantize_inputs(rng) -> np.ndarray:
    blocks = [rng.standard_normal(32) * scale for scale in (1e-30, 1e-3, 1.0, 1e3, 1e30)]
    blocks.append(np.zeros(32))
    blocks.append(np.where(np.arange(32) % 2, -0.0, 0.0))  # signed zeros only
    ties = np.arange(-16, 16) + 0.5  # amax 127 below: id = 1, so every x * id is a tie
    ties[0] = 127.0
    blocks.append(ties)
    blocks.append(np.full(32, -3.0))
    blocks.append(np.array([1e-40, -1e-40] * 16))  # denormals
    blocks.append(rng.standard_normal(32).clip(-3, 3) * 1e38)
    return np.concatenate(blocks).astype(np.float32)


@pytest.mark.parametrize("isa", ISAS[1:] or ["scalar"])
def test_silu_mul_bitwise(isa):
    g, u = silu_inputs(np.random.default_rng(0))
    ref, got = run("scalar", SILU, g, u)["out"], run(isa, SILU, g, u)["out"]
    assert np.isnan(ref).sum() > 0  # the NaN input stays NaN
    np.testing.assert_array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("isa", ISAS[1:] or ["scalar"])
def test_quantize_row_bitwise(isa):
    x = quantize_inputs(np.random.default_rng(1))
    ref, got = run("scalar", QUANTIZE, x), run(isa, QUANTIZE, x)
    blocks = len(x) // 32
    assert np.any(ref["q"] == 127) and np.any(ref["q"] == -127) and np.any(ref["q"] == 0)
    np.testing.assert_array_equal(got["q"], ref["q"])
    np.testing.assert_array_equal(bits(got["d"][:blocks]), bits(ref["d"][:blocks]))
    np.testing.assert_array_equal(bits(got["s"][:blocks]), bits(ref["s"][:blocks]))
    np.testing.assert_array_equal(got["qsum"][:blocks], ref["qsum"][:blocks])
    np.testing.assert_array_equal(got["qsum16"][:2 * blocks], ref["qsum16"][:2 * blocks])


def test_quantize_row_reference_values():
    """The reference itself: d = max|x| / 127, q = round-half-even(x * 127 / max|x|), sums of q."""
    x = quantize_inputs(np.random.default_rng(1))
    got = run("scalar", QUANTIZE, x)
    for b in range(len(x) // 32):
        xb = x[32 * b:32 * b + 32]
        amax = np.float32(np.abs(xb).max())
        with np.errstate(over="ignore"):  # 127 / a denormal max is inf in float32, as in the kernel
            q = np.clip(np.rint(xb * (np.float32(127.0) / amax if amax else np.float32(0))), -127, 127).astype(np.int8)
        np.testing.assert_array_equal(got["q"][32 * b:32 * b + 32], q)
        assert got["d"][b] == np.float32(amax / np.float32(127.0))
        assert got["qsum"][b] == int(q.astype(np.int32).sum())
        assert got["qsum16"][2 * b] == int(q[:16].astype(np.int32).sum())


def test_bad_arguments_are_refused():
    with pytest.raises(AssertionError, match="bad kernel or size"):
        run("scalar", QUANTIZE, np.zeros(33, np.float32))
    with pytest.raises(AssertionError, match="unknown ISA"):
        run("bogus", SILU, np.zeros(8, np.float32))
