"""The native runtime's K/V (models/native.py): one preallocated tensor pair per pool, a
request's cache a handle on one row plus an int length (``cache_pool.py``'s contract).
Zeros, not empty: the invariant attention multiplies masked slots by an exact 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.models.cache_pool import CachePool, PooledCache

if TYPE_CHECKING:
    from verispec.models.native import NativeLlama


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class NativeCachePool(CachePool):
    """Preallocated K/V for ``rows`` requests: k, v [layers, rows, kv_heads, capacity, head_dim].

    Invariants: ``capacity >= max_length + slack`` (dummy rows of padded forwards are written
    past a request's length, never past capacity) and ``capacity % attn_chunk == 0``.
    """

    def __init__(self, owner: NativeLlama, rows: int, max_length: int):
        super().__init__(owner, rows, max_length)
        args, opts = owner.args, owner.options
        self.capacity = round_up(max_length + opts.max_rows, opts.attn_chunk)
        shape = (args.n_layers, rows, args.n_kv_heads, self.capacity, args.head_dim)
        # zeros, not empty: masked slots are multiplied by an exact 0 and must not be NaN
        self.k = torch.zeros(shape, dtype=owner.kv_dtype, device=owner.info.device)
        self.v = torch.zeros(shape, dtype=owner.kv_dtype, device=owner.info.device)

    def _move_slots(self, row: int, src: list[int], dst_start: int) -> None:
        idx = torch.tensor(src, device=self.k.device)
        dst = slice(dst_start, dst_start + len(src))
        for kv in (self.k, self.v):  # [layers, rows, Hkv, slots, D]
            kv[:, row, :, dst] = kv[:, row].index_select(2, idx)

    def _read_slots(self, row: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v [layers, Hkv, n, D]."""
        return tuple(kv[:, row, :, start:start + n].clone() for kv in (self.k, self.v))

    def _write_slots(self, row: int, start: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        for dst, src in zip((self.k, self.v), kv):  # [layers, rows, Hkv, slots, D]
            dst[:, row, :, start:start + src.shape[2]] = src


class NativeCache(PooledCache):
    """A request's view on one row of a ``NativeCachePool``."""


NativeCachePool.cache_class = NativeCache
