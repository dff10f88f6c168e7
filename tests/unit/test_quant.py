"""Weight-only quantization (models/quant.py): int4 groups reproduce Q4_1-style weights,
the packed kernels agree with dequantize-then-matmul, and row slices stay consistent."""

import pytest
import torch

from verispec.models.quant import Int4Weight, dequantize_int4, quant_linear, quantize_int4, quantize_int8


def q4_1_weights(n: int = 64, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 file stores them: per group of 32, d * q + m with q in 0..15 (both ends used)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3
    m = -d * (5 + 5 * torch.rand(n, k // 32, 1, generator=g))  # groups straddle zero, as real ones do
    return (q * d + m).reshape(n, k)


def test_int4_reproduces_q4_1_weights():
    w = q4_1_weights()
    qw = quantize_int4(w)
    deq = dequantize_int4(qw)
    assert torch.equal(deq, dequantize_int4(_unpacked(w, qw)))  # stored codes == codes recomputed
    step = (w.reshape(64, 4, 32).amax(-1) - w.reshape(64, 4, 32).amin(-1)) / 15  # Q4_1's d per group
    err = (deq - w).abs().reshape(64, 4, 32).amax(-1)
    # only the bf16 rounding of scale and zero separates them: a small fraction of one step
    # (on SmolLM2's Q4_1 weights: at most 7% of a step, 0.4% relative Frobenius error)
    assert (err <= 0.1 * step).all(), (err / step).max()


def _unpacked(w: torch.Tensor, qw: Int4Weight) -> Int4Weight:
    """The same quantization in the fallback layout (codes recomputed from scale and zero)."""
    n, k = w.shape
    scale, zero = qw.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/32]
    codes = ((w.reshape(n, k // 32, 32) - zero[..., None]) / scale[..., None] + 8).round().clamp(0, 15)
    return Int4Weight(codes.reshape(n, k).to(torch.uint8), qw.scales_zeros, 32, qw.shape, packed_kernel=False)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_kernel_matches_dequantized_matmul(rows):
    w = q4_1_weights(n=96, k=128, seed=1)
    qw = quantize_int4(w)
    if not qw.packed_kernel:
        pytest.skip("no packed int4 kernel on this device")
    ref_w = dequantize_int4(_unpacked(w, qw))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    got = quant_linear(x, qw)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    want = x.to(torch.bfloat16).float() @ ref_w.t()
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("quantize", [quantize_int4, quantize_int8])
def test_rows_slice_and_row_invariance(quantize):
    w = q4_1_weights(n=96, k=128, seed=3)
    qw = quantize(w)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(4))
    full = quant_linear(x, qw)
    assert torch.equal(quant_linear(x, qw.probe_rows(40))[:, :40], full[:, :40])
    assert torch.equal(quant_linear(x[2:3], qw), full[2:3])  # a row's result does not depend on M


def test_int4_rejects_ragged_groups():
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(8, 40))


def test_dense_prefill_path_matches_kernel():
    """A prefill may dequantize and run a float GEMM: same weights, so close to the kernel."""
    w = q4_1_weights(n=96, k=128, seed=5)
    qw = quantize_int4(w)
    x = torch.randn(1, 80, 128, generator=torch.Generator().manual_seed(6))
    dense, kernel = quant_linear(x, qw, dense=True), quant_linear(x, qw)
    torch.testing.assert_close(dense, kernel, atol=2e-2 * kernel.abs().max().item(), rtol=0)
    assert torch.equal(dense, x @ dequantize_int4(qw).t())
    assert torch.equal(quant_linear(x[:, :3], qw, dense=True), quant_linear(x[:, :3], qw))  # few rows: the kernel


@pytest.mark.parametrize("k", [160, 168, 172, 176, 184, 192])
def test_int8_runs_every_in_features(k):
    """torch's int8 kernel crashes the process for in_features not a multiple of its vector width
    (8 on AVX2, 16 on AVX-512) with two or more rows (stories260K's FFN, K = 172, under --quant
    int8): such weights dequantize instead. Either way the product is x @ (q * scale).T."""
    w = torch.randn(64, k, generator=torch.Generator().manual_seed(k))
    qw = quantize_int8(w)
    assert qw.packed_kernel == (k % 32 == 0)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    ref = (x.bfloat16() @ qw.q.to(torch.bfloat16).T).float() * qw.scales.float()
    torch.testing.assert_close(quant_linear(x, qw), ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(quant_linear(x, qw.probe_rows(3)), ref[:, :3], atol=0.05, rtol=0.02)
