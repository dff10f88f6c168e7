"""Weight-only quantized linears for the native runtime (models/native.py).

* ``int8``: symmetric per-output-channel, ``w ≈ q * scale[:, None]`` (torch's
  ``_weight_int8pack_mm``).
* ``int4``: asymmetric groups of 32 input features, ``w ≈ q * scale + min`` with q in 0..15,
  the layout of GGUF's Q4_1 (so a Q4_1 file's weights are reproduced up to the rounding of
  the bf16 scales), run by torch's ``_weight_int4pack_mm_for_cpu`` (gpt-fast's int4 scheme).

Both kernels read 1 byte (int8) or half a byte (int4) per weight instead of 4 (fp32), take
bf16 activations, and on the CPUs we measured compute every output row with the same
instruction sequence whatever the number of rows, so the runtime's batch invariance is
kept (``NativeLlama`` re-checks that at load time). Activations of another dtype are cast
to bf16 for the product and the result cast back. Where a kernel is missing (for example
CUDA builds, whose int4 packing differs) we dequantize on the fly: exact, not faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KERNEL_DTYPE = torch.bfloat16  # activation dtype of the packed kernels
# the int8 kernel runs only where in_features is a multiple of this (quantize_int8): torch's AVX2 path reads K in
# 8-wide vectors, its AVX-512 path in 16-wide ones; 32 leaves room for a wider path (every real model's K is)
INT8_PACK_K = 32


@dataclass(frozen=True)
class Int8Weight:
    """An int8 weight matrix with one scale per output channel (row)."""

    q: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bf16
    packed_kernel: bool  # True: torch._weight_int8pack_mm works on this device

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * self.scales.element_size()

    def probe_rows(self, n: int) -> Int8Weight:
        """A cheaper weight whose outputs start with the first n output features."""
        return Int8Weight(self.q[:n], self.scales[:n], self.packed_kernel)


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit weight matrix, groups of ``group_size`` input features with a scale and a min.

    ``packed`` is the kernel's layout ([N, K/2] uint8 on CPU) when ``packed_kernel``, else the
    unpacked codes [N, K] uint8. ``scales_zeros`` [K/g, N, 2] bf16 holds (scale, min + 8 scale),
    the kernel's convention ``w = (q - 8) * scale + zero``. ``codes`` [N, K] uint8 (beside a
    packed kernel) lets a prefill dequantize for a float GEMM: the int kernel's cost grows
    linearly with the rows, so at hundreds of rows fp32 GEMM wins by ~2x on this CPU.
    """

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    group_size: int
    shape: torch.Size  # [N, K]
    packed_kernel: bool
    codes: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads (``codes`` are read by prefills only)."""
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def probe_rows(self, n: int) -> Int4Weight:
        """A cheaper weight whose outputs start with the first n output features (the packed
        CPU layout interleaves blocks of rows and cannot be sliced: it is returned whole)."""
        if self.packed_kernel:
            return self
        return Int4Weight(self.packed[:n], self.scales_zeros[:, :n], self.group_size,
                          torch.Size((n, self.shape[1])), self.packed_kernel)


QuantWeight = Int8Weight | Int4Weight


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Quantize ``w`` [N, K] per output row."""
    w32 = w.float()
    scales = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
    q = torch.round(w32 / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    scales = scales.to(KERNEL_DTYPE)
    # torch's CPU kernel reads K in 8- (AVX2) or 16-wide (AVX-512) vectors: for other K it reads past the rows
    # and, with two or more activation rows, crashes the process (torch 2.13: K = 172, stories260K's FFN, on
    # AVX2; K = 168 on AVX-512), which no probe can catch: such K dequantize instead (exact, not faster)
    packed = w.shape[1] % INT8_PACK_K == 0 and _works(lambda x: torch._weight_int8pack_mm(x, q, scales), q)
    return Int8Weight(q=q, scales=scales, packed_kernel=packed)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Quantize ``w`` [N, K] in groups of ``group_size`` along K: min/max per group, 16 levels."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: in_features {k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    # round scale and zero to the kernel's bf16 first, then pick each code against them
    scales = ((hi - lo) / 15).clamp(min=1e-10).to(KERNEL_DTYPE)
    zeros = (lo + 8 * scales.float()).to(KERNEL_DTYPE)
    q = ((g - zeros.float()[..., None]) / scales.float()[..., None] + 8).round().clamp(0, 15)
    q = q.reshape(n, k).to(torch.int32)
    sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.cpu(), 1).to(w.device)
        ok = w.device.type == "cpu" and _works(
            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz), q)
    except (RuntimeError, NotImplementedError, AttributeError):
        ok = False
    codes = q.to(torch.uint8)
    return Int4Weight(packed, sz, group_size, torch.Size((n, k)), True, codes) if ok else \
        Int4Weight(codes, sz, group_size, torch.Size((n, k)), False)


DENSE_MIN_ROWS = 64  # a dense prefill pays one dequantization per weight: worth it from here


def quant_linear(x: torch.Tensor, w: QuantWeight, dense: bool = False) -> torch.Tensor:
    """``x @ dequant(w).T`` for x [..., K] -> [..., N] in x's dtype. ``dense`` (prefills):
    dequantize an int4 weight and run a float GEMM when there are enough rows."""
    if dense and isinstance(w, Int4Weight) and w.codes is not None and x.numel() // x.shape[-1] >= DENSE_MIN_ROWS:
        return F.linear(x, _dequantize(w.codes, w).to(x.dtype))
    x2 = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)
    if isinstance(w, Int8Weight):
        out = (torch._weight_int8pack_mm(x2, w.q, w.scales) if w.packed_kernel
               else F.linear(x2, w.q.to(x2.dtype)) * w.scales)
    elif w.packed_kernel:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, w.group_size, w.scales_zeros)
    else:
        out = F.linear(x2, dequantize_int4(w).to(x2.dtype))
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The float32 [N, K] matrix an unpacked ``Int4Weight`` stands for."""
    if w.packed_kernel and w.codes is None:
        raise ValueError("dequantize_int4 needs the unpacked codes")
    return _dequantize(w.codes if w.packed_kernel else w.packed, w)


def _dequantize(codes: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    n, k = w.shape
    scale, zero = w.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/g] each
    q = codes.float().reshape(n, k // w.group_size, w.group_size) - 8
    return (q * scale[..., None] + zero[..., None]).reshape(n, k)


def _works(kernel, q: torch.Tensor) -> bool:
    """Capability probe: does this torch build run ``kernel`` on this device?"""
    try:
        kernel(torch.zeros(1, q.shape[1], dtype=KERNEL_DTYPE, device=q.device))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True
