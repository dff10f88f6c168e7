"""Weight-only int8 linears for the native runtime (models/native.py).

Symmetric per-output-channel quantization: ``w ≈ q * scale[:, None]`` with ``q`` int8.
Activations stay in the compute dtype (bf16). On CPU the product runs in torch's
``_weight_int8pack_mm`` kernel, which reads 1 byte per weight instead of 2 (bf16) or 4 (fp32)
and, on the CPUs we measured, computes every output row with the same instruction
sequence whatever the number of rows (so the batch-invariance property of the runtime is
kept; ``NativeLlama`` re-checks that at load time). Where that kernel is missing (for
example some CUDA builds) we dequantize on the fly, which is exact but not faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Int8Weight:
    """An int8 weight matrix with one scale per output channel (row)."""

    q: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] compute dtype
    packed_kernel: bool  # True: torch._weight_int8pack_mm works on this device/dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * self.scales.element_size()


def quantize_int8(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
    """Quantize ``w`` [N, K] per output row; ``dtype`` is the activation/compute dtype."""
    w32 = w.float()
    scales = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
    q = torch.round(w32 / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    scales = scales.to(dtype)
    return Int8Weight(q=q, scales=scales, packed_kernel=_packed_kernel_works(q, scales))


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """``x @ dequant(w).T`` for x [..., K] in the scales' dtype -> [..., N]."""
    if w.packed_kernel:
        out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), w.q, w.scales)  # [M, N]
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return F.linear(x, w.q.to(x.dtype)) * w.scales


def _packed_kernel_works(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Capability probe: does this torch build have the packed int8 kernel for this device?"""
    x = torch.zeros(1, q.shape[1], dtype=scales.dtype, device=q.device)
    try:
        torch._weight_int8pack_mm(x, q, scales)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True
