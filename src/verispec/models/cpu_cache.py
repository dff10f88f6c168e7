"""The compiled runtime's K/V (models/cpu.py): one pool of rows per ``CpuCachePool``, a request's
cache a handle on one row plus an int length (``cache_pool.py``'s contract). K is stored in
64-slot transposed tiles (csrc/vs.h: KV_TILE) so a token's scores read contiguous keys; prefix-cache
copies in and out of a row go through numpy, not torch (see ``_read_slots``).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from verispec.memory import check_fits
from verispec.models.cache_pool import CachePool, PooledCache
from verispec.models.cpu_abi import i32, library, ptr

if TYPE_CHECKING:
    from verispec.models.cpu import CpuLlama


SLOT_TILE = 64  # K cache slots per transposed tile (csrc/vs.h: KV_TILE)


GROW_FROM = 4 * SLOT_TILE  # slots a growing cache pool starts with


class CpuCachePool(CachePool):
    """K/V of ``rows`` requests, in ``owner.kv_dtype``: k [layers, rows, kv_heads, slots/64, head_dim, 64] (64-slot
    transposed tiles, so a token's scores read contiguous keys), v [layers, rows, kv_heads,
    slots, head_dim]. ``torch.empty``: slots past a request's length are never read.

    A pool sized by its caller (a server's batch) holds all ``max_length`` slots from the start;
    one that ``grow``s (``CpuLlama.new_cache`` / ``new_cache_pool`` without a length: the
    model's whole context, which a GGUF may declare as 2^24 tokens) starts small and at least
    doubles as its requests reach further, so ``generate`` holds what the request needs. Each
    allocation is checked against the memory available first (one line, not an allocator error)."""

    def __init__(self, owner: CpuLlama, rows: int, max_length: int, grow: bool = False):
        super().__init__(owner, rows, max_length)
        self._limit = -(-max_length // SLOT_TILE) * SLOT_TILE  # the slots it may grow to
        self.slots = 0
        self.reserve(min(self._limit, GROW_FROM) if grow else self._limit)

    def reserve(self, slots: int) -> None:
        """Hold at least ``slots`` slots (at most ``max_length`` rounded up to a tile), keeping the K/V held."""
        if slots <= self.slots:
            return
        new = min(self._limit, max(-(-slots // SLOT_TILE) * SLOT_TILE, 2 * self.slots))
        a, dtype = self.owner.args, self.owner.kv_dtype
        per_slot = 2 * a.n_layers * self.rows * a.n_kv_heads * a.head_dim * dtype.itemsize
        check_fits(new * per_slot, f"the K/V cache of {self.rows} x {new:,} tokens", "ask for fewer tokens")
        k = torch.empty(a.n_layers, self.rows, a.n_kv_heads, new // SLOT_TILE, a.head_dim, SLOT_TILE, dtype=dtype)
        v = torch.empty(a.n_layers, self.rows, a.n_kv_heads, new, a.head_dim, dtype=dtype)
        if self.slots:  # numpy copies, as in _read_slots
            k.numpy()[:, :, :, :self.slots // SLOT_TILE] = self.k.numpy()
            v.numpy()[:, :, :, :self.slots] = self.v.numpy()
        self.k, self.v, self.slots = k, v, new

    def _move_slots(self, row: int, src: list[int], dst_start: int) -> None:
        idx = i32(src)
        library().vs_cache_move(ctypes.byref(self.owner._cfg), self.k.data_ptr(), self.v.data_ptr(),
                                self.rows, self.slots, row, ptr(idx), len(src), dst_start)

    # prefix-cache copies go through numpy views: torch copies would wake torch's OpenMP
    # threads, which then spin on the cores the runtime's own threads need (see forward_batch)
    def _read_slots(self, row: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k [layers, kv_heads, head_dim, n] (the tiles' slot-minor order), v [layers, kv_heads, n, head_dim]."""
        k, v = self.k.numpy(), self.v.numpy()
        tiles = [k[:, row, :, t, :, lo:hi] for t, lo, hi, _ in _tile_spans(start, n)]
        return (torch.from_numpy(np.concatenate(tiles, axis=-1)),
                torch.from_numpy(v[:, row, :, start:start + n].copy()))  # a copy even where the slice is contiguous

    def _write_slots(self, row: int, start: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        k_in, v_in = (t.numpy() for t in kv)
        self.reserve(start + v_in.shape[2])
        k, v = self.k.numpy(), self.v.numpy()
        for t, lo, hi, at in _tile_spans(start, v_in.shape[2]):
            k[:, row, :, t, :, lo:hi] = k_in[..., at:at + hi - lo]
        v[:, row, :, start:start + v_in.shape[2]] = v_in


def _tile_spans(start: int, n: int) -> list[tuple[int, int, int, int]]:
    """Slots ``start .. start+n-1`` as (tile, first, end, offset in the range) per 64-slot tile.

    Example: _tile_spans(60, 8) -> [(0, 60, 64, 0), (1, 0, 4, 4)].
    """
    spans, s = [], start
    while s < start + n:
        t, lo = divmod(s, SLOT_TILE)
        hi = min(SLOT_TILE, lo + start + n - s)
        spans.append((t, lo, hi, s - start))
        s += hi - lo
    return spans


class CpuCache(PooledCache):
    """A request's view on one row of a ``CpuCachePool``."""


CpuCachePool.cache_class = CpuCache
